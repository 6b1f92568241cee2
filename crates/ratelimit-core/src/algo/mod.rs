//! The algorithms as pure state transitions: `(state, now, rules, cost) -> (decision, state)`.
//!
//! All arithmetic is on unsigned integers whose every intermediate value stays below 2^53
//! for rules that pass [`Rule`] validation, so the Redis store's Lua translation (which
//! computes with doubles) reaches exactly the same numbers. Times are microseconds since
//! the Unix epoch.
//!
//! Each algorithm lives in its own module, in the same three steps as the Redis store's
//! `check.lua` (one Lua function per module, same names): `evaluate` (the verdict on the
//! state as it stands, and the state to write), `commit` (writing it), and `expires_at`
//! (when the state has become equivalent to a fresh one). This module only runs several
//! rules all or nothing: every rule is evaluated, and only if all admit are all committed.
//!
//! Divisions by a rule's limit, period or sub-window go through multipliers computed when
//! the rule is built; they give exactly the quotients a division gives.
//!
//! # Changing rules
//!
//! A key's state is named by the key alone; inside it each rule's state is named by the
//! rule's identity ([`RuleSet::rule_ids`]: its name, else its algorithm and period).
//! When a key's state was last written under another rule set, [`carry`] gives the
//! states the new rules start from, at the first check under them:
//!
//! * a rule of a new identity (a new rule, a new algorithm, a new period, a new
//!   sliding window precision) starts empty, and the state of a rule that is gone is
//!   dropped when the store writes the new rules' states (see below);
//! * every other rule keeps what the client used, so a client who spent 3 of `5/h` has
//!   7 left under `10/h` and none under `3/h`, whatever the algorithm:
//!   * fixed window and sliding window counter: the counts carry as they are;
//!   * token bucket: what was used, the old capacity less the tokens at `now` (refilled
//!     under the old rule), is taken from the new capacity, at least 0 left, as of `now`,
//!     refilled from then on at the new rate; a bucket the old rule has refilled
//!     completely by now starts full;
//!   * GCRA and leaky bucket (meter and shaper alike: the mode is a limit, the level is
//!     the same): at `now`, `(tat − now) × old limit` (in 1/old-limit µs, the TAT's
//!     fraction included) is the units used × the period, whatever the limit, since a unit
//!     moves the TAT by period / limit µs. Under the new limit the TAT is `now` plus that
//!     over the new limit, exactly (the remainder is its fraction, in 1/limit µs). A TAT
//!     that has passed starts fresh. A TAT further ahead than a lowered capacity is not cut
//!     back: the new rule denies until it has drained within it, as a window denies until
//!     its count is under a lowered limit;
//!   * sliding log: one log of admitted timestamps per key, shared by every sliding-log
//!     rule, carries as it stands (a timestamp means the same under any limit or period) as
//!     long as some sliding-log rule wrote it and its longest sliding-log period has not
//!     run out since; it holds at most the largest sliding-log limit of the rules that
//!     wrote it. It is dropped when a rule set without a sliding log commits.
//!
//! A state written under the same rule set is used as it is: [`carry`] under unchanged
//! rules decides exactly as the state it was given, and so does a rule whose limit and
//! capacity did not change.
//!
//! **When the carried states are written.** Carrying writes nothing by itself; a store
//! replaces the key's states with the carried ones (and drops those of rules that are
//! gone) when a check under the new rules commits, and also on a denial when a state was
//! converted ([`Carried::converted`]: a GCRA or leaky bucket rule whose limit changed,
//! or a token bucket rule whose limit or capacity changed, with a live state). A converted state depends on the time
//! of the carry, so it is written at the first check under the new rules: a later check
//! reads it as it is, rather than converting again from the old state at another time,
//! and a denial's `retry_after` holds. Otherwise a denial, and a peek always, writes
//! nothing: the windows' counts and the sliding log carry the same at any time, and
//! writing them would drop the states of rules a store shared with processes on the old
//! rules still needs. Each check under the new rules then carries the same state again.
//!
//! # Giving units back
//!
//! A request that turns out not to count (a successful login, where only failures are
//! limited) gives back what its check charged, with [`refund`]: the check charged as
//! always, so concurrent requests never pass the limit; the refund then returns, at
//! most, what that charge took, and never into another window:
//!
//! * fixed window: the units come off the count only while the window counted is the
//!   one the charge fell in;
//! * sliding window counter: off the sub-window the charge fell in, while the state
//!   still counts it;
//! * sliding log: the charge's entries leave the log (the oldest of those logged since
//!   the charge);
//! * token bucket: the tokens go back, up to the capacity;
//! * GCRA and leaky bucket: the theoretical arrival time moves back by the units'
//!   emission intervals, never before now.
//!
//! For the token bucket, GCRA and the leaky bucket, what goes back is the part of the
//! charge that has not drained since it was made (the charge less `rate × elapsed`):
//! what drained may have been taken by other checks meanwhile, on a state that would
//! have been idle but for the charge, and giving it back too would lend. A request that
//! answers within a small part of the emission interval gives back almost all of it.
//!
//! The time of the charge is a reading of the store's clock taken before the check, so
//! it is at or before the moment the store decided: a window that has moved on since
//! then is never mistaken for the charge's.
//!
//! # Settling a charge
//!
//! A request whose cost is known only once it has been served (the tokens an LLM
//! answered with) is charged an estimate at the door and settled to its actual cost
//! afterwards, with [`settle`]: an actual below the estimate gives the difference back,
//! exactly as [`refund`] does; an actual above it charges the excess ([`debit`])
//! **unconditionally**, at the time of the settle, as debt: the state goes past what a
//! check would ever admit, and the key is refused until it has repaid it. Per algorithm,
//! the debt is held as:
//!
//! * fixed window: the count of the current window above the limit; a debt is repaid
//!   as the window runs, and what is left of it when the window ends goes with it;
//! * sliding window counter: the count of the current sub-window, which the window
//!   sees in full for a period, then weighted out as it ages;
//! * sliding log: entries logged at the log's time; the log keeps at most the largest
//!   sliding-log limit of its rules, so a log full of entries logged at the settle is
//!   the most it holds, and each rule refuses for at most one of its periods;
//! * token bucket: below empty, the level 0 as of a `last` in the future: the refill
//!   resumes once the debt is repaid (the wait rounded up to a whole microsecond); a
//!   refund into such a bucket shortens the wait before it fills the level;
//! * GCRA and leaky bucket (meter and shaper): the theoretical arrival time pushed past
//!   the burst (the capacity, or the shaper's queue), by the excess's emission
//!   intervals.
//!
//! **What a give-back keeps.** For the token bucket, GCRA and leaky bucket, a settle
//! below the charge gives back the difference less what the rule's rate has let
//! through since `charged_at`, as [`refund`] does (what drained may have gone to other
//! requests meanwhile): what refilled while the request ran stays charged, up to the
//! whole difference. The time counted runs from `charged_at` (a clock reading taken
//! before the check) to the settle, so it holds the check, the handler's work and the
//! stream. A worked example at `40000/min gcra`: a token every 60 s / 40,000 = 1,500 µs,
//! so 40,000 / 60 = 666⅔ tokens a second; an estimate of 2,000 charged at `t0`, a
//! stream of 1 s, an actual of 200:
//!
//! * the check at `t0`, on an idle key: TAT `t0` + 2,000 × 1,500 µs = `t0` + 3 s;
//!   38,000 left;
//! * the settle at `t0` + 1 s: the difference, 1,800 tokens (2.7 s of TAT), less the
//!   1 s drained since `t0` (666⅔ tokens), goes back: 1.7 s (1,133⅓ tokens). TAT
//!   `t0` + 1.3 s, 0.3 s ahead of now: 200 in use, 39,800 left;
//! * the actual charged at the door instead: TAT `t0` + 0.3 s, passed by now: 40,000
//!   left.
//!
//! The settle leaves the TAT 1 s (666⅔ tokens) later than charging the actual at the
//! door would have. A key otherwise idle feels at most the actual of it (the 200 as if
//! charged at the settle: its bucket would have refilled past the rest anyway); a key
//! whose TAT stays ahead of now (other requests charged) feels all of it: beside
//! another 10,000 charged at `t0`, 29,800 left after the settle against 30,466 (30,466⅔)
//! with the actual charged at the door. A stream of 2.7 s or more gets nothing back.
//! (`a_settle_below_the_estimate_keeps_what_refilled_while_the_request_ran`, in
//! `tests/memory_store.rs`, asserts these numbers.)
//!
//! **Bounded.** One settle charges each rule at most its [`debt_cap`]: the rule's limit
//! (one period's worth), and for the token bucket, GCRA and leaky bucket at most
//! `2^51 / period_us` units, so that every value stays below 2^53 (a day-long period
//! caps at 26,062 units). A state holds at most its capacity plus that cap in use, debt
//! included (a window's counts at most twice the limit): further excess is dropped. A
//! hostile actual (`u64::MAX`) therefore locks a key out for about one period of the
//! rule at most. [`settle_cap`] is the largest excess every rule of a set takes whole.
//!
//! **Repaid.** For the token bucket, GCRA and leaky bucket, debt is repaid by time
//! alone, so over a long horizon the units charged never exceed the rate plus the
//! capacity. The window algorithms hold debt only within their window: a debt larger
//! than what the rest of the window repays is forgiven with it, so they bound the
//! excess per window (by the in-flight requests' estimate errors), not on average.
//!
//! A settle's excess needs no earlier state: a key whose state has expired (or was
//! charged an estimate of 0) is charged from fresh. A key whose state was written under
//! another rule set gets nothing, neither back nor as debt: its usage cannot be told
//! apart from the charge's, and no rule it did not have is charged (the estimate
//! stands).
//! # Concurrent requests
//!
//! A `N concurrent` rule ([`Algorithm::Concurrent`]) counts requests in flight rather
//! than requests started. An admitted check takes a slot, numbered and given a deadline
//! `timeout` (the rule's period) ahead; [`Decision::slot`] carries its number back. The
//! holder frees it with [`release`] when its response has ended, and moves its deadline
//! on with [`renew`] while it runs; a slot whose deadline has passed is free whether or
//! not it was released, so a process that dies holding slots loses them at their
//! deadlines. In a rule set with rate rules it is decided in the same step as they are:
//! a request refused by any rule takes no slot, and one refused for want of a slot
//! consumes nothing from the rates.
//!
//! * A request takes one slot whatever its cost; a peek (cost 0) takes none.
//! * A refusal's `retry_after` is a hint: the earliest deadline of a held slot, at most
//!   one second ([`RETRY_HINT_CAP_US`]), since most slots are released long before their
//!   deadlines. `remaining` is the slots free, `reset_after` the time until the last
//!   held slot's deadline.
//! * Slot numbers are unique per key for as long as its state lives, and a state that
//!   has become fresh numbers from the clock, above every number it gave: releasing a
//!   number twice frees one slot. Renewing a slot past its deadline fails (it was free,
//!   and may have been taken since).
//! * The held slots carry over any change of the rule's limit or timeout (its identity
//!   is its name, else `concurrent`): a lowered limit refuses until enough are released.
//!
//! ```
//! use ratelimit_core::algo::{self, RuleState};
//! use ratelimit_core::RuleSet;
//!
//! let rules: RuleSet = "10/s; 2 concurrent timeout=5s".parse().unwrap();
//! let mut states = vec![RuleState::Fresh; rules.len()];
//! let now = 1_700_000_000_000_000;
//! let a = algo::decide(&rules, &mut states, now, 1).decision.slot().unwrap();
//! let _b = algo::decide(&rules, &mut states, now, 1).decision.slot().unwrap();
//! let third = algo::decide(&rules, &mut states, now, 1);
//! assert!(!third.decision.is_allowed() && !third.committed);
//! assert!(algo::release(&mut states, a, now));
//! assert!(!algo::release(&mut states, a, now), "a second release frees nothing");
//! assert!(algo::decide(&rules, &mut states, now, 1).decision.is_allowed());
//! ```
//!
//! # A clock that steps back
//!
//! Redis `TIME` after a failover to a server with another clock, or an injected clock,
//! can go back. The sliding log's time never does: a check at a time before the log's
//! newest entry is decided (which entries are in the window, whether the units fit, what
//! remains) and logged as if at the newest entry's time, so the log stays newest first
//! and never holds more than a rule's limit in one of its windows. `retry_after` and
//! `reset_after` still count from the clock's reading: the entry a denial waits for
//! leaves after the newest entry's time, when the log's time is the clock's again, so a
//! retry that long after is admitted (nothing else being logged meanwhile).
//!
//! ```
//! use ratelimit_core::algo::{decide, RuleState};
//! use ratelimit_core::RuleSet;
//!
//! let rules: RuleSet = "2/s fixed-window".parse().unwrap();
//! let mut states = vec![RuleState::Fresh; rules.len()];
//! let now = 1_700_000_000_000_000;
//! assert!(decide(&rules, &mut states, now, 1).decision.is_allowed());
//! assert!(decide(&rules, &mut states, now, 1).decision.is_allowed());
//! let third = decide(&rules, &mut states, now, 1);
//! assert!(!third.decision.is_allowed() && !third.committed);
//! ```

use std::collections::VecDeque;
use std::time::Duration;

use smallvec::SmallVec;

use crate::decision::{Decision, RuleOutcome};
use crate::rule::{Algorithm, Rule, RuleSet};

mod fixed_window;
mod gcra;
mod leaky_bucket;
mod sliding_log;
mod sliding_window;
mod token_bucket;

mod concurrent;
pub use concurrent::RETRY_HINT_CAP_US;

/// The stored state of one rule for one key.
///
/// `Fresh` is the state of a key never seen (or whose state expired): every algorithm
/// treats it as "nothing consumed".
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum RuleState {
    /// Nothing recorded.
    #[default]
    Fresh,
    /// Fixed window: units counted in window number `index` (`now / period`).
    Window {
        /// Window number.
        index: u64,
        /// Units admitted in it.
        count: u64,
    },
    /// Sliding window counter: `counts[i]` is the count of sub-window `index - i`.
    Counters {
        /// Newest sub-window number (`now / (period / precision)`).
        index: u64,
        /// `precision + 1` counts, newest first.
        counts: Box<[u64]>,
    },
    /// Sliding log shared by all sliding-log rules of the set, newest timestamp first,
    /// held in the slot of the first sliding-log rule.
    Log(Box<VecDeque<u64>>),
    /// Token bucket: `level` is tokens × period_us, as of `last`.
    Tokens {
        /// Tokens, scaled by the period in microseconds.
        level: u64,
        /// When `level` was computed.
        last: u64,
    },
    /// GCRA and leaky bucket: theoretical arrival time `us + frac / limit` microseconds.
    Tat {
        /// Whole microseconds.
        us: u64,
        /// Fraction of a microsecond, in units of 1/limit.
        frac: u64,
    },
    /// `N concurrent`: the held slots.
    Slots(Box<SlotTable>),
}

/// The slots of a `N concurrent` rule for one key (see the [module
/// docs](self#concurrent-requests)).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SlotTable {
    /// The number the next slot is given at the earliest: slot numbers only grow.
    pub next: u64,
    /// The slots, `(deadline µs, number)`, oldest taken first; those past their deadline
    /// are free and dropped at the next write.
    pub held: Vec<(u64, u64)>,
}

impl SlotTable {
    /// The slots live at `now` (deadline after it), and the earliest of their deadlines
    /// (`u64::MAX` when none).
    pub fn live(&self, now: u64) -> (u64, u64) {
        let mut live = 0;
        let mut earliest = u64::MAX;
        for &(deadline, _) in &self.held {
            if deadline > now {
                live += 1;
                earliest = earliest.min(deadline);
            }
        }
        (live, earliest)
    }
}

/// The result of [`decide`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transition {
    /// The answer.
    pub decision: Decision,
    /// Whether the states were changed (an admitted check with cost > 0).
    pub committed: bool,
    /// When committed: the time from which the key's state is equivalent to a fresh one,
    /// the moment its store entry may be dropped (or its Redis key expire). 0 otherwise.
    pub expires_at_us: u64,
}

/// One rule's verdict, with the state it writes if the whole check commits. Values only
/// a denial needs (`retry_us`) are computed only on denial: 64-bit divisions dominate the
/// cost of a decision.
struct Eval {
    allowed: bool,
    remaining_before: u64,
    retry_us: u64,
    delay_us: u64,
    next: Next,
}

/// The state a rule writes on commit.
enum Next {
    Window { index: u64, count: u64 },
    Counters { cur: u64 },
    Log,
    Tokens { level: u64, last: u64 },
    Tat { us: u64, frac: u64 },
    Slot,
}

fn us(d: u64) -> Duration {
    Duration::from_micros(d)
}

/// Decides a check of `cost` units at `now` against `rules`, whose states are `states`
/// (one per rule, in order). When every rule admits and `cost > 0`, the states are
/// updated in place; otherwise they are left exactly as they were. `cost == 0` peeks: the
/// verdict is the one a request of cost 1 would get, and `remaining` counts what is left.
///
/// The caller must have checked `cost` with [`RuleSet::check_cost`].
pub fn decide(rules: &RuleSet, states: &mut [RuleState], now: u64, cost: u64) -> Transition {
    debug_assert_eq!(states.len(), rules.len());
    // The one-rule case without per-rule buffers. `decide` itself stays a call: inlined
    // whole into callers it ran fewer instructions but measurably slower. The memory
    // store's hot path uses `decide_one_then` directly.
    if let ([rule], [state]) = (rules.rules(), &mut *states) {
        return decide_one(rule, state, rules.log_limit(), now, cost);
    }
    decide_many(rules, states, now, cost)
}

/// The states the rules of `to` start from at `now`, for a key whose `states` were written
/// under `from`: each rule's state by its identity, carried as the [module
/// docs](self#changing-rules) say; a rule without one starts `Fresh`. `states` is left
/// as it is. [`carry_converting`] also says whether a store must write the result on a
/// denial.
pub fn carry(
    from: &RuleSet,
    states: &[RuleState],
    to: &RuleSet,
    now: u64,
) -> SmallVec<[RuleState; 1]> {
    carry_converting(from, states, to, now).states
}

/// What [`carry_converting`] gives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Carried {
    /// The states the rules of the new set start from.
    pub states: SmallVec<[RuleState; 1]>,
    /// Whether a state was converted to a changed rule at the time of the carry: a GCRA
    /// or leaky bucket whose limit changed, or a token bucket whose limit or capacity
    /// changed, with a state that has not yet become fresh. The carried states then
    /// depend on the time, so a store writes them (with [`expires_at_for`]) at the first
    /// check under the new rules that costs something, a denial included: a later check
    /// carrying again from the old states would convert at another time, and a denial's
    /// `retry_after` would not hold.
    pub converted: bool,
}

/// [`carry`], and whether a state was converted ([`Carried::converted`]). A store keeps
/// the old states on a peek, and on a denial unless a state was converted; on a commit,
/// or a denial after a conversion, it replaces them with [`Carried::states`].
pub fn carry_converting(from: &RuleSet, states: &[RuleState], to: &RuleSet, now: u64) -> Carried {
    debug_assert_eq!(states.len(), from.len());
    let log = shared_log(states).filter(|log| {
        log.front()
            .is_some_and(|newest| newest.saturating_add(from.log_period_us()) > now)
    });
    let mut log = log.map(|log| RuleState::Log(Box::new(log.clone())));
    let mut out = SmallVec::with_capacity(to.len());
    let mut converted = false;
    for (rule, id) in to.rules().iter().zip(to.rule_ids()) {
        if rule.algorithm() == Algorithm::SlidingLog {
            // The shared log, in the first sliding-log rule's slot.
            out.push(log.take().unwrap_or_default());
            continue;
        }
        let Some(at) = from.rule_ids().iter().position(|i| i == id) else {
            out.push(RuleState::Fresh);
            continue;
        };
        let (old, state) = (&from.rules()[at], &states[at]);
        let (state, changed) = match old.algorithm() {
            // Held slots carry as they are too, under any limit or timeout.
            Algorithm::FixedWindow | Algorithm::SlidingWindow { .. } | Algorithm::Concurrent => {
                (state.clone(), false)
            }
            Algorithm::TokenBucket { capacity } => {
                token_bucket::carry(old, capacity, rule, state, now)
            }
            Algorithm::Gcra { .. } | Algorithm::LeakyBucket(_) => {
                gcra::carry(old, rule, state, now)
            }
            Algorithm::SlidingLog => unreachable!("identities keep the algorithm"),
        };
        converted |= changed;
        out.push(state);
    }
    Carried {
        states: out,
        converted,
    }
}

/// The moment from which `states`, held under `rules`, are equivalent to fresh ones: when
/// a store may forget them. [`Transition::expires_at_us`] is this for a committed check.
pub fn expires_at_for(rules: &RuleSet, states: &[RuleState]) -> u64 {
    debug_assert_eq!(states.len(), rules.len());
    let log = shared_log(states);
    rules
        .rules()
        .iter()
        .zip(states)
        .map(|(rule, state)| expires_at(rule, state, log))
        .max()
        .unwrap_or(0)
}

/// Frees slot `slot` (a [`Decision::slot`]) among `states` at `now`, whatever the rule
/// set that wrote them (held slots carry over rule changes, and numbers are unique per
/// key); returns whether it was held and live (only then does anything change). A second
/// release of one number frees nothing.
pub fn release(states: &mut [RuleState], slot: u64, now: u64) -> bool {
    states
        .iter_mut()
        .find(|s| matches!(s, RuleState::Slots(_)))
        .is_some_and(|state| concurrent::release(state, slot, now))
}

/// Moves the deadline of live slot `slot` among `states` to `now + timeout_us` (the
/// current rule's timeout); returns whether it was live. A slot past its deadline is not
/// renewed: it was free and may be held by another request since; its holder runs on
/// without one.
pub fn renew(states: &mut [RuleState], slot: u64, timeout_us: u64, now: u64) -> bool {
    states
        .iter_mut()
        .find(|s| matches!(s, RuleState::Slots(_)))
        .is_some_and(|state| concurrent::renew(state, slot, timeout_us, now))
}

/// Takes a slot of the concurrency rule of `rules` whatever its limit, and charges every
/// rule one unit unconditionally ([`debit`]), at `now`: an admission made elsewhere (a
/// fallback's, while the store was down) handed to the store, which then counts it until
/// it is released. Returns the slot's number; `None`, with nothing changed, when `rules`
/// have no concurrency rule, or when [`MAX_CONCURRENT`](crate::MAX_CONCURRENT) slots are
/// live already (the most a state holds, whatever the limit). `states` are the rules'
/// states (fresh ones included), written under `rules`.
pub fn take(rules: &RuleSet, states: &mut [RuleState], now: u64) -> Option<u64> {
    debug_assert_eq!(states.len(), rules.len());
    let at = rules.concurrent()?;
    if let RuleState::Slots(table) = &states[at] {
        if table.live(now).0 >= crate::MAX_CONCURRENT {
            return None;
        }
    }
    debit(rules, states, 1, now);
    Some(concurrent::commit(&rules.rules()[at], &mut states[at], now))
}

/// Gives back `cost` units that a check of `rules` charged at `charged_at` (a reading of
/// the store's clock taken before the check), at `now`, to `states` (written under
/// `rules`), as the [module docs](self#giving-units-back) say: never more than was
/// charged, never into another window. Returns whether any state changed.
///
/// The caller must have checked that `states` were written under `rules` (a state of
/// other rules gets nothing back: its usage cannot be told apart from the charge's).
pub fn refund(
    rules: &RuleSet,
    states: &mut [RuleState],
    cost: u64,
    charged_at: u64,
    now: u64,
) -> bool {
    debug_assert_eq!(states.len(), rules.len());
    let mut changed = false;
    let mut log_done = false;
    for (rule, state) in rules.rules().iter().zip(states.iter_mut()) {
        changed |= match rule.algorithm() {
            Algorithm::FixedWindow => fixed_window::refund(rule, state, cost, charged_at),
            Algorithm::SlidingWindow { precision } => {
                sliding_window::refund(rule, precision, state, cost, charged_at)
            }
            // The shared log is in the first sliding-log rule's slot.
            Algorithm::SlidingLog if !log_done => {
                log_done = true;
                sliding_log::refund(state, cost, charged_at)
            }
            // A slot is given back by `release`, not by a refund.
            Algorithm::SlidingLog | Algorithm::Concurrent => false,
            Algorithm::TokenBucket { capacity } => token_bucket::refund(
                rule,
                capacity,
                state,
                undrained(rule, cost, charged_at, now),
                now,
            ),
            Algorithm::Gcra { .. } | Algorithm::LeakyBucket(_) => {
                gcra::refund(rule, state, undrained(rule, cost, charged_at, now), now)
            }
        };
    }
    changed
}

/// Settles a charge of `charged` units that a check of `rules` made at `charged_at` (a
/// reading of the store's clock taken before the check) to the request's `actual`
/// cost, at `now`, on `states` (written under `rules`), as the [module
/// docs](self#settling-a-charge) say: an actual below the charge gives the difference
/// back ([`refund`]), one above it charges the excess as debt ([`debit`]). Returns
/// whether any state changed.
///
/// The caller must have checked that `states` were written under `rules` (a state of
/// other rules gets nothing: no charge into a rule it did not have).
pub fn settle(
    rules: &RuleSet,
    states: &mut [RuleState],
    charged: u64,
    actual: u64,
    charged_at: u64,
    now: u64,
) -> bool {
    match actual.cmp(&charged) {
        std::cmp::Ordering::Less => refund(rules, states, charged - actual, charged_at, now),
        std::cmp::Ordering::Equal => false,
        std::cmp::Ordering::Greater => debit(rules, states, actual - charged, now),
    }
}

/// Charges `units` unconditionally to every rule of `rules` at `now`, as debt where a
/// state goes past its limit: each rule takes at most its [`debt_cap`], and never
/// more than takes its state to its capacity plus that cap in use (see the [module
/// docs](self#settling-a-charge)). `states` are the rules' states (fresh ones
/// included). Returns whether any state changed; a store then keeps the states until
/// [`expires_at_for`] them.
pub fn debit(rules: &RuleSet, states: &mut [RuleState], units: u64, now: u64) -> bool {
    debug_assert_eq!(states.len(), rules.len());
    let mut changed = false;
    let mut log_done = false;
    for (rule, state) in rules.rules().iter().zip(states.iter_mut()) {
        let cap = debt_cap(rule);
        let take = units.min(cap);
        changed |= match rule.algorithm() {
            Algorithm::FixedWindow => fixed_window::debit(rule, state, take, cap, now),
            Algorithm::SlidingWindow { precision } => {
                sliding_window::debit(rule, precision, state, take, cap, now)
            }
            // The shared log is in the first sliding-log rule's slot, and takes up to its
            // own length (the largest sliding-log limit) whatever this rule's limit.
            Algorithm::SlidingLog if !log_done => {
                log_done = true;
                sliding_log::debit(state, rules.log_limit(), units, now)
            }
            // The log's other rules share the first one's; slots count requests in
            // flight, not units, and take no debt.
            Algorithm::SlidingLog | Algorithm::Concurrent => false,
            Algorithm::TokenBucket { capacity } => {
                token_bucket::debit(rule, capacity, state, take, cap, now)
            }
            Algorithm::Gcra { .. } | Algorithm::LeakyBucket(_) => {
                gcra::debit(rule, rule.capacity(), state, take, cap, now)
            }
        };
    }
    changed
}

/// The most one settle charges `rule` as debt, in units: one period's limit, and for
/// the token bucket, GCRA and leaky bucket at most `2^51 / period_us` (every value of
/// their states then stays below 2^53, exact in the Redis store's Lua). At least 1, but
/// 0 for a concurrency rule, which takes no debt.
pub fn debt_cap(rule: &Rule) -> u64 {
    match rule.algorithm() {
        Algorithm::Concurrent => 0,
        Algorithm::FixedWindow | Algorithm::SlidingWindow { .. } | Algorithm::SlidingLog => {
            rule.limit()
        }
        Algorithm::TokenBucket { .. } | Algorithm::Gcra { .. } | Algorithm::LeakyBucket(_) => rule
            .limit()
            .min(crate::rule::MAX_EXACT_PRODUCT / rule.period_us()),
    }
}

/// The largest excess one settle charges whole to every rule of `rules` that takes
/// debt (a concurrency rule takes none): the least of their [`debt_cap`]s. An excess
/// above it is capped for at least one rule.
pub fn settle_cap(rules: &RuleSet) -> u64 {
    (rules.rules().iter())
        .filter(|r| r.algorithm() != Algorithm::Concurrent)
        .map(debt_cap)
        .min()
        .unwrap_or(0)
}

/// Gives back `unspent` of the `granted` units a lease reserved at `start` (one charge of
/// `granted` units, of which the lease's holder spent all but `unspent`), at `now`, to
/// one rule's `state`: as [`refund`] gives back a charge, but for the token bucket, GCRA
/// and the leaky bucket the part that goes back is the reservation's undrained part,
/// never more than `unspent` units' worth. Sliding windows and logs are never leased:
/// nothing goes back to them. Returns whether the state changed.
///
/// A token bucket takes the units into its level whatever its `last`: a lease's `now`
/// may lie before the bucket's last check, so a `last` ahead of it is no debt to repay
/// (as [`refund`] repays one).
///
/// The caller must have checked that `state` was written under `rule`'s limit (the unit
/// of a TAT's fraction and of a bucket's level); a token bucket's `rule` carries the
/// capacity the state was written under.
pub fn refund_unspent(
    rule: &Rule,
    state: &mut RuleState,
    unspent: u64,
    granted: u64,
    start: u64,
    now: u64,
) -> bool {
    let give =
        || undrained(rule, granted, start, now).min(unspent.saturating_mul(rule.period_us()));
    match rule.algorithm() {
        Algorithm::FixedWindow => fixed_window::refund(rule, state, unspent, start),
        Algorithm::TokenBucket { capacity } => {
            token_bucket::refund_level(rule, capacity, state, give())
        }
        Algorithm::Gcra { .. } | Algorithm::LeakyBucket(_) => {
            gcra::refund(rule, state, give(), now)
        }
        Algorithm::SlidingWindow { .. } | Algorithm::SlidingLog | Algorithm::Concurrent => false,
    }
}

/// The part of a charge of `cost` units made at `charged_at` that has not drained by
/// `now`, in units of 1/limit µs (a TAT's, or a bucket level's, tokens × period): the
/// charge minus what the rule's rate has let through since. What has drained may have
/// been taken by other checks meanwhile, on a state that would have been idle (or full)
/// but for the charge; giving it back too would admit more than if the charge had never
/// been made.
fn undrained(rule: &Rule, cost: u64, charged_at: u64, now: u64) -> u64 {
    let charge = cost.saturating_mul(rule.period_us());
    let drained = now.saturating_sub(charged_at).saturating_mul(rule.limit());
    charge.saturating_sub(drained)
}

/// One rule's state carried as [`carry`] carries it, for a store that keeps beside each
/// rule's state the limit and capacity of the rule that wrote it (the Redis store's
/// state layout) rather than the whole rule set: `state`
/// was written under a rule of `rule`'s identity (so of its algorithm and period) whose
/// limit was `written_limit` and capacity `written_capacity`; and whether it was
/// converted (as [`Carried::converted`] says). Windows and counters carry as they are; a
/// sliding log's state is the shared log, which carries by its own marker, so `Fresh`
/// here.
pub fn carry_stored(
    rule: &Rule,
    written_limit: u64,
    written_capacity: u64,
    state: &RuleState,
    now: u64,
) -> (RuleState, bool) {
    match rule.algorithm() {
        Algorithm::FixedWindow | Algorithm::SlidingWindow { .. } | Algorithm::Concurrent => {
            (state.clone(), false)
        }
        Algorithm::SlidingLog => (RuleState::Fresh, false),
        Algorithm::TokenBucket { .. } => token_bucket::carry_from(
            written_limit,
            written_capacity,
            rule.period_us(),
            rule,
            state,
            now,
        ),
        Algorithm::Gcra { .. } | Algorithm::LeakyBucket(_) => {
            gcra::carry_from(written_limit, rule, state, now)
        }
    }
}

/// [`decide`] for several rules, all or nothing.
#[inline(never)]
fn decide_many(rules: &RuleSet, states: &mut [RuleState], now: u64, cost: u64) -> Transition {
    let c = cost.max(1);
    // Plain loops and pushes: iterator adaptors collecting into SmallVec cost more than
    // the arithmetic of a decision.
    let mut evals: SmallVec<[Eval; 4]> = SmallVec::new();
    let mut allowed = true;
    let mut delay = 0;
    {
        let log = shared_log(states);
        for (rule, state) in rules.rules().iter().zip(states.iter()) {
            let e = evaluate(rule.algorithm(), rule, state, log, now, c);
            allowed &= e.allowed;
            delay = delay.max(e.delay_us);
            evals.push(e);
        }
    }
    let mut outcomes: SmallVec<[RuleOutcome; 2]> = SmallVec::new();
    if cost == 0 || !allowed {
        let log = shared_log(states);
        for ((rule, state), e) in rules.rules().iter().zip(states.iter()).zip(&evals) {
            outcomes.push(RuleOutcome {
                allowed: e.allowed,
                limit: rule.limit(),
                remaining: e.remaining_before,
                reset_after: us(expires_at(rule, state, log).saturating_sub(now)),
                retry_after: (!e.allowed).then(|| us(e.retry_us)),
            });
        }
        return Transition {
            decision: Decision::from_outcomes(outcomes, us(delay)),
            committed: false,
            expires_at_us: 0,
        };
    }
    let mut log_done = false;
    let mut slot = None;
    for ((rule, state), e) in rules.rules().iter().zip(states.iter_mut()).zip(&evals) {
        // The log lives in the first sliding-log rule's slot and is shared.
        if matches!(e.next, Next::Log) {
            if log_done {
                continue;
            }
            log_done = true;
        }
        if matches!(e.next, Next::Slot) {
            slot = Some(concurrent::commit(rule, state, now));
            continue;
        }
        commit(rule, state, &e.next, rules.log_limit(), now, cost);
    }
    let log = shared_log(states);
    let mut expires_at_us = 0;
    for ((rule, state), e) in rules.rules().iter().zip(states.iter()).zip(&evals) {
        let expires = expires_at(rule, state, log);
        expires_at_us = expires_at_us.max(expires);
        outcomes.push(RuleOutcome {
            allowed: true,
            limit: rule.limit(),
            remaining: e.remaining_before - taken(rule, cost),
            reset_after: us(expires.saturating_sub(now)),
            retry_after: None,
        });
    }
    Transition {
        decision: Decision::from_outcomes(outcomes, us(delay)).with_slot(slot),
        committed: true,
        expires_at_us,
    }
}

/// [`decide`] for the most common case, one rule: no per-rule buffers, and the decision
/// built directly from the one verdict.
#[inline]
fn decide_one(
    rule: &Rule,
    state: &mut RuleState,
    log_limit: u64,
    now: u64,
    cost: u64,
) -> Transition {
    let (mut committed, mut expires_at_us) = (false, 0);
    let decision = decide_one_then(
        rule.algorithm(),
        rule,
        state,
        log_limit,
        now,
        cost,
        |c, expires, _| {
            (committed, expires_at_us) = (c, if c { expires } else { 0 });
        },
    );
    Transition {
        decision,
        committed,
        expires_at_us,
    }
}

/// The one-rule decision, handing `then` whether it committed, when the state expires
/// and the rule's outcome before the decision is built. A store updates its entry in
/// `then`, so the decision is built last, straight into the store's return value,
/// rather than built, inspected and copied out.
///
/// The rule's algorithm is given as a value (`rule.algorithm()`): a caller that has
/// matched on it already gets every dispatch on the algorithm resolved, where a reload
/// of the rule's field would be matched again.
#[inline(always)]
pub(crate) fn decide_one_then(
    algorithm: Algorithm,
    rule: &Rule,
    state: &mut RuleState,
    log_limit: u64,
    now: u64,
    cost: u64,
    then: impl FnOnce(bool, u64, &RuleOutcome),
) -> Decision {
    let e = evaluate(algorithm, rule, state, own_log(state), now, cost.max(1));
    let committed = cost > 0 && e.allowed;
    let mut slot = None;
    let expires = if committed {
        if matches!(e.next, Next::Slot) {
            slot = Some(concurrent::commit(rule, state, now));
            concurrent::expires_at(state)
        } else {
            commit_expiring(rule, state, &e.next, log_limit, now, cost)
        }
    } else {
        expires_at_as(algorithm, rule, state, own_log(state))
    };
    let outcome = RuleOutcome {
        allowed: e.allowed,
        limit: rule.limit(),
        remaining: if committed {
            e.remaining_before - taken(rule, cost)
        } else {
            e.remaining_before
        },
        reset_after: us(expires.saturating_sub(now)),
        retry_after: (!e.allowed).then(|| us(e.retry_us)),
    };
    then(committed, expires, &outcome);
    Decision::single(outcome, us(e.delay_us)).with_slot(slot)
}

/// What an admitted check of `cost` takes from the rule's remaining: its cost, but one
/// slot of a concurrency rule.
#[inline(always)]
fn taken(rule: &Rule, cost: u64) -> u64 {
    if rule.is_concurrent() {
        1
    } else {
        cost
    }
}

fn own_log(state: &RuleState) -> Option<&VecDeque<u64>> {
    match state {
        RuleState::Log(log) => Some(log),
        _ => None,
    }
}

fn shared_log(states: &[RuleState]) -> Option<&VecDeque<u64>> {
    states.iter().find_map(|s| match s {
        RuleState::Log(log) => Some(&**log),
        _ => None,
    })
}

/// One rule's verdict on the states as they stand; `algorithm` is `rule.algorithm()`
/// (see [`decide_one_then`]).
#[inline(always)]
fn evaluate(
    algorithm: Algorithm,
    rule: &Rule,
    state: &RuleState,
    log: Option<&VecDeque<u64>>,
    now: u64,
    cost: u64,
) -> Eval {
    match algorithm {
        Algorithm::FixedWindow => fixed_window::evaluate(rule, state, now, cost),
        Algorithm::SlidingWindow { precision } => {
            sliding_window::evaluate(rule, precision, state, now, cost)
        }
        Algorithm::SlidingLog => sliding_log::evaluate(rule, log, now, cost),
        Algorithm::TokenBucket { capacity } => {
            token_bucket::evaluate(rule, capacity, state, now, cost)
        }
        Algorithm::LeakyBucket(mode) => leaky_bucket::evaluate(rule, mode, state, now, cost),
        Algorithm::Gcra { burst } => gcra::evaluate(rule, burst, state, now, cost),
        Algorithm::Concurrent => concurrent::evaluate(rule, state, now),
    }
}

/// Writes the state a rule decided on, once the whole check commits.
#[inline(always)]
fn commit(rule: &Rule, state: &mut RuleState, next: &Next, log_limit: u64, now: u64, cost: u64) {
    match *next {
        Next::Window { index, count } => fixed_window::commit(state, index, count),
        Next::Counters { cur } => {
            let Algorithm::SlidingWindow { precision } = rule.algorithm() else {
                unreachable!("counters belong to the sliding window counter")
            };
            sliding_window::commit(precision, state, cur, cost)
        }
        Next::Log => sliding_log::commit(state, log_limit, now, cost),
        Next::Tokens { level, last } => token_bucket::commit(state, level, last),
        Next::Tat { us, frac } => gcra::commit(state, us, frac),
        // Taken by the callers, which hand the slot's number on.
        Next::Slot => {
            concurrent::commit(rule, state, now);
        }
    }
}

/// [`commit`] for one rule, returning [`expires_at`] of the new state: the algorithm
/// is known from `next`, so the expiry takes no second dispatch on the rule.
#[inline(always)]
fn commit_expiring(
    rule: &Rule,
    state: &mut RuleState,
    next: &Next,
    log_limit: u64,
    now: u64,
    cost: u64,
) -> u64 {
    match *next {
        // GCRA and both leaky bucket modes.
        Next::Tat { us, frac } => {
            gcra::commit(state, us, frac);
            gcra::expires_at(state)
        }
        Next::Window { index, count } => {
            fixed_window::commit(state, index, count);
            fixed_window::expires_at(rule, state)
        }
        _ => {
            commit(rule, state, next, log_limit, now, cost);
            expires_at(rule, state, own_log(state))
        }
    }
}

/// The moment from which the rule's state is equivalent to `Fresh`.
#[inline(always)]
fn expires_at(rule: &Rule, state: &RuleState, log: Option<&VecDeque<u64>>) -> u64 {
    expires_at_as(rule.algorithm(), rule, state, log)
}

/// [`expires_at`] with the rule's algorithm as a value (see [`decide_one_then`]).
#[inline(always)]
fn expires_at_as(
    algorithm: Algorithm,
    rule: &Rule,
    state: &RuleState,
    log: Option<&VecDeque<u64>>,
) -> u64 {
    match algorithm {
        Algorithm::FixedWindow => fixed_window::expires_at(rule, state),
        Algorithm::SlidingWindow { precision } => {
            sliding_window::expires_at(rule, precision, state)
        }
        Algorithm::SlidingLog => sliding_log::expires_at(rule, log),
        Algorithm::TokenBucket { capacity } => token_bucket::expires_at(rule, capacity, state),
        Algorithm::Gcra { .. } | Algorithm::LeakyBucket(_) => gcra::expires_at(state),
        Algorithm::Concurrent => concurrent::expires_at(state),
    }
}

#[cfg(test)]
mod refund_unspent_tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_lease_gives_back_its_unspent_units_undrained_part() {
        let gcra = Rule::gcra(10, Duration::from_secs(1), 10).unwrap();
        // 4 units reserved at 0: the TAT 400 ms ahead. At 50 ms, 3 unspent: the charge's
        // undrained part is 3.5 units, so all 3 go back.
        let mut tat = RuleState::Tat {
            us: 400_000,
            frac: 0,
        };
        assert!(refund_unspent(&gcra, &mut tat, 3, 4, 0, 50_000));
        assert_eq!(
            tat,
            RuleState::Tat {
                us: 100_000,
                frac: 0
            }
        );
        // At 250 ms only 1.5 units of the charge are still ahead: 1.5 go back, not 3.
        let mut tat = RuleState::Tat {
            us: 400_000,
            frac: 0,
        };
        assert!(refund_unspent(&gcra, &mut tat, 3, 4, 0, 250_000));
        assert_eq!(
            tat,
            RuleState::Tat {
                us: 250_000,
                frac: 0
            }
        );
        // A TAT not ahead of now: nothing to give back to.
        let mut idle = RuleState::Tat { us: 10, frac: 0 };
        assert!(!refund_unspent(&gcra, &mut idle, 3, 4, 0, 250_000));

        let window = Rule::fixed_window(10, Duration::from_secs(1)).unwrap();
        let mut count = RuleState::Window { index: 0, count: 5 };
        assert!(refund_unspent(&window, &mut count, 3, 4, 0, 900_000));
        assert_eq!(count, RuleState::Window { index: 0, count: 2 });
        // Never into another window than the reservation's.
        assert!(!refund_unspent(
            &window, &mut count, 1, 4, 1_000_000, 1_100_000
        ));

        let bucket = Rule::token_bucket(10, Duration::from_secs(1), 10).unwrap();
        let mut tokens = RuleState::Tokens {
            level: 9_500_000,
            last: 0,
        };
        // Up to the capacity, never past it.
        assert!(refund_unspent(&bucket, &mut tokens, 3, 4, 0, 0));
        assert_eq!(
            tokens,
            RuleState::Tokens {
                level: 10_000_000,
                last: 0
            }
        );

        let sliding = Rule::sliding_window(10, Duration::from_secs(1), 2).unwrap();
        let mut counters = RuleState::Counters {
            index: 0,
            counts: vec![5, 0, 0].into(),
        };
        assert!(!refund_unspent(&sliding, &mut counters, 3, 4, 0, 0));
    }
}

#[cfg(test)]
mod settle_tests {
    use super::*;
    use std::time::Duration;

    /// The issue's example: `1000/h fixed-window`, an estimate of 100 and an actual of
    /// 300 per request: four admitted, the fifth refused, the count at 1,200.
    #[test]
    fn an_excess_is_charged_as_debt_that_refuses_the_next_request() {
        let rules: RuleSet = "1000/h fixed-window".parse().unwrap();
        let mut states = vec![RuleState::Fresh];
        let t = 1_700_000_000_000_000 / 3_600_000_000 * 3_600_000_000;
        for i in 0..4 {
            assert!(
                decide(&rules, &mut states, t + i, 100).committed,
                "request {i}"
            );
            assert!(settle(&rules, &mut states, 100, 300, t + i, t + i));
        }
        let fifth = decide(&rules, &mut states, t + 4, 100);
        assert!(!fifth.decision.is_allowed());
        assert_eq!(
            fifth.decision.retry_after(),
            Some(Duration::from_micros(3_600_000_000 - 4))
        );
        assert_eq!(
            states[0],
            RuleState::Window {
                index: t / 3_600_000_000,
                count: 1_200
            }
        );
    }

    #[test]
    fn each_algorithm_holds_its_debt_where_the_docs_say() {
        let t = 1_000_000_000;
        // GCRA 10/s burst 5: 15 units from idle, capped at one period's 10, put the TAT
        // 1 s ahead, 0.5 s past the burst; a unit waits 0.6 s.
        let gcra: RuleSet = "10/s gcra burst=5".parse().unwrap();
        let mut s = vec![RuleState::Fresh];
        assert!(debit(&gcra, &mut s, 15, t));
        assert_eq!(
            s[0],
            RuleState::Tat {
                us: t + 1_000_000,
                frac: 0
            }
        );
        let d = decide(&gcra, &mut s.clone(), t, 1).decision;
        assert_eq!(d.retry_after(), Some(Duration::from_millis(600)));
        // At most burst + one period's limit ahead (1.5 s), whatever the excess.
        assert!(debit(&gcra, &mut s, u64::MAX, t));
        assert_eq!(
            s[0],
            RuleState::Tat {
                us: t + 1_500_000,
                frac: 0
            }
        );
        assert!(!debit(&gcra, &mut s, 1, t));

        // Token bucket 10/s capacity 5, full: 15 tokens, capped at 10, leave it 5 below
        // empty, the refill resuming 0.5 s on.
        let bucket: RuleSet = "10/s token-bucket capacity=5".parse().unwrap();
        let mut s = vec![RuleState::Fresh];
        assert!(debit(&bucket, &mut s, 15, t));
        assert_eq!(
            s[0],
            RuleState::Tokens {
                level: 0,
                last: t + 500_000
            }
        );
        let d = decide(&bucket, &mut s.clone(), t, 1).decision;
        assert_eq!(d.retry_after(), Some(Duration::from_millis(600)));
        // A refund repays the debt before it refills the level.
        let mut r = s.clone();
        assert!(refund(&bucket, &mut r, 3, t, t));
        assert_eq!(
            r[0],
            RuleState::Tokens {
                level: 0,
                last: t + 200_000
            }
        );
        assert!(refund(&bucket, &mut r, 5, t, t));
        assert_eq!(
            r[0],
            RuleState::Tokens {
                level: 3_000_000,
                last: t
            }
        );

        // Sliding window counter: the current sub-window above the limit.
        let sliding: RuleSet = "10/s sliding-window precision=2".parse().unwrap();
        let mut s = vec![RuleState::Fresh];
        assert!(debit(&sliding, &mut s, 25, t));
        assert_eq!(
            s[0],
            RuleState::Counters {
                index: t / 500_000,
                counts: vec![10, 0, 0].into()
            }
        );
        assert!(debit(&sliding, &mut s, 25, t));
        assert_eq!(
            s[0],
            RuleState::Counters {
                index: t / 500_000,
                counts: vec![20, 0, 0].into()
            }
        );
        assert!(!debit(&sliding, &mut s, 25, t));

        // Sliding log: at most a full log, logged now.
        let log: RuleSet = "3/s sliding-log".parse().unwrap();
        let mut s = vec![RuleState::Fresh];
        assert!(debit(&log, &mut s, 100, t));
        assert_eq!(s[0], RuleState::Log(Box::new([t, t, t].into())));
    }

    #[test]
    fn the_cap_keeps_gcra_and_buckets_exact_over_long_periods() {
        let day = Rule::gcra(1_000_000, Duration::from_secs(86_400), 1_000).unwrap();
        assert_eq!(debt_cap(&day), (1 << 51) / 86_400_000_000);
        let minute = Rule::gcra(40_000, Duration::from_secs(60), 40_000).unwrap();
        assert_eq!(debt_cap(&minute), 40_000);
        let rules = RuleSet::new(vec![day, minute]).unwrap();
        assert_eq!(settle_cap(&rules), 26_062);
    }
}
