"""`util.filesystem`: the filesystem type of a path from mountinfo (the embedded store refuses network/FUSE ones)."""

import os

from kvledger.util.filesystem import filesystem_type, is_network_type, parse_mountinfo

MOUNTINFO = """\
22 1 252:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
35 22 0:53 / /mnt/jfs\\040one rw,relatime shared:20 - fuse.juicefs JuiceFS:kvl rw,user_id=0
36 22 0:60 / /mnt/nfs rw,relatime shared:21 master:3 - nfs4 srv:/export rw,vers=4.2
garbage line
"""


def test_mountinfo_lines_are_parsed_with_escapes_and_optional_fields():
    entries = parse_mountinfo(MOUNTINFO)
    assert [(e.mount_point, e.dev, e.fstype) for e in entries] == [
        ("/", (252, 1), "ext4"), ("/mnt/jfs one", (0, 53), "fuse.juicefs"), ("/mnt/nfs", (0, 60), "nfs4")]


def test_a_path_is_judged_by_its_device_else_by_the_longest_mount_point_above_it(tmp_path):
    st = os.stat(tmp_path)
    fuse = MOUNTINFO + f"40 22 {os.major(st.st_dev)}:{os.minor(st.st_dev)} / /elsewhere rw - fuse.juicefs x rw\n"
    assert filesystem_type(tmp_path / "not" / "yet", fuse) == "fuse.juicefs"   # nearest existing folder
    nodev = f"1 1 4095:1 / / rw - ext4 a rw\n2 1 4095:2 / {tmp_path} rw - nfs4 b rw\n"   # (btrfs subvolumes)
    assert filesystem_type(tmp_path / "x", nodev) == "nfs4"
    assert filesystem_type(tmp_path, "") is None


def test_network_and_fuse_types():
    for t in ("fuse.juicefs", "fuse", "nfs", "nfs4", "ceph", "cifs", "9p", "lustre"):
        assert is_network_type(t), t
    for t in ("ext4", "xfs", "btrfs", "tmpfs", "zfs", "overlay"):
        assert not is_network_type(t), t
    assert not is_network_type(filesystem_type("/proc/self") or "proc")
