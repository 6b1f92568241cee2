//! Handing the fallback's usage to the store when it answers again.
//!
//! While the store fails, the fallback store admits each instance's share and the store
//! never hears of it. The [`Handover`] keeps, per store key, what the fallback admitted
//! (the time and units of each admission, and the concurrency slots it gave that are
//! still held). When the store answers again, each pending key is handed over before the
//! store decides a check of it: the units that still count in an open window or state
//! are charged to the store unconditionally (as debt where they exceed the limit:
//! [`Store::settle`] from 0 to the units), and each slot still held is taken in the
//! store whatever its limit ([`Store::take_slot`]), so that the store counts it until
//! its request ends.
//!
//! A key is handed over by whichever comes first: a request of that key (its check waits
//! for the handover, which is one store call), or the background task that, while any
//! key is pending, asks the store every [`PROBE_EVERY`] whether it answers and, once it
//! does, hands every pending key over, many calls at once so that the store batches
//! them. See the crate docs, "While the store is down", for what this bounds.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use ratelimit_core::algo::settle_cap;
use ratelimit_core::util::BoundedLog;
use ratelimit_core::{Algorithm, LeakyMode, Rule, RuleSet, Store};

use super::state::Limiter;
use crate::key::KeyDigest;

/// How often the background task asks a failed store whether it answers again.
pub(crate) const PROBE_EVERY: Duration = Duration::from_millis(100);

/// How many keys the background task hands over at once.
const PARALLEL: usize = 64;

/// The most keys with usage to hand over; admissions of further keys are not kept (a
/// `WARN` says so).
pub(crate) const MAX_PENDING_KEYS: usize = 100_000;

/// The most admissions kept per key; beyond it the two oldest are merged, at the later
/// one's time (which counts them for longer, never shorter).
const MAX_ADMISSIONS: usize = 256;

/// Admissions closer together than a key's shortest period divided by this are kept
/// as one, at the later time (counted for longer, never shorter).
const GRAIN_PER_PERIOD: u64 = 64;

/// What a layer with the fallback policy keeps to hand over.
pub(crate) struct Handover {
    /// Whether to hand over at all (off only in tests of what happens without).
    pub(crate) enabled: bool,
    keys: Mutex<HashMap<Box<[u8]>, Pending>>,
    /// `keys.len()`, read without the lock on every request.
    count: AtomicUsize,
    /// Store slots that fallback slots were moved to: (store key, local slot) -> slot.
    moved: Mutex<Moved>,
    /// Whether the background task runs.
    task: AtomicBool,
    /// Signalled when a handover ends, for requests waiting on one.
    done: tokio::sync::Notify,
    /// When the store first answered after an outage (µs on the store's clock; 0: none).
    answered_at: AtomicU64,
    stats: Mutex<Stats>,
    log: BoundedLog,
}

/// Store slots by (store key, local slot).
type Moved = HashMap<(Box<[u8]>, u64), u64>;

/// What the handovers since the store answered again cost.
#[derive(Default)]
struct Stats {
    keys: u64,
    units: u64,
    slots: u64,
    slots_kept: u64,
    calls: u64,
    started: Option<Instant>,
}

/// What the fallback admitted for one key.
struct Pending {
    /// The rules the store decides the key with.
    rules: RuleSet,
    /// The fallback's rules, whose rates drain a bucket's usage.
    fallback_rules: RuleSet,
    /// (time on the store's clock, units), oldest first.
    admitted: Vec<(u64, u64)>,
    /// Admissions closer than this (µs) to the newest are merged into it.
    grain: u64,
    /// Local slots still held.
    slots: Vec<u64>,
    /// A handover of this key is under way.
    busy: bool,
}

/// A key's usage taken for a handover.
struct Taken {
    rules: RuleSet,
    fallback_rules: RuleSet,
    admitted: Vec<(u64, u64)>,
    slots: Vec<u64>,
}

impl Handover {
    pub(crate) fn new(enabled: bool) -> Self {
        Self {
            enabled,
            keys: Mutex::new(HashMap::new()),
            count: AtomicUsize::new(0),
            moved: Mutex::new(HashMap::new()),
            task: AtomicBool::new(false),
            done: tokio::sync::Notify::new(),
            answered_at: AtomicU64::new(0),
            stats: Mutex::new(Stats::default()),
            log: BoundedLog::new(),
        }
    }

    /// Whether `key` has usage to hand over (one atomic load when none has).
    #[inline]
    pub(crate) fn is_pending(&self, key: &[u8]) -> bool {
        self.count.load(Ordering::Acquire) != 0 && self.keys.lock().contains_key(key)
    }

    /// Keeps an admission of `cost` units by the fallback at `now`, and the slot it took.
    /// Answers whether the key is new (the caller then makes sure the task runs).
    fn record(
        &self,
        key: &[u8],
        rules: &RuleSet,
        fallback_rules: &RuleSet,
        now: u64,
        cost: u64,
        slot: Option<u64>,
    ) -> Result<(), ()> {
        let mut keys = self.keys.lock();
        let len = keys.len();
        let pending = match keys.get_mut(key) {
            Some(pending) => pending,
            None if len >= MAX_PENDING_KEYS => return Err(()),
            None => {
                self.count.store(len + 1, Ordering::Release);
                keys.entry(key.into()).or_insert_with(|| Pending {
                    rules: rules.clone(),
                    fallback_rules: fallback_rules.clone(),
                    admitted: Vec::new(),
                    grain: grain(rules),
                    slots: Vec::new(),
                    busy: false,
                })
            }
        };
        // Rules replaced meanwhile: the newest are the ones the store decides with.
        if pending.rules.id() != rules.id() {
            pending.rules = rules.clone();
            pending.fallback_rules = fallback_rules.clone();
            pending.grain = grain(rules);
        }
        if cost > 0 {
            match pending.admitted.last_mut() {
                Some(last) if now.saturating_sub(last.0) < pending.grain => {
                    *last = (now.max(last.0), last.1.saturating_add(cost));
                }
                _ => pending.admitted.push((now, cost)),
            }
            if pending.admitted.len() > MAX_ADMISSIONS {
                let (_, units) = pending.admitted.remove(0);
                pending.admitted[0].1 = pending.admitted[0].1.saturating_add(units);
            }
        }
        pending.slots.extend(slot);
        // The store failed this request: the next ones ask it before handing over.
        self.answered_at.store(0, Ordering::Release);
        Ok(())
    }

    /// Takes `key`'s usage for a handover, unless another is under way or there is none.
    fn take(&self, key: &[u8]) -> Option<Taken> {
        let mut keys = self.keys.lock();
        let pending = keys.get_mut(key)?;
        if pending.busy {
            return None;
        }
        pending.busy = true;
        Some(Taken {
            rules: pending.rules.clone(),
            fallback_rules: pending.fallback_rules.clone(),
            admitted: std::mem::take(&mut pending.admitted),
            slots: std::mem::take(&mut pending.slots),
        })
    }

    /// Ends a handover of `key`: what was handed over is gone; what is `left` (the store
    /// failed) goes back, before anything the fallback admitted meanwhile.
    fn finish(&self, key: &[u8], left: Option<Taken>) {
        let mut keys = self.keys.lock();
        if let Some(pending) = keys.get_mut(key) {
            pending.busy = false;
            if let Some(left) = left {
                let newer = std::mem::replace(&mut pending.admitted, left.admitted);
                pending.admitted.extend(newer);
                let newer = std::mem::replace(&mut pending.slots, left.slots);
                pending.slots.extend(newer);
            }
            if pending.admitted.is_empty() && pending.slots.is_empty() {
                keys.remove(key);
                self.count.store(keys.len(), Ordering::Release);
            }
        }
        drop(keys);
        self.done.notify_waiters();
    }

    /// Notes that the store answers again (the first time since the outage began).
    fn answered(&self, now: u64) {
        if self
            .answered_at
            .compare_exchange(0, now.max(1), Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            self.stats.lock().started.get_or_insert_with(Instant::now);
        }
    }

    /// Forgets a local slot released before it was handed over; answers the store slot
    /// it was moved to, if it was.
    pub(crate) fn released(&self, key: &[u8], slot: u64) -> Option<u64> {
        if let Some(pending) = self.keys.lock().get_mut(key) {
            if let Some(at) = pending.slots.iter().position(|&s| s == slot) {
                pending.slots.swap_remove(at);
                // An entry left empty goes at its next handover.
                return None;
            }
        }
        self.moved.lock().remove(&(Box::from(key), slot))
    }

    /// Pairs local slot `local` with the store slot `store` of the same request (one
    /// admitted by both in the grace after an outage): released and renewed as a moved
    /// slot is.
    pub(crate) fn pair(&self, key: &[u8], local: u64, store: u64) {
        self.moved.lock().insert((key.into(), local), store);
    }

    /// The store slot a local slot was moved to, if it was.
    pub(crate) fn moved_to(&self, key: &[u8], slot: u64) -> Option<u64> {
        self.moved.lock().get(&(Box::from(key), slot)).copied()
    }
}

/// The time within which a key's admissions are kept as one: its shortest period (a
/// concurrency rule's timeout aside) divided by [`GRAIN_PER_PERIOD`].
fn grain(rules: &RuleSet) -> u64 {
    (rules.rules().iter())
        .filter(|r| r.algorithm() != Algorithm::Concurrent)
        .map(|r| r.period_us() / GRAIN_PER_PERIOD)
        .min()
        .unwrap_or(0)
}

/// The units of `admitted` that `rule` still counts at `now`, had the store charged
/// them when the fallback admitted them; `fallback` is the fallback's twin of `rule`
/// (its rate drains a bucket's share), when known.
fn open_units(rule: &Rule, fallback: Option<&Rule>, admitted: &[(u64, u64)], now: u64) -> u64 {
    let period = rule.period_us();
    let since = |from: u64| {
        admitted
            .iter()
            .filter(|&&(t, _)| t >= from)
            .map(|&(_, u)| u)
            .fold(0u64, u64::saturating_add)
    };
    match rule.algorithm() {
        // The current window only: a closed window's count is gone from the store too.
        Algorithm::FixedWindow => since(now / period * period),
        // Every sub-window the counter still weighs: the last period and one sub-window
        // (charged now, they count in full for a period: never less than they would have).
        Algorithm::SlidingWindow { precision } => {
            since(now.saturating_sub(period + period / precision.max(1)))
        }
        Algorithm::SlidingLog => since(now.saturating_sub(period).saturating_add(1)),
        Algorithm::Concurrent => 0,
        // What has not drained at the fallback's rate: a bucket fed by this instance's
        // admissions alone, drained at its share of the rate (the fleet's shares drain at
        // most the whole rate together, so the sum over the instances is at least what
        // the fleet's usage left in the store's bucket).
        Algorithm::TokenBucket { .. }
        | Algorithm::Gcra { .. }
        | Algorithm::LeakyBucket(LeakyMode::Meter { .. } | LeakyMode::Shaper { .. }) => {
            let twin = fallback
                .filter(|f| {
                    std::mem::discriminant(&f.algorithm())
                        == std::mem::discriminant(&rule.algorithm())
                        && f.period_us() == period
                })
                .unwrap_or(rule);
            let (limit, period) = (u128::from(twin.limit()), u128::from(twin.period_us()));
            // In units × period: one unit is `period`, draining `limit` a microsecond.
            let mut level: u128 = 0;
            let mut last = 0u64;
            for &(t, units) in admitted {
                let drained = u128::from(t.saturating_sub(last)) * limit;
                level = level.saturating_sub(drained) + u128::from(units) * period;
                last = t;
            }
            let level = level.saturating_sub(u128::from(now.saturating_sub(last)) * limit);
            u64::try_from(level.div_ceil(period)).unwrap_or(u64::MAX)
        }
    }
}

/// The units to charge the store for `taken` at `now`: the most any rule still counts.
/// One charge goes to every rule, so a shorter rule may be charged more than it would
/// have counted: it refuses longer, never admits more.
fn units_to_charge(taken: &Taken, now: u64) -> u64 {
    let twins =
        (taken.fallback_rules.len() == taken.rules.len()).then(|| taken.fallback_rules.rules());
    (taken.rules.rules().iter().enumerate())
        .map(|(i, rule)| {
            let twin = twins.map(|t| &t[i]);
            open_units(rule, twin, &taken.admitted, now)
        })
        .max()
        .unwrap_or(0)
}

impl<S, K, C, T> Limiter<S, K, C, T>
where
    S: Store,
    K: Send + Sync + 'static,
    C: Send + Sync + 'static,
    T: Send + Sync + 'static,
{
    /// Keeps what the fallback admitted for `key`, to hand it over once the store
    /// answers, and makes sure the task that watches for that runs.
    pub(crate) fn record_fallback(
        this: &Arc<Self>,
        key: &[u8],
        rules: &RuleSet,
        fallback_rules: &RuleSet,
        cost: u64,
        slot: Option<u64>,
    ) {
        let Some(handover) = &this.handover else {
            return;
        };
        if !handover.enabled {
            return;
        }
        let now = this.store.now_us();
        if handover
            .record(key, rules, fallback_rules, now, cost, slot)
            .is_err()
        {
            if let Some(count) = handover.log.hit(now) {
                tracing::warn!(
                    keys = MAX_PENDING_KEYS,
                    requests = count,
                    "rate limit: too many keys decided by the fallback to remember; what \
                     the fallback admits for further keys will not be handed to the store \
                     when it answers (reported at most every 10 s)"
                );
            }
        }
        if !handover.task.swap(true, Ordering::AcqRel) {
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(Self::watch(Arc::downgrade(this)));
            } else {
                handover.task.store(false, Ordering::Release);
            }
        }
    }

    /// Hands `key`'s usage over before its check goes to the store, or waits for the
    /// handover under way (at most the store timeout, else a second). An error means the
    /// store failed: the request is then decided as any whose store call failed.
    pub(crate) async fn hand_over_key(&self, key: &[u8]) -> Result<(), String> {
        let Some(handover) = &self.handover else {
            return Ok(());
        };
        // Until the store is seen answering again, a request asks it with a check of
        // cost 0 (which charges nothing) before handing anything over: during the
        // outage that is the one call its check would have been.
        if handover.answered_at.load(Ordering::Acquire) == 0 {
            let Some(rules) = handover.keys.lock().get(key).map(|p| p.rules.clone()) else {
                return Ok(());
            };
            self.timed(self.store.check(key, &rules, 0)).await?;
            handover.answered(self.store.now_us());
        }
        let deadline = self.store_timeout.unwrap_or(Duration::from_secs(1));
        let started = tokio::time::Instant::now();
        loop {
            let notified = handover.done.notified();
            if !handover.is_pending(key) {
                return Ok(());
            }
            if let Some(taken) = handover.take(key) {
                return self.hand_over(handover, key, taken).await;
            }
            // Another handover of this key is under way.
            let left = deadline.saturating_sub(started.elapsed());
            if left.is_zero() || tokio::time::timeout(left, notified).await.is_err() {
                return Err("a handover of the key's fallback usage is still under way".into());
            }
        }
    }

    /// Charges the store with `taken` (slots first, each by a check that takes one; then
    /// the units as debt), and ends the handover of `key`.
    async fn hand_over(&self, handover: &Handover, key: &[u8], taken: Taken) -> Result<(), String> {
        let now = self.store.now_us();
        let mut units = units_to_charge(&taken, now);
        let mut calls = 0u64;
        let (mut moved, mut kept) = (0u64, 0u64);
        let mut slots = taken.slots.iter().copied();
        let mut result = Ok(());
        // A slot still held is taken in the store whatever its limit, with one unit
        // (`Store::take_slot`): the store then counts it until its request ends, and
        // refuses others while it holds the limit or more. Where the store takes none (a
        // state of other rules, a module older than takes), a check of one unit, decided
        // with the key's rates, may still take it; one that refuses too stays local until
        // released.
        for slot in slots.by_ref() {
            calls += 1;
            let at = match self.timed(self.store.take_slot(key, &taken.rules)).await {
                Ok(Some(at)) => Ok(Some(at)),
                Ok(None) => {
                    calls += 1;
                    match self.timed(self.store.check(key, &taken.rules, 1)).await {
                        Ok(decision) if decision.is_allowed() => Ok(decision.slot()),
                        Ok(_) => Ok(None),
                        Err(e) => Err(e),
                    }
                }
                Err(e) => Err(e),
            };
            match at {
                Ok(Some(at)) => {
                    handover.moved.lock().insert((key.into(), slot), at);
                    units = units.saturating_sub(1);
                    moved += 1;
                }
                Ok(None) => kept += 1,
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        // Charged in parts no rule caps (each rule takes one period's limit per charge).
        let part = settle_cap(&taken.rules).max(1);
        while result.is_ok() && units > 0 {
            let charge = units.min(part);
            calls += 1;
            match (self.timed(self.store.settle(key, &taken.rules, 0, charge, now))).await {
                Ok(_) => units -= charge,
                Err(e) => result = Err(e),
            }
        }
        let charged = units_to_charge(&taken, now) - units;
        match &result {
            Ok(()) => {
                handover.finish(key, None);
                let mut stats = handover.stats.lock();
                stats.keys += 1;
                stats.units += charged;
                stats.slots += moved;
                stats.slots_kept += kept;
                stats.calls += calls;
            }
            Err(error) => {
                // What was not charged goes back (slots moved stay moved); retried at the
                // next request of the key or by the task.
                let left = Taken {
                    admitted: if units == 0 {
                        Vec::new()
                    } else {
                        taken.admitted
                    },
                    slots: slots.collect(),
                    ..taken
                };
                tracing::debug!(
                    key = %KeyDigest(key),
                    %error,
                    "rate limit: handing the fallback's usage to the store failed; kept to \
                     try again"
                );
                handover.finish(key, Some(left));
            }
        }
        result
    }

    async fn timed<V>(
        &self,
        call: impl std::future::Future<Output = Result<V, S::Error>>,
    ) -> Result<V, String> {
        match self.store_timeout {
            None => call.await.map_err(|e| e.to_string()),
            Some(t) => match tokio::time::timeout(t, call).await {
                Ok(r) => r.map_err(|e| e.to_string()),
                Err(_) => Err(format!("no answer within the store timeout of {t:?}")),
            },
        }
    }

    /// While any key is pending: asks the store every [`PROBE_EVERY`] whether it answers
    /// (a check of cost 0 on a pending key, which charges nothing) and, once it does,
    /// hands every pending key over. Ends when nothing is pending or the layer is gone.
    async fn watch(this: Weak<Self>) {
        loop {
            tokio::time::sleep(PROBE_EVERY).await;
            let Some(limiter) = this.upgrade() else {
                return;
            };
            let Some(handover) = &limiter.handover else {
                return;
            };
            let probe = {
                let keys = handover.keys.lock();
                keys.iter()
                    .next()
                    .map(|(key, pending)| (key.clone(), pending.rules.clone()))
            };
            let Some((key, rules)) = probe else {
                // Handed over by requests of the keys: say what it took.
                limiter.summarize(handover);
                handover.task.store(false, Ordering::Release);
                // Recorded between the look and the flag: run on.
                if handover.count.load(Ordering::Acquire) == 0
                    || handover.task.swap(true, Ordering::AcqRel)
                {
                    return;
                }
                continue;
            };
            if limiter
                .timed(limiter.store.check(&key, &rules, 0))
                .await
                .is_err()
            {
                continue;
            }
            limiter.hand_over_all(handover).await;
        }
    }

    /// Hands every pending key over, [`PARALLEL`] at a time, and says what it cost.
    async fn hand_over_all(&self, handover: &Handover) {
        handover.answered(self.store.now_us());
        let keys: Vec<Box<[u8]>> = handover.keys.lock().keys().cloned().collect();
        let mut failed = false;
        for chunk in keys.chunks(PARALLEL) {
            let results = futures_util::future::join_all(chunk.iter().map(|key| async move {
                match handover.take(key) {
                    Some(taken) => self.hand_over(handover, key, taken).await,
                    // A request of the key is handing it over.
                    None => Ok(()),
                }
            }))
            .await;
            failed |= results.iter().any(Result::is_err);
        }
        if !failed && handover.count.load(Ordering::Acquire) == 0 {
            self.summarize(handover);
        }
    }

    /// Logs what the handovers since the store answered again took, once they are done.
    fn summarize(&self, handover: &Handover) {
        let stats = std::mem::take(&mut *handover.stats.lock());
        if stats.keys == 0 {
            return;
        }
        let took_ms = stats.started.map_or(0, |s| s.elapsed().as_millis() as u64);
        tracing::info!(
            namespace = &*self.namespace,
            keys = stats.keys,
            units = stats.units,
            slots = stats.slots,
            slots_kept_local = stats.slots_kept,
            store_calls = stats.calls,
            took_ms,
            "rate limit: the store answers again; handed it what the fallback admitted \
             (units still counting in open windows, charged as debt where over the limit, \
             and slots still held) before it decided those keys again"
        );
        if stats.slots_kept > 0 {
            tracing::warn!(
                namespace = &*self.namespace,
                slots = stats.slots_kept,
                "rate limit: the store took some slots the fallback gave by no means (their \
                 keys' states were written under other rules, or the store cannot take a \
                 slot over the limit: a ratelimit module older than the store's); they stay \
                 local until their requests end, and their keys may have more in flight \
                 than the limit until then"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000;

    fn rule(text: &str) -> Rule {
        let set: RuleSet = text.parse().unwrap();
        set.rules()[0].clone()
    }

    #[test]
    fn admissions_close_together_are_kept_as_one_at_the_later_time() {
        let rules: RuleSet = "64/s fixed-window; 1000/h".parse().unwrap();
        let handover = Handover::new(true);
        // The grain is 1 s / 64 = 15,625 µs.
        for (t, units) in [(10 * S, 1), (10 * S + 15_000, 2), (10 * S + 40_000, 3)] {
            handover
                .record(b"k", &rules, &rules, t, units, None)
                .unwrap();
        }
        handover
            .record(b"k", &rules, &rules, 11 * S, 0, Some(7))
            .unwrap();
        let taken = handover.take(b"k").unwrap();
        assert_eq!(taken.admitted, [(10 * S + 15_000, 3), (10 * S + 40_000, 3)]);
        assert_eq!(taken.slots, [7]);
        assert!(handover.take(b"k").is_none(), "one handover at a time");
        handover.finish(b"k", None);
        assert!(!handover.is_pending(b"k"));
    }

    #[test]
    fn only_what_still_counts_is_handed_over() {
        let admitted = [(10 * S, 2), (11 * S + 5, 3), (11 * S + 900_000, 1)];
        let now = 11 * S + 950_000;
        assert_eq!(
            open_units(&rule("10/s fixed-window"), None, &admitted, now),
            4
        );
        assert_eq!(
            open_units(&rule("10/min fixed-window"), None, &admitted, now),
            6
        );
        assert_eq!(
            open_units(&rule("10/s sliding-log"), None, &admitted, now),
            4
        );
        // The last period and one sub-window.
        assert_eq!(
            open_units(&rule("10/s sliding-window"), None, &admitted, now),
            6
        );
        assert_eq!(open_units(&rule("4 concurrent"), None, &admitted, now), 0);
        // A 2/s share of 8/s drains a unit every 0.5 s: 3 units at 11 s (the first 2
        // drained), 2.8 at 11.9 s, 2.7 at 11.95 s: 3 charged.
        let gcra = rule("8/s gcra burst=8");
        let share = rule("2/s gcra burst=2");
        assert_eq!(open_units(&gcra, Some(&share), &admitted, now), 3);
        // At the whole rate (no twin), a unit every 125 ms: 1 left.
        assert_eq!(open_units(&gcra, None, &admitted, now), 1);
        assert_eq!(open_units(&gcra, Some(&share), &admitted, 20 * S), 0);
    }
}
