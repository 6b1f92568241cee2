-- debit.lua: units charged unconditionally, as bounded debt: the excess of a metered
-- request settled above its estimate (the core's algo::debit). Reads the state through
-- refund.lua's `own_state`; writes check.lua's KEYS[2] layout and the sliding log of
-- KEYS[3]. Part of the library check.lua opens.

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
-- KEYS[1]  rule state of the client key (its layout: see check.lua)
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

-- The slots trailer `tail` (as stored, or '') with the slots past their deadline at `now`
-- dropped and slot `number` added until `deadline`, as the core's concurrent::commit;
-- and the latest deadline it holds. Nil when MAX_CONCURRENT slots are live already (the
-- most a state holds, whatever the limit).
local function tail_with_slot(tail, now, deadline, number)
  local keep, latest = {}, deadline
  local tl = #tail / 8
  if tl >= 2 then
    local t = {struct.unpack(doubles(tl), tail)}
    for j = 3, tl, 2 do
      local d = t[j]
      if d > now then
        keep[#keep + 1], keep[#keep + 2] = d, t[j + 1]
        if d > latest then
          latest = d
        end
      end
    end
  end
  if #keep >= 2 * MAX_CONCURRENT then
    return nil
  end
  keep[#keep + 1], keep[#keep + 2] = deadline, number
  return slots_value(keep), latest
end

-- `debit_at` is `debit` on `packed` as it is: a batch's edit (edits.lua) passes its own
-- packed value, whose first value is not `injected` (then given, 0 or 1; nil: the
-- header's).
--
-- With `taking`, a take (the core's algo::take; a batch's edit op 7): one unit charged
-- whatever the header's cost, and a slot of the concurrency rule taken whatever its
-- limit; returns the slot's number, 0 when it took none (no concurrency rule, a state of
-- another layout).
local function debit_at(KEYS, packed, injected, batch_now, pre, arguments, taking)
  local len = #packed
  if arguments ~= 1 or len < 8 * HEADER or len % 8 ~= 0 then
    return redis.error_reply(string.format('RLARGS debit takes the packed values as '
      .. 'doubles, got %d arguments and %d bytes', arguments, len) .. VERSION_SKEW)
  end
  local header_injected, injected_now, units, ttl_floor, n, width, log_limit, log_period,
    layout, _, pos = struct.unpack(HEADER_FORMAT, packed)
  if injected == nil then
    injected = header_injected
  end
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
  -- Every rule is checked before anything is read or written. Its six values are kept
  -- in the library's table of a check's reply, which holds no reply while a debit runs
  -- (a table per rule, or per debit, costs more than the debit's arithmetic): rule i's
  -- at 6i - 5 to 6i.
  local rules = OUT
  for i = 1, n do
    local code, limit, period, a, b, id
    code, limit, period, a, b, id, pos = struct.unpack(RULE_FORMAT, packed, pos)
    if not (code >= FIXED_WINDOW and code <= CONCURRENT and code % 1 == 0 and limit >= 1
        and limit < top and period >= 1 and period < top and a >= 0 and a < top
        and b >= 0 and b < top and id >= 0 and id < top) then
      return redis.error_reply(string.format('RLARGS debit: rule %d is out of range', i - 1)
        .. VERSION_SKEW)
    end
    local at = 6 * i
    rules[at - 5], rules[at - 4], rules[at - 3], rules[at - 2], rules[at - 1], rules[at] =
      code, limit, period, a, b, id
  end
  if taking then
    local has = false
    for i = 1, n do
      if rules[6 * i - 5] == CONCURRENT then
        has = true
      end
    end
    if not has then
      return 0
    end
    units = 1
  elseif units < 1 then
    return 0
  end
  local now = injected_now
  injected = injected == 1
  if not injected then
    now = batch_now or redis_time()
  end
  local ok, raw = true, pre
  if type(raw) ~= 'string' then
    ok, raw = pcall(redis.call, 'GET', KEYS[1])
  end
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

  -- The next state, in the library's table of a check's next state (see check_one);
  -- every one of its `width` values is written below.
  local new = NEXT
  new[1] = layout
  local off, expires, changed, logged = 1, 0, false, false
  -- A take's slot, numbered as the core's concurrent::commit numbers it.
  local taken = 0
  for i = 1, n do
    local at = 6 * i
    local code, limit, period, a, b, id =
      rules[at - 5], rules[at - 4], rules[at - 3], rules[at - 2], rules[at - 1], rules[at]
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
      -- Slots take no debt: the entry (the next slot's number) as it stands, but for a
      -- take's slot.
      local next_ = (st and st[off + 3]) or 0
      if taking then
        local number = next_
        if now > number then
          number = now
        end
        taken, next_ = number, number + 1
        tail, latest = tail_with_slot(tail, now, now + period, number)
        if not tail then
          return 0
        end
        changed = true
      end
      new[off + 1], new[off + 2], new[off + 3] = id, 1, next_
      exp = next_
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
  if taking then
    return taken
  end
  return 1
end

local function debit(KEYS, ARGV, batch_now, pre)
  return debit_at(KEYS, ARGV[1], nil, batch_now, pre, #ARGV)
end
