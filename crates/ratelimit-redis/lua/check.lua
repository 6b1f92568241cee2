-- check.lua: one rate-limit decision for one client key, all rules at once (`check`), or
-- many such decisions in one call (`check_many`, at the end of the file).
--
-- An integer translation of the core's algorithms: one local function per algorithm,
-- named and ordered as the core's files (algo/fixed_window.rs, sliding_window.rs,
-- sliding_log.rs, token_bucket.rs, leaky_bucket.rs, gcra.rs), evaluated on the state as
-- it stands and committed all or nothing. Every value is an integer below 2^53 (the core
-- refuses rules outside that bound), so Lua's doubles hold them exactly; divisions go
-- through `divmod`, never `/` or `%` alone (but for `x % 1` and `/ 1000`, exact where
-- they are used, as said there), and numbers sent back to Redis as text are formatted
-- with '%d', never `tostring` (which would switch to exponent notation).
--
-- The argument layout is owned by `CheckArgs` in src/script.rs, which encodes it and
-- decodes the reply; change both together.
--
-- KEYS[1]  block marker of the client key: string "<until µs>" or "inf"
-- KEYS[2]  rule state of the client key: string of little-endian doubles, every one an
--          integer below 2^53: the layout (the fingerprint of the rule set that wrote it,
--          ARGV's `layout`), then one entry per rule but the sliding logs, in rule-set
--          order, then a log marker when a rule is a sliding log. An entry is
--          {id, m, m values}: the rule's identity (RuleSet::rule_ids), the number of
--          values, and the state: fixed window (index, count); sliding window counter
--          (index, c0 .. cp), ci = count of sub-window index - i; token bucket (limit,
--          capacity of the rule that wrote it, level = tokens x period_us, last); leaky
--          bucket and GCRA (limit, capacity of the rule that wrote it, tat_us,
--          tat_frac). The log marker is the entry {0, 1, until}: the shared log counts
--          until then (the newest entry plus the writer's longest sliding-log period).
-- KEYS[3]  shared sliding log of the client key, only when a rule is a sliding log: list
--          of µs timestamps, newest first, at most the largest log limit long
--
-- ARGV[1]  the values as little-endian doubles (exact: every one is an integer < 2^53):
--          injected (1: take `now`; 0: read the Redis server's TIME), now (µs since the
--          Unix epoch) when injected, else 0, cost (0 peeks: evaluated as 1, nothing
--          written), TTL floor in ms (applied only under an injected clock, which need
--          not run at Redis's pace), number of rules n, state width (values in KEYS[2] as
--          this rule set writes it), entries the shared log keeps (0: no sliding log),
--          longest sliding-log period in µs, layout (the rule set's fingerprint, below
--          2^52), the caller's deadline in µs on the Redis server's clock, whatever the
--          check's own clock (0: none; a check that starts later is not run);
--          then 6 values per rule: code, limit, period_us, a, b, id
--            FIXED_WINDOW    1
--            SLIDING_WINDOW  2   a = precision, b = sub-window length in µs
--            SLIDING_LOG     3
--            TOKEN_BUCKET    4   a = capacity
--            LEAKY_BUCKET    5   meter: a = capacity, b = 0
--                                shaper: a = burst, b = delay + 1
--            GCRA            6   a = burst
--
-- A state of the same layout is read in place. One of another layout (the rules changed,
-- or processes on two rule versions share the key) is read entry by entry: each rule
-- takes the entry of its identity, carried as the core's `algo::carry` does (see
-- carry below), and starts fresh without one; a check that commits writes the state in
-- its own layout, so the entries of rules it does not have are dropped then.
--
-- Returns one string of little-endian doubles (all integers below 2^53, or -1; Redis
-- turns a string into a reply at about half the cost of a table of 6 integers):
--   {1, retry_us}   blocked; retry_us = -1 for a block without end
--   {3, now_us}     past the caller's deadline (now_us on the Redis clock): nothing
--                   decided, nothing written
--   {s, delay_us, then per rule: allowed (1/0), remaining, reset_us, retry_us}
--                   s = 0, or 2 when a value this script did not write was found at one
--                   of the keys and discarded (the store owns its key namespace)
--
-- Redis calls: TIME (without an injected time, or with a deadline), one MGET for block
-- marker and state, one SET of the state with its expiry when the check commits; a
-- sliding log adds LLEN, LINDEX, LPUSH, PEXPIRE (or a DEL of a log that no longer
-- counts). A value of another type at a key reads as absent and is replaced.

-- Cost: run with EVALSHA, every function below is created anew on each call, and each
-- local it captures costs at creation. So the functions take their inputs as parameters,
-- reach library functions as globals, and capture only each other.

local FIXED_WINDOW, SLIDING_WINDOW, SLIDING_LOG, TOKEN_BUCKET, LEAKY_BUCKET, GCRA =
  1, 2, 3, 4, 5, 6
local HEADER, PER_RULE = 10, 6
-- The struct format of the arguments of one rule: '<' and HEADER + PER_RULE 'd'.
local ONE_RULE = '<dddddddddddddddd'
-- The identity of the log marker's entry; no rule has it.
local LOG_MARKER = 0

-- Exact floor division of non-negative integers below 2^53: the double quotient may round
-- across an integer, the exact remainder corrects it.
local function divmod(a, b)
  local q = math.floor(a / b)
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

-- The state as a string of little-endian doubles (exact for integers below 2^53), in
-- chunks of at most 1000: Lua can hold only so many values on its stack at once.

-- Whether a stored value is one this script could have written: an integer in [0, 2^53).
-- Below 2^53, x % 1 is exact (x - floor(x)); NaN and the infinities give NaN.
local function whole(x)
  return x >= 0 and x < 9007199254740992 and x % 1 == 0
end

-- The state in `raw`, or nil when `raw` is not `width` non-negative integers.
local function decode(raw, width, shape)
  if #raw ~= 8 * width then
    return nil
  end
  local t
  if shape ~= '' then
    -- One trailing value (the next position) follows the state; nothing reads it.
    t = {struct.unpack(shape, raw)}
  else
    t = {}
    local pos = 1
    for first = 1, width, 1000 do
      local m = width - first + 1
      if m > 1000 then
        m = 1000
      end
      local vals = {struct.unpack('<' .. string.rep('d', m), raw, pos)}
      for j = 1, m do
        t[first + j - 1] = vals[j]
      end
      pos = vals[m + 1]
    end
  end
  for j = 1, width do
    local x = t[j]
    -- whole(x), without the call: the loop runs over every stored value.
    if not (x >= 0 and x < 9007199254740992 and x % 1 == 0) then
      return nil
    end
  end
  return t
end

-- The next state `new` as stored.
local function encode(new, width, shape)
  if shape ~= '' then
    return struct.pack(shape, unpack(new, 1, width))
  end
  local parts = {}
  for first = 1, width, 1000 do
    local last = first + 999
    if last > width then
      last = width
    end
    parts[#parts + 1] =
      struct.pack('<' .. string.rep('d', last - first + 1), unpack(new, first, last))
  end
  return table.concat(parts)
end

-- Every algorithm takes the time, the units to weigh (c = cost, at least 1), the stored
-- state st (nil = fresh; this rule's values at st[off + 1 ..]) and the table `new` for
-- the next state, then the rule. It returns: allowed, remaining (before this check),
-- reset (of the state as it stands), retry (when denied), the next state's expiry in µs,
-- delay.

local function fixed_window(now, c, st, new, off, limit, period)
  local index = divmod(now, period)
  local count, reset = 0, 0
  if st then
    local si = st[off + 1]
    if si == index then
      count = st[off + 2]
    end
    reset = (si + 1) * period - now
  end
  new[off + 1], new[off + 2] = index, count + c
  local ends = (index + 1) * period
  return count + c <= limit, limit - count, reset, ends - now, ends, 0
end

-- The count of sub-window kk in a sliding window state whose newest sub-window is idx.
local function sub_count(st, off, idx, p, kk)
  if idx and kk <= idx and idx - kk <= p then
    return st[off + 2 + idx - kk]
  end
  return 0
end

local function sliding_window(now, c, st, new, off, limit, period, p, sub)
  local cur, elapsed = divmod(now, sub)
  local idx = st and st[off + 1]
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
      old = sub_count(st, off, idx, p, cur - p)
    end
    for d = 0, p - 1 do
      if d <= cur then
        recent = recent + sub_count(st, off, idx, p, cur - d)
      end
    end
  end
  local weighted = old * (sub - elapsed)
  local allowed = weighted + sub * (recent + c) <= limit * sub
  local room = limit * sub - weighted
  if room < 0 then
    room = 0
  end
  local remaining = divmod(room, sub) - recent
  local retry, reset = 0, 0
  if not allowed then
    -- The first instant a request of cost c is admitted, sub-window by sub-window; the
    -- sums slide one sub-window per step, keeping the search O(precision).
    local rec = recent
    for j = 0, p + 1 do
      local w = cur + j
      if j > 0 then
        rec = rec + sub_count(st, off, idx, p, w)
        if w - p >= 0 then
          rec = rec - sub_count(st, off, idx, p, w - p)
        end
      end
      if rec + c <= limit then
        local start = 0
        if w >= p then
          local old_j = sub_count(st, off, idx, p, w - p)
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
  -- The next state: counts shifted to sub-window cur, cost added to the newest.
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
  new[off + 2] = new[off + 2] + c
  -- The newest sub-window then holds units: the state lasts p + 1 sub-windows past it.
  return allowed, remaining, reset, retry, (nidx + p + 1) * sub, 0
end

-- Also takes the shared log's key, length and newest entry. Returns nil when the log
-- holds an entry this script did not write.
-- The log's time never goes back (a failover to a server with another clock, an injected
-- clock): at `now` before the newest entry, the check is decided (window, verdict,
-- remaining) as if at the newest entry's time, and commit logs it at that time, so the
-- log stays newest first; retry and reset still count from `now`. As the core's
-- algo/sliding_log.rs.
local function sliding_log(now, c, key, log_len, newest, limit, period)
  local t = now
  if newest and newest > now then
    t = newest
  end
  local nth = nil
  local at = limit - c
  if at < log_len then
    nth = tonumber(redis.call('LINDEX', key, at))
    if not nth then
      return nil
    end
  end
  -- Entries inside this rule's window are a prefix of the log (newest first): binary
  -- search its length among the first `limit` entries.
  local lo, hi = 0, log_len
  if hi > limit then
    hi = limit
  end
  if newest and newest + period <= t then
    hi = 0
  elseif nth and nth + period > t then
    lo = at + 1
  end
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    local ts = tonumber(redis.call('LINDEX', key, mid))
    if not ts then
      return nil
    end
    if ts + period > t then
      lo = mid + 1
    else
      hi = mid
    end
  end
  local reset, retry = 0, 0
  if newest then
    reset = newest + period - now
  end
  if nth then
    retry = nth + period - now
  end
  -- After the push the newest entry is t.
  return (not nth) or nth + period <= t, limit - lo, reset, retry, t + period, 0
end

local function token_bucket(now, c, st, new, off, limit, period, capacity)
  local full = capacity * period
  local level, last, reset = full, now, 0
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
  local retry = 0
  if level < need then
    retry = ceil_div(need - level, limit)
  end
  local after = level - need
  if after < 0 then
    after = 0
  end
  new[off + 1], new[off + 2] = after, last
  local held = after
  if held > full then
    held = full
  end
  return level >= need, divmod(level, period), reset, retry,
    last + ceil_div(full - held, limit), 0
end

-- A bucket's state (level, last), written under a rule of limit ol and capacity oc of the
-- same period, for a rule of capacity `capacity`: nil (fresh) when the old rule has
-- refilled it by now; else the level, at most the new capacity, and last.
local function token_bucket_carry(now, ol, oc, level, last, period, capacity)
  local full = oc * period
  local lvl = level
  if now > last then
    -- Past `full` the sum may round, never below `full`: the comparison stays exact.
    lvl = level + (now - last) * ol
  end
  if lvl >= full then
    return nil
  end
  local cap = capacity * period
  if level > cap then
    level = cap
  end
  return level, last
end

-- The theoretical arrival time (su µs and sf / limit of one; su nil: no state):
-- `cap` emission intervals of room, requests beyond the first `no_delay` (0 = all)
-- admitted with a delay. Returns the six values every algorithm returns, then the next
-- state (µs, fraction).
local function gcra_tat(now, c, su, sf, limit, period, cap, no_delay)
  local bus, bfrac, reset = now, 0, 0
  if su then
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
  local allowed = diff_next <= max
  local delay, retry = 0, 0
  if no_delay > 0 and allowed and diff_next > no_delay * period then
    delay = ceil_div(diff_next - no_delay * period, limit)
  end
  local room = max - diff_base
  if room < 0 then
    room = 0
  end
  if not allowed then
    retry = ceil_div(diff_next - max, limit)
  end
  local exp = nus
  if m > 0 then
    exp = nus + 1
  end
  return allowed, (divmod(room, period)), reset, retry, exp, delay, nus, m
end

-- gcra_tat on a rule's slice of the state tables.
local function tat_rule(now, c, st, new, off, limit, period, cap, no_delay)
  local su, sf
  if st then
    su, sf = st[off + 1], st[off + 2]
  end
  local allowed, remaining, reset, retry, exp, delay, nus, m =
    gcra_tat(now, c, su, sf, limit, period, cap, no_delay)
  new[off + 1], new[off + 2] = nus, m
  return allowed, remaining, reset, retry, exp, delay
end

-- A meter holds `capacity` requests; a shaper lets `burst` wait and the first `delay`
-- of them through at once.
local function leaky_bucket(now, c, st, new, off, limit, period, a, b)
  if b == 0 then
    return tat_rule(now, c, st, new, off, limit, period, a, 0)
  end
  return tat_rule(now, c, st, new, off, limit, period, a + 1, b)
end

local function gcra(now, c, st, new, off, limit, period, burst)
  return tat_rule(now, c, st, new, off, limit, period, burst, 0)
end

-- A TAT (us, frac / ol), written under a rule of limit ol of the same algorithm and
-- period, for a rule of limit `limit`: nil (fresh) once it has passed; else the TAT,
-- rounded up to a whole µs when the limit (the unit of its fraction) changed.
local function gcra_carry(now, ol, us, frac, limit)
  if not (us > now or (us == now and frac > 0)) then
    return nil
  end
  if ol ~= limit and frac > 0 then
    return us + 1, 0
  end
  return us, frac
end

-- The state `raw`, written under another layout, for the rules of the arguments `v`: the
-- table of values in this layout (`st`), the set of rules without a state (`fresh`, by
-- rule number) and whether the shared log counts; nil when `raw` is not a state this
-- script wrote. The core's `algo::carry`, entry by entry.
local function carry(raw, v, n, now)
  local len = #raw / 8
  if len % 1 ~= 0 or len < 1 then
    return nil
  end
  local shape = ''
  if len <= 1000 then
    shape = '<' .. string.rep('d', len)
  end
  local t = decode(raw, len, shape)
  if not t then
    return nil
  end
  -- Where each identity's values start.
  local at = {}
  local pos = 2
  while pos <= len do
    local m = t[pos + 1]
    if not m or pos + 1 + m > len then
      return nil
    end
    at[t[pos]] = pos + 2
    pos = pos + 2 + m
  end
  local log_counts = false
  local lp = at[LOG_MARKER]
  if lp and t[lp - 1] == 1 and t[lp] > now then
    log_counts = true
  end
  local st, fresh, off = {}, {}, 1
  for i = 1, n do
    local o = HEADER + PER_RULE * i - 5
    local code, limit, period, a, b, id = v[o], v[o + 1], v[o + 2], v[o + 3], v[o + 4], v[o + 5]
    if code ~= SLIDING_LOG then
      local p, width = at[id], 2
      if code == SLIDING_WINDOW then
        width = a + 2
      end
      if code >= TOKEN_BUCKET then
        -- The header's writer limit and capacity.
        off = off + 4
        if p and t[p - 1] == width + 2 then
          local x, y
          if code == TOKEN_BUCKET then
            x, y = token_bucket_carry(now, t[p], t[p + 1], t[p + 2], t[p + 3], period, a)
          else
            x, y = gcra_carry(now, t[p], t[p + 2], t[p + 3], limit)
          end
          if x then
            st[off + 1], st[off + 2] = x, y
          else
            fresh[i] = true
          end
        else
          fresh[i] = true
        end
      else
        off = off + 2
        if p and t[p - 1] == width then
          for j = 0, width - 1 do
            st[off + 1 + j] = t[p + j]
          end
        else
          fresh[i] = true
        end
      end
      off = off + width
    end
  end
  return st, fresh, log_counts
end

-- The expiry option of a key whose state matters until `at` µs, and its value: exact on
-- Redis's clock (PXAT, in ms since the epoch: 13 digits, which Lua's number-to-text
-- conversion keeps exact), or relative to an injected clock with a floor (PX).
-- math.ceil(a / 1000) is exact for 0 <= a < 2^53: a / 1000 is below 2^43, where the
-- division's rounding error (under 2^-10) is less than the 0.001 that separates a
-- non-integer quotient from an integer, so rounding never crosses one.
local function expiry_arg(injected, now, ttl_floor, at)
  if injected then
    local ms = 0
    if at > now then
      ms = math.ceil((at - now) / 1000)
    end
    if ms < ttl_floor then
      ms = ttl_floor
    end
    if ms < 1 then
      ms = 1
    end
    return 'PX', string.format('%d', ms)
  end
  return 'PXAT', math.ceil(at / 1000)
end

-- The time, the stored state (raw), the status (0, or 2 when a foreign block marker was
-- dropped) and the units to weigh (cost, at least 1: a peek weighs as one) of a check;
-- or nil and the reply when the key is blocked. Blocks come first: a blocked key
-- consults no rule. (check_one has turned away a check past its deadline.)
-- In a batch, `redis_now` is the Redis time read once for all, and when `at` is set,
-- got[at] and got[at + 1] are the block marker and state as read for all (alone: nil,
-- nil, nil, read here).
local function begin(KEYS, injected, injected_now, cost, redis_now, got, at)
  local now
  if injected then
    now = injected_now
  else
    now = redis_now
    if not now then
      local t = redis.call('TIME')
      now = tonumber(t[1]) * 1000000 + tonumber(t[2])
    end
  end
  if not at then
    got, at = redis.call('MGET', KEYS[1], KEYS[2]), 1
  end
  local status = 0
  local block = got[at]
  if block then
    if block == 'inf' then
      return nil, struct.pack('<dd', 1, -1)
    end
    local untl = tonumber(block)
    if untl and untl > now then
      return nil, struct.pack('<dd', 1, untl - now)
    end
    if not untl then
      status = 2
    end
    redis.call('DEL', KEYS[1])
  end
  local c = cost
  if c < 1 then
    c = 1
  end
  return now, got[at + 1], status, c
end

-- The reply `out` as one string of doubles.
local function as_reply(out)
  return struct.pack('<' .. string.rep('d', #out), unpack(out))
end

-- A rule's remaining, reset and retry as replied: never negative.
local function at_least_zero(remaining, reset, retry)
  if remaining < 0 then
    remaining = 0
  end
  if reset < 0 then
    reset = 0
  end
  if retry < 0 then
    retry = 0
  end
  return remaining, reset, retry
end

-- The decision on the arguments `v` (validated), once `begin` has read the time and the
-- stored state `raw`.
local function decide(KEYS, v, now, raw, status, c)
  local fmt = string.format
  local injected = v[1] == 1
  local cost, ttl_floor, n, width, log_limit, log_period, layout =
    v[3], v[4], v[5], v[6], v[7], v[8], v[9]
  -- The state's struct format, or '' when it is too wide for one struct call (it is then
  -- read and written in chunks).
  local shape = ''
  if width <= 1000 then
    shape = '<' .. string.rep('d', width)
  end

  -- The stored state in this layout: read in place when this rule set wrote it, else
  -- carried entry by entry (rules in `fresh` start without state). The shared log counts
  -- when this rule set wrote the state, or the state's log marker says so.
  local st, fresh, log_counts = nil, nil, false
  if raw then
    st = decode(raw, width, shape)
    if st and st[1] == layout then
      log_counts = true
    else
      st, fresh, log_counts = carry(raw, v, n, now)
      if not st then
        -- Read as fresh; the commit replaces it.
        status = 2
      end
    end
  end

  local key3, log_len, newest, drop_log = KEYS[3], 0, nil, false
  if log_limit > 0 then
    if not log_counts then
      -- A log the state does not vouch for is no one's: read as empty, and dropped before
      -- it is added to. Only a commit drops it: a peek or a denial writes nothing, so the
      -- rules that wrote the log still find it (as MemoryStore keeps it).
      drop_log = true
    else
      log_len = redis.pcall('LLEN', key3)
      if type(log_len) == 'table' then
        -- Another type: drop it (LLEN failed, so the key is not a list).
        redis.call('DEL', key3)
        log_len, status = 0, 2
      elseif log_len > 0 then
        newest = tonumber(redis.call('LINDEX', key3, 0))
        if not newest then
          redis.call('DEL', key3)
          log_len, status = 0, 2
        end
      end
    end
  end

  -- Evaluate every rule on the state as it stands; out holds the reply.
  -- Sized for one rule, the common case, so that it does not grow.
  local out = {status, 0, 0, 0, 0, 0}
  -- The next state at new[1 .. width], each rule's expiry at new[width + i]; `off` is
  -- where the values of the rule at hand start, past its entry's header. Sized for one
  -- rule (state and expiry), so that it does not grow: each growth is a rehash.
  local new = {layout, 0, 0, 0, 0, 0, 0, 0}
  local all_ok, delay, off = true, 0, 1
  for i = 1, n do
    local o = HEADER + PER_RULE * i - 5
    local code, limit, period = v[o], v[o + 1], v[o + 2]
    local s = st
    if fresh and fresh[i] then
      s = nil
    end
    local allowed, remaining, reset, retry, exp, wait
    if code == FIXED_WINDOW then
      new[off + 1], new[off + 2] = v[o + 5], 2
      off = off + 2
      allowed, remaining, reset, retry, exp, wait = fixed_window(now, c, s, new, off, limit, period)
      off = off + 2
    elseif code == SLIDING_WINDOW then
      local p = v[o + 3]
      new[off + 1], new[off + 2] = v[o + 5], p + 2
      off = off + 2
      allowed, remaining, reset, retry, exp, wait =
        sliding_window(now, c, s, new, off, limit, period, p, v[o + 4])
      off = off + p + 2
    elseif code == SLIDING_LOG then
      allowed, remaining, reset, retry, exp, wait =
        sliding_log(now, c, key3, log_len, newest, limit, period)
      if allowed == nil then
        -- An entry deep in the log is not a timestamp: drop the log so the next check
        -- starts clean, and say so.
        redis.call('DEL', key3)
        return redis.error_reply('RLSTATE the sliding log held a value this store did '
          .. 'not write; it was deleted')
      end
    elseif code == TOKEN_BUCKET or code == LEAKY_BUCKET or code == GCRA then
      local a, b = v[o + 3], v[o + 4]
      -- The header: identity, 4 values, the limit and capacity a carry needs.
      local cap = a
      if code == LEAKY_BUCKET and b > 0 then
        cap = a + 1
      end
      new[off + 1], new[off + 2], new[off + 3], new[off + 4] = v[o + 5], 4, limit, cap
      off = off + 4
      if code == TOKEN_BUCKET then
        allowed, remaining, reset, retry, exp, wait =
          token_bucket(now, c, s, new, off, limit, period, a)
      elseif code == LEAKY_BUCKET then
        allowed, remaining, reset, retry, exp, wait =
          leaky_bucket(now, c, s, new, off, limit, period, a, b)
      else
        allowed, remaining, reset, retry, exp, wait =
          gcra(now, c, s, new, off, limit, period, a)
      end
      off = off + 2
    else
      return redis.error_reply(fmt('RLARGS unknown algorithm code %d', code))
    end
    if not allowed then
      all_ok = false
    end
    if wait > delay then
      delay = wait
    end
    remaining, reset, retry = at_least_zero(remaining, reset, retry)
    new[width + i] = exp
    out[4 * i - 1] = allowed and 1 or 0
    out[4 * i] = remaining
    out[4 * i + 1] = reset
    out[4 * i + 2] = retry
  end
  if log_limit > 0 then
    off = off + 3
  end
  if off ~= width then
    return redis.error_reply(fmt('RLARGS the rules fill %d values of a state of %d', off, width)
      .. '; the store and the script are from different versions')
  end
  out[2] = delay

  if not all_ok or cost == 0 then
    return as_reply(out)
  end

  -- Commit: every rule is charged `cost`; remaining and reset become the next state's.
  local state_expires = 0
  for i = 1, n do
    local exp = new[width + i]
    if exp > state_expires then
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

  -- The log's time: now, or its newest entry when the clock went back (see sliding_log).
  local log_now = now
  if newest and newest > now then
    log_now = newest
  end
  if log_limit > 0 then
    -- The log marker: the log counts until its newest entry (log_now) leaves the longest
    -- sliding-log window, the last of the rules' expiries.
    new[width - 2], new[width - 1], new[width] = LOG_MARKER, 1, log_now + log_period
  end
  local unit, at = expiry_arg(injected, now, ttl_floor, state_expires)
  redis.call('SET', KEYS[2], encode(new, width, shape), unit, at)

  if log_limit > 0 then
    if drop_log then
      redis.call('DEL', key3)
    end
    -- Push `cost` copies of log_now in chunks (unpack has a stack limit); keep log_limit.
    local stamp = fmt('%d', log_now)
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
    if log_len + cost > log_limit then
      redis.call('LTRIM', key3, 0, fmt('%d', log_limit - 1))
    end
    local unit, at = expiry_arg(injected, now, ttl_floor, log_now + log_period)
    if unit == 'PX' then
      redis.call('PEXPIRE', key3, at)
    else
      redis.call('PEXPIREAT', key3, at)
    end
  end

  return as_reply(out)
end

-- One-rule checks of the common algorithms skip the general loop: no argument or state
-- tables, the state read and written with one fixed struct call. They decide exactly as
-- the functions above (they are the same arithmetic, or call them in the rare cases),
-- and hand a state of another layout to `decide`.

-- The reply of a one-rule check and whether it commits; as the general loop above.
local function one_reply(status, cost, allowed, remaining, reset, retry, exp, now)
  remaining, reset, retry = at_least_zero(remaining, reset, retry)
  if not allowed then
    return struct.pack('<dddddd', status, 0, 0, remaining, reset, retry), false
  elseif cost == 0 then
    return struct.pack('<dddddd', status, 0, 1, remaining, reset, retry), false
  end
  reset = exp - now
  if reset < 0 then
    reset = 0
  end
  remaining = remaining - cost
  if remaining < 0 then
    remaining = 0
  end
  return struct.pack('<dddddd', status, 0, 1, remaining, reset, retry), true
end

-- One GCRA rule, or one leaky bucket meter (the same arithmetic with capacity as burst):
-- state {layout, id, 4, limit, cap, tat_us, tat_frac}.
local function gcra_one(KEYS, packed, injected, injected_now, cost, ttl_floor, layout, id,
    limit, period, cap, redis_now, got, at)
  local now, raw, status, c =
    begin(KEYS, injected, injected_now, cost, redis_now, got, at)
  if not now then
    return raw
  end
  local su, sf
  if raw then
    local l, _
    if #raw == 56 then
      l, _, _, _, _, su, sf = struct.unpack('<ddddddd', raw)
    end
    if l ~= layout then
      return decide(KEYS, {struct.unpack(ONE_RULE, packed)}, now, raw, status, c)
    end
    if not (whole(su) and whole(sf)) then
      su, status = nil, 2
    end
  end
  local allowed, remaining, reset, retry, exp, _, nus, m =
    gcra_tat(now, c, su, sf, limit, period, cap, 0)
  local out, commit = one_reply(status, cost, allowed, remaining, reset, retry, exp, now)
  if commit then
    redis.call('SET', KEYS[2], struct.pack('<ddddddd', layout, id, 4, limit, cap, nus, m),
      expiry_arg(injected, now, ttl_floor, exp))
  end
  return out
end

-- One sliding window counter of precision 1: state {layout, id, 3, index, c0, c1}. The
-- common cases (no state, or a state of this sub-window or the one before, and an
-- admitted check) are worked out here; a denial or a clock that went back goes through
-- sliding_window.
local function sliding_one(KEYS, packed, injected, injected_now, cost, ttl_floor, layout, id,
    limit, sub, redis_now, got, at)
  local now, raw, status, c =
    begin(KEYS, injected, injected_now, cost, redis_now, got, at)
  if not now then
    return raw
  end
  local idx, c0, c1
  if raw then
    local l, _
    if #raw == 48 then
      l, _, _, idx, c0, c1 = struct.unpack('<dddddd', raw)
    end
    if l ~= layout then
      return decide(KEYS, {struct.unpack(ONE_RULE, packed)}, now, raw, status, c)
    end
    -- whole() of each, without the calls.
    if not (idx >= 0 and c0 >= 0 and c1 >= 0 and idx < 9007199254740992
        and c0 < 9007199254740992 and c1 < 9007199254740992 and idx % 1 == 0
        and c0 % 1 == 0 and c1 % 1 == 0) then
      idx, status = nil, 2
    end
  end
  local cur, elapsed = divmod(now, sub)
  -- (oldest count, weighted; the newer count) as seen in sub-window cur.
  local old, recent = 0, 0
  if idx == cur then
    old, recent = c1, c0
  elseif idx == cur - 1 then
    old = c0
  end
  local weighted = old * (sub - elapsed)
  local allowed, remaining, reset, retry, exp, s0, s1, s2
  if (idx and idx > cur) or weighted + sub * (recent + c) > limit * sub then
    local st = nil
    if idx then
      st = {idx, c0, c1}
    end
    local new = {0, 0, 0}
    allowed, remaining, reset, retry, exp = sliding_window(now, c, st, new, 0, limit, sub, 1, sub)
    s0, s1, s2 = new[1], new[2], new[3]
  else
    local room = limit * sub - weighted
    if room < 0 then
      room = 0
    end
    allowed, remaining, reset, retry = true, divmod(room, sub) - recent, 0, 0
    if idx then
      if c0 > 0 then
        reset = (idx + 2) * sub - now
      elseif c1 > 0 then
        reset = (idx + 1) * sub - now
      end
    end
    -- The next state: counts shifted to sub-window cur (the newer one becomes the
    -- older), cost added to the newest.
    exp, s0, s1, s2 = (cur + 2) * sub, cur, recent + c, old
  end
  local out, commit = one_reply(status, cost, allowed, remaining, reset, retry, exp, now)
  if commit then
    redis.call('SET', KEYS[2], struct.pack('<dddddd', layout, id, 3, s0, s1, s2),
      expiry_arg(injected, now, ttl_floor, exp))
  end
  return out
end

local VERSION_SKEW = ' values; the store and the script are from different versions'

-- One check on its keys and packed values; in a batch with the batch's Redis time and
-- reads (see `begin`).
local function check_one(KEYS, packed, redis_now, got, at)
  local fmt = string.format

  -- The caller's deadline on the Redis clock, the header's last value (0: none).
  if #packed >= 8 * HEADER then
    local deadline = struct.unpack('<d', packed, 8 * HEADER - 7)
    if deadline > 0 then
      if not redis_now then
        local t = redis.call('TIME')
        redis_now = tonumber(t[1]) * 1000000 + tonumber(t[2])
      end
      if redis_now > deadline then
        -- The caller stopped waiting before Redis got to this check (a slow command, a
        -- fork, DEBUG SLEEP): decide nothing and charge nothing.
        return struct.pack('<dd', 3, redis_now)
      end
    end
  end

  -- One C call reads every argument (no text to parse); the last value is unpack's next
  -- position.
  if #packed == 8 * (HEADER + PER_RULE) then
    local inj, t, cost, ttl_floor, n, width, log_limit, _, layout, _, code, limit, period, a, b,
      id = struct.unpack(ONE_RULE, packed)
    if n == 1 and log_limit == 0 then
      if code == GCRA or (code == LEAKY_BUCKET and b == 0) then
        return gcra_one(KEYS, packed, inj == 1, t, cost, ttl_floor, layout, id, limit, period, a,
          redis_now, got, at)
      elseif code == SLIDING_WINDOW and a == 1 and width == 6 then
        return sliding_one(KEYS, packed, inj == 1, t, cost, ttl_floor, layout, id, limit, b,
          redis_now, got, at)
      end
    end
  end
  local count = #packed / 8
  if count % 1 ~= 0 or count < HEADER or count > HEADER + PER_RULE * 64 then
    return redis.error_reply(fmt('RLARGS check.lua takes its values as doubles, got %d bytes',
      #packed) .. VERSION_SKEW)
  end
  local v = {struct.unpack('<' .. string.rep('d', count), packed)}
  local n = v[5] or 0
  if #v ~= HEADER + PER_RULE * n + 1 then
    return redis.error_reply(fmt('RLARGS check.lua expects %d packed values for %d rules, got %d',
      HEADER + PER_RULE * n, n, #v - 1) .. VERSION_SKEW)
  end
  local now, raw, status, c = begin(KEYS, v[1] == 1, v[2], v[3], redis_now, got, at)
  if not now then
    return raw
  end
  return decide(KEYS, v, now, raw, status, c)
end

-- One decision. The file defines `check` and `check_many` and nothing else runs at load:
-- the store loads it as a Redis function library (Redis 7: FUNCTION LOAD, then FCALL, so
-- the functions above are created once per server, not once per call) or, on Redis 6.2,
-- runs it with EVALSHA followed by `return check(KEYS, ARGV)` (or check_many).
local function check(KEYS, ARGV)
  if #ARGV ~= 1 then
    return redis.error_reply('RLARGS check.lua takes 1 argument, got ' .. #ARGV .. VERSION_SKEW)
  end
  return check_one(KEYS, ARGV[1], nil, nil, nil)
end

-- Many decisions in one call, in order, each decided as `check` decides it alone but for
-- one TIME read and one MGET of block markers and states for all (a check whose keys an
-- earlier check of the batch touched reads them again itself). The store sends what
-- queued while its previous call was in flight.
--
-- KEYS     the keys of each check in turn, as for `check` (2, or 3 with a sliding log)
-- ARGV[1]  one character per check: its number of keys, '2' or '3'
-- ARGV[1 + i]  check i's packed values, as ARGV[1] of `check`
--
-- Returns one string: each check's reply in turn, as `check` returns it; a check that
-- failed (an error reply or an error raised) as the doubles {-1, length} and that many
-- bytes of message. One check's failure never touches another's decision.
local function check_many(KEYS, ARGV)
  local counts = ARGV[1]
  local n = #counts
  if #ARGV ~= n + 1 then
    return redis.error_reply('RLARGS check_many expects 1 + ' .. n .. ' arguments, got '
      .. #ARGV .. VERSION_SKEW)
  end
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local byte, pcall, type, pack = string.byte, pcall, type, struct.pack
  local names, k = {}, 0
  for i = 1, n do
    names[2 * i - 1], names[2 * i] = KEYS[k + 1], KEYS[k + 2]
    k = k + byte(counts, i) - 48
  end
  local got = redis.call('MGET', unpack(names))
  local out, touched = {}, {}
  k = 0
  for i = 1, n do
    local m = byte(counts, i) - 48
    local b, s = KEYS[k + 1], KEYS[k + 2]
    local keys = {b, s}
    if m == 3 then
      keys[3] = KEYS[k + 3]
    end
    k = k + m
    local at = nil
    if not (touched[b] or touched[s]) then
      at = 2 * i - 1
    end
    touched[b], touched[s] = true, true
    local ok, r = pcall(check_one, keys, ARGV[i + 1], now, got, at)
    if ok and type(r) == 'string' then
      out[i] = r
    else
      local msg
      if type(r) == 'table' and r.err then
        msg = r.err
      else
        msg = tostring(r)
      end
      out[i] = pack('<dd', -1, #msg) .. msg
    end
  end
  return table.concat(out)
end

-- Many decisions in one call on one node of a Redis Cluster, whose keys may lie in many
-- slots (the function is registered with the flag `allow-cross-slot-keys`). The keys go
-- in ARGV, not KEYS: Redis refuses declared keys of several slots outright, while keys
-- a script reaches itself are checked one command at a time against the slots the node
-- serves. Each check first reads its own keys; a check whose slot the node does not
-- serve (it moved, or is being migrated) is decided not at all, charged nothing, and
-- answered with an error starting `RLMOVED`, for the store to send it again by itself.
-- Nothing else differs from `check_many` (a check reads its keys just before it is
-- decided, so an earlier check of the same key is always seen).
--
-- KEYS     none
-- ARGV[1]  one character per check: its number of keys, '2' or '3'
-- ARGV[1 + i]  check i's packed values, as ARGV[1] of `check`
-- then     the keys of each check in turn, as KEYS of `check`
--
-- Returns what `check_many` returns.
local function check_local(_, ARGV)
  local counts = ARGV[1]
  local n = #counts
  local byte, pcall, type, pack = string.byte, pcall, type, struct.pack
  local keys_total = 0
  for i = 1, n do
    keys_total = keys_total + byte(counts, i) - 48
  end
  if #ARGV ~= 1 + n + keys_total then
    return redis.error_reply('RLARGS check_local expects ' .. (1 + n + keys_total)
      .. ' arguments, got ' .. #ARGV .. VERSION_SKEW)
  end
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local out = {}
  local k = n + 1
  for i = 1, n do
    local m = byte(counts, i) - 48
    local keys = {ARGV[k + 1], ARGV[k + 2]}
    if m == 3 then
      keys[3] = ARGV[k + 3]
    end
    k = k + m
    local got = redis.pcall('MGET', unpack(keys))
    local msg
    if type(got) == 'table' and got.err then
      msg = 'RLMOVED ' .. got.err
    else
      local ok, r = pcall(check_one, keys, ARGV[i + 1], now, got, 1)
      if ok and type(r) == 'string' then
        out[i] = r
      elseif type(r) == 'table' and r.err then
        msg = r.err
      else
        msg = tostring(r)
      end
    end
    if msg then
      out[i] = pack('<dd', -1, #msg) .. msg
    end
  end
  return table.concat(out)
end
