"""Small helpers the tests share: a umask for a block, and a wait for a condition with a deadline."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    """This process's umask (and so its children's) is `mask` until the block ends."""
    before = os.umask(mask)
    try:
        yield
    finally:
        os.umask(before)


def until(check: Callable[[], T], what: str, *, timeout_s: float = 60.0, every_s: float = 0.2) -> T:
    """`check()`'s first true value, asked every `every_s` for up to `timeout_s`; an AssertionError naming `what`
    when it stays false (a server writes what these tests read after it answered)."""
    deadline = time.monotonic() + timeout_s
    while not (got := check()):
        assert time.monotonic() < deadline, what
        time.sleep(every_s)
    return got
