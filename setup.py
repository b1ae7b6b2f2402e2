"""Only the optional C accelerator of chain keys; everything else is in pyproject.toml.

The extension needs OpenSSL's headers (Debian: libssl-dev). Where it cannot be built the
install still succeeds and `kvledger.core.keys` uses its pure-Python loop (same keys)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvledger.core._chainhash", ["kvledger/core/_chainhash.c"],
                             libraries=["crypto"], optional=True)])
