"""One engine interface: the in-process AsyncEngine and the cross-process RemoteEngines are both EngineClients."""

import inspect

import pytest

from kvledger.engine.async_engine import AsyncEngine
from kvledger.engine.client import EngineClient
from kvledger.entrypoint.remote import RemoteEngines

MEMBERS = ("start", "generate", "alive", "engine_count", "close")


@pytest.mark.parametrize("cls", [AsyncEngine, RemoteEngines])
def test_both_clients_serve_the_one_interface(cls):
    for name in MEMBERS:
        ours, theirs = getattr(EngineClient, name), getattr(cls, name)
        assert isinstance(ours, property) == isinstance(theirs, property), name
        if not isinstance(ours, property):
            assert list(inspect.signature(ours).parameters) == list(inspect.signature(theirs).parameters), name
    assert inspect.isasyncgenfunction(cls.generate)
