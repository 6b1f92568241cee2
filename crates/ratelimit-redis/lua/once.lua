-- once.lua: calls decided once, and the entry points the store calls: each function
-- the library registers is one of the functions before it behind `once`, which keeps
-- the call's reply in a record key of its own. Part of the library check.lua opens.

-- Calls decided once: the entry points the store calls (registered in src/script/load.rs)
-- are the functions of the files before it behind `once`. A call the store may send again
-- (its connection broke with it in flight) carries three values after its own arguments:
-- the name of its record (a key of the client key's hash tag, `<prefix>:{<tag>}:r<id in
-- hex>`), how long to keep the record in ms (longer than the store waits to send a call
-- again), and the call's id (32 hex digits, then a byte: 1 when sent again, 0 otherwise).
-- Its reply goes to the record, one SET per call however many checks it carries. A call
-- sent again whose record is there answers the first run's reply and runs nothing; one
-- without it never ran (Redis drops what a closed connection had not yet sent it, and the
-- record outlives every resend) and runs now. The record is written with the call's other
-- effects, so a replica that takes over holds it as it holds the state. A reply is kept
-- as text, 's' and a string or 'n' and an integer; an error reply is not kept (the call
-- wrote nothing). A call without the three values runs as before.
--
-- `base` is the number of the call's own arguments; `probe`, for check_local (whose keys
-- are not declared), reads the record first on every call: a record of a slot the node
-- no longer serves answers every check as moved (`probe`), before anything runs; when
-- the call is sent again, `TRYAGAIN` (the first run may have been on the node that
-- serves it).
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
      if probe and resent == 1 then
        -- Sent again to a node that does not serve its record's slot (a client's slot
        -- map out of date): its first run may have charged on the node that does, so
        -- nothing is answered as moved (the store would send it again as new calls);
        -- nothing runs here, and the store sends it again where the slot is served.
        return redis.error_reply('TRYAGAIN the call was sent again to a node that does '
          .. 'not serve its record\'s slot')
      end
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
