"""A kernel's output under several torch thread counts, for the tests that check its bits do not depend on them."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def under_thread_counts(compute: Callable[[], torch.Tensor], counts: Sequence[int]) -> list[torch.Tensor]:
    """`compute()` in inference mode under each of `counts` torch threads; the caller's count is restored after."""
    threads = torch.get_num_threads()
    outs = []
    try:
        for t in counts:
            torch.set_num_threads(t)
            with torch.inference_mode():
                outs.append(compute())
    finally:
        torch.set_num_threads(threads)
    return outs
