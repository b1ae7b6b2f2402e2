import pytest

from kvledger.util.serve_process import ServeProcess

ALPHA, BETA, OPS = "sk-alpha-0123456789", "sk-beta-9876543210", "sk-ops-5555555555"
QUIET = "sk-quiet-2468013579"   # a key configured no-store (DESIGN rule 12)
KEYS = {ALPHA: "alpha", BETA: {"namespace": "beta", "ttl_class": "agent"},
        OPS: {"namespace": "ops", "role": "operator"}, QUIET: {"namespace": "quiet", "store": False}}
OPERATOR = {"Authorization": f"Bearer {OPS}"}   # /metrics and /dashboard* need the operator key
# Limits of the shared server: small enough that a fuzzer's request never runs for long.
LIMITS = ("--max-prompt-tokens", "320", "--max-tokens-limit", "8", "--max-body-bytes", "65536",
          "--max-concurrent-per-key", "2")


class SharedServer:
    """One `kvledger serve` (SmolLM2, two tenant keys and an operator key) for all the server tests: starting one costs
    tens of seconds of model load. `restart()` stops it and starts it again on the same data
    directory (the restart test); later tests use the new process."""

    def __init__(self, data_dir) -> None:
        self.data_dir = data_dir
        self.server = self._new().start()

    def _new(self) -> ServeProcess:
        return ServeProcess(self.data_dir, *LIMITS, keys=KEYS, api_key=ALPHA)

    def restart(self) -> ServeProcess:
        self.server.stop()
        self.server = self._new().start()
        return self.server

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture(scope="session")
def shared_server(tmp_path_factory):
    holder = SharedServer(tmp_path_factory.mktemp("serve") / "data")
    try:
        yield holder
    finally:
        holder.stop()


@pytest.fixture
def open_server(shared_server):
    """The shared server as it runs now (its `get`/`post` send the key of tenant alpha)."""
    return shared_server.server
