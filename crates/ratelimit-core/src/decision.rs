use std::time::Duration;

use smallvec::SmallVec;

/// What happened to a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Every rule admitted it (possibly after [`Decision::delay`]).
    Allowed,
    /// At least one rule denied it; nothing was consumed.
    Limited,
    /// The key is blocked; no rule was consulted.
    Blocked,
}

/// One rule's view of a check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RuleOutcome {
    /// Whether this rule admits the request.
    pub allowed: bool,
    /// The rule's limit (units per period).
    pub limit: u64,
    /// Units still available after this check (for a denied or peeking check: available now).
    pub remaining: u64,
    /// Time until the rule's full quota is available again.
    pub reset_after: Duration,
    /// On a denial by this rule: the time after which the same request would be admitted.
    pub retry_after: Option<Duration>,
}

/// The answer to a check: the verdict, the delay a shaping rule asks for, and each rule's
/// limit, remaining quota and reset time.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Decision {
    outcome: Outcome,
    delay: Duration,
    retry_after: Option<Duration>,
    rules: SmallVec<[RuleOutcome; 2]>,
    slot: Option<u64>,
}

impl Decision {
    /// A decision from each rule's outcome, in rule-set order: allowed when every rule
    /// admits; otherwise limited, with `retry_after` the largest over the denying rules.
    /// `delay` is kept only when allowed.
    pub fn from_rules(rules: impl IntoIterator<Item = RuleOutcome>, delay: Duration) -> Self {
        Self::from_outcomes(rules.into_iter().collect(), delay)
    }

    /// The decision of a one-rule check.
    #[inline]
    pub(crate) fn single(rule: RuleOutcome, delay: Duration) -> Self {
        let (outcome, delay, retry_after) = if rule.allowed {
            (Outcome::Allowed, delay, None)
        } else {
            (Outcome::Limited, Duration::ZERO, rule.retry_after)
        };
        let mut rules = SmallVec::new();
        rules.push(rule);
        Decision {
            outcome,
            delay,
            retry_after,
            rules,
            slot: None,
        }
    }

    pub(crate) fn from_outcomes(rules: SmallVec<[RuleOutcome; 2]>, delay: Duration) -> Self {
        let allowed = rules.iter().all(|r| r.allowed);
        if allowed {
            Decision {
                outcome: Outcome::Allowed,
                delay,
                retry_after: None,
                rules,
                slot: None,
            }
        } else {
            let retry_after = rules.iter().filter_map(|r| r.retry_after).max();
            Decision {
                outcome: Outcome::Limited,
                delay: Duration::ZERO,
                retry_after,
                rules,
                slot: None,
            }
        }
    }

    /// A denial because the key is blocked; `retry_after` is the time left on the block,
    /// `None` for a block without end.
    pub fn blocked(retry_after: Option<Duration>) -> Self {
        Decision {
            outcome: Outcome::Blocked,
            delay: Duration::ZERO,
            retry_after,
            rules: SmallVec::new(),
            slot: None,
        }
    }

    /// The verdict.
    #[inline]
    pub fn outcome(&self) -> Outcome {
        self.outcome
    }

    /// True when the request may proceed (after [`Decision::delay`]).
    #[inline]
    pub fn is_allowed(&self) -> bool {
        self.outcome == Outcome::Allowed
    }

    /// How long a shaping rule asks the admitted request to wait; zero otherwise.
    #[inline]
    pub fn delay(&self) -> Duration {
        self.delay
    }

    /// For a denial: when the same request would be admitted (the largest over the denying
    /// rules, or the time left on a block). `None` when allowed or blocked without end.
    #[inline]
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }

    /// The slot an admitted check took under the set's `N concurrent` rule: the number to
    /// give [`Store::release`](crate::Store::release) when the request has ended, and
    /// [`Store::renew`](crate::Store::renew) while it runs. `None` when the set has no
    /// such rule, on a refusal, and on a peek (cost 0).
    #[inline]
    pub fn slot(&self) -> Option<u64> {
        self.slot
    }

    /// This decision holding `slot` (see [`Decision::slot`]): for a store that decides
    /// elsewhere (Redis) and builds the decision from the reply.
    #[inline]
    #[must_use]
    pub fn with_slot(mut self, slot: Option<u64>) -> Self {
        self.slot = slot;
        self
    }

    /// Each rule's outcome, in rule-set order (empty when blocked).
    #[inline]
    pub fn rules(&self) -> &[RuleOutcome] {
        &self.rules
    }
}
