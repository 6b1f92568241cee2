use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bb8::Pool;
use bb8_redis::RedisConnectionManager;
use ratelimit_core::util::BoundedLog;
use ratelimit_core::{Clock, Decision, RuleSet, Store, SystemClock};
use redis::aio::ConnectionLike;
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::sentinel::{SentinelClient, SentinelServerType};
use redis::Value;

use crate::error::{classify, RedisStoreError};
use crate::options::Options;
use crate::script::{CheckArgs, Request, Shared};
use crate::transport::{self, Failure, Sentinel, Single, Transport};

/// Connections the pool holds when none is configured. Each is multiplexed (many
/// requests in flight on one socket), so a few are plenty.
pub(crate) const DEFAULT_POOL_SIZE: u32 = 4;

/// The rate-limit [`Store`] over Redis: one server, a Redis Cluster, or the primary of a
/// Sentinel-managed service.
///
/// Every check is one `FCALL` of the decision function (one `EVALSHA` of the decision
/// script before Redis 7), whatever the number of rules; a
/// clone shares the connections. See the [crate docs](crate) for the key layout, time
/// source, TTLs and how to run Redis for a limiter.
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
///
/// // The same store over a Cluster, or over the primary Sentinel names:
/// let cluster = RedisStore::builder()
///     .build_cluster(["redis://10.0.0.1:6379/", "redis://10.0.0.2:6379/"])
///     .await?;
/// let sentinel = RedisStore::builder()
///     .build_sentinel(["redis://10.0.0.5:26379/"], "ratelimit-primary")
///     .await?;
/// # let _ = (cluster, sentinel);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

struct Inner {
    transport: Transport,
    shared: Shared,
    /// `maxmemory-policy` as read at connect, when the server allowed it.
    maxmemory_policy: Option<String>,
    /// Foreign values replaced, reported at a bounded rate.
    heal_log: BoundedLog,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("transport", &self.inner.transport)
            .field("config", &self.inner.shared)
            .field("maxmemory_policy", &self.inner.maxmemory_policy)
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
    /// Prefixes every key with `prefix` (default `"ratelimit"`): keys are
    /// `<prefix>:{<tag>}:...`. It must not contain `{` or `}`, which would change the keys'
    /// Redis Cluster hash tag.
    pub fn prefix(mut self, prefix: &str) -> Self {
        self.options.prefix = prefix.to_owned();
        self
    }

    /// The longest a call may take, from taking a connection to the reply, before it
    /// fails with [`RedisStoreError::Timeout`]. Default 50 ms: an unreachable Redis makes
    /// checks fail fast, and what to do then is the caller's policy. See the crate docs
    /// for what a check that timed out does to counts.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.options.timeout = timeout;
        self
    }

    /// The longest `build` may take to connect and load the scripts (default 1 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
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
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.options.clock = Some(Arc::new(clock));
        self
    }

    /// The shortest TTL given to a key under an injected [`clock`](Self::clock)
    /// (default 60 s); ignored with Redis TIME, where TTLs are exact.
    pub fn ttl_floor(mut self, floor: Duration) -> Self {
        self.options.ttl_floor = floor;
        self
    }

    /// Connections in the pool of a single-server store (default 4, at least 1).
    /// Connections are multiplexed, so more only help when one socket's throughput is
    /// the limit. Cluster and Sentinel stores keep one multiplexed connection per server.
    pub fn pool_size(mut self, size: u32) -> Self {
        self.pool_size = size.max(1);
        self
    }

    /// Connects to one server at `url` (`redis://[user:password@]host[:port][/db]`, or
    /// `rediss://` when the `redis` crate's TLS features are enabled), loads the scripts
    /// and returns the store. Fails with [`RedisStoreError::Connection`] or
    /// [`RedisStoreError::Timeout`] when Redis cannot be reached within the connect
    /// timeout.
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
        // Open the first connection directly (bb8 would only report a refused connection
        // as a timeout), set it up and hand it to the pool.
        let connect = async {
            let mut conn = pool.dedicated_connection().await?;
            let policy = prepare(&mut conn, &shared).await?;
            // A full pool (impossible here) would just drop the connection.
            let _ = pool.add(conn);
            Ok(policy)
        };
        let policy = self.connecting(connect).await?;
        Ok(RedisStore::new(
            Transport::Single(Single::new(pool)),
            shared,
            policy,
        ))
    }

    /// Connects to the Redis Cluster reachable through `urls` (one reachable node
    /// suffices; the others are discovered), loads the scripts on every primary and
    /// returns the store.
    pub async fn build_cluster<I, S>(self, urls: I) -> Result<RedisStore, RedisStoreError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let shared = self.options.shared()?;
        let urls: Vec<String> = urls.into_iter().map(|u| u.as_ref().to_owned()).collect();
        if urls.is_empty() {
            return Err(RedisStoreError::InvalidConfig(
                "no cluster node URL given; pass at least one redis://host:port/".into(),
            ));
        }
        let client = ClusterClient::builder(urls)
            .connection_timeout(self.options.connect_timeout)
            .build()
            .map_err(|e| {
                RedisStoreError::InvalidConfig(format!(
                    "invalid Redis Cluster node URL: {e}; expected redis://host:port/"
                ))
            })?;
        let connect = async {
            let mut conn = client.get_async_connection().await?;
            let policy = prepare(&mut conn, &shared).await?;
            Ok((conn, policy))
        };
        let (conn, policy) = self.connecting(connect).await?;
        Ok(RedisStore::new(Transport::Cluster(conn), shared, policy))
    }

    /// Connects to the primary that the Sentinels at `sentinel_urls` name for
    /// `service_name`, loads the scripts and returns the store. After a failover (the
    /// primary's connection fails, or it answers as a replica) the store asks the
    /// Sentinels again and carries on with the new primary.
    ///
    /// For passwords or TLS towards the Redis servers, build a
    /// [`SentinelClient`](redis::sentinel::SentinelClient) yourself and use
    /// [`build_with_sentinel_client`](Self::build_with_sentinel_client).
    pub async fn build_sentinel<I, S>(
        self,
        sentinel_urls: I,
        service_name: &str,
    ) -> Result<RedisStore, RedisStoreError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let urls: Vec<String> = sentinel_urls
            .into_iter()
            .map(|u| u.as_ref().to_owned())
            .collect();
        if urls.is_empty() {
            return Err(RedisStoreError::InvalidConfig(
                "no Sentinel URL given; pass at least one redis://host:26379/".into(),
            ));
        }
        let client = SentinelClient::build(
            urls,
            service_name.to_owned(),
            None,
            SentinelServerType::Master,
        )
        .map_err(|e| {
            RedisStoreError::InvalidConfig(format!(
                "invalid Sentinel URL: {e}; expected redis://host:26379/"
            ))
        })?;
        self.build_with_sentinel_client(client).await
    }

    /// Like [`build_sentinel`](Self::build_sentinel), over a Sentinel client the
    /// application configured (credentials, TLS, database). The client must be for the
    /// primary ([`SentinelServerType::Master`]): a limiter writes on every check.
    pub async fn build_with_sentinel_client(
        self,
        client: SentinelClient,
    ) -> Result<RedisStore, RedisStoreError> {
        let shared = self.options.shared()?;
        let connect = async {
            let sentinel = Sentinel::connect(client).await?;
            let mut conn = sentinel.primary().ok_or(Failure::PoolTimedOut)?;
            let policy = prepare(&mut conn, &shared).await?;
            Ok((sentinel, policy))
        };
        let (sentinel, policy) = self.connecting(connect).await?;
        Ok(RedisStore::new(
            Transport::Sentinel(Box::new(sentinel)),
            shared,
            policy,
        ))
    }

    /// A single-server store over a pool the application already has. Nothing is sent
    /// until the first call; the scripts load on first use.
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
        let shared = self.shared_or_panic("build_with_pool");
        RedisStore::new(Transport::Single(Single::new(pool)), shared, (None, true))
    }

    /// A Cluster store over a cluster connection the application already has. The
    /// scripts load on first use, on each node.
    ///
    /// # Panics
    ///
    /// As [`build_with_pool`](Self::build_with_pool).
    pub fn build_with_cluster_connection(self, conn: ClusterConnection) -> RedisStore {
        let shared = self.shared_or_panic("build_with_cluster_connection");
        RedisStore::new(Transport::Cluster(conn), shared, (None, true))
    }

    fn shared_or_panic(&self, what: &str) -> Shared {
        self.options
            .shared()
            .unwrap_or_else(|e| panic!("RedisStoreBuilder::{what}: {e}"))
    }

    /// Runs a connect step within the connect timeout.
    async fn connecting<T>(
        &self,
        connect: impl std::future::Future<Output = Result<T, Failure>>,
    ) -> Result<T, RedisStoreError> {
        let timeout = self.options.connect_timeout;
        match tokio::time::timeout(timeout, connect).await {
            Ok(result) => result.map_err(|e| failure(e, timeout)),
            Err(_) => Err(RedisStoreError::Timeout(timeout)),
        }
    }
}

/// Loads the scripts and reads `maxmemory-policy`, warning when limiter keys can be
/// evicted.
/// Returns the policy and whether the server has functions; reads the server's clock.
async fn prepare<C: ConnectionLike + Send>(
    conn: &mut C,
    shared: &Shared,
) -> Result<(Option<String>, bool), Failure> {
    let functions = transport::load_scripts(conn).await?;
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(conn).await?;
    shared
        .redis_clock
        .observe(secs * 1_000_000 + micros, std::time::Instant::now());
    let policy = match redis::cmd("CONFIG")
        .arg("GET")
        .arg("maxmemory-policy")
        .query_async::<Value>(conn)
        .await
    {
        Ok(reply) => policy_in(&reply),
        Err(e) => {
            // Managed services often rename or forbid CONFIG.
            tracing::info!(
                error = %e,
                "cannot read maxmemory-policy; make sure the Redis server does not evict \
                 rate-limit keys (maxmemory-policy noeviction)"
            );
            None
        }
    };
    if let Some(policy) = &policy {
        if let Some(why) = eviction_risk(policy) {
            tracing::warn!(
                maxmemory_policy = %policy,
                "Redis may evict rate-limit keys: {why}. An evicted key forgets what a client \
                 consumed, so limits admit more than configured. Set `maxmemory-policy \
                 noeviction` (or give the limiter a Redis of its own)."
            );
        }
    }
    Ok((policy, functions))
}

/// The policy's value in a `CONFIG GET` reply: a map or a flat array on one server, one
/// of those per node on a Cluster (the first one read wins; a fleet runs one policy).
fn policy_in(reply: &Value) -> Option<String> {
    match reply {
        Value::BulkString(bytes) => {
            let s = String::from_utf8_lossy(bytes);
            (s != "maxmemory-policy").then(|| s.into_owned())
        }
        Value::SimpleString(s) => (s != "maxmemory-policy").then(|| s.clone()),
        Value::Array(items) => items.iter().find_map(policy_in),
        Value::Map(pairs) => pairs.iter().find_map(|(_, v)| policy_in(v)),
        _ => None,
    }
}

/// Why `policy` can evict the store's keys, or `None` when it cannot.
pub(crate) fn eviction_risk(policy: &str) -> Option<&'static str> {
    if policy == "noeviction" {
        None
    } else if policy.starts_with("allkeys-") {
        Some("the policy evicts any key when memory runs out")
    } else {
        Some("the policy evicts keys with a TTL when memory runs out, and every rate-limit state key has one")
    }
}

fn failure(e: Failure, timeout: Duration) -> RedisStoreError {
    match e {
        Failure::Redis(e) => classify(e, timeout),
        Failure::PoolTimedOut => RedisStoreError::Timeout(timeout),
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

impl RedisStore {
    /// A store for the Redis server at `url` with the defaults: prefix `"ratelimit"`,
    /// Redis `TIME`, a 50 ms per-call timeout and a pool of 4 multiplexed connections.
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

    fn new(transport: Transport, shared: Shared, prepared: (Option<String>, bool)) -> Self {
        let (maxmemory_policy, functions) = prepared;
        shared.functions.store(functions, Ordering::Relaxed);
        Self {
            inner: Arc::new(Inner {
                transport,
                shared,
                maxmemory_policy,
                heal_log: BoundedLog::new(),
            }),
        }
    }

    /// The connection pool of a single-server store; `None` for Cluster and Sentinel.
    pub fn pool(&self) -> Option<&Pool<RedisConnectionManager>> {
        match &self.inner.transport {
            Transport::Single(single) => Some(&single.pool),
            _ => None,
        }
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.inner.shared.prefix
    }

    /// The server's `maxmemory-policy` as read when the store connected; `None` when it
    /// could not be read (CONFIG forbidden) or the store was built over an existing
    /// connection. Anything but `noeviction` can evict rate-limit keys, which the store
    /// logs as a warning at connect.
    pub fn maxmemory_policy(&self) -> Option<&str> {
        self.inner.maxmemory_policy.as_deref()
    }

    /// Sends `request` within the store's timeout.
    async fn run(&self, request: Request<'_>) -> Result<Value, RedisStoreError> {
        let timeout = self.inner.shared.timeout;
        match tokio::time::timeout(timeout, self.inner.transport.send(&request)).await {
            Ok(reply) => reply.map_err(|e| failure(e, timeout)),
            Err(_) => Err(RedisStoreError::Timeout(timeout)),
        }
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
        let call = self.inner.shared.check_call(key, rules, cost);
        let reply = self.run(Request::Call(call)).await?;
        let (decision, healed) = match CheckArgs::decision(rules, &reply)? {
            Ok(decided) => decided,
            Err(redis_now) => {
                // Redis got to the check after its deadline (the reply outran our timer,
                // or the deadline was early): it charged nothing. Learn the clock again.
                self.inner
                    .shared
                    .redis_clock
                    .observe(redis_now, std::time::Instant::now());
                return Err(RedisStoreError::Timeout(self.inner.shared.timeout));
            }
        };
        if healed {
            if let Some(count) = self.inner.heal_log.hit(self.now_us()) {
                tracing::warn!(
                    prefix = %self.prefix(),
                    replaced = count,
                    "a rate-limit key held a value this store did not write; it was read as \
                     empty and replaced. Something else writes under the store's prefix: give \
                     the store a prefix of its own (reported at most every 10 s, with the \
                     values replaced since the last report)"
                );
            }
        }
        Ok(decision)
    }

    async fn block(&self, key: &[u8], duration: Option<Duration>) -> Result<(), RedisStoreError> {
        let call = self.inner.shared.block_call(key, duration);
        self.run(Request::Call(call)).await.map(drop)
    }

    async fn unblock(&self, key: &[u8]) -> Result<(), RedisStoreError> {
        let cmd = self.inner.shared.unblock_cmd(key);
        self.run(Request::Cmd(cmd)).await.map(drop)
    }

    async fn reset(&self, key: &[u8], rules: &RuleSet) -> Result<(), RedisStoreError> {
        let cmd = self.inner.shared.reset_cmd(key, rules);
        self.run(Request::Cmd(cmd)).await.map(drop)
    }

    /// The injected clock's time when one is set; otherwise this host's clock, the best
    /// local reading of the Redis server's `TIME`.
    fn now_us(&self) -> u64 {
        match &self.inner.shared.clock {
            Some(clock) => clock.now_us(),
            None => SystemClock.now_us(),
        }
    }

    /// Always: every process connected to the same Redis shares the state.
    fn is_shared(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eviction_policies() {
        assert_eq!(eviction_risk("noeviction"), None);
        for evicting in [
            "allkeys-lru",
            "allkeys-lfu",
            "allkeys-random",
            "volatile-lru",
            "volatile-ttl",
        ] {
            assert!(eviction_risk(evicting).is_some(), "{evicting}");
        }
        let flat = Value::Array(vec![
            Value::BulkString(b"maxmemory-policy".to_vec()),
            Value::BulkString(b"allkeys-lru".to_vec()),
        ]);
        assert_eq!(policy_in(&flat).as_deref(), Some("allkeys-lru"));
        let map = Value::Map(vec![(
            Value::BulkString(b"maxmemory-policy".to_vec()),
            Value::BulkString(b"noeviction".to_vec()),
        )]);
        assert_eq!(policy_in(&map).as_deref(), Some("noeviction"));
    }
}
