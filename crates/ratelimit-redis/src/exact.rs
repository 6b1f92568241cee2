//! The exact path: every store operation as the request that carries it to Redis, the
//! native module's command or the Lua function as the servers allow ([`script`](crate::script) builds
//! either form from what the transport learned), handed to the [`Batcher`] below; and
//! each reply read back into a decision. Lease mode sits above it and knows nothing of
//! requests; the batcher below knows nothing of decisions.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ratelimit_core::packed::Edit;
use ratelimit_core::util::{BoundedLog, RELEASE_RETRY_WAITS};
use ratelimit_core::{Algorithm, Decision, RuleSet};
use redis::Value;

use crate::batch::{check_error, Batcher, Detached, OLDER_MODULE};
use crate::error::RedisStoreError;
use crate::keys::KeyNames;
use crate::script::{
    block_us, Call, CheckArgs, CheckJob, CheckReply, Request, Script, Time, BLOCK, DEBIT,
    GIVE_BACK, REFUND, RELEASE, RENEW,
};
use crate::shared::Shared;

/// The most units one debit charges any rule of `rules`: the largest of their caps (a
/// sliding log's is its length, the largest sliding-log limit, at most its rule's).
fn max_debt(rules: &RuleSet) -> u64 {
    rules
        .rules()
        .iter()
        .map(ratelimit_core::algo::debt_cap)
        .max()
        .unwrap_or(1)
}

/// Units a lease reserved and did not spend, as the module's and the Lua `refund` take
/// them back.
pub(crate) struct Unspent<'a> {
    pub(crate) units: u64,
    /// When the reservation charged them, on the store's clock.
    pub(crate) start_us: u64,
    /// The units the reservation charged.
    pub(crate) granted: u64,
    /// Per rule: the fixed window the reservation charged (0 for other algorithms).
    pub(crate) windows: &'a [u64],
}

/// The store's operations decided in Redis, one request each (checks batched).
pub(crate) struct Exact {
    shared: Arc<Shared>,
    batcher: Batcher,
    /// Foreign values replaced, reported at a bounded rate.
    heal_log: BoundedLog,
    /// Refunds (`give_back`) that failed, reported at a bounded rate.
    give_back_log: BoundedLog,
}

impl std::fmt::Debug for Exact {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.shared.fmt(f)
    }
}

impl Exact {
    pub(crate) fn new(shared: Arc<Shared>, batcher: Batcher) -> Self {
        Self {
            shared,
            batcher,
            heal_log: BoundedLog::new(),
            give_back_log: BoundedLog::new(),
        }
    }

    /// The store's configuration and what its transport learned.
    pub(crate) fn shared(&self) -> &Shared {
        &self.shared
    }

    /// The injected clock's time when one is set; otherwise this host's reading of the
    /// Redis server's `TIME`, or this host's clock until a reading arrives.
    pub(crate) fn now_us(&self) -> u64 {
        self.shared.store_now_us()
    }

    /// Sends `request` within the store's timeout.
    async fn run(&self, request: Request<'_>) -> Result<Value, RedisStoreError> {
        self.batcher.call(&request).await
    }

    /// One check decided by Redis.
    pub(crate) async fn check(
        &self,
        key: &[u8],
        rules: &RuleSet,
        cost: u64,
    ) -> Result<Decision, RedisStoreError> {
        let shared = &self.shared;
        let mut job = CheckJob::new(
            &shared.prefix,
            key,
            rules,
            self.time(),
            cost,
            shared.ttl_floor_ms,
        );
        job.sent_at = self.now_us();
        let bytes = self.batcher.decide(job).await?;
        let (decision, healed) = match CheckReply::decision_from(rules, &bytes)? {
            Ok(decided) => decided,
            Err(redis_now) => {
                // Redis got to the check after its deadline (the reply outran our timer,
                // or the deadline was early): it charged nothing. Learn the clock again.
                shared.redis_clock.observe(redis_now, Instant::now());
                return Err(RedisStoreError::Timeout(shared.timeout));
            }
        };
        if healed {
            if let Some(count) = self.heal_log.hit(self.now_us()) {
                tracing::warn!(
                    prefix = %shared.prefix,
                    replaced = count,
                    "a rate-limit key held a value this store did not write; it was read as \
                     empty and replaced. Something else writes under the store's prefix: give \
                     the store a prefix of its own (reported at most every 10 s, with the \
                     values replaced since the last report)"
                );
            }
        }
        Ok(decision)
    }

    /// A call of `script` in the form `give_back` and `debit` share, decided once (see
    /// `Call::arg_once`): the key's state (and its sliding log, when a rule is one), then
    /// the check's packed values for `units`, then `extra` (a give-back's charge time).
    fn state_call(
        &self,
        script: &'static Script,
        key: &[u8],
        rules: &RuleSet,
        units: u64,
        extra: Option<u64>,
    ) -> Call<'_> {
        let has_log = rules.log_limit() > 0;
        let keys = 1 + usize::from(has_log);
        let mut names = KeyNames::new(&self.shared.prefix, key);
        let mut call = script.call(
            &self.shared.paths,
            names.state().as_bytes(),
            keys,
            keys + 1 + usize::from(extra.is_some()),
        );
        call.cmd.arg(names.state());
        if has_log {
            call.cmd.arg(names.log());
        }
        let time = Time {
            now: self.injected_now(),
            deadline: None,
        };
        CheckArgs::write(&mut call.cmd, time, units, self.shared.ttl_floor_ms, rules);
        if let Some(extra) = extra {
            call.cmd.arg(extra);
        }
        call.arg_once(names.state(), self.shared.record_keep_ms());
        call
    }

    /// Gives back `cost` units a check of `key` under `rules` charged at `charged_at`;
    /// whether anything changed.
    pub(crate) async fn give_back(
        &self,
        key: &[u8],
        rules: &RuleSet,
        cost: u64,
        charged_at: u64,
    ) -> Result<bool, RedisStoreError> {
        let edit = Edit::GiveBack { charged_at };
        let reply = self.edit(key, Some(rules), edit, cost, || {
            self.state_call(&GIVE_BACK, key, rules, cost, Some(charged_at))
        });
        let changed = reply.await.inspect_err(|e| {
            if let Some(count) = self.give_back_log.hit(self.now_us()) {
                tracing::warn!(
                    error = %e,
                    failed_refunds = count,
                    "units a check charged could not be given back to Redis: they stay \
                     charged, so the key admits less than its limit until they drain \
                     (reported at most every 10 s, with the refunds failed since the last \
                     report)"
                );
            }
        })?;
        Ok(changed)
    }

    /// Charges `units` to `key` under `rules` unconditionally, as debt where a state goes
    /// past its limit (a settle above the estimate); whether anything changed.
    pub(crate) async fn debit(
        &self,
        key: &[u8],
        rules: &RuleSet,
        units: u64,
    ) -> Result<bool, RedisStoreError> {
        // No rule takes more than its limit (below 2^53) from one settle: the units sent
        // are the most any rule takes, so they fit the encoding.
        let units = units.min(max_debt(rules));
        let reply = self.edit(key, Some(rules), Edit::Debit, units, || {
            self.state_call(&DEBIT, key, rules, units, None)
        });
        let changed = reply.await.inspect_err(|e| {
            if let Some(count) = self.give_back_log.hit(self.now_us()) {
                tracing::warn!(
                    error = %e,
                    failed_settles = count,
                    "a metered request's cost above its estimate could not be charged to \
                     Redis: the key keeps only its estimate charged (reported at most every \
                     10 s, with the settles and refunds failed since the last report)"
                );
            }
        })?;
        Ok(changed)
    }

    /// Runs an edit of `key`'s state after its check: queued with the checks and sent in
    /// their batch where the servers take edits there (`Paths::edits_batched`), else as
    /// `call`, a call of its own. Whether it changed the state.
    async fn edit<'a>(
        &'a self,
        key: &[u8],
        rules: Option<&RuleSet>,
        edit: Edit,
        units: u64,
        call: impl FnOnce() -> Call<'a>,
    ) -> Result<bool, RedisStoreError> {
        let shared = &self.shared;
        let job = || {
            CheckJob::edit(
                &shared.prefix,
                key,
                rules,
                edit,
                self.injected_now(),
                units,
                shared.ttl_floor_ms,
            )
        };
        self.edit_job(job, call).await
    }

    /// Runs the edit `job` makes in the checks' batch where the servers take edits there,
    /// else as `call`, a call of its own (see [`edit`](Self::edit)).
    async fn edit_job<'a>(
        &'a self,
        job: impl FnOnce() -> CheckJob,
        call: impl FnOnce() -> Call<'a>,
    ) -> Result<bool, RedisStoreError> {
        let shared = &self.shared;
        if shared.paths.edits_batched.load(Ordering::Relaxed) {
            let reply = self
                .batched_edit(job())
                .await
                .and_then(|bytes| CheckReply::edited(&bytes));
            match reply {
                Ok(changed) => return Ok(changed),
                // A module older than edits in batches (a node restarted with one) refused
                // it as a check, nothing written: from now on edits go alone, and this
                // one goes now.
                Err(e) if e.to_string().contains(OLDER_MODULE) => {
                    tracing::info!(
                        "a server's ratelimit module does not take edits in batches (an \
                         older module): settles and releases go as calls of their own until \
                         a reconnection finds every module current"
                    );
                    shared.paths.edits_batched.store(false, Ordering::Relaxed);
                }
                Err(e) => return Err(e),
            }
        }
        let reply = self.run(Request::Call(call())).await?;
        Ok(matches!(reply, Value::Int(1)))
    }

    /// Runs the edit `job` in the checks' batch: its reply's bytes, or its failure entry
    /// as the error (a check alone answers its failure as a batch entry too).
    async fn batched_edit(&self, job: CheckJob) -> Result<Vec<u8>, RedisStoreError> {
        let bytes = self.batcher.decide(job).await?;
        match CheckReply::len(0, &bytes) {
            Some(Err(message)) => Err(check_error(&bytes[message], self.shared.timeout)),
            _ => Ok(bytes),
        }
    }

    /// Queues an edit of `key`'s state that no caller waits for, in the checks' batch
    /// (see [`Batcher::detach`]); `false` when the servers do not take edits in batches
    /// or the store does not batch, and the caller awaits it instead.
    fn edit_detached(
        &self,
        key: &[u8],
        rules: Option<&RuleSet>,
        edit: Edit,
        units: u64,
        detached: Detached,
    ) -> bool {
        let shared = &self.shared;
        if !shared.paths.edits_batched.load(Ordering::Relaxed) {
            return false;
        }
        let job = CheckJob::edit(
            &shared.prefix,
            key,
            rules,
            edit,
            self.injected_now(),
            units,
            shared.ttl_floor_ms,
        );
        self.batcher.detach(job, detached)
    }

    /// Resolves once every release and settle handed over so far is done with.
    pub(crate) async fn flushed(&self) {
        self.batcher.flushed().await;
    }

    /// Frees slot `slot` of `key` without a caller waiting: retried as the tower layer
    /// retries a release (a slot is freed once, so a second run frees nothing more).
    pub(crate) fn release_detached(&self, key: &[u8], slot: u64) -> bool {
        self.edit_detached(
            key,
            None,
            Edit::Release { slot },
            0,
            Detached {
                what: "concurrency slot's release",
                leaves: "the slot stays taken until its deadline",
                retries: &RELEASE_RETRY_WAITS,
                tried: 0,
            },
        )
    }

    /// Settles a charge without a caller waiting: a smaller actual gives back (tried
    /// once: twice would lend what other requests may take), a larger one charges debt
    /// (tried twice: twice limits more, never less).
    pub(crate) fn settle_detached(
        &self,
        key: &[u8],
        rules: &RuleSet,
        charged: u64,
        actual: u64,
        charged_at: u64,
    ) -> bool {
        match actual.cmp(&charged) {
            std::cmp::Ordering::Equal => true,
            std::cmp::Ordering::Less => self.edit_detached(
                key,
                Some(rules),
                Edit::GiveBack { charged_at },
                charged - actual,
                Detached {
                    what: "settle's give-back",
                    leaves: "the estimate stays charged",
                    retries: &[],
                    tried: 0,
                },
            ),
            std::cmp::Ordering::Greater => self.edit_detached(
                key,
                Some(rules),
                Edit::Debit,
                (actual - charged).min(max_debt(rules)),
                Detached {
                    what: "settle's debt",
                    leaves: "only the estimate is charged",
                    retries: &RELEASE_RETRY_WAITS[..1],
                    tried: 0,
                },
            ),
        }
    }

    /// Frees slot `slot` of `key` (`release`), or moves its deadline to now plus
    /// `renew_us` (`renew`); whether it was held and live. One call on the key's state,
    /// routed by it on a Cluster as every call on the key.
    pub(crate) async fn edit_slot(
        &self,
        key: &[u8],
        slot: u64,
        renew_us: Option<u64>,
    ) -> Result<bool, RedisStoreError> {
        let edit = match renew_us {
            None => Edit::Release { slot },
            Some(timeout_us) => Edit::Renew { slot, timeout_us },
        };
        self.edit(key, None, edit, 0, || {
            let mut names = KeyNames::new(&self.shared.prefix, key);
            let (script, args) = match renew_us {
                None => (&**RELEASE, 2),
                Some(_) => (&**RENEW, 4),
            };
            let mut call = script.call(&self.shared.paths, names.state().as_bytes(), 1, 1 + args);
            call.cmd.arg(names.state());
            self.now_arg(&mut call.cmd);
            call.cmd.arg(slot);
            if let Some(timeout) = renew_us {
                call.cmd.arg(timeout).arg(self.shared.ttl_floor_ms);
            }
            call.arg_once(names.state(), self.shared.record_keep_ms());
            call
        })
        .await
    }

    /// Takes a slot of `rules`' concurrency rule for `key` whatever its limit and charges
    /// one unit as debt ([`Edit::Take`]), in the checks' batch; `None` when it took none
    /// (no concurrency rule, a state of other rules), or when a server cannot take it (a
    /// module older than takes, or one older than edits in batches).
    pub(crate) async fn take_slot(
        &self,
        key: &[u8],
        rules: &RuleSet,
    ) -> Result<Option<u64>, RedisStoreError> {
        let shared = &self.shared;
        if rules.concurrent().is_none() || !shared.paths.edits_batched.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let job = CheckJob::edit(
            &shared.prefix,
            key,
            Some(rules),
            Edit::Take,
            self.injected_now(),
            1,
            shared.ttl_floor_ms,
        );
        match self.batched_edit(job).await {
            Ok(bytes) => CheckReply::edit_value(&bytes),
            // A module that knows edits but not this one refused it, nothing written.
            Err(e) if e.to_string().contains("unknown edit") => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Gives a lease's unspent units back to the state named `state`: in the checks'
    /// batch where the servers take edits there, else a call of its own.
    pub(crate) async fn refund_unspent(
        &self,
        state: &str,
        rules: &RuleSet,
        unspent: &Unspent<'_>,
    ) -> Result<(), RedisStoreError> {
        if unspent.units == 0 {
            return Ok(());
        }
        let edit = Edit::Refund {
            start_us: unspent.start_us,
            granted: unspent.granted,
        };
        let shared = &self.shared;
        let job = || {
            CheckJob::edit_of_state(
                state,
                rules,
                edit,
                self.injected_now(),
                unspent.units,
                shared.ttl_floor_ms,
            )
        };
        self.edit_job(job, || self.refund_call(state, rules, unspent))
            .await
            .map(drop)
    }

    /// A lease refund as a call of its own.
    fn refund_call(&self, state: &str, rules: &RuleSet, unspent: &Unspent<'_>) -> Call<'_> {
        let mut call = REFUND.call(&self.shared.paths, state.as_bytes(), 1, 5 + 5 * rules.len());
        call.cmd.arg(state);
        self.now_arg(&mut call.cmd);
        call.cmd
            .arg(unspent.units)
            .arg(unspent.start_us)
            .arg(unspent.granted);
        for ((rule, &id), &window) in rules
            .rules()
            .iter()
            .zip(rules.rule_ids())
            .zip(unspent.windows)
        {
            call.cmd
                .arg(id)
                .arg(algorithm_code(rule.algorithm()))
                .arg(rule.limit())
                .arg(rule.period_us())
                .arg(window);
        }
        call.arg_once(state, self.shared.record_keep_ms());
        call
    }

    /// Blocks `key` for `duration` (for good without one): in the checks' batch where
    /// the servers take edits there, so that a check queued after it sees it, else a call
    /// of its own.
    pub(crate) async fn block(
        &self,
        key: &[u8],
        duration: Option<Duration>,
    ) -> Result<(), RedisStoreError> {
        let length_us = duration.map(block_us);
        let edit = Edit::Block { length_us };
        self.edit(key, None, edit, 0, || {
            let mut names = KeyNames::new(&self.shared.prefix, key);
            let mut call = BLOCK.call(&self.shared.paths, names.block().as_bytes(), 1, 4);
            call.cmd.arg(names.block());
            self.now_arg(&mut call.cmd);
            match length_us {
                Some(us) => call.cmd.arg(us),
                None => call.cmd.arg(""),
            };
            call.cmd.arg(self.shared.ttl_floor_ms);
            call
        })
        .await
        .map(drop)
    }

    pub(crate) async fn unblock(&self, key: &[u8]) -> Result<(), RedisStoreError> {
        let mut cmd = redis::cmd("DEL");
        cmd.arg(KeyNames::new(&self.shared.prefix, key).block());
        self.run(Request::Cmd(cmd)).await.map(drop)
    }

    /// Forgets every rule's state of `key`: the state and the log (a block stays).
    pub(crate) async fn reset(&self, key: &[u8]) -> Result<(), RedisStoreError> {
        let mut names = KeyNames::new(&self.shared.prefix, key);
        let mut cmd = redis::cmd("DEL");
        cmd.arg(names.state()).arg(names.log());
        self.run(Request::Cmd(cmd)).await.map(drop)
    }

    /// The injected clock's time; `None` under Redis `TIME`.
    fn injected_now(&self) -> Option<u64> {
        self.shared.clock.as_ref().map(|clock| clock.now_us())
    }

    /// The `now` argument of `refund` and `block`: the injected clock's time, or empty
    /// for the server's.
    fn now_arg(&self, cmd: &mut redis::Cmd) {
        match self.injected_now() {
            Some(now) => cmd.arg(now),
            None => cmd.arg(""),
        };
    }

    /// A check's time: the injected clock's, and when the caller stops waiting.
    fn time(&self) -> Time {
        Time {
            now: self.injected_now(),
            deadline: self.shared.redis_clock.deadline(self.shared.timeout),
        }
    }
}

/// check.lua's code for an algorithm, as its `refund` reads it.
fn algorithm_code(algorithm: Algorithm) -> u64 {
    match algorithm {
        Algorithm::FixedWindow => 1,
        Algorithm::TokenBucket { .. } => 4,
        Algorithm::LeakyBucket(_) => 5,
        _ => 6,
    }
}
