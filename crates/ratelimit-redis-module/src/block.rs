//! `RATELIMIT.BLOCK`: a client key's block marker written, as `block.lua` writes it.

use std::time::Duration;

use redis_module::{Context, KeyType, RedisString};

use crate::check::{args_error, write_string as write};
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
    let key = ctx.open_key_writable(name);
    let kind = key.key_type();
    if !matches!(kind, KeyType::Empty | KeyType::String) {
        return Err(format!(
            "WRONGTYPE the block marker holds a {}",
            format!("{kind:?}").to_lowercase()
        ));
    }
    if length.as_slice().is_empty() {
        write(&key, b"inf")?;
        // A block without end has no expiry (as `SET` leaves it).
        let _ = key.remove_expire();
        ctx.replicate("SET", &[name.as_slice(), b"inf"][..]);
        return Ok(-1);
    }
    let injected = !now.as_slice().is_empty();
    let now = now_arg(now)?;
    let length = number(length, "the block's length")?;
    let until = now.saturating_add(length);
    let stamp = until.to_string();
    write(&key, stamp.as_bytes())?;
    let server_ms = crate::check::server_now_us() / 1000;
    let at_ms = if injected {
        // Under an injected clock, which need not run at the server's pace: relative,
        // with the TTL floor, and at least 1 ms.
        let floor = number(floor, "the TTL floor")?;
        server_ms + length.div_ceil(1000).max(floor).max(1)
    } else {
        until.div_ceil(1000)
    };
    key.set_expire(Duration::from_millis(
        at_ms.saturating_sub(server_ms).max(1),
    ))
    .map_err(|e| e.to_string())?;
    ctx.replicate(
        "SET",
        &[
            name.as_slice(),
            stamp.as_bytes(),
            b"PXAT",
            at_ms.to_string().as_bytes(),
        ][..],
    );
    i64::try_from(until).map_err(|_| args_error(&"the block's end is past 2^63 µs"))
}
