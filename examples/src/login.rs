//! The `login` example's app: a login guard that counts failed logins only.
//!
//! `POST /login` with the header `x-password: hunter2` succeeds (200); any other password
//! fails (401). Each client IP may fail 5 times per 15 minutes (an exact sliding log);
//! successful logins are free, because the layer charges by outcome: the check before
//! the handler charges as always (so 50 concurrent wrong guesses still get exactly 5
//! tries), and a response that is not a failure gives its unit back at once.

use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::Router;
use ratelimit_core::Store;
use ratelimit_tower::{PeerIp, RateLimitLayer};

/// The password the example accepts.
pub const PASSWORD: &str = "hunter2";

/// The failed-login budget: 5 per 15 minutes per client IP.
pub const FAILED_LOGINS: &str = "5/15min sliding-log name=failed-logins";

/// The app, its state in `store`.
pub fn app<S: Store>(store: S) -> Router {
    let guard = RateLimitLayer::builder(store, PeerIp::new())
        .rules(FAILED_LOGINS)
        .expect("the rule text is valid")
        .namespace("login-failures")
        // Only a 401 counts: a successful login (and a server error) gives its unit back.
        .charge_when(|res: &axum::http::response::Parts| res.status == StatusCode::UNAUTHORIZED)
        .build()
        .expect("the layer's configuration is valid");
    Router::new().route("/login", post(login).route_layer(guard))
}

async fn login(headers: HeaderMap) -> (StatusCode, &'static str) {
    match headers.get("x-password") {
        Some(p) if p == PASSWORD => (StatusCode::OK, "welcome\n"),
        _ => (StatusCode::UNAUTHORIZED, "wrong password\n"),
    }
}
