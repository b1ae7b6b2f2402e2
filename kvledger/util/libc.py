"""libc's memory calls, typed once for ctypes (Linux): mmap, munmap, mlock, madvise, mincore.

ctypes releases the GIL around each call, so a long madvise or mlock does not hold up other threads.
"""

from __future__ import annotations

import ctypes
import functools

MADV_DONTNEED = 4                # a shared file mapping: drop the pages from this process's page tables
MADV_POPULATE_READ = 22          # Linux ≥ 5.14: fault the range in (readable) without touching it
MAP_FAILED = ctypes.c_void_p(-1).value


@functools.cache
def libc() -> ctypes.CDLL:
    """This process's libc with errno kept (ctypes.get_errno()) and the memory calls' argument types set."""
    lib = ctypes.CDLL(None, use_errno=True)
    lib.mmap.restype = ctypes.c_void_p
    lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    for name in ("munmap", "mlock"):
        getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return lib
