use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use ratelimit_core::Decision;

use crate::charge::Charge;
use crate::headers::Fields;
use crate::rejection::Refusal;

/// What becomes of a request.
pub(crate) enum Verdict {
    /// Call the inner service, now or after a delay.
    Pass(Pass),
    /// Answer without calling the inner service.
    Refuse(Box<Refusal>),
}

/// An admitted request: call the inner service after `delay`, adding `fields` to its
/// response; the store's decision, if any, goes into the request's extensions.
pub(crate) struct Pass {
    pub(crate) delay: Duration,
    pub(crate) fields: Option<Fields>,
    /// Boxed: only a decision that arrives later (from a store that is not in process)
    /// travels in the verdict, and a verdict is moved several times.
    pub(crate) decision: Option<Box<Decision>>,
    /// What the store charged, to be given back if the response says it does not
    /// count; only when the layer settles charges.
    pub(crate) charge: Option<Box<Charge>>,
}

/// Who charged a request the store's answer admits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Charged {
    /// Nobody: denied, or the store failed and the layer did not fall back.
    No,
    Store,
    Fallback,
}

impl Verdict {
    /// Passed without asking the store: no delay, no fields, no decision.
    pub(crate) const UNCHECKED: Verdict = Verdict::Pass(Pass {
        delay: Duration::ZERO,
        fields: None,
        decision: None,
        charge: None,
    });
}

pub(crate) type CheckFuture = Pin<Box<dyn Future<Output = Verdict> + Send>>;

/// A verdict now, or once the store answers.
pub(crate) enum Begin {
    Now(Verdict),
    Later(CheckFuture),
}
