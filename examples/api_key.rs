//! Limits per API key, by plan: each plan (tier) has its own rules, budgets and
//! `RateLimit-Policy`; expensive routes cost more.
//!
//! ```sh
//! cargo run -p ratelimit-examples --example api_key
//! curl -i -H 'x-api-key: free-123' localhost:3000/search     # cost 1 of 100/h
//! curl -i -H 'x-api-key: free-123' localhost:3000/export     # cost 10 of 100/h
//! curl -i -H 'x-api-key: pro-456'  localhost:3000/export     # cost 10 of 10000/h
//! curl -i localhost:3000/search                              # 401: no key
//! ```
//!
//! An authentication middleware in front of the limiter looks the key up and puts the
//! account's plan into the request; the limiter's tier selector reads it. A request
//! costing more than its plan can ever grant at once would be answered 413, not 429:
//! waiting would not help. The handler reads what is left of its budget from the
//! `Admission` the limiter put into the request.

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use ratelimit_core::MemoryStore;
use ratelimit_tower::{Admission, HeaderKey, RateLimitLayer};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Plan {
    Free,
    Pro,
}

impl Plan {
    /// The tier of the rate limiter this plan is decided under.
    fn tier(self) -> &'static str {
        match self {
            Plan::Free => "free",
            Plan::Pro => "pro",
        }
    }
}

/// The keys this example knows; a real service would look them up in its database.
fn accounts() -> Arc<HashMap<&'static str, Plan>> {
    Arc::new(HashMap::from([
        ("free-123", Plan::Free),
        ("pro-456", Plan::Pro),
    ]))
}

/// Searches are cheap, exports cost ten.
fn cost(req: &Request) -> u64 {
    if req.uri().path().starts_with("/export") {
        10
    } else {
        1
    }
}

/// Unknown keys never reach the limiter: they are not customers. Known ones carry their
/// plan onwards.
async fn authenticate(mut req: Request, next: Next) -> Response {
    let plan = req
        .headers()
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .and_then(|k| accounts().get(k).copied());
    let Some(plan) = plan else {
        return (StatusCode::UNAUTHORIZED, "missing or unknown x-api-key\n").into_response();
    };
    req.extensions_mut().insert(plan);
    next.run(req).await
}

/// Every request the limiter passes on carries an `Admission` (`admission_extension`),
/// also when it passed unchecked (the store down and failing open): extracting it never
/// fails.
async fn search(admission: Admission) -> String {
    match admission.binding() {
        // The plan's rule nearest to its limit (the burst rule of "pro", often).
        Some(rule) => format!(
            "results ({} of {} left, all back in {} s)\n",
            rule.remaining,
            rule.limit,
            rule.reset_after.as_secs()
        ),
        None => "results (not counted)\n".to_owned(),
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt().init();
    let limiter =
        RateLimitLayer::builder(Arc::new(MemoryStore::new()), HeaderKey::new("x-api-key"))
            .tier(
                "free",
                "100/h sliding-window precision=6 name=free".parse()?,
            )
            .tier(
                "pro",
                "10000/h sliding-window precision=6 name=pro; 50/s gcra name=pro-burst".parse()?,
            )
            // Requests without a plan (the authentication layer did not run first) and
            // plans these limits do not list are limited as free: never a free pass.
            .default_tier("free")
            .select_tier(|req: &Request| req.extensions().get::<Plan>().map(|p| p.tier()))
            .cost(cost)
            // The handler reads the `Admission`: put into requests only when asked for.
            .admission_extension(true)
            .build()?;

    let app = Router::new()
        .route("/search", get(search))
        .route("/export", get(|| async { "a large export\n" }))
        .layer(limiter)
        // Added last, so it runs first.
        .layer(middleware::from_fn(authenticate));

    ratelimit_examples::serve::serve(app, |addr| {
        println!("serving on http://{addr}; keys: free-123 (100/h), pro-456 (10000/h)");
    })
    .await
}
