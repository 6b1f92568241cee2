//! Units given back: a lease's unspent units (`check.lua`'s `refund`) and a charge that
//! turned out not to count (`give_back`), by the core's own refunds
//! ([`ratelimit_core::algo::refund_unspent`], [`ratelimit_core::algo::refund`]) on the
//! state as check.lua and the module write it; and units charged as debt, the excess of a
//! metered request settled above its estimate (`debit`, by
//! [`ratelimit_core::algo::debit`]).

use std::time::Duration;

use ratelimit_core::algo::{self, RuleState};
use ratelimit_core::packed::{self, Header};
use ratelimit_core::{Algorithm, Rule};
use redis_module::{Context, KeyType, RedisString};

use crate::check::{args_error, expires_at_ms, read_log, replicated, rules_of, write_log, Log};
use crate::keyspace::{Expiry, StateKey};

/// A number argument: an integer in decimal.
pub(crate) fn number(arg: &RedisString, what: &str) -> Result<u64, String> {
    arg.try_as_str()
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .ok_or_else(|| {
            let bytes = arg.as_slice();
            args_error(&format_args!(
                "{what} is an integer, got {:?}",
                String::from_utf8_lossy(&bytes[..bytes.len().min(32)])
            ))
        })
}

/// A TTL floor in ms as the store sends it: an integer of at most 2^53 µs in ms, checked
/// on every call (even where it goes unused, under the server's clock), so that a
/// command with a bad floor is refused whole rather than written with the floor wrapped
/// or ignored.
pub(crate) fn ttl_floor_arg(arg: &RedisString) -> Result<u64, String> {
    let floor = number(arg, "the TTL floor")?;
    if floor > packed::MAX_EXACT / 1000 {
        return Err(args_error(&format_args!(
            "the TTL floor is at most 2^53 us in ms, got {floor}"
        )));
    }
    Ok(floor)
}

/// `now` as the store sends it: empty for the server's clock; a time below 2^53 µs
/// (as every time of the encoding) otherwise.
pub(crate) fn now_arg(arg: &RedisString) -> Result<u64, String> {
    if arg.as_slice().is_empty() {
        return Ok(crate::check::server_now_us());
    }
    let now = number(arg, "now")?;
    if now > packed::MAX_EXACT {
        return Err(args_error(&format_args!("now is below 2^53 us, got {now}")));
    }
    Ok(now)
}

/// One rule of a lease refund, as the store sends it.
pub(crate) struct Leased {
    pub(crate) id: u64,
    pub(crate) code: u64,
    pub(crate) limit: u64,
    pub(crate) period: u64,
    pub(crate) window: u64,
}

/// `RATELIMIT.REFUND state now units start granted (id code limit period window)..`:
/// gives back `units` of the `granted` a lease reserved at `start`, to each rule's entry
/// (found by identity, in a state of any layout) written under the same limit. Returns 1
/// when the state was rewritten, 0 when there was nothing to give back to.
pub(crate) fn lease_refund(ctx: &Context, args: &[RedisString]) -> Result<i64, String> {
    let [name, now, units, start, granted, rest @ ..] = args else {
        return Err(args_error(&format_args!(
            "ratelimit.refund takes a key and at least 4 values, got {} arguments",
            args.len()
        )));
    };
    if rest.len() % 5 != 0 || rest.len() > 5 * ratelimit_core::MAX_RULES {
        return Err(args_error(&format_args!(
            "ratelimit.refund takes 5 values per rule, for at most {} rules, got {}",
            ratelimit_core::MAX_RULES,
            rest.len()
        )));
    }
    let now = now_arg(now)?;
    let (units, start, granted) = (
        number(units, "units")?,
        number(start, "start")?,
        number(granted, "granted")?,
    );
    let rules = rest
        .chunks_exact(5)
        .map(|r| {
            Ok(Leased {
                id: number(&r[0], "a rule's id")?,
                code: number(&r[1], "a rule's code")?,
                limit: number(&r[2], "a rule's limit")?,
                period: number(&r[3], "a rule's period")?,
                window: number(&r[4], "a rule's window")?,
            })
        })
        .collect::<Result<Vec<_>, String>>()?;
    lease_refund_at(ctx, name, now, units, start, granted, &rules)
}

/// [`lease_refund`] at the time `now` (µs) of `units` of the `granted` a lease reserved
/// at `start`, to `rules`: as its command and as an edit of a batch.
pub(crate) fn lease_refund_at(
    ctx: &Context,
    name: &RedisString,
    now: u64,
    units: u64,
    start: u64,
    granted: u64,
    rules: &[Leased],
) -> Result<i64, String> {
    let mut key = StateKey::open(ctx, name);
    match key.key_type() {
        KeyType::String => {}
        KeyType::Empty => return Ok(0),
        _ => return Err(wrong_type()),
    }
    let mut raw = key.string().map(<[u8]>::to_vec).unwrap_or_default();
    let Some(entries) = entries(&raw) else {
        return Ok(0);
    };
    let mut changed = false;
    for leased in rules {
        let Some(&(_, o)) = entries.iter().rev().find(|(id, _)| *id == leased.id) else {
            continue;
        };
        let v = |i: usize| packed::value(&raw, o + i);
        let period = Duration::from_micros(leased.period);
        // The rule as far as its refund reads it; its state in the entry.
        let (rule, state, at) = match leased.code {
            1 => (
                Rule::fixed_window(leased.limit, period),
                (|| {
                    Some(RuleState::Window {
                        index: v(0)?,
                        count: v(1)?,
                    })
                })(),
                // The reservation's window, as the store names it.
                leased.window.saturating_mul(leased.period),
            ),
            4..=6 if v(0) != Some(leased.limit) => continue,
            4 => (
                Rule::token_bucket(leased.limit, period, v(1).unwrap_or(0)),
                (|| {
                    Some(RuleState::Tokens {
                        level: v(2)?,
                        last: v(3)?,
                    })
                })(),
                start,
            ),
            5 | 6 => (
                // Only the limit and period count: a TAT goes back by emission intervals.
                Rule::gcra(leased.limit, period, 1),
                (|| {
                    Some(RuleState::Tat {
                        us: v(2)?,
                        frac: v(3)?,
                    })
                })(),
                start,
            ),
            _ => continue,
        };
        let (Ok(rule), Some(mut state)) = (rule, state) else {
            continue;
        };
        if algo::refund_unspent(&rule, &mut state, units, granted, at, now) {
            changed = true;
            let written: &[u64] = match state {
                RuleState::Window { index, count } => &[index, count],
                RuleState::Tokens { level, .. } => &[leased.limit, v(1).unwrap_or(0), level],
                RuleState::Tat { us, frac } => &[leased.limit, v(1).unwrap_or(0), us, frac],
                _ => &[],
            };
            for (i, &x) in written.iter().enumerate() {
                set_value(&mut raw, o + i, x);
            }
        }
    }
    if !changed {
        return Ok(0);
    }
    key.write(name, &raw, Expiry::Kept)?;
    Ok(1)
}

/// Where each entry's values start in a state, by identity, in order (a later entry of
/// one identity wins, as in check.lua); `None` when the state is not a list of entries.
fn entries(raw: &[u8]) -> Option<Vec<(u64, usize)>> {
    // A value longer than any state is no one's: never walked (as a check reads it).
    if raw.is_empty() || !raw.len().is_multiple_of(8) || raw.len() > packed::MAX_STATE_BYTES {
        return None;
    }
    let len = raw.len() / 8;
    let mut at = Vec::new();
    let mut i = 1;
    while i + 1 < len {
        let id = packed::value(raw, i)?;
        let m = usize::try_from(packed::value(raw, i + 1)?).ok()?;
        at.push((id, i + 2));
        i = i.checked_add(2 + m)?;
    }
    (i == len).then_some(at)
}

/// The states of `raw` when the check's rules wrote it: in their own layout, or as a
/// denial after a conversion writes it (the layout [`packed::CARRIED`] plus theirs,
/// which `MemoryStore` holds as those rules' states too); `None` for any other.
fn own_states(
    raw: &[u8],
    header: &Header,
    rules: &packed::PackedRules,
    now: u64,
) -> Option<packed::Stored> {
    let layout = packed::value(raw, 0)?;
    // A concurrency rule's slots follow the fixed part: decoded, and written back, with it.
    let fixed = 8 * header.width;
    let sized = raw.len() == fixed || (rules.rules().concurrent().is_some() && raw.len() > fixed);
    let own = sized && layout == header.layout;
    if !own && layout != packed::CARRIED + header.layout {
        return None;
    }
    packed::decode_state(raw, header, rules, now)
}

fn set_value(raw: &mut [u8], i: usize, x: u64) {
    // Exact: every value of the encoding is below 2^53.
    raw[8 * i..8 * i + 8].copy_from_slice(&(x as f64).to_le_bytes());
}

fn wrong_type() -> String {
    "WRONGTYPE Operation against a key holding the wrong kind of value".to_owned()
}

/// `RATELIMIT.GIVE_BACK state [log] packed charged_at`: gives back the units a check
/// (`packed`, its cost the units) charged at `charged_at`, by [`algo::refund`], to a
/// state written under the check's rules. Returns 1 when something was given back, 0
/// otherwise.
pub(crate) fn give_back(ctx: &Context, args: &[RedisString]) -> Result<i64, String> {
    let (state_name, log_name, packed_check, charged) = match args {
        [s, p, c] => (s, None, p, c),
        [s, l, p, c] => (s, Some(l), p, c),
        _ => {
            return Err(args_error(&format_args!(
                "ratelimit.give_back takes 1 or 2 keys, the packed values and the charge's \
                 time, got {} arguments",
                args.len()
            )))
        }
    };
    let (header, rule_bytes) =
        Header::parse(packed_check.as_slice()).map_err(|e| args_error(&e))?;
    let charged = number(charged, "the charge's time")?;
    let rules = rules_of(rule_bytes, &header)?;
    let now = header.now.unwrap_or_else(crate::check::server_now_us);
    give_back_parsed(ctx, state_name, log_name, &header, &rules, charged, now)
}

/// [`give_back`] of a check whose header and rules are read (`header`, `rules`) at
/// `now` (the header's injected time, else the server's): as its command and as an edit
/// of a batch.
pub(crate) fn give_back_parsed(
    ctx: &Context,
    state_name: &RedisString,
    log_name: Option<&RedisString>,
    header: &Header,
    rules: &packed::PackedRules,
    charged: u64,
    now: u64,
) -> Result<i64, String> {
    let header = *header;
    if header.cost < 1 {
        return Ok(0);
    }
    let mut key = StateKey::open(ctx, state_name);
    // Read in place: the value is decoded (and its log marker's time taken, under rules
    // with a sliding log) before the key is written.
    let (stored, stored_log_until) = {
        let Some(raw) = key.string() else {
            return Ok(0);
        };
        // Only a state written under the check's rules: another's usage cannot be told
        // apart from the charge's.
        let Some(stored) = own_states(raw, &header, rules, now) else {
            return Ok(0);
        };
        let log_until = if rules.rules().log_limit() == 0 {
            0
        } else {
            entries(raw)
                .and_then(|at| at.iter().find(|(id, _)| *id == packed::LOG_MARKER).copied())
                .and_then(|(_, o)| packed::value(raw, o))
                .unwrap_or(0)
        };
        (stored, log_until)
    };
    let mut states = stored.states;
    let log_slot = rules
        .rules()
        .rules()
        .iter()
        .position(|r| r.algorithm() == Algorithm::SlidingLog);
    let mut logged = None;
    if let (Some(slot), Some(log_name), true) = (log_slot, log_name, stored.log_counts) {
        // The whole log, as the core's refund reads it: entries past these rules' own
        // limit (a rule set with a longer log wrote them, and a denial keeps them) are
        // given back in their turn. No writer keeps more than `MAX_LOG_LIMIT`.
        if let Log::Entries(log, _) = read_log(ctx, log_name, ratelimit_core::MAX_LOG_LIMIT)? {
            logged = Some(log.clone());
            states[slot] = RuleState::Log(Box::new(log));
        }
    }
    // Whether a state changed (the log's entries included: they are a state's too).
    let refunded = algo::refund(rules.rules(), &mut states, header.cost, charged, now);
    let mut changed = false;
    // The log marker's new time, when entries left the log.
    let mut marker = None;
    if let (Some(slot), Some(log_name), Some(old)) = (log_slot, log_name, logged) {
        // `logged` is set only where the slot was given the log just above, and
        // `algo::refund` drains a log in place, never replacing it: no argument or
        // stored value can reach the panic.
        let RuleState::Log(new) = &states[slot] else {
            unreachable!("the log's slot holds the log")
        };
        // The refund took the oldest entries of those logged since the charge: in the
        // list, newest first, the last `take` before the first older one.
        let take = old.len() - new.len();
        if take > 0 {
            let since = old.partition_point(|&t| t >= charged);
            let name = log_name.as_slice();
            for i in since - take..since {
                replicated(ctx, "LSET", &[name, i.to_string().as_bytes(), b"x"])?;
            }
            replicated(ctx, "LREM", &[name, take.to_string().as_bytes(), b"x"])?;
            changed = true;
            // The marker counts from the newest entry left, as a commit sets it: the
            // entries given back no longer keep the log alive.
            marker = Some(new.front().map_or(0, |t| t + header.log_period_us));
        }
        states[slot] = RuleState::Fresh;
    }
    if refunded || marker.is_some() {
        // The log marker's time, where the state has one (rules with a sliding log).
        let log_until = marker.unwrap_or(stored_log_until);
        key.write_state(state_name, &header, rules, &states, log_until, Expiry::Kept)?;
        changed = true;
        // The state is written in the rules' own layout, which vouches for the log: a
        // log the carried state did not vouch for is no one's (MemoryStore dropped it
        // with the rules that had no log), so it goes rather than count again.
        if let (Some(log_name), false) = (log_name, stored.log_counts) {
            drop(key);
            crate::check::replicated(ctx, "DEL", &[log_name.as_slice()])?;
        }
    }
    Ok(i64::from(changed))
}

/// `RATELIMIT.DEBIT state [log] packed`: charges the units of a check (`packed`, its cost
/// the units) unconditionally, as debt where a state goes past its limit, by
/// [`algo::debit`]: to a state written under the check's rules, or from fresh when the
/// key holds none. Returns 1 when a state changed, 0 otherwise (a state of another
/// layout, or of another type, is charged nothing).
pub(crate) fn debit(ctx: &Context, args: &[RedisString]) -> Result<i64, String> {
    let (state_name, log_name, packed_check) = match args {
        [s, p] => (s, None, p),
        [s, l, p] => (s, Some(l), p),
        _ => {
            return Err(args_error(&format_args!(
                "ratelimit.debit takes 1 or 2 keys and the packed values, got {} arguments",
                args.len()
            )))
        }
    };
    let (header, rule_bytes) =
        Header::parse(packed_check.as_slice()).map_err(|e| args_error(&e))?;
    let rules = rules_of(rule_bytes, &header)?;
    let now = header.now.unwrap_or_else(crate::check::server_now_us);
    debit_parsed(ctx, state_name, log_name, &header, &rules, now)
}

/// [`debit`] of a check whose header and rules are read (`header`, `rules`) at `now` (as
/// [`give_back_parsed`]): as its command and as an edit of a batch.
pub(crate) fn debit_parsed(
    ctx: &Context,
    state_name: &RedisString,
    log_name: Option<&RedisString>,
    header: &Header,
    rules: &packed::PackedRules,
    now: u64,
) -> Result<i64, String> {
    charge(ctx, state_name, log_name, header, rules, false, now)
}

/// A batch's take (`packed::Edit::Take`): a slot of the rules' concurrency rule taken
/// whatever its limit and one unit charged as debt, by [`algo::take`], to a state written
/// under the rules or from fresh; answers the slot's number, 0 when it took none (no
/// concurrency rule, a state of another layout or type).
pub(crate) fn take_parsed(
    ctx: &Context,
    state_name: &RedisString,
    log_name: Option<&RedisString>,
    header: &Header,
    rules: &packed::PackedRules,
    now: u64,
) -> Result<i64, String> {
    charge(ctx, state_name, log_name, header, rules, true, now)
}

/// A debit of the header's cost, or with `take` a take (one unit and a slot): answers 1
/// or the slot's number when it changed the state, else 0; at `now`, as
/// [`give_back_parsed`].
fn charge(
    ctx: &Context,
    state_name: &RedisString,
    log_name: Option<&RedisString>,
    header: &Header,
    rules: &packed::PackedRules,
    take: bool,
    now: u64,
) -> Result<i64, String> {
    let mut header = *header;
    if (header.log_limit > 0) != log_name.is_some() {
        return Err(args_error(&format_args!(
            "a debit {} a sliding log takes {} keys",
            if header.log_limit > 0 {
                "with"
            } else {
                "without"
            },
            if header.log_limit > 0 { 2 } else { 1 }
        )));
    }
    if take {
        if rules.rules().concurrent().is_none() {
            return Ok(0);
        }
        header.cost = 1;
    } else if header.cost < 1 {
        return Ok(0);
    }
    let mut key = StateKey::open(ctx, state_name);
    let (mut states, unvouched) = match key.key_type() {
        KeyType::Empty => (
            std::iter::repeat_n(RuleState::Fresh, rules.rules().len()).collect(),
            true,
        ),
        KeyType::String => {
            let raw = key.string().unwrap_or_default();
            // Only a state written under the check's rules: no rule it did not have is
            // charged.
            match own_states(raw, &header, rules, now) {
                Some(stored) => (stored.states, !stored.log_counts),
                None => return Ok(0),
            }
        }
        _ => return Ok(0),
    };
    let log_slot = rules
        .rules()
        .rules()
        .iter()
        .position(|r| r.algorithm() == Algorithm::SlidingLog);
    // The shared log counts when the state vouches for it; without a state, or when it
    // holds what this store did not write, it is no one's: dropped before the debt is
    // logged.
    let (mut drop_log, mut log_len) = (unvouched, 0);
    if let (Some(slot), Some(log_name), false) = (log_slot, log_name, unvouched) {
        match read_log(ctx, log_name, header.log_limit)? {
            Log::Entries(log, len) => {
                log_len = len;
                if !log.is_empty() {
                    states[slot] = RuleState::Log(Box::new(log));
                }
            }
            Log::Foreign => drop_log = true,
        }
    }
    let answer = if take {
        algo::take(rules.rules(), &mut states, now).map_or(0, |slot| slot.min(packed::MAX_EXACT))
    } else {
        u64::from(algo::debit(rules.rules(), &mut states, header.cost, now))
    };
    if answer == 0 {
        return Ok(0);
    }
    let log_now = states
        .iter()
        .find_map(|s| match s {
            RuleState::Log(log) => log.front().copied(),
            _ => None,
        })
        .unwrap_or(now);
    let log_until = log_now + header.log_period_us;
    let expires = algo::expires_at_for(rules.rules(), &states);
    key.write_state(
        state_name,
        &header,
        rules,
        &states,
        log_until,
        Expiry::At(expires_at_ms(&header, now, expires)),
    )?;
    drop(key);
    if let Some(log_name) = log_name {
        write_log(
            ctx,
            log_name,
            drop_log,
            log_now,
            if drop_log { 0 } else { log_len },
            header.cost.min(header.log_limit),
            &header,
            expires_at_ms(&header, now, log_until),
        )?;
    }
    // Below 2^53: a slot's number, or 1.
    Ok(answer as i64)
}
