"""Lua scripts of the key store: each admin change is atomic and publishes its invalidation and appends its
audit-trail entry in the same step.

Text only, no imports. Every key they touch shares the hash tag `{keys}` (one Redis Cluster slot), which
is why LOOKUP and LIST may read records whose names they only learn inside the script.

A change's audit entry holds the record as it was just before and just after, read inside the script: no other
change can come between (an operator's "before" is never stale) and no change goes unrecorded (a CLI killed
between the change and a later append). The scripts that change a record take the trail as their last KEYS
and its cap, the operator and the action as their last three ARGV (`_AUDIT`).
"""

# The record's fields but its digest (the secret's keyed hash stays out of the trail), as a Lua table.
_AUDIT = """
local function audit_record(key)
  local raw = redis.call('HGETALL', key)
  local out = {}
  for i = 1, #raw, 2 do
    if raw[i] ~= 'digest' then out[raw[i]] = raw[i + 1] end
  end
  return out
end
local function audit(before, after)
  local record = next(after) and after or before
  local now = redis.call('TIME')
  redis.call('XADD', KEYS[#KEYS], 'MAXLEN', '~', ARGV[#ARGV - 2], '*',
    'at', now[1] .. string.format('%06d', tonumber(now[2])), 'operator', ARGV[#ARGV - 1], 'action', ARGV[#ARGV],
    'name', record['name'] or '', 'prefix', record['prefix'] or '',
    'before_record', cjson.encode(before), 'after_record', cjson.encode(after))
end
"""

# KEYS: digest index. ARGV: record prefix. The record of the key with this digest, or nil.
LOOKUP = """
local name = redis.call('GET', KEYS[1])
if not name then return false end
return redis.call('HGETALL', ARGV[1] .. name)
"""

# KEYS: record, digest index, name set, trail. ARGV: name, then the record as field/value pairs, then the audit's.
# 1 also when the record exists with this very digest: our own earlier try, whose reply was lost (a retry; its
# entry is in the trail already).
CREATE = (
    _AUDIT
    + """
if redis.call('EXISTS', KEYS[1]) == 1 then return redis.call('GET', KEYS[2]) == ARGV[1] and 1 or 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2, #ARGV - 3))
redis.call('SET', KEYS[2], ARGV[1])
redis.call('SADD', KEYS[3], ARGV[1])
audit({}, audit_record(KEYS[1]))
return 1
"""
)

# KEYS: name set. ARGV: record prefix. Every record.
LIST = """
local out = {}
for _, name in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  out[#out + 1] = redis.call('HGETALL', ARGV[1] .. name)
end
return out
"""

# KEYS: record, trail. ARGV: digest prefix, channel, name, revoked-at, then the audit's. 0 if no such key.
REVOKE = (
    _AUDIT
    + """
local digest = redis.call('HGET', KEYS[1], 'digest')
if not digest then return 0 end
local before = audit_record(KEYS[1])
if digest ~= '' then redis.call('DEL', ARGV[1] .. digest) end
redis.call('HSET', KEYS[1], 'revoked', '1', 'digest', '', 'revoked_at', ARGV[4])
redis.call('PUBLISH', ARGV[2], ARGV[3])
audit(before, audit_record(KEYS[1]))
return 1
"""
)

# KEYS: record, name set, trail. ARGV: digest prefix, channel, name, then the audit's. 0 if no such key. The
# record goes for good (its name may be used again); the audit trail keeps what it was.
DELETE = (
    _AUDIT
    + """
local digest = redis.call('HGET', KEYS[1], 'digest')
if not digest then return 0 end
local before = audit_record(KEYS[1])
if digest ~= '' then redis.call('DEL', ARGV[1] .. digest) end
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[3])
redis.call('PUBLISH', ARGV[2], ARGV[3])
audit(before, {})
return 1
"""
)

# KEYS: record, new digest index, trail. ARGV: digest prefix, channel, name, new digest, new prefix, then the
# audit's. 0 if no such key, -1 if it is revoked.
ROTATE = (
    _AUDIT
    + """
local rec = redis.call('HMGET', KEYS[1], 'digest', 'revoked')
if not rec[1] then return 0 end
if rec[2] == '1' then return -1 end
local before = audit_record(KEYS[1])
if rec[1] ~= '' then redis.call('DEL', ARGV[1] .. rec[1]) end
redis.call('SET', KEYS[2], ARGV[3])
redis.call('HSET', KEYS[1], 'digest', ARGV[4], 'prefix', ARGV[5])
redis.call('PUBLISH', ARGV[2], ARGV[3])
audit(before, audit_record(KEYS[1]))
return 1
"""
)

# KEYS: record, trail. ARGV: channel, name, then field/value pairs, then the audit's. 0 if no such key, -1 if it
# is revoked.
UPDATE = (
    _AUDIT
    + """
local revoked = redis.call('HGET', KEYS[1], 'revoked')
if not revoked then return 0 end
if revoked == '1' then return -1 end
local before = audit_record(KEYS[1])
if #ARGV > 5 then redis.call('HSET', KEYS[1], unpack(ARGV, 3, #ARGV - 3)) end
redis.call('PUBLISH', ARGV[1], ARGV[2])
audit(before, audit_record(KEYS[1]))
return 1
"""
)
