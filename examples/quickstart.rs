//! The README's first command: an axum app limited per client IP, state in process memory.
//!
//! ```sh
//! cargo run -p ratelimit-examples --example quickstart
//! curl -i localhost:3000/                # 200, with RateLimit-Policy and RateLimit
//! # the 6th login within a minute gets 429 with a plain-text body:
//! for i in $(seq 6); do sleep 1; curl -si -X POST localhost:3000/login | grep -iE '^(HTTP|retry-after|ratelimit)|limit'; done
//! ```
//!
//! Every route admits 60 requests per minute per client IP (sliding window counter);
//! `POST /login` also admits 1 per second and 5 per minute (exact sliding log, both rules
//! decided together). Set `PORT` to serve elsewhere than 3000, `RUST_LOG` for more or
//! less logging.

use std::sync::Arc;

use axum::routing::{get, post};
use axum::Router;
use ratelimit_core::MemoryStore;
use ratelimit_tower::{PeerIp, RateLimitLayer};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    ratelimit_examples::serve::logging();

    // One store for both layers. Each layer built here has budgets of its own, even with
    // the same rules: a budget is (layer namespace, client key, rules). Clone a layer, or
    // give two layers the same `.namespace(..)`, to share one budget.
    let store = Arc::new(MemoryStore::new());
    let per_ip = RateLimitLayer::new(
        store.clone(),
        PeerIp::new(),
        "60/min sliding-window name=per-ip".parse()?,
    );
    let login = RateLimitLayer::new(
        store,
        PeerIp::new(),
        "1/s sliding-log name=login-1s; 5/min sliding-log name=login-5min".parse()?,
    );

    let app = Router::new()
        .route("/", get(|| async { "hello\n" }))
        // `route_layer`, not `layer`: a `GET /login` is answered 405 without spending
        // the login budget.
        .route(
            "/login",
            post(|| async { "logged in\n" }).route_layer(login),
        )
        .layer(per_ip);

    ratelimit_examples::serve::serve(app, |addr| {
        println!("serving on http://{addr}");
        println!("  every route  60 per minute per client IP (sliding window counter)");
        println!("  POST /login  also 1 per second and 5 per minute per client IP (sliding log)");
        println!("try it (the 6th login within a minute gets 429 with a plain-text body):");
        println!(
            "  for i in $(seq 6); do sleep 1; curl -si -X POST http://{addr}/login | grep -iE '^(HTTP|retry-after|ratelimit)|limit'; done"
        );
    })
    .await
}
