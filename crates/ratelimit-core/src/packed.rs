//! The packed encoding of a check, of a key's rule states and of a decision, as the Redis
//! store keeps and sends them: the layout its Lua functions (`check.lua`) read and write,
//! and the one its native module reads and writes with this crate's own [`algo`] code,
//! so that both serve the same keys.
//!
//! Every value is a little-endian double holding an integer below 2^53 (exact in Lua).
//!
//! * A **check** packs [`HEADER`] values (injected, now, cost, TTL floor in ms, rules,
//!   state width, log limit, log period, layout, deadline; see [`Header`]), then
//!   [`PER_RULE`] per rule: code, limit, period in µs, `a`, `b`, identity
//!   ([`rule_values`]).
//! * A key's **state** is the layout (the writing rule set's fingerprint, [`layout`]),
//!   then one entry `{id, m, m values}` per rule but the sliding logs, in rule order:
//!   fixed window `(index, count)`; sliding window counter `(index, c0 .. cp)`; token
//!   bucket `(limit, capacity, level, last)`; GCRA and leaky bucket `(limit, capacity,
//!   tat_us, tat_frac)`, the limit and capacity being the writer's (what a carry needs);
//!   then, when a rule is a sliding log, the log marker `{0, 1, until}`: the shared log
//!   (kept apart, newest first) counts until then. A state of the check's layout is read
//!   in place; one of another layout entry by entry, each rule carried by identity as
//!   [`algo::carry_stored`] says ([`decode_state`]).
//! * A `N concurrent` rule's **slots** follow the state's fixed part (its width) as the
//!   trailer `{SLOTS_MARKER, 2k, deadline, number, ...}` ([`SLOTS_MARKER`]), one pair per
//!   held slot, when it holds any; the rule's own entry is `(next)`, the number the next
//!   slot is given at the earliest. A state is read in place with its trailer, and the
//!   trailer carries with the rule's identity.
//! * A **compact batch**'s `refs` hold [`REF_LEN`] bytes per check: the index of its
//!   packed check among the call's distinct ones, and its deadline, which the packed
//!   checks then leave out ([`write_ref`], [`read_ref`]).
//! * A **reply** is `{1, block left or -1}`, `{3, server time}` (past the caller's
//!   deadline) or `{status, delay, then per rule allowed, remaining, reset, retry}`, the
//!   status 2 when a value the store did not write was found and discarded; a
//!   concurrency rule that gave a slot has its number as its `retry` (an admitting rule
//!   has no retry, and a number is never 0); in a batch,
//!   a failed check is `{-1, n}` and `n` bytes of message.
//!
//! ```
//! use ratelimit_core::packed::{self, Header, PackedRules};
//! use ratelimit_core::RuleSet;
//!
//! let rules: RuleSet = "10/s gcra burst=5".parse().unwrap();
//! let bytes = packed::pack_check(&rules, Some(1_000), 1, 0, None);
//! let (header, rule_bytes) = Header::parse(&bytes).unwrap();
//! let parsed = PackedRules::parse(rule_bytes, &header).unwrap();
//! assert_eq!(header.now, Some(1_000));
//! assert_eq!(parsed.ids(), rules.rule_ids());
//! ```

use std::time::Duration;

use smallvec::SmallVec;

use crate::algo::{self, RuleState};
use crate::decision::Decision;
use crate::rule::{Algorithm, LeakyMode, Rule, RuleSet, MAX_RULES};

/// The version of this encoding. A change of the layout of a check, a state or a reply
/// is a new version; the Redis store uses its module only when the module reports the
/// store's own.
pub const STATE_FORMAT: u64 = 2;
/// The largest value the encoding holds exactly (2^53 - 1).
pub const MAX_EXACT: u64 = crate::rule::MAX_EXACT;
/// Values of a check's header.
pub const HEADER: usize = 10;
/// Values per rule of a check.
pub const PER_RULE: usize = 6;
/// The identity of the state's log marker entry; no rule has it.
pub const LOG_MARKER: u64 = 0;
/// The most values a key's state holds: the widest rule set's ([`MAX_RULES`] sliding
/// window counters of the finest precision, and the log marker). A stored value longer
/// than this is no state of this encoding, whoever wrote it: it reads as fresh, in time
/// that does not depend on its length.
pub const MAX_STATE_VALUES: usize = 1
    + MAX_RULES * (4 + crate::rule::MAX_PRECISION as usize)
    + 3
    + 2
    + 2 * crate::rule::MAX_CONCURRENT as usize;

/// The identity of the slots trailer (see the module docs): no rule's (those are below
/// 2^52) and no layout's.
pub const SLOTS_MARKER: u64 = (1 << 52) + 1;
/// [`MAX_STATE_VALUES`] in bytes.
pub const MAX_STATE_BYTES: usize = 8 * MAX_STATE_VALUES;

/// Bytes after a compact call's `refs` that make it a call decided once (the module's
/// batch protocol 2): a 16-byte id its sender makes unique, then 1 when the call is
/// sent again after its connection broke, else 0. Never a multiple of [`REF_LEN`]: a
/// call's `refs` tell by their length whether they carry one.
pub const CALL_ID_LEN: usize = 17;

/// Bytes per check in a compact batch's `refs`: the index of its packed check among the
/// call's distinct ones (one byte, so at most 256 per call), then its deadline in µs on
/// the server's clock (8 bytes, little-endian, 0 for none).
pub const REF_LEN: usize = 9;

/// Algorithm codes, in the order of the core's algorithm files.
const FIXED_WINDOW: u64 = 1;
const SLIDING_WINDOW: u64 = 2;
const SLIDING_LOG: u64 = 3;
const TOKEN_BUCKET: u64 = 4;
const LEAKY_BUCKET: u64 = 5;
const GCRA: u64 = 6;
const CONCURRENT: u64 = 7;

/// What is wrong with packed values: a message for the error reply.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct PackedError(String);

/// The values of one rule in a check: code, limit, period in µs, `a`, `b` and the rule's
/// identity `id` ([`RuleSet::rule_ids`]). `a` is the sliding window counter's precision
/// (`b` its sub-window in µs), a token bucket's or leaky meter's capacity, a GCRA burst,
/// a leaky shaper's burst (`b` its delay + 1: 0 means a meter).
pub fn rule_values(rule: &Rule, id: u64) -> [u64; PER_RULE] {
    let (l, p) = (rule.limit(), rule.period_us());
    let (code, a, b) = match rule.algorithm() {
        Algorithm::FixedWindow => (FIXED_WINDOW, 0, 0),
        // The core refuses a precision that does not divide the period.
        Algorithm::SlidingWindow { precision } => (SLIDING_WINDOW, precision, p / precision.max(1)),
        Algorithm::SlidingLog => (SLIDING_LOG, 0, 0),
        Algorithm::TokenBucket { capacity } => (TOKEN_BUCKET, capacity, 0),
        Algorithm::LeakyBucket(LeakyMode::Meter { capacity }) => (LEAKY_BUCKET, capacity, 0),
        // `delay + 1` keeps 0 free for "meter"; the core bounds delay far below u64::MAX.
        Algorithm::LeakyBucket(LeakyMode::Shaper { burst, delay }) => {
            (LEAKY_BUCKET, burst, delay.saturating_add(1))
        }
        Algorithm::Gcra { burst } => (GCRA, burst, 0),
        // The period is the slots' timeout.
        Algorithm::Concurrent => (CONCURRENT, 0, 0),
    };
    [code, l, p, a, b, id]
}

/// The values of a rule's entry in the state, its identity and length included.
fn entry_len(rule: &Rule) -> u64 {
    match rule.algorithm() {
        Algorithm::SlidingLog => 0,
        Algorithm::FixedWindow => 2 + 2,
        Algorithm::SlidingWindow { precision } => 2 + precision + 2,
        // The slot numbering; the slots themselves are kept apart, as the log is.
        Algorithm::Concurrent => 2 + 1,
        _ => 2 + 4,
    }
}

/// Values a key's state holds under `rules`: the layout, an entry per rule but the
/// sliding logs, and the log marker (3 values) when a rule is a sliding log.
pub fn state_width(rules: &RuleSet) -> u64 {
    let entries: u64 = rules.rules().iter().map(entry_len).sum();
    let marker = if rules.log_limit() > 0 { 3 } else { 0 };
    1 + entries + marker
}

/// The layout of a rule set's state: its fingerprint, cut to what a double holds.
pub fn layout(rules: &RuleSet) -> u64 {
    rules.fingerprint() & ((1 << 52) - 1)
}

/// The packed values of a check of `rules` for `cost` units, at the injected time `now`
/// (`None`: the server's clock), with the TTL floor `ttl_floor_ms` and the caller's
/// `deadline` in µs on the server's clock.
pub fn check_values(
    rules: &RuleSet,
    now: Option<u64>,
    cost: u64,
    ttl_floor_ms: u64,
    deadline: Option<u64>,
) -> impl Iterator<Item = u64> + '_ {
    let header = [
        u64::from(now.is_some()),
        now.unwrap_or(0),
        cost,
        ttl_floor_ms.min(MAX_EXACT),
        rules.len() as u64,
        state_width(rules),
        rules.log_limit(),
        rules.log_period_us(),
        layout(rules),
        deadline.unwrap_or(0),
    ];
    header.into_iter().chain(
        rules
            .rules()
            .iter()
            .zip(rules.rule_ids())
            .flat_map(|(rule, &id)| rule_values(rule, id)),
    )
}

/// [`check_values`] packed as doubles: the one argument of a check.
pub fn pack_check(
    rules: &RuleSet,
    now: Option<u64>,
    cost: u64,
    ttl_floor_ms: u64,
    deadline: Option<u64>,
) -> Vec<u8> {
    let mut packed = Vec::with_capacity(8 * (HEADER + PER_RULE * rules.len()));
    for value in check_values(rules, now, cost, ttl_floor_ms, deadline) {
        // Exact: rules, costs and times stay below 2^53.
        packed.extend_from_slice(&(value as f64).to_le_bytes());
    }
    packed
}

/// The value at `bytes[8 * i..]` when it is an integer in `[0, 2^53)`: a value of this
/// encoding; `None` for anything else (bytes missing, a fraction, NaN, out of range).
#[inline(always)]
pub fn value(bytes: &[u8], i: usize) -> Option<u64> {
    let chunk: [u8; 8] = bytes.get(8 * i..8 * i + 8)?.try_into().ok()?;
    let x = f64::from_le_bytes(chunk);
    // NaN and the infinities fail the range test. In range, the cast truncates exactly,
    // and a fraction does not survive the round trip: no call to `trunc` (which
    // `fract` makes on targets without SSE4.1), on every value of every state read.
    if !(x >= 0.0 && x <= MAX_EXACT as f64) {
        return None;
    }
    let n = x as u64;
    (n as f64 == x).then_some(n)
}

fn push(out: &mut Vec<u8>, x: u64) {
    out.extend_from_slice(&(x as f64).to_le_bytes());
}

/// A check's header, as [`Header::parse`] reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Header {
    /// The injected time in µs; `None`: the server's clock.
    pub now: Option<u64>,
    /// Units to charge; 0 peeks.
    pub cost: u64,
    /// The least TTL in ms of a key written under an injected clock.
    pub ttl_floor_ms: u64,
    /// Number of rules.
    pub rules: usize,
    /// Values of the state under these rules ([`state_width`]).
    pub width: usize,
    /// Entries the shared sliding log keeps (0: no sliding log).
    pub log_limit: u64,
    /// The longest sliding-log period in µs.
    pub log_period_us: u64,
    /// The fingerprint of the state's layout ([`layout`]).
    pub layout: u64,
    /// The caller's deadline in µs on the server's clock; `None`: none.
    pub deadline: Option<u64>,
}

impl Header {
    /// The header of the packed check `bytes`, and the bytes of its rules; an error that
    /// says what is wrong when `bytes` is not a check of this layout.
    pub fn parse(bytes: &[u8]) -> Result<(Self, &[u8]), PackedError> {
        let v = header_values(bytes)?;
        if v[0] > 1 {
            return Err(PackedError(format!("injected is 0 or 1, got {}", v[0])));
        }
        let header = Self::of_values(v, bytes.len(), 1)?;
        Ok((header, &bytes[8 * HEADER..]))
    }

    /// The header of the values `v` (`v[0]` is 0 or 1) of a packed value of `len` bytes
    /// holding at least `least` rules: an error when the length is not that of its rules.
    fn of_values(v: [u64; HEADER], len: usize, least: usize) -> Result<Self, PackedError> {
        let [injected, now, cost, ttl_floor_ms, n, width, log_limit, log_period_us, layout, deadline] =
            v;
        let n = usize::try_from(n).unwrap_or(usize::MAX);
        if !(least..=MAX_RULES).contains(&n) || len != 8 * (HEADER + PER_RULE * n) {
            return Err(PackedError(format!(
                "a check of {n} rules ({least} to {MAX_RULES}) takes {} values, got {}",
                HEADER.saturating_add(PER_RULE.saturating_mul(n)),
                len / 8
            )));
        }
        Ok(Header {
            now: (injected == 1).then_some(now),
            cost,
            ttl_floor_ms,
            rules: n,
            width: usize::try_from(width).unwrap_or(usize::MAX),
            log_limit,
            log_period_us,
            layout,
            deadline: (deadline > 0).then_some(deadline),
        })
    }
}

/// The [`HEADER`] values at the start of `bytes`, each an integer below 2^53.
fn header_values(bytes: &[u8]) -> Result<[u64; HEADER], PackedError> {
    let len = bytes.len();
    if len < 8 * HEADER || len % 8 != 0 {
        return Err(PackedError(format!(
            "a check takes its values as doubles, got {len} bytes"
        )));
    }
    let mut v = [0u64; HEADER];
    for (i, slot) in v.iter_mut().enumerate() {
        *slot = value(bytes, i).ok_or_else(|| {
            PackedError(format!(
                "value {i} of the header is not an integer below 2^53"
            ))
        })?;
    }
    Ok(v)
}

/// The rules of a packed check, as the rule set they describe and each rule's identity.
/// Building one costs more than a decision: a store that decides many checks of the same
/// rules keeps them by their bytes.
#[derive(Debug, Clone)]
pub struct PackedRules {
    rules: RuleSet,
    ids: SmallVec<[u64; 4]>,
}

impl PackedRules {
    /// The rules in `bytes` (the values after the header), checked against the header:
    /// each a rule the core accepts, with the state width, log limit and log period the
    /// header says.
    pub fn parse(bytes: &[u8], header: &Header) -> Result<Self, PackedError> {
        let mut rules = Vec::with_capacity(header.rules);
        let mut ids = SmallVec::with_capacity(header.rules);
        for r in 0..header.rules {
            let mut v = [0u64; PER_RULE];
            for (j, slot) in v.iter_mut().enumerate() {
                *slot = value(bytes, PER_RULE * r + j).ok_or_else(|| {
                    PackedError(format!(
                        "value {j} of rule {r} is not an integer below 2^53"
                    ))
                })?;
            }
            let [code, limit, period_us, a, b, id] = v;
            let period = Duration::from_micros(period_us);
            let rule = match code {
                FIXED_WINDOW => Rule::fixed_window(limit, period),
                SLIDING_WINDOW => Rule::sliding_window(limit, period, a),
                SLIDING_LOG => Rule::sliding_log(limit, period),
                TOKEN_BUCKET => Rule::token_bucket(limit, period, a),
                LEAKY_BUCKET if b == 0 => Rule::leaky_meter(limit, period, a),
                LEAKY_BUCKET => Rule::leaky_shaper(limit, period, a, b - 1),
                GCRA => Rule::gcra(limit, period, a),
                CONCURRENT => Rule::concurrent(limit, period),
                _ => return Err(PackedError(format!("unknown algorithm code {code}"))),
            }
            .map_err(|e| PackedError(format!("rule {r}: {e}")))?;
            if id == LOG_MARKER {
                return Err(PackedError(format!(
                    "rule {r} has the log marker's identity"
                )));
            }
            rules.push(rule);
            ids.push(id);
        }
        let rules = RuleSet::new(rules).map_err(|e| PackedError(e.to_string()))?;
        let parsed = Self { rules, ids };
        parsed.check_header(header)?;
        Ok(parsed)
    }

    /// Refuses a header whose state width, log limit or log period is not what these
    /// rules fill: every allocation a store makes for a check is sized by those values,
    /// so a store that keeps parsed rules by their bytes (the header apart) checks each
    /// header against them on every use, not only when it parsed them.
    pub fn check_header(&self, header: &Header) -> Result<(), PackedError> {
        let rules = &self.rules;
        let width = state_width(rules);
        if rules.len() != header.rules
            || width != header.width as u64
            || rules.log_limit() != header.log_limit
            || rules.log_period_us() != header.log_period_us
        {
            return Err(PackedError(format!(
                "the {} rules fill {width} values of a state, with a log of {} entries \
                 over {} us; the header says {} rules, {} values, {} entries over {} us",
                rules.len(),
                rules.log_limit(),
                rules.log_period_us(),
                header.rules,
                header.width,
                header.log_limit,
                header.log_period_us
            )));
        }
        Ok(())
    }

    /// The rule set (without names: [`ids`](Self::ids) stand for them).
    pub fn rules(&self) -> &RuleSet {
        &self.rules
    }

    /// Each rule's identity, in rule order.
    pub fn ids(&self) -> &[u64] {
        &self.ids
    }
}

/// A key's rule states as read from its stored state by [`decode_state`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stored {
    /// One state per rule, in rule order; a sliding log's slot is `Fresh` (the log is
    /// kept apart: the store reads it into the first sliding-log rule's slot).
    pub states: SmallVec<[RuleState; 1]>,
    /// Whether the shared sliding log counts: the state was written under this layout,
    /// or its log marker says the log counts still at `now`.
    pub log_counts: bool,
    /// Whether a state was converted to a changed limit at `now` (see
    /// [`algo::Carried::converted`]): a check of cost > 0 that this denies writes the
    /// carried states ([`encode_carried`]).
    pub converted: bool,
}

/// The rule states of `raw`, a key's stored state, for the check's `rules` at `now`:
/// read in place when it was written under the header's layout, else entry by entry,
/// each rule taking the entry of its identity carried by [`algo::carry_stored`] (a rule
/// without one starts `Fresh`). `None` when `raw` is not a state of this encoding: the
/// store reads the key as fresh and replaces it when the check commits.
pub fn decode_state(raw: &[u8], header: &Header, rules: &PackedRules, now: u64) -> Option<Stored> {
    let n = rules.rules.len();
    // As the Lua twin: in place when every value is one this encoding writes and the
    // layout is the check's.
    let fixed = 8 * header.width;
    let trailer = match raw.get(fixed..) {
        Some([]) => Some(None),
        Some(rest) if rules.rules.concurrent().is_some() => read_slots(rest, 0).map(Some),
        _ => None,
    };
    if let Some(trailer) = trailer.filter(|_| {
        value(raw, 0) == Some(header.layout) && (1..header.width).all(|i| value(raw, i).is_some())
    }) {
        let mut states = SmallVec::with_capacity(n);
        let mut off = 1;
        for rule in rules.rules.rules() {
            let (mut state, len) = read_entry(rule, raw, off + 2)?;
            if let (RuleState::Slots(table), Some(held)) = (&mut state, &trailer) {
                table.held.clone_from(held);
            }
            states.push(state);
            off += len;
        }
        return Some(Stored {
            states,
            log_counts: true,
            converted: false,
        });
    }
    if raw.is_empty() || raw.len() % 8 != 0 || raw.len() > MAX_STATE_BYTES {
        return None;
    }
    let len = raw.len() / 8;
    // Where the values of each identity this check reads start (a later entry of one
    // identity wins, as in Lua): the rules' and the log marker's only, so that the
    // walk is linear in the value's length whatever identities it holds.
    let mut at: SmallVec<[(u64, usize); 8]> = rules
        .ids
        .iter()
        .chain([&LOG_MARKER, &SLOTS_MARKER])
        .map(|&id| (id, 0))
        .collect();
    let mut pos = 1;
    while pos < len {
        let id = value(raw, pos)?;
        let m = usize::try_from(value(raw, pos + 1)?).ok()?;
        if m > len - pos - 2 {
            return None;
        }
        // Every value must be one this encoding writes.
        for i in pos + 2..pos + 2 + m {
            value(raw, i)?;
        }
        if let Some(slot) = at.iter_mut().find(|(i, _)| *i == id) {
            slot.1 = pos + 2;
        }
        pos += 2 + m;
    }
    value(raw, 0)?;
    let find = |id: u64| at.iter().find(|&&(i, p)| i == id && p > 0).map(|&(_, p)| p);
    // A carried state's writer finds its log counting while the state says it has one,
    // as in a state of its own layout.
    let writer = value(raw, 0) == Some(CARRIED + header.layout);
    let log_counts = find(LOG_MARKER).is_some_and(|p| {
        value(raw, p - 1) == Some(1) && value(raw, p).is_some_and(|until| until > now || writer)
    });
    let mut states = SmallVec::with_capacity(n);
    let mut converted = false;
    for (rule, &id) in rules.rules.rules().iter().zip(&rules.ids) {
        let state = match find(id) {
            Some(p) if value(raw, p - 1) == Some(entry_len(rule) - 2) => {
                let (state, _) = read_entry(rule, raw, p)?;
                match rule.algorithm() {
                    Algorithm::TokenBucket { .. }
                    | Algorithm::Gcra { .. }
                    | Algorithm::LeakyBucket(_) => {
                        let (limit, capacity) = (value(raw, p)?, value(raw, p + 1)?);
                        let (state, changed) =
                            algo::carry_stored(rule, limit, capacity, &state, now);
                        converted |= changed;
                        state
                    }
                    Algorithm::Concurrent => {
                        let mut state = state;
                        if let (RuleState::Slots(table), Some(p)) = (&mut state, find(SLOTS_MARKER))
                        {
                            table.held = read_slots(raw, 8 * (p - 2))?;
                        }
                        state
                    }
                    _ => state,
                }
            }
            _ => RuleState::Fresh,
        };
        states.push(state);
    }
    Some(Stored {
        states,
        log_counts,
        converted,
    })
}

/// The slots of the trailer at byte `at` of `raw` (see the module docs): `(deadline,
/// number)` pairs; `None` when it is not one (the whole of `raw` past `at`).
fn read_slots(raw: &[u8], at: usize) -> Option<Vec<(u64, u64)>> {
    let rest = raw.get(at..)?;
    if value(rest, 0)? != SLOTS_MARKER {
        return None;
    }
    let m = usize::try_from(value(rest, 1)?).ok()?;
    if m % 2 != 0 || m > 2 * crate::rule::MAX_CONCURRENT as usize || rest.len() != 8 * (2 + m) {
        return None;
    }
    (0..m / 2)
        .map(|k| Some((value(rest, 2 + 2 * k)?, value(rest, 3 + 2 * k)?)))
        .collect()
}

/// Appends the slots trailer of the concurrency rule's state among `states`, if it holds
/// any slot.
fn encode_slots(out: &mut Vec<u8>, states: &[RuleState]) {
    let Some(table) = states.iter().find_map(|s| match s {
        RuleState::Slots(table) if !table.held.is_empty() => Some(table),
        _ => None,
    }) else {
        return;
    };
    push(out, SLOTS_MARKER);
    push(out, 2 * table.held.len() as u64);
    for &(deadline, number) in &table.held {
        push(out, deadline.min(MAX_EXACT));
        push(out, number.min(MAX_EXACT));
    }
}

/// What [`edit_slots`] does to a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotEdit {
    /// Frees it ([`algo::release`]).
    Release,
    /// Moves its deadline to now plus this many µs ([`algo::renew`]).
    Renew(u64),
}

/// A stored state `raw` (of any layout) with slot `slot` released or renewed at `now`, by
/// the core's own [`algo::release`] and [`algo::renew`]: the new value, whether the slot
/// was live (and so freed or renewed), and the latest deadline the state still holds.
/// `None` when `raw` holds no slots trailer (nothing to do) or is not a state of this
/// encoding: a store then leaves the key as it is.
pub fn edit_slots(raw: &[u8], slot: u64, now: u64, edit: SlotEdit) -> Option<(Vec<u8>, bool, u64)> {
    if raw.is_empty() || raw.len() % 8 != 0 || raw.len() > MAX_STATE_BYTES {
        return None;
    }
    let len = raw.len() / 8;
    value(raw, 0)?;
    // The trailer is the last entry: walk the entries to it, linear in the length.
    let mut pos = 1;
    let marker = loop {
        if pos >= len {
            return None;
        }
        let id = value(raw, pos)?;
        let m = usize::try_from(value(raw, pos + 1)?).ok()?;
        if m > len - pos - 2 {
            return None;
        }
        if id == SLOTS_MARKER {
            break pos;
        }
        pos += 2 + m;
    };
    let held = read_slots(raw, 8 * marker)?;
    let mut states = [RuleState::Slots(Box::new(algo::SlotTable {
        next: 0,
        held,
    }))];
    let live = match edit {
        SlotEdit::Release => algo::release(&mut states, slot, now),
        SlotEdit::Renew(timeout_us) => algo::renew(&mut states, slot, timeout_us, now),
    };
    let mut out = raw[..8 * marker].to_vec();
    encode_slots(&mut out, &states);
    let latest = match &states[0] {
        RuleState::Slots(table) => table.held.iter().map(|&(d, _)| d).max().unwrap_or(0),
        _ => 0,
    };
    Some((out, live, latest))
}

/// The state of `rule` in the entry whose values start at `p` (past its identity and
/// length), and the entry's length in values.
fn read_entry(rule: &Rule, raw: &[u8], p: usize) -> Option<(RuleState, usize)> {
    let v = |i: usize| value(raw, p + i);
    let len = entry_len(rule) as usize;
    let state = match rule.algorithm() {
        Algorithm::SlidingLog => RuleState::Fresh,
        Algorithm::FixedWindow => RuleState::Window {
            index: v(0)?,
            count: v(1)?,
        },
        Algorithm::SlidingWindow { precision } => {
            let counts = (0..=precision as usize)
                .map(|d| v(1 + d))
                .collect::<Option<Box<[u64]>>>()?;
            RuleState::Counters {
                index: v(0)?,
                counts,
            }
        }
        Algorithm::TokenBucket { .. } => RuleState::Tokens {
            level: v(2)?,
            last: v(3)?,
        },
        Algorithm::Gcra { .. } | Algorithm::LeakyBucket(_) => RuleState::Tat {
            us: v(2)?,
            frac: v(3)?,
        },
        Algorithm::Concurrent => RuleState::Slots(Box::new(algo::SlotTable {
            next: v(0)?,
            held: Vec::new(),
        })),
    };
    Some((state, len))
}

/// Appends the state `states` (after a committed check of `rules`) as stored: the
/// header's layout, an entry per rule but the sliding logs, and the log marker saying
/// the log counts until `log_until` when a rule is a sliding log.
pub fn encode_state(
    out: &mut Vec<u8>,
    header: &Header,
    rules: &PackedRules,
    states: &[RuleState],
    log_until: u64,
) {
    out.reserve(8 * header.width);
    push(out, header.layout);
    for ((rule, &id), state) in rules.rules.rules().iter().zip(&rules.ids).zip(states) {
        encode_entry(out, rule, id, state);
    }
    if rules.rules.log_limit() > 0 {
        for x in [LOG_MARKER, 1, log_until] {
            push(out, x);
        }
    }
    encode_slots(out, states);
}

/// The layouts of states a denial writes after a conversion ([`encode_carried`]) are this
/// plus the writer's layout: no rule set's fingerprint (those are below 2^52), so the
/// next check reads it entry by entry; for the rule set that wrote it, the shared log
/// counts as in a state of its own layout (as `MemoryStore`, whose entry then holds that
/// rule set).
pub const CARRIED: u64 = 1 << 52;

/// Appends the states a denial writes after a conversion (check.lua's `write_carried`):
/// the layout [`CARRIED`] + the header's, an entry for each rule but the sliding logs whose carried
/// state is not `Fresh`, each tagged with its new limit and capacity (so reading it again
/// converts nothing), and the log marker saying the log counts until `log_until` when
/// one is given (a rule is a sliding log and the log has an entry).
pub fn encode_carried(
    out: &mut Vec<u8>,
    header: &Header,
    rules: &PackedRules,
    states: &[RuleState],
    log_until: Option<u64>,
) {
    push(out, CARRIED + header.layout);
    for ((rule, &id), state) in rules.rules.rules().iter().zip(&rules.ids).zip(states) {
        if *state != RuleState::Fresh {
            encode_entry(out, rule, id, state);
        }
    }
    if let Some(until) = log_until {
        for x in [LOG_MARKER, 1, until] {
            push(out, x);
        }
    }
    encode_slots(out, states);
}

/// Appends one rule's entry (none for a sliding log): identity, length, then the state,
/// after the writer's limit and capacity for a token bucket, GCRA or leaky bucket.
fn encode_entry(out: &mut Vec<u8>, rule: &Rule, id: u64, state: &RuleState) {
    let (l, a) = (rule.limit(), rule.capacity());
    match (rule.algorithm(), state) {
        (Algorithm::SlidingLog, _) => {}
        (Algorithm::Concurrent, _) => {
            let next = match state {
                RuleState::Slots(table) => table.next,
                _ => 0,
            };
            for x in [id, 1, next] {
                push(out, x);
            }
        }
        (Algorithm::FixedWindow, _) => {
            let (i, c) = match *state {
                RuleState::Window { index, count } => (index, count),
                _ => (0, 0),
            };
            for x in [id, 2, i, c] {
                push(out, x);
            }
        }
        (Algorithm::SlidingWindow { precision }, _) => {
            push(out, id);
            push(out, precision + 2);
            match state {
                RuleState::Counters { index, counts } => {
                    push(out, *index);
                    for d in 0..=precision as usize {
                        push(out, counts.get(d).copied().unwrap_or(0));
                    }
                }
                _ => (0..precision + 2).for_each(|_| push(out, 0)),
            }
        }
        (Algorithm::TokenBucket { capacity }, _) => {
            let (level, last) = match *state {
                RuleState::Tokens { level, last } => (level, last),
                _ => (0, 0),
            };
            for x in [id, 4, l, capacity, level, last] {
                push(out, x);
            }
        }
        (Algorithm::Gcra { .. } | Algorithm::LeakyBucket(_), _) => {
            // The capacity the Lua twin's `gcra` is given: a shaper's burst + 1.
            let cap = match rule.algorithm() {
                Algorithm::LeakyBucket(LeakyMode::Shaper { burst, .. }) => burst + 1,
                _ => a,
            };
            let (us, frac) = match *state {
                RuleState::Tat { us, frac } => (us, frac),
                _ => (0, 0),
            };
            for x in [id, 4, l, cap, us, frac] {
                push(out, x);
            }
        }
    }
}

/// Appends the reply of a decided check: `discarded` when a value the store did not
/// write was found at one of the check's keys and dropped.
///
/// `concurrent` is the position of the check's concurrency rule, if any
/// ([`RuleSet::concurrent`]): the slot the decision took is sent as its `retry`.
pub fn encode_decision(
    out: &mut Vec<u8>,
    decision: &Decision,
    concurrent: Option<usize>,
    discarded: bool,
) {
    let us = |d: Duration| {
        u64::try_from(d.as_micros())
            .unwrap_or(u64::MAX)
            .min(MAX_EXACT)
    };
    push(out, if discarded { 2 } else { 0 });
    push(out, us(decision.delay()));
    for (i, rule) in decision.rules().iter().enumerate() {
        push(out, u64::from(rule.allowed));
        push(out, rule.remaining.min(MAX_EXACT));
        push(out, us(rule.reset_after));
        let retry = match decision.slot() {
            Some(slot) if concurrent == Some(i) => slot.min(MAX_EXACT),
            _ => rule.retry_after.map_or(0, us),
        };
        push(out, retry);
    }
}

/// Appends the reply of a blocked key: the block's time left in µs, `None` for a block
/// without end.
pub fn encode_blocked(out: &mut Vec<u8>, left_us: Option<u64>) {
    out.extend_from_slice(&1f64.to_le_bytes());
    match left_us {
        Some(left) => push(out, left.min(MAX_EXACT)),
        None => out.extend_from_slice(&(-1f64).to_le_bytes()),
    }
}

/// Appends the reply of a check that arrived past its caller's deadline, at the
/// server's time `now_us`: nothing decided, nothing written.
pub fn encode_late(out: &mut Vec<u8>, now_us: u64) {
    push(out, 3);
    push(out, now_us.min(MAX_EXACT));
}

/// Appends a check's entry in a compact batch's `refs` ([`REF_LEN`] bytes).
pub fn write_ref(out: &mut Vec<u8>, index: u8, deadline: Option<u64>) {
    out.push(index);
    out.extend_from_slice(&deadline.unwrap_or(0).to_le_bytes());
}

/// A check's entry in a compact batch's `refs`, as [`write_ref`] wrote it: the index of
/// its packed check and its deadline; `None` when `entry` is not [`REF_LEN`] bytes.
pub fn read_ref(entry: &[u8]) -> Option<(usize, Option<u64>)> {
    let (&index, deadline) = entry.split_first()?;
    let deadline = u64::from_le_bytes(deadline.try_into().ok()?);
    Some((usize::from(index), (deadline > 0).then_some(deadline)))
}

/// Appends a failed check of a batch: `{-1, n}` and the `n` bytes of `message`.
pub fn encode_failure(out: &mut Vec<u8>, message: &[u8]) {
    out.extend_from_slice(&(-1f64).to_le_bytes());
    push(out, message.len() as u64);
    out.extend_from_slice(message);
}

/// An edit of a key's state after its check, carried by a batch beside the checks (the
/// module's batch protocol 5, and the Lua functions of this version), so that settles
/// and releases leave in the same call as the checks queued with them.
///
/// Its packed value is a check's header whose first value is `injected + 2 × op` (a
/// check's is 0 or 1) and whose last, a check's deadline, holds the edit's own number
/// ([`Edit::value`]): op 1 gives a charge back (the check's rules follow; the number is
/// the charge's time), 2 charges debt (the rules follow, the header's cost the units;
/// no number), 3 releases a slot and 4 renews one (no rules; the number is the slot's,
/// and a renewal's timeout in µs follows the header), 5 gives a lease's unspent units
/// back (the rules follow, the header's cost the units; the number is the
/// reservation's time, and the units it charged follow the rules), 6 blocks the key
/// (no rules; the number is the block's length in µs, and 1 for a block without end,
/// else 0, follows the header), 7 takes a slot whatever the limit and charges a unit
/// as debt (the rules follow; no number). The number travels where a
/// check's deadline does, so that in a compact batch it rides in `refs` and edits of
/// one rule set share their packed value as checks do. Its reply in the batch is `{4,
/// 1}` when it changed the state, `{4, 0}` when not ([`encode_edit`]); a take's is `{4,
/// slot}`, or `{4, 0}` when it took none ([`encode_edit_value`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Edit {
    /// A check's charge given back; the check charged at `charged_at` (µs).
    GiveBack {
        /// When the check charged, on the store's clock.
        charged_at: u64,
    },
    /// Units charged unconditionally, as debt where a state goes past its limit.
    Debit,
    /// A concurrency slot freed.
    Release {
        /// The slot's number.
        slot: u64,
    },
    /// A live concurrency slot's deadline moved to now plus `timeout_us`.
    Renew {
        /// The slot's number.
        slot: u64,
        /// The slot's new timeout.
        timeout_us: u64,
    },
    /// Units a lease reserved at `start_us` (charging `granted`) and did not spend,
    /// given back (the header's cost): to each rule's entry written under the same
    /// limit, no more than what of the reservation has not drained, a fixed window's
    /// only in the reservation's window (`start_us` divided by its period).
    Refund {
        /// When the reservation charged, on the store's clock.
        start_us: u64,
        /// The units the reservation charged.
        granted: u64,
    },
    /// The key blocked for `length_us` from now, or without end (`None`), replacing
    /// any earlier block.
    Block {
        /// The block's length in µs (below 2^52), `None` for a block without end.
        length_us: Option<u64>,
    },
    /// A slot of the rules' concurrency rule taken whatever its limit, and one unit
    /// charged to every rule as debt ([`algo::take`]): an admission made while the store
    /// was unreachable, handed to it.
    Take,
}

/// The status of an edit's reply in a batch.
pub const EDIT_STATUS: u64 = 4;

impl Edit {
    fn op(self) -> u64 {
        match self {
            Edit::GiveBack { .. } => 1,
            Edit::Debit => 2,
            Edit::Release { .. } => 3,
            Edit::Renew { .. } => 4,
            Edit::Refund { .. } => 5,
            Edit::Block { .. } => 6,
            Edit::Take => 7,
        }
    }

    /// Whether the edit carries the check's rules (a settle, a lease's refund) or none
    /// (a slot's edit, a block).
    pub fn has_rules(self) -> bool {
        matches!(
            self,
            Edit::GiveBack { .. } | Edit::Debit | Edit::Refund { .. } | Edit::Take
        )
    }

    /// The edit's own number, carried where a check's deadline is: a give-back's charge
    /// time, a slot's number, a refund's reservation time, a block's length; 0 for debt
    /// and a block without end.
    pub fn value(self) -> u64 {
        match self {
            Edit::GiveBack { charged_at } => charged_at,
            Edit::Debit | Edit::Take => 0,
            Edit::Release { slot } | Edit::Renew { slot, .. } => slot,
            Edit::Refund { start_us, .. } => start_us,
            Edit::Block { length_us } => length_us.unwrap_or(0),
        }
    }

    /// This edit with its own number `value` (as a compact batch's `refs` carry it).
    #[must_use]
    pub fn with_value(self, value: u64) -> Self {
        match self {
            Edit::GiveBack { .. } => Edit::GiveBack { charged_at: value },
            Edit::Debit => Edit::Debit,
            Edit::Take => Edit::Take,
            Edit::Release { .. } => Edit::Release { slot: value },
            Edit::Renew { timeout_us, .. } => Edit::Renew {
                slot: value,
                timeout_us,
            },
            Edit::Refund { granted, .. } => Edit::Refund {
                start_us: value,
                granted,
            },
            Edit::Block { length_us } => Edit::Block {
                length_us: length_us.map(|_| value),
            },
        }
    }

    /// Values after the header and the rules, by op: a renewal's timeout, a refund's
    /// units granted, whether a block is without end.
    fn extras_of(op: u64) -> Option<usize> {
        match op {
            1..=3 | 7 => Some(0),
            4..=6 => Some(1),
            _ => None,
        }
    }

    /// The value after the header and the rules (see [`extras_of`](Self::extras_of)).
    fn extra(self) -> Option<u64> {
        match self {
            Edit::Renew { timeout_us, .. } => Some(timeout_us),
            Edit::Refund { granted, .. } => Some(granted),
            Edit::Block { length_us } => Some(u64::from(length_us.is_none())),
            _ => None,
        }
    }
}

/// The packed value of `edit` (see [`Edit`]) at the injected time `now`: for a settle,
/// of the check of `rules` for `units` units; a slot's edit carries no rules (`rules`
/// and `units` are not read).
pub fn pack_edit(
    edit: Edit,
    rules: Option<&RuleSet>,
    now: Option<u64>,
    units: u64,
    ttl_floor_ms: u64,
) -> Vec<u8> {
    let first = u64::from(now.is_some()) + 2 * edit.op();
    let number = Some(edit.value().min(MAX_EXACT));
    let settle = rules.filter(|_| edit.has_rules());
    let mut out = if let Some(rules) = settle {
        pack_check(rules, now, units, ttl_floor_ms, number)
    } else {
        let mut out = Vec::with_capacity(8 * (HEADER + 1));
        let header = [
            0,
            now.unwrap_or(0),
            0,
            ttl_floor_ms.min(MAX_EXACT),
            0,
            0,
            0,
            0,
            0,
            edit.value().min(MAX_EXACT),
        ];
        for x in header {
            push(&mut out, x);
        }
        out
    };
    out[..8].copy_from_slice(&(first as f64).to_le_bytes());
    if let Some(extra) = edit.extra() {
        push(&mut out, extra.min(MAX_EXACT));
    }
    out
}

/// An edit as [`parse_edit`] reads it: the edit, its header, and its rules' bytes.
pub type ParsedEdit<'a> = (Edit, Header, &'a [u8]);

/// The edit a packed value of a batch asks for, with its header (`injected` read from
/// the first value; no deadline) and its rules' bytes (empty for a slot's edit);
/// `Ok(None)` for a check; an error that says what is wrong when the value is neither.
pub fn parse_edit(bytes: &[u8]) -> Result<Option<ParsedEdit<'_>>, PackedError> {
    let mut v = header_values(bytes)?;
    if v[0] <= 1 {
        return Ok(None);
    }
    let op = v[0] / 2;
    let extras = Edit::extras_of(op)
        .ok_or_else(|| PackedError(format!("unknown edit {op} (value 0 of the header)")))?;
    let len = bytes.len();
    let body = len
        .checked_sub(8 * extras)
        .filter(|&b| b >= 8 * HEADER)
        .ok_or_else(|| PackedError(format!("edit {op} is cut short: {} values", len / 8)))?;
    let number = v[HEADER - 1];
    v[0] %= 2;
    v[HEADER - 1] = 0;
    let extra = || {
        value(bytes, body / 8).ok_or_else(|| {
            PackedError(format!(
                "edit {op}'s last value is not an integer below 2^53"
            ))
        })
    };
    let edit = match op {
        1 => Edit::GiveBack { charged_at: number },
        2 => Edit::Debit,
        3 => Edit::Release { slot: number },
        4 => Edit::Renew {
            slot: number,
            timeout_us: extra()?,
        },
        5 => Edit::Refund {
            start_us: number,
            granted: extra()?,
        },
        7 => Edit::Take,
        _ => Edit::Block {
            length_us: match extra()? {
                0 => Some(number),
                1 => None,
                other => {
                    return Err(PackedError(format!(
                        "a block is without end (1) or not (0), got {other}"
                    )))
                }
            },
        },
    };
    let header = if edit.has_rules() {
        Header::of_values(v, body, 1)?
    } else {
        Header::of_values(v, body, 0).and_then(|h| {
            if h.rules == 0 {
                Ok(h)
            } else {
                Err(PackedError(format!(
                    "a slot's edit or a block carries no rules, got {}",
                    h.rules
                )))
            }
        })?
    };
    Ok(Some((edit, header, &bytes[8 * HEADER..body])))
}

/// Appends an edit's reply in a batch: `{4, 1}` when it changed the state, else
/// `{4, 0}`.
pub fn encode_edit(out: &mut Vec<u8>, changed: bool) {
    encode_edit_value(out, u64::from(changed));
}

/// Appends an edit's reply in a batch that answers a number: `{4, value}` (a take's
/// slot, 0 for none).
pub fn encode_edit_value(out: &mut Vec<u8>, value: u64) {
    push(out, EDIT_STATUS);
    push(out, value.min(MAX_EXACT));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A value is an integer in `[0, 2^53)`, as the Lua functions read one: fractions,
    /// negatives, NaN, the infinities and anything past 2^53 are none.
    #[test]
    fn values_are_the_integers_below_2_pow_53() {
        let of = |x: f64| value(&x.to_le_bytes(), 0);
        let top = MAX_EXACT as f64;
        for (x, want) in [
            (0.0, Some(0)),
            (-0.0, Some(0)),
            (1.0, Some(1)),
            (top, Some(MAX_EXACT)),
            (top - 1.0, Some(MAX_EXACT - 1)),
            (0.5, None),
            (1.5, None),
            (2f64.powi(51) + 0.5, None),
            (1e-300, None),
            (-1.0, None),
            (top + 1.0, None),
            (top * 2.0, None),
            (f64::NAN, None),
            (f64::INFINITY, None),
            (f64::NEG_INFINITY, None),
        ] {
            assert_eq!(of(x), want, "{x}");
        }
        assert_eq!(value(&[0; 7], 0), None, "cut short");
    }

    #[test]
    fn edits_read_what_they_packed() {
        let rules: RuleSet = "10/s; 2/s sliding-log".parse().unwrap();
        for (edit, now) in [
            (Edit::GiveBack { charged_at: 17 }, Some(1_000)),
            (Edit::Debit, None),
            (Edit::Release { slot: 5 }, Some(3)),
            (
                Edit::Renew {
                    slot: 6,
                    timeout_us: 2_000_000,
                },
                None,
            ),
            (
                Edit::Refund {
                    start_us: 41,
                    granted: 8,
                },
                Some(50),
            ),
            (
                Edit::Block {
                    length_us: Some(7_000_000),
                },
                None,
            ),
            (Edit::Block { length_us: None }, Some(9)),
            (Edit::Take, Some(11)),
        ] {
            let packed = pack_edit(edit, Some(&rules), now, 3, 250);
            let (read, header, rule_bytes) = parse_edit(&packed).unwrap().unwrap();
            assert_eq!(read, edit);
            // The edit's number where a check's deadline is, which compact refs carry.
            assert_eq!(value(&packed, HEADER - 1), Some(edit.value()));
            let numbered = !matches!(
                edit,
                Edit::Debit | Edit::Take | Edit::Block { length_us: None }
            );
            assert_eq!(read.with_value(9).value(), if numbered { 9 } else { 0 });
            assert_eq!(header.deadline, None);
            assert_eq!(header.now, now);
            assert_eq!(header.ttl_floor_ms, 250);
            if edit.has_rules() {
                assert_eq!(header.cost, 3);
                let parsed = PackedRules::parse(rule_bytes, &header).unwrap();
                assert_eq!(parsed.ids(), rules.rule_ids());
            } else {
                assert_eq!((header.rules, rule_bytes.len()), (0, 0));
            }
            // A check's parser refuses it: a server that knows no edits fails it alone.
            assert!(Header::parse(&packed).is_err());
        }
        let check = pack_check(&rules, None, 1, 0, None);
        assert_eq!(parse_edit(&check).unwrap(), None);
        let mut bad = pack_edit(Edit::Release { slot: 1 }, None, None, 0, 0);
        bad[..8].copy_from_slice(&16f64.to_le_bytes());
        assert!(parse_edit(&bad).is_err());
        assert!(parse_edit(&bad[..8 * HEADER]).is_err());
    }

    #[test]
    fn refs_read_what_they_wrote() {
        let mut refs = Vec::new();
        write_ref(&mut refs, 3, Some(1_700_000_000_000_000));
        write_ref(&mut refs, 255, None);
        assert_eq!(refs.len(), 2 * REF_LEN);
        let read: Vec<_> = refs.chunks(REF_LEN).map(read_ref).collect();
        assert_eq!(
            read,
            [Some((3, Some(1_700_000_000_000_000))), Some((255, None))]
        );
        assert_eq!(read_ref(&refs[..REF_LEN - 1]), None);
        assert_eq!(read_ref(&refs[..REF_LEN + 1]), None);
    }

    fn rules(text: &str) -> RuleSet {
        text.parse().unwrap()
    }

    fn parsed(r: &RuleSet) -> (Header, PackedRules) {
        let bytes = pack_check(r, Some(5), 1, 0, None);
        let (header, rest) = Header::parse(&bytes).unwrap();
        let rules = PackedRules::parse(rest, &header).unwrap();
        (header, rules)
    }

    #[test]
    fn a_check_round_trips() {
        let r = rules(
            "5/s fixed-window; 6/s sliding-window precision=4; 7/s sliding-log; \
             8/s token-bucket capacity=9; 10/s gcra burst=3 name=api; \
             11/s leaky-bucket mode=meter capacity=4; 12/s leaky-bucket mode=shaper burst=5 delay=2",
        );
        let (header, p) = parsed(&r);
        assert_eq!(header.now, Some(5));
        assert_eq!(header.width as u64, state_width(&r));
        assert_eq!(header.layout, layout(&r));
        assert_eq!(p.ids(), r.rule_ids());
        for (a, b) in p.rules().rules().iter().zip(r.rules()) {
            assert_eq!(a.algorithm(), b.algorithm());
            assert_eq!((a.limit(), a.period_us()), (b.limit(), b.period_us()));
        }
    }

    #[test]
    fn a_state_round_trips_in_place_and_carries_by_identity() {
        let r = rules("5/s fixed-window; 6/s sliding-window precision=2; 8/s token-bucket capacity=9; 10/s gcra burst=3; 1/min sliding-log");
        let (header, p) = parsed(&r);
        let states = vec![
            RuleState::Window { index: 7, count: 3 },
            RuleState::Counters {
                index: 9,
                counts: vec![1, 2, 3].into(),
            },
            RuleState::Tokens {
                level: 4_000_000,
                last: 10,
            },
            RuleState::Tat { us: 20, frac: 3 },
            RuleState::Fresh,
        ];
        let mut raw = Vec::new();
        encode_state(&mut raw, &header, &p, &states, 99);
        assert_eq!(raw.len(), 8 * header.width);
        let stored = decode_state(&raw, &header, &p, 5).unwrap();
        assert_eq!(stored.states.to_vec(), states);
        assert!(stored.log_counts);
        // Under another rule set: each rule by identity; the log by its marker.
        let r2 = rules("6/s sliding-window precision=2; 12/s gcra burst=3; 2/min sliding-log");
        let (h2, p2) = parsed(&r2);
        let carried = decode_state(&raw, &h2, &p2, 5).unwrap();
        assert_eq!(carried.states[0], states[1]);
        // A TAT ahead of now, whose limit changed from 10 to 12: what is owed, 15 µs and
        // 3/10 at 10/s (153 in 1/10 µs), is 12 µs and 9/12 at 12/s.
        assert_eq!(carried.states[1], RuleState::Tat { us: 17, frac: 9 });
        assert!(carried.converted);
        assert!(carried.log_counts);
        assert!(!decode_state(&raw, &h2, &p2, 99).unwrap().log_counts);
        // A denial writes the carried states in the CARRIED layout: read again, they are
        // the same and convert nothing.
        let mut written = Vec::new();
        encode_carried(&mut written, &h2, &p2, &carried.states, Some(7));
        assert_eq!(value(&written, 0), Some(CARRIED + h2.layout));
        let again = decode_state(&written, &h2, &p2, 9).unwrap();
        assert_eq!(again.states[..2], carried.states[..2]);
        assert!(!again.converted);
        // Its writer's log counts past the marker, as in a state of its own layout.
        assert!(again.log_counts);
        assert!(!decode_state(&written, &header, &p, 9).unwrap().log_counts);
    }

    #[test]
    fn slots_follow_the_state_and_carry_by_identity() {
        let r = rules("10/s fixed-window; 3 concurrent timeout=1s");
        let (header, p) = parsed(&r);
        let mut states = vec![RuleState::Fresh; 2];
        for now in [5, 6] {
            assert!(algo::decide(&r, &mut states, now, 1)
                .decision
                .slot()
                .is_some());
        }
        let mut raw = Vec::new();
        encode_state(&mut raw, &header, &p, &states, 0);
        // The fixed part, then the trailer: marker, 4, two (deadline, number) pairs.
        assert_eq!(raw.len(), 8 * (header.width + 2 + 4));
        assert_eq!(value(&raw, header.width), Some(SLOTS_MARKER));
        assert_eq!(
            decode_state(&raw, &header, &p, 7).unwrap().states.to_vec(),
            states
        );
        // Under another limit and timeout: the same identity, the same slots.
        let r2 = rules("2 concurrent timeout=5s");
        let (h2, p2) = parsed(&r2);
        assert_eq!(
            decode_state(&raw, &h2, &p2, 7).unwrap().states[0],
            states[1]
        );
        // A release rewrites the trailer only; twice, it frees nothing.
        let (out, live, latest) = edit_slots(&raw, 5, 7, SlotEdit::Release).unwrap();
        assert!(live);
        assert_eq!(latest, 1_000_006);
        assert_eq!(out.len(), raw.len() - 16);
        assert!(!edit_slots(&out, 5, 7, SlotEdit::Release).unwrap().1);
        // Without slots, no trailer at all.
        let (none, _, _) = edit_slots(&out, 6, 7, SlotEdit::Release).unwrap();
        assert_eq!(none.len(), 8 * header.width);
        assert_eq!(edit_slots(&none, 6, 7, SlotEdit::Release), None);
    }

    #[test]
    fn foreign_values_are_not_states() {
        let (header, p) = parsed(&rules("10/s gcra burst=3"));
        for raw in [
            &b"hello"[..],
            &[0u8; 7][..],
            &[],
            &f64::NAN.to_le_bytes(),
            &[1f64, 5.0, 9.0]
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect::<Vec<_>>()[..],
        ] {
            assert_eq!(decode_state(raw, &header, &p, 0), None, "{raw:?}");
        }
    }

    #[test]
    fn bad_checks_are_refused_with_a_reason() {
        let r = rules("10/s");
        let mut bytes = pack_check(&r, None, 1, 0, None);
        assert!(Header::parse(&bytes[..bytes.len() - 8]).is_err());
        bytes[8 * HEADER..8 * HEADER + 8].copy_from_slice(&9f64.to_le_bytes());
        let (header, rest) = Header::parse(&bytes).unwrap();
        let err = PackedRules::parse(rest, &header).unwrap_err();
        assert!(
            err.to_string().contains("unknown algorithm code 9"),
            "{err}"
        );
        bytes[16..24].copy_from_slice(&0.5f64.to_le_bytes());
        assert!(Header::parse(&bytes).is_err());
    }
}
