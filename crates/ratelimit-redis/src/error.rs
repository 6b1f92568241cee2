use std::time::Duration;

use ratelimit_core::CapacityError;
use redis::{ErrorKind, RedisError, ServerErrorKind};

/// What went wrong talking to Redis.
///
/// A store error never means "denied": it means no decision could be made. What to do
/// then (fail open, fail closed, fall back to a local store) is the caller's policy, e.g.
/// the tower layer's.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum RedisStoreError {
    /// Redis could not be reached or the connection failed (refused, reset, closed,
    /// cluster down). The store reconnects by itself on the next call.
    #[error("cannot reach Redis: {0}")]
    Connection(#[source] RedisError),
    /// Redis did not answer within the store's per-call timeout.
    #[error(
        "Redis did not answer within {0:?}; check that the server is up and reachable, \
         or raise the store's timeout"
    )]
    Timeout(Duration),
    /// Redis answered the rate-limit script with an error (other than a key of the wrong
    /// type, see [`RedisStoreError::WrongType`]).
    #[error("the rate-limit script failed in Redis: {0}")]
    Script(#[source] RedisError),
    /// Redis answered with something the store does not understand.
    #[error("unexpected reply from Redis: {0}")]
    UnexpectedReply(String),
    /// One of the store's keys holds a value of another type or shape than the store
    /// writes: something else wrote under the store's prefix.
    #[error(
        "a rate-limit key holds data this store did not write ({0}); another application \
         shares the key prefix: give the store a prefix of its own or delete the key"
    )]
    WrongType(String),
    /// The check's cost exceeds what a rule can ever grant.
    #[error(transparent)]
    Capacity(#[from] CapacityError),
    /// The store cannot be built as configured.
    #[error("invalid Redis store configuration: {0}")]
    InvalidConfig(String),
}

impl RedisStoreError {
    /// True for errors that say nothing about the request and may pass on retry: the
    /// connection and timeout cases.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Self::Connection(_) | Self::Timeout(_))
    }
}

/// Whether the connection that produced `e` is unusable and should be replaced.
pub(crate) fn is_connection_error(e: &RedisError) -> bool {
    e.is_io_error() || e.is_connection_dropped() || e.is_unrecoverable_error()
}

/// Whether `e` proves the call ran nowhere, and may be sent again as it is once the
/// topology has settled: a primary demoted (`READONLY`) or not yet serving (`LOADING`,
/// `MASTERDOWN`), a Cluster down, moving a slot or redirecting it, a Cluster node the
/// client has no connection to (nothing was sent).
pub(crate) fn ran_nothing(e: &RedisError) -> bool {
    matches!(
        e.kind(),
        ErrorKind::Server(
            ServerErrorKind::ReadOnly
                | ServerErrorKind::MasterDown
                | ServerErrorKind::BusyLoading
                | ServerErrorKind::ClusterDown
                | ServerErrorKind::TryAgain
                | ServerErrorKind::Moved
                | ServerErrorKind::Ask
        ) | ErrorKind::ClusterConnectionNotFound
    )
}

/// Whether the module refused a call sent again because it can no longer tell whether
/// its first run happened (`RLUNKNOWN`): nothing ran now; the first run may have.
pub(crate) fn run_unknown(e: &RedisError) -> bool {
    e.code() == Some("RLUNKNOWN")
}

/// Whether `e` says the server, or the node serving the keys, cannot take the call now:
/// a lost connection, a Cluster redirect or outage, a primary demoted or loading.
pub(crate) fn is_unreachable(e: &RedisError) -> bool {
    is_connection_error(e)
        || e.is_cluster_error()
        || matches!(
            e.kind(),
            ErrorKind::Server(
                ServerErrorKind::MasterDown
                    | ServerErrorKind::BusyLoading
                    | ServerErrorKind::ReadOnly
            ) | ErrorKind::ClusterConnectionNotFound
        )
}

/// Sorts a Redis error into the store's categories.
pub(crate) fn classify(e: RedisError, timeout: Duration) -> RedisStoreError {
    if e.is_timeout() {
        return RedisStoreError::Timeout(timeout);
    }
    if e.kind() == ErrorKind::MasterNameNotFoundBySentinel {
        return RedisStoreError::InvalidConfig(format!(
            "no Sentinel names a primary for this service ({e}); check the service name \
             against `sentinel monitor <name> ...` in sentinel.conf"
        ));
    }
    if matches!(e.code(), Some("WRONGTYPE" | "RLSTATE")) {
        let what = match e.detail() {
            Some(detail) => format!("{} {detail}", e.code().unwrap_or_default()),
            None => e.to_string(),
        };
        return RedisStoreError::WrongType(what);
    }
    if is_unreachable(&e) || run_unknown(&e) {
        return RedisStoreError::Connection(e);
    }
    if e.kind() == ErrorKind::UnexpectedReturnType {
        return RedisStoreError::UnexpectedReply(e.to_string());
    }
    RedisStoreError::Script(e)
}
