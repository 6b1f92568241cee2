//! The module's commands: their arguments divided into checks, each check run with its
//! panics caught, the replies joined as the Lua functions join them.

use std::panic::{catch_unwind, AssertUnwindSafe};

use ratelimit_core::packed;
use redis_module::{Context, RedisError, RedisResult, RedisString, RedisValue};
use smallvec::SmallVec;

use crate::check::{check_one, server_now_us, Keys};
use crate::keyspace::{served, StableSlots};

/// Runs `f`, a panic in it turned into an error message: a bug in one check must not
/// take the server down.
fn guarded(f: impl FnOnce() -> Result<(), String>) -> Result<(), String> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        // An error reply is one line.
        let what = what.replace(['\r', '\n'], " ");
        Err(format!(
            "RLPANIC the rate-limit module failed on this check: {what}"
        ))
    })
}

fn arity(what: &str) -> RedisError {
    RedisError::String(format!(
        "RLARGS {what}; the store and the module are from different versions"
    ))
}

/// `RATELIMIT.CHECK block state [log] packed`: one check, its reply or its error.
#[allow(clippy::needless_pass_by_value)] // the signature `redis_module!` calls
pub(crate) fn check(ctx: &Context, args: Vec<RedisString>) -> RedisResult {
    let keys = match &args[..] {
        [_, block, state, _] => Keys {
            block,
            state,
            log: None,
        },
        [_, block, state, log, _] => Keys {
            block,
            state,
            log: Some(log),
        },
        _ => {
            return Err(arity(&format!(
                "ratelimit.check takes 2 or 3 keys and the packed values, got {} arguments",
                args.len().saturating_sub(1)
            )))
        }
    };
    let packed_check = args[args.len() - 1].as_slice();
    let mut out = Vec::with_capacity(16 + 32 * 4);
    guarded(|| check_one(ctx, &keys, packed_check, server_now_us(), &mut out))
        .map_err(RedisError::String)?;
    Ok(RedisValue::StringBuffer(out))
}

/// One check of a batch: its reply, or its failure entry.
fn batch_entry(ctx: &Context, keys: &Keys<'_>, packed_check: &[u8], now: u64, out: &mut Vec<u8>) {
    let start = out.len();
    if let Err(message) = guarded(|| check_one(ctx, keys, packed_check, now, out)) {
        out.truncate(start);
        packed::encode_failure(out, message.as_bytes());
    }
}

/// The number of keys of each check in a batch's `counts` (one character per check:
/// `'2'` or `'3'`, or in `check_many` `'4'`/`'5'` for 2/3 keys shared with an earlier
/// check, which here changes nothing: every check reads its keys itself).
fn key_counts(counts: &[u8], shared_allowed: bool) -> Result<Vec<usize>, RedisError> {
    counts
        .iter()
        .map(|&c| match c {
            b'2' | b'3' => Ok(usize::from(c - b'0')),
            b'4' | b'5' if shared_allowed => Ok(usize::from(c - b'2')),
            _ => Err(arity(&format!(
                "a batch takes key counts {}, got {:?}",
                if shared_allowed { "2 to 5" } else { "2 or 3" },
                char::from(c)
            ))),
        })
        .collect()
}

/// `RATELIMIT.CHECK_MANY numkeys key.. counts packed..`: the checks in order, their
/// replies one after the other.
#[allow(clippy::needless_pass_by_value)] // the signature `redis_module!` calls
pub(crate) fn check_many(ctx: &Context, args: Vec<RedisString>) -> RedisResult {
    let numkeys = args
        .get(1)
        .and_then(|n| n.try_as_str().ok()?.parse::<usize>().ok())
        .ok_or_else(|| arity("ratelimit.check_many takes numkeys first"))?;
    let keys = args
        .get(2..2 + numkeys)
        .ok_or_else(|| arity("ratelimit.check_many has fewer keys than numkeys"))?;
    let rest = &args[2 + numkeys..];
    let Some((counts, packs)) = rest.split_first() else {
        return Err(arity(
            "ratelimit.check_many takes the key counts after the keys",
        ));
    };
    let counts = key_counts(counts.as_slice(), true)?;
    if packs.len() != counts.len() || counts.iter().sum::<usize>() != numkeys {
        return Err(arity(&format!(
            "ratelimit.check_many counts {} checks of {} keys, got {} packed values and {numkeys} keys",
            counts.len(),
            counts.iter().sum::<usize>(),
            packs.len()
        )));
    }
    let now = server_now_us();
    let mut out = Vec::with_capacity(packs.len() * 48);
    let mut k = 0;
    for (m, packed_check) in counts.iter().zip(packs) {
        let these = &keys[k..k + m];
        k += m;
        let keys = Keys::of(these);
        batch_entry(ctx, &keys, packed_check.as_slice(), now, &mut out);
    }
    Ok(RedisValue::StringBuffer(out))
}

/// `RATELIMIT.CHECK_LOCAL 0 counts packed.. key..`: the checks in order on one Cluster
/// node; a check whose keys the node does not serve is answered `RLMOVED`, untouched.
#[allow(clippy::needless_pass_by_value)] // the signature `redis_module!` calls
pub(crate) fn check_local(ctx: &Context, args: Vec<RedisString>) -> RedisResult {
    let Some(counts) = args.get(2) else {
        return Err(arity(
            "ratelimit.check_local takes 0 and the key counts first",
        ));
    };
    let counts = key_counts(counts.as_slice(), false)?;
    let n = counts.len();
    let total: usize = counts.iter().sum();
    if args.len() != 3 + n + total {
        return Err(arity(&format!(
            "ratelimit.check_local expects {} arguments, got {}",
            2 + n + total,
            args.len() - 1
        )));
    }
    let packs = &args[3..3 + n];
    let keys = &args[3 + n..];
    let now = server_now_us();
    let mut out = Vec::with_capacity(n * 48);
    let mut stable = StableSlots::new();
    let mut k = 0;
    for (m, packed_check) in counts.iter().zip(packs) {
        let these = &keys[k..k + m];
        k += m;
        // A command through the command table checks the keys' slot against the ones
        // this node serves (a moved or migrating slot fails it), before anything is read.
        let names: SmallVec<[&RedisString; 3]> = these.iter().collect();
        if let Err(why) = served(ctx, &names, &mut stable) {
            packed::encode_failure(&mut out, format!("RLMOVED {why}").as_bytes());
            continue;
        }
        let keys = Keys::of(these);
        batch_entry(ctx, &keys, packed_check.as_slice(), now, &mut out);
    }
    Ok(RedisValue::StringBuffer(out))
}

/// A command on one key that answers an integer, its panics caught.
fn integer_command(
    args: &[RedisString],
    f: impl FnOnce(&[RedisString]) -> Result<i64, String>,
) -> RedisResult {
    let mut reply = 0;
    guarded(|| {
        reply = f(&args[1..])?;
        Ok(())
    })
    .map_err(RedisError::String)?;
    Ok(RedisValue::Integer(reply))
}

/// `RATELIMIT.REFUND state now units start granted (id code limit period window)..`:
/// a lease's unspent units given back (`check.lua`'s `refund`).
#[allow(clippy::needless_pass_by_value)] // the signature `redis_module!` calls
pub(crate) fn refund(ctx: &Context, args: Vec<RedisString>) -> RedisResult {
    integer_command(&args, |args| crate::refund::lease_refund(ctx, args))
}

/// `RATELIMIT.GIVE_BACK state [log] packed charged_at`: a check's charge given back
/// (`check.lua`'s `give_back`).
#[allow(clippy::needless_pass_by_value)] // the signature `redis_module!` calls
pub(crate) fn give_back(ctx: &Context, args: Vec<RedisString>) -> RedisResult {
    integer_command(&args, |args| crate::refund::give_back(ctx, args))
}

/// `RATELIMIT.BLOCK marker now length ttl_floor`: a client key blocked (`block.lua`).
#[allow(clippy::needless_pass_by_value)] // the signature `redis_module!` calls
pub(crate) fn block(ctx: &Context, args: Vec<RedisString>) -> RedisResult {
    integer_command(&args, |args| crate::block::block(ctx, args))
}

/// `RATELIMIT.VERSION`: the module's version and its state format.
#[allow(clippy::needless_pass_by_value)] // the signature `redis_module!` calls
pub(crate) fn version(_: &Context, _: Vec<RedisString>) -> RedisResult {
    Ok(RedisValue::Array(vec![
        RedisValue::SimpleString(env!("CARGO_PKG_VERSION").to_owned()),
        RedisValue::Integer(i64::try_from(crate::STATE_FORMAT).unwrap_or(i64::MAX)),
    ]))
}
