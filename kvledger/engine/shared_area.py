"""Host memory that the engine and its fetcher process both map (rule 6's "host shared memory").

A `memfd_create` file, mapped shared: the fetcher gets its descriptor (`pass_fds`) and maps the same pages, so what
it reads from the block ledger lands where the engine reads it, with no copy between the processes. A memfd has no
name under /dev/shm (nothing outlives the last descriptor and mapping, Ctrl-C or SIGKILL included) and is not
bounded by that mount's size. Both sides map with MAP_POPULATE: every page is allocated and mapped once, when the
area is made or attached, never by the first hit's reads (94 MB of pages mapped on the fly cost a fetch 30 ms).
"""

from __future__ import annotations

import mmap
import os


def map_area(fd: int, size: int) -> mmap.mmap:
    """`size` bytes of `fd` mapped shared, read-write, every page populated now."""
    assert size > 0
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)


class SharedArea:
    """`size` bytes of zeros, mapped here (`buf`); `fd` passes them to another process (`map_area` there).

    Invariant: the mapping stays valid while any view of `buf` lives, after `close` too (close drops the descriptor:
    no process can attach any more)."""

    def __init__(self, size: int, name: str = "kvledger") -> None:
        self.size = size
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.buf = map_area(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
