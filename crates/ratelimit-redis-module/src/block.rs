//! `RATELIMIT.BLOCK`: a client key's block marker written, as `block.lua` writes it.

use redis_module::{Context, KeyType, RedisString};

use crate::check::args_error;
use crate::keyspace::{Expiry, StateKey};
use crate::refund::{now_arg, number};

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
    let mut key = StateKey::open(ctx, name);
    let kind = key.key_type();
    if !matches!(kind, KeyType::Empty | KeyType::String) {
        return Err(format!(
            "WRONGTYPE the block marker holds a {}",
            format!("{kind:?}").to_lowercase()
        ));
    }
    if length.as_slice().is_empty() {
        // A block without end has no expiry (as `SET` leaves it).
        key.write(name, b"inf", Expiry::Never)?;
        return Ok(-1);
    }
    let injected = !now.as_slice().is_empty();
    let now = now_arg(now)?;
    let length = number(length, "the block's length")?;
    let until = now.saturating_add(length);
    let at_ms = if injected {
        // Under an injected clock, which need not run at the server's pace: relative to
        // the server's, with the TTL floor, and at least 1 ms.
        let floor = number(floor, "the TTL floor")?;
        crate::check::server_now_us() / 1000 + length.div_ceil(1000).max(floor).max(1)
    } else {
        until.div_ceil(1000)
    };
    key.write(name, until.to_string().as_bytes(), Expiry::At(at_ms))?;
    i64::try_from(until).map_err(|_| args_error(&"the block's end is past 2^63 µs"))
}
