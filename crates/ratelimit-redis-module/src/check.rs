//! One check on its keys, as `check.lua`'s `check_one` decides it, with the core's own
//! algorithms: the packed arguments read by [`ratelimit_core::packed`], the block marker
//! and the state read and written through the key API, the decision made by
//! [`ratelimit_core::algo::decide`], the writes replicated as their effects.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::rc::Rc;

use ratelimit_core::algo::{self, RuleState};
use ratelimit_core::packed::{self, Header, PackedRules};
use redis_module::key::KeyFlags;

use crate::keyspace::{may_exist, Expiry, StateKey};
use redis_module::{CallOptionsBuilder, CallReply, CallResult, Context, KeyType, RedisString};

/// The rule sets seen lately, by their packed bytes: building one (validation, the
/// divisors) costs more than a decision. Commands run on Redis's main thread, one at a
/// time, so a thread-local map serves.
const RULE_CACHE: usize = 1024;

thread_local! {
    static RULES: RefCell<HashMap<Box<[u8]>, Rc<PackedRules>>> = RefCell::new(HashMap::new());
    /// The last packed check, read: a batch's checks mostly carry the same bytes (rules,
    /// cost, deadline), and comparing them costs less than reading the header again and
    /// hashing the rules for the map.
    static LAST: RefCell<Option<ReadCheck>> = const { RefCell::new(None) };
}

/// A packed check's bytes, and its header and rules as read.
type ReadCheck = (Box<[u8]>, Header, Rc<PackedRules>);

/// The header and the rules of a packed check, read or taken from the caches.
pub(crate) fn read_check(packed_check: &[u8]) -> Result<(Header, Rc<PackedRules>), String> {
    let last = LAST.with(|last| {
        last.borrow()
            .as_ref()
            .filter(|(bytes, _, _)| **bytes == *packed_check)
            .map(|(_, header, rules)| (*header, rules.clone()))
    });
    if let Some(read) = last {
        return Ok(read);
    }
    let (header, rule_bytes) = Header::parse(packed_check).map_err(|e| args_error(&e))?;
    let rules = rules_of(rule_bytes, &header)?;
    LAST.with(|last| *last.borrow_mut() = Some((packed_check.into(), header, rules.clone())));
    Ok((header, rules))
}

/// The rules of a packed check, from the cache or built and cached; either way checked
/// against `header` ([`PackedRules::check_header`]): the cache is keyed by the rules'
/// bytes alone, and the state width, log limit and log period the header carries size
/// what a check allocates.
pub(crate) fn rules_of(bytes: &[u8], header: &Header) -> Result<Rc<PackedRules>, String> {
    if let Some(rules) = RULES.with(|cache| cache.borrow().get(bytes).cloned()) {
        rules.check_header(header).map_err(|e| args_error(&e))?;
        return Ok(rules);
    }
    let rules = Rc::new(PackedRules::parse(bytes, header).map_err(|e| args_error(&e))?);
    RULES.with(|cache| {
        let mut cache = cache.borrow_mut();
        if cache.len() >= RULE_CACHE {
            // Many rule sets at once is rare (tiers, rollouts); start over rather than
            // track recency on the hot path.
            cache.clear();
        }
        cache.insert(bytes.into(), rules.clone());
    });
    Ok(rules)
}

/// The rule sets the cache holds (at most [`RULE_CACHE`]).
pub(crate) fn cached_rule_sets() -> usize {
    RULES.with(|cache| cache.borrow().len())
}

pub(crate) fn args_error(e: &dyn std::fmt::Display) -> String {
    format!("RLARGS {e}; the store and the module are from different versions")
}

/// The server's time in µs since the Unix epoch: the realtime clock Redis's `TIME` reads
/// (a check's clock when it has none injected, and the clock of every deadline).
pub(crate) fn server_now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// The keys of one check: block marker, state, and the shared sliding log when a rule is
/// a sliding log.
pub(crate) struct Keys<'a> {
    pub(crate) block: &'a RedisString,
    pub(crate) state: &'a RedisString,
    pub(crate) log: Option<&'a RedisString>,
}

impl<'a> Keys<'a> {
    /// A batch entry's keys in the order the store sends them: block marker, state,
    /// then the log when there is one (the caller has checked there are 2 or 3).
    pub(crate) fn of(names: &'a [RedisString]) -> Self {
        Keys {
            block: &names[0],
            state: &names[1],
            log: names.get(2),
        }
    }
}

/// Decides one check and appends its reply to `out`; an `Err` is the message of an
/// error reply (for a batch, the check's failure entry), with nothing appended.
pub(crate) fn check_one(
    ctx: &Context,
    keys: &Keys<'_>,
    packed_check: &[u8],
    server_now: u64,
    out: &mut Vec<u8>,
) -> Result<(), String> {
    let (header, rules) = read_check(packed_check)?;
    if (header.log_limit > 0) != keys.log.is_some() {
        return Err(args_error(&format_args!(
            "a check {} a sliding log takes {} keys",
            if header.log_limit > 0 {
                "with"
            } else {
                "without"
            },
            if header.log_limit > 0 { 3 } else { 2 }
        )));
    }
    decide_one(ctx, keys, &header, &rules, server_now, out)
}

/// Decides one check whose packed values are read already (`header`, `rules`) and
/// appends its reply to `out`; an `Err` as for [`check_one`].
pub(crate) fn decide_one(
    ctx: &Context,
    keys: &Keys<'_>,
    header: &Header,
    rules: &PackedRules,
    server_now: u64,
    out: &mut Vec<u8>,
) -> Result<(), String> {
    #[cfg(feature = "test-panic")]
    if keys.state.as_slice().ends_with(b"{rlpanic}:s") {
        panic!("{}", crate::TEST_PANIC);
    }
    let header = *header;
    rules
        .rules()
        .check_cost(header.cost)
        .map_err(|e| args_error(&e))?;
    if header
        .deadline
        .is_some_and(|deadline| server_now > deadline)
    {
        // The caller stopped waiting before Redis got to this check: decide nothing and
        // charge nothing.
        packed::encode_late(out, server_now);
        return Ok(());
    }
    let now = header.now.unwrap_or(server_now);
    let mut discarded = false;

    // Blocks come first: a blocked key consults no rule. Most keys have none: asked
    // whether it exists, a missing key costs a lookup and nothing else (opened, even
    // for reading, it is allocated and freed too; for writing, signalled as modified
    // when closed). A value of another type reads as no marker and stays, as for `MGET`
    // in Lua.
    let block = may_exist(ctx, keys.block)
        .then(|| ctx.open_key_with_flags(keys.block, KeyFlags::NOTOUCH))
        .filter(|block| block.key_type() == KeyType::String);
    if let Some(block) = block {
        let until = {
            let marker = block.read().map_err(|e| e.to_string())?.unwrap_or_default();
            if marker == b"inf" {
                packed::encode_blocked(out, None);
                return Ok(());
            }
            std::str::from_utf8(marker)
                .ok()
                .and_then(|s| s.parse::<u64>().ok())
        };
        match until {
            Some(until) if until > now => {
                packed::encode_blocked(out, Some(until - now));
                return Ok(());
            }
            Some(_) => {}
            // Not a marker this store wrote: dropped, and said.
            None => discarded = true,
        }
        drop(block);
        delete(ctx, &ctx.open_key_writable(keys.block), keys.block);
    }

    // The state: read in place, or carried entry by entry; anything else reads as fresh
    // and is replaced when the check commits.
    let mut state_key = StateKey::open(ctx, keys.state);
    let mut stored = None;
    // A value of another type: read as absent, replaced (and said) when the check
    // commits, as in Lua.
    let foreign_type = !matches!(state_key.key_type(), KeyType::String | KeyType::Empty);
    if let Some(raw) = state_key.string() {
        stored = packed::decode_state(raw, &header, rules, now);
        discarded |= stored.is_none();
    }
    let (mut states, log_counts, converted) = match stored {
        Some(stored) => (stored.states, stored.log_counts, stored.converted),
        None => (
            std::iter::repeat_n(RuleState::Fresh, rules.rules().len()).collect(),
            false,
            false,
        ),
    };

    // The shared sliding log, when it counts.
    let mut drop_log = false;
    let mut log_len = 0;
    if let Some(log_key) = keys.log {
        if log_counts {
            match read_log(ctx, log_key, header.log_limit)? {
                Log::Entries(log, len) => {
                    log_len = len;
                    if let Some(slot) = rules
                        .rules()
                        .rules()
                        .iter()
                        .position(|r| r.algorithm() == ratelimit_core::Algorithm::SlidingLog)
                    {
                        if !log.is_empty() {
                            states[slot] = RuleState::Log(Box::new(log));
                        }
                    }
                }
                Log::Foreign => {
                    discarded = true;
                    replicated(ctx, "DEL", &[log_key.as_slice()])?;
                }
            }
        } else {
            // A log the state does not vouch for is no one's: read as empty, dropped when
            // the check commits (a peek or a denial writes nothing, as in Lua).
            drop_log = true;
        }
    }

    let transition = algo::decide(rules.rules(), &mut states, now, header.cost);
    discarded |= foreign_type && transition.committed;
    if transition.committed {
        let log_now = match states.iter().find_map(|s| match s {
            RuleState::Log(log) => log.front().copied(),
            _ => None,
        }) {
            Some(newest) => newest,
            None => now,
        };
        let log_until = log_now + header.log_period_us;
        let expiry = expires_at_ms(&header, now, transition.expires_at_us);
        state_key.write_state(
            keys.state,
            &header,
            rules,
            &states,
            log_until,
            Expiry::At(expiry),
        )?;
        drop(state_key);
        if let Some(log_key) = keys.log {
            write_log(
                ctx,
                log_key,
                drop_log,
                log_now,
                log_len,
                header.cost,
                &header,
                expires_at_ms(&header, now, log_until),
            )?;
        }
    } else if converted && header.cost > 0 {
        // A state converted to a changed limit depends on the time of this check: a
        // denial writes it (check.lua's `write_carried`), so that the next check keeps
        // this one's retry time rather than converting again at its own.
        write_carried(
            ctx,
            keys,
            &mut state_key,
            &header,
            rules,
            &states,
            now,
            &transition,
        )?;
    }
    packed::encode_decision(
        out,
        &transition.decision,
        rules.rules().concurrent(),
        discarded,
    );
    Ok(())
}

/// Writes the carried states of a denied check after a conversion, with an expiry that
/// covers the longest of them, and the sliding log's marker and expiry when it has an
/// entry; each write replicated.
#[allow(clippy::too_many_arguments)]
fn write_carried(
    ctx: &Context,
    keys: &Keys<'_>,
    state_key: &mut StateKey<'_>,
    header: &Header,
    rules: &PackedRules,
    states: &[RuleState],
    now: u64,
    transition: &algo::Transition,
) -> Result<(), String> {
    let newest = states.iter().find_map(|s| match s {
        RuleState::Log(log) => log.front().copied(),
        _ => None,
    });
    let log_until = newest
        .filter(|_| header.log_limit > 0)
        .map(|newest| newest + header.log_period_us);
    let until = transition
        .decision
        .rules()
        .iter()
        .map(|r| now.saturating_add(u64::try_from(r.reset_after.as_micros()).unwrap_or(u64::MAX)))
        .fold(now, u64::max);
    let mut raw = Vec::new();
    packed::encode_carried(&mut raw, header, rules, states, log_until);
    state_key.write(
        keys.state,
        &raw,
        Expiry::At(expires_at_ms(header, now, until)),
    )?;
    if let (Some(log_key), Some(until)) = (keys.log, log_until) {
        let expiry = expires_at_ms(header, now, until);
        replicated(
            ctx,
            "PEXPIREAT",
            &[log_key.as_slice(), expiry.to_string().as_bytes()],
        )?;
    }
    Ok(())
}

/// Deletes an open key, replicated as `DEL` when it was deleted (a replica is sent only
/// the writes that happened).
fn delete(ctx: &Context, key: &redis_module::key::RedisKeyWritable, name: &RedisString) {
    if key.delete().is_ok() {
        crate::keyspace::replicate_writes(ctx);
        ctx.replicate("DEL", &[name][..]);
    }
}

/// Runs a write command whose effect is replicated (the `!` flag of `RM_Call`).
/// The state writes made before it are replicated first, so that a replica applies
/// them in the primary's order.
pub(crate) fn replicated(ctx: &Context, command: &str, args: &[&[u8]]) -> Result<(), String> {
    crate::keyspace::replicate_writes(ctx);
    let options = CallOptionsBuilder::new()
        .replicate()
        .errors_as_replies()
        .build();
    let reply: CallResult<'_> = ctx.call_ext(command, &options, args);
    match reply {
        // No reply at all: Redis before 7.2 refused the call (`E` is newer).
        Ok(CallReply::Unknown) => Err(format!("RLSTATE {command} was refused")),
        Ok(_) => Ok(()),
        Err(e) => Err(format!(
            "RLSTATE {command} failed: {}",
            e.to_utf8_string().unwrap_or_default()
        )),
    }
}

/// The shared log as read: its newest entries (at most the log limit) and its length,
/// or a value this store did not write.
pub(crate) enum Log {
    /// The newest entries and the log's length.
    Entries(VecDeque<u64>, u64),
    /// Not a list this store wrote.
    Foreign,
}

pub(crate) fn read_log(ctx: &Context, key: &RedisString, limit: u64) -> Result<Log, String> {
    match ctx.open_key(key).key_type() {
        KeyType::Empty => return Ok(Log::Entries(VecDeque::new(), 0)),
        KeyType::List => {}
        _ => return Ok(Log::Foreign),
    }
    let len = match ctx.call("LLEN", &[key.as_slice()][..]) {
        Ok(redis_module::RedisValue::Integer(n)) => u64::try_from(n).unwrap_or(0),
        other => return Err(format!("RLSTATE LLEN of the sliding log: {other:?}")),
    };
    let last = limit.saturating_sub(1).to_string();
    let entries = match ctx.call("LRANGE", &[key.as_slice(), b"0", last.as_bytes()][..]) {
        Ok(redis_module::RedisValue::Array(items)) => items,
        other => return Err(format!("RLSTATE LRANGE of the sliding log: {other:?}")),
    };
    let mut log = VecDeque::with_capacity(entries.len());
    for item in &entries {
        let stamp = match item {
            redis_module::RedisValue::BulkRedisString(s) => s.as_slice().to_vec(),
            redis_module::RedisValue::StringBuffer(b) => b.clone(),
            redis_module::RedisValue::BulkString(s) | redis_module::RedisValue::SimpleString(s) => {
                s.clone().into_bytes()
            }
            _ => Vec::new(),
        };
        match std::str::from_utf8(&stamp)
            .ok()
            .and_then(|s| s.parse::<u64>().ok())
            .filter(|&ts| ts <= packed::MAX_EXACT)
        {
            Some(ts) => log.push_back(ts),
            // An entry that is not a timestamp: the log is no one's. Read as empty and
            // replaced, as any foreign value, rather than answered with an error after
            // the log was dropped (a command that answers an error writes nothing).
            None => return Ok(Log::Foreign),
        }
    }
    Ok(Log::Entries(log, len))
}

/// Logs `count` copies of the log's time (a committed check's cost, or a debit's
/// entries), keeps the log limit's newest, and sets the expiry, each write replicated.
#[allow(clippy::too_many_arguments)]
pub(crate) fn write_log(
    ctx: &Context,
    key: &RedisString,
    drop_log: bool,
    log_now: u64,
    log_len: u64,
    count: u64,
    header: &Header,
    expiry_ms: u64,
) -> Result<(), String> {
    let name = key.as_slice();
    if drop_log {
        replicated(ctx, "DEL", &[name])?;
    }
    let stamp = log_now.to_string();
    let mut left = count;
    while left > 0 {
        let m = left.min(1000);
        let mut args: Vec<&[u8]> = Vec::with_capacity(1 + m as usize);
        args.push(name);
        args.extend(std::iter::repeat_n(stamp.as_bytes(), m as usize));
        replicated(ctx, "LPUSH", &args)?;
        left -= m;
    }
    if log_len + count > header.log_limit {
        let last = (header.log_limit - 1).to_string();
        replicated(ctx, "LTRIM", &[name, b"0", last.as_bytes()])?;
    }
    replicated(ctx, "PEXPIREAT", &[name, expiry_ms.to_string().as_bytes()])
}

/// When a key whose state matters until `at` µs expires, in ms since the Unix epoch, as
/// `check.lua`'s `expiry_arg` computes it (the `PXAT` the primary sets and the replicas
/// and the AOF receive): on the server's clock exactly, the ms after `at`; under an
/// injected clock, which need not run at the server's pace, the server's time plus
/// what is left from `now`, with the TTL floor, and at least 1 ms.
pub(crate) fn expires_at_ms(header: &Header, now: u64, at: u64) -> u64 {
    if header.now.is_some() {
        let ms = at
            .saturating_sub(now)
            .div_ceil(1000)
            .max(header.ttl_floor_ms)
            .max(1);
        server_now_us() / 1000 + ms
    } else {
        at.div_ceil(1000)
    }
}
