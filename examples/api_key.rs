//! Limits per API key, by pricing tier, with expensive routes costing more.
//!
//! ```sh
//! cargo run -p ratelimit-examples --example api_key
//! curl -i -H 'x-api-key: free-123' localhost:3000/search     # cost 1 of 20/min
//! curl -i -H 'x-api-key: free-123' localhost:3000/export     # cost 10 of 20/min
//! curl -i -H 'x-api-key: pro-456'  localhost:3000/export     # cost 10 of 1000/min
//! curl -i localhost:3000/search                              # 401: no key
//! ```
//!
//! One layer per tier; each keys only the requests of its tier (the key extractor returns
//! `None` for the others), so a key is counted once, against its own tier's rules. A
//! request costing more than its tier can ever grant at once would be answered 413, not
//! 429: waiting would not help.

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use ratelimit_core::MemoryStore;
use ratelimit_tower::RateLimitLayer;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tier {
    Free,
    Pro,
}

/// The keys this example knows; a real service would look them up in its database.
fn accounts() -> Arc<HashMap<&'static str, Tier>> {
    Arc::new(HashMap::from([
        ("free-123", Tier::Free),
        ("pro-456", Tier::Pro),
    ]))
}

/// The API key of `req` if it belongs to `tier`.
fn key_of(
    accounts: Arc<HashMap<&'static str, Tier>>,
    tier: Tier,
) -> impl Fn(&Request<Body>) -> Option<Vec<u8>> + Clone + Send + Sync + 'static {
    move |req| {
        let key = req.headers().get("x-api-key")?.to_str().ok()?;
        (accounts.get(key) == Some(&tier)).then(|| key.as_bytes().to_vec())
    }
}

/// Searches are cheap, exports cost ten.
fn cost(req: &Request<Body>) -> u64 {
    if req.uri().path().starts_with("/export") {
        10
    } else {
        1
    }
}

/// Unknown keys never reach the limiters: they are not customers.
async fn authenticate(req: Request, next: Next) -> Response {
    let known = req
        .headers()
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|k| accounts().contains_key(k));
    if !known {
        return (StatusCode::UNAUTHORIZED, "missing or unknown x-api-key\n").into_response();
    }
    next.run(req).await
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt().init();
    let accounts = accounts();
    let store = Arc::new(MemoryStore::new());
    let free = RateLimitLayer::builder(store.clone(), key_of(accounts.clone(), Tier::Free))
        .rules("20/min sliding-window precision=6 name=free")?
        .cost(cost)
        .build()?;
    let pro = RateLimitLayer::builder(store, key_of(accounts, Tier::Pro))
        .rules("1000/min sliding-window precision=6 name=pro; 50/s gcra name=pro-burst")?
        .cost(cost)
        .build()?;

    let app = Router::new()
        .route("/search", get(|| async { "results\n" }))
        .route("/export", get(|| async { "a large export\n" }))
        .layer(free)
        .layer(pro)
        .layer(middleware::from_fn(authenticate));

    ratelimit_examples::serve::serve(app, |addr| {
        println!("serving on http://{addr}; keys: free-123 (20/min), pro-456 (1000/min)");
    })
    .await
}
