//! Blocking and unblocking clients at run time through an admin endpoint.
//!
//! ```sh
//! ADMIN_TOKEN=s3cret cargo run -p ratelimit-examples --example admin_block
//! curl -i localhost:3000/                                             # 200
//! curl -X PUT -H 'authorization: Bearer s3cret' 'localhost:3000/admin/blocks/127.0.0.1?seconds=30'
//! curl -i localhost:3000/                                             # 403, Retry-After: 30
//! curl -X DELETE -H 'authorization: Bearer s3cret' localhost:3000/admin/blocks/127.0.0.1
//! ```
//!
//! The layer blocks a client key in its own namespace (its budgets' part of the store),
//! so a block stops the client on this layer, on its clones, on every layer given the
//! same namespace, and with Redis on every instance. Blocked clients get 403 here; the
//! default is a 429 indistinguishable from a limit. Without `seconds` the block lasts
//! until lifted. Denials are cached in process for at most a second, so an unblock takes
//! effect within a second.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, put};
use axum::Router;
use ratelimit_core::MemoryStore;
use ratelimit_tower::{BlockedStatus, DenyCacheConfig, PeerIp, RateLimitLayer};

#[derive(Clone)]
struct Admin {
    limiter: RateLimitLayer<Arc<MemoryStore>, PeerIp>,
    token: Arc<str>,
}

impl Admin {
    fn authorized(&self, headers: &HeaderMap) -> bool {
        headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .is_some_and(|t| t == &*self.token)
    }
}

async fn block(
    State(admin): State<Admin>,
    headers: HeaderMap,
    Path(key): Path<String>,
    Query(query): Query<HashMap<String, String>>,
) -> (StatusCode, String) {
    if !admin.authorized(&headers) {
        return (
            StatusCode::UNAUTHORIZED,
            "bad or missing admin token\n".into(),
        );
    }
    let duration = match query.get("seconds").map(|s| s.parse::<u64>()) {
        None => None,
        Some(Ok(secs)) => Some(Duration::from_secs(secs)),
        Some(Err(_)) => {
            return (
                StatusCode::BAD_REQUEST,
                "seconds must be a whole number\n".into(),
            );
        }
    };
    match admin.limiter.block(key.as_bytes(), duration).await {
        Ok(()) => (StatusCode::OK, format!("blocked {key} for {duration:?}\n")),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")),
    }
}

async fn unblock(
    State(admin): State<Admin>,
    headers: HeaderMap,
    Path(key): Path<String>,
) -> (StatusCode, String) {
    if !admin.authorized(&headers) {
        return (
            StatusCode::UNAUTHORIZED,
            "bad or missing admin token\n".into(),
        );
    }
    match admin.limiter.unblock(key.as_bytes()).await {
        Ok(()) => (StatusCode::OK, format!("unblocked {key}\n")),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")),
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt().init();
    let token: Arc<str> = std::env::var("ADMIN_TOKEN")
        .map_err(|_| "set ADMIN_TOKEN to the bearer token the admin endpoint accepts")?
        .into();

    let limited = RateLimitLayer::builder(Arc::new(MemoryStore::new()), PeerIp::new())
        .rules("60/min sliding-window precision=6")?
        .namespace("site")
        .blocked_status(BlockedStatus::Forbidden)
        .deny_cache(DenyCacheConfig::default().max_ttl(Duration::from_secs(1)))
        .build()?;

    let admin = Router::new()
        .route("/admin/blocks/{key}", put(block).delete(unblock))
        .with_state(Admin {
            limiter: limited.clone(),
            token,
        });
    let app = Router::new()
        .route("/", get(|| async { "hello\n" }))
        .layer(limited)
        .merge(admin);

    ratelimit_examples::serve::serve(app, |addr| {
        println!("serving on http://{addr}; admin: PUT/DELETE /admin/blocks/<key>[?seconds=N]");
    })
    .await
}
