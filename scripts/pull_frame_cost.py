"""What a state pull's frames cost in Python: the most a C frame helper could take off a pull.

    .venv/bin/python scripts/pull_frame_cost.py --repeat 9

A pull on a kept-alive connection runs four frame calls, two on each side: the client packs its request and
checks the answer's head, the server checks the request and packs the answer head; each computes or checks one
HMAC-SHA256 (`wire.Session`, keyed once). A C helper beside `core/_chainhash.c` would do the same work in one
call each. This times the four calls as they are, in a tight loop (their code and data hot in the cache, so a
floor: in a pull they run after a 1.4 MB copy has evicted them), and prints the best of `--repeat` runs of
`--number` calls each, in µs, and their sum. A C helper still computes the MACs, so the sum bounds what it could
save from above.
"""

from __future__ import annotations

import argparse
import os
import timeit
from collections.abc import Callable

from kvledger.state import auth, wire

LENGTH, POSITION, CHECKSUM = 1_415_040, 3, 0x1234_5678_9ABC_DEF0   # an answer head's fields: one V4 snapshot


def calls() -> dict[str, Callable[[], object]]:
    """The four frame calls of one pull (and one MAC alone), on a random session key and block key."""
    session, key = wire.Session(os.urandom(32)), os.urandom(16)
    request = session.request(wire.Op.GET, 7, key)
    answer = bytearray(session.answer(wire.PullStatus.OK, 7, key, LENGTH, POSITION, CHECKSUM))
    assert session.read_request(request)[2] == key
    assert session.read_answer(answer, key).length == LENGTH
    return {
        "client: request": lambda: session.request(wire.Op.GET, 7, key),
        "server: read_request": lambda: session.read_request(request),
        "server: answer": lambda: session.answer(wire.PullStatus.OK, 7, key, LENGTH, POSITION, CHECKSUM),
        "client: read_answer": lambda: session.read_answer(answer, key),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="example: python scripts/pull_frame_cost.py --repeat 9 --number 20000",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--repeat", type=int, default=9, help="timed runs per call; the best is printed")
    p.add_argument("--number", type=int, default=20_000, help="calls per timed run")
    args = p.parse_args()
    if args.repeat < 1 or args.number < 1:
        p.error("--repeat and --number must be >= 1")
    total = 0.0
    try:
        for name, call in calls().items():
            best_us = min(timeit.repeat(call, number=args.number, repeat=args.repeat)) / args.number * 1e6
            total += best_us
            print(f"{name:26s} {best_us:6.2f} us")
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    print(f"{'the four, a pull':26s} {total:6.2f} us")
    keyed, head = auth.keyed(os.urandom(32)), os.urandom(32)

    def one_mac() -> bytes:
        h = keyed.copy()
        h.update(head)
        return h.digest()

    mac_us = min(timeit.repeat(one_mac, number=args.number, repeat=args.repeat)) / args.number * 1e6
    print(f"{'of which one MAC':26s} {mac_us:6.2f} us (x4)")


if __name__ == "__main__":
    main()
