-- refund.lua: gives back units a lease reserved and did not spend, as if the reservation
-- had charged that many fewer. Lease mode only (src/lease.rs); exact checks never call it.
--
-- KEYS[1]  rule state of the client key (see check.lua for its layout)
--
-- ARGV[1]  now, µs since the Unix epoch; "" = read the Redis server's TIME
-- ARGV[2]  units to give back (u, at least 1)
-- ARGV[3]  the reservation's time t, µs, on the same clock as `now`
-- ARGV[4]  the units the reservation charged (b >= u)
-- ARGV[5..] 5 values per rule of the rule set: id, code, limit, period_us, window (the
--          fixed window index of the reservation; 0 for other algorithms). Codes as in
--          check.lua: 1 fixed window, 4 token bucket, 5 leaky bucket meter, 6 GCRA; rules
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

local raw = redis.call('GET', KEYS[1])
if not raw or #raw % 8 ~= 0 or #raw == 0 then
  return 0
end

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

local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
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
  local limit, period, window = tonumber(ARGV[r + 2]), tonumber(ARGV[r + 3]), tonumber(ARGV[r + 4])
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
    if (code == 6 or code == 5) and v[o] == limit and give > 0 then
      local q, rem = divmod(give, limit)
      local us, frac = v[o + 2] - q, v[o + 3] - rem
      if frac < 0 then
        us, frac = us - 1, frac + limit
      end
      if us < now then
        us, frac = now, 0
      end
      v[o + 2], v[o + 3], changed = us, frac, true
    elseif code == 4 and v[o] == limit and give > 0 then
      local level = v[o + 2] + give
      local full = v[o + 1] * period
      if level > full then
        level = full
      end
      v[o + 2], changed = level, true
    elseif code == 1 and v[o] == window then
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
