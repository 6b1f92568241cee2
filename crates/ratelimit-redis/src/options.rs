use std::sync::Arc;
use std::time::Duration;

use ratelimit_core::Clock;

use crate::error::RedisStoreError;
use crate::keys;
use crate::shared::{clock_name, RedisClock, Shared};

/// Per-call timeout used when none is configured.
pub(crate) const DEFAULT_TIMEOUT: Duration = Duration::from_millis(50);
/// Time allowed to establish the first connection and load the scripts.
pub(crate) const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// TTL floor under an injected clock.
pub(crate) const DEFAULT_TTL_FLOOR: Duration = Duration::from_secs(60);

/// The settings of a store builder.
#[derive(Clone)]
pub(crate) struct Options {
    pub(crate) prefix: String,
    pub(crate) timeout: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) clock: Option<Arc<dyn Clock>>,
    pub(crate) ttl_floor: Duration,
    pub(crate) force_lua: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            prefix: keys::DEFAULT_PREFIX.to_owned(),
            timeout: DEFAULT_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            clock: None,
            ttl_floor: DEFAULT_TTL_FLOOR,
            force_lua: false,
        }
    }
}

impl std::fmt::Debug for Options {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Options")
            .field("prefix", &self.prefix)
            .field("timeout", &self.timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("clock", &clock_name(self.clock.as_ref()))
            .field("ttl_floor", &self.ttl_floor)
            .field("force_lua", &self.force_lua)
            .finish()
    }
}

impl Options {
    pub(crate) fn shared(&self) -> Result<Shared, RedisStoreError> {
        keys::validate_prefix(&self.prefix)?;
        if self.timeout.is_zero() {
            return Err(RedisStoreError::InvalidConfig(
                "`timeout` must be longer than zero; the default is 50 ms".into(),
            ));
        }
        Ok(Shared {
            prefix: self.prefix.as_str().into(),
            clock: self.clock.clone(),
            ttl_floor_ms: u64::try_from(self.ttl_floor.as_millis()).unwrap_or(u64::MAX),
            timeout: self.timeout,
            paths: crate::script::Paths::new(),
            force_lua: self.force_lua,
            redis_clock: RedisClock::new(),
            maxmemory_policy: std::sync::RwLock::new(None),
            detached_log: ratelimit_core::util::BoundedLog::new(),
            detached: crate::shared::Outstanding::default(),
            recovered_at: std::sync::atomic::AtomicU64::new(0),
        })
    }
}
