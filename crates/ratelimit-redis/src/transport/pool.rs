//! One server through an application's `bb8` pool.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bb8::Pool;
use bb8_redis::RedisConnectionManager;
use redis::aio::MultiplexedConnection;
use redis::{RedisResult, Value};

use crate::error::is_connection_error;
use crate::script::Request;
use crate::shared::Shared;

use super::conn::{in_flight, Conn, Failure};
use super::setup::prepare;

/// Counts repairs so that callers who saw the same failure repair it once.
#[derive(Debug, Default)]
pub(super) struct Repairs {
    generation: AtomicU64,
    lock: tokio::sync::Mutex<()>,
}

impl Repairs {
    pub(super) fn seen(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Runs `repair` unless another caller repaired since `seen`.
    pub(super) async fn once<F: std::future::Future<Output = Result<(), Failure>>>(
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
/// as a [`Link`](super::Link) does at each connection: the scripts loaded, `TIME` read (for the
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

    /// Sends `request`. After a connection error the dead pooled connections are
    /// replaced and the request goes again (and again, while its new connections die
    /// too: the caller's timeout bounds the wait) when that cannot decide it twice: as
    /// itself when running it twice does no harm, as its resend when it is a call
    /// decided once (which answers the first run's reply if there was one).
    pub(super) async fn send(&self, request: &Request<'_>) -> Result<Value, Failure> {
        let mut seen = self.repairs.seen();
        let again = request.resent();
        let mut next = request;
        loop {
            let sent = async {
                let mut conn = self.checkout().await?;
                self.prepared(&conn).await?;
                Ok::<_, Failure>(next.send(&mut conn).await?)
            };
            match sent.await {
                Err(Failure::Redis(e)) if is_connection_error(&e) => {
                    // Redis restarted or the network dropped the socket.
                    tracing::debug!(error = %e, "Redis connection failed; reconnecting");
                    self.repairs.once(seen, || self.replace_dead()).await?;
                    seen = self.repairs.seen();
                    match &again {
                        Some(again) => next = again,
                        None => return Err(in_flight(&e).into()),
                    }
                }
                other => return other,
            }
        }
    }

    /// Sets the server up through `conn` unless it was since the last repair.
    pub(super) async fn prepared(&self, conn: &MultiplexedConnection) -> Result<(), Failure> {
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
    pub(super) async fn checkout(&self) -> Result<MultiplexedConnection, Failure> {
        Ok((*self.pool.get().await?).clone())
    }

    /// bb8 cannot be told a connection broke, so each pooled connection is probed with
    /// PING (an immediate error when its socket is gone) and a dead one is swapped for a
    /// fresh one in place.
    pub(super) async fn replace_dead(&self) -> Result<(), Failure> {
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
