"""Sessions of an engine's internal API (issue 20 item 1): the engine proves the cluster token before a
caller sends anything that matters, the token never travels, and no request can be replayed."""

from __future__ import annotations

import json
import os

import pytest

from kvledger.engine.session import (
    REPLAY_WINDOW,
    ProofFailed,
    SessionClient,
    SessionTable,
    _Open,
    request_mac,
)
from kvledger.state import auth

TOKEN = "c" * 64


def opened(table: SessionTable, client: SessionClient):
    cn = auth.nonce()
    return client._accept(cn, 200, json.dumps(table.open(cn.hex())).encode())


def signed(s, seq: int, body: bytes = b"{}", path: str = "/engine/v1/generate") -> tuple:
    return s.sid, str(seq), request_mac(s.key, "POST", path, seq, body), "POST", path, body


def test_a_session_proves_the_token_both_ways_and_refuses_a_replay():
    table, client = SessionTable(TOKEN), SessionClient(TOKEN)
    s = opened(table, client)
    assert table.check(*signed(s, 1)) is None
    assert table.check(*signed(s, 1)) == "a replayed request"
    assert table.check(*signed(s, 3)) is None and table.check(*signed(s, 2)) is None   # out of order is fine
    assert table.check(*signed(s, 2)) == "a replayed request"
    sid, seq, tag, method, path, _ = signed(s, 4)
    assert table.check(sid, seq, tag, method, path, b'{"tokens": [1]}') == "the request's MAC is wrong"
    assert table.check(sid, seq, tag, method, "/engine/v1/health", b"{}") == "the request's MAC is wrong"
    assert table.check(*signed(s, 4)) is None
    assert table.check(*signed(s, 5 + REPLAY_WINDOW)) is None
    assert table.check(*signed(s, 5)) == "a replayed request"   # below the window: refused unseen
    assert table.check("0" * 32, "9", "00", "POST", "/x", b"") == "session_unknown"
    assert table.check(None, None, None, "GET", "/x", b"").startswith("this is an engine's internal API")


def test_an_engine_without_the_token_cannot_make_the_proof():
    impostor, client = SessionTable("not the cluster's token, 32+ chars"), SessionClient(TOKEN)
    with pytest.raises(ProofFailed):
        opened(impostor, client)
    with pytest.raises(ProofFailed):
        client._accept(auth.nonce(), 200, b'{"session": "x", "server_nonce": "00", "proof": "00"}')


def test_a_caller_without_the_token_gets_no_request_through():
    table = SessionTable(TOKEN)
    answer = table.open(auth.nonce().hex())   # anyone may ask; without the token no session key follows
    for guess in (os.urandom(32), auth.derive_keys("another token, of 32 characters!").engine):
        assert table.check(*signed(_Open(answer["session"], guess), 1)) == "the request's MAC is wrong"


def test_unauthenticated_session_requests_cannot_evict_a_working_session():
    table, client = SessionTable(TOKEN), SessionClient(TOKEN)
    s = opened(table, client)
    assert table.check(*signed(s, 1)) is None
    for _ in range(5000):
        table.open(auth.nonce().hex())
    assert table.check(*signed(s, 2)) is None


def test_a_reply_mac_proves_the_reply_and_binds_it_to_its_request():
    """A P/D tail's KV comes back MACed: the caller takes it only with the MAC of that reply to that request."""
    from kvledger.engine.session import H_MAC, H_SEQ, H_SESSION

    table, client = SessionTable(TOKEN), SessionClient(TOKEN)
    url, path = "http://127.0.0.1:1", "/engine/v1/tail/" + "ab" * 16
    client.sessions[url] = s = opened(table, client)
    s.seq = 6
    sent = {H_SESSION: s.sid, H_SEQ: "7", H_MAC: request_mac(s.key, "GET", path, 7, b"")}
    assert table.check(sent[H_SESSION], "7", sent[H_MAC], "GET", path, b"") is None
    kv = os.urandom(4096)
    tag = table.reply_mac(s.sid, 7, path, kv)
    assert client.reply_ok(url, sent, path, kv, tag)
    assert not client.reply_ok(url, sent, path, kv[:-1] + bytes([kv[-1] ^ 1]), tag)   # other bytes
    assert not client.reply_ok(url, sent | {H_SEQ: "8"}, path, kv, tag)                 # another request's
    assert not client.reply_ok(url, sent, path, kv, sent[H_MAC])                        # a request MAC is not one
    assert not client.reply_ok(url, sent, path, kv, None)
    assert table.reply_mac("no-such-session", 7, path, kv) is None
