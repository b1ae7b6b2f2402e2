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
