-- decide.lua: the decisions. `check_one` decides one check on its keys and packed
-- values (check.lua's KEYS and ARGV layouts, and its reply); `check` is one call of it,
-- `check_many` many in one call on one server, `check_local` many on one Cluster node.
-- Part of the library check.lua opens.

-- One check on its keys and packed values. In a batch, `redis_now` is the Redis time read
-- once for all, and when `at` is set, got[at] and got[at + 1] are the block marker and
-- state as read for all (alone: nil, nil, nil, read here). Evaluates every rule on the
-- state as it stands and commits all or nothing.
-- An edit of a batch (edits.lua, which defines it).
local edit_one

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
  if injected > 1 then
    return edit_one(key1, key2, key3, packed, injected, deadline, redis_now,
      at and got[at + 1], injected_now, ttl_floor)
  end
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

-- One decision. The library defines its entry points (once.lua) and nothing else runs at
-- load: the store loads it as a Redis function library (Redis 7: FUNCTION LOAD, then
-- FCALL, so the functions are created once per server, not once per call) or, on Redis
-- 6.2, runs it with EVALSHA followed by `return check_once(KEYS, ARGV)` (or another of
-- the entry points).
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
