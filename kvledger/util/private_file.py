"""Files that hold secrets (the cluster token, the API key file), read and written so that no other
local user can plant or swap one.

    text = read_private(path, "--api-keys")   # ValueError naming the flag and the mode when the file is
                                              # not this user's alone
    write_private(path, text)                 # mode 0600, atomically, never through a planted link

A file is accepted only when the running user owns it and its group and others have no permission
on it at all (mode & 0o077 == 0), as ssh demands of a private key: a key file others may read hands
every tenant's key to every local user, one they may write lets them plant a tenant. The check is
made on the open descriptor (fstat), so the bytes read are those of the file checked.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def read_private(path: str | Path, flag: str) -> str:
    """The text of `path`; ValueError `"{flag} {path}: ..."` when it cannot be read or is not this user's
    alone (`check_private`)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)   # a planted FIFO does not block
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot read it ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        check_private(os.fstat(fd), path, flag)
        raw = f.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{flag} {path}: not UTF-8 text") from None


def check_private(st: os.stat_result, path: str | Path, flag: str) -> None:
    """ValueError unless `st` is a regular file owned by this user with no permission bit for group or
    others (mode & 0o077 == 0); its message is one line naming the file, its mode and the fix."""
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{flag} {path}: not a regular file")
    if st.st_uid != os.geteuid():
        raise ValueError(f"{flag} {path}: owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}); "
                         "another user could have planted it")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise ValueError(f"{flag} {path}: {_exposure(mode)} by group or others (mode {mode:04o}); chmod 600 {path}")


def _exposure(mode: int) -> str:
    """The most group or others may do to a file of permission bits `mode` (some of 0o077 set)."""
    if mode & 0o022:
        return "writable"
    return "readable" if mode & 0o044 else "executable"


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` with mode 0600: into a new file beside it (O_EXCL: a planted file or link of
    that name fails the write, never receives it), fsynced, then renamed over `path` (a link planted at
    `path` is replaced, its target untouched). Parent folders that do not exist are created 0700."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), 0o600)   # whatever the umask
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    """The rename survives a crash (best effort: some filesystems refuse fsync on a folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
