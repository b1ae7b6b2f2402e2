"""What the Redis block store keeps on the server: one hash per block, `{prefix}b:<16-byte key>`,
field `m` the packed metadata below (never pickle), field `d` the bytes (absent in the cluster
mode); and the Lua scripts of CHECK, exists and put (one round trip each)."""

from __future__ import annotations

import struct

from kvledger.store.backend import read_name, stored_name

META = struct.Struct("<16sIIQddHH")  # parent, pos, size, xxh3_64, created, ttl_s, ns_len, cls_len (+ ns, cls)

MATCH = """
local blob, ttl, prefix = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local n = #blob / 16
local t = redis.call('TIME')  -- one instant for the whole walk: the refreshed chain stays ordered tails first
local at = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + ttl
for i = 0, n - 1 do
  local k = prefix .. string.sub(blob, i * 16 + 1, i * 16 + 16)
  if redis.call('PEXPIREAT', k, at - i, 'GT') == 0 and redis.call('EXISTS', k) == 0 then
    return i
  end
end
return n
"""

EXISTS = """
local blob, prefix = ARGV[1], ARGV[2]
local out = {}
for i = 0, #blob / 16 - 1 do
  out[i + 1] = tostring(redis.call('EXISTS', prefix .. string.sub(blob, i * 16 + 1, i * 16 + 16)))
end
return table.concat(out)
"""

PUT = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
if ARGV[2] == '' then
  redis.call('HSET', KEYS[1], 'm', ARGV[1])
else
  redis.call('HSET', KEYS[1], 'm', ARGV[1], 'd', ARGV[2])
end
redis.call('PEXPIREAT', KEYS[1], ARGV[3])
return 1
"""


def encode_meta(parent: bytes, pos: int, size: int, xxh: int, created: float, ttl_s: float,
                namespace: str, ttl_class: str) -> bytes:
    ns, cl = stored_name(namespace), stored_name(ttl_class)
    return META.pack(parent, pos, size, xxh, created, ttl_s, len(ns), len(cl)) + ns + cl


MetaFields = tuple[bytes, int, int, int, float, float, str, str]  # parent, pos, size, xxh, created, ttl_s, ns, cls


def decode_meta(raw: bytes) -> MetaFields | None:
    """The fields of a metadata value, or None when it does not parse."""
    try:
        parent, pos, size, xxh, created, ttl_s, ns_len, cls_len = META.unpack_from(raw)
        rest = raw[META.size:]
        if len(rest) != ns_len + cls_len:
            return None
        return parent, pos, size, xxh, created, ttl_s, read_name(rest[:ns_len]), read_name(rest[ns_len:])
    except (struct.error, UnicodeDecodeError, TypeError):
        return None
