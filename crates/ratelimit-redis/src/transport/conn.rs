//! One open connection, one server's or a Cluster's, and how a request over it fails.

use std::time::Duration;

use bb8::RunError;
use redis::aio::MultiplexedConnection;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, ErrorKind, RedisError, RedisResult, Value};

use crate::error::{classify, RedisStoreError};
use crate::script::Request;

use super::cluster::{on_masters, Primary};

/// One open connection of a [`Link`](super::Link).
#[derive(Clone)]
pub(super) enum Conn {
    Multiplexed(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl Conn {
    pub(super) async fn send(&mut self, request: &Request<'_>) -> RedisResult<Value> {
        match self {
            Conn::Multiplexed(conn) => request.send(conn).await,
            Conn::Cluster(conn) => request.send(conn).await,
        }
    }

    /// `cmd`'s reply from the server, or from every master of a Cluster by address; the
    /// error of a reply stays with its node.
    pub(super) async fn each_master(
        &mut self,
        cmd: Cmd,
    ) -> RedisResult<Vec<(Primary, RedisResult<Value>)>> {
        match self {
            Conn::Multiplexed(conn) => Ok(vec![(Primary::Server, cmd.query_async(conn).await)]),
            Conn::Cluster(conn) => on_masters(conn, cmd).await,
        }
    }
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

/// The error for a request whose connection broke while it was in flight: it may have
/// run in Redis, so it is not sent again.
pub(super) fn in_flight(e: &RedisError) -> RedisError {
    RedisError::from((
        ErrorKind::Io,
        "the connection to Redis broke with the call in flight; it may have run, so it is \
         not sent again",
        e.to_string(),
    ))
}
