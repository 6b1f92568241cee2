//! Concurrency slots released and renewed (`check.lua`'s `release` and `renew`), by the
//! core's own [`ratelimit_core::algo::release`] and [`ratelimit_core::algo::renew`] on the
//! slots trailer of a state as check.lua and the module write it.

use ratelimit_core::packed::{self, SlotEdit};
use ratelimit_core::MAX_SLOT_TIMEOUT_US;
use redis_module::{Context, KeyType, RedisString};

use crate::check::args_error;
use crate::keyspace::{Expiry, StateKey};
use crate::refund::{now_arg, number, ttl_floor_arg};

/// `RATELIMIT.RELEASE state now slot`: frees slot `slot` of the state. Returns 1 when it
/// was held and live, 0 otherwise (a release sent again frees nothing).
pub(crate) fn release(ctx: &Context, args: &[RedisString]) -> Result<i64, String> {
    let [name, now, slot] = args else {
        return Err(args_error(&format_args!(
            "ratelimit.release takes a key, the time and a slot, got {} arguments",
            args.len()
        )));
    };
    let now = now_arg(now)?;
    let slot = number(slot, "slot")?;
    release_at(ctx, name, slot, now)
}

/// [`release`] at the time `now`: as its command and as an edit of a batch.
pub(crate) fn release_at(
    ctx: &Context,
    name: &RedisString,
    slot: u64,
    now: u64,
) -> Result<i64, String> {
    edit(ctx, name, slot, now, SlotEdit::Release, |_| Expiry::Kept)
}

/// `RATELIMIT.RENEW state now slot timeout ttl_floor`: moves the deadline of live slot
/// `slot` to now plus `timeout` µs, and the key's expiry to at least that. Returns 1 when
/// the slot was live, 0 otherwise.
pub(crate) fn renew(ctx: &Context, args: &[RedisString]) -> Result<i64, String> {
    let [name, now_text, slot, timeout, ttl_floor] = args else {
        return Err(args_error(&format_args!(
            "ratelimit.renew takes a key, the time, a slot, a timeout and a TTL floor, got {} \
             arguments",
            args.len()
        )));
    };
    let injected = !now_text.as_slice().is_empty();
    let now = now_arg(now_text)?;
    let slot = number(slot, "slot")?;
    let timeout = number(timeout, "timeout")?;
    let ttl_floor = ttl_floor_arg(ttl_floor)?;
    renew_at(ctx, name, slot, timeout, injected.then_some(now), ttl_floor)
}

/// [`renew`] at the injected time `injected` (`None`: the server's clock): as its
/// command and as an edit of a batch.
pub(crate) fn renew_at(
    ctx: &Context,
    name: &RedisString,
    slot: u64,
    timeout: u64,
    injected: Option<u64>,
    ttl_floor: u64,
) -> Result<i64, String> {
    if timeout == 0 || timeout > MAX_SLOT_TIMEOUT_US {
        return Err(args_error(&format_args!(
            "timeout is 1 to {MAX_SLOT_TIMEOUT_US} us, got {timeout}"
        )));
    }
    if ttl_floor > packed::MAX_EXACT / 1000 {
        return Err(args_error(&format_args!(
            "the TTL floor is at most 2^53 us in ms, got {ttl_floor}"
        )));
    }
    let now = injected.unwrap_or_else(crate::check::server_now_us);
    edit(ctx, name, slot, now, SlotEdit::Renew(timeout), |latest| {
        // As a check's expiry: on the server's clock, or relative to an injected one.
        let ms = if injected.is_some() {
            let ms = latest
                .saturating_sub(now)
                .div_ceil(1000)
                .max(ttl_floor)
                .max(1);
            crate::check::server_now_us() / 1000 + ms
        } else {
            latest.div_ceil(1000)
        };
        Expiry::AtLeast(ms)
    })
}

/// Applies `edit` to the state at `name`, writing it (with `expiry` of its latest
/// deadline) only when the slot was live.
fn edit(
    ctx: &Context,
    name: &RedisString,
    slot: u64,
    now: u64,
    edit: SlotEdit,
    expiry: impl FnOnce(u64) -> Expiry,
) -> Result<i64, String> {
    let mut key = StateKey::open(ctx, name);
    match key.key_type() {
        KeyType::String => {}
        KeyType::Empty => return Ok(0),
        _ => {
            return Err(
                "WRONGTYPE Operation against a key holding the wrong kind of value".to_owned(),
            )
        }
    }
    let Some(raw) = key.string() else {
        return Ok(0);
    };
    let Some((out, live, latest)) = packed::edit_slots(raw, slot, now, edit) else {
        return Ok(0);
    };
    if !live {
        return Ok(0);
    }
    key.write(name, &out, expiry(latest))?;
    Ok(1)
}
