-- check.lua: one rate-limit decision for one client key, all rules at once (`check`);
-- many such decisions in one call (`check_many`, and `check_local` on a Cluster node);
-- the refund of a lease's unspent units (`refund`), the refund of a charge
-- (`give_back`), the debt of a charge settled above its estimate (`debit`), and a
-- concurrency slot released or renewed (`release`, `renew`); every one decided once.
--
-- One Lua library, in files by concern, which src/script/load.rs puts together in this
-- order (each file reaches what the ones before it define):
--   check.lua       this file: the contract (keys, arguments, state layout, reply), the
--                   constants, exact integer arithmetic and the state's encoding
--   algorithms.lua  one function per algorithm, as the core's files
--   carry.lua       a state of another layout read for these rules; expiries; the slots
--                   trailer; the state a denial after a conversion writes
--   decide.lua      check_one, and the decision entry points check, check_many,
--                   check_local
--   refund.lua      refund (a lease's unspent units) and give_back
--   debit.lua       debit
--   slots.lua       release and renew
--   block.lua       block (also the store's block script, alone)
--   edits.lua       give_back, debit, release, renew, refund and block carried by a
--                   batch in place of a check
--   once.lua        calls decided once (a record per call) and the registered entry
--                   points
--
-- An integer translation of the core's algorithms: one local function per algorithm,
-- named and ordered as the core's files (algo/fixed_window.rs, sliding_window.rs,
-- sliding_log.rs, token_bucket.rs, leaky_bucket.rs, gcra.rs), evaluated on the state as
-- it stands and committed all or nothing. Every value is an integer below 2^53 (the core
-- refuses rules outside that bound), so Lua's doubles hold them exactly; divisions go
-- through `divmod`'s arithmetic (written out in the hottest places), never `/` or `%`
-- alone (but for `x % 1` and `/ 1000`, exact where they are used, as said there), and
-- numbers sent back to Redis as text are formatted with '%d', never `tostring` (which
-- would switch to exponent notation).
--
-- The argument layout is owned by `CheckArgs` in src/script/args.rs and the reply's by
-- `CheckReply` in src/script/reply.rs; change them and this file together. The store
-- puts one line before this file (src/script/load.rs) defining the constants it shares
-- with them and with the core: HEADER and PER_RULE (the values of the header and of
-- each rule in ARGV[1]), MAX_RULES (the most rules a rule set has), MAX_STATE (the most
-- values a state holds: a longer value is no state), MAX_CONCURRENT (the most slots),
-- MAX_LOG (the largest sliding-log limit), and HEADER_FORMAT and RULE_FORMAT (the struct
-- formats of the header and of one rule).
--
-- KEYS[1]  block marker of the client key: string "<until µs>" or "inf"
-- KEYS[2]  rule state of the client key: string of little-endian doubles, every one an
--          integer below 2^53: the layout (the fingerprint of the rule set that wrote it,
--          ARGV's `layout`), then one entry per rule but the sliding logs, in rule-set
--          order, then a log marker when a rule is a sliding log. An entry is
--          {id, m, m values}: the rule's identity (RuleSet::rule_ids), the number of
--          values, and the state: fixed window (index, count); sliding window counter
--          (index, c0 .. cp), ci = count of sub-window index - i; token bucket (limit,
--          capacity of the rule that wrote it, level = tokens x period_us, last); leaky
--          bucket and GCRA (limit, capacity of the rule that wrote it, tat_us,
--          tat_frac); concurrent (next: the number the next slot gets at the least).
--          The log marker is the entry {0, 1, until}: the shared log counts
--          until then (the newest entry plus the writer's longest sliding-log period).
--          Past these `width` values, when a concurrency rule holds slots, the slots
--          trailer {SLOTS_MARKER, 2k, deadline, number, ...}: one pair per slot.
--          A denial after a conversion (below) writes the layout 2^52, no rule set's,
--          and entries only for the rules that carried a state.
-- KEYS[3]  shared sliding log of the client key, only when a rule is a sliding log: list
--          of µs timestamps, newest first, at most the largest log limit long
--
-- ARGV[1]  the values as little-endian doubles (exact: every one is an integer < 2^53):
--          injected (1: take `now`; 0: read the Redis server's TIME), now (µs since the
--          Unix epoch) when injected, else 0, cost (0 peeks: evaluated as 1, nothing
--          written), TTL floor in ms (applied only under an injected clock, which need
--          not run at Redis's pace), number of rules n, state width (values in KEYS[2] as
--          this rule set writes it), entries the shared log keeps (0: no sliding log),
--          longest sliding-log period in µs, layout (the rule set's fingerprint, below
--          2^52), the caller's deadline in µs on the Redis server's clock, whatever the
--          check's own clock (0: none; a check that starts later is not run);
--          then 6 values per rule: code, limit, period_us, a, b, id
--            FIXED_WINDOW    1
--            SLIDING_WINDOW  2   a = precision, b = sub-window length in µs
--            SLIDING_LOG     3
--            TOKEN_BUCKET    4   a = capacity
--            LEAKY_BUCKET    5   meter: a = capacity, b = 0
--                                shaper: a = burst, b = delay + 1
--            GCRA            6   a = burst
--            CONCURRENT      7   period = the slots' timeout (see concurrent below)
--
-- A state of the same layout is read in place. One of another layout (the rules changed,
-- or processes on two rule versions share the key) is read entry by entry: each rule
-- takes the entry of its identity, carried as the core's `algo::carry_converting` does
-- (see carry below: windows' counts as they are, a token bucket's or a TAT's usage
-- converted to a changed limit or capacity), and starts fresh without one; a check that
-- commits writes the state in its own layout, so the entries of rules it does not have
-- are dropped then. A denial after a conversion writes the carried entries too (see
-- write_carried): a converted state depends on the time, and the next check must not
-- convert again from the old one. A peek, and any other denial, writes nothing.
--
-- Returns one string of little-endian doubles (all integers below 2^53, or -1; Redis
-- turns a string into a reply at about half the cost of a table of 6 integers):
--   {1, retry_us}   blocked; retry_us = -1 for a block without end
--   {3, now_us}     past the caller's deadline (now_us on the Redis clock): nothing
--                   decided, nothing written
--   {s, delay_us, then per rule: allowed (1/0), remaining, reset_us, retry_us}
--                   s = 0, or 2 when a value this script did not write was found at one
--                   of the keys and discarded (the store owns its key namespace)
--
-- Redis calls: TIME (without an injected time, or with a deadline), one MGET for block
-- marker and state, one SET of the state with its expiry when the check commits (or is
-- denied after a conversion); a sliding log adds LLEN, LINDEX, LPUSH, PEXPIRE (or a DEL
-- of a log that no longer counts; a denial after a conversion only a PEXPIRE). A value of
-- another type at a key reads as absent and is replaced (status 2) when the check
-- commits; a block marker of another type is left alone and reads as no block.

-- Cost: run with EVALSHA, every function below is created anew on each call, and each
-- local it captures costs at creation. So the functions take their inputs as parameters,
-- reach library functions as globals, and capture only each other and the four tables
-- every check reuses (FORMATS, OUT, NEXT, REPLIES). Loaded as a library (FCALL), the
-- functions are made once and a captured local costs less than a global.

local FIXED_WINDOW, SLIDING_WINDOW, SLIDING_LOG, TOKEN_BUCKET, LEAKY_BUCKET, GCRA, CONCURRENT =
  1, 2, 3, 4, 5, 6, 7
-- The identity of the slots trailer (2^52 + 1): no rule's, no layout's.
local SLOTS_MARKER = 4503599627370497
-- The largest retry of a refusal for want of a slot, in µs: a hint.
local RETRY_HINT_CAP = 1000000
-- The identity of the log marker's entry; no rule has it.
local LOG_MARKER = 0
-- The layouts of states a denial wrote after a conversion (see write_carried): 2^52 plus
-- the writer's layout, no rule set's (their layouts are below 2^52), so every check reads
-- it entry by entry; for the rule set that wrote it, the shared log counts as it does in
-- a state of its own layout (as MemoryStore, whose entry then holds that rule set).
local CARRIED = 4503599627370496

-- Exact floor division of non-negative integers below 2^53. Lua's `a % b` is
-- a - floor(a / b) * b: the double quotient may round across an integer, which leaves
-- the remainder one b out of [0, b); correcting it makes it exact, and a - r is then a
-- multiple of b, whose quotient the division gives exactly. All of it runs in the VM,
-- without a call to math.floor: that call costs more than the arithmetic.
local function divmod(a, b)
  local r = a % b
  if r < 0 then
    r = r + b
  elseif r >= b then
    r = r - b
  end
  return (a - r) / b, r
end

-- ceil(a / b) for a >= 0, b > 0.
local function ceil_div(a, b)
  local q, r = divmod(a, b)
  if r > 0 then
    return q + 1
  end
  return q
end

-- The struct format of w doubles, made once per width: a library's locals live as long
-- as the library (under EVALSHA, for the call). Callers look in FORMATS first: a table
-- read costs less than a call.
local FORMATS = {}
local function doubles(w)
  local f = FORMATS[w]
  if not f then
    f = '<' .. string.rep('d', w)
    FORMATS[w] = f
  end
  return f
end

-- The reply and the next state of the check at hand (see check_one), and the replies of
-- a batch: the library's own, reused by every call.
local OUT, NEXT, REPLIES = {}, {}, {}

-- The state as a string of little-endian doubles (exact for integers below 2^53), in
-- chunks of at most 1000: Lua can hold only so many values on its stack at once.

-- The state in `raw`, or nil when `raw` is not `width` non-negative integers.
local function decode(raw, width, shape)
  if #raw ~= 8 * width then
    return nil
  end
  local t
  if shape ~= '' then
    -- One trailing value (the next position) follows the state; nothing reads it.
    t = {struct.unpack(shape, raw)}
  else
    t = {}
    local pos = 1
    for first = 1, width, 1000 do
      local m = width - first + 1
      if m > 1000 then
        m = 1000
      end
      local vals = {struct.unpack('<' .. string.rep('d', m), raw, pos)}
      for j = 1, m do
        t[first + j - 1] = vals[j]
      end
      pos = vals[m + 1]
    end
  end
  for j = 1, width do
    local x = t[j]
    -- An integer in [0, 2^53), one this script could have written. Below 2^53, x % 1 is
    -- exact (x - floor(x)); NaN and the infinities give NaN.
    if not (x >= 0 and x < 9007199254740992 and x % 1 == 0) then
      return nil
    end
  end
  return t
end

-- The next state `new` as stored.
local function encode(new, width, shape)
  if shape ~= '' then
    return struct.pack(shape, unpack(new, 1, width))
  end
  local parts = {}
  for first = 1, width, 1000 do
    local last = first + 999
    if last > width then
      last = width
    end
    parts[#parts + 1] =
      struct.pack('<' .. string.rep('d', last - first + 1), unpack(new, first, last))
  end
  return table.concat(parts)
end
