//! What several test files of this crate share.

use std::future::{ready, Future};
use std::time::Duration;

use ratelimit_core::{Clock, Decision, ManualClock, RuleSet, Store};

/// A store whose backend is gone: every check fails at once or, when `hang`, never
/// answers. Its clock is `clock` when given (so a test can move the layer's time), else
/// the system clock. `shared` is what it answers to `Store::is_shared`.
#[derive(Debug, Default)]
pub(crate) struct Down {
    pub(crate) hang: bool,
    pub(crate) clock: Option<ManualClock>,
    pub(crate) shared: bool,
}

impl Store for Down {
    type Error = std::io::Error;
    fn check(
        &self,
        _: &[u8],
        _: &RuleSet,
        _: u64,
    ) -> impl Future<Output = Result<Decision, Self::Error>> + Send {
        let hang = self.hang;
        async move {
            if hang {
                std::future::pending::<()>().await;
            }
            Err(std::io::Error::other("connection refused"))
        }
    }
    fn block(
        &self,
        _: &[u8],
        _: Option<Duration>,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send {
        ready(Ok(()))
    }
    fn unblock(&self, _: &[u8]) -> impl Future<Output = Result<(), Self::Error>> + Send {
        ready(Ok(()))
    }
    fn reset(&self, _: &[u8], _: &RuleSet) -> impl Future<Output = Result<(), Self::Error>> + Send {
        ready(Ok(()))
    }
    fn now_us(&self) -> u64 {
        match &self.clock {
            Some(clock) => clock.now_us(),
            None => ratelimit_core::SystemClock.now_us(),
        }
    }
    fn is_shared(&self) -> bool {
        self.shared
    }
}
