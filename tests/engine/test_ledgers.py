"""open_ledgers: the embedded server, a node's one long-lived process, pins its LMDB index in memory."""

from __future__ import annotations

import sys

import pytest

from kvledger.core import ModelSpec
from kvledger.engine.ledgers import Part, open_ledgers


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the pin is Linux's (mlock)")
def test_the_embedded_server_pins_its_index_until_it_closes(tmp_path):
    ledgers = open_ledgers(ModelSpec.preset("smollm2-135m"), tmp_path, Part.EMBEDDED)
    pin = ledgers.block.store.pin
    try:
        assert ledgers.state is None and pin is not None and pin.wait(30)
        assert pin.mode == "locked" and pin.pinned_bytes > 0
    finally:
        ledgers.close()
    assert pin.mode == "off"
