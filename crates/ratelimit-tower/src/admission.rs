//! [`Admission`]: what every admitted request carries in its extensions.

use std::time::Duration;

use ratelimit_core::{Decision, RuleOutcome};

/// How the layer came to pass a request: what an [`Admission`] says about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AdmittedBy {
    /// The store decided and admitted it.
    Store,
    /// The store failed and the local fallback store
    /// ([`FailurePolicy::Fallback`](crate::FailurePolicy::Fallback)) admitted it.
    Fallback,
    /// Not checked: the key extractor exempted the request (an allow-list).
    Exempt,
    /// Not checked: the store failed and the layer fails open
    /// ([`FailurePolicy::FailOpen`](crate::FailurePolicy::FailOpen)).
    FailOpen,
    /// Not checked: no key was found and [`MissingKey::Admit`](crate::MissingKey::Admit)
    /// passes such requests.
    MissingKey,
    /// Shadow mode passed a request the layer would have refused or delayed (see
    /// [`shadow`](crate::RateLimitLayerBuilder::shadow)).
    Shadow,
}

/// The rule of a decision that is nearest to refusing: the fewest units left (the first
/// such rule in rule-set order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Binding {
    /// The rule's position in its tier's rule set.
    pub index: usize,
    /// The rule's limit (units per period).
    pub limit: u64,
    /// Units left after this request (for a refused one: left now).
    pub remaining: u64,
    /// Time until the rule's full quota is available again.
    pub reset_after: Duration,
}

impl Binding {
    /// The binding rule of `decision`; `None` when it has no rule outcomes (a blocked key).
    pub fn of(decision: &Decision) -> Option<Self> {
        let mut binding: Option<(usize, &RuleOutcome)> = None;
        for (index, outcome) in decision.rules().iter().enumerate() {
            if binding.is_none_or(|(_, b)| outcome.remaining < b.remaining) {
                binding = Some((index, outcome));
            }
        }
        binding.map(|(index, o)| Binding {
            index,
            limit: o.limit,
            remaining: o.remaining,
            reset_after: o.reset_after,
        })
    }
}

/// What a layer built with
/// [`admission_extension(true)`](crate::RateLimitLayerBuilder::admission_extension) puts
/// into every request it passes on: whether the request was checked, and the rule
/// nearest to its limit. Read it in an axum handler as `admission: Admission` (or
/// `Option<Admission>`; `Extension<Admission>` reads the same entry); it is then present on **every** request
/// the layer admits, under every [`FailurePolicy`](crate::FailurePolicy), in shadow mode,
/// for exempt keys and under [`MissingKey::Admit`](crate::MissingKey::Admit), so
/// extracting it never fails because of a policy. Without `admission_extension(true)`
/// (the default) no request carries one, and a handler extracting `Admission` is
/// answered 500 with a body that says so ([`MissingAdmission`]).
///
/// It is a small `Copy` value. The store's whole
/// [`Decision`] (every rule's outcome) is put beside it for checked requests when the
/// layer is built with [`decision_extension(true)`](crate::RateLimitLayerBuilder::decision_extension).
/// With stacked layers, the innermost layer's admission is the one a handler sees.
///
/// ```
/// use axum::{routing::get, Router};
/// use ratelimit_tower::Admission;
///
/// async fn search(admission: Admission) -> String {
///     match admission.binding() {
///         Some(rule) => format!("{} left", rule.remaining),
///         None => "not limited".to_owned(),
///     }
/// }
/// let app: Router = Router::new().route("/search", get(search));
/// // ...layered with `RateLimitLayer::builder(store, key).admission_extension(true)`.
/// # let _ = app;
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Admission {
    by: AdmittedBy,
    delay: Duration,
    binding: Option<Binding>,
}

impl Admission {
    /// Admitted by a store's `decision` (the layer's store, or the fallback store).
    pub(crate) fn decided(by: AdmittedBy, decision: &Decision) -> Self {
        Self {
            by,
            delay: decision.delay(),
            binding: Binding::of(decision),
        }
    }

    /// Passed without a store's admitting decision; `binding` is the refused decision's in
    /// shadow mode, when there was one.
    pub(crate) const fn unchecked(by: AdmittedBy, binding: Option<Binding>) -> Self {
        Self {
            by,
            delay: Duration::ZERO,
            binding,
        }
    }

    /// How the request came to be passed.
    #[inline]
    pub fn by(&self) -> AdmittedBy {
        self.by
    }

    /// True when a store (the layer's, or the fallback store) decided the request and
    /// admitted it; false when it passed unchecked (exempt, fail-open, a missing key
    /// admitted) or in shadow mode against the limiter's answer.
    #[inline]
    pub fn is_checked(&self) -> bool {
        matches!(self.by, AdmittedBy::Store | AdmittedBy::Fallback)
    }

    /// How long a shaping rule held the request before passing it on; zero otherwise.
    #[inline]
    pub fn delay(&self) -> Duration {
        self.delay
    }

    /// The rule nearest to refusing (fewest units left), from the store's decision:
    /// `None` when no store decided (an unchecked request) or the decision had no rule
    /// outcomes. In shadow mode, the refused decision's binding rule.
    #[inline]
    pub fn binding(&self) -> Option<Binding> {
        self.binding
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(limit: u64, remaining: u64) -> RuleOutcome {
        RuleOutcome {
            allowed: true,
            limit,
            remaining,
            reset_after: Duration::from_secs(limit),
            retry_after: None,
        }
    }

    #[test]
    fn the_binding_rule_has_the_fewest_units_left_first_on_ties() {
        let decision = Decision::from_rules(
            [outcome(10, 7), outcome(100, 3), outcome(5, 3)],
            Duration::ZERO,
        );
        let admission = Admission::decided(AdmittedBy::Store, &decision);
        assert!(admission.is_checked());
        assert_eq!(
            admission.binding(),
            Some(Binding {
                index: 1,
                limit: 100,
                remaining: 3,
                reset_after: Duration::from_secs(100),
            })
        );
        assert_eq!(Binding::of(&Decision::blocked(None)), None);
    }

    #[test]
    fn unchecked_admissions_say_so() {
        for by in [
            AdmittedBy::Exempt,
            AdmittedBy::FailOpen,
            AdmittedBy::MissingKey,
            AdmittedBy::Shadow,
        ] {
            let admission = Admission::unchecked(by, None);
            assert!(!admission.is_checked(), "{by:?}");
            assert_eq!(admission.binding(), None);
        }
        assert!(Admission::unchecked(AdmittedBy::Fallback, None).is_checked());
    }

    #[test]
    fn small_enough_to_put_into_every_request() {
        assert!(std::mem::size_of::<Admission>() <= 80);
    }
}

/// The message of [`MissingAdmission`].
#[cfg(feature = "axum")]
const MISSING_ADMISSION: &str = "this request carries no rate-limit Admission: build the \
    RateLimitLayer in front of this route with `.admission_extension(true)` (off by default), \
    or extract `Option<Admission>` where a route may have no such layer";

/// The rejection of a handler that extracts an [`Admission`] the request does not carry:
/// answered 500, with a body that says what to change (the layer was built without
/// [`admission_extension(true)`](crate::RateLimitLayerBuilder::admission_extension), or
/// the route has no rate-limit layer).
#[cfg(feature = "axum")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct MissingAdmission;

#[cfg(feature = "axum")]
impl std::fmt::Display for MissingAdmission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(MISSING_ADMISSION)
    }
}

#[cfg(feature = "axum")]
impl std::error::Error for MissingAdmission {}

#[cfg(feature = "axum")]
impl axum::response::IntoResponse for MissingAdmission {
    fn into_response(self) -> axum::response::Response {
        tracing::error!("{MISSING_ADMISSION}");
        (http::StatusCode::INTERNAL_SERVER_ERROR, MISSING_ADMISSION).into_response()
    }
}

/// `admission: Admission` in an axum handler: the request's admission, or a 500 that
/// says what to change when the layer was built without
/// [`admission_extension(true)`](crate::RateLimitLayerBuilder::admission_extension).
/// (`Extension<Admission>` reads the same entry, with axum's generic message.)
#[cfg(feature = "axum")]
impl<S: Send + Sync> axum::extract::FromRequestParts<S> for Admission {
    type Rejection = MissingAdmission;

    async fn from_request_parts(
        parts: &mut http::request::Parts,
        _state: &S,
    ) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<Admission>()
            .copied()
            .ok_or(MissingAdmission)
    }
}

/// `admission: Option<Admission>`: `None` for a request no layer with
/// [`admission_extension(true)`](crate::RateLimitLayerBuilder::admission_extension)
/// passed.
#[cfg(feature = "axum")]
impl<S: Send + Sync> axum::extract::OptionalFromRequestParts<S> for Admission {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut http::request::Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts.extensions.get::<Admission>().copied())
    }
}
