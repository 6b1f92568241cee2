use std::future::Future;
use std::pin::Pin;

use http::Extensions;
use ratelimit_core::Decision;

use crate::admission::{Admission, AdmittedBy, Binding};
use crate::charge::Charge;
use crate::headers::Fields;
use crate::rejection::Refusal;
use crate::slot::SlotGuard;

/// What becomes of a request.
pub(crate) enum Verdict {
    /// Call the inner service, now or after a delay.
    Pass(Pass),
    /// Answer without calling the inner service.
    Refuse(Box<Refusal>),
}

/// An admitted request: call the inner service after `delay_us`, adding `fields` to its
/// response; its [`Admission`] (always) and the store's decision (when kept) go into the
/// request's extensions.
pub(crate) struct Pass {
    /// In microseconds rather than a `Duration`: 8 bytes less keeps the verdict small
    /// with its slot (see the test below).
    pub(crate) delay_us: u64,
    pub(crate) fields: Option<Fields>,
    pub(crate) admission: Admitted,
    /// The slot a concurrency rule gave the request, held to its response's end.
    pub(crate) slot: Option<SlotGuard>,
}

/// Who charged a request the store's answer admits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Charged {
    /// Nobody: denied, or the store failed and the layer did not fall back.
    No,
    Store,
    Fallback,
}

/// Where a passed request's [`Admission`] is. A verdict is moved several times on the
/// in-process path, so this stays two words: what is known at once goes straight into
/// the request's extensions, what arrives later (a store that is not in process, shadow
/// mode) travels boxed.
pub(crate) enum Admitted {
    /// Already in the request's extensions, or nothing to put there (the layer puts no
    /// admission into requests).
    Inserted,
    /// Passed unchecked, with no rule to name.
    Unchecked(AdmittedBy),
    /// To be put into the extensions when the request is passed on.
    Later(Box<Deferred>),
    /// Already in the extensions; what the store charged travels on, to be given back
    /// if the response says it does not count (only when the layer settles charges).
    Charged(Box<Charge>),
}

/// An admission and the store's decision, each when the layer puts it into requests.
pub(crate) struct Deferred {
    pub(crate) admission: Option<Admission>,
    pub(crate) decision: Option<Decision>,
    /// What the store charged, as in [`Admitted::Charged`].
    pub(crate) charge: Option<Box<Charge>>,
}

impl Admitted {
    /// Puts what is not yet in `extensions` there; the charge to settle on the
    /// response, if any. The common case, nothing to put, is inlined into every
    /// request's path.
    #[inline]
    pub(crate) fn insert_into(self, extensions: &mut Extensions) -> Option<Box<Charge>> {
        match self {
            Admitted::Inserted => None,
            other => other.insert_later(extensions),
        }
    }

    #[inline(never)]
    fn insert_later(self, extensions: &mut Extensions) -> Option<Box<Charge>> {
        match self {
            Admitted::Inserted => None,
            Admitted::Unchecked(by) => {
                extensions.insert(Admission::unchecked(by, None));
                None
            }
            Admitted::Later(later) => {
                let Deferred {
                    admission,
                    decision,
                    charge,
                } = *later;
                if let Some(admission) = admission {
                    extensions.insert(admission);
                }
                if let Some(decision) = decision {
                    extensions.insert(decision);
                }
                charge
            }
            Admitted::Charged(charge) => Some(charge),
        }
    }

    /// Keeps `charge` with the admission.
    pub(crate) fn keep(&mut self, charge: Box<Charge>) {
        match self {
            Admitted::Inserted => *self = Admitted::Charged(charge),
            Admitted::Later(later) => later.charge = Some(charge),
            // Nothing was charged for these.
            Admitted::Unchecked(_) | Admitted::Charged(_) => {}
        }
    }

    /// The binding rule of an admission not yet in the extensions.
    pub(crate) fn binding(&self) -> Option<Binding> {
        match self {
            Admitted::Later(later) => later.admission.and_then(|a| a.binding()),
            Admitted::Inserted | Admitted::Unchecked(_) | Admitted::Charged(_) => None,
        }
    }
}

impl Verdict {
    /// Passed without asking the store (or without its answer): no delay, no fields; an
    /// admission saying so when `admission` (the layer puts admissions into requests).
    pub(crate) const fn unchecked(by: AdmittedBy, admission: bool) -> Verdict {
        Verdict::Pass(Pass {
            delay_us: 0,
            fields: None,
            admission: if admission {
                Admitted::Unchecked(by)
            } else {
                Admitted::Inserted
            },
            slot: None,
        })
    }
}

pub(crate) type CheckFuture = Pin<Box<dyn Future<Output = Verdict> + Send>>;

/// A verdict now, or once the store answers.
pub(crate) enum Begin {
    Now(Verdict),
    Later(CheckFuture),
}

#[cfg(test)]
mod tests {
    /// A verdict is moved several times on the in-process path (and returned as the error
    /// of `prepare`, which clippy's `result_large_err` bounds at 128 bytes): what an
    /// admitted request needs later goes into the request or into a box.
    #[test]
    fn a_verdict_stays_small() {
        assert!(
            std::mem::size_of::<super::Verdict>() <= 120,
            "{} bytes",
            std::mem::size_of::<super::Verdict>()
        );
        assert_eq!(std::mem::size_of::<super::Admitted>(), 16);
    }
}
