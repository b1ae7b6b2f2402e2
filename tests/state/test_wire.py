import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvledger.state import auth
from kvledger.state.wire import (
    CHALLENGE_BYTES,
    HELLO_BYTES,
    MAX_PAYLOAD,
    REQUEST_BYTES,
    RESPONSE_BYTES,
    Op,
    ProtocolError,
    PullStatus,
    Session,
    pack_challenge,
    pack_hello,
    pack_proof,
    pack_request,
    pack_response,
    unpack_challenge,
    unpack_hello,
    unpack_proof,
    unpack_request,
    unpack_response,
)

S = bytes(range(32))  # a session key
K = b"k" * 16


def test_round_trips():
    n, p = auth.nonce(), auth.nonce()
    assert unpack_hello(pack_hello(n)) == n and len(pack_hello(n)) == HELLO_BYTES
    assert unpack_challenge(pack_challenge(n, p)) == (PullStatus.OK, n, p)
    assert len(pack_challenge(n, p)) == CHALLENGE_BYTES
    assert unpack_proof(pack_proof(p)) == p
    req = unpack_request(pack_request(S, Op.GET, 7, K), S)
    assert (req.op, req.seq, req.key) == (Op.GET, 7, K)
    resp = unpack_response(pack_response(S, PullStatus.OK, 7, K, 1415040, 130816, 12345), S, K)
    assert resp == (PullStatus.OK, 7, 1415040, 130816, 12345)
    assert unpack_response(pack_response(S, PullStatus.MISS, 1, K), S, K).status is PullStatus.MISS
    assert unpack_response(pack_response(None, PullStatus.DENIED, 0, K), S, K).status is PullStatus.DENIED


def test_keys_depend_on_the_token_and_an_empty_token_is_refused():
    a, b = auth.derive_keys("secret"), auth.derive_keys("secret2")
    assert a == auth.derive_keys(b"secret") and a.handshake != b.handshake and a.handshake != a.directory
    for empty in ("", b""):
        with pytest.raises(ValueError, match="token is empty"):
            auth.derive_keys(empty)


@pytest.mark.parametrize("offset,value", [(0, b"XXXX"), (4, b"\x09"), (5, b"\x63"), (8, b"\x01"), (20, b"\xff")])
def test_bad_magic_version_op_or_any_changed_byte_is_refused(offset, value):
    """A request frame changed anywhere (magic, version, op, seq, key) fails to parse or its MAC."""
    frame = bytearray(pack_request(S, Op.GET, 0, K))
    frame[offset:offset + len(value)] = value
    with pytest.raises(ProtocolError):
        unpack_request(bytes(frame), S)


def test_a_request_or_answer_under_another_session_or_key_is_refused():
    with pytest.raises(ProtocolError, match="MAC"):
        unpack_request(pack_request(S, Op.GET, 0, K), bytes(32))
    ok = pack_response(S, PullStatus.OK, 0, K, 10, 128, 99)
    with pytest.raises(ProtocolError, match="MAC"):
        unpack_response(ok, bytes(32), K)
    with pytest.raises(ProtocolError, match="MAC"):
        unpack_response(ok, S, b"x" * 16)  # an answer for another key
    changed = bytearray(ok)
    changed[32:40] = (98).to_bytes(8, "little")  # the checksum: a lying relay
    with pytest.raises(ProtocolError, match="MAC"):
        unpack_response(bytes(changed), S, K)


def test_absurd_response_length_is_refused():
    with pytest.raises(AssertionError):
        pack_response(S, PullStatus.OK, 0, K, MAX_PAYLOAD + 1)
    for status, length in ((PullStatus.OK, MAX_PAYLOAD + 1), (PullStatus.MISS, 5)):  # a miss carries no payload
        frame = bytearray(pack_response(S, PullStatus.OK, 0, K, 10))
        frame[5] = int(status)
        frame[16:24] = length.to_bytes(8, "little")
        import hmac

        frame[40:] = hmac.digest(S, bytes(frame[:40]) + K, "sha256")
        with pytest.raises(ProtocolError):
            unpack_response(bytes(frame), S, K)


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])  # a loaded machine is slow, not wrong
@given(st.binary(min_size=0, max_size=2 * REQUEST_BYTES))
def test_random_bytes_parse_or_raise_protocol_error_only(raw):
    for parse in (lambda f: unpack_request(f[:REQUEST_BYTES], S), lambda f: unpack_response(f[:RESPONSE_BYTES], S, K),
                  lambda f: unpack_hello(f[:HELLO_BYTES]), lambda f: unpack_challenge(f[:CHALLENGE_BYTES]),
                  lambda f: unpack_proof(f[:HELLO_BYTES])):
        try:
            parse(raw)
        except ProtocolError:
            pass
        else:
            assert raw[:3] == b"KVL"


@pytest.mark.parametrize("key_len", [0, 1, 16, 32, 63, 64, 65, 200])
def test_a_key_keyed_once_macs_exactly_as_hmac_sha256(key_len):
    """`auth.keyed` is RFC 2104 HMAC-SHA256 with its pads hashed once: the same MAC as `hmac.digest` for any key
    (shorter, equal to and longer than SHA-256's 64-byte block) and any split of the message, copy after copy."""
    import hmac
    import os

    key = os.urandom(key_len)
    k = auth.keyed(key)
    for msg in (b"", b"x", os.urandom(40), os.urandom(1000)):
        want = hmac.digest(key, msg, "sha256")
        h = k.copy()
        h.update(msg[:7])
        h.update(memoryview(msg)[7:])
        assert h.digest() == want == auth.mac(key, msg[:3], msg[3:])


def test_frames_of_a_session_are_the_module_functions_frames():
    session = Session(S)
    assert session.request(Op.GET, 7, K) == pack_request(session, Op.GET, 7, K) == pack_request(S, Op.GET, 7, K)
    frame = session.answer(PullStatus.OK, 7, K, 10, 128, 99)
    assert frame == pack_response(S, PullStatus.OK, 7, K, 10, 128, 99)
    assert session.read_request(bytearray(pack_request(S, Op.PING, 3, K))) == (Op.PING, 3, K)
    assert unpack_request(pack_request(S, Op.PING, 3, K), session).seq == 3
    assert session.read_answer(memoryview(frame), K) == unpack_response(frame, S, K)
    assert session.read_answer(frame, K).checksum == 99
    with pytest.raises(ProtocolError, match="MAC"):
        Session(bytes(32)).read_answer(frame, K)
    with pytest.raises(ProtocolError, match="MAC"):
        session.read_answer(frame, b"y" * 16)   # an answer for another key
    assert repr(session) == "Session(<secret>)"
