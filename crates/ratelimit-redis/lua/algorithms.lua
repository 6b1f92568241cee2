-- algorithms.lua: the algorithms, one local function each, named and ordered as the
-- core's files (algo/fixed_window.rs, sliding_window.rs, sliding_log.rs,
-- token_bucket.rs, leaky_bucket.rs, gcra.rs, concurrent.rs), with the carry of a
-- bucket's or a TAT's state written under another limit. Each reads its rule's values
-- of a decoded state (check.lua's KEYS[2] layout) at st[off + 1 ..] and writes the next
-- state's into `new`; the sliding log reads and writes KEYS[3]. Part of the library
-- check.lua opens.

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

-- Writes to new[off + 1 ..] the sliding window counter of st (nil: fresh) as a commit
-- leaves it: counts shifted to sub-window cur (a clock that went back counts into the
-- newest sub-window), `add` units added to the newest. Returns the newest sub-window.
local function shift_counts(st, new, off, p, cur, add)
  local idx = st and st[off + 1]
  local nidx, shift = cur, p + 1
  if idx then
    if idx < cur then
      shift = cur - idx
      if shift > p + 1 then
        shift = p + 1
      end
    else
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
  new[off + 2] = new[off + 2] + add
  return nidx
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
  local nidx = shift_counts(st, new, off, p, cur, c)
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
    -- In debt (or after a clock that went back), the refill starts at `last`.
    retry = last - now + ceil_div(need - level, limit)
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
-- same period, for a rule of limit `limit` and capacity `capacity`: nil (fresh) when the
-- old rule has refilled it by now; else the bucket as it is when neither changed, or
-- what was used (the old capacity less the level now) taken from the new capacity, at
-- least 0 left, as of now; and whether it was converted so. As the core's
-- token_bucket::carry.
local function token_bucket_carry(now, ol, oc, level, last, limit, period, capacity)
  -- Unchanged, the state is used as it is, refilled or not: a state carried earlier is
  -- carried again at every read, and must read as a store that kept it holds it.
  if ol == limit and oc == capacity then
    return level, last, false
  end
  local full = oc * period
  local lvl = level
  if now > last then
    -- Past `full` the sum may round, never below `full`: the comparison stays exact.
    lvl = level + (now - last) * ol
  end
  if lvl >= full then
    return nil
  end
  local left = capacity * period - (full - lvl)
  if left < 0 then
    left = 0
  end
  -- A clock that went back refills from the later time.
  if now > last then
    last = now
  end
  return left, last, true
end

-- GCRA on the theoretical arrival time, held as (tat_us, tat_frac): tat_us µs and
-- tat_frac / limit of one. `cap` emission intervals of room; requests beyond the first
-- `no_delay` (0 = all) admitted with a delay. The leaky bucket is this arithmetic too:
-- a meter with cap = capacity, a shaper with cap = burst + 1 and no_delay = delay + 1.
-- The divisions are `divmod`'s, written out: this is the hottest function of the file.
local function gcra(now, c, st, new, off, limit, period, cap, no_delay)
  local bus, bfrac, reset = now, 0, 0
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
  -- q, m = divmod(bfrac + c * period, limit), inline.
  local x = bfrac + c * period
  local m = x % limit
  if m < 0 then
    m = m + limit
  elseif m >= limit then
    m = m - limit
  end
  local nus = bus + (x - m) / limit
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
  new[off + 1], new[off + 2] = nus, m
  -- divmod(room, period), inline.
  local rr = room % period
  if rr < 0 then
    rr = rr + period
  elseif rr >= period then
    rr = rr - period
  end
  return allowed, (room - rr) / period, reset, retry, exp, delay
end

-- A TAT (us, frac / ol), written under a rule of limit ol of the same algorithm and
-- period, for a rule of limit `limit`: nil (fresh) once it has passed; else the TAT as it
-- is under the same limit, or what is owed, (us - now) x ol + frac (units used x period,
-- whatever the limit), as a TAT now + owed / limit, exactly; and whether it was
-- converted so. As the core's gcra::carry.
local function gcra_carry(now, ol, us, frac, limit)
  -- Unchanged, the state is used as it is, past or not (see token_bucket_carry).
  if ol == limit then
    return us, frac, false
  end
  if not (us > now or (us == now and frac > 0)) then
    return nil
  end
  local q, r = divmod((us - now) * ol + frac, limit)
  return now + q, r, true
end

-- The state `raw`, written under another layout, for the rules of the arguments `v`: the
-- table of values in this layout (`st`), the set of rules without a state (`fresh`, by
-- rule number), whether the shared log counts and whether a state was converted to a
-- changed rule (then a denial writes the carried state: see write_carried); nil when
-- `raw` is not a state this script wrote. The core's `algo::carry_converting`, entry by
-- entry.
-- concurrent (the core's algo/concurrent.rs): at most `limit` slots live at `now`, a
-- request taking one whatever its cost. `held` lists the slots read, {deadline, number,
-- ...}, live or not; `next` (st[off + 1]) the number the next slot gets at the least. On
-- commit the check keeps the live slots and adds one, numbered max(next, now), until
-- now + period. Returns as the other algorithms, and the new slot's number and the
-- latest deadline a commit leaves (the rule's expiry).
local function concurrent(now, st, new, off, limit, period, held)
  local nxt = 0
  if st then
    nxt = st[off + 1]
  end
  local live, earliest, latest = 0, nil, nxt
  for j = 1, #held, 2 do
    local d = held[j]
    if d > latest then
      latest = d
    end
    if d > now then
      live = live + 1
      if not earliest or d < earliest then
        earliest = d
      end
    end
  end
  local slot = nxt
  if now > slot then
    slot = now
  end
  new[off + 1] = slot + 1
  local exp = now + period
  for j = 1, #held, 2 do
    if held[j] > now and held[j] > exp then
      exp = held[j]
    end
  end
  if slot + 1 > exp then
    exp = slot + 1
  end
  local retry = 0
  if live >= limit then
    retry = earliest - now
    if retry > RETRY_HINT_CAP then
      retry = RETRY_HINT_CAP
    end
  end
  return live < limit, limit - live, latest - now, retry, exp, 0, slot
end

