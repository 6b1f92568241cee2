//! How requests reach Redis: connections the store keeps and re-establishes itself (one
//! server, a Cluster, the primary a set of Sentinels names), or a pool the application
//! brought. The batcher above sends every call through [`Transport`]; the transport
//! knows nothing of checks or decisions. By concern:
//!
//! - [`link`]: the store's own connections, their failures and the reconnection;
//! - [`pool`]: an application's `bb8` pool;
//! - [`conn`]: one open connection and how a request over it fails;
//! - [`cluster`]: the slot map, commands to every master, moved and moving slots;
//! - [`setup`]: what each new connection learns (scripts, module, clocks, policies).

use std::sync::Arc;
use std::time::Duration;

use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::{Cmd, Value};

use crate::error::{classify, is_connection_error, ran_nothing, RedisStoreError};
use crate::script::{Call, Request};

use cluster::on_masters;
pub(crate) use cluster::{Nodes, Primary};
use conn::Conn;
pub(crate) use conn::{failure, Failure};
pub(crate) use link::{Link, Source};
pub(crate) use pool::Pooled;

/// A call's send as [`Transport::call`] awaits it: boxed, to keep its callers' future
/// types shallow.
type SendFuture<'a> =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<Value, Failure>> + Send + 'a>>;

mod cluster;
mod conn;
mod link;
mod pool;
mod setup;

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
                .field("topology", &link.topology())
                .field("connected", &link.is_connected())
                .finish(),
            Transport::Pool(pooled) => f.debug_tuple("Pool").field(&pooled.pool.state()).finish(),
        }
    }
}

impl Transport {
    /// Sends `request`. A request whose connection turned out dead (or whose server is no
    /// longer the primary) goes again on a fresh connection, while the caller's timeout
    /// allows, when that cannot decide it twice ([`Request::resent`]): as itself when
    /// running it twice does no harm, as its resend when it is a call decided once (a
    /// batch of checks and edits, a settle, a release), which answers the first run's
    /// reply if there was one. Any other request lost with its connection may have run,
    /// and nothing tells whether it did, so it fails (the caller's failure policy
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
        // Boxed, once per Redis call: the client's futures nest deep, and every future
        // that awaits a store operation (the layer's, an application's) would otherwise
        // carry them, near the depth rustc lays out by default.
        let send: SendFuture<'_> = Box::pin(self.send(request));
        match tokio::time::timeout(timeout, send).await {
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
            link.nodes_stale();
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
                (Conn::Cluster(mut conn), _) => {
                    match call.invoke_routed(&mut conn, &routing).await {
                        // The connection to the node broke with the call in flight: a
                        // call the module decides once goes again (as its resend, to
                        // the node serving the slot by then) until it is answered or
                        // the caller's timeout ends the wait; any other fails.
                        Err(e) if is_connection_error(&e) => match call.resent() {
                            Some(again) => {
                                link.node_lost(&e);
                                resend_routed(link, &mut conn, &again, &routing, e).await
                            }
                            None => Err(e),
                        },
                        other => other,
                    }
                }
                (Conn::Multiplexed(mut conn), _) => call.invoke(&mut conn).await,
            };
            Ok::<_, Failure>(reply.inspect_err(|e| link.node_lost(e))?)
        };
        // Boxed, as in `call`.
        let send: SendFuture<'_> = Box::pin(send);
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

/// Sends `again`, the resend of a call decided once whose connection broke, to the node
/// `routing` names, pausing between sends (the cluster connection reconnects to the
/// node meanwhile), while the connection breaks again or the node answers without
/// running it; the caller's timeout bounds it.
async fn resend_routed(
    link: &Link,
    conn: &mut redis::cluster_async::ClusterConnection,
    again: &Call<'_>,
    routing: &RoutingInfo,
    mut e: redis::RedisError,
) -> redis::RedisResult<Value> {
    let mut pause = link::RETRY_PAUSE;
    // Once the first send may have run, only an answer of another kind ends this: an
    // error that proves the resend ran nowhere (a redirect, no connection to the node)
    // says nothing of the first send, so the caller must not send the checks again as
    // new calls.
    while is_connection_error(&e) || ran_nothing(&e) {
        link.nodes_stale();
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(link::MAX_RETRY_PAUSE);
        match again.invoke_routed(conn, routing).await {
            Err(next) => e = next,
            Ok(reply) => return Ok(reply),
        }
    }
    Err(e)
}
