//! Rate limiting for [tower](https://docs.rs/tower) services and [axum](https://docs.rs/axum) routers.
//!
//! [`RateLimitLayer`] extracts a key from each request (the client IP, an API key, a user
//! id: see [`KeyExtractor`]), asks a [`Store`](ratelimit_core::Store) to decide the
//! request against the layer's rules, and then passes it on, delays it (shaping rules),
//! or answers it:
//!
//! | outcome | status | fields |
//! |---|---|---|
//! | admitted | the inner service's | `RateLimit-Policy`, `RateLimit` (can be turned off) |
//! | limited | 429 | `Retry-After`, `RateLimit-Policy`, `RateLimit` |
//! | blocked key | 429 or 403 ([`BlockedStatus`]) | `Retry-After` (unless endless), `RateLimit-Policy` |
//! | cost above a rule's capacity | 413 (waiting would not help) | `RateLimit-Policy` |
//! | store failed | per [`FailurePolicy`]: pass, 503, or a local fallback store | |
//!
//! The fields follow draft-ietf-httpapi-ratelimit-headers: one list item per rule, named
//! by the rule's name or `<limit>-per-<period>`, e.g.
//! `RateLimit-Policy: "login";q=5;w=60` and `RateLimit: "login";r=2;t=41`. `Retry-After`
//! is in whole seconds, rounded up, and never 0. Layers stack: a response passing
//! through two layers carries both layers' items.
//!
//! ```
//! use axum::{body::Body, extract::ConnectInfo, routing::{get, post}, Router};
//! use http::{Request, StatusCode};
//! use ratelimit_core::MemoryStore;
//! use ratelimit_tower::{PeerIp, RateLimitLayer};
//! use std::{net::SocketAddr, sync::Arc};
//! use tower::ServiceExt;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let store = Arc::new(MemoryStore::new());
//! let per_ip = RateLimitLayer::builder(store.clone(), PeerIp::new())
//!     .rules("10/min sliding-window")?
//!     .build()?;
//! let login = RateLimitLayer::builder(store, PeerIp::new())
//!     .rules("1/s name=login-burst; 5/min name=login")?
//!     .build()?;
//! let app = Router::new()
//!     .route("/", get(|| async { "hello" }))
//!     .route("/login", post(|| async { "welcome" }).layer(login))
//!     .layer(per_ip);
//!
//! let request = || {
//!     let mut req = Request::post("/login").body(Body::empty()).unwrap();
//!     // What axum's `into_make_service_with_connect_info` gives each request.
//!     let peer: SocketAddr = "192.0.2.1:5000".parse().unwrap();
//!     # #[cfg(feature = "axum")]
//!     req.extensions_mut().insert(ConnectInfo(peer));
//!     # #[cfg(not(feature = "axum"))]
//!     # req.extensions_mut().insert(peer);
//!     req
//! };
//! let ok = app.clone().oneshot(request()).await?;
//! assert_eq!(ok.status(), StatusCode::OK);
//! assert_eq!(ok.headers()["ratelimit"], r#""login-burst";r=0;t=1, "login";r=4;t=12"#);
//!
//! let limited = app.oneshot(request()).await?;
//! assert_eq!(limited.status(), StatusCode::TOO_MANY_REQUESTS);
//! assert_eq!(limited.headers()["retry-after"], "1");
//! let policies: Vec<_> = limited.headers().get_all("ratelimit-policy").iter().collect();
//! assert_eq!(policies, [r#""login-burst";q=1;w=1, "login";q=5;w=60"#, r#""10-per-1min";q=10;w=60"#]);
//! # Ok(())
//! # }
//! ```
//!
//! Serve the router with `into_make_service_with_connect_info::<SocketAddr>()` so that
//! [`PeerIp`] sees the peer address; behind a reverse proxy use [`ClientIp`].
//!
//! # Beyond limits
//!
//! * **Shaping.** A rule in shaper mode (`2/s leaky-bucket mode=shaper burst=10`) admits
//!   late rather than refusing: the request waits the store's delay (at most
//!   [`max_delay`](RateLimitLayerBuilder::max_delay), on the tokio timer, so the service
//!   must run inside a tokio runtime) before the inner service sees it.
//! * **Local deny cache.** Once a key is denied with retry time T, its requests are
//!   answered in process until T, without a store call: a flood from one client costs the
//!   store one call per retry period, not one per request.
//! * **Shadow mode.** [`shadow`](RateLimitLayerBuilder::shadow) decides and reports (a
//!   `RateLimit-Shadow` field and an `INFO` event) but never refuses: for trying new
//!   limits on real traffic.
//! * **Observability.** `tracing` events with targets under `ratelimit_tower` (`WARN` for
//!   store failures, with the policy applied; `DEBUG` for refusals and delays; `TRACE`
//!   for admissions), a `ratelimit_check` span (`DEBUG`) around each store round trip
//!   that does not complete at once, and, with the `metrics` feature, counters labelled
//!   by rule (see below).
//!
//! # Metrics
//!
//! With the `metrics` feature, each layer registers these counters when it is built
//! (install the recorder first):
//!
//! | counter | labels |
//! |---|---|
//! | `ratelimit_admitted_total` | `rule` (each rule of the layer) |
//! | `ratelimit_limited_total` | `rule` (each rule that denied) |
//! | `ratelimit_blocked_total` | `rules` (the layer's rule names, comma-separated) |
//! | `ratelimit_store_errors_total` | `rules`, `policy` (`fail_open`, `fail_closed`, `fallback`) |
//!
//! # Cost
//!
//! The store is generic, not boxed. With a [`MemoryStore`](ratelimit_core::MemoryStore)
//! (or an `Arc` of one) the check runs synchronously inside `call` and the layer
//! allocates nothing for it; other stores' checks are boxed futures (one allocation per
//! request, small next to a network round trip).

// docs.rs builds with every feature and `--cfg docsrs`: badge items behind a feature.
#![cfg_attr(docsrs, feature(doc_cfg))]

// The README is the crates.io page: its examples must compile like the crate docs'.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

mod cost;
mod deny_cache;
mod future;
pub mod headers;
pub mod key;
mod layer;
mod metrics;
mod policy;
mod rejection;
mod service;

pub use cost::{RequestCost, UnitCost};
pub use deny_cache::DenyCacheConfig;
pub use future::ResponseFuture;
pub use key::{
    ClientIp, ForwardedHeader, GlobalKey, HeaderKey, Key, KeyConfigError, KeyExtractor, PeerIp,
};
pub use layer::{RateLimitLayer, RateLimitLayerBuilder, DEFAULT_MAX_DELAY};
pub use policy::FailurePolicy;
pub use rejection::{BlockedStatus, DefaultRejection, OnRejection, RejectReason, Rejection};
pub use service::RateLimit;
