import pytest

from kvledger.util.serve_process import ServeProcess

# Limits of the shared server: small enough that a fuzzer's request never runs for long.
LIMITS = ("--max-prompt-tokens", "320", "--max-tokens-limit", "4", "--max-body-bytes", "65536",
          "--max-concurrent-per-key", "2")


@pytest.fixture(scope="session")
def open_server(tmp_path_factory):
    """One `kvledger serve` (SmolLM2, no key file: open, loopback) for the error, fuzz and page tests."""
    server = ServeProcess(tmp_path_factory.mktemp("serve-open") / "data", *LIMITS).start()
    try:
        yield server
    finally:
        server.stop()

