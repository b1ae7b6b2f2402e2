import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvledger.state.protocol import (
    MAX_PAYLOAD,
    REQUEST_BYTES,
    RESPONSE_BYTES,
    Op,
    ProtocolError,
    Status,
    pack_request,
    pack_response,
    token_digest,
    unpack_request,
    unpack_response,
)


def test_round_trips():
    d = token_digest("secret")
    assert len(d) == 32 and d != token_digest("secret2") and d == token_digest(b"secret")
    req = unpack_request(pack_request(Op.GET, d, b"k" * 16))
    assert (req.op, req.token_digest, req.key, req.length) == (Op.GET, d, b"k" * 16, 0)
    resp = unpack_response(pack_response(Status.OK, 1415040, 130816, 12345))
    assert resp == (Status.OK, 1415040, 130816, 12345)
    assert unpack_response(pack_response(Status.MISS)).status is Status.MISS


@pytest.mark.parametrize("offset,value", [(0, b"XXXX"), (4, b"\x09"), (5, b"\x63")])
def test_bad_magic_version_op(offset, value):
    frame = bytearray(pack_request(Op.GET, token_digest("t"), bytes(16)))
    frame[offset:offset + len(value)] = value
    with pytest.raises(ProtocolError):
        unpack_request(bytes(frame))


@pytest.mark.parametrize("length", [1, MAX_PAYLOAD, MAX_PAYLOAD + 1, 2**32 - 1])
def test_any_length_field_is_refused(length):
    frame = bytearray(pack_request(Op.GET, token_digest("t"), bytes(16)))
    frame[56:60] = length.to_bytes(4, "little")
    with pytest.raises(ProtocolError):
        unpack_request(bytes(frame))


def test_absurd_response_length_is_refused():
    frame = bytearray(pack_response(Status.OK, 10))
    frame[8:16] = (MAX_PAYLOAD + 1).to_bytes(8, "little")
    with pytest.raises(ProtocolError):
        unpack_response(bytes(frame))
    frame = bytearray(pack_response(Status.MISS))
    frame[8:16] = (5).to_bytes(8, "little")  # a miss carries no payload
    with pytest.raises(ProtocolError):
        unpack_response(bytes(frame))


@given(st.binary(min_size=0, max_size=2 * REQUEST_BYTES))
def test_random_bytes_parse_or_raise_protocol_error_only(raw):
    try:
        req = unpack_request(raw[:REQUEST_BYTES])
    except ProtocolError:
        pass
    else:
        assert raw[:4] == b"KVLS" and req.op in Op and req.length == 0 and len(req.key) == 16
    try:
        resp = unpack_response(raw[:RESPONSE_BYTES])
    except ProtocolError:
        pass
    else:
        assert raw[:4] == b"KVLR" and resp.status in Status and resp.length <= MAX_PAYLOAD
