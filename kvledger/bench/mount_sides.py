"""The stores `kvledger bench mount` compares, started and stopped here: the cluster mode's block ledger (Redis
index + segment files) on a local folder and on a JuiceFS volume.

    | side             | writes through (fsync on, off) | reads through                              |
    |------------------|--------------------------------|--------------------------------------------|
    | local            | two stores on DIR/local/blocks | a third store on the same folder           |
    | juicefs          | two stores on mount A          | a store on mount B: the other machine      |
    | juicefs_no_cache | (juicefs's writers)            | a store on mount C, `--cache-size 0`       |

One redis-server holds kvledger's index (a key prefix per filesystem: `local:`, `jfs:`). The JuiceFS volume's
metadata is on a redis-server of its own, its objects in a local folder (`--storage file`): the JuiceFS figures
are FUSE and the JuiceFS client over this machine's disk, not a network. Each mount has its own cache folder.
"""

from __future__ import annotations

import contextlib
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from kvledger.store.ledger import BlockLedger, blocks_dir
from kvledger.util.juicefs import JuiceFS
from kvledger.util.redis_server import RedisServer

INDEX_TIMEOUT_S = 30.0   # every Redis call's deadline (the populating puts pipeline thousands of blocks)


@dataclass(slots=True)
class Reader:
    """A store that reads what a side's writers wrote: `root` is its folder (on its own mount)."""

    name: str
    root: Path
    ledger: BlockLedger


@dataclass(slots=True)
class Side:
    """One filesystem under the block ledger: its writers (fsync on and off, one folder) and its readers."""

    name: str
    prefix: str
    writer: BlockLedger
    writer_no_fsync: BlockLedger
    readers: list[Reader]


@dataclass(slots=True)
class Sides:
    """The two sides, the index's URL and what describes them in the result (see the module docstring)."""

    index_url: str
    local: Side
    juicefs: Side
    describe: dict[str, str] = field(default_factory=dict)

    @property
    def all(self) -> tuple[Side, Side]:
        return self.local, self.juicefs

    def readers(self) -> list[Reader]:
        return [r for side in self.all for r in side.readers]

    def open_reader(self, reader: Reader, side: Side) -> BlockLedger:
        """A new store where `reader` reads (what a restarted engine opens)."""
        return _open(reader.root, self.index_url, side.prefix, fsync=False)


def _open(root: Path, url: str, prefix: str, fsync: bool) -> BlockLedger:
    return BlockLedger.open(path=root, redis_url=url, prefix=prefix, fsync=fsync, timeout_s=INDEX_TIMEOUT_S)


def _side(name: str, prefix: str, url: str, write_root: Path, readers: dict[str, Path],
          stack: contextlib.ExitStack) -> Side:
    ledgers = [_open(write_root, url, prefix, fsync) for fsync in (True, False)]
    ledgers += [_open(root, url, prefix, False) for root in readers.values()]
    for ledger in ledgers:
        stack.callback(ledger.close)
    return Side(name, prefix, ledgers[0], ledgers[1],
                [Reader(n, root, led) for (n, root), led in zip(readers.items(), ledgers[2:])])


@contextlib.contextmanager
def started(base: Path):  # -> Iterator[Sides]
    """Both sides under `base` (a folder this call may fill), stopped and unmounted on exit."""
    with contextlib.ExitStack() as stack:
        index = stack.enter_context(RedisServer())
        meta = stack.enter_context(RedisServer())
        volume = stack.enter_context(JuiceFS(base / "jfs", meta.url.rsplit("/", 1)[0] + "/1", name="bench"))
        a, b = volume.mount(base / "mnt-a"), volume.mount(base / "mnt-b")
        c = volume.mount(base / "mnt-c", "--cache-size", "0")
        local = blocks_dir(base / "local")
        sides = Sides(index.url,
                      _side("local", "local:", index.url, local, {"local": local}, stack),
                      _side("juicefs", "jfs:", index.url, blocks_dir(a.path),
                            {"juicefs": blocks_dir(b.path), "juicefs_no_cache": blocks_dir(c.path)}, stack))
        sides.describe = {"local": f"{local} (the bench's --dir)",
                          "juicefs": f"JuiceFS {_version(volume)}: metadata on a redis-server of its own, objects "
                          "in a local folder (--storage file), --trash-days 0; writes through mount A, reads "
                          "through mount B (own cache folder, default --cache-size)",
                          "juicefs_no_cache": "reads through mount C of the same volume, --cache-size 0"}
        yield sides


def _version(volume: JuiceFS) -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run([volume.binary, "version"], capture_output=True, text=True, timeout=30).stdout
        return out.strip().removeprefix("juicefs version ")
    return "?"
