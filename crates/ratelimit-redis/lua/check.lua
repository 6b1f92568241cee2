-- check.lua: one rate-limit decision for one client key, all rules at once (`check`);
-- many such decisions in one call (`check_many`, and `check_local` on a Cluster node);
-- and, at the end of the file, the refund of a lease's unspent units (`refund`), the
-- refund of a charge (`give_back`) and the debt of a charge settled above its estimate
-- (`debit`).
--
-- An integer translation of the core's algorithms: one local function per algorithm,
-- named and ordered as the core's files (algo/fixed_window.rs, sliding_window.rs,
-- sliding_log.rs, token_bucket.rs, leaky_bucket.rs, gcra.rs), evaluated on the state as
-- it stands and committed all or nothing. Every value is an integer below 2^53 (the core
-- refuses rules outside that bound), so Lua's doubles hold them exactly; divisions go
-- through `divmod`'s arithmetic (written out in the hottest places), never `/` or `%`
-- alone (but for `x % 1` and `/ 1000`, exact where they are used, as said there), and
-- numbers sent back to Redis as text are formatted with '%d', never `tostring` (which
-- would switch to exponent notation).
--
-- The argument layout is owned by `CheckArgs` in src/script/args.rs and the reply's by
-- `CheckReply` in src/script/reply.rs; change them and this file together. The store
-- puts one line before this file (src/script/load.rs) defining the constants it shares
-- with them and with the core: HEADER and PER_RULE (the values of the header and of
-- each rule in ARGV[1]), MAX_RULES (the most rules a rule set has), MAX_STATE (the most
-- values a state holds: a longer value is no state), and HEADER_FORMAT and RULE_FORMAT
-- (the struct formats of the header and of one rule).
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
--          tat_frac); concurrent (next: the number the next slot gets at the least).
--          The log marker is the entry {0, 1, until}: the shared log counts
--          until then (the newest entry plus the writer's longest sliding-log period).
--          Past these `width` values, when a concurrency rule holds slots, the slots
--          trailer {SLOTS_MARKER, 2k, deadline, number, ...}: one pair per slot.
--          A denial after a conversion (below) writes the layout 2^52, no rule set's,
--          and entries only for the rules that carried a state.
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
--            CONCURRENT      7   period = the slots' timeout (see concurrent below)
--
-- A state of the same layout is read in place. One of another layout (the rules changed,
-- or processes on two rule versions share the key) is read entry by entry: each rule
-- takes the entry of its identity, carried as the core's `algo::carry_converting` does
-- (see carry below: windows' counts as they are, a token bucket's or a TAT's usage
-- converted to a changed limit or capacity), and starts fresh without one; a check that
-- commits writes the state in its own layout, so the entries of rules it does not have
-- are dropped then. A denial after a conversion writes the carried entries too (see
-- write_carried): a converted state depends on the time, and the next check must not
-- convert again from the old one. A peek, and any other denial, writes nothing.
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
-- marker and state, one SET of the state with its expiry when the check commits (or is
-- denied after a conversion); a sliding log adds LLEN, LINDEX, LPUSH, PEXPIRE (or a DEL
-- of a log that no longer counts; a denial after a conversion only a PEXPIRE). A value of
-- another type at a key reads as absent and is replaced (status 2) when the check
-- commits; a block marker of another type is left alone and reads as no block.

-- Cost: run with EVALSHA, every function below is created anew on each call, and each
-- local it captures costs at creation. So the functions take their inputs as parameters,
-- reach library functions as globals, and capture only each other and the four tables
-- every check reuses (FORMATS, OUT, NEXT, REPLIES). Loaded as a library (FCALL), the
-- functions are made once and a captured local costs less than a global.

local FIXED_WINDOW, SLIDING_WINDOW, SLIDING_LOG, TOKEN_BUCKET, LEAKY_BUCKET, GCRA, CONCURRENT =
  1, 2, 3, 4, 5, 6, 7
-- The identity of the slots trailer (2^52 + 1): no rule's, no layout's.
local SLOTS_MARKER = 4503599627370497
-- The largest retry of a refusal for want of a slot, in µs: a hint.
local RETRY_HINT_CAP = 1000000
-- The identity of the log marker's entry; no rule has it.
local LOG_MARKER = 0
-- The layouts of states a denial wrote after a conversion (see write_carried): 2^52 plus
-- the writer's layout, no rule set's (their layouts are below 2^52), so every check reads
-- it entry by entry; for the rule set that wrote it, the shared log counts as it does in
-- a state of its own layout (as MemoryStore, whose entry then holds that rule set).
local CARRIED = 4503599627370496

-- Exact floor division of non-negative integers below 2^53. Lua's `a % b` is
-- a - floor(a / b) * b: the double quotient may round across an integer, which leaves
-- the remainder one b out of [0, b); correcting it makes it exact, and a - r is then a
-- multiple of b, whose quotient the division gives exactly. All of it runs in the VM,
-- without a call to math.floor: that call costs more than the arithmetic.
local function divmod(a, b)
  local r = a % b
  if r < 0 then
    r = r + b
  elseif r >= b then
    r = r - b
  end
  return (a - r) / b, r
end

-- ceil(a / b) for a >= 0, b > 0.
local function ceil_div(a, b)
  local q, r = divmod(a, b)
  if r > 0 then
    return q + 1
  end
  return q
end

-- The struct format of w doubles, made once per width: a library's locals live as long
-- as the library (under EVALSHA, for the call). Callers look in FORMATS first: a table
-- read costs less than a call.
local FORMATS = {}
local function doubles(w)
  local f = FORMATS[w]
  if not f then
    f = '<' .. string.rep('d', w)
    FORMATS[w] = f
  end
  return f
end

-- The reply and the next state of the check at hand (see check_one), and the replies of
-- a batch: the library's own, reused by every call.
local OUT, NEXT, REPLIES = {}, {}, {}

-- The state as a string of little-endian doubles (exact for integers below 2^53), in
-- chunks of at most 1000: Lua can hold only so many values on its stack at once.

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
    -- An integer in [0, 2^53), one this script could have written. Below 2^53, x % 1 is
    -- exact (x - floor(x)); NaN and the infinities give NaN.
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

-- The slots trailer at value `p` of `t` (its marker), as a list {deadline, number, ...};
-- nil when it is not one ending the state of `len` values.
local function trailer(t, p, len)
  local m = t[p + 1]
  if not m or m % 2 ~= 0 or m > 2 * MAX_CONCURRENT or p + 1 + m ~= len then
    return nil
  end
  local held = {}
  for j = 1, m do
    held[j] = t[p + 1 + j]
  end
  return held
end

local function carry(raw, v, n, now)
  local len = #raw / 8
  -- Longer than the widest state (MAX_STATE values): no state of this encoding, read
  -- as fresh before anything is decoded, as the module does.
  if len % 1 ~= 0 or len < 1 or len > MAX_STATE then
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
  -- A carried state's writer finds its log counting while the state says it has one, as
  -- in a state of its own layout.
  if lp and t[lp - 1] == 1 and (t[lp] > now or t[1] == CARRIED + v[9]) then
    log_counts = true
  end
  local st, fresh, off, converted = {}, {}, 1, false
  for i = 1, n do
    local o = HEADER + PER_RULE * i - 5
    local code, limit, period, a, b, id = v[o], v[o + 1], v[o + 2], v[o + 3], v[o + 4], v[o + 5]
    if code ~= SLIDING_LOG then
      local p, width = at[id], 2
      if code == SLIDING_WINDOW then
        width = a + 2
      elseif code == CONCURRENT then
        width = 1
      end
      if code >= TOKEN_BUCKET and code ~= CONCURRENT then
        -- The header's writer limit and capacity.
        off = off + 4
        if p and t[p - 1] == width + 2 then
          local x, y, z
          if code == TOKEN_BUCKET then
            x, y, z =
              token_bucket_carry(now, t[p], t[p + 1], t[p + 2], t[p + 3], limit, period, a)
          else
            x, y, z = gcra_carry(now, t[p], t[p + 2], t[p + 3], limit)
          end
          if x then
            st[off + 1], st[off + 2] = x, y
            if z then
              converted = true
            end
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
  local held = {}
  local sp = at[SLOTS_MARKER]
  if sp then
    held = trailer(t, sp - 2, len) or {}
  end
  return st, fresh, log_counts, converted, held, lp and t[lp]
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
  return 'PXAT', string.format('%d', math.ceil(at / 1000))
end

-- Sets the shared log's expiry to `at` µs (see expiry_arg).
local function expire_log(key3, injected, now, ttl_floor, at)
  local unit, ms = expiry_arg(injected, now, ttl_floor, at)
  if unit == 'PX' then
    redis.call('PEXPIRE', key3, ms)
  else
    redis.call('PEXPIREAT', key3, ms)
  end
end

-- The slots trailer of `held` ({deadline, number, ...}), '' when it holds none.
local function slots_value(held)
  local m = #held
  if m == 0 then
    return ''
  end
  local parts = {struct.pack('<dd', SLOTS_MARKER, m)}
  for j = 1, m, 2 do
    parts[#parts + 1] = struct.pack('<dd', held[j], held[j + 1])
  end
  return table.concat(parts)
end

-- Writes the state carried to this check's rules, on a denial after a carry that
-- converted a state (see carry), as the core's MemoryStore does: a converted state
-- depends on the time of the carry, so the next check reads it as it is instead of
-- converting again from the old state at another time, and the denial's retry time
-- holds. The state holds the entries of the rules that carried one, in this layout's
-- order (headers from `new`, where the check put them; values from `st`), and the log
-- marker, under the layout CARRIED + this layout: a rule that starts fresh gets no entry (a fixed
-- window has no values that read as fresh at every time), and the next check carries
-- each entry as it is (a converted entry holds its new rule's limit and capacity). The
-- log counts until its newest entry leaves the longest sliding-log window of these
-- rules, and its key is kept as long. The state expires with its longest-lived rule,
-- the largest reset in `out`. A peek, or a denial without a conversion, writes nothing.
local function write_carried(key2, key3, packed, n, st, fresh, new, out, now, injected,
    ttl_floor, log_limit, log_period, newest, layout, held)
  local unpack_ = struct.unpack
  local w, k, off, at, pos = {CARRIED + layout}, 1, 1, now, 8 * HEADER + 1
  for i = 1, n do
    local code, a, _
    code, _, _, a, _, _, pos = unpack_(RULE_FORMAT, packed, pos)
    if code ~= SLIDING_LOG then
      local head, width = 2, 2
      if code == CONCURRENT then
        width = 1
      elseif code >= TOKEN_BUCKET then
        head = 4
      elseif code == SLIDING_WINDOW then
        width = a + 2
      end
      if not fresh[i] then
        for j = off + 1, off + head do
          k = k + 1
          w[k] = new[j]
        end
        for j = off + head + 1, off + head + width do
          k = k + 1
          w[k] = st[j]
        end
      end
      off = off + head + width
    end
    if now + out[4 * i + 1] > at then
      at = now + out[4 * i + 1]
    end
  end
  if log_limit > 0 and newest then
    w[k + 1], w[k + 2], w[k + 3] = LOG_MARKER, 1, newest + log_period
    k = k + 3
    expire_log(key3, injected, now, ttl_floor, newest + log_period)
  end
  local shape = ''
  if k <= 1000 then
    shape = FORMATS[k] or doubles(k)
  end
  local unit, ms = expiry_arg(injected, now, ttl_floor, at)
  redis.call('SET', key2, encode(w, k, shape) .. slots_value(held), unit, ms)
end

-- The Redis server's time, in µs since the Unix epoch.
local function redis_time()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

local VERSION_SKEW = ' values; the store and the script are from different versions'

-- Values of the packed encoding are integers below this (2^53).
local TOP = 9007199254740992

-- One check on its keys and packed values. In a batch, `redis_now` is the Redis time read
-- once for all, and when `at` is set, got[at] and got[at + 1] are the block marker and
-- state as read for all (alone: nil, nil, nil, read here). Evaluates every rule on the
-- state as it stands and commits all or nothing.
local function check_one(key1, key2, key3, packed, redis_now, got, at)
  local fmt, unpack_ = string.format, struct.unpack
  local len = #packed
  if len < 8 * HEADER or len % 8 ~= 0 then
    return redis.error_reply(fmt('RLARGS check.lua takes its values as doubles, got %d bytes',
      len) .. VERSION_SKEW)
  end
  -- The header in one C call (no text to parse); `pos` is where the rules start.
  local injected, injected_now, cost, ttl_floor, n, width, log_limit, log_period, layout,
    deadline, pos = unpack_(HEADER_FORMAT, packed)
  if not (n >= 0 and n <= MAX_RULES and len == 8 * (HEADER + PER_RULE * n)) then
    return redis.error_reply(fmt('RLARGS check.lua expects %d packed values for %d rules of '
      .. 'at most %d, got %d', HEADER + PER_RULE * n, n, MAX_RULES, len / 8) .. VERSION_SKEW)
  end
  -- Values no store sends (it checks its rules and costs first) are refused before
  -- anything is read or written: values out of [0, 2^53), NaN (which fails every
  -- comparison), a cost that is not whole. Comparisons only, written out: this runs on
  -- every check (a `%` or a function per value costs several percent of a decision).
  local top = TOP
  if not ((injected == 0 or injected == 1) and injected_now >= 0 and injected_now < top
      and cost >= 0 and cost < top and cost % 1 == 0 and ttl_floor >= 0 and ttl_floor < top
      and width >= 0 and width < top and log_limit >= 0 and log_limit < top
      and log_period >= 0 and log_period < top and layout >= 0 and layout < top
      and deadline >= 0 and deadline < top) then
    return redis.error_reply('RLARGS a value of the header is out of range; '
      .. 'the store and the script are from different versions')
  end
  if deadline > 0 then
    -- The caller's deadline is on the Redis clock, whatever the check's own clock.
    if not redis_now then
      redis_now = redis_time()
    end
    if redis_now > deadline then
      -- The caller stopped waiting before Redis got to this check (a slow command, a
      -- fork, DEBUG SLEEP): decide nothing and charge nothing.
      return struct.pack('<dd', 3, redis_now)
    end
  end

  -- The time: injected, or Redis's (read once for a batch, `redis_now`).
  injected = injected == 1
  local now = injected_now
  if not injected then
    now = redis_now or redis_time()
  end
  -- The block marker and the state: read for the whole batch (got[at], got[at + 1]), or
  -- here (alone, or when an earlier check of the batch wrote them). Blocks come first: a
  -- blocked key consults no rule.
  if not at then
    got, at = redis.call('MGET', key1, key2), 1
  end
  local status = 0
  local block = got[at]
  if block then
    if block == 'inf' then
      return struct.pack('<dd', 1, -1)
    end
    local untl = tonumber(block)
    if untl and untl > now then
      return struct.pack('<dd', 1, untl - now)
    end
    if not untl then
      -- Not a marker this store wrote: dropped, and said.
      status = 2
    end
    redis.call('DEL', key1)
  end
  local raw = got[at + 1]
  -- The units to weigh: a peek (cost 0) weighs as one.
  local c = cost
  if c < 1 then
    c = 1
  end

  -- The state's struct format, or '' when it is too wide for one struct call (it is then
  -- read and written in chunks).
  local shape = ''
  if width <= 1000 then
    shape = FORMATS[width] or doubles(width)
  end

  -- The stored state in this layout: read in place when this rule set wrote it, else
  -- carried entry by entry (rules in `fresh` start without state). The shared log counts
  -- when this rule set wrote the state, or the state's log marker says so.
  local st, fresh, log_counts, converted = nil, nil, false, false
  -- The slots read, {deadline, number, ...}: a state longer than its width holds them
  -- in its trailer (see KEYS[2]), read in place with it.
  local held = {}
  if raw then
    if #raw > 8 * width and width >= 1 then
      local rest = string.sub(raw, 8 * width + 1)
      local m = #rest / 8
      local tr = nil
      if m >= 2 and m % 1 == 0 and m <= 2 + 2 * MAX_CONCURRENT then
        local tshape = ''
        if m <= 1000 then
          tshape = FORMATS[m] or doubles(m)
        end
        tr = decode(rest, m, tshape)
      end
      if tr and tr[1] == SLOTS_MARKER then
        tr = trailer(tr, 1, m)
      else
        tr = nil
      end
      if tr then
        st = decode(string.sub(raw, 1, 8 * width), width, shape)
        if st and st[1] == layout then
          held = tr
        else
          st = nil
        end
      end
    else
      st = decode(raw, width, shape)
    end
    if st and st[1] == layout then
      log_counts = true
    else
      st, fresh, log_counts, converted, held =
        carry(raw, {unpack_(doubles(len / 8), packed)}, n, now)
      if not st then
        -- Read as fresh; the commit replaces it.
        status = 2
        held = {}
      end
    end
  end

  local log_len, newest, drop_log = 0, nil, false
  if log_limit > 0 then
    if not log_counts then
      -- A log the state does not vouch for is no one's: read as empty, and dropped before
      -- it is added to. Only a commit drops it (a denial that writes a converted state
      -- leaves it unvouched for, as a commit would): a peek or another denial writes
      -- nothing, so the rules that wrote the log still find it (as MemoryStore keeps it).
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

  -- Evaluate every rule on the state as it stands; out[1 .. 2 + 4n] holds the reply:
  -- status, delay, then per rule allowed, remaining, reset, retry. The next state goes to
  -- new[1 .. width], each rule's expiry to new[width + i]; `off` is where the values of
  -- the rule at hand start, past its entry's header. Both tables are the library's own,
  -- reused by every check (each check writes every entry it reads): a table made per
  -- check, and grown to its size, would cost more than the decision.
  local out, new = OUT, NEXT
  out[1], out[2], new[1] = status, 0, layout
  local all_ok, delay, off = true, 0, 1
  local code, limit, period, a, b, id
  -- The concurrency rule's position and the number a commit gives its slot.
  local conc, slot, conc_period = nil, nil, 0
  for i = 1, n do
    code, limit, period, a, b, id, pos = unpack_(RULE_FORMAT, packed, pos)
    -- A rule no store sends, or a cost above what the rule can ever admit (the core's
    -- `RuleSet::check_cost`): refused, nothing written.
    local most = limit
    if code == GCRA or code == TOKEN_BUCKET or code == LEAKY_BUCKET then
      most = a
      if code == LEAKY_BUCKET and b > 0 then
        most = a + 1
      end
    elseif code == CONCURRENT then
      -- One slot whatever the cost.
      most = TOP
    end
    if not (limit >= 1 and limit < TOP and period >= 1 and period < TOP and a >= 0
        and a < TOP and b >= 0 and b < TOP and c <= most) then
      return redis.error_reply(fmt('RLARGS rule %d: limit %s, period %s, values %s and %s, '
        .. 'cost %s; the store and the script are from different versions', i - 1, limit,
        period, a, b, cost))
    end
    local s = st
    if fresh and fresh[i] then
      s = nil
    end
    local allowed, remaining, reset, retry, exp, wait
    if code == GCRA or code == LEAKY_BUCKET then
      -- The entry's header: identity, 4 values, the limit and capacity a carry needs.
      local cap, no_delay = a, 0
      if code == LEAKY_BUCKET and b > 0 then
        cap, no_delay = a + 1, b
      end
      new[off + 1], new[off + 2], new[off + 3], new[off + 4] = id, 4, limit, cap
      off = off + 4
      allowed, remaining, reset, retry, exp, wait =
        gcra(now, c, s, new, off, limit, period, cap, no_delay)
      off = off + 2
    elseif code == FIXED_WINDOW then
      new[off + 1], new[off + 2] = id, 2
      off = off + 2
      allowed, remaining, reset, retry, exp, wait = fixed_window(now, c, s, new, off, limit, period)
      off = off + 2
    elseif code == SLIDING_WINDOW then
      new[off + 1], new[off + 2] = id, a + 2
      off = off + 2
      allowed, remaining, reset, retry, exp, wait =
        sliding_window(now, c, s, new, off, limit, period, a, b)
      off = off + a + 2
    elseif code == TOKEN_BUCKET then
      new[off + 1], new[off + 2], new[off + 3], new[off + 4] = id, 4, limit, a
      off = off + 4
      allowed, remaining, reset, retry, exp, wait =
        token_bucket(now, c, s, new, off, limit, period, a)
      off = off + 2
    elseif code == CONCURRENT then
      if fresh and fresh[i] then
        -- No entry of this rule's identity: its slots are no one's.
        held = {}
      end
      new[off + 1], new[off + 2] = id, 1
      off = off + 2
      allowed, remaining, reset, retry, exp, wait, slot =
        concurrent(now, s, new, off, limit, period, held)
      conc, conc_period = i, period
      off = off + 1
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
    else
      return redis.error_reply(fmt('RLARGS unknown algorithm code %d', code))
    end
    if not allowed then
      all_ok = false
    end
    if wait > delay then
      delay = wait
    end
    new[width + i] = exp
    -- Remaining, reset and retry as replied: never negative.
    if remaining < 0 then
      remaining = 0
    end
    if reset < 0 then
      reset = 0
    end
    if retry < 0 then
      retry = 0
    end
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
    if converted and cost > 0 then
      -- Slots go with their rule: a set without one drops them, as it drops the
      -- entries of rules it does not have.
      local kept = {}
      if conc then
        kept = held
      end
      write_carried(key2, key3, packed, n, st, fresh, new, out, now, injected, ttl_floor,
        log_limit, log_period, newest, layout, kept)
    end
    return struct.pack(FORMATS[2 + 4 * n] or doubles(2 + 4 * n), unpack(out, 1, 2 + 4 * n))
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
    if i == conc then
      -- One slot, whatever the cost; its number goes back as the rule's retry.
      left = out[4 * i] - 1
      out[4 * i + 2] = slot
    end
    if left < 0 then
      left = 0
    end
    out[4 * i] = left
  end
  -- The slots the state keeps: the live ones and the new one.
  local tail = ''
  if conc then
    local keep = {}
    for j = 1, #held, 2 do
      if held[j] > now then
        keep[#keep + 1] = held[j]
        keep[#keep + 1] = held[j + 1]
      end
    end
    keep[#keep + 1] = now + conc_period
    keep[#keep + 1] = slot
    tail = slots_value(keep)
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
  local unit, ms = expiry_arg(injected, now, ttl_floor, state_expires)
  if raw then
    redis.call('SET', key2, encode(new, width, shape) .. tail, unit, ms)
  elseif not redis.call('SET', key2, encode(new, width, shape) .. tail, unit, ms, 'NX') then
    -- Nothing was read, yet the key exists: a value of another type (MGET reads it as
    -- nil), replaced, and said so.
    redis.call('DEL', key2)
    redis.call('SET', key2, encode(new, width, shape) .. tail, unit, ms)
    out[1] = 2
  end

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
    expire_log(key3, injected, now, ttl_floor, log_now + log_period)
  end

  return struct.pack(FORMATS[2 + 4 * n] or doubles(2 + 4 * n), unpack(out, 1, 2 + 4 * n))
end

-- One decision. The file defines `check`, `check_many`, `check_local`, `refund`,
-- `give_back` and `debit`, and nothing else runs at load: the store loads it as a Redis function library (Redis 7:
-- FUNCTION LOAD, then FCALL, so the functions above are created once per server, not
-- once per call) or, on Redis 6.2, runs it with EVALSHA followed by
-- `return check(KEYS, ARGV)` (or another of the six).
local function check(KEYS, ARGV)
  if #ARGV ~= 1 then
    return redis.error_reply('RLARGS check.lua takes 1 argument, got ' .. #ARGV .. VERSION_SKEW)
  end
  return check_one(KEYS[1], KEYS[2], KEYS[3], ARGV[1], nil, nil, nil)
end

-- A check of a batch that failed, as the batch's reply carries it: the doubles
-- {-1, length} and that many bytes of message. `r` is what failed it: an error reply, an
-- error raised, or a message.
local function failure(r)
  local msg
  if type(r) == 'table' and r.err then
    msg = r.err
  else
    msg = tostring(r)
  end
  return struct.pack('<dd', -1, #msg) .. msg
end

-- Many decisions in one call, in order, each decided as `check` decides it alone but for
-- one TIME read and one MGET of every key for all. The store sends what queued while its
-- previous call was in flight.
--
-- KEYS     the keys of each check in turn, as for `check` (2, or 3 with a sliding log)
-- ARGV[1]  one character per check: its number of keys, '2' or '3'; or '4' or '5' for 2
--          or 3 keys that an earlier check of the batch has too (the same client key):
--          such a check reads its keys again itself, after the earlier one wrote them
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
  local byte, pcall, type = string.byte, pcall, type
  local k = 0
  for i = 1, n do
    local m = byte(counts, i) - 48
    if m < 2 or m > 5 then
      return redis.error_reply('RLARGS check_many takes key counts 2 to 5, got '
        .. counts:sub(i, i) .. VERSION_SKEW)
    end
    if m > 3 then
      m = m - 2
    end
    k = k + m
  end
  if k ~= #KEYS then
    return redis.error_reply('RLARGS check_many counts ' .. k .. ' keys, got ' .. #KEYS
      .. VERSION_SKEW)
  end
  local now = redis_time()
  -- Every key at once; a sliding log's key, a list, reads as nil (and is not used).
  local got = redis.call('MGET', unpack(KEYS))
  local out = REPLIES
  k = 0
  for i = 1, n do
    local m, at = byte(counts, i) - 48, k + 1
    if m > 3 then
      m, at = m - 2, nil
    end
    local l = nil
    if m == 3 then
      l = KEYS[k + 3]
    end
    local ok, r = pcall(check_one, KEYS[k + 1], KEYS[k + 2], l, ARGV[i + 1], now, got, at)
    k = k + m
    if ok and type(r) == 'string' then
      out[i] = r
    else
      out[i] = failure(r)
    end
  end
  return table.concat(out, '', 1, n)
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
  local byte, pcall, type = string.byte, pcall, type
  local keys_total = 0
  for i = 1, n do
    keys_total = keys_total + byte(counts, i) - 48
  end
  if #ARGV ~= 1 + n + keys_total then
    return redis.error_reply('RLARGS check_local expects ' .. (1 + n + keys_total)
      .. ' arguments, got ' .. #ARGV .. VERSION_SKEW)
  end
  local now = redis_time()
  local out = REPLIES
  local k = n + 1
  for i = 1, n do
    local m = byte(counts, i) - 48
    local b, s, l = ARGV[k + 1], ARGV[k + 2], nil
    local got
    if m == 3 then
      l = ARGV[k + 3]
      got = redis.pcall('MGET', b, s, l)
    else
      got = redis.pcall('MGET', b, s)
    end
    k = k + m
    if type(got) == 'table' and got.err then
      out[i] = failure('RLMOVED ' .. got.err)
    else
      local ok, r = pcall(check_one, b, s, l, ARGV[i + 1], now, got, 1)
      if ok and type(r) == 'string' then
        out[i] = r
      else
        out[i] = failure(r)
      end
    end
  end
  return table.concat(out, '', 1, n)
end

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
  local st = decode(string.sub(raw, 1, 8 * width), width, shape)
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
-- KEYS[1]  rule state of the client key (see the top of this file for its layout)
--
-- ARGV[1]  now, µs since the Unix epoch; "" = read the Redis server's TIME
-- ARGV[2]  units to give back (u, at least 1)
-- ARGV[3]  the reservation's time t, µs, on the same clock as `now`
-- ARGV[4]  the units the reservation charged (b >= u)
-- ARGV[5..] 5 values per rule of the rule set: id, code, limit, period_us, window (the
--          fixed window index of the reservation; 0 for other algorithms). Codes as
--          above: 1 fixed window, 4 token bucket, 5 leaky bucket meter, 6 GCRA; rules
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
-- Returns 1 when the state was rewritten, 0 when there was nothing to give back to.

local function refund(KEYS, ARGV)
  local raw = redis.call('GET', KEYS[1])
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
-- KEYS[1]  rule state of the client key (see the top of this file)
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
-- Returns 1 when something was given back, 0 otherwise.
-- A count less the units given back, never below 0.
local function less(count, cost)
  if count > cost then
    return count - cost
  end
  return 0
end

local function give_back(KEYS, ARGV)
  local packed = ARGV[1]
  local len = #packed
  if len < 8 * HEADER or len % 8 ~= 0 then
    return redis.error_reply(string.format('RLARGS give_back takes its values as doubles, '
      .. 'got %d bytes', len) .. VERSION_SKEW)
  end
  local injected, injected_now, cost, _, n, width, log_limit, log_period, layout, _, pos =
    struct.unpack(HEADER_FORMAT, packed)
  if not (n >= 0 and n <= MAX_RULES and len == 8 * (HEADER + PER_RULE * n)) then
    return redis.error_reply(string.format('RLARGS give_back expects %d packed values for '
      .. '%d rules, got %d', HEADER + PER_RULE * n, n, len / 8) .. VERSION_SKEW)
  end
  local charged = tonumber(ARGV[2])
  if not charged then
    return redis.error_reply('RLARGS the charge\'s time is an integer; the store and the '
      .. 'script are from different versions')
  end
  if cost < 1 then
    return 0
  end
  local now = injected_now
  if injected ~= 1 then
    now = redis_time()
  end
  local ok, raw = pcall(redis.call, 'GET', KEYS[1])
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
      local ok2, entries = pcall(redis.call, 'LRANGE', KEYS[2], 0, log_limit - 1)
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

-- Charges units unconditionally, as debt where a state goes past its limit: the excess
-- of a metered request settled above the estimate its check charged (the core's
-- `algo::debit`; an actual below the estimate goes to `give_back`). Every rule takes at
-- most its cap, `limit` (one period's), and for the token bucket, GCRA and leaky bucket
-- at most 2^51 / period (so every value stays below 2^53); and never more than takes its
-- state past its capacity plus that cap in use:
--   fixed window       the count of the current window, at most limit + cap
--   sliding window     the current sub-window's count, while the window's counts (the
--                      oldest one whole) stay at most limit + cap
--   sliding log        at most `log_limit` entries at the log's time
--   token bucket       from the level at now, the rest below empty: level 0 as of a last
--                      pushed on by the rest's refill time (rounded up to a microsecond)
--   GCRA, leaky bucket the TAT moved on from max(tat, now)
-- A key without a state is charged from fresh; a state of another layout (the rules
-- changed, or it is no state of this script's) is charged nothing. The state is written
-- with an expiry that covers its longest-lived rule, as a check's commit writes it.
--
-- KEYS[1]  rule state of the client key (see the top of this file)
-- KEYS[2]  shared sliding log of the client key, only when a rule is a sliding log
--
-- ARGV[1]  the check's packed values, as for a check (the header's cost is the units to
--          charge; its deadline is not read)
--
-- Returns 1 when a state changed, 0 otherwise.

-- The counts of sub-window cur as a check sees them, the oldest one whole: as the core's
-- sliding_window::window_sums, summed.
local function window_used(st, off, p, cur)
  local idx = st and st[off + 1]
  if not idx then
    return 0
  end
  local used = 0
  if idx <= cur then
    local keep = p - (cur - idx)
    for d = 0, keep do
      used = used + st[off + 2 + d]
    end
  else
    for d = 0, p do
      if d <= cur then
        used = used + sub_count(st, off, idx, p, cur - d)
      end
    end
  end
  return used
end

local function debit(KEYS, ARGV)
  local packed = ARGV[1]
  local len = #packed
  if #ARGV ~= 1 or len < 8 * HEADER or len % 8 ~= 0 then
    return redis.error_reply(string.format('RLARGS debit takes the packed values as '
      .. 'doubles, got %d arguments and %d bytes', #ARGV, len) .. VERSION_SKEW)
  end
  local injected, injected_now, units, ttl_floor, n, width, log_limit, log_period, layout, _,
    pos = struct.unpack(HEADER_FORMAT, packed)
  local top = TOP
  if not (n >= 1 and n <= MAX_RULES and len == 8 * (HEADER + PER_RULE * n)
      and (injected == 0 or injected == 1) and injected_now >= 0 and injected_now < top
      and units >= 0 and units < top and units % 1 == 0 and ttl_floor >= 0
      and ttl_floor < top and width >= 1 and width <= MAX_STATE and width % 1 == 0
      and log_limit >= 0 and log_limit < top and log_period >= 0 and log_period < top
      and layout >= 0 and layout < top) then
    return redis.error_reply('RLARGS debit: a value of the header is out of range'
      .. VERSION_SKEW)
  end
  -- Every rule is checked before anything is read or written.
  local rules = {}
  for i = 1, n do
    local code, limit, period, a, b, id
    code, limit, period, a, b, id, pos = struct.unpack(RULE_FORMAT, packed, pos)
    if not (code >= FIXED_WINDOW and code <= CONCURRENT and code % 1 == 0 and limit >= 1
        and limit < top and period >= 1 and period < top and a >= 0 and a < top
        and b >= 0 and b < top and id >= 0 and id < top) then
      return redis.error_reply(string.format('RLARGS debit: rule %d is out of range', i - 1)
        .. VERSION_SKEW)
    end
    rules[i] = {code, limit, period, a, b, id}
  end
  if units < 1 then
    return 0
  end
  local now = injected_now
  injected = injected == 1
  if not injected then
    now = redis_time()
  end
  local ok, raw = pcall(redis.call, 'GET', KEYS[1])
  if not ok then
    return 0
  end
  local shape = ''
  if width <= 1000 then
    shape = FORMATS[width] or doubles(width)
  end
  -- A concurrency rule's slots follow the fixed part (see check): kept as they are, the
  -- key kept until their deadlines.
  local st, log_counts, tail, latest = nil, false, '', 0
  if raw then
    st, _, log_counts, tail, latest = own_state(raw, packed, n, now, layout, width, shape)
    if not st then
      return 0
    end
  end

  -- The shared log: it counts when the state vouches for it; without a state it is no
  -- one's, and is dropped before the debt is logged.
  local log_len, newest, drop_log = 0, nil, false
  if log_limit > 0 then
    if not log_counts then
      drop_log = true
    else
      log_len = redis.pcall('LLEN', KEYS[2])
      if type(log_len) == 'table' then
        log_len, drop_log = 0, true
      elseif log_len > 0 then
        newest = tonumber(redis.call('LINDEX', KEYS[2], 0))
        if not newest then
          log_len, drop_log = 0, true
        end
      end
    end
  end

  local new = {layout}
  local off, expires, changed, logged = 1, 0, false, false
  for i = 1, n do
    local code, limit, period, a, b, id = unpack(rules[i])
    local cap = limit
    if code >= TOKEN_BUCKET then
      local most = divmod(2251799813685248, period)
      if most < cap then
        cap = most
      end
    end
    local take = units
    if take > cap then
      take = cap
    end
    local exp = 0
    if code == GCRA or code == LEAKY_BUCKET or code == TOKEN_BUCKET then
      local capacity = a
      if code == LEAKY_BUCKET and b > 0 then
        capacity = a + 1
      end
      new[off + 1], new[off + 2], new[off + 3], new[off + 4] = id, 4, limit, capacity
      off = off + 4
      local x, y
      if st then
        x, y = st[off + 1], st[off + 2]
      end
      local most = (capacity + cap) * period
      if code == TOKEN_BUCKET then
        local full = capacity * period
        local level, base = full, now
        if st then
          level = x
          if now > y then
            level = x + (now - y) * limit
          end
          if level > full then
            level = full
          end
          if y > now then
            base = y
          end
        end
        local add = most - (full - level + (base - now) * limit)
        if add > take * period then
          add = take * period
        end
        if add > 0 then
          if level >= add then
            x, y = level - add, base
          else
            x, y = 0, base + ceil_div(add - level, limit)
          end
          changed = true
        end
        local held = x
        if held > full then
          held = full
        end
        exp = y + ceil_div(full - held, limit)
      else
        local us, frac = now, 0
        if st and (x > now or (x == now and y > 0)) then
          us, frac = x, y
        end
        local add = most - ((us - now) * limit + frac)
        if add > take * period then
          add = take * period
        end
        if add > 0 then
          local q, r = divmod(frac + add, limit)
          x, y, changed = us + q, r, true
        end
        exp = x
        if y > 0 then
          exp = x + 1
        end
      end
      new[off + 1], new[off + 2] = x, y
      off = off + 2
    elseif code == FIXED_WINDOW then
      new[off + 1], new[off + 2] = id, 2
      off = off + 2
      local index = divmod(now, period)
      local count = 0
      if st and st[off + 1] == index then
        count = st[off + 2]
      end
      local add = limit + cap - count
      if add > take then
        add = take
      end
      if add > 0 then
        new[off + 1], new[off + 2], changed = index, count + add, true
      else
        new[off + 1], new[off + 2] = st[off + 1], st[off + 2]
      end
      exp = (new[off + 1] + 1) * period
      off = off + 2
    elseif code == SLIDING_WINDOW then
      local p, sub = a, b
      new[off + 1], new[off + 2] = id, p + 2
      off = off + 2
      local cur = divmod(now, sub)
      local add = limit + cap - window_used(st, off, p, cur)
      if add > take then
        add = take
      end
      if add > 0 then
        -- As a check's commit.
        shift_counts(st, new, off, p, cur, add)
        changed = true
      else
        for d = 1, p + 2 do
          new[off + d] = st[off + d]
        end
      end
      for d = 0, p do
        if new[off + 2 + d] > 0 then
          exp = (new[off + 1] - d + p + 1) * sub
          break
        end
      end
      off = off + p + 2
    elseif code == CONCURRENT then
      -- Slots take no debt: the entry (the next slot's number) as it stands.
      new[off + 1], new[off + 2], new[off + 3] = id, 1, (st and st[off + 3]) or 0
      exp = new[off + 3]
      off = off + 3
    elseif code == SLIDING_LOG and not logged then
      logged = true
    end
    if exp > expires then
      expires = exp
    end
  end

  local log_now, add_log = now, 0
  if log_limit > 0 then
    if newest and newest > now then
      log_now = newest
    end
    add_log = units
    if add_log > log_limit then
      add_log = log_limit
    end
    changed = true
    new[off + 1], new[off + 2], new[off + 3] = LOG_MARKER, 1, log_now + log_period
    off = off + 3
    if log_now + log_period > expires then
      expires = log_now + log_period
    end
  end
  if off ~= width then
    return redis.error_reply(string.format('RLARGS debit: the rules fill %d values of a '
      .. 'state of %d', off, width) .. VERSION_SKEW)
  end
  if not changed then
    return 0
  end
  if latest > expires then
    expires = latest
  end
  local unit, ms = expiry_arg(injected, now, ttl_floor, expires)
  redis.call('SET', KEYS[1], encode(new, width, shape) .. tail, unit, ms)
  if log_limit > 0 then
    if drop_log then
      redis.call('DEL', KEYS[2])
      log_len = 0
    end
    local stamp = string.format('%d', log_now)
    local left = add_log
    while left > 0 do
      local chunk = {}
      local m = left
      if m > 1000 then
        m = 1000
      end
      for j = 1, m do
        chunk[j] = stamp
      end
      redis.call('LPUSH', KEYS[2], unpack(chunk))
      left = left - m
    end
    if log_len + add_log > log_limit then
      redis.call('LTRIM', KEYS[2], 0, string.format('%d', log_limit - 1))
    end
    expire_log(KEYS[2], injected, now, ttl_floor, log_now + log_period)
  end
  return 1
end

-- release and renew: a concurrency slot freed, or its deadline moved on, by its number
-- (the core's algo::release and algo::renew).
--
-- KEYS[1]  the client key's rule state (see check above)
-- ARGV[1]  now in µs, or '' for the Redis server's TIME
-- ARGV[2]  the slot's number
-- renew only:
-- ARGV[3]  the timeout in µs: the slot's new deadline is now plus this
-- ARGV[4]  TTL floor in ms (under an injected clock, as for check)
--
-- Returns 1 when the slot was held and live (freed, or renewed), 0 otherwise: a release
-- sent again frees nothing. The state is rewritten only when the slot was live, and only
-- that slot changes; a release keeps the key's expiry, a
-- renewal moves it on to the new deadline when that is later.
local function edit_slot(KEYS, ARGV, timeout)
  local raw = redis.pcall('GET', KEYS[1])
  if type(raw) ~= 'string' or #raw % 8 ~= 0 or #raw < 16 or #raw > 8 * MAX_STATE then
    return 0
  end
  local injected = ARGV[1] ~= ''
  local now
  if injected then
    now = tonumber(ARGV[1])
  else
    now = redis_time()
  end
  local number = tonumber(ARGV[2])
  if not now or not number then
    return redis.error_reply('RLARGS release and renew take a time and a slot number; the '
      .. 'store and the script are from different versions')
  end
  -- The trailer ends the state: walk the entries to it.
  local len = #raw / 8
  local pos, t = 2, nil
  local unpack_ = struct.unpack
  while pos <= len do
    local id, m = unpack_('<dd', raw, 8 * (pos - 1) + 1)
    if not (m and m >= 0 and m % 1 == 0 and pos + 1 + m <= len) then
      return 0
    end
    if id == SLOTS_MARKER then
      if m % 2 ~= 0 or m > 2 * MAX_CONCURRENT or pos + 1 + m ~= len then
        return 0
      end
      t = {}
      for j = 1, m, 2 do
        local d, k = unpack_('<dd', raw, 8 * (pos + j) + 1)
        t[#t + 1], t[#t + 2] = d, k
      end
      break
    end
    pos = pos + 2 + m
  end
  if not t then
    return 0
  end
  -- Only the slot itself changes: the others, live or not, stay as they are (a check
  -- drops those past their deadline when it writes).
  local keep, live, latest = {}, false, 0
  for j = 1, #t, 2 do
    local d, k = t[j], t[j + 1]
    local this = k == number and d > now and not live
    if this then
      live = true
      if timeout then
        local until_ = now + timeout
        if until_ > d then
          d = until_
        end
      end
    end
    if not this or timeout then
      keep[#keep + 1], keep[#keep + 2] = d, k
      if d > latest then
        latest = d
      end
    end
  end
  if not live then
    return 0
  end
  local value = string.sub(raw, 1, 8 * (pos - 1)) .. slots_value(keep)
  if not timeout then
    redis.call('SET', KEYS[1], value, 'KEEPTTL')
    return 1
  end
  -- The new expiry, in ms from now: the latest deadline's, or the key's own when later.
  local ttl_floor = tonumber(ARGV[4]) or 0
  local unit, ms = expiry_arg(injected, now, ttl_floor, latest)
  local rel = tonumber(ms)
  if unit == 'PXAT' then
    -- `now` is the server's time here (not injected).
    rel = rel - math.floor(now / 1000)
  end
  local pttl = redis.call('PTTL', KEYS[1])
  if pttl > rel then
    rel = pttl
  end
  if rel < 1 then
    rel = 1
  end
  redis.call('SET', KEYS[1], value, 'PX', string.format('%d', rel))
  return 1
end

local function release(KEYS, ARGV)
  return edit_slot(KEYS, ARGV, nil)
end

local function renew(KEYS, ARGV)
  local timeout = tonumber(ARGV[3])
  if not timeout or timeout < 1 or timeout > 3600000000 then
    return redis.error_reply('RLARGS renew takes a timeout of 1 to 3600000000 us; the store '
      .. 'and the script are from different versions')
  end
  return edit_slot(KEYS, ARGV, timeout)
end

-- Calls decided once: the entry points the store calls (registered in src/script/load.rs)
-- are the functions above behind `once`. A call the store may send again (its connection
-- broke with it in flight) carries three values after its own arguments: the name of its
-- record (a key of the client key's hash tag, `<prefix>:{<tag>}:r<id in hex>`), how long
-- to keep the record in ms (longer than the store waits to send a call again), and the
-- call's id (32 hex digits, then a byte: 1 when sent again, 0 otherwise). Its reply goes to the record, one
-- SET per call however many checks it carries. A call sent again whose record is there
-- answers the first run's reply and runs nothing; one without it never ran (Redis drops
-- what a closed connection had not yet sent it, and the record outlives every resend)
-- and runs now. The record is written with the call's other effects, so a replica that
-- takes over holds it as it holds the state. A reply is kept as text, 's' and a string or
-- 'n' and an integer; an error reply is not kept (the call wrote nothing). A call
-- without the three values runs as before.
--
-- `base` is the number of the call's own arguments; `probe`, for check_local (whose keys
-- are not declared), reads the record first on every call: a record of a slot the node
-- no longer serves answers every check as moved (`probe`), before anything runs.
local function once(fn, KEYS, ARGV, base, probe)
  if #ARGV ~= base + 3 then
    return fn(KEYS, ARGV)
  end
  local rk, keep, id = ARGV[base + 1], tonumber(ARGV[base + 2]), ARGV[base + 3]
  local resent = string.byte(id, 33)
  if #id ~= 33 or (resent ~= 0 and resent ~= 1) or not keep or keep < 1 or keep % 1 ~= 0 then
    return redis.error_reply('RLARGS a call decided once ends with its record\'s name, '
      .. 'its keep in ms and its id of 33 bytes; the store and the script are from '
      .. 'different versions')
  end
  ARGV[base + 3], ARGV[base + 2], ARGV[base + 1] = nil, nil, nil
  if resent == 1 or probe then
    local r = redis.pcall('GET', rk)
    if type(r) == 'table' then
      if probe then
        return probe(r.err)
      end
      return r
    end
    if r and resent == 1 then
      if string.byte(r, 1) == 110 then
        return tonumber(string.sub(r, 2))
      end
      return string.sub(r, 2)
    end
  end
  local reply = fn(KEYS, ARGV)
  local kind = type(reply)
  if kind == 'string' then
    redis.call('SET', rk, 's' .. reply, 'PX', keep)
  elseif kind == 'number' then
    redis.call('SET', rk, string.format('n%d', reply), 'PX', keep)
  end
  return reply
end

local function check_once(KEYS, ARGV)
  return once(check, KEYS, ARGV, 1)
end

local function check_many_once(KEYS, ARGV)
  return once(check_many, KEYS, ARGV, #(ARGV[1] or '') + 1)
end

local function check_local_once(KEYS, ARGV)
  local counts = ARGV[1] or ''
  local n = #counts
  local base = 1 + n
  for i = 1, n do
    base = base + string.byte(counts, i) - 48
  end
  return once(check_local, KEYS, ARGV, base, function(err)
    local out = {}
    for i = 1, n do
      out[i] = failure('RLMOVED ' .. err)
    end
    return table.concat(out, '', 1, n)
  end)
end

local function refund_once(KEYS, ARGV)
  -- Its own arguments: 4, then 5 per rule.
  local base = #ARGV
  if (base - 4) % 5 == 3 then
    base = base - 3
  end
  return once(refund, KEYS, ARGV, base)
end

local function give_back_once(KEYS, ARGV)
  return once(give_back, KEYS, ARGV, 2)
end

local function debit_once(KEYS, ARGV)
  return once(debit, KEYS, ARGV, 1)
end

local function release_once(KEYS, ARGV)
  return once(release, KEYS, ARGV, 2)
end

local function renew_once(KEYS, ARGV)
  return once(renew, KEYS, ARGV, 4)
end
