//! The limiter's side of charging by outcome: the predicate and the refund.

use std::panic::{catch_unwind, AssertUnwindSafe};

use http::response::Parts;
use http::HeaderValue;
use ratelimit_core::Store;

use super::state::Limiter;
use crate::charge::{Charge, Refund, Settle};
use crate::key::KeyDigest;

impl<S, K, C, T> Settle for Limiter<S, K, C, T>
where
    S: Store,
    K: Send + Sync + 'static,
    C: Send + Sync + 'static,
    T: Send + Sync + 'static,
{
    fn counts(&self, parts: &Parts) -> Result<bool, ()> {
        let Some(predicate) = &self.charge_when else {
            return Ok(true);
        };
        catch_unwind(AssertUnwindSafe(|| predicate(parts))).map_err(|_| {
            tracing::error!(
                namespace = &*self.namespace,
                "rate limit: the charge_when predicate panicked; the request fails with 500 \
                 and its units are given back"
            );
        })
    }

    fn refunds_refused(&self) -> bool {
        self.refund_refused
    }

    fn refund(&self, charge: Charge) -> Option<Refund> {
        let tier = charge.tier.get(&charge.version);
        if charge.by_fallback {
            if let (Some(fallback), Some(rules)) = (&self.fallback, &tier.fallback_rules) {
                fallback.refund_now(&charge.key, rules, charge.cost, charge.charged_at);
            }
            return None;
        }
        if let Some(result) =
            self.store
                .refund_sync(&charge.key, &tier.rules, charge.cost, charge.charged_at)
        {
            if let Err(e) = result {
                self.report_refund_failure(&charge, &e.to_string());
            }
            return None;
        }
        let store = std::sync::Arc::clone(&self.store);
        let timeout = self.store_timeout;
        let report = std::sync::Arc::clone(&self.refund_log);
        Some(Box::pin(async move {
            let tier = charge.tier.get(&charge.version);
            let call = store.refund(&charge.key, &tier.rules, charge.cost, charge.charged_at);
            if let Some(error) = failure(call, timeout).await {
                if let Some(count) = report.hit(store.now_us()) {
                    refund_failed(&charge, tier.client_key(&charge.key), &error, count);
                }
            }
        }))
    }

    fn refunded_field(&self, charge: &Charge, value: &HeaderValue) -> Option<HeaderValue> {
        let tier = charge.tier.get(&charge.version);
        // The field was written by the rules that charged: the fallback's, when it did.
        tier.policy(charge.by_fallback).refunded(value, charge.cost)
    }

    fn actual_from_head(&self, parts: &Parts) -> Option<u64> {
        let read = self.metering.settle_with.as_ref()?;
        catch_unwind(AssertUnwindSafe(|| read(parts))).unwrap_or_else(|_| {
            tracing::error!(
                namespace = &*self.namespace,
                "rate limit: the settle_with function panicked; the request's estimate stands"
            );
            None
        })
    }

    fn settle_actual(&self, charge: Charge, actual: u64) -> Option<Refund> {
        let tier = charge.tier.get(&charge.version);
        let actual = self.capped(&charge, actual);
        if actual == charge.cost {
            return None;
        }
        if charge.by_fallback {
            if let (Some(fallback), Some(rules)) = (&self.fallback, &tier.fallback_rules) {
                let _ = fallback.settle_sync(
                    &charge.key,
                    rules,
                    charge.cost,
                    actual,
                    charge.charged_at,
                );
            }
            return None;
        }
        if let Some(result) = self.store.settle_sync(
            &charge.key,
            &tier.rules,
            charge.cost,
            actual,
            charge.charged_at,
        ) {
            if let Err(e) = result {
                self.report_settle_failure(&charge, actual, &e.to_string());
            }
            return None;
        }
        let store = std::sync::Arc::clone(&self.store);
        let timeout = self.store_timeout;
        let report = std::sync::Arc::clone(&self.refund_log);
        Some(Box::pin(async move {
            let tier = charge.tier.get(&charge.version);
            // A debt is retried once: if the first call ran after all (its answer lost
            // with the connection), the key is charged twice, which limits more, never
            // less. Giving back is not: twice would lend what other requests may take.
            let tries = if actual > charge.cost { 2 } else { 1 };
            let mut error = None;
            for _ in 0..tries {
                let call = store.settle(
                    &charge.key,
                    &tier.rules,
                    charge.cost,
                    actual,
                    charge.charged_at,
                );
                error = failure(call, timeout).await;
                if error.is_none() {
                    return;
                }
            }
            if let Some(error) = error {
                if let Some(count) = report.hit(store.now_us()) {
                    settle_failed(&charge, tier.client_key(&charge.key), actual, &error, count);
                }
            }
        }))
    }
}

impl<S: Store, K, C, T> Limiter<S, K, C, T> {
    /// `actual`, cut to the charge's estimate plus the most one settle may add.
    fn capped(&self, charge: &Charge, actual: u64) -> u64 {
        let tier = charge.tier.get(&charge.version);
        // By default what the store would take at most: no rule takes more than its
        // `debt_cap` in one settle.
        let most = self.metering.max_debt.unwrap_or_else(|| {
            (tier.rules.rules().iter())
                .map(ratelimit_core::algo::debt_cap)
                .max()
                .unwrap_or(0)
        });
        let cap = charge.cost.saturating_add(most);
        if actual > cap {
            if let Some(count) = self.metering_log.hit(self.store.now_us()) {
                tracing::warn!(
                    key = %KeyDigest(tier.client_key(&charge.key)),
                    actual,
                    estimate = charge.cost,
                    charged = cap,
                    requests = count,
                    "rate limit: a request's actual cost is more than one settle may charge                      beyond its estimate (max_debt); the excess is cut (reported at most every                      10 s, with the requests since the last report)"
                );
            }
            return cap;
        }
        actual
    }

    fn report_settle_failure(&self, charge: &Charge, actual: u64, error: &str) {
        if let Some(count) = self.refund_log.hit(self.store.now_us()) {
            let tier = charge.tier.get(&charge.version);
            settle_failed(charge, tier.client_key(&charge.key), actual, error, count);
        }
    }

    fn report_refund_failure(&self, charge: &Charge, error: &str) {
        if let Some(count) = self.refund_log.hit(self.store.now_us()) {
            let tier = charge.tier.get(&charge.version);
            refund_failed(charge, tier.client_key(&charge.key), error, count);
        }
    }
}

/// A refund that failed leaves the units charged: the client is limited more than it
/// should be, never less.
fn refund_failed(charge: &Charge, client: &[u8], error: &str, count: u64) {
    tracing::warn!(
        key = %KeyDigest(client),
        units = charge.cost,
        error,
        requests = count,
        "rate limit: giving back a request's units failed; they stay charged \
         (reported at most every 10 s, with the refunds since the last report)"
    );
}

/// A settle that failed leaves the estimate charged: the key is limited by its
/// estimates, not by nothing.
fn settle_failed(charge: &Charge, client: &[u8], actual: u64, error: &str, count: u64) {
    tracing::warn!(
        key = %KeyDigest(client),
        estimate = charge.cost,
        actual,
        error,
        requests = count,
        "rate limit: settling a request's actual cost failed; its estimate stays charged \
         (reported at most every 10 s, with the failures since the last report)"
    );
}

/// What went wrong with a store call given `timeout`, if anything.
async fn failure<T, E: std::fmt::Display>(
    call: impl std::future::Future<Output = Result<T, E>>,
    timeout: Option<std::time::Duration>,
) -> Option<String> {
    match timeout {
        None => call.await.err().map(|e| e.to_string()),
        Some(t) => match tokio::time::timeout(t, call).await {
            Ok(r) => r.err().map(|e| e.to_string()),
            Err(_) => Some(format!("no answer within the store timeout of {t:?}")),
        },
    }
}
