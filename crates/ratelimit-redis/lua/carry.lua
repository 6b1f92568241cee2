-- carry.lua: a state written under another layout read for these rules (`carry`, as
-- the core's algo::carry_converting), the slots trailer past a state's fixed part, and
-- the writes every entry point shares: a key's expiry (`expiry_arg`, `expire_log`), the
-- slots trailer as stored, the state a denial after a conversion writes
-- (`write_carried`). Reads the KEYS[2] layout check.lua describes. Part of the library
-- check.lua opens.

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

-- The slots trailer of `held` ({deadline, number, ...}), '' when it holds none; of its
-- first `m` values when given (a reused table holds more).
local function slots_value(held, m)
  m = m or #held
  if m == 0 then
    return ''
  end
  -- One pack (m is at most 2 x MAX_CONCURRENT, within Lua's stack).
  return struct.pack(doubles(2 + m), SLOTS_MARKER, m, unpack(held, 1, m))
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
