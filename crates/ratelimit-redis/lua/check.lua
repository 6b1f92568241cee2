-- check.lua: one rate-limit decision for one client key, all rules at once.
--
-- An integer translation of `ratelimit_core::algo::decide`: the same formulas, evaluated
-- on the state as it stands, committed all or nothing. Every value is an integer below
-- 2^53 (the core refuses rules outside that bound), so Lua's doubles hold them exactly;
-- divisions go through `divmod`, never `/` or `%` alone, and numbers are written back
-- with '%.0f', never `tostring` (which would switch to exponent notation).
--
-- KEYS[1]  block marker of the client key: string "<until µs>" or "inf"
-- KEYS[2]  rule state of (client key, rule set): hash, field "<i>" = state of rule i,
--          space-separated integers (fixed window "index count"; sliding window counter
--          "index c0 .. cp"; token bucket "level last"; GCRA / leaky bucket "us frac")
-- KEYS[3]  shared sliding log of (client key, rule set): list of µs timestamps, newest first
--
-- ARGV[1]  now, µs since the Unix epoch; "" = read the Redis server's TIME
-- ARGV[2]  cost; 0 peeks (evaluated as 1, nothing written)
-- ARGV[3]  TTL floor in ms, applied only when ARGV[1] is given (the injected clock
--          need not run at Redis's pace)
-- ARGV[4]  entries the shared log keeps (RuleSet::log_limit)
-- ARGV[5]  longest sliding-log period, µs (RuleSet::log_period_us)
-- ARGV[6]  number of rules n, then 5 values per rule: code, limit, period_us, a, b
--            1 fixed window
--            2 sliding window counter   a = precision
--            3 sliding log
--            4 token bucket             a = capacity
--            5 GCRA / leaky bucket      a = capacity in emission intervals,
--                                       b = requests let through without delay (0 = all)
--
-- Returns
--   {1, retry_us}   blocked; retry_us = -1 for a block without end
--   {0, delay_us, then per rule: allowed (1/0), remaining, reset_us, retry_us}
--
-- Errors: WRONGTYPE from Redis when a key holds another type; "RLSTATE ..." when a key
-- holds a value this script did not write.

local floor = math.floor

-- Exact floor division of non-negative integers below 2^53: the double quotient may round
-- across an integer, the exact remainder corrects it.
local function divmod(a, b)
  local q = floor(a / b)
  local r = a - q * b
  if r < 0 then
    q = q - 1
    r = r + b
  elseif r >= b then
    q = q + 1
    r = r - b
  end
  return q, r
end

local function div(a, b)
  local q = divmod(a, b)
  return q
end

local function div_ceil(a, b)
  local q, r = divmod(a, b)
  if r > 0 then
    return q + 1
  end
  return q
end

local function sat_sub(a, b)
  if a > b then
    return a - b
  end
  return 0
end

local function int(x)
  return string.format('%.0f', x)
end

local function corrupt(what)
  return redis.error_reply('RLSTATE ' .. what .. ' holds a value this store did not write')
end

local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
else
  now = tonumber(ARGV[1])
end
local cost = tonumber(ARGV[2])
local ttl_floor = tonumber(ARGV[3])
local log_limit = tonumber(ARGV[4])
local log_period = tonumber(ARGV[5])
local n = tonumber(ARGV[6])
local c = cost
if c < 1 then
  c = 1
end

-- Blocks first: a blocked key consults no rule.
local block = redis.call('GET', KEYS[1])
if block then
  if block == 'inf' then
    return {1, -1}
  end
  local untl = tonumber(block)
  if not untl then
    return corrupt('the block marker')
  end
  if untl > now then
    return {1, untl - now}
  end
  redis.call('DEL', KEYS[1])
end

-- Sets a key's TTL to end at `at` (µs): exactly, on Redis's clock, or relative to the
-- injected clock with a floor.
local function expire_at(key, at)
  if ARGV[1] == '' then
    redis.call('PEXPIREAT', key, int(div_ceil(at, 1000)))
  else
    local ms = 0
    if at > now then
      ms = div_ceil(at - now, 1000)
    end
    if ms < ttl_floor then
      ms = ttl_floor
    end
    redis.call('PEXPIRE', key, int(ms))
  end
end

local rules = {}
local fields = {}
local has_log = false
for i = 1, n do
  local o = 6 + (i - 1) * 5
  local r = {
    code = tonumber(ARGV[o + 1]),
    limit = tonumber(ARGV[o + 2]),
    period = tonumber(ARGV[o + 3]),
    a = tonumber(ARGV[o + 4]),
    b = tonumber(ARGV[o + 5]),
  }
  rules[i] = r
  if r.code == 3 then
    has_log = true
  else
    fields[#fields + 1] = tostring(i)
  end
end

-- Current states, parsed; nil = fresh.
local states = {}
if #fields > 0 then
  local raw = redis.call('HMGET', KEYS[2], unpack(fields))
  for j, f in ipairs(fields) do
    local v = raw[j]
    if v then
      local i = tonumber(f)
      local r = rules[i]
      local t = {}
      for x in string.gmatch(v, '%d+') do
        t[#t + 1] = tonumber(x)
      end
      local want = 2
      if r.code == 2 then
        want = r.a + 2
      end
      if #t ~= want then
        return corrupt('rule state ' .. f)
      end
      states[i] = t
    end
  end
end

-- The shared log: length and newest entry, read once.
local log_len, log_newest = 0, nil
local function log_at(idx)
  local v = redis.call('LINDEX', KEYS[3], idx)
  if not v then
    return nil
  end
  local ts = tonumber(v)
  if not ts then
    error({err = 'RLSTATE the sliding log holds a value this store did not write'})
  end
  return ts
end
if has_log then
  log_len = redis.call('LLEN', KEYS[3])
  if log_len > 0 then
    log_newest = log_at(0)
  end
end

-- Sliding window counter: the count of sub-window k in state s.
local function sub_count(s, p, k)
  if s and k <= s[1] and s[1] - k <= p then
    return s[2 + s[1] - k]
  end
  return 0
end

-- Expiry of each algorithm's state (the moment it is equivalent to fresh), µs; 0 = fresh.
local function expires(r, s)
  if not s then
    return 0
  end
  if r.code == 1 then
    return (s[1] + 1) * r.period
  elseif r.code == 2 then
    local p = r.a
    local sub = div(r.period, p)
    for d = 0, p do
      if s[2 + d] > 0 then
        return (s[1] - d + p + 1) * sub
      end
    end
    return 0
  elseif r.code == 4 then
    local full = r.a * r.period
    local level = s[1]
    if level > full then
      level = full
    end
    return s[2] + div_ceil(full - level, r.limit)
  else
    local e = s[1]
    if s[2] > 0 then
      e = e + 1
    end
    return e
  end
end

local function token_level(r, s)
  local full = r.a * r.period
  if not s then
    return full
  end
  local level, last = s[1], s[2]
  local elapsed = sat_sub(now, last)
  local held = level
  if held > full then
    held = full
  end
  if elapsed >= div_ceil(full - held, r.limit) then
    return full
  end
  return level + elapsed * r.limit
end

local function tat_base(s)
  if s and (s[1] > now or (s[1] == now and s[2] > 0)) then
    return s[1], s[2]
  end
  return now, 0
end

local function tat_add(us, frac, units, r)
  local q, m = divmod(frac + units * r.period, r.limit)
  return us + q, m
end

-- Evaluate every rule on the state as it stands.
local evals = {}
local all_allowed = true
for i = 1, n do
  local r = rules[i]
  local s = states[i]
  local limit, period = r.limit, r.period
  local e
  if r.code == 1 then
    local index = div(now, period)
    local count = 0
    if s and s[1] == index then
      count = s[2]
    end
    local reset = (index + 1) * period - now
    local reset_before = 0
    if count > 0 then
      reset_before = reset
    end
    e = {
      allowed = count + c <= limit,
      remaining = sat_sub(limit, count),
      reset = reset_before,
      retry = reset,
      delay = 0,
    }
  elseif r.code == 2 then
    local p = r.a
    local sub = div(period, p)
    local cur, elapsed = divmod(now, sub)
    local old = 0
    if cur >= p then
      old = sub_count(s, p, cur - p)
    end
    local recent = 0
    for k = 0, p - 1 do
      if k <= cur then
        recent = recent + sub_count(s, p, cur - k)
      end
    end
    local weighted = old * (sub - elapsed)
    local allowed = weighted + sub * (recent + c) <= limit * sub
    local remaining = sat_sub(div(sat_sub(limit * sub, weighted), sub), recent)
    local retry = 0
    if not allowed then
      -- The first instant a request of cost c is admitted, sub-window by sub-window; the
      -- recent sum slides by one sub-window per step, keeping the search O(precision).
      local rec = recent
      for j = 0, p + 1 do
        local w = cur + j
        if j > 0 then
          rec = rec + sub_count(s, p, w)
          if w - p >= 0 then
            rec = rec - sub_count(s, p, w - p)
          end
        end
        local old_j = 0
        if w >= p then
          old_j = sub_count(s, p, w - p)
        end
        if rec + c <= limit then
          local x = (limit - rec - c) * sub
          local start = nil
          if old_j == 0 then
            start = 0
          else
            local q = div(x, old_j)
            if q > 0 then
              start = sat_sub(sub, q)
            end
          end
          if start then
            local t = w * sub + start
            if t > now then
              retry = t - now
              break
            end
          end
        end
      end
    end
    e = {
      allowed = allowed,
      remaining = remaining,
      reset = sat_sub(expires(r, s), now),
      retry = retry,
      delay = 0,
    }
  elseif r.code == 3 then
    local nth = nil
    if limit - c < log_len then
      nth = log_at(limit - c)
    end
    -- Entries still inside this rule's window form a prefix of the log (newest first):
    -- binary search for its length among the first `limit` entries.
    local lo, hi = 0, math.min(log_len, limit)
    while lo < hi do
      local mid = floor((lo + hi) / 2)
      if log_at(mid) + period > now then
        lo = mid + 1
      else
        hi = mid
      end
    end
    local reset = 0
    if log_newest then
      reset = sat_sub(log_newest + period, now)
    end
    local retry = 0
    if nth then
      retry = sat_sub(nth + period, now)
    end
    e = {
      allowed = (not nth) or nth + period <= now,
      remaining = limit - lo,
      reset = reset,
      retry = retry,
      delay = 0,
    }
  elseif r.code == 4 then
    local level = token_level(r, s)
    local need = c * period
    local full = r.a * period
    e = {
      allowed = level >= need,
      remaining = div(level, period),
      reset = div_ceil(full - level, limit),
      retry = div_ceil(sat_sub(need, level), limit),
      delay = 0,
      level = level,
    }
  else
    local cap, no_delay = r.a, r.b
    local bus, bfrac = tat_base(s)
    local nus, nfrac = tat_add(bus, bfrac, c, r)
    local diff_base = (bus - now) * limit + bfrac
    local diff_next = (nus - now) * limit + nfrac
    local max = cap * period
    local allowed = diff_next <= max
    local delay = 0
    if no_delay > 0 and allowed then
      delay = div_ceil(sat_sub(diff_next, no_delay * period), limit)
    end
    e = {
      allowed = allowed,
      remaining = div(sat_sub(max, diff_base), period),
      reset = div_ceil(diff_base, limit),
      retry = div_ceil(sat_sub(diff_next, max), limit),
      delay = delay,
      bus = bus,
      bfrac = bfrac,
    }
  end
  evals[i] = e
  if not e.allowed then
    all_allowed = false
  end
end

local delay = 0
for i = 1, n do
  if evals[i].delay > delay then
    delay = evals[i].delay
  end
end

local out = {0, delay}

if not (all_allowed and cost > 0) then
  for i = 1, n do
    local e = evals[i]
    local retry = 0
    if not e.allowed then
      retry = e.retry
    end
    out[#out + 1] = e.allowed and 1 or 0
    out[#out + 1] = e.remaining
    out[#out + 1] = e.reset
    out[#out + 1] = retry
  end
  return out
end

-- Commit: every rule is charged `cost`.
local hset = {}
local state_expires = 0
for i = 1, n do
  local r = rules[i]
  local s = states[i]
  local e = evals[i]
  local period = r.period
  local after = nil
  if r.code == 1 then
    local index = div(now, period)
    if s and s[1] == index then
      after = {index, s[2] + cost}
    else
      after = {index, cost}
    end
  elseif r.code == 2 then
    local p = r.a
    local cur = div(now, div(period, p))
    if s and s[1] <= cur then
      local shift = cur - s[1]
      if shift > p + 1 then
        shift = p + 1
      end
      after = {cur}
      for d = 0, p do
        if d < shift then
          after[2 + d] = 0
        else
          after[2 + d] = s[2 + d - shift]
        end
      end
      after[2] = after[2] + cost
    elseif s then
      -- The clock went back: count the units in the newest sub-window.
      after = s
      after[2] = after[2] + cost
    else
      after = {cur, cost}
      for d = 1, p do
        after[2 + d] = 0
      end
    end
  elseif r.code == 4 then
    local last = now
    if s and s[2] > now then
      last = s[2]
    end
    after = {e.level - cost * period, last}
  elseif r.code == 5 then
    local us, frac = tat_add(e.bus, e.bfrac, cost, r)
    after = {us, frac}
  end
  local reset
  if after then
    local words = {}
    for d = 1, #after do
      words[d] = int(after[d])
    end
    hset[#hset + 1] = tostring(i)
    hset[#hset + 1] = table.concat(words, ' ')
    local exp = expires(r, after)
    if exp > state_expires then
      state_expires = exp
    end
    reset = sat_sub(exp, now)
  else
    -- Sliding log: after the push its newest entry is `now`.
    reset = period
  end
  out[#out + 1] = 1
  out[#out + 1] = sat_sub(e.remaining, cost)
  out[#out + 1] = reset
  out[#out + 1] = 0
end

if #hset > 0 then
  redis.call('HSET', KEYS[2], unpack(hset))
  expire_at(KEYS[2], state_expires)
end

if has_log then
  -- Push `cost` copies of now in chunks (Lua's unpack has a stack limit), keep log_limit.
  local stamp = int(now)
  local left = cost
  while left > 0 do
    local chunk = {}
    local m = math.min(left, 1000)
    for k = 1, m do
      chunk[k] = stamp
    end
    redis.call('LPUSH', KEYS[3], unpack(chunk))
    left = left - m
  end
  redis.call('LTRIM', KEYS[3], 0, int(log_limit - 1))
  expire_at(KEYS[3], now + log_period)
end

return out
