"""Only the optional C extensions; everything else is in pyproject.toml.

- `kvledger.core._chainhash`, the loop of chain keys, needs OpenSSL's headers (Debian: libssl-dev). Where it
  cannot be built, `kvledger.core.keys` uses its pure-Python loop (same keys).
- `kvledger.state._sockio`, a state connection's socket calls with their deadline (`kvledger.state.sockio`), needs
  Linux. Where it cannot be built, `sockio` runs the same calls in Python.
- `kvledger.engine.models._gemv`, `_attend` and `_rowwise`, the decode step's matmuls and attention and a Llama
  layer's row-wise operators, need an x86-64 compiler with AVX2 intrinsics and OpenMP. Where they cannot be
  built, the engine runs those in oneDNN and torch (`models/gemv.py`, `models/attend.py`, `models/rowwise.py`).

Where either cannot be built the install still succeeds."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvledger.core._chainhash", ["kvledger/core/_chainhash.c"],
                             libraries=["crypto"], optional=True),
                   Extension("kvledger.state._sockio", ["kvledger/state/_sockio.c"], optional=True),
                   *(Extension(f"kvledger.engine.models.{name}", [f"kvledger/engine/models/{name}.c"],
                               depends=["kvledger/engine/models/_avx2.h"],
                               extra_compile_args=["-O3", "-fopenmp", *flags], extra_link_args=["-fopenmp"],
                               optional=True)
                     # _rowwise's rotation is torch's formula operator for operator: no product fused into a sum
                     for name, flags in (("_gemv", []), ("_attend", []), ("_prompt_attend", []),
                                         ("_rowwise", ["-ffp-contract=off"])))])
