//! Metered costs: a charge settled to the request's actual cost, read from the response
//! head ([`settle_with`](crate::RateLimitLayerBuilder::settle_with)) or reported through
//! [`Usage`] before the response body ends.

use std::sync::Arc;

use http::header::HeaderName;
use http::response::Parts;
use ratelimit_core::util::BoundedLog;

use crate::charge::{Charge, Refund};
use crate::usage::Usage;

/// The actual cost read from a response head.
pub(crate) type SettleWith = Arc<dyn Fn(&Parts) -> Option<u64> + Send + Sync>;

/// How a layer settles its charges.
#[derive(Clone, Default)]
pub(crate) struct Metering {
    pub(crate) settle_with: Option<SettleWith>,
    pub(crate) usage_extension: bool,
    pub(crate) max_debt: Option<u64>,
}

impl Metering {
    /// Whether charges are settled at all.
    pub(crate) fn is_on(&self) -> bool {
        self.settle_with.is_some() || self.usage_extension
    }
}

/// A header's decimal count, or `None` (with a bounded `WARN` when it is there but is
/// not one).
pub(crate) fn from_header(name: &str) -> SettleWith {
    let name = HeaderName::try_from(name).unwrap_or_else(|e| {
        panic!("settle_from_header: {name:?} is not a valid header name ({e})")
    });
    let log = BoundedLog::new();
    Arc::new(move |parts: &Parts| {
        let value = parts.headers.get(&name)?;
        let parsed = value
            .to_str()
            .ok()
            .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|v| v.parse::<u64>().ok());
        if parsed.is_none() {
            if let Some(count) =
                log.hit(ratelimit_core::Clock::now_us(&ratelimit_core::SystemClock))
            {
                tracing::warn!(
                    header = name.as_str(),
                    value = ?value,
                    responses = count,
                    "rate limit: a usage header is not a decimal count; the request's \
                     estimate stands (reported at most every 10 s, with the responses since \
                     the last report)"
                );
            }
        }
        parsed
    })
}

/// A charge waiting for the end of its response body to be settled to what was reported
/// through its [`Usage`].
pub(crate) struct Meter {
    charge: Option<Charge>,
    usage: Usage,
    /// The settle on its way to the store, once the body has ended.
    pending: Option<Refund>,
}

impl Meter {
    pub(crate) fn new(charge: Charge, usage: Usage) -> Self {
        Self {
            charge: Some(charge),
            usage,
            pending: None,
        }
    }

    /// The settle on its way to the store, once the body has ended.
    pub(crate) fn pending(&mut self) -> Option<&mut Refund> {
        self.pending.as_mut()
    }

    /// The body has ended: settles to what was reported (nothing reported: the estimate
    /// stands). Answers the store call to wait for before the end goes out, if any.
    pub(crate) fn finish(&mut self) -> Option<&mut Refund> {
        let charge = self.charge.take()?;
        let actual = self.usage.reported()?;
        let settle = Arc::clone(&charge.settle);
        self.pending = settle.settle_actual(charge, actual);
        self.pending.as_mut()
    }
}

impl Drop for Meter {
    /// The body was dropped before its end (the client went away): what was reported is
    /// settled in the background, since nothing waits for the response any more.
    fn drop(&mut self) {
        let Some(charge) = self.charge.take() else {
            return;
        };
        let Some(actual) = self.usage.reported() else {
            return;
        };
        let settle = Arc::clone(&charge.settle);
        if let Some(call) = settle.settle_actual(charge, actual) {
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => {
                    runtime.spawn(call);
                }
                Err(_) => tracing::warn!(
                    "rate limit: a response body was dropped outside a Tokio runtime; its \
                     reported usage was not settled and the estimate stands"
                ),
            }
        }
    }
}
