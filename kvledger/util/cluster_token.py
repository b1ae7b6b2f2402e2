"""The cluster token: the shared secret of a cluster's internal APIs (engines, state servers).

It lives in a file readable by its owner only (`kvledger up` writes one); `KVLEDGER_CLUSTER_TOKEN`
may carry it instead. Never logged, never sent in the clear to anything but the cluster's own
loopback or private listeners. A token file another user owns or may write is refused
(`private_file.read_private`), and so is a token shorter than MIN_CHARS."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from kvledger.util.private_file import read_private, write_private

ENV = "KVLEDGER_CLUSTER_TOKEN"
MIN_CHARS = 32          # a given token: at least this many characters
TOKEN_BYTES = 32        # a generated one: 256 random bits (secrets), 64 hex characters


def new_token_file(path: Path) -> str:
    """A fresh token, written to `path` (0600, atomically, never through a link planted there)."""
    token = secrets.token_hex(TOKEN_BYTES)
    write_private(path, token + "\n")
    return token


def load_token(path: Path | None) -> str:
    """The token from `path`, else from $KVLEDGER_CLUSTER_TOKEN; ValueError says what is wrong, naming
    `--token-file` or the variable."""
    if path is not None:
        where = f"--token-file {path}"
        token = read_private(path, "--token-file").strip()
    else:
        where = f"${ENV}"
        token = os.environ.get(ENV, "").strip()
        if not token:
            raise ValueError(f"give --token-file FILE (or set {ENV}): the cluster's internal APIs need a token")
    if len(token) < MIN_CHARS:
        raise ValueError(f"{where}: the cluster token must have at least {MIN_CHARS} characters (a guessable "
                         f"token opens the internal APIs; `python -c 'import secrets; print(secrets.token_hex(32))'` "
                         "makes one)")
    return token
