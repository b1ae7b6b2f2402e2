"""Sessions of an engine's internal API: the engine proves it knows the cluster token before anyone
sends it a prompt, and every request is bound to a session and a fresh sequence number.

    caller (entrypoint)                                   engine
    POST /engine/v1/session {"client_nonce": cn} ──────▶
                            ◀──────  {"session": id, "server_nonce": sn, "proof": HMAC(K, "server" | cn | sn)}
    checks the proof: an engine that cannot make it is refused and gets nothing more
    every request carries
        X-Kvledger-Session: id
        X-Kvledger-Seq: n            a new number in this session (a replayed request is refused)
        X-Kvledger-Mac: HMAC(S, method | path | n | SHA-256(body)),  S = HMAC(K, "session" | cn | sn)

K is the cluster token's engine key (`state/auth.py`); S never travels, and only a holder of the
token can compute it, so a valid MAC proves the caller too. The token itself is never sent: an
address that Redis names (the registry can be written by anyone who reaches Redis) learns nothing
from us but nonces. Replies are not MACed (the internal API belongs on a private network, README),
but for one whose bytes the caller computes with, a P/D tail's KV: X-Kvledger-Mac on the reply is
HMAC(S, "REPLY" | path | n | SHA-256(reply body)) (`SessionTable.reply_mac`, `SessionClient.reply_ok`).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from dataclasses import dataclass, field

from kvledger.state import auth

SESSION_PATH = "/engine/v1/session"
H_SESSION, H_SEQ, H_MAC = "x-kvledger-session", "x-kvledger-seq", "x-kvledger-mac"
MAX_PENDING = 256      # sessions opened and not yet used: an unauthenticated caller can only churn these
MAX_VERIFIED = 1024    # sessions that carried a valid MAC (entrypoints): never evicted by pending ones
IDLE_S = 600.0         # a session unused this long is forgotten (the caller opens a new one)
REPLAY_WINDOW = 4096   # sequence numbers this far below the highest seen are refused (no record kept)
REPLY = "REPLY"        # the "method" of a reply's MAC: no request's MAC is ever a reply's


class ProofFailed(Exception):
    """The engine could not prove the cluster token: it is not one of this cluster's engines."""


def request_mac(key: bytes, method: str, path: str, seq: int, body: bytes) -> str:
    return auth.mac(key, method.upper().encode(), b"\0", path.encode(), b"\0", str(seq).encode(), b"\0",
                    hashlib.sha256(body).digest()).hex()


@dataclass(slots=True)
class _Session:
    key: bytes
    used: float                 # monotonic seconds
    top: int = 0                # the highest sequence number seen
    seen: set[int] = field(default_factory=set)   # numbers seen within REPLAY_WINDOW of `top`

    def take(self, seq: int) -> bool:
        """Whether `seq` is new (then it is recorded)."""
        if seq <= self.top - REPLAY_WINDOW or seq in self.seen:
            return False
        self.seen.add(seq)
        if seq > self.top:
            self.top = seq
            if len(self.seen) > 2 * REPLAY_WINDOW:
                self.seen = {n for n in self.seen if n > self.top - REPLAY_WINDOW}
        return True


class SessionTable:
    """The engine's side. `open` answers a session request; `check` one request's headers."""

    def __init__(self, token: str) -> None:
        self.key = auth.derive_keys(token).engine
        self.pending: OrderedDict[str, _Session] = OrderedDict()
        self.verified: OrderedDict[str, _Session] = OrderedDict()
        self._lock = threading.Lock()

    def open(self, client_nonce_hex: str) -> dict[str, str]:
        """ValueError for a nonce that is not NONCE_BYTES of hex."""
        cn = bytes.fromhex(client_nonce_hex)
        if len(cn) != auth.NONCE_BYTES:
            raise ValueError(f"client_nonce must be {auth.NONCE_BYTES} bytes of hex")
        sn = auth.nonce()
        sid = auth.nonce()[:16].hex()
        with self._lock:
            self.pending[sid] = _Session(auth.session_key(self.key, cn, sn), time.monotonic())
            while len(self.pending) > MAX_PENDING:
                self.pending.popitem(last=False)
        return {"session": sid, "server_nonce": sn.hex(), "proof": auth.server_proof(self.key, cn, sn).hex()}

    def check(self, sid: str | None, seq: str | None, tag: str | None, method: str, path: str,
              body: bytes) -> str | None:
        """None when the request is authentic and new; else why not, for the 401."""
        if not (sid and seq and tag) or not seq.isdigit() or len(seq) > 19:
            return "this is an engine's internal API: open a session (the cluster token) first"
        now = time.monotonic()
        with self._lock:
            s = self.verified.get(sid) or self.pending.get(sid)
            if s is None or now - s.used > IDLE_S:
                return "session_unknown"
            if not hmac.compare_digest(tag.encode(), request_mac(s.key, method, path, int(seq), body).encode()):
                return "the request's MAC is wrong"
            if not s.take(int(seq)):
                return "a replayed request"
            s.used = now
            if self.pending.pop(sid, None) is not None:
                self.verified[sid] = s
                self._evict_idle(now)
            self.verified.move_to_end(sid)
        return None

    def reply_mac(self, sid: str, seq: int, path: str, body: bytes) -> str | None:
        """The MAC of a reply to request `seq` of session `sid` (checked already): a reply the caller must trust
        (a P/D tail's KV) proves it comes from a holder of the token. None when the session is gone."""
        with self._lock:
            s = self.verified.get(sid)
        return None if s is None else request_mac(s.key, REPLY, path, seq, body)

    def _evict_idle(self, now: float) -> None:
        for sid in [k for k, v in self.verified.items() if now - v.used > IDLE_S]:
            del self.verified[sid]
        while len(self.verified) > MAX_VERIFIED:
            self.verified.popitem(last=False)


@dataclass(slots=True)
class _Open:
    sid: str
    key: bytes
    seq: int = 0


class SessionClient:
    """The caller's side: one session per engine URL, opened on first use (and again when the engine
    forgot it: `forget`). `headers` are those of one request; ProofFailed for an impostor."""

    def __init__(self, token: str) -> None:
        self.key = auth.derive_keys(token).engine
        self.sessions: dict[str, _Open] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def headers(self, client: object, url: str, method: str, path: str, body: bytes) -> dict[str, str]:
        """`client`: an httpx.AsyncClient (its timeouts bound the session request)."""
        s = self.sessions.get(url)
        if s is None:
            async with self._locks.setdefault(url, asyncio.Lock()):
                s = self.sessions.get(url)
                if s is None:
                    s = self.sessions[url] = await self._open(client, url)
        s.seq += 1
        return {H_SESSION: s.sid, H_SEQ: str(s.seq), H_MAC: request_mac(s.key, method, path, s.seq, body)}

    def reply_ok(self, url: str, sent: dict[str, str], path: str, body: bytes, tag: str | None) -> bool:
        """Whether `tag` is the engine's MAC of reply `body` to the request sent with headers `sent`."""
        s = self.sessions.get(url)
        if s is None or tag is None or sent.get(H_SESSION) != s.sid:
            return False
        return hmac.compare_digest(tag.encode(), request_mac(s.key, REPLY, path, int(sent[H_SEQ]), body).encode())

    def forget(self, url: str) -> None:
        self.sessions.pop(url, None)

    async def _open(self, client: object, url: str) -> _Open:
        cn = auth.nonce()
        r = await client.post(url + SESSION_PATH, json={"client_nonce": cn.hex()})  # type: ignore[attr-defined]
        return self._accept(cn, r.status_code, r.content)

    def open_sync(self, url: str, timeout_s: float = 10.0) -> _Open:
        cn = auth.nonce()
        req = urllib.request.Request(url + SESSION_PATH, json.dumps({"client_nonce": cn.hex()}).encode(),
                                     {"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                status, raw = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        return self._accept(cn, status, raw)

    def _accept(self, cn: bytes, status: int, raw: bytes) -> _Open:
        try:
            d = json.loads(raw) if status == 200 else {}
            sid, sn, proof = str(d["session"]), bytes.fromhex(d["server_nonce"]), bytes.fromhex(d["proof"])
        except (ValueError, KeyError, TypeError):
            raise ProofFailed(f"no session answer (HTTP {status})") from None
        if not auth.same(proof, auth.server_proof(self.key, cn, sn)):
            raise ProofFailed("its proof of the cluster token is wrong")
        return _Open(sid, auth.session_key(self.key, cn, sn))


def engine_request(url: str, path: str, token: str, body: bytes | None = None,
                   timeout_s: float = 10.0) -> tuple[int, bytes]:
    """One authenticated call of an engine's internal API (tools and tests): a session of its own."""
    s = SessionClient(token).open_sync(url, timeout_s)
    method = "POST" if body is not None else "GET"
    s.seq += 1
    headers = {H_SESSION: s.sid, H_SEQ: str(s.seq), H_MAC: request_mac(s.key, method, path, s.seq, body or b""),
               "Content-Type": "application/json"}
    req = urllib.request.Request(url + path, body, headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
