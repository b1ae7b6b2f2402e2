"""What the Redis block store keeps on the server: one hash per block (named as `redis_keys` says),
field `m` the packed metadata below (never pickle), and either field `d`, the bytes, or, in the cluster
mode, field `l`, where the bytes are (`shared_files.Location`: segment file and offset); and the Lua
scripts of CHECK, exists and put (one round trip per node touched)."""

from __future__ import annotations

import struct

from kvledger.store.backend import read_name, stored_name

META = struct.Struct("<16sIIQddHH")  # parent, pos, size, xxh3_64, created, ttl_s, ns_len, cls_len (+ ns, cls)

# Every key a script touches is in KEYS (Redis Cluster refuses anything else), all of one hash slot.
# KEYS: blocks in chain order. ARGV[1]: TTL ms; ARGV[2]: the expiry instant in unix ms ('': this server's
# TIME + TTL); ARGV[3]: each key's chain position, u32 little-endian ('': 0, 1, 2, …). Block at chain
# position c expires at `at - c` (tails first), `GT` so a hit never shortens a TTL. Returns how many
# leading KEYS are present.
MATCH = """
local ttl, at, pos = tonumber(ARGV[1]), ARGV[2], ARGV[3]
if at == '' then  -- one instant for the whole walk: the refreshed chain stays ordered tails first
  local t = redis.call('TIME')
  at = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + ttl
else
  at = tonumber(at)
end
for i, k in ipairs(KEYS) do
  local c = i - 1
  if pos ~= '' then c = struct.unpack('<I4', pos, 4 * i - 3) end
  if redis.call('PEXPIREAT', k, at - c, 'GT') == 0 and redis.call('EXISTS', k) == 0 then
    return i - 1
  end
end
return #KEYS
"""

# One '0' / '1' per KEYS entry.
EXISTS = """
local out = {}
for i, k in ipairs(KEYS) do
  out[i] = tostring(redis.call('EXISTS', k))
end
return table.concat(out)
"""

# KEYS[1]: the block. ARGV: metadata, the field of the bytes ('d') or of their location ('l'), its value,
# the expiry instant in unix ms. Returns 0 when the block is present (written once), else 1.
PUT = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'm', ARGV[1], ARGV[2], ARGV[3])
redis.call('PEXPIREAT', KEYS[1], ARGV[4])
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
