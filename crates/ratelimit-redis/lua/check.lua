-- check.lua: one rate-limit decision for one client key, all rules at once.
--
-- An integer translation of `ratelimit_core::algo::decide`: the same formulas, evaluated
-- on the state as it stands, committed all or nothing. Every value is an integer below
-- 2^53 (the core and the store refuse rules outside that bound), so Lua's doubles hold
-- them exactly; divisions go through `divmod`, never `/` or `%` alone, and numbers sent
-- back to Redis as text are formatted with '%d', never `tostring` (which would switch
-- to exponent notation).
--
-- KEYS[1]  block marker of the client key: string "<until µs>" or "inf"
-- KEYS[2]  rule state of (client key, rule set): string, a MessagePack array of integers,
--          rule after rule in rule-set order: fixed window (index, count); sliding window
--          counter (index, c0 .. cp), ci = count of sub-window index - i; token bucket
--          (level = tokens x period_us, last); GCRA / leaky bucket (tat_us, tat_frac);
--          sliding log: nothing
-- KEYS[3]  shared sliding log of (client key, rule set): list of µs timestamps, newest
--          first, at most ARGV[4] long
--
-- ARGV[1]  now, µs since the Unix epoch; "" = read the Redis server's TIME
-- ARGV[2]  cost; 0 peeks (evaluated as 1, nothing written)
-- ARGV[3]  TTL floor in ms, applied only when ARGV[1] is given (the injected clock
--          need not run at Redis's pace)
-- ARGV[4]  entries the shared log keeps (RuleSet::log_limit)
-- ARGV[5]  longest sliding-log period, µs (RuleSet::log_period_us)
-- ARGV[6]  number of rules n
-- ARGV[7]  length of the rule state (2 per rule, precision + 2 for a sliding window
--          counter, 0 for a sliding log)
-- ARGV[8..] 5 values per rule: code, limit, period_us, a, b
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
--
-- Every redis.call costs more than the arithmetic: a check without a sliding log makes
-- three (four with Redis TIME): GET block, GET state, SET state with its expiry.

local floor, tonumber, fmt = math.floor, tonumber, string.format
local ARGV, KEYS, redis, cmsgpack = ARGV, KEYS, redis, cmsgpack

-- Exact floor division of non-negative integers below 2^53: the double quotient may round
-- across an integer, the exact remainder corrects it.
local function divmod(a, b)
  local q = floor(a / b)
  local r = a - q * b
  if r < 0 then
    return q - 1, r + b
  elseif r >= b then
    return q + 1, r - b
  end
  return q, r
end

-- ceil(a / b) for a >= 0, b > 0.
local function ceil_div(a, b)
  local q, r = divmod(a, b)
  if r > 0 then
    return q + 1
  end
  return q
end

local FOREIGN = ' holds a value this store did not write'

local injected = ARGV[1] ~= ''
local now
if injected then
  now = tonumber(ARGV[1])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- Blocks first: a blocked key consults no rule.
local block = redis.call('GET', KEYS[1])
if block then
  if block == 'inf' then
    return {1, -1}
  end
  local untl = tonumber(block)
  if not untl then
    return redis.error_reply('RLSTATE the block marker' .. FOREIGN)
  end
  if untl > now then
    return {1, untl - now}
  end
  redis.call('DEL', KEYS[1])
end

local cost = tonumber(ARGV[2])
local c = cost
if c < 1 then
  c = 1
end
local n = tonumber(ARGV[6])

local width = tonumber(ARGV[7])
local has_log = tonumber(ARGV[4]) > 0

-- st: the stored state (nil = fresh), rule i's values at st[off + 1 ..].
local st = nil
if width > 0 then
  local raw = redis.call('GET', KEYS[2])
  if raw then
    local decoded, t = pcall(cmsgpack.unpack, raw)
    if not decoded or type(t) ~= 'table' or #t ~= width then
      return redis.error_reply('RLSTATE the rule state' .. FOREIGN)
    end
    for j = 1, width do
      local x = t[j]
      if type(x) ~= 'number' or x < 0 or x ~= floor(x) then
        return redis.error_reply('RLSTATE the rule state' .. FOREIGN)
      end
    end
    st = t
  end
end

local key3 = KEYS[3]
local log_len, newest = 0, nil
if has_log then
  log_len = redis.call('LLEN', key3)
  if log_len > 0 then
    newest = tonumber(redis.call('LINDEX', key3, 0))
    if not newest then
      return redis.error_reply('RLSTATE the sliding log' .. FOREIGN)
    end
  end
end

-- Evaluate every rule on the state as it stands. out doubles as the reply; new gets the
-- next state of fixed window, token bucket and TAT rules, written if the check commits.
local out = {0, 0}
local new = {}
local all_ok, delay, off = true, 0, 0
for i = 1, n do
  local o = 5 * i + 3
  local k = tonumber(ARGV[o])
  local limit = tonumber(ARGV[o + 1])
  local period = tonumber(ARGV[o + 2])
  local allowed, remaining, reset, retry = true, 0, 0, 0
  if k == 1 then
    local index = divmod(now, period)
    local count = 0
    if st then
      local si = st[off + 1]
      if si == index then
        count = st[off + 2]
      end
      reset = (si + 1) * period - now
    end
    allowed = count + c <= limit
    remaining = limit - count
    retry = (index + 1) * period - now
    new[off + 1], new[off + 2] = index, count + c
    off = off + 2
  elseif k == 2 then
    local p = tonumber(ARGV[o + 3])
    local sub = divmod(period, p)
    local cur, elapsed = divmod(now, sub)
    local idx = st and st[off + 1]
    local base = off
    -- The count of sub-window kk.
    local function sub_count(kk)
      if idx and kk <= idx and idx - kk <= p then
        return st[base + 2 + idx - kk]
      end
      return 0
    end
    -- (oldest count, to be weighted; sum of the p newer ones) as seen in sub-window cur.
    local old, recent = 0, 0
    if idx and idx <= cur then
      local keep = p - (cur - idx)
      if keep >= 0 then
        old = st[off + 2 + keep]
        for d = 0, keep - 1 do
          recent = recent + st[off + 2 + d]
        end
      end
    elseif idx then
      -- The clock went back (an injected clock can): sub-window by sub-window.
      if cur >= p then
        old = sub_count(cur - p)
      end
      for d = 0, p - 1 do
        if d <= cur then
          recent = recent + sub_count(cur - d)
        end
      end
    end
    local weighted = old * (sub - elapsed)
    allowed = weighted + sub * (recent + c) <= limit * sub
    local room = limit * sub - weighted
    if room < 0 then
      room = 0
    end
    remaining = divmod(room, sub) - recent
    if not allowed then
      -- The first instant a request of cost c is admitted, sub-window by sub-window; the
      -- sums slide one sub-window per step, keeping the search O(precision).
      local rec = recent
      for j = 0, p + 1 do
        local w = cur + j
        if j > 0 then
          rec = rec + sub_count(w)
          if w - p >= 0 then
            rec = rec - sub_count(w - p)
          end
        end
        if rec + c <= limit then
          local start = 0
          if w >= p then
            local old_j = sub_count(w - p)
            if old_j > 0 then
              local q = divmod((limit - rec - c) * sub, old_j)
              if q == 0 then
                start = nil
              elseif q < sub then
                start = sub - q
              end
            end
          end
          if start and w * sub + start > now then
            retry = w * sub + start - now
            break
          end
        end
      end
    end
    if idx then
      for d = 0, p do
        if st[off + 2 + d] > 0 then
          reset = (idx - d + p + 1) * sub - now
          break
        end
      end
    end
    off = off + p + 2
  elseif k == 3 then
    local nth = nil
    local at = limit - c
    if at < log_len then
      nth = tonumber(redis.call('LINDEX', key3, at))
      if not nth then
        return redis.error_reply('RLSTATE the sliding log' .. FOREIGN)
      end
    end
    -- Entries inside this rule's window are a prefix of the log (newest first): binary
    -- search its length among the first `limit` entries.
    local lo, hi = 0, log_len
    if hi > limit then
      hi = limit
    end
    if newest and newest + period <= now then
      hi = 0
    elseif nth and nth + period > now then
      lo = at + 1
    end
    while lo < hi do
      local mid = floor((lo + hi) / 2)
      local ts = tonumber(redis.call('LINDEX', key3, mid))
      if not ts then
        return redis.error_reply('RLSTATE the sliding log' .. FOREIGN)
      end
      if ts + period > now then
        lo = mid + 1
      else
        hi = mid
      end
    end
    allowed = (not nth) or nth + period <= now
    remaining = limit - lo
    if newest then
      reset = newest + period - now
    end
    if nth then
      retry = nth + period - now
    end
  elseif k == 4 then
    local full = tonumber(ARGV[o + 3]) * period
    local level, last = full, now
    if st then
      local sl, slast = st[off + 1], st[off + 2]
      local idle = now - slast
      if idle > 0 then
        -- Past `full` the sum may round, never below `full`: the minimum stays exact.
        level = sl + idle * limit
      else
        level = sl
      end
      if level > full then
        level = full
      end
      if slast > now then
        last = slast
      end
      local held = sl
      if held > full then
        held = full
      end
      reset = slast + ceil_div(full - held, limit) - now
    end
    local need = c * period
    allowed = level >= need
    remaining = divmod(level, period)
    if not allowed then
      retry = ceil_div(need - level, limit)
    end
    local after = level - need
    if after < 0 then
      after = 0
    end
    new[off + 1], new[off + 2] = after, last
    off = off + 2
  else
    local cap, no_delay = tonumber(ARGV[o + 3]), tonumber(ARGV[o + 4])
    local bus, bfrac = now, 0
    if st then
      local su, sf = st[off + 1], st[off + 2]
      if su > now or (su == now and sf > 0) then
        bus, bfrac = su, sf
      end
      reset = su - now
      if sf > 0 then
        reset = reset + 1
      end
    end
    local q, m = divmod(bfrac + c * period, limit)
    local nus = bus + q
    local diff_base = (bus - now) * limit + bfrac
    local diff_next = (nus - now) * limit + m
    local max = cap * period
    allowed = diff_next <= max
    if no_delay > 0 and allowed and diff_next > no_delay * period then
      local dq = ceil_div(diff_next - no_delay * period, limit)
      if dq > delay then
        delay = dq
      end
    end
    local room = max - diff_base
    if room < 0 then
      room = 0
    end
    remaining = divmod(room, period)
    if not allowed then
      retry = ceil_div(diff_next - max, limit)
    end
    new[off + 1], new[off + 2] = nus, m
    off = off + 2
  end
  if remaining < 0 then
    remaining = 0
  end
  if reset < 0 then
    reset = 0
  end
  if retry < 0 then
    retry = 0
  end
  if not allowed then
    all_ok = false
  end
  out[4 * i - 1] = allowed and 1 or 0
  out[4 * i] = remaining
  out[4 * i + 1] = reset
  out[4 * i + 2] = retry
end
out[2] = delay

if not all_ok or cost == 0 then
  return out
end

-- Commit: every rule is charged `cost`; remaining and reset become the state's after.
local ttl_floor = tonumber(ARGV[3])

-- Sets the expiry of the SET or PEXPIRE `command` on `key` to `at` µs: exactly on
-- Redis's clock, or relative to the injected clock with a floor.
local function with_expiry(command, key, value, at)
  if injected then
    local ms = 0
    if at > now then
      ms = ceil_div(at - now, 1000)
    end
    if ms < ttl_floor then
      ms = ttl_floor
    end
    if ms < 1 then
      ms = 1
    end
    ms = fmt('%d', ms)
    if value then
      return redis.call(command, key, value, 'PX', ms)
    end
    return redis.call('PEXPIRE', key, ms)
  end
  local ms = fmt('%d', ceil_div(at, 1000))
  if value then
    return redis.call(command, key, value, 'PXAT', ms)
  end
  return redis.call('PEXPIREAT', key, ms)
end

local state_expires = 0
off = 0
for i = 1, n do
  local o = 5 * i + 3
  local k = tonumber(ARGV[o])
  local period = tonumber(ARGV[o + 2])
  local exp
  if k == 3 then
    -- After the push the newest entry is now.
    exp = now + period
  elseif k == 2 then
    local p = tonumber(ARGV[o + 3])
    local sub = divmod(period, p)
    local cur = divmod(now, sub)
    local idx = st and st[off + 1]
    local nidx, shift = cur, p + 1
    if idx then
      if idx < cur then
        shift = cur - idx
        if shift > p + 1 then
          shift = p + 1
        end
      else
        -- A clock that went back counts into the newest sub-window.
        nidx, shift = idx, 0
      end
    end
    new[off + 1] = nidx
    for d = 0, p do
      if d < shift then
        new[off + 2 + d] = 0
      else
        new[off + 2 + d] = st[off + 2 + d - shift]
      end
    end
    new[off + 2] = new[off + 2] + cost
    -- The newest sub-window now holds units: the state lasts p + 1 sub-windows past it.
    exp = (nidx + p + 1) * sub
    off = off + p + 2
  else
    local a, b = new[off + 1], new[off + 2]
    if k == 1 then
      exp = (a + 1) * period
    elseif k == 4 then
      local full = tonumber(ARGV[o + 3]) * period
      local held = a
      if held > full then
        held = full
      end
      exp = b + ceil_div(full - held, tonumber(ARGV[o + 1]))
    else
      exp = a
      if b > 0 then
        exp = exp + 1
      end
    end
    off = off + 2
  end
  if k ~= 3 and exp > state_expires then
    state_expires = exp
  end
  local reset = exp - now
  if reset < 0 then
    reset = 0
  end
  out[4 * i + 1] = reset
  local left = out[4 * i] - cost
  if left < 0 then
    left = 0
  end
  out[4 * i] = left
end

if width > 0 then
  with_expiry('SET', KEYS[2], cmsgpack.pack(new), state_expires)
end

if has_log then
  -- Push `cost` copies of now in chunks (unpack has a stack limit); keep log_limit.
  local stamp = fmt('%d', now)
  local left = cost
  while left > 0 do
    local chunk = {}
    local m = left
    if m > 1000 then
      m = 1000
    end
    for j = 1, m do
      chunk[j] = stamp
    end
    redis.call('LPUSH', key3, unpack(chunk))
    left = left - m
  end
  local log_limit = tonumber(ARGV[4])
  if log_len + cost > log_limit then
    redis.call('LTRIM', key3, 0, fmt('%d', log_limit - 1))
  end
  with_expiry(nil, key3, nil, now + tonumber(ARGV[5]))
end

return out
