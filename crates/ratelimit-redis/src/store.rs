use std::sync::{Arc, PoisonError};
use std::time::Duration;

use bb8::Pool;
use bb8_redis::RedisConnectionManager;
use ratelimit_core::{Clock, Decision, RuleSet, Store};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use redis::{IntoConnectionInfo, RedisConnectionInfo, RedisError};

use crate::batch::{self, Batcher};
use crate::error::RedisStoreError;
use crate::exact::Exact;
use crate::lease::Leased;
use crate::options::Options;
use crate::script;
use crate::shared::Shared;
use crate::transport::{failure, Link, Pooled, Source, Transport};

/// Connections to one server when none is configured. Each is multiplexed (many
/// requests in flight on one socket), so a few are plenty.
pub(crate) const DEFAULT_POOL_SIZE: u32 = 1;
/// The most checks in one call when none is configured.
pub(crate) const DEFAULT_MAX_BATCH: usize = 64;
/// The most checks one call may carry: the batch function unpacks two key names per check
/// onto Lua's stack at once.
const MAX_BATCH: usize = 1024;

/// The rate-limit [`Store`] over Redis: one server, a Redis Cluster, or the primary of a
/// Sentinel-managed service.
///
/// Every check is one `FCALL` of the decision function (one `EVALSHA` of the decision
/// script before Redis 7), whatever the number of rules, and checks that queue while a
/// call is in flight share one call (see the crate docs); a clone shares the connections
/// and the queue. See the [crate docs](crate) for the key layout, time
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

/// The store's layers, each knowing only the one below: the check path (lease mode in
/// front of the exact path, which hands its requests to the batcher, which hands calls
/// to the transport), and the transport itself for what is not a check (connection
/// state, administration).
struct Inner {
    checks: Leased,
    transport: Arc<Transport>,
}

impl Inner {
    fn exact(&self) -> &Exact {
        self.checks.exact()
    }

    fn shared(&self) -> &Shared {
        self.checks.exact().shared()
    }
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("transport", &self.inner.transport)
            .field("config", self.inner.shared())
            .field("maxmemory_policy", &self.maxmemory_policy())
            .finish()
    }
}

/// Builds a [`RedisStore`]; from [`RedisStore::builder`].
#[derive(Debug, Clone)]
#[must_use]
pub struct RedisStoreBuilder {
    options: Options,
    pool_size: u32,
    max_batch: usize,
    batch_wait: Option<Duration>,
    lease: Option<Duration>,
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

    /// The longest one connection attempt may take, setup included (default 1 s): the
    /// first one, in `build`, and each one the store makes in the background while
    /// Redis is unreachable.
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

    /// The most checks one Redis call decides (default 64, at most 1024; 1 sends every
    /// check as a call of its own). Checks that queue while the store's calls are in flight (one per
    /// connection) leave together as one call that decides them in order, each as
    /// atomically as alone, with one read of Redis `TIME` for all; a lone check leaves at
    /// once. On a Cluster, a batch goes as one call per node (Redis 7; before it, one
    /// call per check). Settles ([`settle`](Store::settle), [`refund`](Store::refund)),
    /// releases and renewals of concurrency slots queue with the checks and leave in the
    /// same calls, each in its turn (on the Lua functions, and on a module of batch
    /// protocol 5 or later; an older module takes each as a call of its own).
    pub fn max_batch(mut self, checks: usize) -> Self {
        self.max_batch = checks.clamp(1, MAX_BATCH);
        self
    }

    /// Holds each batch open up to `wait` after its first check for more to join (none by
    /// default: a batch is what queued while the previous call was in flight). Trades
    /// latency for Redis and app CPU under moderate load; the wait counts against each
    /// check's timeout.
    pub fn batch_wait(mut self, wait: Duration) -> Self {
        self.batch_wait = (!wait.is_zero()).then_some(wait);
        self
    }

    /// Connections a single-server store keeps open (default 1, at least 1), and so the
    /// batched calls it has in flight at once. Connections are multiplexed, so more only
    /// help when one socket's throughput is the limit: with one, more checks share each
    /// call, which costs both Redis and the app less per decision (see BENCHMARKS.md).
    /// Cluster and Sentinel stores keep one multiplexed connection per server.
    pub fn pool_size(mut self, size: u32) -> Self {
        self.pool_size = size.max(1);
        self
    }

    /// Lease mode (off by default): for a hot key, the store reserves a block of units in
    /// one call and spends it locally for up to `length`, giving back what it did not
    /// spend. Over any interval the fleet admits no more than the exact limiter admits
    /// over that interval extended by `length`; see the crate docs ("Lease mode") for
    /// the promise, the algorithms it serves and how soon a block takes effect. A zero
    /// length keeps exact mode.
    pub fn lease(mut self, length: Duration) -> Self {
        self.lease = (!length.is_zero()).then_some(length);
        self
    }

    /// Decides with the Lua functions even where the server has the native module
    /// (crate `ratelimit-redis-module`), which the store otherwise finds and uses by
    /// itself at every (re)connection. Both decide alike on the same keys; this is for
    /// operators who want one path during a rollout, and for tests that compare them.
    pub fn force_lua(mut self, force: bool) -> Self {
        self.options.force_lua = force;
        self
    }

    /// A store for one server at `url` (`redis://[user:password@]host[:port][/db]`, or
    /// `rediss://` when the `redis` crate's TLS features are enabled).
    ///
    /// Fails only when the configuration is wrong (a malformed URL, a bad prefix), never
    /// because Redis is unreachable: the store tries to connect once, within the connect
    /// timeout, and if Redis does not answer it starts anyway. Its checks then fail at
    /// once with [`RedisStoreError::Connection`] (the caller's failure policy decides)
    /// while it reconnects in the background, and go through Redis as soon as it is
    /// back. Every (re)connection loads the scripts and reads the server's `TIME` and
    /// `maxmemory-policy`.
    pub async fn build(self, url: &str) -> Result<RedisStore, RedisStoreError> {
        let shared = self.options.shared()?;
        let invalid = |e: RedisError| {
            RedisStoreError::InvalidConfig(format!(
                "invalid Redis URL: {e}; expected redis://host:port/db"
            ))
        };
        let info = url.into_connection_info().map_err(invalid)?;
        let quiet = info.redis_settings().clone().set_skip_set_lib_name();
        let client = redis::Client::open(info.set_redis_settings(quiet)).map_err(invalid)?;
        let lanes = usize::try_from(self.pool_size).unwrap_or(1);
        self.start(Source::Server { client, lanes }, shared).await
    }

    /// A store for the Redis Cluster reachable through `urls` (one reachable node
    /// suffices; the others are discovered). Fails only on configuration errors (no URL,
    /// a malformed one); a Cluster that is down or not formed yet is connected in the
    /// background, as for [`build`](Self::build). The scripts load on every primary.
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
            // The connection would resend a call lost with its connection, which may
            // have run: a check charged twice. The store follows MOVED itself.
            .retries(0)
            .build()
            .map_err(|e| {
                RedisStoreError::InvalidConfig(format!(
                    "invalid Redis Cluster node URL: {e}; expected redis://host:port/"
                ))
            })?;
        self.start(Source::Cluster(client), shared).await
    }

    /// A store for the primary that the Sentinels at `sentinel_urls` name for
    /// `service_name`. After a failover (the primary's connection fails, or it answers as
    /// a replica) the store asks the Sentinels again and carries on with the new primary.
    /// Fails on configuration errors, including a service the reachable Sentinels do not
    /// know; unreachable Sentinels or primary are connected in the background, as for
    /// [`build`](Self::build).
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
        let quiet = RedisConnectionInfo::default().set_skip_set_lib_name();
        let client = SentinelClient::build(
            urls,
            service_name.to_owned(),
            Some(SentinelNodeConnectionInfo::default().set_redis_connection_info(quiet)),
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
        self.start(Source::Sentinel(tokio::sync::Mutex::new(client)), shared)
            .await
    }

    /// A single-server store over a pool the application already has. Nothing is sent
    /// until the first call, which first sets the server up as [`build`](Self::build)
    /// does at connect: loads the scripts, reads `TIME` (for the callers' deadlines,
    /// from then on) and `maxmemory-policy`. So does the first call after the store
    /// replaced dead pooled connections.
    ///
    /// For one round trip per check, build the pool with `test_on_check_out(false)`
    /// (bb8's default pings every connection it hands out); the store replaces
    /// connections that fail.
    ///
    /// # Panics
    ///
    /// If the configured prefix contains `{` or `}` or the timeout is zero (the errors
    /// [`build`](Self::build) returns), or outside a Tokio runtime (the store starts the
    /// task that sends batched checks).
    pub fn build_with_pool(self, pool: Pool<RedisConnectionManager>) -> RedisStore {
        let shared = self.shared_or_panic("build_with_pool");
        self.store(Transport::Pool(Pooled::new(pool, shared.clone())), shared)
    }

    /// A Cluster store over a cluster connection the application already has. As over a
    /// pool, the first call first sets every master up (scripts, `TIME`,
    /// `maxmemory-policy`).
    ///
    /// The connection's own retries stay as the application configured them; by
    /// default they resend a call lost with its connection, which may have run already
    /// and so charge its checks twice. Build the client with
    /// [`retries(0)`](redis::cluster::ClusterClientBuilder::retries), as
    /// [`build_cluster`](Self::build_cluster) does, for the store to fail such a call
    /// instead (the crate docs, "Failures").
    ///
    /// # Panics
    ///
    /// As [`build_with_pool`](Self::build_with_pool).
    pub fn build_with_cluster_connection(self, conn: ClusterConnection) -> RedisStore {
        let shared = self.shared_or_panic("build_with_cluster_connection");
        self.store(Transport::Link(Link::given(conn, shared.clone())), shared)
    }

    fn shared_or_panic(&self, what: &str) -> Arc<Shared> {
        self.options
            .shared()
            .map(Arc::new)
            .unwrap_or_else(|e| panic!("RedisStoreBuilder::{what}: {e}"))
    }

    /// Connects once (within the connect timeout) and returns the store; when Redis is
    /// unreachable, the store starts unconnected and keeps trying. Only an answer that
    /// says the configuration is wrong fails the build.
    async fn start(self, source: Source, shared: Shared) -> Result<RedisStore, RedisStoreError> {
        let shared = Arc::new(shared);
        let link = Link::new(source, shared.clone(), self.options.connect_timeout);
        if let Err(e) = link.start().await {
            if let e @ RedisStoreError::InvalidConfig(_) = failure(e, self.options.connect_timeout)
            {
                return Err(e);
            }
        }
        Ok(self.store(Transport::Link(link), shared))
    }

    fn store(&self, transport: Transport, shared: Arc<Shared>) -> RedisStore {
        let transport = Arc::new(transport);
        let settings = batch::Settings {
            max: self.max_batch,
            wait: self.batch_wait,
            in_flight: usize::try_from(self.pool_size).unwrap_or(1),
        };
        let batcher = Batcher::start(transport.clone(), shared.clone(), settings);
        let exact = Exact::new(shared, batcher);
        let inner = Arc::new(Inner {
            checks: Leased::new(exact, self.lease),
            transport,
        });
        if let Some(length) = self.lease {
            Leased::spawn_sweep(Arc::downgrade(&inner), |inner| &inner.checks, length / 2);
        }
        RedisStore { inner }
    }
}

impl RedisStore {
    /// A store for the Redis server at `url` with the defaults: prefix `"ratelimit"`,
    /// Redis `TIME`, a 50 ms per-call timeout and one multiplexed connection. As
    /// [`RedisStoreBuilder::build`], fails only on configuration errors, never because
    /// Redis is unreachable.
    pub async fn connect(url: &str) -> Result<Self, RedisStoreError> {
        Self::builder().build(url).await
    }

    /// Configures a store.
    pub fn builder() -> RedisStoreBuilder {
        RedisStoreBuilder {
            options: Options::default(),
            pool_size: DEFAULT_POOL_SIZE,
            max_batch: DEFAULT_MAX_BATCH,
            batch_wait: None,
            lease: None,
        }
    }

    /// The lease length of a store in lease mode; `None` in exact mode (the default).
    pub fn lease_length(&self) -> Option<Duration> {
        self.inner.checks.length()
    }

    /// Gives back now the units of every lease that has ended (the store's sweep does so
    /// every half lease length on its own); nothing in exact mode.
    pub async fn sweep_leases(&self) {
        self.inner.checks.sweep().await;
    }

    /// The connection pool of a store built over one
    /// ([`build_with_pool`](RedisStoreBuilder::build_with_pool)); `None` otherwise.
    pub fn pool(&self) -> Option<&Pool<RedisConnectionManager>> {
        match &*self.inner.transport {
            Transport::Pool(pooled) => Some(&pooled.pool),
            Transport::Link(_) => None,
        }
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.inner.shared().prefix
    }

    /// The server's `maxmemory-policy` as read at the last (re)connection (over the
    /// application's pool or cluster connection: at its first call; on a Cluster, also
    /// after the cluster connection lost a node and reconnects to it); `None` when it
    /// could not be read (CONFIG forbidden) or before the first connection. On a Cluster
    /// it is read from every master: a policy that can evict when a master has one
    /// (each such master is named in a warning), else the one they have. Anything but
    /// `noeviction` can evict rate-limit keys, which the store logs as a warning when it
    /// connects.
    pub fn maxmemory_policy(&self) -> Option<String> {
        self.inner
            .shared()
            .maxmemory_policy
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Whether the store's decisions run in the native module (crate
    /// `ratelimit-redis-module`) rather than as Lua functions: as found at the last
    /// (re)connection (on a Cluster, when every master has the module of the store's
    /// state format), unless the builder's [`force_lua`](RedisStoreBuilder::force_lua)
    /// said otherwise. False before the first connection, and on a Cluster where only
    /// some masters have the module: there each call goes to the module on the masters
    /// that have it and to the Lua functions on the others, by the slot of its key.
    pub fn uses_module(&self) -> bool {
        self.inner
            .shared()
            .paths
            .module
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Resolves once every release and settle handed to the store so far
    /// ([`Store::release_detached`], [`Store::settle_detached`]: what the tower layer
    /// hands over after each response) has been answered by Redis, or given up after its
    /// retries (reported in a `WARN`). Await it when shutting down, after the server
    /// stops taking requests and before the runtime ends, so that the last responses'
    /// settles (a metered gateway's token counts) and releases reach Redis; with a
    /// timeout of your choosing, since a store that cannot reach Redis takes its retries
    /// (about 1.3 s, plus twice the store timeout per try) before it gives up.
    ///
    /// ```no_run
    /// # async fn run(store: ratelimit_redis::RedisStore) {
    /// // ... axum::serve(listener, app).with_graceful_shutdown(signal).await ...
    /// let _ = tokio::time::timeout(std::time::Duration::from_secs(5), store.flush()).await;
    /// # }
    /// ```
    pub async fn flush(&self) {
        self.inner.exact().flushed().await;
    }

    /// Whether the store holds a connection to Redis now. A store starts and runs
    /// without one (its checks fail with [`RedisStoreError::Connection`]) and reconnects
    /// by itself. Always true for a store over an application's pool.
    pub fn is_connected(&self) -> bool {
        self.inner.transport.is_connected()
    }

    /// Resolves once the store holds a connection to Redis (at once when it does), e.g.
    /// for a readiness probe, or to wait for Redis at startup with a timeout of one's
    /// choosing.
    pub async fn connected(&self) {
        self.inner.transport.connected().await;
    }

    /// Removes the function libraries that other versions of this crate loaded, on
    /// every primary (each master of a Cluster; the current primary of a Sentinel
    /// service, whose replicas follow it), and returns their names. Only libraries named
    /// `ratelimit_` and a 16-hex-digit tag are removed, and never this version's own:
    /// other applications' libraries stay. Nothing to do on Redis 6.2 (no functions).
    ///
    /// Each version loads its own library (its name is tagged with the SHA1 of its
    /// script), so that old and new app servers share a Redis during a rolling deploy,
    /// each calling its own functions; without this, every upgrade leaves the
    /// previous library on every server for good. Run it once the deploy is done,
    /// from one instance of the new version or from an operator's tool. Running it
    /// earlier breaks nothing: an instance of an older version whose library is gone
    /// loads it again on its next check (one extra round trip; see the crate docs,
    /// "Upgrading"), and the library is then back until the next run. Nothing removes
    /// libraries by itself, so two versions never take turns removing each other's.
    ///
    /// Fails when a primary cannot be reached or refuses `FUNCTION LIST` /
    /// `FUNCTION DELETE` (an ACL); what was removed before that stays removed, and a
    /// second run finishes the job.
    pub async fn unload_other_versions(&self) -> Result<Vec<String>, RedisStoreError> {
        let transport = &self.inner.transport;
        let timeout = self.inner.shared().timeout;
        let mut removed = std::collections::BTreeSet::new();
        for (primary, listed) in transport
            .on_primaries(script::function_list_cmd(), timeout)
            .await?
        {
            let listed = match listed {
                Ok(listed) => listed,
                Err(RedisStoreError::Script(e)) if script::unknown_command(&e) => continue,
                Err(e) => return Err(e),
            };
            let names = script::library_names(&listed).ok_or_else(|| {
                RedisStoreError::UnexpectedReply(format!(
                    "FUNCTION LIST should answer a list of libraries, got {listed:?}"
                ))
            })?;
            for name in names
                .into_iter()
                .filter(|name| script::is_other_version(name))
            {
                let delete = script::function_delete_cmd(&name);
                match transport.on_primary(&primary, delete, timeout).await {
                    Ok(_) => {
                        tracing::info!(
                            library = %name,
                            ?primary,
                            "removed the rate-limit function library of another version"
                        );
                        removed.insert(name);
                    }
                    // Removed meanwhile, by another run.
                    Err(RedisStoreError::Script(e)) if script::library_missing(&e) => {}
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(removed.into_iter().collect())
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
        self.inner.checks.check(key, rules, cost).await
    }

    async fn block(&self, key: &[u8], duration: Option<Duration>) -> Result<(), RedisStoreError> {
        self.inner.exact().block(key, duration).await?;
        self.inner.checks.forget(key);
        Ok(())
    }

    async fn unblock(&self, key: &[u8]) -> Result<(), RedisStoreError> {
        self.inner.exact().unblock(key).await
    }

    /// Deletes the key's state and sliding log: every rule's state, whatever `rules`.
    async fn reset(&self, key: &[u8], rules: &RuleSet) -> Result<(), RedisStoreError> {
        let _ = rules;
        self.inner.exact().reset(key).await?;
        self.inner.checks.forget(key);
        Ok(())
    }

    /// Gives back units through the function library's `give_back` (a script on Redis
    /// 6.2), straight to Redis in lease mode too: the charge is in Redis's state either
    /// way. `charged_at` is a reading of [`now_us`](Store::now_us) taken before the check.
    async fn refund(
        &self,
        key: &[u8],
        rules: &RuleSet,
        cost: u64,
        charged_at: u64,
    ) -> Result<bool, RedisStoreError> {
        if cost == 0 {
            return Ok(false);
        }
        self.inner
            .exact()
            .give_back(key, rules, cost, charged_at)
            .await
    }

    /// Settles in one call, straight to Redis in lease mode too (as
    /// [`refund`](Store::refund)): an actual below the charge through the function
    /// library's `give_back` (the module's `RATELIMIT.GIVE_BACK`), one above it through
    /// `debit` (`RATELIMIT.DEBIT` where every module primary has it, else the Lua
    /// function); no call when the actual is the charge.
    async fn settle(
        &self,
        key: &[u8],
        rules: &RuleSet,
        charged: u64,
        actual: u64,
        charged_at: u64,
    ) -> Result<bool, RedisStoreError> {
        let exact = self.inner.exact();
        match actual.cmp(&charged) {
            std::cmp::Ordering::Less => {
                exact
                    .give_back(key, rules, charged - actual, charged_at)
                    .await
            }
            std::cmp::Ordering::Equal => Ok(false),
            std::cmp::Ordering::Greater => exact.debit(key, rules, actual - charged).await,
        }
    }

    /// Frees a concurrency slot through the function library's `release` (the module's
    /// `RATELIMIT.RELEASE`): one call on the key's state, whatever `rules` (held slots
    /// carry over rule changes), sent again after a lost connection without freeing
    /// twice (a slot is freed by its number, once). In lease mode too: slots are never
    /// leased.
    async fn release(
        &self,
        key: &[u8],
        rules: &RuleSet,
        slot: u64,
    ) -> Result<bool, RedisStoreError> {
        let _ = rules;
        self.inner.exact().edit_slot(key, slot, None).await
    }

    /// Queues the release in the checks' batch where the servers take edits there
    /// (every current module, and the Lua functions), sent again after a lost connection
    /// and retried for about a second while Redis is unreachable; `false` otherwise
    /// (a batch size of 1, or a module older than edits in batches).
    fn release_detached(&self, key: &[u8], rules: &RuleSet, slot: u64) -> bool {
        let _ = rules;
        self.inner.exact().release_detached(key, slot)
    }

    /// Queues the settle's give-back or debt in the checks' batch, as
    /// [`release_detached`](Store::release_detached) does a release.
    fn settle_detached(
        &self,
        key: &[u8],
        rules: &RuleSet,
        charged: u64,
        actual: u64,
        charged_at: u64,
    ) -> bool {
        self.inner
            .exact()
            .settle_detached(key, rules, charged, actual, charged_at)
    }

    /// Renews a concurrency slot through `renew` (`RATELIMIT.RENEW`) to the timeout of
    /// `rules`' concurrency rule.
    async fn renew(&self, key: &[u8], rules: &RuleSet, slot: u64) -> Result<bool, RedisStoreError> {
        let Some(at) = rules.concurrent() else {
            return Ok(false);
        };
        let timeout = rules.rules()[at].period_us();
        self.inner.exact().edit_slot(key, slot, Some(timeout)).await
    }

    /// Takes the slot in the checks' batch (one call with the checks queued beside it),
    /// by the module or the Lua functions; `None` where a server's module is older than
    /// takes (the caller keeps the request's slot to itself).
    async fn take_slot(&self, key: &[u8], rules: &RuleSet) -> Result<Option<u64>, RedisStoreError> {
        self.inner.exact().take_slot(key, rules).await
    }

    /// When a connection of this store last came back after a loss or after failed
    /// attempts (a single server's or a Sentinel's; a Cluster's connection mends itself
    /// and reports none), on the store's clock.
    fn recovered_at_us(&self) -> u64 {
        self.inner
            .shared()
            .recovered_at
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The injected clock's time when one is set; otherwise this host's reading of the
    /// Redis server's `TIME` (learned from `TIME` replies, never ahead of the server's
    /// own; on a Cluster, of the fastest master's), or this host's clock until a reading
    /// arrives.
    fn now_us(&self) -> u64 {
        self.inner.exact().now_us()
    }

    /// Always: every process connected to the same Redis shares the state.
    fn is_shared(&self) -> bool {
        true
    }
}
