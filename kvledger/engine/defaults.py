"""The defaults the serving commands share (`serve`, `entrypoint`, `engine`, `up`), each written once: `DEFAULTS`.

Every reader takes its value from here: each command's flag, each config record's field (`ServeConfig`,
`TraceSettings`, `EngineConfig`), `Engine`'s constructor, and the bench where it means "what the server runs
with". A field is named after its flag's argparse dest where one flag has it; the three stop graces, whose flag
is `--grace-s` on each command, are named after their command. tests/engine/test_defaults.py checks every
command's parsed defaults against this table.

A default that a module below the engine owns as its own behaviour stays with it, read by name: the model
(`core.DEFAULT_MODEL`), the TTL classes (`core.plan.DEFAULT_TTL_DAYS`, as seconds in `store.ttl.DEFAULT_CLASSES`),
the HTTP server's header timeout and connection limits (`util.http_server`), a body's timeout
(`entrypoint.body_limit.BODY_TIMEOUT_S`). A default that one command alone has (`up --prefill 1`) stays at its flag.

A light module (no torch): the commands read it for `--help` before anything loads.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class Defaults:
    """One value per setting; units in the names (`_s` seconds, `_bytes` bytes) or in the comment."""

    # where a server listens
    host: str = "127.0.0.1"     # loopback: an open server (no --api-keys) binds nowhere else; an engine's API too
    port: int = 8000            # the HTTP API of serve / entrypoint / up (an engine's own: 0, any free one)
    # one engine
    max_num_seqs: int = 8                  # sequences: the running batch; the per-key limit with keys is half of it
    max_num_batched_tokens: int = 4096     # tokens one step computes at most (decode tokens + prefill chunks)
    kv_cache_bytes: int = 512 * MIB        # the device KV pool, which is also the device prefix cache
    checkpoint_every: int = 0              # tokens between rule 4′ snapshots while prefilling; 0: only rule 4's
    stream_hits: str = "auto"              # --stream-hits: auto streams a hit when a CPU is left for the fetcher
    device: str = "cpu"                    # torch device of the model
    # the HTTP front (serve, entrypoint; up hands them to its entrypoint)
    routing: str = "cache-aware"           # prefill engine: least tokens to compute + queued (entrypoint/router.py)
    max_body_bytes: int = 4 * MIB          # a larger request body → 413
    open_per_key: int = 16                 # requests of one caller in flight without --api-keys: all one tenant
    max_tokens_limit: int = 4096           # tokens one request may generate: minutes of a batch slot
    status_interval_s: float = 10.0        # a status line per this much activity; 0: none
    gc_interval_s: float = 60.0            # embedded store: expired blocks removed this often while serving
    trace_file_bytes: int = 32 * MIB       # the server's trace file is rotated before it passes this
    trace_files: int = 4                   # rotated trace files kept beside the current one
    # a stop (SIGTERM): how long what runs may finish
    serve_grace_s: float = 10.0            # serve / entrypoint: requests in flight, then they end with a 503
    up_grace_s: float = 2.0                # up: its entrypoint's requests and its engines' hand-offs (a local cluster)
    engine_grace_s: float = 60.0           # engine: hand requests back, then drain its streams


DEFAULTS = Defaults()
