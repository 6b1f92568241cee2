-- refund.lua: units given back to a state after its check. `refund` gives back a
-- lease's unspent units (entries found by identity in a state of any layout); `give_back`
-- a charge that turned out not to count, or a settle below its estimate, read through
-- `own_state` (the state in these rules' layout, or carried into it by `own_carried`).
-- Reads and writes check.lua's KEYS[2] layout and the sliding log of KEYS[3]. Part of
-- the library check.lua opens.

-- The state `raw` when a denial after a conversion under these rules wrote it (the
-- layout CARRIED + `layout`, which MemoryStore holds as these rules' states), in this
-- layout as a check under them would read it: each rule's entry carried (see carry),
-- its header written, a rule without one zeroed (values that read as fresh, as the
-- module encodes a fresh state), and the log marker; then the rules without an entry
-- (`fresh`, by rule number) and whether the log counts. Nil for any other value.
local function own_carried(raw, packed, n, now, layout, width)
  if #raw < 8 or struct.unpack('<d', raw) ~= CARRIED + layout then
    return nil
  end
  local v = {struct.unpack(doubles(#packed / 8), packed)}
  local st, fresh, log_counts, _, held, marked = carry(raw, v, n, now)
  if not st then
    return nil
  end
  st[1] = layout
  local off = 1
  for i = 1, n do
    local o = HEADER + PER_RULE * i - 5
    local code, limit, a, b, id = v[o], v[o + 1], v[o + 3], v[o + 4], v[o + 5]
    if code ~= SLIDING_LOG then
      -- An entry's values start after its header: for a bucket or a TAT, after the
      -- writer's limit and capacity too (told by the code: a sliding window counter of
      -- precision 2 also holds 4 values).
      local m, values = 2, off + 2
      if code == CONCURRENT then
        m = 1
      elseif code >= TOKEN_BUCKET then
        local cap = a
        if code == LEAKY_BUCKET and b > 0 then
          cap = a + 1
        end
        st[off + 3], st[off + 4], m, values = limit, cap, 4, off + 4
      elseif code == SLIDING_WINDOW then
        m = a + 2
      end
      st[off + 1], st[off + 2] = id, m
      if fresh[i] then
        for j = values + 1, off + 2 + m do
          st[j] = 0
        end
      end
      off = off + 2 + m
    end
  end
  if off + 3 == width then
    st[off + 1], st[off + 2], st[off + 3] = LOG_MARKER, 1, marked or 0
  end
  return st, fresh, log_counts, held
end

-- A key's stored state `raw` as a give_back or debit under these rules reads it: its
-- fixed part in this layout (its own, or carried by own_carried), the rules without an
-- entry, whether the log counts, and its slots trailer as stored (kept as it is: slots
-- go back by release, and take no debt) with the latest of their deadlines. Nil for a
-- value of any other layout.
local function own_state(raw, packed, n, now, layout, width, shape)
  -- The fixed part, cut out only when a trailer follows it (a new string costs a copy
  -- and Lua's interning of it).
  local fixed = raw
  if #raw > 8 * width then
    fixed = string.sub(raw, 1, 8 * width)
  end
  local st = decode(fixed, width, shape)
  if st and st[1] == layout then
    if #raw == 8 * width then
      return st, nil, true, '', 0
    end
    local tail = string.sub(raw, 8 * width + 1)
    local tl = #tail / 8
    if tl % 1 ~= 0 or tl < 2 then
      return nil
    end
    local t = {struct.unpack(doubles(tl), tail)}
    local held = t[1] == SLOTS_MARKER and trailer(t, 1, tl)
    if not held then
      return nil
    end
    local latest = 0
    for j = 1, #held, 2 do
      if held[j] > latest then
        latest = held[j]
      end
    end
    return st, nil, true, tail, latest
  end
  local fresh, log_counts, held
  st, fresh, log_counts, held = own_carried(raw, packed, n, now, layout, width)
  if not st then
    return nil
  end
  local latest = 0
  for j = 1, #(held or {}), 2 do
    if held[j] > latest then
      latest = held[j]
    end
  end
  return st, fresh, log_counts, slots_value(held or {}), latest
end

-- What of `give` (tokens x period) a token bucket whose refill resumes at `last` puts
-- into its level, once it has shortened that wait to now: `give` less the wait's refill,
-- or nil when `give` does not cover the wait (which then moves back by the whole
-- microseconds of refill `give` holds). As the core's token_bucket::refund: units given
-- back repay a debt before they can be spent.
local function give_to_debt(give, last, now, limit)
  if last <= now then
    return give
  end
  local wait = (last - now) * limit
  if give < wait then
    return nil
  end
  return give - wait
end

-- Gives back units a lease reserved and did not spend, as if the reservation had charged
-- that many fewer. Lease mode only (src/lease.rs); exact checks never call it.
--
-- KEYS[1]  rule state of the client key (its layout: see check.lua)
--
-- ARGV[1]  now, µs since the Unix epoch; "" = read the Redis server's TIME
-- ARGV[2]  units to give back (u, at least 1)
-- ARGV[3]  the reservation's time t, µs, on the same clock as `now`
-- ARGV[4]  the units the reservation charged (b >= u)
-- ARGV[5..] 5 values per rule of the rule set: id, code, limit, period_us, window (the
--          fixed window index of the reservation; 0 for other algorithms). Codes as
--          in check.lua: 1 fixed window, 4 token bucket, 5 leaky bucket meter, 6 GCRA; rules
--          of other algorithms are never leased.
--
-- Per rule, the entry of its identity is changed only when it was written under the same
-- limit (the unit of a TAT's fraction and of a bucket's level), else left alone: a refund
-- that cannot be exact gives back nothing, which only ever admits less.
--   GCRA, leaky meter  tat -= g x period / limit, never below now
--   token bucket       level += g x period, at most the capacity that wrote it
--   fixed window       count -= u, only in the reservation's window
-- where g = min(u, b - (now - t) x limit / period): the time-based algorithms give back no
-- more of the charge than still lies ahead of now. Other instances may have been charged
-- since the reservation, on a bucket that would have been full but for it; taking the
-- units off the end of the TAT then would hand out more than the exact limiter had the
-- reservation charged u fewer. The part of the charge not yet drained cannot have been
-- hidden that way, so giving back at most that never admits more than the exact limiter.
-- The key keeps its TTL (KEEPTTL): a refund only makes the state expire sooner in truth.
--
-- Returns 1 when the state was rewritten, 0 when there was nothing to give back to. In a
-- batch (edits.lua), `pre` is the state as the batch read it (a string; otherwise it is
-- read here), and the values may be numbers.

local function refund(KEYS, ARGV, pre)
  local raw = pre
  if type(raw) ~= 'string' then
    raw = redis.call('GET', KEYS[1])
  end
  if not raw or #raw % 8 ~= 0 or #raw == 0 then
    return 0
  end

  local now
  if ARGV[1] == '' then
    now = redis_time()
  else
    now = tonumber(ARGV[1])
  end
  local u = tonumber(ARGV[2])
  local elapsed = now - tonumber(ARGV[3])
  if elapsed < 0 then
    elapsed = 0
  end
  local b = tonumber(ARGV[4])

  local v, pos = {}, 1
  for i = 1, #raw / 8 do
    v[i], pos = struct.unpack('<d', raw, pos)
  end

  -- Where each identity's values start: v[1] is the layout, then {id, m, m values}.
  local at = {}
  local i = 2
  while i + 1 <= #v do
    local m = v[i + 1]
    at[v[i]] = i + 2
    i = i + 2 + m
  end
  if i ~= #v + 1 then
    return 0
  end

  local changed = false
  for r = 5, #ARGV, 5 do
    local id, code = tonumber(ARGV[r]), tonumber(ARGV[r + 1])
    local limit, period = tonumber(ARGV[r + 2]), tonumber(ARGV[r + 3])
    local window = tonumber(ARGV[r + 4])
    local o = at[id]
    if o then
      -- The drainable part of the charge, in units of 1 / limit µs (the TAT's fraction) or
      -- of the level; none once the charge has drained (elapsed x limit >= b x period,
      -- compared before a product that could pass 2^53 is formed).
      local give = 0
      if elapsed < b * period / limit + 1 then
        give = b * period - elapsed * limit
        if give > u * period then
          give = u * period
        end
      end
      if give <= 0 then
        give = 0
      end
      -- As the core's `algo::refund_unspent`: a TAT not ahead of now, a full bucket or
      -- an empty count is left as it is (and not written).
      if (code == GCRA or code == LEAKY_BUCKET) and v[o] == limit and give > 0
        and (v[o + 2] > now or (v[o + 2] == now and v[o + 3] > 0)) then
        local q, rem = divmod(give, limit)
        local us, frac = v[o + 2] - q, v[o + 3] - rem
        if frac < 0 then
          us, frac = us - 1, frac + limit
        end
        if us < now then
          us, frac = now, 0
        end
        v[o + 2], v[o + 3], changed = us, frac, true
      elseif code == TOKEN_BUCKET and v[o] == limit and give > 0
        and v[o + 2] < v[o + 1] * period then
        local level = v[o + 2] + give
        local full = v[o + 1] * period
        if level > full then
          level = full
        end
        v[o + 2], changed = level, true
      elseif code == FIXED_WINDOW and v[o] == window and v[o + 1] > 0 then
        local count = v[o + 1] - u
        if count < 0 then
          count = 0
        end
        v[o + 1], changed = count, true
      end
    end
  end
  if not changed then
    return 0
  end

  local parts = {}
  for j = 1, #v do
    parts[j] = struct.pack('<d', v[j])
  end
  redis.call('SET', KEYS[1], table.concat(parts), 'KEEPTTL')
  return 1
end

-- Gives back units a check charged, for a request that turned out not to count (charging
-- by outcome): the core's `algo::refund`. Never more than was charged, never into another
-- window; a state written under another rule set gets nothing back.
--
-- KEYS[1]  rule state of the client key (its layout: see check.lua)
-- KEYS[2]  shared sliding log of the client key, only when a rule is a sliding log
--
-- ARGV[1]  the check's packed values, as for a check (the header's cost is the units to
--          give back; its deadline is not read)
-- ARGV[2]  the charge's time, µs, a reading of the caller's clock (the injected one, or
--          its reading of the Redis clock) taken before the check: at or before the
--          moment the check was decided
--
-- Per rule:
--   fixed window       count -= cost, only while the counted window is the charge's
--   sliding window     the charge's sub-window's count -= cost, while the state keeps it
--   sliding log        the oldest `cost` entries logged at or after the charge's time go
--   token bucket       level += g, at most the capacity
--   GCRA, leaky bucket tat -= g, never below now
-- where g = cost x period - (now - charged) x limit, at least 0: the part of the charge
-- not yet drained (what drained may have gone to other checks meanwhile). The keys keep
-- their TTLs (KEEPTTL): a refund only makes the state expire sooner in truth.
--
-- Returns 1 when something was given back, 0 otherwise. In a batch (edits.lua),
-- `batch_now` is the batch's Redis time and `pre` the state as the batch read it (a
-- string; otherwise it is read here).
-- A count less the units given back, never below 0.
local function less(count, cost)
  if count > cost then
    return count - cost
  end
  return 0
end

-- `give_back_at` is `give_back` on `packed` as it is and the charge's time `charged`
-- (nil when it was not an integer): a batch's edit (edits.lua) passes its own packed
-- value, whose first value is not `injected` (then given, 0 or 1; nil: the header's).
local function give_back_at(KEYS, packed, injected, charged, batch_now, pre)
  local len = #packed
  if len < 8 * HEADER or len % 8 ~= 0 then
    return redis.error_reply(string.format('RLARGS give_back takes its values as doubles, '
      .. 'got %d bytes', len) .. VERSION_SKEW)
  end
  local header_injected, injected_now, cost, _, n, width, log_limit, log_period, layout, _,
    pos = struct.unpack(HEADER_FORMAT, packed)
  if injected == nil then
    injected = header_injected
  end
  if not (n >= 0 and n <= MAX_RULES and len == 8 * (HEADER + PER_RULE * n)) then
    return redis.error_reply(string.format('RLARGS give_back expects %d packed values for '
      .. '%d rules, got %d', HEADER + PER_RULE * n, n, len / 8) .. VERSION_SKEW)
  end
  if not charged then
    return redis.error_reply('RLARGS the charge\'s time is an integer; the store and the '
      .. 'script are from different versions')
  end
  if cost < 1 then
    return 0
  end
  local now = injected_now
  if injected ~= 1 then
    now = batch_now or redis_time()
  end
  local ok, raw = true, pre
  if type(raw) ~= 'string' then
    ok, raw = pcall(redis.call, 'GET', KEYS[1])
  end
  if not ok or not raw then
    return 0
  end
  local shape = ''
  if width <= 1000 then
    shape = FORMATS[width] or doubles(width)
  end
  -- A concurrency rule's slots follow the fixed part (see check): kept as they are.
  local st, fresh, log_counts, tail = own_state(raw, packed, n, now, layout, width, shape)
  if not st then
    return 0
  end

  local changed, logged, off = false, false, 1
  local elapsed = now - charged
  if elapsed < 0 then
    elapsed = 0
  end
  local dirty = false
  for i = 1, n do
    local code, limit, period, a, b, id
    code, limit, period, a, b, id, pos = struct.unpack(RULE_FORMAT, packed, pos)
    -- The undrained part of the charge, in 1/limit µs (compared before a product that
    -- could pass 2^53 is formed); nothing to a rule without a state.
    local give = 0
    if not (fresh and fresh[i]) and elapsed < cost * period / limit + 1 then
      give = cost * period - elapsed * limit
      if give < 0 then
        give = 0
      end
    end
    if code == GCRA or code == LEAKY_BUCKET then
      off = off + 4
      local us, frac = st[off + 1], st[off + 2]
      if give > 0 and (us > now or (us == now and frac > 0)) then
        local left = (us - now) * limit + frac - give
        if left < 0 then
          left = 0
        end
        local q, r = divmod(left, limit)
        st[off + 1], st[off + 2], dirty = now + q, r, true
      end
      off = off + 2
    elseif code == TOKEN_BUCKET then
      off = off + 4
      local full = a * period
      local level, last = st[off + 1], st[off + 2]
      if give > 0 and (level < full or last > now) then
        local rest = give_to_debt(give, last, now, limit)
        if rest then
          level = level + rest
          if last > now then
            last = now
          end
          if level > full then
            level = full
          end
        else
          last = last - divmod(give, limit)
        end
        if level ~= st[off + 1] or last ~= st[off + 2] then
          st[off + 1], st[off + 2], dirty = level, last, true
        end
      end
      off = off + 2
    elseif code == FIXED_WINDOW then
      off = off + 2
      if st[off + 1] == divmod(charged, period) and st[off + 2] > 0 then
        st[off + 2], dirty = less(st[off + 2], cost), true
      end
      off = off + 2
    elseif code == SLIDING_WINDOW then
      off = off + 2
      local idx, k = st[off + 1], divmod(charged, b)
      if k <= idx and idx - k <= a then
        local j = off + 2 + idx - k
        if st[j] > 0 then
          st[j], dirty = less(st[j], cost), true
        end
      end
      off = off + a + 2
    elseif code == CONCURRENT then
      -- A slot goes back by release, not by a refund.
      off = off + 3
    elseif code == SLIDING_LOG and not logged and log_counts then
      logged = true
      -- Newest first: the entries at or after the charge are a prefix; its last `cost`
      -- are the oldest of them. Marked, then removed in one LREM.
      -- The whole log, as the core's refund reads it: entries past these rules' own
      -- limit (a rule set with a longer log wrote them, and a denial keeps them) are
      -- given back in their turn. A log is never longer than the largest limit any
      -- rule may have (MAX_LOG).
      local ok2, entries = pcall(redis.call, 'LRANGE', KEYS[2], 0, MAX_LOG - 1)
      if ok2 then
        local since = 0
        for i = 1, #entries do
          local stamp = tonumber(entries[i])
          if not stamp or stamp < charged then
            break
          end
          since = i
        end
        local take = cost
        if take > since then
          take = since
        end
        if take > 0 then
          for i = since - take, since - 1 do
            redis.call('LSET', KEYS[2], i, 'x')
          end
          redis.call('LREM', KEYS[2], take, 'x')
          changed = true
          -- The log marker counts from the newest entry left, as a commit sets it: the
          -- entries given back no longer keep the log alive.
          local newest = tonumber(redis.call('LINDEX', KEYS[2], 0))
          st[width], dirty = (newest and newest + log_period) or 0, true
        end
      end
    end
  end
  if dirty then
    redis.call('SET', KEYS[1], encode(st, width, shape) .. tail, 'KEEPTTL')
    changed = true
    -- The state is written in the rules' own layout, which vouches for the log: a log
    -- the carried state did not vouch for is no one's (MemoryStore dropped it with the
    -- rules that had no log), so it goes rather than count again.
    if log_limit > 0 and not log_counts then
      redis.call('DEL', KEYS[2])
    end
  end
  if changed then
    return 1
  end
  return 0
end

local function give_back(KEYS, ARGV, batch_now, pre)
  return give_back_at(KEYS, ARGV[1], nil, tonumber(ARGV[2]), batch_now, pre)
end
