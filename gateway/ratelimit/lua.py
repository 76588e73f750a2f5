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
# marker of this lease, tokens used in the budget's day and month (counters). ARGV: window ms, rpm, tpm, max
# concurrency, estimated tokens, lease id, lease ttl ms, concurrency retry ms, marker ttl ms, daily budget, monthly
# budget, ms until the day ends, ms until the month ends. Every limit is checked before anything is written, so a
# refused request consumes nothing. An admitted lease leaves a marker holding its answer: the same lease admitted
# again (a retry after a lost reply) gets that answer and is not charged twice, budgets included. A lease already
# released is refused: its admission timed out in the gateway, waited in a stalled Redis, and its release overtook it.
ACQUIRE = (
    BUCKET
    + """
if redis.call('EXISTS', KEYS[5]) == 1 then return {1, tonumber(ARGV[8]), 0, 0, 0, 0} end
local done = redis.call('GET', KEYS[4])
if done then
  local answer = {0, 0}
  for number in string.gmatch(done, '%d+') do answer[#answer + 1] = tonumber(number) end
  return answer
end
local rpm, tpm, conc = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local cost, ttl = tonumber(ARGV[5]), tonumber(ARGV[7])
local daily, monthly = tonumber(ARGV[10]), tonumber(ARGV[11])
local req, tok = level(KEYS[1], rpm), level(KEYS[2], tpm)
local day, month = tonumber(redis.call('GET', KEYS[6]) or '0'), tonumber(redis.call('GET', KEYS[7]) or '0')
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
-- A budget admits a request only while its up-front charge fits in what is left; it refills when its window ends.
if daily > 0 and day + cost > daily then refused = bit.bor(refused, 16); retry = math.max(retry, tonumber(ARGV[12])) end
if monthly > 0 and month + cost > monthly then
  refused = bit.bor(refused, 16); retry = math.max(retry, tonumber(ARGV[13]))
end
if refused == 0 then
  if rpm > 0 then req = req + window; store(KEYS[1], req, rpm) end
  if tpm > 0 and cost > 0 then tok = tok + cost * window; store(KEYS[2], tok, tpm) end
  if (daily > 0 or monthly > 0) and cost > 0 then
    day = redis.call('INCRBY', KEYS[6], cost)
    month = redis.call('INCRBY', KEYS[7], cost)
    if redis.call('PTTL', KEYS[6]) < 0 then redis.call('PEXPIRE', KEYS[6], ARGV[12] + 3600000) end
    if redis.call('PTTL', KEYS[7]) < 0 then redis.call('PEXPIRE', KEYS[7], ARGV[13] + 3600000) end
  end
  if conc > 0 then
    redis.call('ZADD', KEYS[3], now + ttl, ARGV[6])
    redis.call('PEXPIRE', KEYS[3], 2 * ttl)
  end
  redis.call('SET', KEYS[4], string.format('%.0f %.0f %.0f %.0f', req, tok, day, month), 'PX', ARGV[9])
end
return {refused, retry, req, tok, day, month}
"""
)

# KEYS: requests bucket, tokens bucket, leases, usage of the day (HASH), last used (ms), release marker of this
# lease, its admission marker, tokens used in the budget's day and month of the lease. ARGV: window ms, tpm, used -
# estimated tokens, lease id, used tokens, retention seconds, requests served (0|1), marker ttl ms, admission
# unconfirmed (0|1), used - tokens charged to the budget up front, ms until the budget's day and month end (as at
# admission), the API (route label), prompt, completion and reasoning tokens as the engine reported them (-1: not
# reported), rpm. Runs once per lease: a second release of it (a retry after a lost reply) changes nothing, so
# neither a bucket, a budget nor the usage is charged twice. A request not served (it never reached the engine:
# refused by the engine's admission, the engine down) gives its request back to the requests bucket and is not in
# the usage. The release of an admission the gateway never saw answered refunds its charge (buckets and budgets)
# only if the admission ran (its marker is there; a lapsed marker keeps the charge, erring against the key).
RELEASE = (
    BUCKET
    + """
if not redis.call('SET', KEYS[6], '1', 'NX', 'PX', ARGV[8]) then return 0 end
local tpm, diff, rpm = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[17])
local budget = tonumber(ARGV[10])
local ran = ARGV[9] ~= '1' or redis.call('EXISTS', KEYS[7]) == 1
if not ran then diff = 0; budget = 0 end
if tpm > 0 and diff ~= 0 then store(KEYS[2], math.max(0, level(KEYS[2], tpm) + diff * window), tpm) end
if ARGV[7] == '0' and ran and rpm > 0 then store(KEYS[1], math.max(0, level(KEYS[1], rpm) - window), rpm) end
redis.call('ZREM', KEYS[3], ARGV[4])
if budget ~= 0 then
  for i, counter in ipairs({KEYS[8], KEYS[9]}) do
    if budget > 0 or redis.call('EXISTS', counter) == 1 then
      if redis.call('INCRBY', counter, budget) <= 0 then
        redis.call('DEL', counter)
      elseif redis.call('PTTL', counter) < 0 then
        redis.call('PEXPIRE', counter, math.max(1, tonumber(ARGV[10 + i])) + 3600000)
      end
    end
  end
end
if ARGV[7] == '1' then
  local api = ARGV[13]
  redis.call('HINCRBY', KEYS[4], 'requests', 1)
  redis.call('HINCRBY', KEYS[4], 'tokens', ARGV[5])
  redis.call('HINCRBY', KEYS[4], api .. ':requests', 1)
  redis.call('HINCRBY', KEYS[4], api .. ':tokens', ARGV[5])
  for i, kind in ipairs({'prompt_tokens', 'completion_tokens', 'reasoning_tokens'}) do
    local count = tonumber(ARGV[13 + i])
    if count > 0 then redis.call('HINCRBY', KEYS[4], api .. ':' .. kind, count) end
  end
  redis.call('EXPIRE', KEYS[4], ARGV[6])
  redis.call('SET', KEYS[5], string.format('%.0f', now), 'EX', ARGV[6])
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
