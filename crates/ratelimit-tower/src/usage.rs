//! [`Usage`]: what a request turned out to cost, reported by the handler or its body.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// What an admitted request actually cost, when that is known only once it has been
/// served: the tokens an LLM answered with, the rows a query scanned, the bytes sent.
///
/// A layer built with [`usage_extension`](crate::RateLimitLayerBuilder::usage_extension)
/// puts one in every request it admits; the handler (axum: `Extension<Usage>`), or the
/// streaming body it returns, calls [`report`](Self::report) at any time before the
/// response body ends. The layer settles the request's charge **when the response body
/// ends**: the check at the door charged the layer's [`cost`](crate::RateLimitLayerBuilder::cost)
/// (the estimate); the settle gives back what the estimate overstated, or charges the
/// excess as debt that the key repays before it is admitted again
/// ([`Store::settle`](ratelimit_core::Store::settle)).
///
/// * Reported twice: the last report counts.
/// * Never reported: the estimate stands, and no store call is made.
/// * The body dropped before its end (the client went away, the connection broke): what
///   was reported by then is settled; nothing reported, the estimate stands.
///
/// Clones share one report: the handler keeps one, a stream it returns another. Several
/// metered layers around one request (a per-key and a global token budget, say) share
/// one `Usage` too, so one report settles every one of them.
///
/// ```
/// use ratelimit_tower::Usage;
///
/// let usage = Usage::new();
/// assert_eq!(usage.reported(), None);
/// let in_the_stream = usage.clone();
/// in_the_stream.report(120);
/// in_the_stream.report(342); // the last report counts
/// assert_eq!(usage.reported(), Some(342));
/// ```
#[derive(Clone, Default)]
pub struct Usage(Arc<Reported>);

/// The report: `actual + 1`, or 0 for none, so that one atomic word holds both (a
/// report of `u64::MAX` is kept as `u64::MAX - 1`, far above any cap a settle applies).
#[derive(Default)]
struct Reported(AtomicU64);

impl Usage {
    /// A usage with nothing reported.
    pub fn new() -> Self {
        Self::default()
    }

    /// Reports the request's actual cost, in the units of the layer's rules; replaces any
    /// earlier report.
    pub fn report(&self, actual: u64) {
        (self.0)
            .0
            .store(actual.saturating_add(1), Ordering::Release);
    }

    /// The last report, if any.
    pub fn reported(&self) -> Option<u64> {
        (self.0).0.load(Ordering::Acquire).checked_sub(1)
    }
}

impl fmt::Debug for Usage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Usage").field(&self.reported()).finish()
    }
}

/// The request's [`Usage`]: the one an outer metered layer put there if any, so that one
/// report settles both; else a new one, put there.
pub(crate) fn shared(extensions: &mut http::Extensions) -> Usage {
    if let Some(usage) = extensions.get::<Usage>() {
        return usage.clone();
    }
    let usage = Usage::new();
    extensions.insert(usage.clone());
    usage
}
