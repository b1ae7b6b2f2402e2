"""The server's own trace: one line per finished request, in the Mooncake format `kvledger bench sim --trace`
and `kvledger whatif` read (bench/trace.py), in a rotating, size-bounded set of files.

    <folder>/requests.jsonl        the current file (appended to)
    <folder>/requests.1.jsonl      the previous one ... requests.<files>.jsonl, the oldest kept
    <folder>/server.json           what the server was started with (model, TTLs, capacity, routing)

A line: `timestamp` (ms since the epoch, the request's arrival), `input_length`, `output_length`,
`block_tokens` (128), `hash_ids` (the prompt's full blocks: `hash_id`, a keyed hash of each chain key
as a 63-bit integer, so identical prefixes share ids and two namespaces never do; the partial last
block has no id), `output_hash_ids` (the full blocks of prompt + output the engine stores at the request's
end, from block ⌊input_length / 128⌋ on: rule 7), `ttl_class` (the request's, as the block ledger
resolved it), `tenant_id` (the keyed id of its tenant's root key, `tenant_id`: every line of one tenant, salted or
not, has the same one, so a forget finds them), and `live` (what this server measured: cached tokens, TTFT, engine,
fetch, decode; `trace.LiveFigures`). Hashes only: no token id, no text, no namespace name.

Forgetting a tenant (DESIGN rule 12; `forget`) rewrites every file of the folder without its lines, on the writer
thread (so no line is written meanwhile), each file replaced whole. Lines written before lines carried
`tenant_id` name no tenant and stay.

The trace is meant to be shared, and a chain key is a public function of model, namespace and tokens:
an id that were the key itself would let whoever holds the trace confirm a guessed prompt. So an id is
HMAC-SHA256 of the chain key under the server's trace key (`trace_key`), which never enters the trace
folder: equal keys still get equal ids (all the what-if needs), a guess without the key matches none.

The request path never waits on it: `record` queues a few references (O(1); a full queue drops the
line and counts it) and one writer thread hashes the output, writes whole lines with one `write` each
on an O_APPEND descriptor, and rotates. Any OSError (a full disk, a folder that cannot be written)
turns the recorder off with one warning; the server goes on serving.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvledger.core import ModelSpec, continue_chain, root_key, tenant_of
from kvledger.entrypoint.config import TraceSettings
from kvledger.state.auth import derive_keys
from kvledger.util.private_file import claim_secret

log = logging.getLogger("kvledger.serve")
CURRENT = "requests.jsonl"
SETTINGS = "server.json"
QUEUE_MAX = 4096          # finished requests waiting for the writer; more at once are dropped (counted)
ID_MASK = 2**63 - 1       # a hash id is a non-negative 63-bit integer (JSON readers, numpy int64)
KEY_FILE = "trace.key"    # <data_dir>/trace.key: an embedded server's trace key, 64 hex characters, mode 0600
KEY_BYTES = 32


def hash_id(key: bytes, secret: bytes) -> int:
    """A chain key's id in the trace: the first 8 bytes of HMAC-SHA256(`secret`, `key`), little-endian, as a 63-bit
    integer. Equal keys, equal ids under one secret; without it, a key says nothing of its id."""
    return int.from_bytes(hmac.digest(secret, key, "sha256")[:8], "little") & ID_MASK


def trace_key(data_dir: Path, cluster_token: str | None) -> bytes:
    """The key of this server's trace ids (32 bytes), the same for every process that writes lines of one trace:
    - a cluster's entrypoints: derived from the cluster token (`state.auth`'s `trace` key), which all of them
      hold already, so several entrypoints, on several machines, write the same ids without sharing a file;
    - an embedded server: `<data_dir>/trace.key`, 32 random bytes in hex, made 0600 on the first start
      and read back on every later one (refused unless this user's alone),
      so the ids of one trace agree across restarts (`claim_secret`).
    ValueError, one line naming the file, for a key file that cannot be used (OSError: one that cannot be made)."""
    if cluster_token is not None:
        return derive_keys(cluster_token).trace
    return claim_secret(Path(data_dir) / KEY_FILE, "trace key", KEY_BYTES)


def tenant_id(spec: ModelSpec, namespace: str, secret: bytes) -> int:
    """The `tenant_id` of a line: the id (`hash_id`, keyed) of the root key of the namespace's tenant
    (`core.tenant_of`): without the trace key, a guessed tenant name matches no line."""
    return hash_id(root_key(spec, tenant_of(namespace)), secret)


def rotated(folder: Path, k: int) -> Path:
    """The k-th file of the folder (0: the current one; k ≥ 1: the k-th most recent rotated one)."""
    return folder / (CURRENT if k == 0 else f"requests.{k}.jsonl")


@dataclass(frozen=True, slots=True)
class Finished:
    """One finished request as `record` hands it to the writer thread (references, nothing computed).
    `arrival_s`: epoch seconds; `keys`: the prompt's chain keys (CHECK's); `tokens`: prompt + output."""

    arrival_s: float
    prompt_tokens: np.ndarray
    output_tokens: Sequence[int]
    keys: Sequence[bytes]
    namespace: str
    ttl_class: str
    live: Mapping[str, Any]
    public_blocks: int = 0   # leading blocks of a published public prefix (`core.chain_parent`)


@dataclass(slots=True)
class _Forget:
    """A forget handed to the writer thread: `removed` is set, then `done`."""

    tenant_id: int
    done: threading.Event
    removed: int = 0


class TraceRecorder:
    """Records finished requests into `settings`' folder (see the module docstring). Thread-safe `record`;
    `flush` waits for the queued lines; `close` stops the writer. `enabled` falls to False on the first
    OSError; `written` and `dropped` count lines."""

    def __init__(self, folder: Path, settings: TraceSettings, spec: ModelSpec, server: Mapping[str, Any],
                 secret: bytes | None, late: Callable[[], Mapping[str, Any]] | None = None) -> None:
        """`server`: written to server.json at once; `secret`: the key of the ids (`trace_key`; None only when
        `settings` has recording off), never written; `late()`: added to server.json before the first line."""
        assert not settings.enabled or (secret is not None and len(secret) >= 16), "a trace key of ≥ 128 bits"
        self.folder, self.settings, self.spec, self._secret = Path(folder), settings, spec, secret or b""
        self._server, self._late = dict(server), late
        self.enabled = settings.enabled
        self.written = self.dropped = 0
        self._queue: queue.Queue[Finished | _Forget | None] = queue.Queue(QUEUE_MAX)
        self._fd: int | None = None
        self._size = 0
        self._thread: threading.Thread | None = None
        if self.enabled:
            self._guard(self._open)
        if self.enabled:
            self._thread = threading.Thread(target=self._run, name="trace-recorder", daemon=True)
            self._thread.start()

    # --- the request path -----------------------------------------------------------------

    def record(self, item: Finished) -> None:
        """Queue one finished request; never blocks, never raises."""
        if not self.enabled:
            return
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.dropped += 1

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued line is written (or dropped); False when `timeout_s` passed first."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and self._thread is not None and self._thread.is_alive():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def forget(self, tenant: str, timeout_s: float = 60.0) -> int | None:
        """Rewrite the folder's files without the lines of `tenant` (see the module docstring); how many went,
        None when the writer did not finish within `timeout_s` (blocking: call it off the event loop)."""
        job = _Forget(tenant_id(self.spec, tenant, self._secret), threading.Event())
        if self._thread is None or not self._thread.is_alive():   # no writer (recording off): nothing races it
            self._rewrite(job)
            return job.removed
        try:
            self._queue.put(job, timeout=timeout_s)
        except queue.Full:
            return None
        return job.removed if job.done.wait(timeout_s) else None

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(10)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    # --- the writer thread ----------------------------------------------------------------

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                if isinstance(item, _Forget):
                    self._rewrite(item)
                elif self.enabled:
                    self._guard(self._write, self.line(item))
            except Exception:   # a bug here must not kill the thread that every later flush waits on
                log.exception("trace recorder: a line could not be made; recording goes on")
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _guard(self, step: Any, *args: Any) -> None:
        """Run one file step; an OSError turns recording off with one warning (rule 8: never the request's)."""
        try:
            step(*args)
        except OSError as e:
            self.enabled = False
            log.warning("trace recording is off: %s: %s (requests are served as before)", self.folder,
                        e.strerror or e)
            if self._fd is not None:
                with contextlib.suppress(OSError):
                    os.close(self._fd)
                self._fd = None

    def _open(self) -> None:
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._server.update(block_tokens=self.spec.block_size, started_at=time.time())
        self._write_settings()
        self._fd = os.open(rotated(self.folder, 0), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._size = os.fstat(self._fd).st_size

    def _write_settings(self) -> None:
        tmp = self.folder / f".{SETTINGS}.tmp"
        tmp.write_text(json.dumps(self._server, indent=1) + "\n")
        os.replace(tmp, self.folder / SETTINGS)

    def _write(self, line: bytes) -> None:
        if self._late is not None:   # the engine is loaded by now: what only it knows
            self._server.update(self._late())
            self._late = None
            self._write_settings()
        if len(line) > self.settings.file_bytes:
            self.dropped += 1
            return
        if self._size and self._size + len(line) > self.settings.file_bytes:
            self._rotate()
        assert self._fd is not None
        view = memoryview(line)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        self._size += len(line)
        self.written += 1

    def _rotate(self) -> None:
        """requests.jsonl → requests.1.jsonl → ... → requests.<files>.jsonl (the oldest is dropped)."""
        assert self._fd is not None
        os.close(self._fd)
        self._fd = None
        files = self.settings.files
        if files == 0:
            os.unlink(rotated(self.folder, 0))
        else:
            for k in range(files - 1, -1, -1):
                if rotated(self.folder, k).exists():
                    os.replace(rotated(self.folder, k), rotated(self.folder, k + 1))
        self._fd = os.open(rotated(self.folder, 0), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._size = 0

    def _rewrite(self, job: _Forget) -> None:
        """Each file of the folder without the lines of `job`'s tenant, replaced whole (a temporary file, then a
        rename); the current file's descriptor reopened after. A line that does not parse is kept. An OSError
        leaves that file as it was (logged); `job.done` is set whatever happens."""
        try:
            for k in range(self.settings.files + 1):
                path = rotated(self.folder, k)
                try:
                    job.removed += self._rewrite_file(path, job.tenant_id, current=k == 0)
                except OSError as e:
                    log.warning("trace: %s could not be rewritten without a forgotten tenant's lines: %s", path, e)
        finally:
            job.done.set()

    def _rewrite_file(self, path: Path, tenant: int, current: bool) -> int:
        try:
            lines = path.read_bytes().splitlines(keepends=True)
        except FileNotFoundError:
            return 0
        kept = [line for line in lines if _tenant_of_line(line) != tenant]
        if len(kept) == len(lines):
            return 0
        tmp = path.with_name(f".{path.name}.forget.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"".join(kept))
            os.fsync(fd)
        finally:
            os.close(fd)
        if current and self._fd is not None:
            os.close(self._fd)
            self._fd = None
        os.replace(tmp, path)
        if current and self.enabled:
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            self._size = os.fstat(self._fd).st_size
        return len(lines) - len(kept)

    def line(self, item: Finished) -> bytes:
        """The JSON line of one request (see the module docstring)."""
        b, n = self.spec.block_size, len(item.prompt_tokens)
        obj = {"timestamp": round(item.arrival_s * 1000, 3), "input_length": n,
               "output_length": len(item.output_tokens), "block_tokens": b,
               "hash_ids": [hash_id(k, self._secret) for k in item.keys[: n // b]]}
        out = self._output_keys(item)
        if out:
            obj["output_hash_ids"] = [hash_id(k, self._secret) for k in out]
        obj["ttl_class"] = item.ttl_class
        obj["tenant_id"] = tenant_id(self.spec, item.namespace, self._secret)
        obj["live"] = dict(item.live)
        return (json.dumps(obj, separators=(",", ":")) + "\n").encode()

    def _output_keys(self, item: Finished) -> list[bytes]:
        """Chain keys of the full blocks of prompt + output from block ⌊L / B⌋ on that the engine stores at the
        request's end: the KV of every token but the last generated one (never fed back) exists."""
        b, n, m = self.spec.block_size, len(item.prompt_tokens), len(item.output_tokens)
        first, end = n // b, (n + m - 1) // b
        if m == 0 or end <= first:
            return []
        tokens = np.concatenate([np.asarray(item.prompt_tokens, dtype=np.uint32),
                                 np.asarray(item.output_tokens, dtype=np.uint32)])
        return continue_chain(tokens, self.spec, item.namespace, item.keys[:first], public_blocks=item.public_blocks,
                              upto=end)[first:]


def _tenant_of_line(line: bytes) -> int | None:
    """The `tenant_id` of a trace line; None for a line without one, or one that does not parse."""
    try:
        got = json.loads(line).get("tenant_id")
    except (ValueError, AttributeError):
        return None
    return got if isinstance(got, int) else None


def trace_request(state: Any, prep: Any, out: Any, usage: Any, ttft_s: float | None) -> None:
    """Queue one finished request of `state` (a ServerState) for its trace: generate.record's one call. Never
    raises (a recorder's bug turns it off, never fails the request)."""
    recorder: TraceRecorder | None = getattr(state, "trace", None)
    if recorder is None or not recorder.enabled:
        return
    try:
        req, used = prep.engine_request, out.usage
        ttl_class, _ = state.policy.resolve(req.namespace, req.ttl_class)
        decode_s = (out.last_token_at - out.first_token_at if out.first_token_at is not None
                    and out.last_token_at is not None else None)
        live = {"cached_tokens": usage.prompt_cache_hit_tokens,
                "ttft_s": None if ttft_s is None else round(ttft_s, 6),
                "engine": None if used is None else used.engine,
                "hit_kind": "" if used is None else used.hit_kind,
                "fetch_bytes": 0 if used is None else used.fetch_bytes,
                "fetch_s": None if used is None else used.timings.get("fetch_s"),
                "decode_s": None if decode_s is None else round(decode_s, 6)}
        arrival = time.time() - (time.perf_counter() - prep.arrival)
        recorder.record(Finished(arrival, req.tokens, out.token_ids, req.keys, req.namespace, ttl_class, live,
                                 req.public_blocks))
    except Exception as e:   # never the request's problem
        recorder.enabled = False
        log.warning("trace recording is off: %s: %s", type(e).__name__, e)


def open_recorder(state: Any) -> TraceRecorder:
    """The recorder of a server (a ServerState, being built), with what a what-if needs to know of it in
    `server.json` (units: seconds, bytes, blocks); what only the loaded engine knows (`device_blocks`: its
    device prefix cache, embedded; `max_model_len`) is added when the first line is written. A trace key
    that cannot be used turns recording off with one warning (never the server's start)."""
    config, spec, policy = state.config, state.spec, state.policy
    settings, secret = config.trace, None
    if settings.enabled:
        try:
            secret = trace_key(config.data_dir, config.cluster_token)
        except (OSError, ValueError) as e:
            log.warning("trace recording is off: %s (requests are served as before)",
                        f"{config.data_dir}: {e.strerror}" if isinstance(e, OSError) else e)
            settings = replace(settings, enabled=False)
    server = {"model": config.model, "mode": "embedded" if config.embedded else "cluster",
              "block_bytes": spec.block_bytes(), "ttl_s": dict(policy.classes), "default_class": policy.default_class,
              "store_capacity_bytes": config.store_capacity_bytes, "routing": config.routing,
              "replay": config.replay, "checkpoint_every": config.checkpoint_every,
              "max_num_seqs": config.max_num_seqs, "kv_cache_bytes": config.kv_cache_bytes}

    def engine_facts() -> dict[str, Any]:
        core = getattr(state, "_engine_core", None)
        pool = getattr(core, "pool", None)
        return {"max_model_len": state.max_model_len, "device_blocks": None if pool is None else pool.total}

    return TraceRecorder(config.trace_folder, settings, spec, server, secret, engine_facts)
