//! Units given back: a lease's unspent units (`check.lua`'s `refund`) and a charge that
//! turned out not to count (`give_back`), by the core's own refunds
//! ([`ratelimit_core::algo::refund_unspent`], [`ratelimit_core::algo::refund`]) on the
//! state as check.lua and the module write it.

use std::time::Duration;

use ratelimit_core::algo::{self, RuleState};
use ratelimit_core::packed::{self, Header};
use ratelimit_core::{Algorithm, Rule};
use redis_module::{Context, KeyType, RedisString};

use crate::check::{args_error, read_log, replicated, rules_of, Log};
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
struct Leased {
    id: u64,
    code: u64,
    limit: u64,
    period: u64,
    window: u64,
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
    for leased in &rules {
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
    let rules = rules_of(rule_bytes, &header)?;
    let charged = number(charged, "the charge's time")?;
    if header.cost < 1 {
        return Ok(0);
    }
    let now = header.now.unwrap_or_else(crate::check::server_now_us);
    let mut key = StateKey::open(ctx, state_name);
    let Some(raw) = key.string().map(<[u8]>::to_vec) else {
        return Ok(0);
    };
    // Only a state of the check's own layout: another's usage cannot be told apart from
    // the charge's.
    // (A concurrency rule's slots follow that state's fixed part: they stay as they are.)
    let slots_follow = rules.rules().concurrent().is_some() && raw.len() > 8 * header.width;
    if (raw.len() != 8 * header.width && !slots_follow)
        || packed::value(&raw, 0) != Some(header.layout)
    {
        return Ok(0);
    }
    let Some(stored) = packed::decode_state(&raw, &header, &rules, now) else {
        return Ok(0);
    };
    let mut states = stored.states;
    let before = states.clone();
    let log_slot = rules
        .rules()
        .rules()
        .iter()
        .position(|r| r.algorithm() == Algorithm::SlidingLog);
    let mut logged = None;
    if let (Some(slot), Some(log_name)) = (log_slot, log_name) {
        if let Log::Entries(log, _) = read_log(ctx, log_name, header.log_limit)? {
            logged = Some(log.clone());
            states[slot] = RuleState::Log(Box::new(log));
        }
    }
    algo::refund(rules.rules(), &mut states, header.cost, charged, now);
    let mut changed = false;
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
        }
        states[slot] = RuleState::Fresh;
    }
    if states[..] != before[..] {
        let log_until = packed::value(&raw, header.width - 1).unwrap_or(0);
        let mut out = Vec::with_capacity(raw.len());
        packed::encode_state(&mut out, &header, &rules, &states, log_until);
        key.write(state_name, &out, Expiry::Kept)?;
        changed = true;
    }
    Ok(i64::from(changed))
}
