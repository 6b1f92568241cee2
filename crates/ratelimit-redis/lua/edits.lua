-- edits.lua: edits of a state after its check carried by a batch in place of a check,
-- so that settles and releases leave in the call that carries the checks queued beside
-- them (the core's packed::Edit; the module's batch protocol 5). Part of the library
-- check.lua opens.
--
-- An edit's packed value is a check's header whose first value is injected + 2 x op and
-- whose last (a check's deadline) is the edit's own number:
--   op 1  give_back: the check's rules follow; the number is the charge's time
--   op 2  debit: the check's rules follow (the header's cost is the units)
--   op 3  release: no rules; the number is the slot's
--   op 4  renew: no rules; the number is the slot's, and the timeout in us follows the
--         header
--   op 5  refund (a lease's unspent units): the lease's rules follow (the header's cost
--         the units); the number is the reservation's time, and the units it charged
--         follow the rules
--   op 6  block: no rules; the number is the block's length in us, and 1 for a block
--         without end (else 0) follows the header
--   op 7  take: the rules follow; a slot of their concurrency rule taken whatever its
--         limit and one unit charged as debt (a fallback's admission handed over),
--         answered {4, the slot's number} or {4, 0} when it took none
-- It runs on the check's keys (the state, and the log for a settle under rules with a
-- sliding log; the block marker for a block) by the same function as its own call,
-- reading its keys itself, and is answered with the doubles {4, 1} when it changed the
-- state, {4, 0} when not; an error is its failure entry, as a check's.

-- A lease's unspent units given back (op 5) by refund.lua's `refund`, its arguments
-- made from the packed rules: each rule's identity, code, limit and period, and a fixed
-- window's index of the reservation's time `start`.
local function lease_refund(state, packed, injected, start, redis_now, pre)
  local fmt, unpack_ = string.format, struct.unpack
  local _, injected_now, units, _, n, _, _, _, _, _, pos = unpack_(HEADER_FORMAT, packed)
  local top = TOP
  if not (n >= 1 and n <= MAX_RULES and n % 1 == 0
      and #packed == 8 * (HEADER + PER_RULE * n + 1) and injected_now >= 0
      and injected_now < top and injected_now % 1 == 0 and units >= 1 and units < top
      and units % 1 == 0) then
    return redis.error_reply('RLARGS a lease\'s refund is out of range' .. VERSION_SKEW)
  end
  local args = { '', units, start, 0 }
  if injected == 1 then
    args[1] = injected_now
  elseif redis_now then
    args[1] = redis_now
  end
  for i = 1, n do
    local code, limit, period, _, _, id
    code, limit, period, _, _, id, pos = unpack_(RULE_FORMAT, packed, pos)
    if not (code >= FIXED_WINDOW and code <= CONCURRENT and code % 1 == 0 and limit >= 1
        and limit < top and period >= 1 and period < top and id >= 0 and id < top) then
      return redis.error_reply(fmt('RLARGS a lease\'s refund: rule %d is out of range', i - 1)
        .. VERSION_SKEW)
    end
    local window = 0
    if code == FIXED_WINDOW then
      window = divmod(start, period)
    end
    local at = 5 * i
    args[at], args[at + 1], args[at + 2], args[at + 3], args[at + 4] =
      id, code, limit, period, window
  end
  local granted = unpack_('<d', packed, pos)
  if not (granted >= units and granted < top and granted % 1 == 0) then
    return redis.error_reply('RLARGS a lease\'s refund grants fewer units than it gives back'
      .. VERSION_SKEW)
  end
  args[4] = granted
  return refund({ state }, args, pre)
end

-- `first` and `number` are the packed value's first and last header values, as
-- check_one read them (`first` above 1), and `injected_now` and `ttl_floor` its second
-- and fourth (unchecked); `redis_now` the batch's Redis time, when read; `pre` the state
-- as the batch read it, when it did (else false or nil: read here).
edit_one = function(marker, state, log, packed, first, number, redis_now, pre, injected_now,
    ttl_floor)
  local fmt = string.format
  local op = (first - first % 2) / 2
  local injected = first % 2
  local len = #packed
  if not (first % 1 == 0 and op >= 1 and op <= 7 and number >= 0 and number < TOP
      and number % 1 == 0) then
    return redis.error_reply(fmt('RLARGS an edit of op %s is none this library knows',
      tostring(op)) .. VERSION_SKEW)
  end
  local reply
  if op == 5 then
    reply = lease_refund(state, packed, injected, number, redis_now, pre)
  elseif op == 6 then
    if len ~= 8 * HEADER + 8 then
      return redis.error_reply(fmt('RLARGS a block takes %d bytes, got %d', 8 * HEADER + 8,
        len) .. VERSION_SKEW)
    end
    local without_end = struct.unpack('<d', packed, 8 * HEADER + 1)
    if not (injected_now >= 0 and injected_now < TOP and injected_now % 1 == 0
        and ttl_floor >= 0 and ttl_floor < TOP and ttl_floor % 1 == 0
        and (without_end == 0 or without_end == 1) and number <= 4503599627370496) then
      return redis.error_reply('RLARGS a value of the block is out of range' .. VERSION_SKEW)
    end
    -- As the store's own block call: Redis's TIME unless the time is injected.
    local now, length = '', ''
    if injected == 1 then
      now = fmt('%d', injected_now)
    end
    if without_end == 0 then
      length = fmt('%d', number)
    end
    reply = block({ marker }, { now, length, fmt('%d', ttl_floor) })
    if type(reply) == 'number' then
      reply = 1
    end
  elseif op == 7 then
    reply = debit_at({ state, log }, packed, injected, redis_now, pre, 1, true)
  elseif op <= 2 then
    -- The check's own packed values, as give_back and debit take them, but for the
    -- first (injected, given apart; the number, in the deadline's place, they do not
    -- read).
    if op == 1 then
      reply = give_back_at({ state, log }, packed, injected, number, redis_now, pre)
    else
      reply = debit_at({ state, log }, packed, injected, redis_now, pre, 1)
    end
  else
    local want = 8 * HEADER
    if op == 4 then
      want = want + 8
    end
    if len ~= want then
      return redis.error_reply(fmt('RLARGS a slot\'s edit takes %d bytes, got %d', want, len)
        .. VERSION_SKEW)
    end
    if not (injected_now >= 0 and injected_now < TOP and injected_now % 1 == 0
        and ttl_floor >= 0 and ttl_floor < TOP and ttl_floor % 1 == 0) then
      return redis.error_reply('RLARGS a value of the header is out of range' .. VERSION_SKEW)
    end
    -- Nil: Redis's TIME, read by the edit.
    local now, as_injected = nil, injected == 1
    if as_injected then
      now = injected_now
    elseif op == 3 and redis_now then
      -- A release on the server's clock, read once for the batch (no TIME of its own);
      -- its expiry does not depend on the clock's kind, a renewal's does.
      now, as_injected = redis_now, true
    end
    local timeout = nil
    if op == 4 then
      timeout = struct.unpack('<d', packed, 8 * HEADER + 1)
      if not (timeout >= 0 and timeout < TOP and timeout % 1 == 0) then
        return redis.error_reply('RLARGS a renewal\'s timeout is out of range' .. VERSION_SKEW)
      end
      local bad = bad_renew_timeout(timeout)
      if bad then
        return bad
      end
    end
    local raw = slot_state(state, pre)
    if raw then
      reply = edit_slot_at(state, raw, as_injected, now, number, timeout, ttl_floor)
    else
      reply = 0
    end
  end
  if type(reply) == 'number' then
    return struct.pack('<dd', 4, reply)
  end
  return reply
end
