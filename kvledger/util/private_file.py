"""Files and folders that are this user's alone: secrets (the cluster token, the API key file, the trace and
event keys), read and written so that no other local user can read, plant or swap one, and the data the
ledgers write (DESIGN: files 0600, folders 0700, whoever's process writes them, whatever its umask).

    text = read_private(path, "--api-keys")   # ValueError naming the flag and the mode when the file is
                                              # not this user's alone
    write_private(path, text)                 # mode 0600, atomically, never through a planted link
    secret = claim_secret(path, "events key") # 32 random bytes made 0600 on first use; concurrent first
                                              # users (processes, machines of one mount) agree on one
    private_dir(path)                         # missing folders made 0700
    fd = open_private(path, os.O_WRONLY | os.O_EXCL)   # a file made 0600

The umask can only take bits away, so a file created 0600 or a folder created 0700 is never open to group
or others; the chmod after each creation makes the mode exactly that even under a umask that takes the
owner's bits (077 on top of them), so the owner can still write what it made. Where a filesystem fixes
modes itself (a CIFS mount's file_mode) and refuses the chmod, its modes stand, as for any writer.

A file is accepted only when the running user owns it and its group and others have no permission
on it at all (mode & 0o077 == 0), as ssh demands of a private key: a key file others may read hands
every tenant's key to every local user, one they may write lets them plant a tenant. The check is
made on the open descriptor (fstat), so the bytes read are those of the file checked.
"""

from __future__ import annotations

import errno
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
    tmp = _written_beside(path, text)
    try:
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def claim_secret(path: Path, what: str, nbytes: int = 32) -> bytes:
    """The secret in `path` (`nbytes` random bytes as hex, mode 0600), made when there is none: written whole
    to a file of this caller's own, then hard-linked in, so concurrent first users (other processes, other
    machines' mounts of one folder) agree on one secret and none reads a half-written file. Read back with
    `read_private`: ValueError `"{what} {path}: ..."` for a file not this user's alone or not such a secret."""
    if not path.exists():
        tmp = _written_beside(path, os.urandom(nbytes).hex() + "\n")
        try:
            os.link(tmp, path)   # atomic: the whole file appears, or another claimer's stands
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
    text = read_private(path, what).strip()
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        secret = b""
    if len(secret) != nbytes:
        raise ValueError(f"{what} {path}: not {nbytes * 2} hex characters")
    return secret


def private_dir(path: Path) -> Path:
    """`path` as a folder, each missing component (parents included) created with mode 0700 whatever the
    umask; existing folders keep their mode (an operator's mount point is not ours to change). `path`."""
    path = Path(path)
    missing = []
    for folder in (path, *path.parents):
        if folder.is_dir():
            break
        missing.append(folder)
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:
            if not folder.is_dir():
                raise
            continue   # another process made it meanwhile: its creator set its mode
        _chmod(folder, 0o700)
    return path


def open_private(path: str | Path, flags: int) -> int:
    """`os.open(path, flags | O_CREAT | O_CLOEXEC)` of a file only its owner may read or write: a file it
    creates is 0600 whatever the umask, and an existing one this user owns with group or other bits set
    (an older version's 0644) is made 0600 too. The descriptor (the caller closes it).

    With O_EXCL the file is new and this call made it with mode 0600, which a umask can only narrow: no
    fstat then, and a chmod only when the umask took the owner's own bits (a segment file on a shared mount is
    created without a metadata round trip)."""
    fd = os.open(path, flags | os.O_CREAT | os.O_CLOEXEC, 0o600)
    if flags & os.O_EXCL:
        mask = _umask()
        if mask is None or mask & 0o600:
            _chmod(fd, 0o600)
        return fd
    try:
        tighten(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _umask() -> int | None:
    """This process's umask, read without changing it (Linux's /proc/self/status; None where it is not there)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return None


def tighten(file: int | str | Path) -> None:
    """A file (a descriptor or a path) this user owns made exactly 0600 when it is not; another user's is left
    alone (a chmod would fail: `read_private` is where such a file is refused)."""
    st = os.fstat(file) if isinstance(file, int) else os.stat(file)
    if stat.S_IMODE(st.st_mode) != 0o600 and st.st_uid == os.geteuid():
        _chmod(file, 0o600)


def _chmod(target: int | str | Path, mode: int) -> None:
    """chmod, best effort where the filesystem fixes modes itself (a CIFS mount's file_mode, a FUSE mount
    without permissions refuse it: its modes are its own, for any writer). Secrets stay safe: `read_private`
    refuses one whose mode could not be made private."""
    try:
        os.chmod(target, mode)
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise


def _written_beside(path: Path, text: str) -> Path:
    """A new file beside `path` (0600, O_EXCL, never through a link) holding `text`, fsynced; its path.
    Missing parent folders are created 0700."""
    private_dir(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    fd = open_private(tmp, os.O_WRONLY | os.O_EXCL | os.O_NOFOLLOW)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


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
