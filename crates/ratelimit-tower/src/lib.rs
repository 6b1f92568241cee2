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
//! | no key found (misconfiguration) | 500 by default ([`MissingKey`]) | |
//!
//! A refusal has a short `text/plain` body (`rate limit exceeded, retry in 3 s`) by
//! default; [`ProblemJson`] gives RFC 9457 `application/problem+json`, and
//! [`on_rejection`](RateLimitLayerBuilder::on_rejection) takes any hook.
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
//! let per_ip = RateLimitLayer::new(store.clone(), PeerIp::new(), "10/min sliding-window".parse()?);
//! let login = RateLimitLayer::new(store, PeerIp::new(), "1/s name=login-burst; 5/min name=login".parse()?);
//! let app = Router::new()
//!     .route("/", get(|| async { "hello" }))
//!     // `route_layer`: requests that match no route (404, 405) spend no login budget.
//!     .route("/login", post(|| async { "welcome" }).route_layer(login))
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
//! assert_eq!(limited.headers()["content-type"], "text/plain; charset=utf-8");
//! let policies: Vec<_> = limited.headers().get_all("ratelimit-policy").iter().collect();
//! assert_eq!(policies, [r#""login-burst";q=1;w=1, "login";q=5;w=60"#, r#""10-per-1min";q=10;w=60"#]);
//! # Ok(())
//! # }
//! ```
//!
//! Serve the router with `into_make_service_with_connect_info::<SocketAddr>()` so that
//! [`PeerIp`] sees the peer address; behind a reverse proxy use [`ClientIp`]. Put
//! per-route limits on with `route_layer` (`MethodRouter::layer` also runs for requests
//! the route answers 405, spending the budget on them).
//!
//! # Every request is limited, exempt or refused
//!
//! The key extractor ([`KeyExtractor`]) answers a key, a deliberate exemption
//! ([`PeerIp::exempt`] / [`ClientIp::exempt`] for networks,
//! [`exempt_if`](key::KeyExtractorExt::exempt_if) for anything else), or "no key found":
//! a request without a peer address (the server was started without
//! `into_make_service_with_connect_info`), without the header, or without the extension an
//! authentication layer should have set. No key found is a misconfiguration: by default
//! the request is answered 500 with a body that says what is missing
//! ([`MissingKey`]), and the layer logs at `ERROR` at most every 10 seconds with the
//! number of such requests. A closure extractor answering `None` is "no key found" too.
//!
//! # Budgets and namespaces
//!
//! A budget is (namespace, tier, client key). A layer's namespace is the one
//! given to [`namespace`](RateLimitLayerBuilder::namespace), or else derived from where
//! [`RateLimitLayer::new`] / [`builder`](RateLimitLayer::builder) is called in the source
//! (`@` and a hash of file, line and column). So:
//!
//! * two layers built in two places never share budgets, even with the same rules on the
//!   same store (`"2/min"` on `/a` and on `/b` are two budgets);
//! * a cloned layer shares its budgets (put one layer on two routes to give them one);
//! * layers given the same namespace share budgets;
//! * the instances of a fleet running the same build share budgets through a shared store
//!   (Redis): the derived namespace is the same in every process. A deploy that moves the
//!   line a layer is built on starts its budgets afresh; name the namespace to keep them
//!   across deploys, and when a helper function builds several layers (one call site for
//!   all of them).
//!
//! The store key is `[n] namespace [m] tier client-key`, where `n` and `m` are single
//! bytes holding the lengths of the namespace and the tier name (`""` unless
//! [tiers](#tiers-rules-per-request) are used), so no two (namespace, tier, key) triples
//! produce the same bytes. The store then keeps one state per key (each rule's inside it
//! by the rule's identity, so changed limits keep each client's usage) and digests long
//! keys itself. [`RateLimitLayer::store_key`] gives the key for a client;
//! [`RateLimitLayer::block`], [`unblock`](RateLimitLayer::unblock) and
//! [`reset`](RateLimitLayer::reset) act on a client key in the layer's namespace.
//!
//! # Tiers: rules per request
//!
//! A layer can hold several tiers (plans), each with its own rules, budgets and
//! `RateLimit-Policy`; a selector picks the tier of each request:
//!
//! ```
//! use axum::body::Body;
//! use http::Request;
//! use ratelimit_core::MemoryStore;
//! use ratelimit_tower::{HeaderKey, RateLimitLayer};
//!
//! #[derive(Clone, Copy)]
//! enum Plan { Free, Pro }
//!
//! let layer = RateLimitLayer::builder(MemoryStore::new(), HeaderKey::new("x-api-key"))
//!     .tier("free", "100/h name=free".parse()?)
//!     .tier("pro", "10000/h name=pro".parse()?)
//!     .default_tier("free")
//!     // The plan, as an authentication layer in front of this one found it.
//!     .select_tier(|req: &Request<Body>| match req.extensions().get::<Plan>() {
//!         Some(Plan::Pro) => Some("pro"),
//!         Some(Plan::Free) | None => None,
//!     })
//!     .build()?;
//! assert_eq!(layer.tier_rules("pro").unwrap().rules()[0].limit(), 10_000);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Handlers see the decision
//!
//! An admitted request carries the store's [`Decision`](ratelimit_core::Decision) in its
//! extensions (remaining and reset per rule); with stacked layers, the innermost one's.
//! In axum: `Extension(decision): Extension<Decision>`.
//!
//! # Testing your app
//!
//! Everything the layer keeps in time (its deny cache, the fallback store) runs on the
//! store's clock, so a [`MemoryStore`](ratelimit_core::MemoryStore) on a
//! [`ManualClock`](ratelimit_core::ManualClock) tests the app with the default settings:
//! no paused tokio time, nothing turned off.
//!
//! ```
//! use axum::{body::Body, extract::ConnectInfo, routing::get, Router};
//! use http::{Request, StatusCode};
//! use ratelimit_core::{ManualClock, MemoryStore};
//! use ratelimit_tower::{PeerIp, RateLimitLayer};
//! use std::{net::SocketAddr, sync::Arc, time::Duration};
//! use tower::ServiceExt;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let clock = ManualClock::new(1_700_000_000_000_000);
//! let store = Arc::new(MemoryStore::builder().clock(clock.clone()).build());
//! let app = Router::new()
//!     .route("/", get(|| async { "hello" }))
//!     .layer(RateLimitLayer::new(store, PeerIp::new(), "10/min".parse()?));
//!
//! let get = || {
//!     let mut req = Request::get("/").body(Body::empty()).unwrap();
//!     let peer: SocketAddr = "203.0.113.9:40000".parse().unwrap();
//!     # #[cfg(feature = "axum")]
//!     req.extensions_mut().insert(ConnectInfo(peer));
//!     # #[cfg(not(feature = "axum"))]
//!     # req.extensions_mut().insert(peer);
//!     req
//! };
//! for _ in 0..10 {
//!     assert_eq!(app.clone().oneshot(get()).await?.status(), StatusCode::OK);
//! }
//! let limited = app.clone().oneshot(get()).await?;
//! assert_eq!(limited.status(), StatusCode::TOO_MANY_REQUESTS);
//!
//! clock.advance(Duration::from_secs(120));
//! assert_eq!(app.oneshot(get()).await?.status(), StatusCode::OK);
//! # Ok(())
//! # }
//! ```
//!
//! # Beyond limits
//!
//! * **Shaping.** A rule in shaper mode (`2/s leaky-bucket mode=shaper burst=10`) admits
//!   late rather than refusing: the request waits the store's delay (at most
//!   [`max_delay`](RateLimitLayerBuilder::max_delay), on the tokio timer, so the service
//!   must run inside a tokio runtime) before the inner service sees it.
//! * **Local deny cache.** Once a key is denied with retry time T, its requests are
//!   answered in process until T (on the store's clock), without a store call: a flood
//!   from one client costs the store one call per retry period, not one per request.
//! * **Fleet-aware fallback.** With [`FailurePolicy::Fallback`] each instance decides
//!   locally while the store is down; [`fallback_share`](RateLimitLayerBuilder::fallback_share)
//!   divides the limits among N instances so the fleet stays within them.
//! * **Shadow mode.** [`shadow`](RateLimitLayerBuilder::shadow) decides and reports (a
//!   `RateLimit-Shadow` field and an `INFO` event) but never refuses: for trying new
//!   limits on real traffic.
//! * **Observability.** `tracing` events with targets under `ratelimit_tower` (`WARN` for
//!   store failures, with the policy applied, at most every 10 s with a count; `DEBUG` for refusals and delays; `TRACE`
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
//! (or an `Arc` of one) the check runs synchronously inside `call` without a future;
//! other stores' checks are boxed futures (one allocation per request, small next to a
//! network round trip). An admitted request costs two allocations of the layer's own:
//! the `RateLimit` field and the decision placed in the request's extensions.

// docs.rs builds with every feature and `--cfg docsrs`: badge items behind a feature.
#![cfg_attr(docsrs, feature(doc_cfg))]

// The README is the crates.io page: its examples must compile like the crate docs'.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

mod cost;
mod decide;
mod deny_cache;
mod future;
pub mod headers;
pub mod key;
mod layer;
mod metrics;
mod policy;
mod rejection;
mod service;
mod tier;

pub use cost::{RequestCost, UnitCost};
pub use deny_cache::DenyCacheConfig;
pub use future::ResponseFuture;
pub use key::{
    ClientIp, Extraction, ForwardedHeader, GlobalKey, HeaderKey, Key, KeyConfigError, KeyExtractor,
    KeyExtractorExt, PeerIp,
};
pub use layer::{BuildError, RateLimitLayer, RateLimitLayerBuilder, DEFAULT_MAX_DELAY};
pub use policy::{FailurePolicy, MissingKey};
pub use rejection::{BlockedStatus, OnRejection, PlainText, ProblemJson, RejectReason, Rejection};
pub use service::RateLimit;
pub use tier::{OneTier, SelectTier};
