//! The connections a store opens and re-opens itself.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock, Weak};
use std::time::{Duration, Instant};

use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::sentinel::SentinelClient;
use redis::{AsyncConnectionConfig, ErrorKind, RedisError, ServerErrorKind, Value};

use ratelimit_core::util::BoundedLog;

use crate::error::{classify, is_connection_error, is_unreachable, ran_nothing, RedisStoreError};
use crate::script::Request;
use crate::shared::Shared;

use super::cluster::{follow_slot, migrating, moved, NodeMap, Nodes};
use super::conn::{in_flight, Conn, Failure};
use super::setup::{detect_module, prepare, read_policy};

/// The first pause between reconnection attempts; it doubles up to [`MAX_BACKOFF`].
pub(super) const FIRST_BACKOFF: Duration = Duration::from_millis(50);

/// While requests keep asking for a connection that is not there, the reconnection tries
/// again at least this often, whatever its pause has grown to: a store under traffic is
/// back within this of Redis answering again, an idle one backs off to [`MAX_BACKOFF`].
pub(super) const ASKED_EVERY: Duration = Duration::from_millis(250);

/// The longest pause between reconnection attempts.
pub(super) const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// The first pause before a Cluster call that ran nowhere goes again; it doubles up to
/// [`MAX_RETRY_PAUSE`], within the caller's timeout.
pub(super) const RETRY_PAUSE: Duration = Duration::from_millis(2);

/// The longest pause between two sends of a Cluster call that ran nowhere.
pub(super) const MAX_RETRY_PAUSE: Duration = Duration::from_millis(50);

/// How long after losing its connection a link makes calls wait for the reconnection.
const LOST_LATELY: Duration = Duration::from_secs(1);

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
    pub(super) fn name(&self) -> &'static str {
        match self {
            Source::Server { .. } => "server",
            Source::Cluster(_) | Source::Given => "cluster",
            Source::Sentinel(_) => "sentinel",
        }
    }
}

/// What a [`Link`] knows about its recent failures.
#[derive(Default)]
pub(super) struct Health {
    /// A task is reconnecting.
    reconnecting: bool,
    /// Failed attempts since the last working connection.
    failures: u64,
    down_since: Option<Instant>,
    last_error: Option<RedisError>,
}

/// Connections the store opened itself. While they work, requests go through them; once
/// one fails, they are dropped and a background task reconnects with growing pauses
/// (50 ms doubling to 2 s; at most [`ASKED_EVERY`] while requests ask for a connection),
/// setting every new connection up as at build: the scripts
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
    /// Cuts the reconnection's pause short: a request found no connection.
    wake: Arc<tokio::sync::Notify>,
    /// When a request last cut the pause short.
    woken_at: Mutex<Option<Instant>>,
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
            wake: Arc::new(tokio::sync::Notify::new()),
            woken_at: Mutex::new(None),
        })
    }

    /// A request found no connection: the reconnection tries now, unless a request woke
    /// it under [`ASKED_EVERY`] ago.
    fn asked(&self) {
        let mut woken_at = self.woken_at.lock().unwrap_or_else(PoisonError::into_inner);
        if woken_at.is_some_and(|at| at.elapsed() < ASKED_EVERY) {
            return;
        }
        *woken_at = Some(Instant::now());
        self.wake.notify_one();
    }

    /// Sets up the application's connection on its first call (nothing to do for the
    /// store's own connections, set up as they were opened).
    pub(super) async fn set_up(&self) -> Result<(), Failure> {
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

    pub(super) fn is_cluster(&self) -> bool {
        matches!(self.source, Source::Cluster(_) | Source::Given)
    }

    /// The node map; read with `CLUSTER SLOTS` when unknown or stale.
    pub(super) async fn nodes(&self) -> Option<Arc<Nodes>> {
        if self.shared.paths.take_remap() {
            // A master answered a module call as an unknown command (it lost the module,
            // or a slot moved to one without it): which masters have it is asked again,
            // and on a mixed Cluster the slots of those that have it are read with it.
            // Until then, only the slots met so far go to Lua.
            if let Ok((mut conn, _)) = self.conn() {
                let find = detect_module(&mut conn, &self.shared, false);
                let _ = tokio::time::timeout(self.shared.timeout, find).await;
            }
        }
        let conn = || match self.conn() {
            Ok((Conn::Cluster(conn), _)) => Some(conn),
            _ => None,
        };
        self.nodes.get(conn, &self.shared).await
    }

    /// Notes that a slot was not where the node map said.
    pub(crate) fn nodes_stale(&self) {
        self.nodes.mark_stale();
    }

    /// What the link connects to, for `Debug` and logs.
    pub(super) fn topology(&self) -> &'static str {
        self.source.name()
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

    pub(super) fn lock_health(&self) -> std::sync::MutexGuard<'_, Health> {
        self.health.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn is_connected(&self) -> bool {
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
    }

    pub(super) async fn connected(&self) {
        let mut attempts = self.attempts.subscribe();
        while !self.is_connected() {
            if attempts.changed().await.is_err() {
                return;
            }
        }
    }

    /// One connection attempt with its setup, within the connect timeout.
    pub(super) async fn attempt(&self) -> Result<(), Failure> {
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

    pub(super) async fn open(&self) -> Result<Vec<Conn>, Failure> {
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

    pub(super) fn install(&self, conns: Vec<Conn>) {
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = Some(conns.into());
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// Logs the recovery when there were failures, and wakes whoever waits.
    pub(super) fn recovered(&self) {
        let (failures, down_since) = {
            let mut health = self.lock_health();
            let seen = (health.failures, health.down_since);
            *health = Health {
                reconnecting: health.reconnecting,
                ..Health::default()
            };
            seen
        };
        if failures > 0 || down_since.is_some() {
            // A connection back after a loss (or made after failed attempts): what the
            // store decides from now on may meet what others decided without it.
            let now = self.shared.store_now_us().max(1);
            self.shared.recovered_at.store(now, Ordering::Relaxed);
        }
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

    pub(super) fn failed(&self, e: &Failure) {
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
    pub(super) fn reconnect_in_background(self: &Arc<Self>, pause_first: bool) {
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
    pub(super) fn cluster_conn(
        &self,
        timeout: Duration,
    ) -> Result<ClusterConnection, RedisStoreError> {
        match self.conn() {
            Ok((Conn::Cluster(conn), _)) => Ok(conn),
            Ok((Conn::Multiplexed(_), _)) => Err(RedisStoreError::UnexpectedReply(
                "a Cluster command over a connection to one server".into(),
            )),
            Err(e) => Err(classify(e, timeout)),
        }
    }

    /// A connection to send on, or the reason there is none.
    pub(super) fn conn(&self) -> Result<(Conn, u64), RedisError> {
        let current = self.current.read().unwrap_or_else(PoisonError::into_inner);
        match &*current {
            Some(conns) => {
                let i = self.next.fetch_add(1, Ordering::Relaxed) % conns.len();
                Ok((conns[i].clone(), self.generation.load(Ordering::Acquire)))
            }
            None => {
                drop(current);
                self.asked();
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
    pub(super) fn breaks(&self, e: &RedisError) -> bool {
        match self.source {
            // The cluster connection repairs itself.
            Source::Cluster(_) | Source::Given => false,
            Source::Server { .. } => is_connection_error(e),
            Source::Sentinel(_) => is_connection_error(e) || is_demoted(e),
        }
    }

    /// Drops the connections of `generation` (unless replaced meanwhile) and reconnects.
    pub(super) fn broken(self: &Arc<Self>, generation: u64, e: &RedisError) {
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

    /// Sends `request`; the caller's timeout bounds everything here. A request whose
    /// connection broke with it in flight goes again on the next connection (and the next,
    /// while they break too), when that cannot decide it twice ([`Request::resent`]): a call the module decides
    /// once is sent as its resend, which answers the first run's reply if there was
    /// one. Errors that prove nothing ran (a demoted primary, a Cluster redirect, down or
    /// without a connection to the node) are sent again after a short pause, the slot
    /// map read again; a link without a connection, lost under a second ago, waits for
    /// the reconnection's next attempt rather than fail at once.
    pub(super) async fn send(self: &Arc<Self>, request: &Request<'_>) -> Result<Value, Failure> {
        self.set_up().await?;
        let mut attempts = self.attempts.subscribe();
        let (mut conn, generation) = match self.conn() {
            Ok(conn) => conn,
            Err(e) if self.lost_lately() => {
                // Nothing was sent: wait for the reconnection under way.
                let _ = attempts.changed().await;
                self.conn().map_err(|_| e)?
            }
            Err(e) => return Err(e.into()),
        };
        match conn.send(request).await {
            Err(e) if self.breaks(&e) => self.after_break(request, generation, e, attempts).await,
            Err(e) if moved(&e) || migrating(&e) => match conn {
                // Followed to the node serving the slot now; a connection that breaks
                // there (connections cut under load, a node restarting) is as any other
                // Cluster failure: the call goes again when that cannot decide it twice.
                Conn::Cluster(mut conn) => match follow_slot(&mut conn, request, e).await {
                    Ok(reply) => Ok(reply),
                    Err(e) => {
                        self.node_lost(&e);
                        self.cluster_retry(&mut conn, request, e).await
                    }
                },
                Conn::Multiplexed(_) => Err(e.into()),
            },
            Err(e) if self.is_cluster() => {
                self.node_lost(&e);
                let Conn::Cluster(mut conn) = conn else {
                    return Err(e.into());
                };
                self.cluster_retry(&mut conn, request, e).await
            }
            Err(e) => {
                self.node_lost(&e);
                Err(e.into())
            }
            Ok(reply) => Ok(reply),
        }
    }

    /// `request`'s connection (of `generation`) broke with `e`: Redis restarted, failed
    /// over or the network dropped the socket. The first reconnection starts at once, and
    /// the request goes again on each new connection until it gets an answer of another
    /// kind (the caller's timeout bounds the wait): a demoted server answered without
    /// running it, so it goes as it was; a lost connection tells nothing, so only a
    /// request that cannot be decided twice goes again, as its resend, which answers the
    /// first run's reply if there was one (also when a resend's own connection breaks:
    /// connections killed in a row under load).
    async fn after_break(
        self: &Arc<Self>,
        request: &Request<'_>,
        mut generation: u64,
        mut e: RedisError,
        mut attempts: tokio::sync::watch::Receiver<u64>,
    ) -> Result<Value, Failure> {
        let again = request.resent();
        loop {
            self.broken(generation, &e);
            if is_connection_error(&e) && again.is_none() {
                return Err(in_flight(&e).into());
            }
            if !self.is_connected() {
                let _ = attempts.changed().await;
            }
            let Ok((mut conn, next_generation)) = self.conn() else {
                return Err(e.into());
            };
            match conn.send(again.as_ref().unwrap_or(request)).await {
                Err(next) if self.breaks(&next) => {
                    tracing::debug!(error = %next, "a resent call lost its connection too");
                    generation = next_generation;
                    e = next;
                }
                reply => return Ok(reply?),
            }
        }
    }

    /// On a Cluster, `request` failed with `e`: when `e` proves nothing ran, or the
    /// connection to its node broke and the request cannot be decided twice (its resend,
    /// [`Request::resent`]), it is sent again after a pause (doubling from
    /// [`RETRY_PAUSE`]; the cluster connection reconnects to the node or reads the slots
    /// again meanwhile) until it gets an answer of another kind or the caller's timeout
    /// ends the wait.
    pub(super) async fn cluster_retry(
        &self,
        conn: &mut ClusterConnection,
        request: &Request<'_>,
        mut e: RedisError,
    ) -> Result<Value, Failure> {
        let resent = request.resent();
        let again = resent.as_ref().unwrap_or(request);
        let retry = |e: &RedisError| ran_nothing(e) || (resent.is_some() && is_connection_error(e));
        let mut pause = RETRY_PAUSE;
        while retry(&e) {
            self.nodes_stale();
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(MAX_RETRY_PAUSE);
            tracing::debug!(error = %e, "Cluster call sent again");
            e = match again.send(conn).await {
                Ok(reply) => return Ok(reply),
                Err(next) => next,
            };
        }
        // A lost connection tells nothing: a request that may have run must not run
        // again.
        if resent.is_none() && is_connection_error(&e) {
            return Err(in_flight(&e).into());
        }
        Err(e.into())
    }

    /// Whether the link lost its connection under a second ago and its first
    /// reconnection attempt, which starts at once, is under way: a call then waits for
    /// it instead of failing at once (a connection cut under load is back within
    /// milliseconds). Once an attempt failed, the server is down: calls fail fast.
    fn lost_lately(&self) -> bool {
        let health = self.lock_health();
        health.reconnecting
            && health.failures == 0
            && health
                .down_since
                .is_some_and(|since| since.elapsed() < LOST_LATELY)
    }

    /// On a Cluster, after a failure that makes the cluster connection reconnect to a
    /// node or read the slots again (a dropped connection, a restarted or promoted
    /// node), reads every master's `maxmemory-policy` again once they all answer: the
    /// node it reconnects to may be another server now, or the same one reconfigured.
    pub(super) fn node_lost(self: &Arc<Self>, e: &RedisError) {
        if !is_unreachable(e) || !self.is_cluster() || self.rereading.swap(true, Ordering::AcqRel) {
            return;
        }
        tokio::spawn(reread_policy(Arc::downgrade(self)));
    }
}

/// Reads the masters' `maxmemory-policy` until every master answers, pausing as the
/// reconnection does; it ends with the store.
pub(super) async fn reread_policy(link: Weak<Link>) {
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

pub(super) async fn reconnect(link: Weak<Link>, mut pause_first: bool) {
    let mut pause = FIRST_BACKOFF;
    let Some(wake) = link.upgrade().map(|link| link.wake.clone()) else {
        return;
    };
    loop {
        if pause_first {
            // Cut short by a request that found no connection (at most every
            // `ASKED_EVERY`): under traffic the store is back soon after Redis.
            // A pause cut short does not grow.
            tokio::select! {
                () = tokio::time::sleep(jitter(pause)) => pause = (pause * 2).min(MAX_BACKOFF),
                () = wake.notified() => {}
            }
        }
        pause_first = true;
        let Some(link) = link.upgrade() else {
            return;
        };
        match link.attempt().await {
            Ok(()) => {
                link.lock_health().reconnecting = false;
                // A connection that broke between its install and the line above found
                // this task still running and started none: nothing would reconnect.
                if !link.is_connected() {
                    link.reconnect_in_background(false);
                }
                return;
            }
            Err(e) => link.failed(&e),
        }
    }
}

/// `pause` less up to a quarter, so that a fleet restarted together does not reconnect
/// in step.
pub(super) fn jitter(pause: Duration) -> Duration {
    let nanos = u64::from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .subsec_nanos(),
    );
    let quarter = u64::try_from(pause.as_micros() / 4).unwrap_or(0).max(1);
    pause.saturating_sub(Duration::from_micros(nanos % quarter))
}

/// The server no longer takes writes as a primary: a failover happened.
pub(super) fn is_demoted(e: &RedisError) -> bool {
    matches!(
        e.kind(),
        ErrorKind::Server(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jitter_stays_within_a_quarter() {
        for pause in [FIRST_BACKOFF, MAX_BACKOFF] {
            let j = jitter(pause);
            assert!(j <= pause && j >= pause * 3 / 4, "{j:?}");
        }
    }
}
