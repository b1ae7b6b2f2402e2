"""The cluster token: the shared secret of a cluster's internal APIs (engines, state servers).

It lives in a file readable by its owner only (`kvledger up` writes one); `KVLEDGER_CLUSTER_TOKEN`
may carry it instead. Never logged, never sent in the clear to anything but the cluster's own
loopback or private listeners."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

ENV = "KVLEDGER_CLUSTER_TOKEN"
MIN_CHARS = 16


def new_token_file(path: Path) -> str:
    token = secrets.token_hex(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def load_token(path: Path | None) -> str:
    """The token from `path`, else from $KVLEDGER_CLUSTER_TOKEN; ValueError says what is wrong."""
    if path is not None:
        try:
            token = Path(path).read_text().strip()
        except OSError as e:
            raise ValueError(f"cannot read the cluster token file {path}: {e.strerror}") from None
    else:
        token = os.environ.get(ENV, "").strip()
        if not token:
            raise ValueError(f"give --token-file FILE (or set {ENV}): the cluster's internal APIs need a token")
    if len(token) < MIN_CHARS:
        raise ValueError(f"the cluster token must have at least {MIN_CHARS} characters")
    return token
