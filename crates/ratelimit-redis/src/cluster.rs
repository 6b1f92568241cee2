use std::sync::Arc;
use std::time::Duration;

use ratelimit_core::{Decision, RuleSet, Store};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::Value;

use crate::error::{classify, RedisStoreError};
use crate::options::{common_builder_methods, Options};
use crate::script::{self, Shared, BLOCK, CHECK};

/// The rate-limit [`Store`] over a Redis Cluster, through the `redis` crate's async
/// cluster connection (multiplexed, slot-aware, reconnecting by itself).
///
/// Same decisions, key layout and script as [`RedisStore`](crate::RedisStore): all keys of
/// one client key share one hash tag, so each check is one `EVALSHA` on the primary
/// owning that slot.
///
/// ```no_run
/// use ratelimit_core::{RuleSet, Store};
/// use ratelimit_redis::RedisClusterStore;
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let store = RedisClusterStore::connect([
///     "redis://10.0.0.1:6379/",
///     "redis://10.0.0.2:6379/",
///     "redis://10.0.0.3:6379/",
/// ])
/// .await?;
/// let rules: RuleSet = "1/s sliding-log; 20/min sliding-log".parse()?;
/// let decision = store.check(b"user-42", &rules, 1).await?;
/// # let _ = decision;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct RedisClusterStore {
    conn: ClusterConnection,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for RedisClusterStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisClusterStore")
            .field("config", &self.shared)
            .finish_non_exhaustive()
    }
}

/// Builds a [`RedisClusterStore`]; from [`RedisClusterStore::builder`].
#[derive(Debug, Clone)]
#[must_use]
pub struct RedisClusterStoreBuilder {
    options: Options,
}

impl RedisClusterStoreBuilder {
    common_builder_methods!();

    /// Connects to the cluster through any of `urls` (one reachable node suffices; the
    /// others are discovered), loads the scripts on every node and returns the store.
    pub async fn build<I, S>(self, urls: I) -> Result<RedisClusterStore, RedisStoreError>
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
        let timeout = self.options.connect_timeout;
        let client = ClusterClient::builder(urls)
            .connection_timeout(timeout)
            .build()
            .map_err(|e| {
                RedisStoreError::InvalidConfig(format!(
                    "invalid Redis Cluster node URL: {e}; expected redis://host:port/"
                ))
            })?;
        let connect = async {
            let mut conn = client
                .get_async_connection()
                .await
                .map_err(|e| classify(e, timeout))?;
            // SCRIPT LOAD is sent to every node.
            for script in [&*CHECK, &*BLOCK] {
                let _: Value = script
                    .load_cmd()
                    .query_async(&mut conn)
                    .await
                    .map_err(|e| classify(e, timeout))?;
            }
            Ok(conn)
        };
        let conn = tokio::time::timeout(timeout, connect)
            .await
            .unwrap_or(Err(RedisStoreError::Timeout(timeout)))?;
        Ok(RedisClusterStore { conn, shared })
    }

    /// A store over a cluster connection the application already has. The scripts load
    /// on first use, on each node.
    ///
    /// # Panics
    ///
    /// If the configured prefix contains `{` or `}` or the timeout is zero (the errors
    /// [`build`](Self::build) returns).
    pub fn build_with_connection(self, conn: ClusterConnection) -> RedisClusterStore {
        let shared = self
            .options
            .shared()
            .unwrap_or_else(|e| panic!("RedisClusterStoreBuilder::build_with_connection: {e}"));
        RedisClusterStore { conn, shared }
    }
}

impl RedisClusterStore {
    /// A store for the cluster reachable through `urls`, with the defaults: prefix
    /// `"ratelimit"`, Redis `TIME` (of the node owning each key) and a 50 ms per-call
    /// timeout.
    pub async fn connect<I, S>(urls: I) -> Result<Self, RedisStoreError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        Self::builder().build(urls).await
    }

    /// Configures a store.
    pub fn builder() -> RedisClusterStoreBuilder {
        RedisClusterStoreBuilder {
            options: Options::default(),
        }
    }

    /// The cluster connection.
    pub fn connection(&self) -> &ClusterConnection {
        &self.conn
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.shared.prefix
    }

    async fn with_timeout(
        &self,
        fut: impl std::future::Future<Output = redis::RedisResult<Value>>,
    ) -> Result<Value, RedisStoreError> {
        let timeout = self.shared.timeout;
        match tokio::time::timeout(timeout, fut).await {
            Ok(reply) => reply.map_err(|e| classify(e, timeout)),
            Err(_) => Err(RedisStoreError::Timeout(timeout)),
        }
    }
}

impl Store for RedisClusterStore {
    type Error = RedisStoreError;

    async fn check(
        &self,
        key: &[u8],
        rules: &RuleSet,
        cost: u64,
    ) -> Result<Decision, RedisStoreError> {
        rules.check_cost(cost)?;
        let call = self.shared.check_call(key, rules, cost);
        let mut conn = self.conn.clone();
        let reply = self.with_timeout(call.invoke(&mut conn)).await?;
        script::decision(rules, reply)
    }

    async fn block(&self, key: &[u8], duration: Option<Duration>) -> Result<(), RedisStoreError> {
        let call = self.shared.block_call(key, duration);
        let mut conn = self.conn.clone();
        self.with_timeout(call.invoke(&mut conn)).await.map(drop)
    }

    async fn unblock(&self, key: &[u8]) -> Result<(), RedisStoreError> {
        let cmd = self.shared.unblock_cmd(key);
        let mut conn = self.conn.clone();
        self.with_timeout(cmd.query_async(&mut conn))
            .await
            .map(drop)
    }

    async fn reset(&self, key: &[u8], rules: &RuleSet) -> Result<(), RedisStoreError> {
        let cmd = self.shared.reset_cmd(key, rules);
        let mut conn = self.conn.clone();
        self.with_timeout(cmd.query_async(&mut conn))
            .await
            .map(drop)
    }
}
