-- block.lua: blocks one client key, replacing any earlier block: `block`, the script
-- the store sends alone (this file and a `return` of it), and a library function, which
-- a batch's block (edits.lua) runs.
--
-- KEYS[1]  block marker of the client key (see check.lua)
--
-- ARGV[1]  now, µs since the Unix epoch; "" = read the Redis server's TIME
-- ARGV[2]  block length in µs (below 2^52); "" = until lifted
-- ARGV[3]  TTL floor in ms, applied only when ARGV[1] is given
--
-- Returns the block's end in µs since the epoch, or -1 for a block without end.
-- The marker holds that end ("inf" for none) and expires with it: no cleanup needed.
-- Errors with WRONGTYPE, writing nothing, when the key holds another type (SET would
-- silently replace someone else's data).

local function block(KEYS, ARGV)
  local kind = redis.call('TYPE', KEYS[1])['ok']
  if kind ~= 'none' and kind ~= 'string' then
    return redis.error_reply('WRONGTYPE the block marker holds a ' .. kind)
  end

  if ARGV[2] == '' then
    redis.call('SET', KEYS[1], 'inf')
    return -1
  end

  local now
  if ARGV[1] == '' then
    local t = redis.call('TIME')
    now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  else
    now = tonumber(ARGV[1])
  end
  local untl = now + tonumber(ARGV[2])

  -- Exact ceil(a / 1000) for non-negative integers below 2^53.
  local function ms_ceil(a)
    local q = math.floor(a / 1000)
    local r = a - q * 1000
    if r < 0 then
      q = q - 1
      r = r + 1000
    elseif r >= 1000 then
      q = q + 1
      r = r - 1000
    end
    if r > 0 then
      q = q + 1
    end
    return q
  end

  local stamp = string.format('%.0f', untl)
  if ARGV[1] == '' then
    redis.call('SET', KEYS[1], stamp, 'PXAT', string.format('%.0f', ms_ceil(untl)))
  else
    local ms = ms_ceil(untl - now)
    local floor_ms = tonumber(ARGV[3])
    if ms < floor_ms then
      ms = floor_ms
    end
    if ms < 1 then
      ms = 1
    end
    redis.call('SET', KEYS[1], stamp, 'PX', string.format('%.0f', ms))
  end
  return untl
end
