import os

from kvledger.state.files import HEADER_BYTES, SnapshotFiles


def test_round_trip_and_no_temporary_left(tmp_path):
    files = SnapshotFiles(tmp_path)
    data = os.urandom(5000)
    files.write(b"k" * 16, 256, data)
    assert files.exists(b"k" * 16) and files.read(b"k" * 16) == (256, data)
    assert [p.name for p in files.path(b"k" * 16).parent.iterdir()] == [files.path(b"k" * 16).name]
    assert files.read(b"x" * 16) is None
    assert files.remove(b"k" * 16) and not files.exists(b"k" * 16)


def test_durable_write(tmp_path):
    files = SnapshotFiles(tmp_path, durable=True)
    files.write(b"d" * 16, 128, b"abc")
    assert files.read(b"d" * 16) == (128, bytearray(b"abc"))


def test_damaged_files_are_misses_and_removed(tmp_path):
    files = SnapshotFiles(tmp_path)
    key = b"c" * 16
    for damage in ("flip", "truncate", "extend", "magic", "header"):
        files.write(key, 128, b"z" * 1000)
        p = files.path(key)
        raw = bytearray(p.read_bytes())
        if damage == "flip":
            raw[HEADER_BYTES + 10] ^= 1
        elif damage == "truncate":
            raw = raw[:-1]
        elif damage == "extend":
            raw += b"!"
        elif damage == "magic":
            raw[0:8] = b"NOTASNAP"
        else:
            raw = raw[:10]
        p.write_bytes(bytes(raw))
        assert files.read(key) is None, damage
        assert not p.exists(), damage
    assert files.corrupt == 5


def test_gc_removes_old_snapshots_and_stray_temporaries(tmp_path):
    files = SnapshotFiles(tmp_path)
    files.write(b"o" * 16, 128, b"old")
    files.write(b"n" * 16, 256, b"new")
    stray = files.path(b"o" * 16).with_name(".leftover.tmp")
    stray.write_bytes(b"half")
    old = files.path(b"o" * 16).stat().st_mtime - 3600
    for p in (files.path(b"o" * 16), stray):
        os.utime(p, (old, old))
    assert files.gc(max_age_s=1800) == 2
    assert not files.exists(b"o" * 16) and not stray.exists() and files.read(b"n" * 16) == (256, b"new")


def test_a_mount_that_fails_the_stat_answers_absent(tmp_path, monkeypatch):
    """Rule 8: a shared mount whose stat fails (EIO, ESTALE, ENOTCONN: a dead FUSE client) is a miss, not an error
    in the CHECK (the fault injected at the filesystem call, as a dead mount raises it)."""
    import errno
    from pathlib import Path

    files = SnapshotFiles(tmp_path)
    files.write(b"k" * 16, 128, b"abc")
    assert files.exists(b"k" * 16)

    def dead(self):
        raise OSError(errno.ENOTCONN, "Transport endpoint is not connected", str(self))

    monkeypatch.setattr(Path, "is_file", dead)
    assert not files.exists(b"k" * 16)
