use std::sync::Arc;
use std::time::Duration;

use ratelimit_core::Clock;

use crate::error::RedisStoreError;
use crate::keys;
use crate::script::Shared;

/// Per-call timeout used when none is configured.
pub(crate) const DEFAULT_TIMEOUT: Duration = Duration::from_millis(50);
/// Time allowed to establish the first connection and load the scripts.
pub(crate) const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// TTL floor under an injected clock.
pub(crate) const DEFAULT_TTL_FLOOR: Duration = Duration::from_secs(60);

/// The settings both store builders share.
#[derive(Clone)]
pub(crate) struct Options {
    pub(crate) prefix: String,
    pub(crate) timeout: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) clock: Option<Arc<dyn Clock>>,
    pub(crate) ttl_floor: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            prefix: keys::DEFAULT_PREFIX.to_owned(),
            timeout: DEFAULT_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            clock: None,
            ttl_floor: DEFAULT_TTL_FLOOR,
        }
    }
}

impl std::fmt::Debug for Options {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Options")
            .field("prefix", &self.prefix)
            .field("timeout", &self.timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field(
                "clock",
                &if self.clock.is_some() {
                    "injected"
                } else {
                    "Redis TIME"
                },
            )
            .field("ttl_floor", &self.ttl_floor)
            .finish()
    }
}

impl Options {
    pub(crate) fn shared(&self) -> Result<Arc<Shared>, RedisStoreError> {
        keys::validate_prefix(&self.prefix)?;
        if self.timeout.is_zero() {
            return Err(RedisStoreError::InvalidConfig(
                "`timeout` must be longer than zero; the default is 50 ms".into(),
            ));
        }
        Ok(Arc::new(Shared {
            prefix: self.prefix.as_str().into(),
            clock: self.clock.clone(),
            ttl_floor_ms: u64::try_from(self.ttl_floor.as_millis()).unwrap_or(u64::MAX),
            timeout: self.timeout,
        }))
    }
}

/// Expands to the builder methods both store builders share.
macro_rules! common_builder_methods {
    () => {
        /// Prefixes every key with `prefix` (default `"ratelimit"`): keys are
        /// `<prefix>:{k<hex of the client key>}:...`. It must not contain `{` or `}`,
        /// which would change the keys' Redis Cluster hash tag.
        pub fn prefix(mut self, prefix: &str) -> Self {
            self.options.prefix = prefix.to_owned();
            self
        }

        /// The longest a call may take, from taking a connection to the reply, before it
        /// fails with [`RedisStoreError::Timeout`](crate::RedisStoreError::Timeout).
        /// Default 50 ms: an unreachable Redis makes checks fail fast, and what to do then is
        /// the caller's policy.
        pub fn timeout(mut self, timeout: std::time::Duration) -> Self {
            self.options.timeout = timeout;
            self
        }

        /// The longest `build` may take to connect and load the scripts (default 1 s).
        pub fn connect_timeout(mut self, timeout: std::time::Duration) -> Self {
            self.options.connect_timeout = timeout;
            self
        }

        /// Takes time from `clock` instead of the Redis server's `TIME` (for tests and the
        /// conformance suite). Every app server then must share that clock; with Redis TIME
        /// (the default) a fleet with skewed clocks still agrees.
        ///
        /// Redis expires keys on its own clock while the injected clock may stand still or
        /// jump, so under an injected clock each key's TTL is the time its state still
        /// matters *measured on the injected clock*, but never less than
        /// [`ttl_floor`](Self::ttl_floor). A key that outlives its state is harmless: the
        /// script reads expired state as fresh.
        pub fn clock(mut self, clock: impl ratelimit_core::Clock) -> Self {
            self.options.clock = Some(std::sync::Arc::new(clock));
            self
        }

        /// The shortest TTL given to a key under an injected [`clock`](Self::clock)
        /// (default 60 s); ignored with Redis TIME, where TTLs are exact.
        pub fn ttl_floor(mut self, floor: std::time::Duration) -> Self {
            self.options.ttl_floor = floor;
            self
        }
    };
}
pub(crate) use common_builder_methods;
