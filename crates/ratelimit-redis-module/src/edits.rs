//! Edits of a state after its check carried by a batch beside the checks (batch
//! protocol 5, [`packed::Edit`]): a charge given back, debt, a slot released or renewed,
//! a lease's unspent units given back, a block, each run by the same code as its own
//! command and answered `{4, 0 or 1}` in its turn; and a slot taken whatever the limit
//! (a fallback's admission handed over), which has no command of its own and is answered
//! `{4, slot}`.

use std::rc::Rc;

use ratelimit_core::packed::{self, Edit, Header, PackedRules};
use redis_module::{Context, RedisString};

use crate::check::{args_error, rules_of};
use crate::refund::Leased;

/// Whether a batch's packed value is an edit rather than a check: read before the
/// check's own parse, which refuses it.
pub(crate) fn is_edit(packed_value: &[u8]) -> bool {
    packed::value(packed_value, 0).is_some_and(|first| first > 1)
}

/// Whether a batch's packed value is a block (which edits the block marker, not the
/// state).
pub(crate) fn is_block(packed_value: &[u8]) -> bool {
    packed::value(packed_value, 0).is_some_and(|first| first / 2 == 6)
}

/// An edit's packed value as read: the edit, its header, its rules' bytes, and the rules
/// themselves for an edit that charges or gives back under them (a give-back, debt, a
/// take). Read once per distinct packed value of a compact batch, where the edits of
/// one rule set share it as checks do.
pub(crate) struct ReadEdit<'a> {
    edit: Edit,
    header: Header,
    rule_bytes: &'a [u8],
    rules: Option<Rc<PackedRules>>,
}

/// Reads the edit `packed_value`; an `Err` is the message of its failure entry.
pub(crate) fn read_edit(packed_value: &[u8]) -> Result<ReadEdit<'_>, String> {
    let Some((edit, header, rule_bytes)) =
        packed::parse_edit(packed_value).map_err(|e| args_error(&e))?
    else {
        return Err(args_error(&"a batch's edit is not an edit"));
    };
    let rules = match edit {
        Edit::GiveBack { .. } | Edit::Debit | Edit::Take => Some(rules_of(rule_bytes, &header)?),
        _ => None,
    };
    Ok(ReadEdit {
        edit,
        header,
        rule_bytes,
        rules,
    })
}

/// Runs the edit `read` on the state `state` (and the sliding log `log`, for a settle
/// under rules with one; the block marker `block`, for a block) and appends its reply;
/// an `Err` is the message of its failure entry, with nothing appended. `number` is the
/// edit's own number as a compact batch's `refs` carry it (in place of a check's
/// deadline), which replaces the packed value's: edits of one rule set share a packed
/// value as checks do. `server_now` is the server's time as the call read it for all its
/// entries, the edit's own time unless its header injects one.
#[allow(clippy::too_many_arguments)]
pub(crate) fn edit_one(
    ctx: &Context,
    block: Option<&RedisString>,
    state: &RedisString,
    log: Option<&RedisString>,
    read: &ReadEdit<'_>,
    number: Option<u64>,
    server_now: u64,
    out: &mut Vec<u8>,
) -> Result<(), String> {
    let edit = match number {
        Some(number) => read.edit.with_value(number),
        None => read.edit,
    };
    let answer = run(ctx, block, state, log, edit, read, server_now)?;
    if edit == Edit::Take {
        packed::encode_edit_value(out, u64::try_from(answer).unwrap_or(0));
    } else {
        packed::encode_edit(out, answer == 1);
    }
    Ok(())
}

fn run(
    ctx: &Context,
    block: Option<&RedisString>,
    state: &RedisString,
    log: Option<&RedisString>,
    edit: Edit,
    read: &ReadEdit<'_>,
    server_now: u64,
) -> Result<i64, String> {
    let (header, rule_bytes) = (&read.header, read.rule_bytes);
    let now = || header.now.unwrap_or(server_now);
    let rules = || {
        read.rules
            .as_deref()
            .ok_or_else(|| args_error(&"an edit under rules without its rules"))
    };
    match edit {
        Edit::GiveBack { charged_at } => {
            crate::refund::give_back_parsed(ctx, state, log, header, rules()?, charged_at, now())
        }
        Edit::Debit => crate::refund::debit_parsed(ctx, state, log, header, rules()?, now()),
        Edit::Take => crate::refund::take_parsed(ctx, state, log, header, rules()?, now()),
        Edit::Release { slot } => crate::slots::release_at(ctx, state, slot, now()),
        Edit::Renew { slot, timeout_us } => crate::slots::renew_at(
            ctx,
            state,
            slot,
            timeout_us,
            header.now,
            header.ttl_floor_ms,
        ),
        Edit::Refund { start_us, granted } => {
            let rules = leased(rule_bytes, header.rules, start_us)?;
            if header.cost < 1 || granted < header.cost {
                return Err(args_error(&format_args!(
                    "a lease's refund gives back {} of {granted} units",
                    header.cost
                )));
            }
            crate::refund::lease_refund_at(
                ctx,
                state,
                now(),
                header.cost,
                start_us,
                granted,
                &rules,
            )
        }
        Edit::Block { length_us } => {
            let block = block.ok_or_else(|| args_error(&"a block without its marker's key"))?;
            let (now, injected) = (now(), header.now.is_some());
            crate::block::block_at(ctx, block, now, injected, length_us, header.ttl_floor_ms)?;
            Ok(1)
        } // `Edit` is exhaustive here; a later edit is refused by `parse_edit`.
    }
}

/// A lease refund's rules as its command takes them, from the packed rules
/// `rule_bytes` (`n` of them): identity, algorithm code, limit, period, and for a fixed
/// window the index of the window of the reservation's time `start`.
fn leased(rule_bytes: &[u8], n: usize, start: u64) -> Result<Vec<Leased>, String> {
    (0..n)
        .map(|i| {
            let at = packed::PER_RULE * i;
            let v = |k: usize| {
                packed::value(rule_bytes, at + k)
                    .ok_or_else(|| args_error(&format_args!("a lease's rule {i} is cut short")))
            };
            let (code, limit, period, id) = (v(0)?, v(1)?, v(2)?, v(5)?);
            if limit == 0 || period == 0 {
                return Err(args_error(&format_args!(
                    "a lease's rule {i} has a limit or period of 0"
                )));
            }
            Ok(Leased {
                id,
                code,
                limit,
                period,
                window: if code == 1 { start / period } else { 0 },
            })
        })
        .collect()
}
