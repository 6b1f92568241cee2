//! The quickstart's limits kept in Redis, so that every instance of the app shares them.
//!
//! ```sh
//! redis-server --port 6379 &
//! PORT=3000 cargo run -p ratelimit-examples --features redis --example redis_fleet &
//! PORT=3001 cargo run -p ratelimit-examples --features redis --example redis_fleet &
//! # 10 requests per minute per client IP, whichever instance they reach:
//! for i in $(seq 6); do curl -s -o /dev/null -w '%{http_code} ' localhost:3000/; \
//!                       curl -s -o /dev/null -w '%{http_code} ' localhost:3001/; done
//! ```
//!
//! `REDIS_URL` (default `redis://127.0.0.1:6379/`) selects the server. The same store
//! runs over a Redis Cluster (`REDIS_CLUSTER_URLS`, comma-separated node URLs) or over
//! the primary Redis Sentinel names (`REDIS_SENTINEL_URLS`, comma-separated Sentinel URLs,
//! and `REDIS_SERVICE`, the monitored name). While Redis is unreachable (also when the app
//! starts before it), each instance limits `/` on its own with a local store holding half
//! of each limit (two instances keep the fleet within the limit; set `FLEET_SIZE` for
//! more) and refuses logins with 503, logging a warning every 10 s with the number of
//! failed checks. The store reconnects by itself and says so in the log; from then on
//! the limits are the fleet's again, without a restart.

use std::num::NonZeroU32;
use std::time::Duration;

use axum::routing::{get, post};
use axum::Router;
use ratelimit_redis::RedisStore;
use ratelimit_tower::{FailurePolicy, PeerIp, RateLimitLayer};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    ratelimit_examples::serve::logging_at("info");

    let (store, url) = store_from_env().await?;
    if !store.is_connected() {
        println!("{url} is not reachable yet: serving under the failure policies until it is");
    }
    let fleet_size: NonZeroU32 = match std::env::var("FLEET_SIZE") {
        Ok(n) => n.parse().map_err(|e| format!("FLEET_SIZE={n:?}: {e}"))?,
        Err(_) => NonZeroU32::new(2).expect("2 is not zero"),
    };
    ratelimit_examples::serve::serve(app(store.clone(), fleet_size)?, |addr| {
        println!("serving on http://{addr} with limits in {url}");
    })
    .await?;
    // Stopped (Ctrl-C): the releases the layer handed to the store reach Redis first.
    let _ = tokio::time::timeout(Duration::from_secs(3), store.flush()).await;
    Ok(())
}

/// The store the environment names, and what it names. Fails only on a configuration
/// error: a Redis that is down is connected once it is up.
pub(crate) async fn store_from_env() -> Result<(RedisStore, String), Box<dyn std::error::Error>> {
    let list = |name: &str| -> Option<Vec<String>> {
        let value = std::env::var(name).ok()?;
        Some(value.split(',').map(|u| u.trim().to_owned()).collect())
    };
    // A check that takes longer than this counts as a failure and the fallback decides.
    let builder = RedisStore::builder().timeout(Duration::from_millis(50));
    Ok(if let Some(nodes) = list("REDIS_CLUSTER_URLS") {
        let store = builder.build_cluster(&nodes).await?;
        (store, format!("the Redis Cluster at {}", nodes.join(", ")))
    } else if let Some(sentinels) = list("REDIS_SENTINEL_URLS") {
        let service = std::env::var("REDIS_SERVICE").unwrap_or_else(|_| "mymaster".into());
        let store = builder.build_sentinel(&sentinels, &service).await?;
        let name = format!("the primary of {service} ({})", sentinels.join(", "));
        (store, name)
    } else {
        let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/".into());
        (builder.build(&url).await?, url)
    })
}

/// The app: `/` limited per client IP for the whole fleet, `/login` strictly.
pub(crate) fn app(
    store: RedisStore,
    fleet_size: NonZeroU32,
) -> Result<Router, Box<dyn std::error::Error>> {
    // The store is cheap to clone: both layers share its connections.
    // Named namespaces: every instance shares these budgets, and a deploy that moves this
    // code keeps them (an unnamed layer's namespace comes from where it is built).
    let per_ip = RateLimitLayer::builder(store.clone(), PeerIp::new())
        .namespace("fleet-per-ip")
        .rules("10/min sliding-window name=per-ip")?
        // While Redis is down each instance holds 1/FLEET_SIZE of the limit locally.
        .fallback_share(fleet_size)
        .build()?;
    let login = RateLimitLayer::builder(store, PeerIp::new())
        .namespace("fleet-login")
        .rules("1/s sliding-log name=login-1s; 5/min sliding-log name=login-5min")?
        // No login attempt that was not counted: refuse (503) while Redis is down.
        .failure_policy(FailurePolicy::FailClosed)
        .build()?;

    Ok(Router::new()
        .route(
            "/",
            get(|| async { "hello from the fleet\n" }).route_layer(per_ip),
        )
        .route(
            "/login",
            post(|| async { "logged in\n" }).route_layer(login),
        ))
}
