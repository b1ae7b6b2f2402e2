"""Where kvledger keeps its data by default."""

from __future__ import annotations

import os
from pathlib import Path


def default_data_dir() -> Path:
    """$XDG_DATA_HOME/kvledger/serve (~/.local/share/kvledger/serve): `kvledger serve`'s --data-dir, and the
    store the `kvledger store` commands open when given none."""
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "kvledger" / "serve"
