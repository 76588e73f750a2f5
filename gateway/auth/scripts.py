"""Lua scripts of the key store: each admin change is atomic and publishes its invalidation in the same step.

Text only, no imports. Every key they touch shares the hash tag `{keys}` (one Redis Cluster slot), which
is why LOOKUP and LIST may read records whose names they only learn inside the script.
"""

# KEYS: digest index. ARGV: record prefix. The record of the key with this digest, or nil.
LOOKUP = """
local name = redis.call('GET', KEYS[1])
if not name then return false end
return redis.call('HGETALL', ARGV[1] .. name)
"""

# KEYS: record, digest index, name set. ARGV: name, then the record as field/value pairs.
# 1 also when the record exists with this very digest: our own earlier try, whose reply was lost (a retry).
CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return redis.call('GET', KEYS[2]) == ARGV[1] and 1 or 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('SET', KEYS[2], ARGV[1])
redis.call('SADD', KEYS[3], ARGV[1])
return 1
"""

# KEYS: name set. ARGV: record prefix. Every record.
LIST = """
local out = {}
for _, name in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  out[#out + 1] = redis.call('HGETALL', ARGV[1] .. name)
end
return out
"""

# KEYS: record. ARGV: digest prefix, channel, name, revoked-at. 0 if no such key.
REVOKE = """
local digest = redis.call('HGET', KEYS[1], 'digest')
if not digest then return 0 end
if digest ~= '' then redis.call('DEL', ARGV[1] .. digest) end
redis.call('HSET', KEYS[1], 'revoked', '1', 'digest', '', 'revoked_at', ARGV[4])
redis.call('PUBLISH', ARGV[2], ARGV[3])
return 1
"""

# KEYS: record, name set. ARGV: digest prefix, channel, name. 0 if no such key. The record goes for good (its name
# may be used again); the audit trail keeps what it was.
DELETE = """
local digest = redis.call('HGET', KEYS[1], 'digest')
if not digest then return 0 end
if digest ~= '' then redis.call('DEL', ARGV[1] .. digest) end
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[3])
redis.call('PUBLISH', ARGV[2], ARGV[3])
return 1
"""

# KEYS: record, new digest index. ARGV: digest prefix, channel, name, new digest, new prefix.
# 0 if no such key, -1 if it is revoked.
ROTATE = """
local rec = redis.call('HMGET', KEYS[1], 'digest', 'revoked')
if not rec[1] then return 0 end
if rec[2] == '1' then return -1 end
if rec[1] ~= '' then redis.call('DEL', ARGV[1] .. rec[1]) end
redis.call('SET', KEYS[2], ARGV[3])
redis.call('HSET', KEYS[1], 'digest', ARGV[4], 'prefix', ARGV[5])
redis.call('PUBLISH', ARGV[2], ARGV[3])
return 1
"""

# KEYS: record. ARGV: channel, name, then field/value pairs. 0 if no such key, -1 if it is revoked.
UPDATE = """
local revoked = redis.call('HGET', KEYS[1], 'revoked')
if not revoked then return 0 end
if revoked == '1' then return -1 end
if #ARGV > 2 then redis.call('HSET', KEYS[1], unpack(ARGV, 3)) end
redis.call('PUBLISH', ARGV[1], ARGV[2])
return 1
"""
