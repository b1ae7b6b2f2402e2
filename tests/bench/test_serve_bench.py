"""`kvledger bench serve`'s per-session first turns: which system prompt each starts with, and how many sessions
started with it before."""

import numpy as np

from kvledger.bench.serve_bench import Session, Turn, first_turns


def test_first_turns_number_system_prompts_and_count_the_sessions_before():
    a, b = np.arange(300, dtype=np.uint32), np.arange(1, 200, dtype=np.uint32)
    sessions = [Session(s, (np.arange(5, dtype=np.uint32),), (1,)) for s in (a, b, a, a)]
    cache = [Turn(i, 0, 310, c, 0.1 * (i + 1), 1.0, (1,)) for i, c in enumerate((0, 0, 0, 256))]
    cache.append(Turn(0, 1, 320, 300, 0.05, 1.0, (1,)))   # a later turn: not a first one
    base = [Turn(i, 0, 310, 0, 1.0, 1.0, (1,)) for i in range(4)]
    rows = first_turns(sessions, {"cache": (cache, 1.0), "no_cache": (base, 1.0)})
    assert [(r["system"], r["sessions_before"], r["cached_tokens"]) for r in rows] == [(0, 0, 0), (1, 0, 0), (0, 1, 0),
                                                                                      (0, 2, 256)]
    assert rows[3]["system_tokens"] == 300 and rows[3]["no_cache_ttft_s"] == 1.0
