//! A Cluster's map of slots to nodes, commands to every master, and following a slot
//! that moved or is moving.

use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo, SingleNodeRoutingInfo};
use redis::{Cmd, ErrorKind, RedisError, RedisResult, ServerErrorKind, Value};

use crate::script::{self, Request};
use crate::shared::Shared;

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
pub(super) async fn on_masters(
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
    pub(super) fn parse(reply: &Value) -> Option<Self> {
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
    pub(super) fn map_module(&self, paths: &script::Paths, with: &[(String, u16)]) {
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
pub(super) struct NodeMap {
    current: RwLock<Option<Arc<Nodes>>>,
    stale: std::sync::atomic::AtomicBool,
    /// One reader at a time.
    reading: tokio::sync::Mutex<()>,
}

impl NodeMap {
    /// The map as last read, unless found stale since.
    fn known(&self) -> Option<Arc<Nodes>> {
        let current = self.current.read().unwrap_or_else(PoisonError::into_inner);
        current
            .clone()
            .filter(|_| !self.stale.load(Ordering::Acquire))
    }

    /// The map; read with `CLUSTER SLOTS` through the connection `conn` gives when
    /// unknown or stale.
    pub(super) async fn get(
        &self,
        conn: impl FnOnce() -> Option<ClusterConnection>,
        shared: &Shared,
    ) -> Option<Arc<Nodes>> {
        if let Some(nodes) = self.known() {
            return Some(nodes);
        }
        let _one = self.reading.lock().await;
        if let Some(nodes) = self.known() {
            return Some(nodes);
        }
        let mut conn = conn()?;
        self.stale.store(false, Ordering::Release);
        let mut cmd = redis::cmd("CLUSTER");
        cmd.arg("SLOTS");
        let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random);
        let read = conn.route_command(cmd, routing);
        let reply = tokio::time::timeout(shared.timeout, read).await.ok()?;
        let nodes = Arc::new(Nodes::parse(&reply.ok()?)?);
        nodes.map_module(&shared.paths, &shared.paths.module_nodes());
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = Some(nodes.clone());
        Some(nodes)
    }

    /// Notes that a slot was not where the map said: it is read again before the next
    /// batch.
    pub(super) fn mark_stale(&self) {
        self.stale.store(true, Ordering::Release);
    }
}

/// Sends `request` again to the node a `MOVED` answer named: the node that answered ran
/// nothing. The cluster connection's own retries are off (they would also resend a call
/// lost with its connection, which may have run), so a moved slot is followed here.
pub(super) async fn redirect(
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
pub(super) fn moved(e: &RedisError) -> bool {
    e.kind() == ErrorKind::Server(ServerErrorKind::Moved)
}

/// Whether a Cluster answered that the call's slot is being moved between nodes (`ASK`,
/// or `TRYAGAIN` for keys split between the two nodes for the moment): the call ran
/// nowhere.
pub(super) fn migrating(e: &RedisError) -> bool {
    matches!(
        e.kind(),
        ErrorKind::Server(ServerErrorKind::Ask | ServerErrorKind::TryAgain)
    )
}

/// The first pause before a call refused while its slot migrates is sent again.
pub(super) const MIGRATION_PAUSE: Duration = Duration::from_millis(2);

/// The longest pause between two sends of a call refused while its slot migrates.
pub(super) const MIGRATION_MAX_PAUSE: Duration = Duration::from_millis(32);

/// Follows a Cluster's answer that a call's slot is elsewhere, the refused sends having
/// run nothing: a `MOVED` is sent to the node it names ([`redirect`]); a call refused
/// while its slot migrates is sent again after pauses doubling from [`MIGRATION_PAUSE`]
/// to [`MIGRATION_MAX_PAUSE`] until the move ends: a check's keys (its block marker, its
/// state) are seldom all on one side of a moving slot, so following `ASK` would meet
/// `TRYAGAIN`, and a slot of small keys moves in milliseconds. The caller's timeout
/// bounds the wait.
pub(super) async fn follow_slot(
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
