//! The limiter's side of concurrency slots: releasing and renewing them in its store
//! (or its fallback store, for a slot taken there).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use ratelimit_core::util::RELEASE_RETRY_WAITS;
use ratelimit_core::Store;

use super::state::Limiter;
use crate::key::KeyDigest;
use crate::slot::{Held, Slots};

impl<S, K, C, T> Slots for Limiter<S, K, C, T>
where
    S: Store,
    K: Send + Sync + 'static,
    C: Send + Sync + 'static,
    T: Send + Sync + 'static,
{
    fn release(self: Arc<Self>, held: Held) {
        if held.by_fallback {
            if let Some(fallback) = &self.fallback {
                fallback.release_now(&held.key, held.slot);
            }
            // A slot handed to the store is released there too.
            let moved = (self.handover.as_ref()).and_then(|h| h.released(&held.key, held.slot));
            if let Some(slot) = moved {
                self.release_in_store(Held {
                    slot,
                    by_fallback: false,
                    ..held
                });
            }
            return;
        }
        self.release_in_store(held);
    }

    fn lost(&self, held: &Held) {
        self.slot_lost(held);
    }

    fn renew(
        self: Arc<Self>,
        held: &Held,
    ) -> Pin<Box<dyn Future<Output = Result<bool, String>> + Send>> {
        if held.by_fallback {
            let renewed = self
                .fallback
                .as_ref()
                .is_some_and(|f| f.renew_now(&held.key, &held.rules, held.slot));
            // A slot handed to the store is renewed there: the store's copy is the one the
            // fleet counts.
            let moved = (self.handover.as_ref()).and_then(|h| h.moved_to(&held.key, held.slot));
            let Some(slot) = moved else {
                return Box::pin(std::future::ready(Ok(renewed)));
            };
            let (key, rules) = (held.key.clone(), held.rules.clone());
            return Box::pin(async move { self.renew_in_store(&key, &rules, slot).await });
        }
        let (key, rules, slot) = (held.key.clone(), held.rules.clone(), held.slot);
        Box::pin(async move { self.renew_in_store(&key, &rules, slot).await })
    }
}

impl<S: Store, K, C, T> Limiter<S, K, C, T>
where
    K: Send + Sync + 'static,
    C: Send + Sync + 'static,
    T: Send + Sync + 'static,
{
    async fn renew_in_store(
        &self,
        key: &[u8],
        rules: &ratelimit_core::RuleSet,
        slot: u64,
    ) -> Result<bool, String> {
        let call = self.store.renew(key, rules, slot);
        match self.store_timeout {
            None => call.await.map_err(|e| e.to_string()),
            Some(t) => match tokio::time::timeout(t, call).await {
                Ok(r) => r.map_err(|e| e.to_string()),
                Err(_) => Err(format!("no answer within the store timeout of {t:?}")),
            },
        }
    }

    /// Releases a slot the store gave: now, or handed to the store to send in its own
    /// time (a batching store), or in a task with retries.
    fn release_in_store(self: Arc<Self>, held: Held) {
        if self
            .store
            .release_detached(&held.key, &held.rules, held.slot)
        {
            return;
        }
        if let Some(result) = self.store.release_sync(&held.key, &held.rules, held.slot) {
            if let Err(e) = result {
                self.release_failed(&held, &e.to_string());
            }
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.release_failed(&held, "no Tokio runtime to release it on");
            return;
        };
        runtime.spawn(async move {
            let mut error = String::new();
            for wait in std::iter::once(Duration::ZERO).chain(RELEASE_RETRY_WAITS) {
                if !wait.is_zero() {
                    tokio::time::sleep(wait).await;
                }
                let call = self.store.release(&held.key, &held.rules, held.slot);
                let result = match self.store_timeout {
                    None => call.await.map_err(|e| e.to_string()),
                    Some(t) => match tokio::time::timeout(t, call).await {
                        Ok(r) => r.map_err(|e| e.to_string()),
                        Err(_) => Err(format!("no answer within the store timeout of {t:?}")),
                    },
                };
                match result {
                    // Released, or already gone: a resent release frees nothing more.
                    Ok(_) => return,
                    Err(e) => error = e,
                }
            }
            self.release_failed(&held, &error);
        });
    }
}

impl<S: Store, K, C, T> Limiter<S, K, C, T> {
    /// A slot gone when renewed (it ran past its deadline, or the store lost it, as a
    /// failover to a replica that missed it does): its request runs on without one.
    fn slot_lost(&self, held: &Held) {
        if let Some(count) = self.slot_log.hit(self.store.now_us()) {
            tracing::warn!(
                key = %KeyDigest(&held.key),
                slot = held.slot,
                requests = count,
                "rate limit: a request's concurrency slot was gone when renewed; the \
                 request runs on without one (reported at most every 10 s, with the \
                 slots lost or not released since the last report)"
            );
        }
    }

    /// A release that failed leaves the slot taken until its deadline: the key admits
    /// one request fewer at once until then, never one more.
    fn release_failed(&self, held: &Held, error: &str) {
        if let Some(count) = self.slot_log.hit(self.store.now_us()) {
            tracing::warn!(
                key = %KeyDigest(&held.key),
                slot = held.slot,
                error,
                requests = count,
                "rate limit: releasing a request's concurrency slot failed; it stays taken \
                 until its deadline (reported at most every 10 s, with the releases since \
                 the last report)"
            );
        }
    }
}
