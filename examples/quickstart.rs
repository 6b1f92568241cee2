//! The README's first command: an axum app limited per client IP, state in process memory.
//!
//! ```sh
//! cargo run -p ratelimit-examples --example quickstart
//! ```
//!
//! `GET /` admits 10 requests per minute per client IP (sliding window counter);
//! `POST /login` admits 1 per second and 5 per minute (exact sliding log, both rules
//! decided together). Set `PORT` to serve elsewhere than 3000, `RUST_LOG` for more or
//! less logging.

use std::sync::Arc;

use axum::routing::{get, post};
use axum::Router;
use ratelimit_core::MemoryStore;
use ratelimit_tower::{PeerIp, RateLimitLayer};
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| EnvFilter::new("info,ratelimit_tower=debug")),
        )
        .init();

    // One store for both layers: each layer's rule set keeps its own counts.
    let store = Arc::new(MemoryStore::new());
    let per_ip = RateLimitLayer::builder(store.clone(), PeerIp::new())
        .rules("10/min sliding-window name=per-ip")?
        .build()?;
    let login = RateLimitLayer::builder(store, PeerIp::new())
        .rules("1/s sliding-log name=login-1s; 5/min sliding-log name=login-5min")?
        .build()?;

    let app = Router::new()
        .route("/", get(|| async { "hello\n" }).layer(per_ip))
        .route("/login", post(|| async { "logged in\n" }).layer(login));

    ratelimit_examples::serve::serve(app, |addr| {
        println!("serving on http://{addr}");
        println!("  GET  /       10 per minute per client IP (sliding window counter)");
        println!("  POST /login  1 per second and 5 per minute per client IP (sliding log)");
        println!("try it (the 11th request gets 429 with Retry-After and RateLimit fields):");
        println!(
            "  for i in $(seq 11); do curl -si http://{addr}/ | grep -iE '^(HTTP|retry-after|ratelimit)'; done"
        );
    })
    .await
}
