//! How requests reach Redis: connections the store keeps and re-establishes itself (one
//! server, a Cluster, the primary a set of Sentinels names), or a pool the application
//! brought. The store above sends every request through [`Transport::send`].

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock, Weak};
use std::time::{Duration, Instant};

use bb8::{Pool, RunError};
use bb8_redis::RedisConnectionManager;
use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{
    MultipleNodeRoutingInfo, Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr,
};
use redis::sentinel::SentinelClient;
use redis::{
    AsyncConnectionConfig, Cmd, ErrorKind, RedisError, RedisResult, ServerErrorKind, Value,
};

use ratelimit_core::util::BoundedLog;

use crate::error::{classify, is_connection_error, is_unreachable, RedisStoreError};
use crate::script::{self, Call, Request};
use crate::shared::Shared;

/// The first pause between reconnection attempts; it doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(50);
/// The longest pause between reconnection attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// The connection to Redis a store sends its requests through.
pub(crate) enum Transport {
    /// Connections the store opened and re-opens after a failure.
    Link(Arc<Link>),
    /// An application's `bb8` pool of multiplexed connections to one server.
    Pool(Pooled),
}

impl std::fmt::Debug for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Transport::Link(link) => f
                .debug_struct("Link")
                .field("topology", &link.source.name())
                .field("connected", &link.is_connected())
                .finish(),
            Transport::Pool(pooled) => f.debug_tuple("Pool").field(&pooled.pool.state()).finish(),
        }
    }
}

impl Transport {
    /// Sends `request`. A request whose connection turned out dead (or whose server is no
    /// longer the primary) is sent once more if a fresh connection comes up in time, but
    /// only when running it twice does no harm ([`Request::repeatable`]): a check or a
    /// refund lost with its connection may have run in Redis before the connection
    /// broke, and nothing tells whether it did, so it fails (the caller's failure policy
    /// decides) rather than charge or give back twice. A call the server answered
    /// without running it (a missing script or function, a moved slot) is resent.
    pub(crate) async fn send(&self, request: &Request<'_>) -> Result<Value, Failure> {
        match self {
            Transport::Link(link) => link.send(request).await,
            Transport::Pool(pooled) => pooled.send(request).await,
        }
    }

    /// Sends `request` within `timeout`, with the failure sorted into the store's errors.
    pub(crate) async fn call(
        &self,
        request: &Request<'_>,
        timeout: Duration,
    ) -> Result<Value, RedisStoreError> {
        match tokio::time::timeout(timeout, self.send(request)).await {
            Ok(reply) => reply.map_err(|e| failure(e, timeout)),
            Err(_) => Err(RedisStoreError::Timeout(timeout)),
        }
    }

    /// Whether the store talks to a Redis Cluster.
    pub(crate) fn is_cluster(&self) -> bool {
        matches!(self, Transport::Link(link) if link.is_cluster())
    }

    /// On a Cluster, which node serves each slot, as last read (read now when not yet
    /// known or since found stale); `None` on one server, or when it cannot be read.
    pub(crate) async fn nodes(&self) -> Option<Arc<Nodes>> {
        match self {
            Transport::Link(link) if link.is_cluster() => link.nodes().await,
            _ => None,
        }
    }

    /// Notes that a slot was not where the node map said: it is read again before the
    /// next batch.
    pub(crate) fn nodes_stale(&self) {
        if let Transport::Link(link) = self {
            link.nodes.stale.store(true, Ordering::Release);
        }
    }

    /// Sends `call` to the Cluster node serving `slot` (as the connection's own map has
    /// it), within `timeout`.
    pub(crate) async fn call_on(
        &self,
        slot: u16,
        call: &Call<'_>,
        timeout: Duration,
    ) -> Result<Value, RedisStoreError> {
        let Transport::Link(link) = self else {
            return Err(RedisStoreError::UnexpectedReply(
                "a call to a Cluster node over a pool".into(),
            ));
        };
        let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(Route::new(
            slot,
            SlotAddr::Master,
        )));
        let send = async {
            link.set_up().await?;
            let reply = match link.conn()? {
                (Conn::Cluster(mut conn), _) => call.invoke_routed(&mut conn, &routing).await,
                (Conn::Multiplexed(mut conn), _) => call.invoke(&mut conn).await,
            };
            Ok::<_, Failure>(reply.inspect_err(|e| link.node_lost(e))?)
        };
        match tokio::time::timeout(timeout, send).await {
            Ok(reply) => reply.map_err(|e| failure(e, timeout)),
            Err(_) => Err(RedisStoreError::Timeout(timeout)),
        }
    }

    /// Sends `cmd` to every primary within `timeout`: the store's one server (the
    /// Sentinels' current primary, the pool's server), or each master of a Cluster;
    /// returns each primary's answer.
    pub(crate) async fn on_primaries(
        &self,
        cmd: Cmd,
        timeout: Duration,
    ) -> Result<Vec<(Primary, Result<Value, RedisStoreError>)>, RedisStoreError> {
        let Transport::Link(link) = self else {
            return Ok(vec![(
                Primary::Server,
                self.call(&Request::Cmd(cmd), timeout).await,
            )]);
        };
        if !link.is_cluster() {
            return Ok(vec![(
                Primary::Server,
                self.call(&Request::Cmd(cmd), timeout).await,
            )]);
        }
        let mut conn = link.cluster_conn(timeout)?;
        let replies = match tokio::time::timeout(timeout, on_masters(&mut conn, cmd)).await {
            Ok(replies) => replies.map_err(|e| classify(e, timeout))?,
            Err(_) => return Err(RedisStoreError::Timeout(timeout)),
        };
        Ok(replies
            .into_iter()
            .map(|(primary, reply)| (primary, reply.map_err(|e| classify(e, timeout))))
            .collect())
    }

    /// Sends `cmd` to `primary` (one of those [`on_primaries`](Self::on_primaries)
    /// answered for) within `timeout`.
    pub(crate) async fn on_primary(
        &self,
        primary: &Primary,
        cmd: Cmd,
        timeout: Duration,
    ) -> Result<Value, RedisStoreError> {
        let (Primary::Master { host, port }, Transport::Link(link)) = (primary, self) else {
            return self.call(&Request::Cmd(cmd), timeout).await;
        };
        let mut conn = link.cluster_conn(timeout)?;
        let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
            host: host.clone(),
            port: *port,
        });
        match tokio::time::timeout(timeout, conn.route_command(cmd, routing)).await {
            Ok(reply) => reply
                .and_then(Value::extract_error)
                .map_err(|e| classify(e, timeout)),
            Err(_) => Err(RedisStoreError::Timeout(timeout)),
        }
    }

    /// Whether the store holds a working connection (always true over a pool, whose
    /// connections the application manages).
    pub(crate) fn is_connected(&self) -> bool {
        match self {
            Transport::Link(link) => link.is_connected(),
            Transport::Pool(_) => true,
        }
    }

    /// Resolves once the store holds a connection.
    pub(crate) async fn connected(&self) {
        if let Transport::Link(link) = self {
            link.connected().await;
        }
    }
}

/// A primary that a command goes to: the store's one server, or a Cluster master.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Primary {
    /// The one server: the store's, the Sentinels' current primary, the pool's.
    Server,
    /// A Cluster master, by the address the cluster connection knows it by.
    Master { host: String, port: u16 },
}

impl Primary {
    /// A master from the `host:port` the cluster connection names it by.
    fn parse(address: &Value) -> Option<Self> {
        let address = match address {
            Value::BulkString(bytes) => std::str::from_utf8(bytes).ok()?,
            Value::SimpleString(s) => s.as_str(),
            _ => return None,
        };
        let (host, port) = address.rsplit_once(':')?;
        Some(Primary::Master {
            host: host.to_owned(),
            port: port.parse().ok()?,
        })
    }
}

/// `cmd` on every master of a Cluster: each master's reply (an error reply as an error)
/// under its address.
async fn on_masters(
    conn: &mut ClusterConnection,
    cmd: Cmd,
) -> RedisResult<Vec<(Primary, RedisResult<Value>)>> {
    let unexpected = |detail: String| {
        RedisError::from((ErrorKind::UnexpectedReturnType, "unexpected reply", detail))
    };
    let routing = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
    // Without a response policy the cluster connection answers with each node's reply
    // under the node's address.
    let reply = conn.route_command(cmd, routing).await?;
    let Value::Map(replies) = reply else {
        return Err(unexpected(format!(
            "a command to every Cluster primary should answer per node, got {reply:?}"
        )));
    };
    replies
        .into_iter()
        .map(|(address, reply)| {
            let primary = Primary::parse(&address).ok_or_else(|| {
                unexpected(format!(
                    "a Cluster node should be named host:port, got {address:?}"
                ))
            })?;
            let reply = match reply {
                Value::ServerError(e) => Err(e.into()),
                reply => Ok(reply),
            };
            Ok((primary, reply))
        })
        .collect()
}

/// The store's error for a failed request.
pub(crate) fn failure(e: Failure, timeout: Duration) -> RedisStoreError {
    match e {
        Failure::Redis(e) => classify(e, timeout),
        Failure::PoolTimedOut => RedisStoreError::Timeout(timeout),
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

/// Where a [`Link`] gets its connections.
pub(crate) enum Source {
    /// One server: `lanes` multiplexed connections to it.
    Server { client: redis::Client, lanes: usize },
    /// A Redis Cluster; the `redis` crate's cluster connection follows slots, failovers
    /// and node restarts by itself once it exists.
    Cluster(ClusterClient),
    /// The primary the Sentinels name for a service.
    Sentinel(tokio::sync::Mutex<SentinelClient>),
    /// A cluster connection the application made: nothing to reconnect.
    Given,
}

impl Source {
    fn name(&self) -> &'static str {
        match self {
            Source::Server { .. } => "server",
            Source::Cluster(_) | Source::Given => "cluster",
            Source::Sentinel(_) => "sentinel",
        }
    }
}

/// One open connection of a [`Link`].
#[derive(Clone)]
enum Conn {
    Multiplexed(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl Conn {
    async fn send(&mut self, request: &Request<'_>) -> RedisResult<Value> {
        match self {
            Conn::Multiplexed(conn) => request.send(conn).await,
            Conn::Cluster(conn) => request.send(conn).await,
        }
    }

    /// `cmd`'s reply from the server, or from every master of a Cluster by address; the
    /// error of a reply stays with its node.
    async fn each_master(&mut self, cmd: Cmd) -> RedisResult<Vec<(Primary, RedisResult<Value>)>> {
        match self {
            Conn::Multiplexed(conn) => Ok(vec![(Primary::Server, cmd.query_async(conn).await)]),
            Conn::Cluster(conn) => on_masters(conn, cmd).await,
        }
    }
}

/// What a [`Link`] knows about its recent failures.
#[derive(Default)]
struct Health {
    /// A task is reconnecting.
    reconnecting: bool,
    /// Failed attempts since the last working connection.
    failures: u64,
    down_since: Option<Instant>,
    last_error: Option<RedisError>,
}

/// Connections the store opened itself. While they work, requests go through them; once
/// one fails, they are dropped and a background task reconnects with growing pauses
/// (50 ms doubling to 2 s), setting every new connection up as at build: the scripts
/// loaded, Redis `TIME` read, `maxmemory-policy` read. Meanwhile requests fail at once
/// with [`RedisStoreError::Connection`](crate::RedisStoreError::Connection): no request
/// waits for a server that is not there.
pub(crate) struct Link {
    source: Source,
    shared: Arc<Shared>,
    connect_timeout: Duration,
    current: RwLock<Option<Arc<[Conn]>>>,
    /// Round robin over the lanes.
    next: AtomicUsize,
    /// Bumped by every install and every break, so that a stale failure breaks nothing.
    generation: AtomicU64,
    health: Mutex<Health>,
    /// Counts finished connection attempts, for callers waiting on one.
    attempts: tokio::sync::watch::Sender<u64>,
    failure_log: BoundedLog,
    /// On a Cluster, the node of each slot.
    nodes: NodeMap,
    /// Over the application's connection: not yet set up as [`prepare`] sets up the
    /// store's own connections. It is on the first call.
    unprepared: std::sync::atomic::AtomicBool,
    /// One setup at a time.
    preparing: tokio::sync::Mutex<()>,
    /// On a Cluster, a task reads the masters' `maxmemory-policy` again.
    rereading: std::sync::atomic::AtomicBool,
}

/// Which Cluster node serves each slot: a number per node, the same for every slot the
/// node serves (`u16::MAX` for a slot no node serves).
#[derive(Debug)]
pub(crate) struct Nodes {
    of_slot: Vec<u16>,
    /// Each node's address, by its number.
    addresses: Vec<(String, u16)>,
}

impl Nodes {
    /// The node serving `slot`.
    pub(crate) fn of(&self, slot: u16) -> u16 {
        self.of_slot[usize::from(slot)]
    }

    /// The map in a `CLUSTER SLOTS` reply: `[start, end, [host, port, ..], replicas..]`
    /// per range.
    fn parse(reply: &Value) -> Option<Self> {
        let Value::Array(ranges) = reply else {
            return None;
        };
        let mut of_slot = vec![u16::MAX; 16384];
        let mut seen: Vec<(String, u16)> = Vec::new();
        for range in ranges {
            let Value::Array(fields) = range else {
                return None;
            };
            let (Value::Int(start), Value::Int(end), Value::Array(primary)) =
                (fields.first()?, fields.get(1)?, fields.get(2)?)
            else {
                return None;
            };
            let address = match (primary.first()?, primary.get(1)?) {
                (host, Value::Int(port)) => (
                    match host {
                        Value::BulkString(bytes) => String::from_utf8(bytes.clone()).ok()?,
                        Value::SimpleString(s) => s.clone(),
                        _ => return None,
                    },
                    u16::try_from(*port).ok()?,
                ),
                _ => return None,
            };
            let node = match seen.iter().position(|a| *a == address) {
                Some(i) => i,
                None => {
                    seen.push(address);
                    seen.len() - 1
                }
            };
            let (start, end) = (usize::try_from(*start).ok()?, usize::try_from(*end).ok()?);
            for slot in of_slot.get_mut(start..=end)? {
                *slot = u16::try_from(node).ok()?;
            }
        }
        Some(Self {
            of_slot,
            addresses: seen,
        })
    }

    /// Records in `paths` which slots' nodes are among `with` (the primaries with the
    /// module), when some are and some are not.
    fn map_module(&self, paths: &script::Paths, with: &[(String, u16)]) {
        let mixed = !with.is_empty() && self.addresses.iter().any(|a| !with.contains(a));
        paths.set_module_slots(mixed.then_some(|slot: u16| {
            self.addresses
                .get(usize::from(self.of(slot)))
                .is_some_and(|address| with.contains(address))
        }));
    }
}

/// The node map as last read, and whether a batch found it stale since.
#[derive(Default)]
struct NodeMap {
    current: RwLock<Option<Arc<Nodes>>>,
    stale: std::sync::atomic::AtomicBool,
    /// One reader at a time.
    reading: tokio::sync::Mutex<()>,
}

impl Link {
    pub(crate) fn new(source: Source, shared: Arc<Shared>, connect_timeout: Duration) -> Arc<Self> {
        Arc::new(Self {
            source,
            shared,
            connect_timeout,
            current: RwLock::new(None),
            next: AtomicUsize::new(0),
            generation: AtomicU64::new(0),
            health: Mutex::new(Health::default()),
            attempts: tokio::sync::watch::Sender::new(0),
            failure_log: BoundedLog::new(),
            nodes: NodeMap::default(),
            unprepared: std::sync::atomic::AtomicBool::new(false),
            preparing: tokio::sync::Mutex::new(()),
            rereading: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Sets up the application's connection on its first call (nothing to do for the
    /// store's own connections, set up as they were opened).
    async fn set_up(&self) -> Result<(), Failure> {
        if !self.unprepared.load(Ordering::Acquire) {
            return Ok(());
        }
        let _one_at_a_time = self.preparing.lock().await;
        if !self.unprepared.load(Ordering::Acquire) {
            return Ok(());
        }
        let (mut conn, _) = self.conn()?;
        prepare(&mut conn, &self.shared).await?;
        self.unprepared.store(false, Ordering::Release);
        Ok(())
    }

    fn is_cluster(&self) -> bool {
        matches!(self.source, Source::Cluster(_) | Source::Given)
    }

    /// The node map; read with `CLUSTER SLOTS` when unknown or stale.
    async fn nodes(&self) -> Option<Arc<Nodes>> {
        let known = || {
            let current = self
                .nodes
                .current
                .read()
                .unwrap_or_else(PoisonError::into_inner);
            current
                .clone()
                .filter(|_| !self.nodes.stale.load(Ordering::Acquire))
        };
        if let Some(nodes) = known() {
            return Some(nodes);
        }
        let _one = self.nodes.reading.lock().await;
        if let Some(nodes) = known() {
            return Some(nodes);
        }
        let Ok((Conn::Cluster(mut conn), _)) = self.conn() else {
            return None;
        };
        self.nodes.stale.store(false, Ordering::Release);
        let mut cmd = redis::cmd("CLUSTER");
        cmd.arg("SLOTS");
        let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random);
        let read = conn.route_command(cmd, routing);
        let reply = tokio::time::timeout(self.shared.timeout, read).await.ok()?;
        let nodes = Arc::new(Nodes::parse(&reply.ok()?)?);
        nodes.map_module(&self.shared.paths, &self.shared.paths.module_nodes());
        *self
            .nodes
            .current
            .write()
            .unwrap_or_else(PoisonError::into_inner) = Some(nodes.clone());
        Some(nodes)
    }

    /// A link over a cluster connection the application made; the scripts load on first
    /// use.
    pub(crate) fn given(conn: ClusterConnection, shared: Arc<Shared>) -> Arc<Self> {
        let link = Self::new(Source::Given, shared, Duration::ZERO);
        link.install(vec![Conn::Cluster(conn)]);
        link.unprepared.store(true, Ordering::Release);
        link
    }

    /// Connects once within the connect timeout; on failure a background task keeps
    /// trying. Returns the failure (for the caller to tell configuration errors apart).
    pub(crate) async fn start(self: &Arc<Self>) -> Result<(), Failure> {
        match self.attempt().await {
            Ok(()) => Ok(()),
            Err(e) => {
                self.failed(&e);
                self.reconnect_in_background(true);
                Err(e)
            }
        }
    }

    fn lock_health(&self) -> std::sync::MutexGuard<'_, Health> {
        self.health.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn is_connected(&self) -> bool {
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
    }

    async fn connected(&self) {
        let mut attempts = self.attempts.subscribe();
        while !self.is_connected() {
            if attempts.changed().await.is_err() {
                return;
            }
        }
    }

    /// One connection attempt with its setup, within the connect timeout.
    async fn attempt(&self) -> Result<(), Failure> {
        let connect = async {
            let conns = self.open().await?;
            prepare(&mut conns[0].clone(), &self.shared).await?;
            Ok::<_, Failure>(conns)
        };
        let result = match tokio::time::timeout(self.connect_timeout, connect).await {
            Ok(result) => result,
            Err(_) => Err(Failure::Redis(RedisError::from((
                ErrorKind::Io,
                "connecting to Redis timed out",
                format!(
                    "no answer within the connect timeout ({:?})",
                    self.connect_timeout
                ),
            )))),
        };
        if let Ok(conns) = result {
            self.install(conns);
            self.recovered();
            return Ok(());
        }
        self.attempts.send_modify(|n| *n += 1);
        result.map(drop)
    }

    async fn open(&self) -> Result<Vec<Conn>, Failure> {
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.connect_timeout))
            // The store bounds every call with its own timeout.
            .set_response_timeout(None);
        match &self.source {
            Source::Server { client, lanes } => {
                let mut conns = Vec::with_capacity(*lanes);
                for _ in 0..*lanes {
                    let conn = client
                        .get_multiplexed_async_connection_with_config(&config)
                        .await?;
                    conns.push(Conn::Multiplexed(conn));
                }
                Ok(conns)
            }
            Source::Cluster(client) => {
                Ok(vec![Conn::Cluster(client.get_async_connection().await?)])
            }
            Source::Sentinel(client) => {
                let client = client.lock().await.async_get_client().await?;
                let conn = client
                    .get_multiplexed_async_connection_with_config(&config)
                    .await?;
                Ok(vec![Conn::Multiplexed(conn)])
            }
            Source::Given => Err(Failure::Redis(RedisError::from((
                ErrorKind::Io,
                "the application's cluster connection cannot be reopened",
            )))),
        }
    }

    fn install(&self, conns: Vec<Conn>) {
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = Some(conns.into());
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// Logs the recovery when there were failures, and wakes whoever waits.
    fn recovered(&self) {
        let (failures, down_since) = {
            let mut health = self.lock_health();
            let seen = (health.failures, health.down_since);
            *health = Health {
                reconnecting: health.reconnecting,
                ..Health::default()
            };
            seen
        };
        if failures > 0 {
            tracing::info!(
                topology = self.source.name(),
                failed_attempts = failures,
                down_for = ?down_since.map(|t| t.elapsed()),
                "Redis is reachable again; rate-limit checks go through it"
            );
        }
        self.attempts.send_modify(|n| *n += 1);
    }

    fn failed(&self, e: &Failure) {
        let error = match e {
            Failure::Redis(e) => e.clone(),
            Failure::PoolTimedOut => RedisError::from((ErrorKind::Io, "timed out")),
        };
        {
            let mut health = self.lock_health();
            health.failures += 1;
            health.down_since.get_or_insert_with(Instant::now);
            health.last_error = Some(error.clone());
        }
        if let Some(count) = self.failure_log.hit(self.shared.now_us()) {
            tracing::warn!(
                topology = self.source.name(),
                %error,
                failed_attempts = count,
                "cannot connect to Redis; rate-limit checks fail (the caller's failure policy \
                 decides) and the store keeps trying in the background (reported at most \
                 every 10 s, with the attempts since the last report)"
            );
        }
    }

    /// Starts the reconnecting task unless one runs. It holds the link weakly: a dropped
    /// store stops it.
    fn reconnect_in_background(self: &Arc<Self>, pause_first: bool) {
        {
            let mut health = self.lock_health();
            if health.reconnecting {
                return;
            }
            health.reconnecting = true;
        }
        let weak = Arc::downgrade(self);
        tokio::spawn(reconnect(weak, pause_first));
    }

    /// The cluster connection of a Cluster store, or the store's error why there is
    /// none.
    fn cluster_conn(&self, timeout: Duration) -> Result<ClusterConnection, RedisStoreError> {
        match self.conn() {
            Ok((Conn::Cluster(conn), _)) => Ok(conn),
            Ok((Conn::Multiplexed(_), _)) => Err(RedisStoreError::UnexpectedReply(
                "a Cluster command over a connection to one server".into(),
            )),
            Err(e) => Err(classify(e, timeout)),
        }
    }

    /// A connection to send on, or the reason there is none.
    fn conn(&self) -> Result<(Conn, u64), RedisError> {
        let current = self.current.read().unwrap_or_else(PoisonError::into_inner);
        match &*current {
            Some(conns) => {
                let i = self.next.fetch_add(1, Ordering::Relaxed) % conns.len();
                Ok((conns[i].clone(), self.generation.load(Ordering::Acquire)))
            }
            None => {
                drop(current);
                let detail = match &self.lock_health().last_error {
                    Some(e) => format!("last attempt: {e}"),
                    None => "the connection was lost".to_owned(),
                };
                Err(RedisError::from((
                    ErrorKind::Io,
                    "no connection to Redis; reconnecting in the background",
                    detail,
                )))
            }
        }
    }

    /// Whether `e` means the connection is unusable.
    fn breaks(&self, e: &RedisError) -> bool {
        match self.source {
            // The cluster connection repairs itself.
            Source::Cluster(_) | Source::Given => false,
            Source::Server { .. } => is_connection_error(e),
            Source::Sentinel(_) => is_connection_error(e) || is_demoted(e),
        }
    }

    /// Drops the connections of `generation` (unless replaced meanwhile) and reconnects.
    fn broken(self: &Arc<Self>, generation: u64, e: &RedisError) {
        {
            let mut current = self.current.write().unwrap_or_else(PoisonError::into_inner);
            if self.generation.load(Ordering::Acquire) != generation || current.is_none() {
                return;
            }
            *current = None;
            self.generation.fetch_add(1, Ordering::AcqRel);
        }
        self.lock_health().down_since = Some(Instant::now());
        tracing::debug!(error = %e, "Redis connection lost; reconnecting");
        self.reconnect_in_background(false);
    }

    async fn send(self: &Arc<Self>, request: &Request<'_>) -> Result<Value, Failure> {
        self.set_up().await?;
        let mut attempts = self.attempts.subscribe();
        let (mut conn, generation) = self.conn()?;
        match conn.send(request).await {
            Err(e) if self.breaks(&e) => {
                // Redis restarted, failed over or the network dropped the socket: the
                // first reconnection starts at once; send once more if it works (the
                // caller's timeout bounds the wait) and the request may run twice.
                self.broken(generation, &e);
                // A demoted server answered without running the call; a lost
                // connection tells nothing.
                if is_connection_error(&e) && !request.repeatable() {
                    return Err(in_flight(&e).into());
                }
                if !self.is_connected() {
                    let _ = attempts.changed().await;
                }
                let Ok((mut conn, _)) = self.conn() else {
                    return Err(e.into());
                };
                Ok(conn.send(request).await?)
            }
            Err(e) if moved(&e) || migrating(&e) => match conn {
                Conn::Cluster(mut conn) => Ok(follow_slot(&mut conn, request, e).await?),
                Conn::Multiplexed(_) => Err(e.into()),
            },
            Err(e) => {
                self.node_lost(&e);
                Err(e.into())
            }
            Ok(reply) => Ok(reply),
        }
    }

    /// On a Cluster, after a failure that makes the cluster connection reconnect to a
    /// node or read the slots again (a dropped connection, a restarted or promoted
    /// node), reads every master's `maxmemory-policy` again once they all answer: the
    /// node it reconnects to may be another server now, or the same one reconfigured.
    fn node_lost(self: &Arc<Self>, e: &RedisError) {
        if !is_unreachable(e) || !self.is_cluster() || self.rereading.swap(true, Ordering::AcqRel) {
            return;
        }
        tokio::spawn(reread_policy(Arc::downgrade(self)));
    }
}

/// Reads the masters' `maxmemory-policy` until every master answers, pausing as the
/// reconnection does; it ends with the store.
async fn reread_policy(link: Weak<Link>) {
    let mut pause = FIRST_BACKOFF;
    loop {
        tokio::time::sleep(jitter(pause)).await;
        pause = (pause * 2).min(MAX_BACKOFF);
        let Some(link) = link.upgrade() else {
            return;
        };
        let Ok((mut conn, _)) = link.conn() else {
            continue;
        };
        // A given connection has no connect timeout of the store's.
        let within = link.connect_timeout.max(link.shared.timeout);
        let read = read_policy(&mut conn, &link.shared);
        if matches!(tokio::time::timeout(within, read).await, Ok(Ok(()))) {
            link.rereading.store(false, Ordering::Release);
            return;
        }
    }
}

/// The error for a request whose connection broke while it was in flight: it may have
/// run in Redis, so it is not sent again.
fn in_flight(e: &RedisError) -> RedisError {
    RedisError::from((
        ErrorKind::Io,
        "the connection to Redis broke with the call in flight; it may have run, so it is \
         not sent again",
        e.to_string(),
    ))
}

/// Sends `request` again to the node a `MOVED` answer named: the node that answered ran
/// nothing. The cluster connection's own retries are off (they would also resend a call
/// lost with its connection, which may have run), so a moved slot is followed here.
async fn redirect(
    conn: &mut ClusterConnection,
    request: &Request<'_>,
    moved: RedisError,
) -> RedisResult<Value> {
    let target = moved
        .redirect_node()
        .and_then(|(address, _)| address.rsplit_once(':'))
        .and_then(|(host, port)| Some((host.to_owned(), port.parse().ok()?)));
    let Some((host, port)) = target else {
        return Err(moved);
    };
    let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress { host, port });
    match request {
        Request::Call(call) => call.invoke_routed(conn, &routing).await,
        Request::Cmd(cmd) => conn
            .route_command(cmd.clone(), routing)
            .await
            .and_then(Value::extract_error),
    }
}

/// Whether a Cluster answered that the call's slot is served by another node (`MOVED`):
/// the call ran nowhere.
fn moved(e: &RedisError) -> bool {
    e.kind() == ErrorKind::Server(ServerErrorKind::Moved)
}

/// Whether a Cluster answered that the call's slot is being moved between nodes (`ASK`,
/// or `TRYAGAIN` for keys split between the two nodes for the moment): the call ran
/// nowhere.
fn migrating(e: &RedisError) -> bool {
    matches!(
        e.kind(),
        ErrorKind::Server(ServerErrorKind::Ask | ServerErrorKind::TryAgain)
    )
}

/// The first pause before a call refused while its slot migrates is sent again.
const MIGRATION_PAUSE: Duration = Duration::from_millis(2);
/// The longest pause between two sends of a call refused while its slot migrates.
const MIGRATION_MAX_PAUSE: Duration = Duration::from_millis(32);

/// Follows a Cluster's answer that a call's slot is elsewhere, the refused sends having
/// run nothing: a `MOVED` is sent to the node it names ([`redirect`]); a call refused
/// while its slot migrates is sent again after pauses doubling from [`MIGRATION_PAUSE`]
/// to [`MIGRATION_MAX_PAUSE`] until the move ends: a check's keys (its block marker, its
/// state) are seldom all on one side of a moving slot, so following `ASK` would meet
/// `TRYAGAIN`, and a slot of small keys moves in milliseconds. The caller's timeout
/// bounds the wait.
async fn follow_slot(
    conn: &mut ClusterConnection,
    request: &Request<'_>,
    mut refused: RedisError,
) -> RedisResult<Value> {
    let mut pause = MIGRATION_PAUSE;
    while migrating(&refused) {
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(MIGRATION_MAX_PAUSE);
        match request.send(conn).await {
            Err(e) => refused = e,
            Ok(reply) => return Ok(reply),
        }
    }
    if moved(&refused) {
        return redirect(conn, request, refused).await;
    }
    Err(refused)
}

async fn reconnect(link: Weak<Link>, mut pause_first: bool) {
    let mut pause = FIRST_BACKOFF;
    loop {
        if pause_first {
            tokio::time::sleep(jitter(pause)).await;
            pause = (pause * 2).min(MAX_BACKOFF);
        }
        pause_first = true;
        let Some(link) = link.upgrade() else {
            return;
        };
        match link.attempt().await {
            Ok(()) => {
                link.lock_health().reconnecting = false;
                return;
            }
            Err(e) => link.failed(&e),
        }
    }
}

/// `pause` less up to a quarter, so that a fleet restarted together does not reconnect
/// in step.
fn jitter(pause: Duration) -> Duration {
    let nanos = u64::from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .subsec_nanos(),
    );
    let quarter = u64::try_from(pause.as_micros() / 4).unwrap_or(0).max(1);
    pause.saturating_sub(Duration::from_micros(nanos % quarter))
}

/// Loads the scripts, reads the server's clock and its `maxmemory-policy` (warning when
/// limiter keys can be evicted); remembers whether the server has functions. On a
/// Cluster, the clock and the policy are read from every master: the fastest clock
/// sets the deadlines (see [`RedisClock`](script::RedisClock)), and each master whose
/// policy can evict is warned about by address.
async fn prepare(conn: &mut Conn, shared: &Shared) -> Result<(), Failure> {
    let functions = match conn {
        Conn::Multiplexed(c) => load_scripts(c).await?,
        Conn::Cluster(c) => load_scripts(c).await?,
    };
    shared.paths.functions.store(functions, Ordering::Relaxed);
    detect_module(conn, shared).await?;
    for (_, reply) in conn.each_master(redis::cmd("TIME")).await? {
        let (secs, micros): (u64, u64) =
            redis::from_redis_value(reply?).map_err(RedisError::from)?;
        shared
            .redis_clock
            .observe(secs * 1_000_000 + micros, Instant::now());
    }
    read_policy(conn, shared).await
}

/// Reads `maxmemory-policy` from the server, or from every master of a Cluster (warning
/// about each one whose policy can evict the store's keys). Fails when a master cannot
/// be reached; a master that refuses `CONFIG` is taken as it is.
async fn read_policy(conn: &mut Conn, shared: &Shared) -> Result<(), Failure> {
    let mut config = redis::cmd("CONFIG");
    config.arg("GET").arg("maxmemory-policy");
    let mut read = Vec::new();
    for (primary, reply) in conn.each_master(config).await? {
        match reply {
            Ok(reply) => read.extend(policy_in(&reply).map(|policy| (primary, policy))),
            Err(e) if is_connection_error(&e) => return Err(e.into()),
            Err(e) => {
                // Managed services often rename or forbid CONFIG.
                tracing::info!(
                    error = %e,
                    ?primary,
                    "cannot read maxmemory-policy; make sure the Redis server does not evict \
                     rate-limit keys (maxmemory-policy noeviction)"
                );
            }
        }
    }
    for (primary, policy) in &read {
        if let Some(why) = eviction_risk(policy) {
            tracing::warn!(
                maxmemory_policy = %policy,
                ?primary,
                "Redis may evict rate-limit keys: {why}. An evicted key forgets what a client \
                 consumed, so limits admit more than configured. Set `maxmemory-policy \
                 noeviction` (or give the limiter a Redis of its own)."
            );
        }
    }
    // The policy that can evict, if a master has one; else the one all have.
    let policy = read
        .iter()
        .find(|(_, policy)| eviction_risk(policy).is_some())
        .or(read.first())
        .map(|(_, policy)| policy.clone());
    *shared
        .maxmemory_policy
        .write()
        .unwrap_or_else(PoisonError::into_inner) = policy;
    Ok(())
}

/// Finds out which primaries have the native module of this crate's state format: where
/// every one has it, the store decides with its commands; where none has, with the Lua
/// functions; on a Cluster where some have it, each call goes to the module on the nodes
/// that have it and to Lua on the others (by the node map, read here). One INFO line says
/// which path is in use (on a mixed Cluster, one per primary).
async fn detect_module(conn: &mut Conn, shared: &Shared) -> Result<(), Failure> {
    if shared.force_lua {
        shared.paths.module.store(false, Ordering::Relaxed);
        shared.paths.set_module_nodes(Vec::new());
        shared.paths.set_module_slots(None::<fn(u16) -> bool>);
        tracing::info!("rate-limit decisions run as Lua functions (force_lua)");
        return Ok(());
    }
    let ours = ratelimit_core::packed::STATE_FORMAT;
    let found: Vec<(Primary, Option<(String, u64)>)> = conn
        .each_master(redis::cmd("RATELIMIT.VERSION"))
        .await?
        .into_iter()
        .map(|(primary, reply)| (primary, reply.ok().and_then(|r| module_format(&r))))
        .collect();
    let has = |f: &Option<(String, u64)>| f.as_ref().map(|f| f.1) == Some(ours);
    let with: Vec<(String, u16)> = found
        .iter()
        .filter(|(_, f)| has(f))
        .filter_map(|(primary, _)| match primary {
            Primary::Master { host, port } => Some((host.clone(), *port)),
            Primary::Server => None,
        })
        .collect();
    let all = !found.is_empty() && found.iter().all(|(_, f)| has(f));
    shared.paths.module.store(all, Ordering::Relaxed);
    shared.paths.set_module_nodes(with.clone());
    let mixed = !all && !with.is_empty();
    if mixed {
        if let Conn::Cluster(cluster) = conn {
            let mut cmd = redis::cmd("CLUSTER");
            cmd.arg("SLOTS");
            let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random);
            let reply = cluster.route_command(cmd, routing).await?;
            match Nodes::parse(&reply) {
                Some(nodes) => nodes.map_module(&shared.paths, &with),
                None => shared.paths.set_module_slots(None::<fn(u16) -> bool>),
            }
        }
    } else {
        shared.paths.set_module_slots(None::<fn(u16) -> bool>);
    }
    let path = |f: &Option<(String, u64)>| match f {
        Some((version, format)) if *format == ours => {
            format!("in the Redis module ratelimit {version}")
        }
        Some((version, format)) => format!(
            "as Lua functions: the module ratelimit {version} has state format {format}, \
             not {ours}"
        ),
        None => "as Lua functions: no ratelimit module".to_owned(),
    };
    if mixed {
        for (primary, f) in &found {
            tracing::info!(
                ?primary,
                "rate-limit decisions on this primary run {}",
                path(f)
            );
        }
    } else if let Some((_, f)) = found.first() {
        tracing::info!(
            state_format = ours,
            primaries = found.len(),
            "rate-limit decisions run {}",
            path(f)
        );
    }
    Ok(())
}

/// The version and state format in a `RATELIMIT.VERSION` reply.
fn module_format(reply: &Value) -> Option<(String, u64)> {
    let Value::Array(items) = reply else {
        return None;
    };
    let version = match items.first()? {
        Value::SimpleString(s) => s.clone(),
        Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        _ => return None,
    };
    let Value::Int(format) = items.get(1)? else {
        return None;
    };
    Some((version, u64::try_from(*format).ok()?))
}

/// The policy's value in a `CONFIG GET` reply: a map or a flat array.
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
fn eviction_risk(policy: &str) -> Option<&'static str> {
    if policy == "noeviction" {
        None
    } else if policy.starts_with("allkeys-") {
        Some("the policy evicts any key when memory runs out")
    } else {
        Some("the policy evicts keys with a TTL when memory runs out, and every rate-limit state key has one")
    }
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

/// One server through an application's `bb8` pool of multiplexed connections. The
/// first call, and the first after dead connections were replaced, sets the server up
/// as a [`Link`] does at each connection: the scripts loaded, `TIME` read (for the
/// callers' deadlines), `maxmemory-policy` read.
pub(crate) struct Pooled {
    pub(crate) pool: Pool<RedisConnectionManager>,
    shared: Arc<Shared>,
    repairs: Repairs,
    /// One more than the repair generation the server was last set up in; 0: never.
    prepared: AtomicU64,
    /// One setup at a time.
    preparing: tokio::sync::Mutex<()>,
}

impl Pooled {
    pub(crate) fn new(pool: Pool<RedisConnectionManager>, shared: Arc<Shared>) -> Self {
        Self {
            pool,
            shared,
            repairs: Repairs::default(),
            prepared: AtomicU64::new(0),
            preparing: tokio::sync::Mutex::new(()),
        }
    }

    async fn send(&self, request: &Request<'_>) -> Result<Value, Failure> {
        let seen = self.repairs.seen();
        let first = async {
            let mut conn = self.checkout().await?;
            self.prepared(&conn).await?;
            Ok::<_, Failure>(request.send(&mut conn).await?)
        };
        match first.await {
            Err(Failure::Redis(e)) if is_connection_error(&e) => {
                // Redis restarted or the network dropped the socket: replace the dead pooled
                // connections and send once more, if the request may run twice.
                tracing::debug!(error = %e, "Redis connection failed; reconnecting");
                self.repairs.once(seen, || self.replace_dead()).await?;
                if !request.repeatable() {
                    return Err(in_flight(&e).into());
                }
                let mut conn = self.checkout().await?;
                self.prepared(&conn).await?;
                Ok(request.send(&mut conn).await?)
            }
            other => other,
        }
    }

    /// Sets the server up through `conn` unless it was since the last repair.
    async fn prepared(&self, conn: &MultiplexedConnection) -> Result<(), Failure> {
        let want = self.repairs.seen() + 1;
        if self.prepared.load(Ordering::Acquire) == want {
            return Ok(());
        }
        let _one_at_a_time = self.preparing.lock().await;
        if self.prepared.load(Ordering::Acquire) == want {
            return Ok(());
        }
        prepare(&mut Conn::Multiplexed(conn.clone()), &self.shared).await?;
        self.prepared.store(want, Ordering::Release);
        Ok(())
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

/// The server no longer takes writes as a primary: a failover happened.
fn is_demoted(e: &RedisError) -> bool {
    matches!(
        e.kind(),
        ErrorKind::Server(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)
    )
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

    #[test]
    fn jitter_stays_within_a_quarter() {
        for pause in [FIRST_BACKOFF, MAX_BACKOFF] {
            let j = jitter(pause);
            assert!(j <= pause && j >= pause * 3 / 4, "{j:?}");
        }
    }
}
