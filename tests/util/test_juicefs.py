"""`util.juicefs`: what the tests' dead mounts rely on."""

import errno
import os

import pytest

from kvledger.util.juicefs import abort_connection


def test_aborting_a_connection_fails_every_call_on_the_mount_at_once(tmp_path, juicefs):
    """`Mount.kill` aborts the FUSE connection after its SIGKILL: a client killed mid-request on its own mount
    would otherwise keep it open, and every call there (a fork closing an inherited descriptor too) hang."""
    mount = juicefs.mount(tmp_path / "m")
    (mount.path / "f").write_bytes(b"x")
    fd = os.open(mount.path / "f", os.O_RDONLY)
    abort_connection(mount.path)
    with pytest.raises(OSError) as err:
        os.listdir(mount.path)
    assert err.value.errno == errno.ENOTCONN
    with pytest.raises(OSError):
        os.close(fd)   # the flush fails at once; the descriptor is released
    abort_connection(tmp_path / "not-a-mount")   # nothing there: nothing done
