"""Cluster mode end to end: `kvledger up` (Redis, 2 prefill + 2 decode engines, an entrypoint) as real
processes, driven with the real `openai` client, against a single-process `kvledger serve`.

One cluster for the module (four model loads cost a minute); the tests run in file order and the
last ones take engines away (a SIGTERM hand-off, then a SIGKILL)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import openai
import pytest

from kvledger.engine.session import engine_request
from kvledger.entrypoint.cluster_process import ClusterProcess
from kvledger.util.serve_process import ServeProcess, request

BLOCK = 128
SYSTEM = "You are a careful librarian. " + " ".join(f"Book {i} stands on shelf {i * 7 % 13}." for i in range(70))


def messages(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with ClusterProcess(tmp_path_factory.mktemp("cluster") / "data", prefill=2, decode=2,
                        routing="round-robin") as c:
        yield c


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    server = ServeProcess(tmp_path_factory.mktemp("single") / "data").start()
    yield server
    server.stop()


def chat(url: str, question: str, max_tokens: int = 10, **kw):
    return client(url).chat.completions.create(model="smollm2-135m", messages=messages(question),
                                               max_tokens=max_tokens, temperature=0, **kw)


def test_prefill_on_one_engine_hits_on_the_other_through_the_decode_engine(cluster, single):
    reference = chat(single.url, "Where is book 12?")
    first = chat(cluster.url, "Where is book 12?")
    second = chat(cluster.url, "Where is book 12?")
    a, b = first.usage.model_dump()["kvledger"], second.usage.model_dump()["kvledger"]
    assert {a["engine"], b["engine"]} == {"prefill-0", "prefill-1"}   # round-robin: one each
    cap = (second.usage.prompt_tokens - 1) // BLOCK * BLOCK
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == cap > 0
    assert b["store_cached_tokens"] == cap and b["device_cached_tokens"] == 0   # from the shared store
    # what the prefill engine ran through the model: the rest of the prompt, no more (no over-claimed reuse)
    assert a["computed_prompt_tokens"] == first.usage.prompt_tokens and b["computed_prompt_tokens"] == \
        second.usage.prompt_tokens - cap
    # P/D: a prefill leg for the first token, then a decode leg from there
    assert [(leg["kind"], leg["start"]) for leg in b["legs"]] == [("prefill", 0), ("decode", 1)]
    assert b["legs"][0]["engine"] == b["engine"] and b["legs"][1]["engine"].startswith("decode-")
    assert first.choices[0].message.content == second.choices[0].message.content == \
        reference.choices[0].message.content
    assert second.usage.completion_tokens == reference.usage.completion_tokens


def test_the_decode_leg_takes_the_prompts_tail_from_the_prefill_engine_and_computes_one_token(cluster, single):
    """P/D hand-off of the tail: the prefill leg keeps the block its prompt ends in; the decode leg pulls it from
    that engine (a session of its own, the reply MACed) and computes only the first output token, where it used
    to recompute everything after the prompt's last whole block. The answer is the single process's."""
    reference = chat(single.url, "Where is book 3?", max_tokens=8)
    got = chat(cluster.url, "Where is book 3?", max_tokens=8)
    n = got.usage.prompt_tokens
    assert n % BLOCK, "the prompt must end inside a block for a tail to exist"
    prefill, decode = got.usage.model_dump()["kvledger"]["legs"]
    assert (prefill["kind"], decode["kind"]) == ("prefill", "decode")
    assert prefill["computed_prompt_tokens"] == n - prefill["cached_tokens"]
    assert decode["cached_tokens"] == n and decode["computed_prompt_tokens"] == 1   # prompt + 1 token, 1 computed
    assert got.choices[0].message.content == reference.choices[0].message.content
    status, _ = cluster.engine_get(prefill["engine"], "/engine/v1/tail/" + "00" * 16)
    assert status == 404   # taken once (and an unknown key is a 404, never a 5xx)
    status, _ = request(cluster.members[prefill["engine"]].url + "/engine/v1/tail/" + "00" * 16)
    assert status == 401   # the internal API's session, as every other path


def test_stream_through_the_cluster_matches_single_process(cluster, single):
    kw = {"stream": True, "stream_options": {"include_usage": True}}
    parts = list(chat(cluster.url, "Where is book 40?", max_tokens=12, **kw))
    text = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
    assert parts[0].choices[0].delta.role == "assistant"
    assert parts[-1].choices == [] and parts[-1].usage.completion_tokens >= 1
    assert text == chat(single.url, "Where is book 40?", max_tokens=12).choices[0].message.content


def test_engine_api_needs_the_cluster_token(cluster):
    url = cluster.members["prefill-0"].url
    status, _ = request(url + "/engine/v1/health")
    assert status == 401
    status, _ = request(url + "/engine/v1/health", headers={"Authorization": "Bearer not-the-token-000000"})
    assert status == 401
    status, _ = request(url + "/engine/v1/health", headers={"Authorization": f"Bearer {cluster.token}"})
    assert status == 401   # the token itself opens nothing: it is never sent (engine/session.py)
    status, body = cluster.engine_get("prefill-0", "/engine/v1/health")
    assert status == 200 and body["role"] == "prefill"
    ok = {"request_id": "x", "tokens": [1], "sampling": {"max_tokens": 1}}
    for bad in (b"{not json", json.dumps(ok | {"tokens": [-1]}).encode(), json.dumps(ok | {"pickle": "x"}).encode(),
                json.dumps(ok | {"tokens": [99_999_999]}).encode(), json.dumps(ok | {"tokens": []}).encode()):
        status, raw = engine_request(url, "/engine/v1/generate", cluster.token, bad)
        assert status == 400 and "message" in json.loads(raw)["error"], raw


class FakeEngine:
    """An HTTP server that records whatever reaches it and answers as a malicious engine would: a session
    with a made-up proof, invented tokens served as a full hit."""

    def __init__(self) -> None:
        import http.server
        import threading

        seen = self.seen = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                seen.append((self.path, dict(self.headers), body))
                answer = ({"session": "s", "server_nonce": "00" * 32, "proof": "00" * 32}
                          if self.path.endswith("/session") else
                          {"token_ids": [4242, 4242, 4242], "finished": True, "finish_reason": "stop",
                           "usage": {"prompt_tokens": 700, "cached_tokens": -5, "completion_tokens": 3,
                                     "hit_kind": "snapshot"}})
                raw = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("content-length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            do_GET = do_POST

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_a_fake_engine_registered_through_redis_receives_nothing(cluster, single):
    """Issue 20 item 1, the attack as found: anyone who reaches Redis registers an engine whose id sorts
    first (a plain entry; a genuine entry with its URL or limits changed; a genuine one under its id), with
    no expiry. The fake receives nothing (no prompt, no token), the tenant gets the right answer, the cluster
    keeps its limits, and /metrics stays whole."""
    import redis

    fake = FakeEngine()
    r = redis.Redis.from_url(cluster.redis_url)   # the password `up` made: as if a Redis writer had it
    prefix = "kvl:{engines}:"
    genuine = json.loads(r.get(prefix + "e:prefill-0"))
    body = json.loads(genuine["info"])
    entries = {
        "aaa-fake": json.dumps(body | {"engine_id": "aaa-fake", "url": fake.url, "max_model_len": 2}),
        "aaa-fake-url": json.dumps(genuine | {"info": json.dumps(body | {"url": fake.url})}),
        "aaa-fake-copy": json.dumps(genuine | {"info": json.dumps(body | {"engine_id": "aaa-fake-copy"})}),
    }
    try:
        for engine_id, raw in entries.items():
            r.sadd(prefix + "set", engine_id)
            r.set(prefix + "e:" + engine_id, raw)
        time.sleep(1.5)   # the entrypoint lists the registry every 0.5 s
        reference = chat(single.url, "Where is book 77?")
        for _ in range(3):
            got = chat(cluster.url, "Where is book 77?")
            assert got.choices[0].message.content == reference.choices[0].message.content
            assert got.usage.model_dump()["kvledger"]["engine"].startswith("prefill-")
        status, raw = request(cluster.url + "/metrics")
        assert status == 200 and b"aaa-fake" not in raw
    finally:
        for engine_id in entries:
            r.srem(prefix + "set", engine_id)
            r.delete(prefix + "e:" + engine_id)
        fake.server.shutdown()
    assert fake.seen == []


def _stream_and_act(url: str, question: str, n: int, after: int, act) -> tuple[list[int], object]:
    """Stream a completion of exactly n tokens; call act() once `after` tokens have arrived."""
    ids: list[int] = []
    last = None
    stream = client(url).completions.create(model="smollm2-135m", prompt=SYSTEM + "\n" + question, max_tokens=n,
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    acted = False
    for chunk in stream:
        if chunk.choices:
            ids.extend(chunk.model_dump().get("choices")[0].get("token_ids") or [])
        else:
            last = chunk
        if not acted and len(ids) >= after:
            act()
            acted = True
    assert acted
    return ids, last


def _busy_decode_engine(cluster: ClusterProcess) -> str:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for name in [n for n in cluster.members if n.startswith("decode")]:
            try:
                status, body = cluster.engine_get(name, "/engine/v1/health")
            except OSError:   # one stopped by an earlier test
                continue
            if status == 200 and body["running"] > 0:
                return name
        time.sleep(0.05)
    raise AssertionError("no decode engine is running the request")


def _interrupted(cluster: ClusterProcess, single: ServeProcess, question: str, n: int, after: int, sig: int):
    """A stream of n greedy tokens from the cluster whose decode engine gets `sig` once `after` tokens
    have arrived; (its token ids, its usage chunk, the single-process ids, the engine signalled)."""
    ref = client(single.url).completions.create(model="smollm2-135m", prompt=SYSTEM + "\n" + question, max_tokens=n,
                                                temperature=0, extra_body={"ignore_eos": True})
    signalled: dict[str, str] = {}

    def act() -> None:
        signalled["name"] = _busy_decode_engine(cluster)
        cluster.signal(signalled["name"], sig)

    ids, last = _stream_and_act(cluster.url, question, n, after, act)
    return ids, last, ref.model_dump()["choices"][0]["token_ids"], signalled["name"]


def test_decode_engine_sigterm_hands_off_with_the_stream_intact(cluster, single):
    ids, last, ref_ids, name = _interrupted(cluster, single, "Book 5 is", 40, 8, signal.SIGTERM)
    assert len(ids) == 40 and last.usage.completion_tokens == 40  # no token lost or repeated
    assert ids == ref_ids                                         # greedy continues exactly
    assert cluster.wait_exit(name)                                # it drained and exited
    status, metrics = request(cluster.url + "/metrics")
    continued = [ln for ln in metrics.decode().splitlines() if ln.startswith("kvledger_engine_legs_total")
                 and 'kind="continue"' in ln]
    assert status == 200 and continued and float(continued[0].split()[-1]) >= 1   # a hand-off happened


def test_killed_engine_mid_stream_is_retried_elsewhere(cluster, single):
    """SIGKILL (no hand-off): the stream breaks, the entrypoint continues from the tokens it has."""
    ids, last, ref_ids, _ = _interrupted(cluster, single, "Book 9 is", 24, 6, signal.SIGKILL)
    assert ids == ref_ids and last.usage.completion_tokens == 24
    time.sleep(4)   # the registry forgets it within its heartbeat TTL (3 s)
    after = chat(cluster.url, "Where is book 3?")
    assert after.choices[0].finish_reason in ("stop", "length")


def test_health_stays_up_while_requests_run(cluster):
    box: dict = {}
    worker = threading.Thread(target=lambda: box.setdefault("r", chat(cluster.url, "Where is book 60?")))
    worker.start()
    while worker.is_alive():
        t = time.monotonic()
        status, _ = request(cluster.url + "/health", timeout=10)
        assert status == 200 and time.monotonic() - t < 2.0
        time.sleep(0.1)
    worker.join()
    assert box["r"].usage.completion_tokens >= 1


def test_windowed_model_decode_engine_pulls_the_snapshot_from_the_prefill_host(tmp_path):
    """tiny-v4 (sliding-window layers), 1 prefill + 1 decode engine: the decode leg resumes from the
    window snapshot the prefill engine holds (state ledger pull between processes, rule 3's exact
    hit), and the output equals one no-cache engine's for the whole request (`tiny_reference`)."""
    import random

    rng = random.Random(7)
    prompt = [rng.randrange(1, 20_000) for _ in range(700)]
    ref = tiny_reference(tmp_path, prompt, 8)
    c = ClusterProcess(tmp_path / "cluster", prefill=1, decode=1, model="tiny-v4").start()
    try:
        status, body = request_json(c.url + "/v1/completions", {"model": "tiny-v4", "prompt": prompt,
                                                                "max_tokens": 8, "temperature": 0})
        assert status == 200 and body["choices"][0]["token_ids"] == ref
        text = request(c.url + "/metrics")[1].decode()
        c.proc.send_signal(signal.SIGINT)    # Ctrl-C: everything stops, Redis included; 128 + SIGINT
        assert c.proc.wait(timeout=120) == 130
    finally:
        c.stop()
    assert set(c.members) == {"redis", "prefill-0", "decode-0", "entrypoint"}
    for member in c.members.values():
        with pytest.raises(ProcessLookupError):
            os.kill(member.pid, 0)
    decode_snapshot = _sample(text, 'kvledger_engine_legs_total{engine="decode-0",hit_kind="snapshot",kind="decode"}')
    store_tokens = _sample(text, 'kvledger_engine_leg_cached_tokens_total{kind="decode",source="store"}')
    assert decode_snapshot == 1 and store_tokens > 0


def tiny_reference(tmp_path, prompt: list[int], n: int) -> list[int]:
    """What one no-cache tiny-v4 engine answers for the whole request, in one request: the reference however
    the cluster splits it (DESIGN rule 10; a decode leg continues the request, YoCo anchor included, so a
    reference split after the first token, as P/D splits, would follow the system under test)."""
    single = ServeProcess(tmp_path / "single", "--no-cache", model="tiny-v4").start()
    try:
        body = {"model": "tiny-v4", "prompt": prompt, "max_tokens": n, "temperature": 0}
        status, out = single.post("/v1/completions", body)
        assert status == 200, out
        return out["choices"][0]["token_ids"]
    finally:
        single.stop()


def request_json(url: str, body: dict) -> tuple[int, dict]:
    import json

    status, raw = request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return status, json.loads(raw)


def _sample(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_on_a_redis_cluster_a_prefix_prefilled_on_one_engine_hits_on_the_other(tmp_path):
    """The same cluster on a real 3-master Redis Cluster (`kvledger up --redis-cluster`): the index,
    the snapshot directory and the registry all on it. tiny-v4, round-robin over 2 prefill engines,
    1 decode engine: the second request's prefill engine hits from the store (blocks) and pulls the
    snapshot from the first one's state server; outputs equal a single-process server's (`tiny_reference`)."""
    import random

    rng = random.Random(11)
    prompt = [rng.randrange(1, 20_000) for _ in range(600)]
    body = {"model": "tiny-v4", "prompt": prompt, "max_tokens": 6, "temperature": 0}
    ref = tiny_reference(tmp_path, prompt, 6)
    with ClusterProcess(tmp_path / "cluster", "--redis-cluster", prefill=2, decode=1, routing="round-robin",
                        model="tiny-v4") as c:
        assert c.members["redis"].url.startswith("redis+cluster://")
        first = request_json(c.url + "/v1/completions", body)[1]
        second = request_json(c.url + "/v1/completions", body)[1]
    assert first["choices"][0]["token_ids"] == second["choices"][0]["token_ids"] == ref
    a, b = first["usage"]["kvledger"], second["usage"]["kvledger"]
    assert {a["engine"], b["engine"]} == {"prefill-0", "prefill-1"}
    assert b["hit_kind"] == "snapshot" and b["store_cached_tokens"] == second["usage"]["prompt_cache_hit_tokens"] > 0
