"""Which filesystem a path lies on, from /proc/self/mountinfo: the embedded store's LMDB index must stay on a local one.

A mountinfo line (proc(5)); fields 5 and 9 are the ones read here, octal escapes (`\\040`) undone:

    36 35 98:0 /mnt1 /mnt/parent rw,noatime master:1 - ext4 /dev/root rw,errors=continue
    |  |  |    |     |                               |   |
    id |  dev  root  mount point                     sep fstype

The mount a path is on: the latest line whose device is the path's `st_dev` (bind mounts of one device share
a type), else (btrfs subvolumes report devices mountinfo does not list) the longest mount point above the
resolved path. A path that does not exist yet is judged by its nearest existing folder.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

MOUNTINFO = Path("/proc/self/mountinfo")
# Filesystems whose files other machines (or a user-space daemon) serve: locks and mmap coherence do not hold
# there as LMDB needs them; "fuse" and every "fuse.*" (JuiceFS is "fuse.juicefs")
NETWORK_TYPES = frozenset({"nfs", "nfs4", "ceph", "cifs", "smb3", "smbfs", "9p", "lustre", "gpfs", "afs",
                           "beegfs", "glusterfs", "fuse", "fuseblk"})
_ESCAPE = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True, slots=True)
class MountEntry:
    """One line of mountinfo: the mount point, its device (major, minor) and its filesystem type."""

    mount_point: str
    dev: tuple[int, int]
    fstype: str


def _unescape(field: str) -> str:
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[MountEntry]:
    """The entries of a mountinfo text, in its order (later mounts last); malformed lines are skipped."""
    out = []
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        sep = fields.index("-", 6)
        major, _, minor = fields[2].partition(":")
        if len(fields) <= sep + 1 or not (major.isdigit() and minor.isdigit()):
            continue
        out.append(MountEntry(_unescape(fields[4]), (int(major), int(minor)), fields[sep + 1]))
    return out


def filesystem_type(path: str | os.PathLike, mountinfo: str | None = None) -> str | None:
    """The type of the filesystem `path` (or its nearest existing folder) is on, e.g. "ext4", "fuse.juicefs";
    None when mountinfo cannot be read or names no mount above it. OSError when the path's nearest existing
    folder cannot be stat'ed (a dead mount: ENOTCONN)."""
    where = Path(os.path.abspath(path))
    while not where.exists() and where != where.parent:
        where = where.parent
    st = os.stat(where)
    if mountinfo is None:
        try:
            mountinfo = MOUNTINFO.read_text()
        except OSError:
            return None
    entries = parse_mountinfo(mountinfo)
    dev = (os.major(st.st_dev), os.minor(st.st_dev))
    same = [e for e in entries if e.dev == dev]
    if same:
        return same[-1].fstype
    real = os.path.realpath(where)
    above = [e for e in entries if real == e.mount_point or real.startswith(e.mount_point.rstrip("/") + "/")]
    return max(above, key=lambda e: len(e.mount_point)).fstype if above else None


def is_network_type(fstype: str) -> bool:
    """Whether a filesystem of this type is served from elsewhere (network, or FUSE: a user-space daemon)."""
    return fstype in NETWORK_TYPES or fstype.startswith(("fuse.", "nfs"))
