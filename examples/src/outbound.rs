//! The `outbound` example's parts: a partner API that counts the calls it gets per
//! second, and callers that reach it through a [`ThrottleLayer`], waiting for their turn.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::routing::get;
use axum::Router;
use ratelimit_core::Store;
use ratelimit_tower::{ThrottleError, ThrottleLayer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower::{service_fn, Layer, Service, ServiceExt};

/// The partner's limit, shared by every instance of the caller: 10 calls a second,
/// queued up to 20 deep.
pub const PARTNER_LIMIT: &str = "10/s leaky-bucket mode=shaper burst=20";

/// Calls the partner got, per second since the Unix epoch.
pub type Arrivals = Arc<Mutex<BTreeMap<u64, u32>>>;

/// Starts the partner on a free port of 127.0.0.1 (or `port`); its address and its
/// arrivals.
pub async fn partner(port: u16) -> std::io::Result<(SocketAddr, Arrivals)> {
    let arrivals = Arrivals::default();
    let counted = Arc::clone(&arrivals);
    let app = Router::new().route(
        "/",
        get(move || {
            let counted = Arc::clone(&counted);
            async move {
                let second = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs());
                *counted.lock().unwrap().entry(second).or_default() += 1;
                "ok"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok((addr, arrivals))
}

/// One plain HTTP/1.1 `GET /` to `addr`, answered with its status line.
async fn get_partner(addr: SocketAddr) -> std::io::Result<String> {
    let mut conn = tokio::net::TcpStream::connect(addr).await?;
    conn.write_all(b"GET / HTTP/1.1\r\nhost: partner\r\nconnection: close\r\n\r\n")
        .await?;
    let mut reply = String::new();
    conn.read_to_string(&mut reply).await?;
    Ok(reply.lines().next().unwrap_or_default().to_owned())
}

/// What the callers of one instance did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Calls {
    /// Calls the partner answered 200.
    pub ok: u64,
    /// Calls that failed (no turn within the wait, a store or connection failure).
    pub failed: u64,
}

/// `tasks` callers calling the partner at `addr` through one throttle on `store`, each
/// as often as its turns come, for `length`.
pub async fn callers<S: Store>(
    store: S,
    addr: SocketAddr,
    tasks: usize,
    length: Duration,
) -> Calls {
    let throttle = ThrottleLayer::new(
        store,
        "partner-api",
        PARTNER_LIMIT.parse().expect("the rule text is valid"),
        Duration::from_secs(10),
    );
    let client = throttle.layer(service_fn(move |()| get_partner(addr)));
    let until = tokio::time::Instant::now() + length;
    let mut handles = Vec::new();
    for _ in 0..tasks {
        let mut client = client.clone();
        handles.push(tokio::spawn(async move {
            let mut calls = Calls::default();
            while tokio::time::Instant::now() < until {
                let reply: Result<String, ThrottleError<std::io::Error>> =
                    match client.ready().await {
                        Ok(ready) => ready.call(()).await,
                        Err(e) => Err(e),
                    };
                match reply {
                    Ok(status) if status.contains(" 200 ") => calls.ok += 1,
                    _ => calls.failed += 1,
                }
            }
            calls
        }));
    }
    let mut total = Calls::default();
    for h in handles {
        let c = h.await.expect("a caller task panicked");
        total.ok += c.ok;
        total.failed += c.failed;
    }
    total
}
