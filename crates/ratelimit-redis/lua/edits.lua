-- edits.lua: edits of a state after its check carried by a batch in place of a check,
-- so that settles and releases leave in the call that carries the checks queued beside
-- them (the core's packed::Edit; the module's batch protocol 5). Part of the library
-- check.lua opens.
--
-- An edit's packed value is a check's header whose first value is injected + 2 x op:
--   op 1  give_back: the check's rules follow, then the charge's time
--   op 2  debit: the check's rules follow (the header's cost is the units)
--   op 3  release: no rules; the slot's number follows the header
--   op 4  renew: no rules; the slot's number and the timeout in us follow the header
-- It runs on the check's keys (the state, and the log for a settle under rules with a
-- sliding log) by the same function as its own call, reading its keys itself, and is
-- answered with the doubles {4, 1} when it changed the state, {4, 0} when not; an error
-- is its failure entry, as a check's.

-- Values after the header and rules, by op.
local EDIT_EXTRAS = { 1, 0, 1, 2 }

-- `first` is the packed value's first double, above 1 (check_one read it).
edit_one = function(state, log, packed, first)
  local fmt, unpack_ = string.format, struct.unpack
  local op = (first - first % 2) / 2
  local injected = first % 2
  local extras = EDIT_EXTRAS[op]
  local len = #packed
  local body = len - 8 * (extras or 0)
  if not extras or first % 1 ~= 0 or body < 8 * HEADER then
    return redis.error_reply(fmt('RLARGS an edit of op %s in %d bytes is none this '
      .. 'library knows', tostring(op), len) .. VERSION_SKEW)
  end
  local e1, e2 = 0, 0
  if extras >= 1 then
    e1 = unpack_('<d', packed, body + 1)
  end
  if extras == 2 then
    e2 = unpack_('<d', packed, body + 9)
  end
  if not (e1 >= 0 and e1 < TOP and e1 % 1 == 0 and e2 >= 0 and e2 < TOP and e2 % 1 == 0) then
    return redis.error_reply('RLARGS a value after an edit\'s header is out of range'
      .. VERSION_SKEW)
  end
  local reply
  if op <= 2 then
    -- The check's own packed values, as give_back and debit take them.
    local check = struct.pack('<d', injected) .. string.sub(packed, 9, body)
    local keys = { state, log }
    if op == 1 then
      reply = give_back(keys, { check, fmt('%d', e1) })
    else
      reply = debit(keys, { check })
    end
  else
    if body ~= 8 * HEADER then
      return redis.error_reply('RLARGS a slot\'s edit carries no rules' .. VERSION_SKEW)
    end
    local _, injected_now, _, ttl_floor = unpack_('<dddd', packed)
    if not (injected_now >= 0 and injected_now < TOP and injected_now % 1 == 0
        and ttl_floor >= 0 and ttl_floor < TOP and ttl_floor % 1 == 0) then
      return redis.error_reply('RLARGS a value of the header is out of range' .. VERSION_SKEW)
    end
    local now = ''
    if injected == 1 then
      now = fmt('%d', injected_now)
    end
    if op == 3 then
      reply = release({ state }, { now, fmt('%d', e1) })
    else
      reply = renew({ state }, { now, fmt('%d', e1), fmt('%d', e2), fmt('%d', ttl_floor) })
    end
  end
  if type(reply) == 'number' then
    return struct.pack('<dd', 4, reply)
  end
  return reply
end
