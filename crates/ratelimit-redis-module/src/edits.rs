//! Edits of a state after its check carried by a batch beside the checks (batch
//! protocol 5, [`packed::Edit`]): a charge given back, debt, a slot released or renewed,
//! each run by the same code as its own command and answered `{4, 0 or 1}` in its turn.

use ratelimit_core::packed::{self, Edit, Header};
use redis_module::{Context, RedisString};

use crate::check::args_error;

/// Whether a batch's packed value is an edit rather than a check: read before the
/// check's own parse, which refuses it.
pub(crate) fn is_edit(packed_value: &[u8]) -> bool {
    packed::value(packed_value, 0).is_some_and(|first| first > 1)
}

/// Runs the edit `packed_value` on the state `state` (and the sliding log `log`, for a
/// settle under rules with one) and appends its reply; an `Err` is the message of its
/// failure entry, with nothing appended. `number` is the edit's own number as a compact
/// batch's `refs` carry it (in place of a check's deadline), which replaces the packed
/// value's: edits of one rule set share a packed value as checks do.
pub(crate) fn edit_one(
    ctx: &Context,
    state: &RedisString,
    log: Option<&RedisString>,
    packed_value: &[u8],
    number: Option<u64>,
    out: &mut Vec<u8>,
) -> Result<(), String> {
    let Some((edit, header, rule_bytes)) =
        packed::parse_edit(packed_value).map_err(|e| args_error(&e))?
    else {
        return Err(args_error(&"a batch's edit is not an edit"));
    };
    let edit = match number {
        Some(number) => edit.with_value(number),
        None => edit,
    };
    let changed = run(ctx, state, log, edit, &header, rule_bytes)?;
    packed::encode_edit(out, changed == 1);
    Ok(())
}

fn run(
    ctx: &Context,
    state: &RedisString,
    log: Option<&RedisString>,
    edit: Edit,
    header: &Header,
    rule_bytes: &[u8],
) -> Result<i64, String> {
    match edit {
        Edit::GiveBack { charged_at } => {
            crate::refund::give_back_parsed(ctx, state, log, header, rule_bytes, charged_at)
        }
        Edit::Debit => crate::refund::debit_parsed(ctx, state, log, header, rule_bytes),
        Edit::Release { slot } => {
            let now = header.now.unwrap_or_else(crate::check::server_now_us);
            crate::slots::release_at(ctx, state, slot, now)
        }
        Edit::Renew { slot, timeout_us } => crate::slots::renew_at(
            ctx,
            state,
            slot,
            timeout_us,
            header.now,
            header.ttl_floor_ms,
        ),
        // `Edit` is exhaustive here; a later edit is refused by `parse_edit`.
    }
}
