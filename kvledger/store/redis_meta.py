"""What the Redis block store keeps on the server: one hash per block (named as `redis_keys` says),
field `m` the packed metadata below (never pickle), and either field `d`, the bytes, or, in the cluster
mode, field `l`, where the bytes are (`shared_files.Location`: segment file and offset); beside it the
block's tombstone; and the Lua scripts of CHECK, exists, put and removal (one round trip per node touched).

Tombstones. Redis expires a block by itself, with no hook, so the record of why a block is gone is
written while it lives: the put writes, with the block, a string key in the block's hash slot, its
tombstone, whose value is the grace G in ms and which expires exactly G after the block
(G = TOMB_GRACE_S, 7 days, one per store). A CHECK that extends a block's expiry extends its
tombstone's alike, so a tombstone outlives its block by G whatever the hits, and the block's last
expiry is the tombstone's minus its value. When a CHECK finds a block absent and its tombstone there:

    | tombstone                       | the block                                  | Gone              |
    |---------------------------------|--------------------------------------------|-------------------|
    | value G, server time ≥ expiry   | its TTL ran out                            | expired, expiry   |
    | value G, server time < expiry   | removed before it: maxmemory eviction, an  | evicted, now (the |
    |                                 | operator's DEL, FLUSH... (Redis says not)  | time is not kept) |
    | value 'x' + ms (BURY wrote it)  | deleted by kvledger: damaged, or `delete`  | evicted, that ms  |
    | absent                          | never stored here, written before          | None              |
    |                                 | tombstones, gone over G ago, or the        |                   |
    |                                 | tombstone itself evicted by maxmemory      |                   |

Either value may end in '|' + the tenant tag of the block's namespace (16 hex digits, store/forget.py): PUT writes
it, BURY keeps it, and a forget finds a tenant's tombstones by it, those of blocks gone before it included.

What bounds them: a tombstone lives at most G past its block, so Redis holds the tombstones of its
live blocks plus those of the blocks gone in the last G: at most the blocks put in the last TTL + G, and
each ~100 B of used_memory (72 B by MEMORY USAGE; a block's record in the cluster mode, metadata and
location only, is ~580 B). Under a maxmemory policy that evicts by LRU/LFU, tombstones (rarely read) go before
blocks, and a block evicted after its tombstone reads as never stored; under volatile-ttl they go
after (they expire later).

Refresh grain. A CHECK rewrites a block's expiry (and its tombstone's) only when it lags the target
(now + TTL − chain position) by more than TTL / REFRESH_GRAIN: a hit leaves every present block
expiring at least now + TTL × (1 − 1/64) (agent 3 d: within 68 min). Reading the expiry
(PEXPIRETIME) costs a CHECK less than rewriting it, so a prefix hit again within the grain (a
conversation's next turn, a shared system prompt) costs one read per block and nothing is written
or replicated; a refresh costs a read and two writes (the block's and its tombstone's).
"""

from __future__ import annotations

import struct

from kvledger.store.backend import read_name, stored_name

META = struct.Struct("<16sIIQddHH")  # parent, pos, size, xxh3_64, created, ttl_s, ns_len, cls_len (+ ns, cls)
TOMB_GRACE_S = 7 * 86_400.0   # a tombstone outlives its block by this (one value per store: every client alike)
REFRESH_GRAIN = 64            # a CHECK rewrites an expiry only when it lags its target by more than TTL / this

_NOW = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# Quota accounting (redis_quota.py). A block's field `q` is its bucket id (8 bytes) and its size (u32 LE); its
# member in its bucket's sorted set is its key (16 bytes) and that size; the group's hash holds the live bytes
# (`t`, and `b` + id per bucket; `n` + id the bucket's names). `tagof(k)` is the group part of a block's name
# (`{<tag>}`, '' on one server): the block's name less the block prefix (its length `blen`) and the key.
# release: the member out of its set and its bytes out of the totals, only if the member was there (so two
# releases of one block count once); the bytes it released.
_ACCOUNT = """
local function tagof(k, blen) return string.sub(k, blen + 1, #k - 16) end
local function member(k, q) return string.sub(k, #k - 15) .. string.sub(q, 9, 12) end
local function release(uprefix, zprefix, k, blen, q)
  local tag, id = tagof(k, blen), string.sub(q, 1, 8)
  if redis.call('ZREM', zprefix .. tag .. id, member(k, q)) == 0 then return 0 end
  local size, u = struct.unpack('<I4', q, 9), uprefix .. tagof(k, blen)
  redis.call('HINCRBY', u, 't', -size)
  if redis.call('HINCRBY', u, 'b' .. id, -size) <= 0 then redis.call('HDEL', u, 'b' .. id, 'n' .. id) end
  return size
end
"""

# mark_tomb: set a tombstone to `mark` (an eviction's 'x' + ms) for `grace` ms, keeping the tenant tag ('|' + hex)
# its PUT wrote (store/forget.py).
_MARK = """
local function mark_tomb(t, mark, grace)
  local old, tag = redis.call('GET', t), ''
  if old then
    local bar = string.find(old, '|', 1, true)
    if bar then tag = string.sub(old, bar) end
  end
  redis.call('SET', t, mark .. tag, 'PX', grace)
end
"""

# KEYS: blocks in chain order, all of one hash slot (their tombstones share it: named from them, not in KEYS).
# ARGV[1]: TTL ms; ARGV[2]: the expiry instant in unix ms ('': this server's TIME + TTL); ARGV[3]: each key's
# chain position, u32 little-endian ('': 0, 1, 2, …); ARGV[4]: the refresh grain ms; ARGV[5]: the tombstone
# name prefix ('': none); ARGV[6]: the length of the block name prefix; ARGV[7]: the grace ms; ARGV[8]: '1'
# to explain the first absent key; ARGV[9]: the prefix of the quota sets' names ('': no accounting). A block at
# chain position c lagging `at - c` by more than the grain is set to expire at `at - c`, or 1 ms before the block
# walked before it, whichever is sooner (tails first); its tombstone `grace` after it; its member in its bucket's
# set moves to `at - ttl` (the hit's instant: the set orders by last refresh). Returns how many leading KEYS are
# present, or with ARGV[8] and a tombstone of the first absent one 'COUNT expired|evicted UNIX_MS' (the table in
# the module docstring; one string: cheaper to parse than an array).
MATCH = _NOW + _ACCOUNT + """
local ttl, at, pos, grain = tonumber(ARGV[1]), ARGV[2], ARGV[3], tonumber(ARGV[4])
local tprefix, blen, grace = ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7])
local zprefix = ARGV[9]
local now = nil
local function explain(n, tomb)
  local v = redis.call('GET', tomb)
  if not v then return n end
  local bar = string.find(v, '|', 1, true)
  if bar then v = string.sub(v, 1, bar - 1) end
  if string.sub(v, 1, 1) == 'x' then return string.format('%d evicted %s', n, string.sub(v, 2)) end
  local expiry = redis.call('PEXPIRETIME', tomb) - tonumber(v)
  now = now or now_ms()
  if now >= expiry then return string.format('%d expired %d', n, expiry) end
  return string.format('%d evicted %d', n, now)
end
if at == '' then
  now = now_ms()
  at = now + ttl
else
  at = tonumber(at)
end
local prev = at + 1
for i, k in ipairs(KEYS) do
  local c = i - 1
  if pos ~= '' then c = struct.unpack('<I4', pos, 4 * i - 3) end
  local e = redis.call('PEXPIRETIME', k)
  if e == -2 then
    if ARGV[8] == '1' and tprefix ~= '' then return explain(i - 1, tprefix .. string.sub(k, blen + 1)) end
    return i - 1
  end
  if e >= 0 and e < at - c - grain then
    e = math.min(at - c, prev - 1)
    redis.call('PEXPIREAT', k, e)
    if tprefix ~= '' then redis.call('PEXPIREAT', tprefix .. string.sub(k, blen + 1), e + grace, 'GT') end
    if zprefix ~= '' then
      local q = redis.call('HGET', k, 'q')
      if q then
        redis.call('ZADD', zprefix .. tagof(k, blen) .. string.sub(q, 1, 8), 'XX', 'GT', at - ttl, member(k, q))
      end
    end
  end
  if e >= 0 then prev = e end
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

# KEYS[1]: the block; KEYS[2], if given: its tombstone. ARGV: metadata, the field of the bytes ('d') or of their
# location ('l'), its value, the expiry instant in unix ms, the tombstone's grace ms; then the quota names'
# prefixes ('': no accounting), the block prefix's length, the block's `q` (bucket id and size), its bucket's
# names, the instant in ms (its score); then the name of its tenant's hold in this slot ('': none;
# store/forget.py) and the tenant tag in hex its tombstone carries ('': none). Returns 2 when the tenant is held
# (nothing written), 0 when the block is present (written once), else 1. A member already in the set (its block
# expired by Redis, never released) is moved, not counted twice.
PUT = _ACCOUNT + """
if ARGV[12] ~= '' and redis.call('EXISTS', ARGV[12]) == 1 then return 2 end
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'm', ARGV[1], ARGV[2], ARGV[3])
redis.call('PEXPIREAT', KEYS[1], ARGV[4])
if KEYS[2] then
  local v = ARGV[5]
  if ARGV[13] ~= '' then v = v .. '|' .. ARGV[13] end
  redis.call('SET', KEYS[2], v, 'PXAT', tonumber(ARGV[4]) + tonumber(ARGV[5]))
end
local uprefix, zprefix, blen, q = ARGV[6], ARGV[7], tonumber(ARGV[8]), ARGV[9]
if uprefix ~= '' then
  local k, id = KEYS[1], string.sub(q, 1, 8)
  redis.call('HSET', k, 'q', q)
  if redis.call('ZADD', zprefix .. tagof(k, blen) .. id, ARGV[11], member(k, q)) == 1 then
    local size, u = struct.unpack('<I4', q, 9), uprefix .. tagof(k, blen)
    redis.call('HINCRBY', u, 't', size)
    redis.call('HINCRBY', u, 'b' .. id, size)
    redis.call('HSETNX', u, 'n' .. id, ARGV[10])
  end
end
return 1
"""

# KEYS[1]: the volume id's name; ARGV[1]: the id the store folder holds. Sets the name when it is absent or empty
# (kvledger before 2026-12-03 could record "" when two machines opened a fresh volume at once); returns what it
# holds then, which the caller compares with its own id.
CLAIM_VOLUME = """
local v = redis.call('GET', KEYS[1])
if not v or v == '' then
  redis.call('SET', KEYS[1], ARGV[1])
  return ARGV[1]
end
return v
"""

# KEYS: blocks of one hash slot. ARGV[1]: the tombstone name prefix ('': none); ARGV[2]: the length of the block
# name prefix; ARGV[3]: the grace ms; ARGV[4], ARGV[5]: the quota names' prefixes ('': no accounting). Deletes
# each block, releasing its bytes; the tombstone of each one deleted says 'x' + this server's time in ms
# (evicted then), keeps the tenant tag its PUT wrote, and lives `grace` from now. Returns how many blocks were
# deleted.
BURY = _NOW + _ACCOUNT + _MARK + """
local tprefix, blen, grace, uprefix, zprefix = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4], ARGV[5]
local mark, n = string.format('x%d', now_ms()), 0
for _, k in ipairs(KEYS) do
  local q = uprefix ~= '' and redis.call('HGET', k, 'q')
  if redis.call('DEL', k) == 1 then
    n = n + 1
    if tprefix ~= '' then mark_tomb(tprefix .. string.sub(k, blen + 1), mark, grace) end
    if q then release(uprefix, zprefix, k, blen, q) end
  end
end
return n
"""

# Eviction and its sweep (redis_quota.py). KEYS: blocks of one hash slot; ARGV[1..5] as BURY's; ARGV[6]: 'evict'
# or 'sweep'; then per key its `q` and the score eviction planned it at. evict: a block whose member is still at
# that score (no hit since, no other evictor first) is released and deleted, with an evicted tombstone; sweep:
# the member of a block Redis no longer holds (expired, or removed behind kvledger's back) is released, a live
# one left alone. Returns {blocks deleted, bytes released} (released ≥ deleted: stale members count bytes only).
EVICT = _NOW + _ACCOUNT + _MARK + """
local tprefix, blen, grace, uprefix, zprefix, mode = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local mark, n, freed = string.format('x%d', now_ms()), 0, 0
for i, k in ipairs(KEYS) do
  local q, planned = ARGV[5 + 2 * i], tonumber(ARGV[6 + 2 * i])
  local live = redis.call('EXISTS', k) == 1
  local score = tonumber(redis.call('ZSCORE', zprefix .. tagof(k, blen) .. string.sub(q, 1, 8), member(k, q)))
  if score and score <= planned and (mode == 'evict' or not live) then
    freed = freed + release(uprefix, zprefix, k, blen, q)
    if live and redis.call('DEL', k) == 1 then
      n = n + 1
      if tprefix ~= '' then mark_tomb(tprefix .. string.sub(k, blen + 1), mark, grace) end
    end
  end
end
return {n, freed}
"""

# A forget (redis_forget.py). KEYS: blocks of one hash slot; ARGV[1..5] as BURY's. Deletes each block, releasing its
# bytes, and its tombstone: a forgotten block leaves none. Returns how many blocks were deleted.
FORGET = _ACCOUNT + """
local tprefix, blen, uprefix, zprefix = ARGV[1], tonumber(ARGV[2]), ARGV[4], ARGV[5]
local n = 0
for _, k in ipairs(KEYS) do
  local q = uprefix ~= '' and redis.call('HGET', k, 'q')
  n = n + redis.call('DEL', k)
  if q then release(uprefix, zprefix, k, blen, q) end
  if tprefix ~= '' then redis.call('DEL', tprefix .. string.sub(k, blen + 1)) end
end
return n
"""

# What a forgotten tenant's buckets still count in one group (redis_quota.py): members of blocks Redis expired by
# itself, never released. KEYS[1]: the group's usage hash; ARGV[1]: its sets' name prefix (with the group's tag);
# ARGV[2..]: the tenant's bucket ids. Each bucket's set goes, and its bytes and names leave the hash. Returns the
# members dropped.
FORGET_BUCKETS = """
local n = 0
for i = 2, #ARGV do
  local id = ARGV[i]
  n = n + redis.call('ZCARD', ARGV[1] .. id)
  redis.call('DEL', ARGV[1] .. id)
  local b = tonumber(redis.call('HGET', KEYS[1], 'b' .. id) or '0')
  if b ~= 0 then redis.call('HINCRBY', KEYS[1], 't', -b) end
  redis.call('HDEL', KEYS[1], 'b' .. id, 'n' .. id)
end
return n
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
