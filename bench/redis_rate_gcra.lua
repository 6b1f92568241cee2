-- A GCRA limiter as one Lua script per decision: the algorithm of go-redis/redis_rate's
-- `allowN` script (itself from rwz/redis-gcra), written out here to measure what such a
-- script costs Redis beside this project's store (bench/examples/redis_instructions.rs,
-- `ONLY=redis_rate`). It makes the same Redis calls in the same order: effects
-- replication, `TIME`, `GET` of the key's theoretical arrival time (TAT), and on an
-- admission `SET` of the new TAT with `EX`, and replies the same four values.
--
-- KEYS[1]  the client's key (redis_rate names it "rate:" .. key)
-- ARGV     burst, rate, period in seconds, cost (redis_rate's AllowN sends them so)
-- reply    {admitted cost, remaining, retry after (s, "-1" when admitted), reset after (s)}

-- Writes from a script that read the clock must replicate as effects (a no-op on
-- Redis 7, the default there; needed on Redis 3.2 to 6.2).
redis.replicate_commands()

local key = KEYS[1]
local burst = tonumber(ARGV[1])
local rate = tonumber(ARGV[2])
local period = tonumber(ARGV[3])
local cost = tonumber(ARGV[4])

-- One unit of the limit every `interval` seconds; a full burst is `burst` units ahead.
local interval = period / rate
local tolerance = interval * burst

-- Seconds since 2017-01-01 (1483228800 s after the epoch), so that the microseconds of
-- Redis's clock still fit a double's 53 bits of mantissa.
local clock = redis.call("TIME")
local now = (clock[1] - 1483228800) + clock[2] / 1000000

-- A key never seen, or whose TAT is past, starts from now.
local tat = tonumber(redis.call("GET", key) or now)
if tat < now then
  tat = now
end

local next_tat = tat + interval * cost
local headroom = now - (next_tat - tolerance)
local remaining = math.floor(headroom / interval + 0.5)

if remaining < 0 then
  -- Refused: nothing written; retry once the headroom is back to zero.
  return {0, 0, tostring(-headroom), tostring(tat - now)}
end

local reset_after = next_tat - now
redis.call("SET", key, next_tat, "EX", math.ceil(reset_after))
return {cost, remaining, tostring(-1), tostring(reset_after)}
