"""Only the optional C extensions; everything else is in pyproject.toml.

- `kvledger.core._chainhash`, the loop of chain keys, needs OpenSSL's headers (Debian: libssl-dev). Where it
  cannot be built, `kvledger.core.keys` uses its pure-Python loop (same keys).
- `kvledger.engine.models._gemv`, the decode step's matmuls, needs an x86-64 compiler with AVX2 intrinsics and
  OpenMP. Where it cannot be built, the engine's matmuls all run in oneDNN (`models/gemv.py`).

Where either cannot be built the install still succeeds."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvledger.core._chainhash", ["kvledger/core/_chainhash.c"],
                             libraries=["crypto"], optional=True),
                   Extension("kvledger.engine.models._gemv", ["kvledger/engine/models/_gemv.c"],
                             extra_compile_args=["-O3", "-fopenmp"], extra_link_args=["-fopenmp"], optional=True)])
