import json

import pytest

from kvledger.bench.trace import DEFAULT_TRACE, TraceRequest, TraceError, read_trace, write_trace


def test_reads_the_synthetic_trace():
    trace = read_trace(DEFAULT_TRACE)
    first_line = json.loads(DEFAULT_TRACE.read_text().splitlines()[0])
    assert len(trace) == sum(1 for line in DEFAULT_TRACE.read_text().splitlines() if line.strip())
    r = trace.requests[0]
    assert (r.input_length, r.output_length, list(r.hash_ids)) == (
        first_line["input_length"], first_line["output_length"], first_line["hash_ids"])
    assert r.block_tokens == 512 and r.arrival_s == first_line["timestamp"] / 1000
    assert trace.span_s > 0
    assert (DEFAULT_TRACE.parent / "LICENSE-APACHE").exists()


@pytest.mark.parametrize("line, message", [
    ("{not json", "not JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"input_length": 10, "output_length": 1, "hash_ids": [1]}', "'timestamp'"),
    ('{"timestamp": 0, "output_length": 1, "hash_ids": [1]}', "missing key 'input_length'"),
    ('{"timestamp": 0, "input_length": -5, "output_length": 1, "hash_ids": []}', "non-negative integer"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": "abc"}', "list of integers"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1, 2]}', "2 hash_ids for 10 tokens"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1}', "missing key 'hash_ids'"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1], "ttl_class": "x"}', "ttl_class"),
])
def test_malformed_line_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "t.jsonl"
    good = '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}'
    path.write_text(good + "\n\n" + line + "\n")
    with pytest.raises(TraceError) as e:
        read_trace(path)
    assert f"{path}:3:" in str(e.value) and message in str(e.value)


def test_empty_missing_and_directory(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    for path, message in ((tmp_path / "empty.jsonl", "no requests"), (tmp_path / "nope.jsonl", "cannot read"),
                          (tmp_path, "is a directory")):
        with pytest.raises(TraceError, match=message):
            read_trace(path)


def test_sorted_by_arrival_ties_keep_file_order(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [(5, [1]), (0, [2]), (5, [3]), (1, [4])]
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": 100, "output_length": 0, "hash_ids": h})
                            + "\n" for t, h in rows))
    assert [r.hash_ids[0] for r in read_trace(path).requests] == [2, 4, 1, 3]


def test_write_read_round_trip(tmp_path):
    reqs = [TraceRequest(0.5, 700, 3, (1, 2)), TraceRequest(1.25, 300, 9, (7, 8, 9), 128, (10,), "agent", 4)]
    write_trace(reqs, tmp_path / "w.jsonl")
    assert list(read_trace(tmp_path / "w.jsonl").requests) == reqs


# --- recorded traces: the live figures, and reading up to the damage ------------------------------

def _line(ts: float, ids: list[int], **extra) -> str:
    return json.dumps({"timestamp": ts, "input_length": 128 * len(ids) + 5, "output_length": 2, "hash_ids": ids,
                       "block_tokens": 128, **extra}) + "\n"


def test_live_figures_round_trip_and_are_checked(tmp_path):
    from kvledger.bench.trace import LiveFigures

    live = LiveFigures(cached_tokens=128, ttft_s=0.25, engine="serve", hit_kind="snapshot", fetch_bytes=3 << 30,
                       fetch_s=0.01, decode_s=None)
    reqs = [TraceRequest(1.0, 300, 2, (5, 6), 128, live=live), TraceRequest(2.0, 300, 2, (5, 7), 128)]
    write_trace(reqs, tmp_path / "w.jsonl")
    assert list(read_trace(tmp_path / "w.jsonl").requests) == reqs
    bad = tmp_path / "bad.jsonl"
    for live_obj, message in (({"cached_tokens": 999}, "more than the 261 prompt tokens"),
                              ({"ttft_s": -1}, "'live.ttft_s'"), ([], "'live' must be a JSON object"),
                              ({"engine": 3}, "strings"), ({"fetch_bytes": 1.5}, "'live.fetch_bytes'")):
        bad.write_text(_line(0, [1, 2], live=live_obj))
        with pytest.raises(TraceError, match=message):
            read_trace(bad)


@pytest.mark.parametrize("damage, message", [
    ('{"timestamp": 3, "input_length": 13', "not JSON"),             # a line cut by a crash mid-write
    ("\x00\x00\x00\x00", "not JSON"),                                 # zeros a crash left in the file
    (b"\xff\xfe garbage\n", "not UTF-8 text"),
    ('{"timestamp": 3, "input_length": 10, "output_length": 1}\n', "missing key 'hash_ids'"),
])
def test_a_damaged_trace_is_read_up_to_the_damage(tmp_path, damage, message):
    path = tmp_path / "requests.jsonl"
    head = (_line(1000, [1, 2]) + _line(2000, [1, 3])).encode()
    tail = damage if isinstance(damage, bytes) else damage.encode()
    path.write_bytes(head + tail + _line(4000, [9]).encode())
    with pytest.raises(TraceError, match=f"{path}:3: {message}"):
        read_trace(path)                                   # a file given by hand: the mistake is an error
    trace = read_trace(path, damage="stop")
    assert [r.hash_ids for r in trace.requests] == [(1, 2), (1, 3)]
    assert trace.damage.startswith(f"{path}:3: {message}")
    path.write_bytes(tail)
    with pytest.raises(TraceError, match=f"{path}:1: {message}"):   # nothing before the damage: nothing to read
        read_trace(path, damage="stop")
