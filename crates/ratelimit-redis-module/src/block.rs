//! `RATELIMIT.BLOCK`: a client key's block marker written, as `block.lua` writes it.

use ratelimit_core::packed;
use redis_module::{Context, KeyType, RedisString};

use crate::check::args_error;
use crate::keyspace::{Expiry, StateKey};
use crate::refund::{now_arg, number, ttl_floor_arg};

/// `RATELIMIT.BLOCK marker now length ttl_floor`: blocks a client key, replacing any
/// earlier block. `now` empty reads the server's clock; `length` in µs, empty for a
/// block without end; the TTL floor in ms applies only under an injected `now`. Returns
/// the block's end in µs (-1 for none); a marker key holding another type is refused
/// with `WRONGTYPE`, nothing written.
pub(crate) fn block(ctx: &Context, args: &[RedisString]) -> Result<i64, String> {
    let [name, now, length, floor] = args else {
        return Err(args_error(&format_args!(
            "ratelimit.block takes a key and 3 values, got {} arguments",
            args.len()
        )));
    };
    // Every value is read and checked before the key is touched: a refused command
    // writes nothing.
    let floor = ttl_floor_arg(floor)?;
    let injected = !now.as_slice().is_empty();
    let now = now_arg(now)?;
    let length = if length.as_slice().is_empty() {
        None
    } else {
        Some(number(length, "the block's length")?)
    };
    block_at(ctx, name, now, injected, length, floor)
}

/// [`block`] at the time `now` (µs; `injected`, else the server's), for `length` µs
/// (`None`: without end): as its command and as an edit of a batch.
pub(crate) fn block_at(
    ctx: &Context,
    name: &RedisString,
    now: u64,
    injected: bool,
    length: Option<u64>,
    floor: u64,
) -> Result<i64, String> {
    if floor > packed::MAX_EXACT / 1000 {
        return Err(args_error(&format_args!(
            "the TTL floor is at most 2^53 us in ms, got {floor}"
        )));
    }
    let written = match length {
        None => None,
        Some(length) => Some(marker(now, injected, length, floor)?),
    };
    let mut key = StateKey::open(ctx, name);
    let kind = key.key_type();
    if !matches!(kind, KeyType::Empty | KeyType::String) {
        return Err(format!(
            "WRONGTYPE the block marker holds a {}",
            format!("{kind:?}").to_lowercase()
        ));
    }
    match written {
        None => {
            // A block without end has no expiry (as `SET` leaves it).
            key.write(name, b"inf", Expiry::Never)?;
            Ok(-1)
        }
        Some((until, at_ms)) => {
            key.write(name, until.to_string().as_bytes(), Expiry::At(at_ms))?;
            // Below 2^53 (checked in `marker`).
            Ok(i64::try_from(until).unwrap_or(i64::MAX))
        }
    }
}

/// The longest block in µs, as the store caps it (`block.lua` takes lengths below it):
/// `now + length` stays below 2^53, exact in Lua, for a century yet.
const MAX_LENGTH_US: u64 = 1 << 52;

/// A timed block's end in µs and its marker's expiry in ms, from the arguments; an
/// error, before anything is written, for a value out of range.
fn marker(now: u64, injected: bool, length: u64, floor: u64) -> Result<(u64, u64), String> {
    if length > MAX_LENGTH_US {
        return Err(args_error(&format_args!(
            "the block's length is at most 2^52 us, got {length}"
        )));
    }
    let until = now
        .checked_add(length)
        .filter(|&until| until <= packed::MAX_EXACT)
        .ok_or_else(|| args_error(&format_args!("now + length is past 2^53 us")))?;
    let at_ms = if injected {
        // Under an injected clock, which need not run at the server's pace: relative to
        // the server's, with the TTL floor, and at least 1 ms.
        crate::check::server_now_us() / 1000 + length.div_ceil(1000).max(floor).max(1)
    } else {
        until.div_ceil(1000)
    };
    Ok((until, at_ms))
}
