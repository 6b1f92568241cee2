//! The module's commands: their arguments divided into checks, each check run with its
//! panics caught, the replies joined as the Lua functions join them.

use std::panic::{catch_unwind, AssertUnwindSafe};

use ratelimit_core::packed::{self, REF_LEN};
use redis_module::{Context, RedisError, RedisResult, RedisString, RedisValue};
use smallvec::SmallVec;

use crate::check::{args_error, check_one, decide_one, read_check, server_now_us, Keys};
use crate::keyspace::{exists_here, hash_tag, replicate_writes, served, StableSlots};
use crate::{edits, once};

/// Runs `f`, a panic in it turned into an error message: a bug in one check must not
/// take the server down. The message is [`ascii`]: it becomes an error reply or a batch
/// entry's message either way.
fn guarded(f: impl FnOnce() -> Result<(), String>) -> Result<(), String> {
    catch_unwind(AssertUnwindSafe(f))
        .unwrap_or_else(|panic| Err(panic_message(&*panic)))
        .map_err(|message| ascii(&message))
}

/// The error of a panic, for the reply.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    let what = panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_default();
    format!("RLPANIC the rate-limit module failed on this check: {what}")
}

/// A command's whole run, its panics caught: no panic may unwind into Redis (an
/// `extern "C"` boundary, where an unwind aborts the server), whatever the arguments.
/// An error reply is [`ascii`].
pub(crate) fn boundary(f: impl FnOnce() -> RedisResult) -> RedisResult {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Err(RedisError::String(message))) => Err(RedisError::String(ascii(&message))),
        Ok(reply) => reply,
        Err(panic) => Err(RedisError::String(ascii(&panic_message(&*panic)))),
    }
}

/// `message` as one line of printable ASCII, at most [`MAX_MESSAGE`] bytes: what every
/// client parses as an error reply. The redis-module crate writes each `char` of an
/// error as one byte (a "µ" would arrive as a lone 0xB5, which clients refuse as
/// UTF-8), and a message may quote a client's bytes; so "µs" becomes "us", line breaks
/// become spaces, and any other character outside printable ASCII is escaped (`\x..`,
/// `\u{..}`).
pub(crate) fn ascii(message: &str) -> String {
    let mut out = String::with_capacity(message.len().min(MAX_MESSAGE));
    for c in message.chars() {
        if out.len() >= MAX_MESSAGE {
            out.push_str("...");
            break;
        }
        match c {
            ' '..='~' => out.push(c),
            '\u{b5}' | '\u{3bc}' => out.push('u'),
            '\r' | '\n' | '\t' => out.push(' '),
            c if (c as u32) < 0x100 => out.push_str(&format!("\\x{:02x}", c as u32)),
            c => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
        }
    }
    out
}

/// The longest error message the module answers, in bytes: a message quoting a
/// client's argument is cut.
const MAX_MESSAGE: usize = 512;

fn arity(what: &str) -> RedisError {
    RedisError::String(ascii(&format!(
        "RLARGS {what}; the store and the module are from different versions"
    )))
}

/// `RATELIMIT.CHECK block state [log] packed`: one check, its reply or its error.
#[allow(clippy::needless_pass_by_value)] // the signature `redis_module!` calls
fn check_unguarded(ctx: &Context, args: Vec<RedisString>) -> RedisResult {
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
    guarded(|| entry_one(ctx, &keys, packed_check, server_now_us(), &mut out))
        .map_err(RedisError::String)?;
    Ok(RedisValue::StringBuffer(out))
}

/// One entry of a batch or a single check's command, on its keys: a check, or from
/// batch protocol 5 an edit of a state after its check ([`edits`]); its reply appended
/// to `out`, or the message of its failure.
fn entry_one(
    ctx: &Context,
    keys: &Keys<'_>,
    packed_value: &[u8],
    now: u64,
    out: &mut Vec<u8>,
) -> Result<(), String> {
    if crate::protocol() >= 5 && edits::is_edit(packed_value) {
        return edits::edit_one(
            ctx,
            Some(keys.block),
            keys.state,
            keys.log,
            &edits::read_edit(packed_value)?,
            None,
            now,
            out,
        );
    }
    check_one(ctx, keys, packed_value, now, out)
}

/// One check of a batch: its reply, or its failure entry.
fn batch_entry(ctx: &Context, keys: &Keys<'_>, packed_check: &[u8], now: u64, out: &mut Vec<u8>) {
    let start = out.len();
    if let Err(message) = guarded(|| entry_one(ctx, keys, packed_check, now, out)) {
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
fn check_many_unguarded(ctx: &Context, args: Vec<RedisString>) -> RedisResult {
    let numkeys = args
        .get(1)
        .and_then(|n| n.try_as_str().ok()?.parse::<usize>().ok())
        // More keys than arguments is refused below; this keeps `2 + numkeys` in range.
        .map(|n| n.min(args.len()))
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
fn check_local_unguarded(ctx: &Context, args: Vec<RedisString>) -> RedisResult {
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

/// One check's entry in a compact batch's `refs`.
#[derive(Clone, Copy)]
struct Ref {
    /// The index of its packed value.
    pack: usize,
    deadline: Option<u64>,
}

/// The entries of a compact batch's `refs` for `checks` checks of `packs` packed
/// values: an error for the whole call, before anything is read, when their length
/// is not [`REF_LEN`] per check or one refers past the packed values.
fn refs_of(
    command: &str,
    refs: &[u8],
    checks: usize,
    packs: usize,
) -> Result<Vec<Ref>, RedisError> {
    if refs.len() != checks * REF_LEN {
        return Err(arity(&format!(
            "{command} takes {REF_LEN} bytes of refs per check: {checks} checks, got {} bytes",
            refs.len()
        )));
    }
    refs.chunks_exact(REF_LEN)
        .enumerate()
        .map(|(i, entry)| {
            let Some((pack, deadline)) = packed::read_ref(entry) else {
                return Err(arity(&format!("{command}: check {i}'s refs are cut short")));
            };
            if pack >= packs {
                return Err(arity(&format!(
                    "{command}: check {i} refers to packed value {pack}, of {packs}"
                )));
            }
            Ok(Ref { pack, deadline })
        })
        .collect()
}

/// Whether a state key's name is `..{tag}:s`: it ends in `}:s` and has a hash tag (a
/// `{` followed by something and a `}`), so that its block marker's and log's names,
/// the same but for the last byte, hash to its Cluster slot.
fn is_state_name(name: &[u8]) -> bool {
    // The suffix holds no `{`, so a tag found is one that ends at or before its `}`.
    name.ends_with(b"}:s") && hash_tag(name).is_some()
}

/// The name of a check's other key: its state's name with the last byte `kind` (`b`
/// the block marker, `l` the sliding log), written through `scratch`.
fn sibling(state: &[u8], kind: u8, scratch: &mut Vec<u8>) -> RedisString {
    scratch.clear();
    scratch.extend_from_slice(state);
    if let Some(last) = scratch.last_mut() {
        *last = kind;
    }
    RedisString::create_from_slice(std::ptr::null_mut(), scratch)
}

/// The checks of a compact batch: each state name with its `refs` entry, decided in
/// order on the packed values `packs` (each read once per call), each check's slot
/// asked about first when `stable` is given (a Cluster node's batch).
fn compact_checks(
    ctx: &Context,
    states: &[RedisString],
    refs: &[Ref],
    packs: &[RedisString],
    mut stable: Option<&mut StableSlots>,
) -> Vec<u8> {
    let now = server_now_us();
    let mut out = Vec::with_capacity(states.len() * 48);
    let mut reads: SmallVec<[Option<Result<_, String>>; 4]> =
        std::iter::repeat_with(|| None).take(packs.len()).collect();
    let mut edit_reads: SmallVec<[Option<Result<_, String>>; 4]> =
        std::iter::repeat_with(|| None).take(packs.len()).collect();
    let mut scratch = Vec::new();
    let edits = crate::protocol() >= 5;
    for (state, r) in states.iter().zip(refs) {
        let start = out.len();
        let pack = packs[r.pack].as_slice();
        if edits && edits::is_edit(pack) {
            let read = edit_reads[r.pack].get_or_insert_with(|| edits::read_edit(pack));
            let edited = guarded(|| {
                let name = state.as_slice();
                if !is_state_name(name) {
                    return Err(args_error(&format_args!(
                        "a state key's name ends in `}}:s` after a hash tag, got {:?}",
                        String::from_utf8_lossy(&name[name.len().saturating_sub(64)..])
                    )));
                }
                // A settle under rules with a sliding log edits the log too.
                let log = packed::value(pack, 6)
                    .is_some_and(|limit| limit > 0)
                    .then(|| sibling(name, b'l', &mut scratch));
                let block = edits::is_block(pack).then(|| sibling(name, b'b', &mut scratch));
                if let Some(stable) = stable.as_deref_mut() {
                    // An edit touches its state alone (and the log, for a settle under
                    // a sliding log): a state this node holds is one Redis itself would
                    // let a command of the key edit here, migrating slot or not. A block
                    // writes its marker, which may have left with a migrating slot.
                    if block.is_some() || log.is_some() || !exists_here(ctx, state) {
                        let marker = sibling(name, b'b', &mut scratch);
                        served(ctx, &[&marker], stable).map_err(|why| format!("RLMOVED {why}"))?;
                    }
                }
                let number = r.deadline.unwrap_or(0);
                let read = read.as_ref().map_err(Clone::clone)?;
                edits::edit_one(
                    ctx,
                    block.as_ref(),
                    state,
                    log.as_ref(),
                    read,
                    Some(number),
                    now,
                    &mut out,
                )
            });
            if let Err(message) = edited {
                out.truncate(start);
                packed::encode_failure(&mut out, message.as_bytes());
            }
            continue;
        }
        let read = reads[r.pack].get_or_insert_with(|| read_check(pack));
        let decided = guarded(|| {
            let (header, rules) = read.as_ref().map_err(Clone::clone)?;
            let name = state.as_slice();
            if !is_state_name(name) {
                return Err(args_error(&format_args!(
                    "a state key's name ends in `}}:s` after a hash tag, got {:?}",
                    String::from_utf8_lossy(&name[name.len().saturating_sub(64)..])
                )));
            }
            let block = sibling(name, b'b', &mut scratch);
            let log = (header.log_limit > 0).then(|| sibling(name, b'l', &mut scratch));
            if let Some(stable) = stable.as_deref_mut() {
                // The block marker alone, asked about first as in `check_local`: the
                // state's hash tag, checked above, puts the check's keys in its slot.
                served(ctx, &[&block], stable).map_err(|why| format!("RLMOVED {why}"))?;
            }
            let mut header = *header;
            header.deadline = r.deadline;
            let keys = Keys {
                block: &block,
                state,
                log: log.as_ref(),
            };
            decide_one(ctx, &keys, &header, rules, now, &mut out)
        });
        if let Err(message) = decided {
            out.truncate(start);
            packed::encode_failure(&mut out, message.as_bytes());
        }
    }
    out
}

/// `RATELIMIT.CHECK_STATES numkeys state.. refs packed..`: `CHECK_MANY`'s checks in
/// compact form, one argument per check (its state key; the block marker's and the
/// log's names follow from it) and the distinct packed values once, each check's
/// referred to by `refs` (see [`REF_LEN`]).
#[allow(clippy::needless_pass_by_value)] // the signature `redis_module!` calls
fn check_states_unguarded(ctx: &Context, args: Vec<RedisString>) -> RedisResult {
    const NAME: &str = "ratelimit.check_states";
    let numkeys = args
        .get(1)
        .and_then(|n| n.try_as_str().ok()?.parse::<usize>().ok())
        // More keys than arguments is refused below; this keeps `2 + numkeys` in range.
        .map(|n| n.min(args.len()))
        .ok_or_else(|| arity(&format!("{NAME} takes numkeys first")))?;
    let states = args
        .get(2..2 + numkeys)
        .ok_or_else(|| arity(&format!("{NAME} has fewer keys than numkeys")))?;
    let Some((refs, packs)) = args[2 + numkeys..].split_first() else {
        return Err(arity(&format!("{NAME} takes the refs after the keys")));
    };
    let (refs, id) = split_id(NAME, refs.as_slice())?;
    let refs = refs_of(NAME, refs, numkeys, packs.len())?;
    once(id, || compact_checks(ctx, states, &refs, packs, None))
}

/// `RATELIMIT.CHECK_STATE state refs packed`: one check in the compact form of
/// [`check_states`] (batch protocol 2), its state key first so that a Cluster client
/// routes it by the key and the server checks the key's slot.
#[allow(clippy::needless_pass_by_value)] // the signature `redis_module!` calls
fn check_state_unguarded(ctx: &Context, args: Vec<RedisString>) -> RedisResult {
    const NAME: &str = "ratelimit.check_state";
    let [_, state, refs, pack] = &args[..] else {
        return Err(arity(&format!(
            "{NAME} takes a state key, the refs and a packed check, got {} arguments",
            args.len().saturating_sub(1)
        )));
    };
    let (refs, id) = split_id(NAME, refs.as_slice())?;
    let refs = refs_of(NAME, refs, 1, 1)?;
    once(id, || {
        compact_checks(
            ctx,
            std::slice::from_ref(state),
            &refs,
            std::slice::from_ref(pack),
            None,
        )
    })
}

/// A call's id, and whether it is sent again.
type CallId = ([u8; 16], bool);

/// `refs` as a compact call sends it, and the call's id when it carries one (batch
/// protocol 2: [`once::ID_LEN`] bytes after the checks' entries).
fn split_id<'r>(command: &str, refs: &'r [u8]) -> Result<(&'r [u8], Option<CallId>), RedisError> {
    if crate::protocol() < 2 || refs.len() % REF_LEN != once::ID_LEN % REF_LEN {
        return Ok((refs, None));
    }
    let Some((refs, id)) = refs
        .len()
        .checked_sub(once::ID_LEN)
        .and_then(|at| refs.split_at_checked(at))
    else {
        return Err(arity(&format!("{command}: the refs are cut short")));
    };
    match once::parse_id(id) {
        Some(id) => Ok((refs, Some(id))),
        None => Err(arity(&format!("{command}: the call's id ends in 0 or 1"))),
    }
}

/// The reply of a call with the id `id` (none: the call runs as any): the reply of its
/// run when it ran already (it was sent again after its connection broke), else the
/// reply of `run`, recorded.
fn once(id: Option<CallId>, run: impl FnOnce() -> Vec<u8>) -> RedisResult {
    let Some((id, resent)) = id else {
        return Ok(RedisValue::StringBuffer(run()));
    };
    let now = server_now_us();
    match once::seen(&id, resent, now) {
        once::Seen::Ran(reply) => Ok(RedisValue::StringBuffer(reply.to_vec())),
        once::Seen::Unknown => Err(RedisError::Str(
            "RLUNKNOWN the call was sent again and its first run is no longer known (the \
             module's record of recent replies is full); nothing ran now",
        )),
        once::Seen::New => {
            let reply = run();
            once::record(id, &reply, now);
            Ok(RedisValue::StringBuffer(reply))
        }
    }
}

/// `RATELIMIT.CHECK_LOCAL_STATES 0 refs packed.. state..`: `CHECK_LOCAL`'s checks in
/// the compact form of [`check_states`], on one Cluster node; a check whose slot the
/// node does not serve is answered `RLMOVED`, untouched. The number of checks is the
/// length of `refs` over [`REF_LEN`]; the state keys are the last arguments.
#[allow(clippy::needless_pass_by_value)] // the signature `redis_module!` calls
fn check_local_states_unguarded(ctx: &Context, args: Vec<RedisString>) -> RedisResult {
    const NAME: &str = "ratelimit.check_local_states";
    let Some(refs) = args.get(2) else {
        return Err(arity(&format!("{NAME} takes 0 and the refs first")));
    };
    let (refs, id) = split_id(NAME, refs.as_slice())?;
    let checks = refs.len() / REF_LEN;
    let Some(packs) = args
        .len()
        .checked_sub(checks)
        .and_then(|end| args.get(3..end))
    else {
        return Err(arity(&format!(
            "{NAME} has {checks} checks by its refs but {} arguments",
            args.len() - 1
        )));
    };
    let refs = refs_of(NAME, refs, checks, packs.len())?;
    let states = &args[args.len() - checks..];
    let mut stable = StableSlots::new();
    if let (Some((call, true)), Some(first)) = (id, states.first()) {
        // Sent again, and not known here: a node that does not serve the first check's
        // slot (by which the store routes the call) got it from a client whose slot map
        // is out of date. The first run may have charged on the node that serves it, so
        // nothing is answered as moved (the store would send those checks again as new
        // calls): nothing runs here, and the store sends it again where the slot is.
        let first = first.as_slice();
        let unknown = matches!(once::seen(&call, true, server_now_us()), once::Seen::New);
        if unknown && is_state_name(first) {
            let marker = sibling(first, b'b', &mut Vec::new());
            if served(ctx, &[&marker], &mut stable).is_err() {
                return Err(RedisError::Str(
                    "TRYAGAIN the call was sent again to a node that does not serve its first \
                     check's slot",
                ));
            }
        }
    }
    once(id, || {
        compact_checks(ctx, states, &refs, packs, Some(&mut stable))
    })
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

/// An edit of a state after its check ([`integer_command`]), decided once when it
/// carries a call id as its last argument (protocol 4): [`once::TEXT_ID_LEN`] bytes, 32
/// hex digits and a byte 0 or 1, which none of the edits' own arguments is (times and
/// numbers are decimal text, packed values a multiple of 8 bytes). Its reply is kept as
/// the compact calls' are, as 8 bytes (little-endian); an error reply is not kept
/// (nothing was written).
fn edit_command(
    args: &[RedisString],
    f: impl FnOnce(&[RedisString]) -> Result<i64, String>,
) -> RedisResult {
    let id = match args.split_last() {
        Some((last, _)) if crate::protocol() >= 4 && args.len() > 2 => {
            let bytes = last.as_slice();
            (bytes.len() == once::TEXT_ID_LEN)
                .then(|| once::parse_text_id(bytes))
                .flatten()
        }
        _ => None,
    };
    let Some((id, resent)) = id else {
        return integer_command(args, f);
    };
    let args = &args[..args.len() - 1];
    let now = server_now_us();
    match once::seen(&id, resent, now) {
        once::Seen::Ran(reply) => {
            let bytes: [u8; 8] =
                reply
                    .get(..8)
                    .and_then(|b| b.try_into().ok())
                    .ok_or(RedisError::Str(
                        "RLUNKNOWN the record of the call's first run is not an edit's",
                    ))?;
            Ok(RedisValue::Integer(i64::from_le_bytes(bytes)))
        }
        once::Seen::Unknown => Err(RedisError::Str(
            "RLUNKNOWN the call was sent again and its first run is no longer known (the \
             module's record of recent replies is full); nothing ran now",
        )),
        once::Seen::New => {
            let reply = integer_command(args, f)?;
            if let RedisValue::Integer(n) = reply {
                once::record(id, &n.to_le_bytes(), now);
            }
            Ok(reply)
        }
    }
}

/// `RATELIMIT.REFUND state now units start granted (id code limit period window)..`:
/// a lease's unspent units given back (`check.lua`'s `refund`).
#[allow(clippy::needless_pass_by_value)] // the signature `redis_module!` calls
fn refund_unguarded(ctx: &Context, args: Vec<RedisString>) -> RedisResult {
    edit_command(&args, |args| crate::refund::lease_refund(ctx, args))
}

/// `RATELIMIT.GIVE_BACK state [log] packed charged_at`: a check's charge given back
/// (`check.lua`'s `give_back`).
#[allow(clippy::needless_pass_by_value)] // the signature `redis_module!` calls
fn give_back_unguarded(ctx: &Context, args: Vec<RedisString>) -> RedisResult {
    edit_command(&args, |args| crate::refund::give_back(ctx, args))
}

/// `RATELIMIT.DEBIT state [log] packed`: units charged as debt, a metered request's
/// excess over its estimate (`check.lua`'s `debit`).
#[allow(clippy::needless_pass_by_value)] // the signature `redis_module!` calls
fn debit_unguarded(ctx: &Context, args: Vec<RedisString>) -> RedisResult {
    edit_command(&args, |args| crate::refund::debit(ctx, args))
}

/// `RATELIMIT.RELEASE state now slot`: a concurrency slot freed (`check.lua`'s
/// `release`).
#[allow(clippy::needless_pass_by_value)] // the signature `redis_module!` calls
fn release_unguarded(ctx: &Context, args: Vec<RedisString>) -> RedisResult {
    edit_command(&args, |args| crate::slots::release(ctx, args))
}

/// `RATELIMIT.RENEW state now slot timeout ttl_floor`: a live slot renewed (`check.lua`'s
/// `renew`).
#[allow(clippy::needless_pass_by_value)] // the signature `redis_module!` calls
fn renew_unguarded(ctx: &Context, args: Vec<RedisString>) -> RedisResult {
    edit_command(&args, |args| crate::slots::renew(ctx, args))
}

/// `RATELIMIT.BLOCK marker now length ttl_floor`: a client key blocked (`block.lua`).
#[allow(clippy::needless_pass_by_value)] // the signature `redis_module!` calls
fn block_unguarded(ctx: &Context, args: Vec<RedisString>) -> RedisResult {
    integer_command(&args, |args| crate::block::block(ctx, args))
}

/// `RATELIMIT.VERSION`: the module's version, its state format, and the batch protocol
/// it serves (see [`crate::PROTOCOL`]).
#[allow(clippy::needless_pass_by_value)] // the signature `redis_module!` calls
fn version_unguarded(_: &Context, _: Vec<RedisString>) -> RedisResult {
    let mut reply = vec![
        RedisValue::SimpleString(env!("CARGO_PKG_VERSION").to_owned()),
        RedisValue::Integer(i64::try_from(crate::STATE_FORMAT).unwrap_or(i64::MAX)),
    ];
    // A module of protocol 0 answers as the modules before the compact form: two
    // elements, which stores of every version read.
    let protocol = crate::protocol();
    if protocol > 0 {
        reply.push(RedisValue::Integer(i64::from(protocol)));
    }
    Ok(RedisValue::Array(reply))
}

/// `RATELIMIT.STATS`: what the module keeps in memory across calls: the rule sets
/// cached and the replies of recent calls kept (and their bytes).
fn stats_unguarded(_: &Context, _: Vec<RedisString>) -> RedisResult {
    let rules = crate::check::cached_rule_sets();
    let (replies, bytes) = once::usage();
    let int = |n: usize| RedisValue::Integer(i64::try_from(n).unwrap_or(i64::MAX));
    Ok(RedisValue::Array(vec![
        RedisValue::SimpleStringStatic("rule_sets"),
        int(rules),
        RedisValue::SimpleStringStatic("replies"),
        int(replies),
        RedisValue::SimpleStringStatic("reply_bytes"),
        int(bytes),
    ]))
}

/// The commands as Redis calls them: each the function of the same name with
/// `_unguarded`, run inside [`boundary`], its state writes replicated when it ends
/// (whatever its reply: what it wrote stays written).
macro_rules! at_the_boundary {
    ($($name:ident => $inner:ident),* $(,)?) => {$(
        #[allow(clippy::needless_pass_by_value)] // the signature `redis_module!` calls
        pub(crate) fn $name(ctx: &Context, args: Vec<RedisString>) -> RedisResult {
            let reply = boundary(|| $inner(ctx, args));
            replicate_writes(ctx);
            reply
        }
    )*};
}

at_the_boundary! {
    check => check_unguarded,
    check_many => check_many_unguarded,
    check_local => check_local_unguarded,
    check_states => check_states_unguarded,
    check_local_states => check_local_states_unguarded,
    refund => refund_unguarded,
    give_back => give_back_unguarded,
    debit => debit_unguarded,
    block => block_unguarded,
    release => release_unguarded,
    renew => renew_unguarded,
    version => version_unguarded,
    check_state => check_state_unguarded,
    stats => stats_unguarded,
}
