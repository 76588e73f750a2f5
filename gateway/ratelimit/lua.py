"""Lua of the rate limiter: admission, release and lease renewal, each one atomic round trip.

Text only, no imports. Every key a script touches carries the key name's hash tag (`{name}`), so each runs
in one Redis Cluster slot. The bucket arithmetic is described in `ratelimit.redis`.
"""

BUCKET = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local window = tonumber(ARGV[1])
local function level(key, limit)
  if limit <= 0 then return 0 end
  local state = redis.call('HMGET', key, 'u', 't')
  local used = tonumber(state[1])
  if not used then return 0 end
  local elapsed = now - tonumber(state[2])
  if elapsed > 0 then used = math.max(0, used - elapsed * limit) end
  return used
end
local function wait(used, amount, limit)
  local over = used + amount * window - limit * window
  if over <= 0 then return 0 end
  return math.ceil(over / limit)
end
local function store(key, used, limit)
  if used <= 0 then redis.call('DEL', key) return end
  redis.call('HSET', key, 'u', string.format('%.0f', used), 't', string.format('%.0f', now))
  redis.call('PEXPIRE', key, math.ceil(used / limit) + 1000)
end
"""

# KEYS: requests bucket, tokens bucket, leases (ZSET, score = expiry ms), admission marker of this lease, release
# marker of this lease. ARGV: window ms, rpm, tpm, max concurrency, estimated tokens, lease id, lease ttl ms,
# concurrency retry ms, marker ttl ms. Every limit is checked before anything is written, so a refused request
# consumes nothing. An admitted lease leaves a marker holding its answer: the same lease admitted again (a retry
# after a lost reply) gets that answer and is not charged twice. A lease already released is refused: its
# admission timed out in the gateway, waited in a stalled Redis, and its release overtook it.
ACQUIRE = (
    BUCKET
    + """
if redis.call('EXISTS', KEYS[5]) == 1 then return {1, tonumber(ARGV[8]), 0, 0} end
local done = redis.call('GET', KEYS[4])
if done then
  local gap = string.find(done, ' ')
  return {0, 0, tonumber(string.sub(done, 1, gap - 1)), tonumber(string.sub(done, gap + 1))}
end
local rpm, tpm, conc = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local cost, ttl = tonumber(ARGV[5]), tonumber(ARGV[7])
local req, tok = level(KEYS[1], rpm), level(KEYS[2], tpm)
local refused, retry = 0, 0
if conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if redis.call('ZCARD', KEYS[3]) >= conc then refused = refused + 1; retry = tonumber(ARGV[8]) end
end
if rpm > 0 then
  local w = wait(req, 1, rpm)
  if w > 0 then refused = refused + 2; retry = math.max(retry, w) end
end
if tpm > 0 then
  if cost > tpm then
    refused = refused + 8; retry = math.max(retry, window)
  else
    local w = wait(tok, cost, tpm)
    if w > 0 then refused = refused + 4; retry = math.max(retry, w) end
  end
end
if refused == 0 then
  if rpm > 0 then req = req + window; store(KEYS[1], req, rpm) end
  if tpm > 0 and cost > 0 then tok = tok + cost * window; store(KEYS[2], tok, tpm) end
  if conc > 0 then
    redis.call('ZADD', KEYS[3], now + ttl, ARGV[6])
    redis.call('PEXPIRE', KEYS[3], 2 * ttl)
  end
  redis.call('SET', KEYS[4], string.format('%.0f %.0f', req, tok), 'PX', ARGV[9])
end
return {refused, retry, req, tok}
"""
)

# KEYS: tokens bucket, leases, usage of the day (HASH), last used (ms), release marker of this lease, its admission
# marker. ARGV: window ms, tpm, used - estimated tokens, lease id, used tokens, retention seconds, requests served
# (0|1), marker ttl ms, admission unconfirmed (0|1). Runs once per lease: a second release of it (a retry after a
# lost reply) changes nothing. The release of an admission the gateway never saw answered refunds its charge only
# if the admission ran (its marker is there; a lapsed marker keeps the charge, erring against the key).
RELEASE = (
    BUCKET
    + """
if not redis.call('SET', KEYS[5], '1', 'NX', 'PX', ARGV[8]) then return 0 end
local tpm, diff = tonumber(ARGV[2]), tonumber(ARGV[3])
if ARGV[9] == '1' and redis.call('EXISTS', KEYS[6]) == 0 then diff = 0 end
if tpm > 0 and diff ~= 0 then store(KEYS[1], math.max(0, level(KEYS[1], tpm) + diff * window), tpm) end
redis.call('ZREM', KEYS[2], ARGV[4])
if ARGV[7] == '1' then
  redis.call('HINCRBY', KEYS[3], 'requests', 1)
  redis.call('HINCRBY', KEYS[3], 'tokens', ARGV[5])
  redis.call('EXPIRE', KEYS[3], ARGV[6])
  redis.call('SET', KEYS[4], string.format('%.0f', now), 'EX', ARGV[6])
end
return 1
"""
)

# KEYS: leases. ARGV: ttl ms, lease ids. Returns the ids that had already expired (their slots are gone).
RENEW = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local ttl = tonumber(ARGV[1])
local lost = {}
for i = 2, #ARGV do
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) then
    redis.call('ZADD', KEYS[1], 'XX', now + ttl, ARGV[i])
  else
    lost[#lost + 1] = ARGV[i]
  end
end
redis.call('PEXPIRE', KEYS[1], 2 * ttl)
return lost
"""
