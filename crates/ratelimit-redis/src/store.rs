use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bb8::{Pool, RunError};
use bb8_redis::RedisConnectionManager;
use ratelimit_core::{Decision, RuleSet, Store};
use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::{Cmd, RedisResult, Value};

use crate::error::{classify, is_connection_error, RedisStoreError};
use crate::options::{common_builder_methods, Options};
use crate::script::{self, Call, Shared, BLOCK, CHECK};

/// Connections the pool holds when none is configured. Each is multiplexed (many
/// requests in flight on one socket), so a few are plenty.
pub(crate) const DEFAULT_POOL_SIZE: u32 = 4;

/// The rate-limit [`Store`] over one Redis server (or a primary behind a proxy), through
/// a `bb8` pool of multiplexed connections.
///
/// Every check is one `EVALSHA` of the decision script, whatever the number of rules; a
/// clone shares the pool. See the [crate docs](crate) for the key layout, time source and
/// TTLs.
///
/// ```no_run
/// use ratelimit_core::{RuleSet, Store};
/// use ratelimit_redis::RedisStore;
/// use std::time::Duration;
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let store = RedisStore::builder()
///     .prefix("api")
///     .timeout(Duration::from_millis(20))
///     .build("redis://127.0.0.1:6379/")
///     .await?;
/// let rules: RuleSet = "10/s gcra burst=20; 1000/h sliding-window precision=6".parse()?;
/// let decision = store.check(b"203.0.113.7", &rules, 1).await?;
/// println!("allowed: {}, retry after: {:?}", decision.is_allowed(), decision.retry_after());
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    pool: Pool<RedisConnectionManager>,
    shared: Arc<Shared>,
    health: Arc<Health>,
}

/// Coordinates replacing dead connections.
#[derive(Debug, Default)]
struct Health {
    /// Bumped after each repair; a failure seen before it is already repaired.
    generation: AtomicU64,
    lock: tokio::sync::Mutex<()>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("pool", &self.pool.state())
            .field("config", &self.shared)
            .finish()
    }
}

/// Builds a [`RedisStore`]; from [`RedisStore::builder`].
#[derive(Debug, Clone)]
#[must_use]
pub struct RedisStoreBuilder {
    options: Options,
    pool_size: u32,
}

impl RedisStoreBuilder {
    common_builder_methods!();

    /// Connections in the pool (default 4, at least 1). Connections are multiplexed, so
    /// more only help when one socket's throughput is the limit.
    pub fn pool_size(mut self, size: u32) -> Self {
        self.pool_size = size.max(1);
        self
    }

    /// Connects to `url` (`redis://[user:password@]host[:port][/db]`, or `rediss://` when
    /// the `redis` crate's TLS features are enabled), loads the scripts and returns the
    /// store. Fails with [`RedisStoreError::Connection`] or [`RedisStoreError::Timeout`]
    /// when Redis cannot be reached within the connect timeout.
    pub async fn build(self, url: &str) -> Result<RedisStore, RedisStoreError> {
        let shared = self.options.shared()?;
        let manager = RedisConnectionManager::new(url).map_err(|e| {
            RedisStoreError::InvalidConfig(format!(
                "invalid Redis URL: {e}; expected redis://host:port/db"
            ))
        })?;
        let pool = Pool::builder()
            .max_size(self.pool_size)
            // Connections are shared, not held, so bb8 would rarely open a second one:
            // keep them all open and let requests spread over them.
            .min_idle(Some(self.pool_size))
            // One round trip per check: no PING on checkout. Dead connections are replaced
            // when a call fails on them instead.
            .test_on_check_out(false)
            // Report a refused connection at once rather than retrying until the timeout.
            .retry_connection(false)
            .connection_timeout(self.options.connect_timeout)
            .error_sink(Box::new(TracingSink))
            .build_unchecked(manager);
        let store = RedisStore {
            pool,
            shared,
            health: Arc::default(),
        };
        store.seed(self.options.connect_timeout).await?;
        Ok(store)
    }

    /// A store over a pool the application already has. Nothing is sent until the first
    /// call; the scripts load on first use.
    ///
    /// For one round trip per check, build the pool with `test_on_check_out(false)`
    /// (bb8's default pings every connection it hands out); the store replaces
    /// connections that fail.
    ///
    /// # Panics
    ///
    /// If the configured prefix contains `{` or `}` or the timeout is zero (the errors
    /// [`build`](Self::build) returns).
    pub fn build_with_pool(self, pool: Pool<RedisConnectionManager>) -> RedisStore {
        let shared = self
            .options
            .shared()
            .unwrap_or_else(|e| panic!("RedisStoreBuilder::build_with_pool: {e}"));
        RedisStore {
            pool,
            shared,
            health: Arc::default(),
        }
    }
}

/// Logs the connection errors bb8 meets while filling the pool in the background.
#[derive(Debug, Clone, Copy)]
struct TracingSink;

impl bb8::ErrorSink<redis::RedisError> for TracingSink {
    fn sink(&self, error: redis::RedisError) {
        tracing::warn!(%error, "cannot open a Redis connection for the rate-limit pool");
    }

    fn boxed_clone(&self) -> Box<dyn bb8::ErrorSink<redis::RedisError>> {
        Box::new(*self)
    }
}

/// A request: a script call or a plain command.
enum Op<'a> {
    Call(&'a Call),
    Cmd(&'a Cmd),
}

impl Op<'_> {
    async fn send<C: ConnectionLike + Send>(&self, conn: &mut C) -> RedisResult<Value> {
        match self {
            Op::Call(call) => call.invoke(conn).await,
            Op::Cmd(cmd) => cmd.query_async(conn).await,
        }
    }
}

fn pool_error(e: RunError<redis::RedisError>, timeout: Duration) -> RedisStoreError {
    match e {
        RunError::User(e) => classify(e, timeout),
        RunError::TimedOut => RedisStoreError::Timeout(timeout),
    }
}

impl RedisStore {
    /// A store for the Redis at `url` with the defaults: prefix `"ratelimit"`, Redis
    /// `TIME`, a 50 ms per-call timeout and a pool of 4 multiplexed connections.
    pub async fn connect(url: &str) -> Result<Self, RedisStoreError> {
        Self::builder().build(url).await
    }

    /// Configures a store.
    pub fn builder() -> RedisStoreBuilder {
        RedisStoreBuilder {
            options: Options::default(),
            pool_size: DEFAULT_POOL_SIZE,
        }
    }

    /// The connection pool.
    pub fn pool(&self) -> &Pool<RedisConnectionManager> {
        &self.pool
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.shared.prefix
    }

    /// Opens the first connection directly (bb8 would only report a refused connection
    /// as a timeout), loads the scripts on it and hands it to the pool.
    async fn seed(&self, timeout: Duration) -> Result<(), RedisStoreError> {
        let seed = async {
            let mut conn = self
                .pool
                .dedicated_connection()
                .await
                .map_err(|e| classify(e, timeout))?;
            for script in [&*CHECK, &*BLOCK] {
                let _: String = script
                    .load_cmd()
                    .query_async(&mut conn)
                    .await
                    .map_err(|e| classify(e, timeout))?;
            }
            // A full pool (impossible here) would just drop the connection.
            let _ = self.pool.add(conn);
            Ok(())
        };
        tokio::time::timeout(timeout, seed)
            .await
            .unwrap_or(Err(RedisStoreError::Timeout(timeout)))
    }

    async fn run(&self, op: Op<'_>) -> Result<Value, RedisStoreError> {
        let timeout = self.shared.timeout;
        tokio::time::timeout(timeout, self.run_once(op))
            .await
            .unwrap_or(Err(RedisStoreError::Timeout(timeout)))
    }

    async fn run_once(&self, op: Op<'_>) -> Result<Value, RedisStoreError> {
        let timeout = self.shared.timeout;
        let generation = self.health.generation.load(Ordering::Acquire);
        let mut conn = self.checkout().await?;
        match op.send(&mut conn).await {
            Err(e) if is_connection_error(&e) => {
                // The connection is dead (Redis restarted, the network dropped it): replace
                // the dead pooled connections and send once more. A request lost with its
                // connection may have reached Redis first; if so it is counted twice, which
                // errs toward limiting, never toward admitting more.
                tracing::debug!(error = %e, "Redis connection failed; reconnecting");
                self.heal(generation).await?;
                let mut conn = self.checkout().await?;
                op.send(&mut conn).await.map_err(|e| classify(e, timeout))
            }
            other => other.map_err(|e| classify(e, timeout)),
        }
    }

    /// A handle on one of the pool's multiplexed connections. The pooled connection goes
    /// back at once: requests from many tasks share its socket (pipelined), instead of
    /// queueing for exclusive use, where bb8 lets newcomers overtake waiting tasks.
    async fn checkout(&self) -> Result<MultiplexedConnection, RedisStoreError> {
        let timeout = self.shared.timeout;
        let pooled = self.pool.get().await.map_err(|e| pool_error(e, timeout))?;
        Ok((*pooled).clone())
    }

    /// Replaces the pool's dead connections, once per failure: bb8 cannot be told a
    /// connection broke, so each pooled connection is probed with PING (an immediate
    /// error when its socket is gone) and a dead one is swapped for a fresh one in place.
    /// Callers that saw the same failure wait and reuse the outcome.
    async fn heal(&self, seen: u64) -> Result<(), RedisStoreError> {
        let timeout = self.shared.timeout;
        let _one_at_a_time = self.health.lock.lock().await;
        if self.health.generation.load(Ordering::Acquire) != seen {
            return Ok(());
        }
        for _ in 0..self.pool.state().connections.max(1) {
            let mut pooled = self.pool.get().await.map_err(|e| pool_error(e, timeout))?;
            let probe: RedisResult<()> = redis::cmd("PING").query_async(&mut *pooled).await;
            if let Err(e) = probe {
                if !is_connection_error(&e) {
                    return Err(classify(e, timeout));
                }
                *pooled = self
                    .pool
                    .dedicated_connection()
                    .await
                    .map_err(|e| classify(e, timeout))?;
            }
        }
        self.health.generation.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }
}

impl Store for RedisStore {
    type Error = RedisStoreError;

    async fn check(
        &self,
        key: &[u8],
        rules: &RuleSet,
        cost: u64,
    ) -> Result<Decision, RedisStoreError> {
        rules.check_cost(cost)?;
        let call = self.shared.check_call(key, rules, cost);
        let reply = self.run(Op::Call(&call)).await?;
        script::decision(rules, reply)
    }

    async fn block(&self, key: &[u8], duration: Option<Duration>) -> Result<(), RedisStoreError> {
        let call = self.shared.block_call(key, duration);
        self.run(Op::Call(&call)).await.map(drop)
    }

    async fn unblock(&self, key: &[u8]) -> Result<(), RedisStoreError> {
        let cmd = self.shared.unblock_cmd(key);
        self.run(Op::Cmd(&cmd)).await.map(drop)
    }

    async fn reset(&self, key: &[u8], rules: &RuleSet) -> Result<(), RedisStoreError> {
        let cmd = self.shared.reset_cmd(key, rules);
        self.run(Op::Cmd(&cmd)).await.map(drop)
    }
}
