//! How requests reach Redis: one server through a pool, a Cluster, or the primary a set
//! of Sentinels names. The store above sends every request through [`Transport::send`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::RwLock;

use bb8::{Pool, RunError};
use bb8_redis::RedisConnectionManager;
use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster_async::ClusterConnection;
use redis::sentinel::SentinelClient;
use redis::{ErrorKind, RedisError, RedisResult, ServerErrorKind, Value};

use crate::error::is_connection_error;
use crate::script::{self, Request};

/// The connection to Redis a store sends its requests through.
pub(crate) enum Transport {
    /// One server (or a proxy in front of one) through a pool of multiplexed connections.
    Single(Single),
    /// A Redis Cluster through the `redis` crate's cluster connection, which routes each
    /// request by its keys' slot and follows MOVED / ASK and failovers by itself.
    Cluster(ClusterConnection),
    /// The primary that Redis Sentinel names for a service, found again after a failover.
    Sentinel(Box<Sentinel>),
}

impl std::fmt::Debug for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Transport::Single(single) => {
                f.debug_tuple("Single").field(&single.pool.state()).finish()
            }
            Transport::Cluster(_) => f.write_str("Cluster"),
            Transport::Sentinel(_) => f.write_str("Sentinel"),
        }
    }
}

impl Transport {
    /// Sends `request`; a request whose connection turned out dead (or whose server is no
    /// longer the primary) is sent once more on a fresh connection.
    ///
    /// A request lost with its connection may have reached Redis first; if so it is
    /// counted twice, which errs toward limiting, never toward admitting more.
    pub(crate) async fn send(&self, request: &Request<'_>) -> Result<Value, Failure> {
        match self {
            Transport::Single(single) => single.send(request).await,
            Transport::Cluster(conn) => Ok(request.send(&mut conn.clone()).await?),
            Transport::Sentinel(sentinel) => sentinel.send(request).await,
        }
    }
}

/// Why a request failed: Redis's answer, or bb8's own timeout.
#[derive(Debug)]
pub(crate) enum Failure {
    Redis(RedisError),
    PoolTimedOut,
}

impl From<RedisError> for Failure {
    fn from(e: RedisError) -> Self {
        Failure::Redis(e)
    }
}

impl From<RunError<RedisError>> for Failure {
    fn from(e: RunError<RedisError>) -> Self {
        match e {
            RunError::User(e) => Failure::Redis(e),
            RunError::TimedOut => Failure::PoolTimedOut,
        }
    }
}

/// Loads the store's scripts through `conn` (on a Cluster connection, on every primary),
/// and the decision function library where the server has functions (Redis 7). Returns
/// whether it has.
pub(crate) async fn load_scripts<C: ConnectionLike + Send>(conn: &mut C) -> RedisResult<bool> {
    let mut functions = true;
    for script in script::scripts() {
        let _: Value = script.load_cmd().query_async(conn).await?;
        if let Some(load) = script.function_load_cmd() {
            match load.query_async::<Value>(conn).await {
                Ok(_) => {}
                Err(e) if script::already_loaded(&e) => {}
                Err(e) if script::unknown_command(&e) => functions = false,
                Err(e) => return Err(e),
            }
        }
    }
    Ok(functions)
}

/// Counts repairs so that callers who saw the same failure repair it once.
#[derive(Debug, Default)]
struct Repairs {
    generation: AtomicU64,
    lock: tokio::sync::Mutex<()>,
}

impl Repairs {
    fn seen(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Runs `repair` unless another caller repaired since `seen`.
    async fn once<F: std::future::Future<Output = Result<(), Failure>>>(
        &self,
        seen: u64,
        repair: impl FnOnce() -> F,
    ) -> Result<(), Failure> {
        let _one_at_a_time = self.lock.lock().await;
        if self.seen() != seen {
            return Ok(());
        }
        repair().await?;
        self.generation.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }
}

/// One server through a `bb8` pool of multiplexed connections.
pub(crate) struct Single {
    pub(crate) pool: Pool<RedisConnectionManager>,
    repairs: Repairs,
}

impl Single {
    pub(crate) fn new(pool: Pool<RedisConnectionManager>) -> Self {
        Self {
            pool,
            repairs: Repairs::default(),
        }
    }

    async fn send(&self, request: &Request<'_>) -> Result<Value, Failure> {
        let seen = self.repairs.seen();
        match request.send(&mut self.checkout().await?).await {
            Err(e) if is_connection_error(&e) => {
                // Redis restarted or the network dropped the socket: replace the dead pooled
                // connections and send once more.
                tracing::debug!(error = %e, "Redis connection failed; reconnecting");
                self.repairs.once(seen, || self.replace_dead()).await?;
                Ok(request.send(&mut self.checkout().await?).await?)
            }
            other => Ok(other?),
        }
    }

    /// A handle on one of the pool's multiplexed connections. The pooled connection goes
    /// back at once: requests from many tasks share its socket (pipelined), instead of
    /// queueing for exclusive use, where bb8 lets newcomers overtake waiting tasks.
    async fn checkout(&self) -> Result<MultiplexedConnection, Failure> {
        Ok((*self.pool.get().await?).clone())
    }

    /// bb8 cannot be told a connection broke, so each pooled connection is probed with
    /// PING (an immediate error when its socket is gone) and a dead one is swapped for a
    /// fresh one in place.
    async fn replace_dead(&self) -> Result<(), Failure> {
        for _ in 0..self.pool.state().connections.max(1) {
            let mut pooled = self.pool.get().await?;
            let probe: RedisResult<()> = redis::cmd("PING").query_async(&mut *pooled).await;
            if let Err(e) = probe {
                if !is_connection_error(&e) {
                    return Err(e.into());
                }
                *pooled = self.pool.dedicated_connection().await?;
            }
        }
        Ok(())
    }
}

/// The primary of a Sentinel-managed service. The connection is kept until it fails or
/// the server answers as a replica (`READONLY`, after a failover demoted it); then the
/// Sentinels are asked for the primary again.
pub(crate) struct Sentinel {
    client: tokio::sync::Mutex<SentinelClient>,
    primary: RwLock<Option<MultiplexedConnection>>,
    repairs: Repairs,
}

impl Sentinel {
    /// Asks the Sentinels for the primary and connects to it.
    pub(crate) async fn connect(client: SentinelClient) -> Result<Self, Failure> {
        let sentinel = Self {
            client: tokio::sync::Mutex::new(client),
            primary: RwLock::new(None),
            repairs: Repairs::default(),
        };
        sentinel.rediscover().await?;
        Ok(sentinel)
    }

    /// The current primary's connection.
    pub(crate) fn primary(&self) -> Option<MultiplexedConnection> {
        self.primary
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    async fn rediscover(&self) -> Result<(), Failure> {
        let client = self.client.lock().await.async_get_client().await?;
        let mut conn = client.get_multiplexed_async_connection().await?;
        load_scripts(&mut conn).await?;
        *self
            .primary
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(conn);
        Ok(())
    }

    async fn send(&self, request: &Request<'_>) -> Result<Value, Failure> {
        let seen = self.repairs.seen();
        let first = match self.primary() {
            Some(mut conn) => request.send(&mut conn).await,
            None => Err(RedisError::from((
                ErrorKind::Io,
                "no primary connection yet",
            ))),
        };
        match first {
            Err(e) if is_connection_error(&e) || is_demoted(&e) => {
                tracing::info!(error = %e, "Redis primary lost; asking Sentinel for the primary");
                self.repairs.once(seen, || self.rediscover()).await?;
                let mut conn = self
                    .primary()
                    .ok_or_else(|| RedisError::from((ErrorKind::Io, "no primary connection")))?;
                Ok(request.send(&mut conn).await?)
            }
            other => Ok(other?),
        }
    }
}

/// The server no longer takes writes as a primary: a failover happened.
fn is_demoted(e: &RedisError) -> bool {
    matches!(
        e.kind(),
        ErrorKind::Server(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)
    )
}
