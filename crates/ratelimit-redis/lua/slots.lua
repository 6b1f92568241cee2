-- slots.lua: a concurrency slot released or renewed (`release`, `renew`), by its number
-- in the slots trailer that ends a state (check.lua's KEYS[2]). Part of the library
-- check.lua opens.

-- release and renew: a concurrency slot freed, or its deadline moved on, by its number
-- (the core's algo::release and algo::renew).
--
-- KEYS[1]  the client key's rule state (its layout: see check.lua)
-- ARGV[1]  now in µs, or '' for the Redis server's TIME
-- ARGV[2]  the slot's number
-- renew only:
-- ARGV[3]  the timeout in µs: the slot's new deadline is now plus this
-- ARGV[4]  TTL floor in ms (under an injected clock, as for check)
--
-- Returns 1 when the slot was held and live (freed, or renewed), 0 otherwise: a release
-- sent again frees nothing. The state is rewritten only when the slot was live, and only
-- that slot changes; a release keeps the key's expiry, a
-- renewal moves it on to the new deadline when that is later. In a batch (edits.lua),
-- `pre` is the state as the batch read it (a string; otherwise it is read here).
--
-- `edit_slot_at` is the same on values already read: `raw` the state (a string of a
-- state's length), `injected` whether `now` is the caller's (else Redis's TIME, read here
-- when `now` is nil), the slot's `number`, the renewal's `timeout` (nil: a release) and
-- `ttl_floor`. A batch's edit (edits.lua) calls it with the batch's values as they are,
-- without going through text.
local function edit_slot_at(key, raw, injected, now, number, timeout, ttl_floor)
  if not now then
    now = redis_time()
  end
  -- The trailer ends the state: walk the entries to it, on the state's values read in
  -- one unpack (`raw` is a state's length: slot_state).
  local len = #raw / 8
  local v = {struct.unpack(FORMATS[len] or doubles(len), raw)}
  local pos, at = 2, nil
  while pos <= len do
    local id, m = v[pos], v[pos + 1]
    if not (m and m >= 0 and m % 1 == 0 and pos + 1 + m <= len) then
      return 0
    end
    if id == SLOTS_MARKER then
      if m % 2 ~= 0 or m > 2 * MAX_CONCURRENT or pos + 1 + m ~= len then
        return 0
      end
      at = pos + 1
      break
    end
    pos = pos + 2 + m
  end
  if not at then
    return 0
  end
  -- Only the slot itself changes: the others, live or not, stay as they are (a check
  -- drops those past their deadline when it writes). The slots are the values after
  -- the marker and its count, to the state's end.
  -- The slots kept go to the library's table of a check's reply, which holds no reply
  -- while a release or a renewal runs (a table made here, and grown pair by pair, costs
  -- as much as the walk): `kept` values.
  local keep, kept, live, latest = OUT, 0, false, 0
  for j = at + 1, len, 2 do
    local d, k = v[j], v[j + 1]
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
      keep[kept + 1], keep[kept + 2], kept = d, k, kept + 2
      if d > latest then
        latest = d
      end
    end
  end
  if not live then
    return 0
  end
  local value = string.sub(raw, 1, 8 * (pos - 1)) .. slots_value(keep, kept)
  if not timeout then
    redis.call('SET', key, value, 'KEEPTTL')
    return 1
  end
  -- The new expiry, in ms from now: the latest deadline's, or the key's own when later.
  local unit, ms = expiry_arg(injected, now, ttl_floor, latest)
  local rel = tonumber(ms)
  if unit == 'PXAT' then
    -- `now` is the server's time here (not injected).
    rel = rel - math.floor(now / 1000)
  end
  local pttl = redis.call('PTTL', key)
  if pttl > rel then
    rel = pttl
  end
  if rel < 1 then
    rel = 1
  end
  redis.call('SET', key, value, 'PX', string.format('%d', rel))
  return 1
end

-- The state of KEYS[1] (`pre`, or read here), or nil when it is no state's length: a
-- slot's edit then frees or renews nothing.
local function slot_state(key, pre)
  local raw = pre
  if type(raw) ~= 'string' then
    raw = redis.pcall('GET', key)
  end
  if type(raw) ~= 'string' or #raw % 8 ~= 0 or #raw < 16 or #raw > 8 * MAX_STATE then
    return nil
  end
  return raw
end

local function edit_slot(KEYS, ARGV, timeout, pre)
  local raw = slot_state(KEYS[1], pre)
  if not raw then
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
  return edit_slot_at(KEYS[1], raw, injected, now, number, timeout, tonumber(ARGV[4]) or 0)
end

local function release(KEYS, ARGV, pre)
  return edit_slot(KEYS, ARGV, nil, pre)
end

-- The refusal of a renewal's timeout that is not 1 to 3600000000 µs (or no number);
-- nil for one that is.
local function bad_renew_timeout(timeout)
  if not timeout or timeout < 1 or timeout > 3600000000 then
    return redis.error_reply('RLARGS renew takes a timeout of 1 to 3600000000 us; the store '
      .. 'and the script are from different versions')
  end
  return nil
end

local function renew(KEYS, ARGV, pre)
  local timeout = tonumber(ARGV[3])
  local bad = bad_renew_timeout(timeout)
  if bad then
    return bad
  end
  return edit_slot(KEYS, ARGV, timeout, pre)
end
