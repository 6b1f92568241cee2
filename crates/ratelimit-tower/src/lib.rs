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
//! | store failed | per [`FailurePolicy`]: pass, 503, or a local fallback store | the fallback's, when it decides |
//! | store failed, cost above the fallback's share only | 503 ([while the store is down](#while-the-store-is-down)) | `Retry-After`, `RateLimit-Policy` (the fallback's) |
//! | the client left out its key (a header) | 400 by default ([`omitted_key_status`](RateLimitLayerBuilder::omitted_key_status)) | |
//! | no key found (server misconfiguration) | 500 by default ([`MissingKey`]) | |
//!
//! A gRPC call is refused with HTTP 200 and a `grpc-status` instead: see [gRPC](#grpc).
//!
//! A refusal has a short `text/plain` body (`rate limit exceeded, retry in 3 s`) by
//! default; [`ProblemJson`] gives RFC 9457 `application/problem+json`, and
//! [`on_rejection`](RateLimitLayerBuilder::on_rejection) takes any hook.
//!
//! The fields follow draft-ietf-httpapi-ratelimit-headers: one list item per rule, e.g.
//! `RateLimit-Policy: "login";q=5;w=60` and `RateLimit: "login";r=2;t=41`. `Retry-After`
//! is in whole seconds, rounded up, and never 0. Layers stack: a response passing
//! through two layers carries both layers' items. In detail:
//!
//! * **Names.** A rule named with `name=` is announced by that name, as written. An
//!   unnamed rule is `<limit>-per-<period>@<layer>`, where `<layer>` is the layer's
//!   namespace when it is up to 32 characters of `A-Z a-z 0-9 _ - .`, else 8 hex digits
//!   of its hash (so for implicit namespaces): `"10-per-1min@api"`. Two stacked layers
//!   with the same rule text therefore announce two items a client can tell apart. Layers
//!   that share a namespace share the budget of such a rule, and announce it by one name;
//!   two rules named alike are the application's to rename.
//! * **`q`** is the rule's limit, or what it admits at once when that is more (a token
//!   bucket's capacity, a leaky shaper's burst + 1): `r` never exceeds `q`.
//! * **`w`** is the rule's period in seconds. The draft's window is whole seconds, so a
//!   rule whose period is not (`3/1500ms`, `1/500ms`) is announced without `w` rather
//!   than with a longer or shorter window; its name states the period
//!   (`"3-per-1500ms@api";q=3`).
//! * **`t`** is the time, in whole seconds rounded up, until the rule's quota is whole
//!   again: at most `w` for a fixed window and a sliding log; for a bucket (token bucket,
//!   leaky bucket, GCRA) the time to refill `q` at the rule's rate, so at most `w` unless
//!   `q` is above the limit. A sliding window counter keeps a request counted until the
//!   sub-window it fell in has left the window, so its `t` can reach
//!   `w + w / precision` (twice `w` with precision 1). These are the times the quota
//!   takes, not rounded down to `w`; `r` grows back before then.
//! * **While the store is down**, a request the fallback store decides is told the rules
//!   the fallback enforces, under names of their own: `"api/fallback";q=25;w=60` for a
//!   `100/min name=api` rule shared by 4 instances. See
//!   [while the store is down](#while-the-store-is-down).
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
//!     .namespace("per-ip")
//!     .build()?;
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
//! assert_eq!(policies, [r#""login-burst";q=1;w=1, "login";q=5;w=60"#, r#""10-per-1min@per-ip";q=10;w=60"#]);
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
//! [`exempt_if`](key::KeyExtractorExt::exempt_if) for anything else), or no key, for one
//! of two reasons:
//!
//! * **The client left it out** ([`Extraction::Omitted`]): a request without the header a
//!   [`HeaderKey`] reads. The client's mistake: answered 400 (or the status given to
//!   [`omitted_key_status`](RateLimitLayerBuilder::omitted_key_status)) with a body that
//!   says what is missing, logged at `DEBUG`. To key such requests another way, give the
//!   extractor a fallback: `HeaderKey::new("x-api-key").or(PeerIp::new())` keys by the
//!   API key when there is one, else by the peer address
//!   ([`or`](key::KeyExtractorExt::or)).
//! * **The server did not provide it** ([`Extraction::Missing`]): a request without a peer
//!   address (the server was started without `into_make_service_with_connect_info`) or
//!   without the extension an authentication layer should have set. A misconfiguration:
//!   by default answered 500 with a body that says what is missing ([`MissingKey`]), and
//!   logged at `ERROR` at most every 10 seconds with the number of such requests. A
//!   closure extractor answering `None` is a missing key too.
//!
//! Logs above `TRACE` show a client key only as its digest
//! ([`log_digest`](key::log_digest)): `key=#3fa2c91b`; `TRACE` events add the key itself
//! (`client=`).
//!
//! # Budgets and namespaces
//!
//! A budget is (namespace, tier, client key); inside it each rule keeps its state by its
//! identity (see [Changing limits](#changing-limits)). A layer's namespace is the one
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
//!   all of them). On a store shared across processes
//!   ([`Store::is_shared`](ratelimit_core::Store::is_shared), e.g. Redis) a layer built
//!   without a namespace logs a `WARN` at build, naming its source location and the fix.
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
//! `RateLimit-Policy`; a selector picks the tier of each request. A layer with a selector
//! has a default tier (the top-level rules, the tier `""`, or the tier named with
//! [`default_tier`](RateLimitLayerBuilder::default_tier)): requests the selector puts in
//! no tier, and requests in a tier the limits lack (a plan the limits in force do not list
//! yet, or any more), are decided under it, the latter with a `WARN` once per tier name
//! per version of the limits (past 64 names, one line per 10 s for all of them). Limits
//! without a default tier are refused, by [`build`](RateLimitLayerBuilder::build) and by
//! [`LimitsHandle::replace`] alike ([`BuildError::NoDefaultTier`]): a tier missing from
//! the limits never turns into 500s.
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
//! # Changing limits
//!
//! A layer's rules and tiers can change while it runs. [`RateLimitLayer::limits`] gives a
//! [`LimitsHandle`]; [`replace`](LimitsHandle::replace) puts new [`Limits`] in force for
//! the layer, every clone of it and every service made from one, or refuses them with the
//! [`BuildError`] [`build`](RateLimitLayerBuilder::build) would give, keeping the running
//! ones. With the `serde` feature, [`Limits`] reads from a configuration file (rule sets in
//! their text form). [`LimitsFile`] reads such a file with bounds (its size, its tiers),
//! parses and compares it off the request path, and logs each reload in one bounded line;
//! the `live_limits` example reloads a TOML file with it on `SIGHUP`.
//!
//! ```
//! use ratelimit_core::MemoryStore;
//! use ratelimit_tower::{Limits, PeerIp, RateLimitLayer};
//!
//! let layer = RateLimitLayer::builder(MemoryStore::new(), PeerIp::new())
//!     .namespace("api") // a fixed name: budgets survive deploys and reloads alike
//!     .rules("5/h sliding-window name=hourly")?
//!     .build()?;
//! let handle = layer.limits(); // keep it, e.g. in a signal handler
//! handle.replace(Limits::new("10/h sliding-window name=hourly".parse()?))?;
//! assert_eq!(layer.rules().rules()[0].limit(), 10);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Each request is decided entirely under one version: the one current when it arrived,
//! for its tier, its rules, its fields and its deny-cache lookup, even if a replacement
//! lands while its store call is in flight. The hot path takes no lock: the current
//! version sits in an [`arc-swap`](https://docs.rs/arc-swap) `ArcSwap`, which a request
//! reads with a few atomic operations and a replacement swaps whole. A lock (even a
//! read-write one) would put a shared write on every request; a version number checked per
//! request would still need a lock to read the tiers it numbers. What is derived from the
//! rules is rebuilt with them: the `RateLimit-Policy` fields, the fallback rules of
//! [`fallback_share`](RateLimitLayerBuilder::fallback_share), the metrics' labels; denials
//! cached under the old limits no longer answer. The namespace, key extractor, tier
//! selector and every other setting stay as built.
//!
//! **What carries, what starts fresh.** A client's state in the store is named by
//! (namespace, tier, client key) and, inside it, each rule's state by the rule's identity:
//! its name when it has one, else its algorithm and period. So, for a client who has spent
//! 3 under `5/h`:
//!
//! * a changed limit keeps the usage: 7 left under `10/h`, none under `3/h`, whatever the
//!   algorithm (GCRA, the default, included). Window counts and log entries carry as they
//!   are; a token bucket's tokens and a GCRA's or leaky bucket's arrival time are turned
//!   into units used and back under the new limit, at the first check under it (the
//!   core's `algo` module docs, "Changing rules", give each algorithm's case);
//! * a rule of a new identity starts empty (a new rule, a new algorithm, a new period or
//!   sliding-window precision, a rule that gains, loses or changes its name), and the
//!   state of a rule that is gone is dropped;
//! * a new tier starts empty; a removed tier's clients are decided by the tier the
//!   selector now gives them, on that tier's usage.
//!
//! Name a file-driven layer's namespace: the derived one (see
//! [namespaces](#budgets-and-namespaces)) is the same across reloads, but not across a
//! deploy that moves the line the layer is built on.
//!
//! **A fleet rolling from one file to the next.** Instances reload one at a time, so for a
//! while some decide under the old limits and some under the new, on the same shared
//! state. That is safe: each rule's state is shared by identity, each instance decides
//! each request atomically under its own rules, and no state is corrupted or reset. A
//! client's requests are held to the limit of whichever instance answers each one: while
//! `100/min` and `200/min` instances coexist, a client can get up to 200 in the minute
//! through the new ones, the old ones refusing past 100 of the same shared count. The
//! `RateLimit-Policy` a client sees is that of the instance that answered. Once every
//! instance has reloaded, the fleet enforces the new limits, on usage that carried.
//!
//! # Counting only some outcomes
//!
//! A login guard limits failed logins, not logins: "5 failures per 15 minutes per
//! address; successful logins are free". [`charge_when`](RateLimitLayerBuilder::charge_when)
//! says which responses count. The check before the handler charges as always and
//! refuses when the budget is spent, so 50 concurrent wrong guesses get exactly 5 tries
//! (a limiter that only counts after the response lets every one of them through); a
//! response that does not count gives its units back at once, through
//! [`Store::refund`](ratelimit_core::Store::refund), never more than its check took and
//! never into another window (a fixed window that rolled over in between keeps its new
//! count). The response's `RateLimit` field shows the units back.
//!
//! ```
//! use ratelimit_core::MemoryStore;
//! use ratelimit_tower::{PeerIp, RateLimitLayer};
//!
//! let guard = RateLimitLayer::builder(MemoryStore::new(), PeerIp::new())
//!     .rules("5/15min sliding-log name=failed-logins")?
//!     .namespace("login")
//!     .charge_when(|res: &http::response::Parts| res.status == http::StatusCode::UNAUTHORIZED)
//!     .build()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! What it costs: a request that gives back makes a second store call (in process: a
//! lock and a few integer operations; on Redis: one more round trip, which the response
//! waits for, so that the client's next request finds its units back). For the token
//! bucket, GCRA and the leaky bucket, what goes back is the part of the charge that has
//! not drained since the check (a handler that answers in a fraction of the emission
//! interval gives back nearly all of it): what drained may have gone to other requests
//! meanwhile. The `login` example is a whole app.
//!
//! **A refused request consumes nothing, across stacked layers too.** A request that a
//! layer further in refuses (a route's own limit under a site-wide one) was charged by
//! the layers around it; its response carries [`Refused`], and they give their units back
//! (on by default; [`refund_refused(false)`](RateLimitLayerBuilder::refund_refused) keeps
//! the outer charge, and spares admitted requests the small allocation the refund would
//! need).
//!
//! gRPC: a call refused or failed at once is a trailers-only response, its `grpc-status`
//! in the head the predicate sees (`res.headers.get("grpc-status")`); a streamed call's
//! status comes in the trailers, after the predicate has run, and such a call counts.
//!
//! # Metered costs
//!
//! An LLM endpoint limits tokens per minute per API key, and a request's token count is
//! known only once the model has answered, often in the last event of a stream. The
//! layer reserves an estimate at the door (its [`cost`](RateLimitLayerBuilder::cost);
//! 0 is allowed: admitted while the key has a unit left) and settles the charge
//! to the actual cost once it is known, in one atomic store call
//! ([`Store::settle`](ratelimit_core::Store::settle)): an actual below the estimate gives
//! the difference back; an actual above it charges the excess **unconditionally**, as
//! debt the key repays before it is admitted again (its next refusal's `Retry-After`
//! covers it). The actual comes from the response head,
//! [`settle_with`](RateLimitLayerBuilder::settle_with) (or
//! [`settle_from_header`](RateLimitLayerBuilder::settle_from_header)), or from a
//! [`Usage`] in the request's extensions that the handler or its streaming body
//! reports to before the body ends ([`usage_extension(true)`](RateLimitLayerBuilder::usage_extension);
//! a handler extracting `usage: Usage` from a layer built without it is answered 500
//! with a body that says to turn it on, [`MissingUsage`]).
//!
//! ```
//! use axum::{body::Body, routing::post, Router};
//! use ratelimit_core::MemoryStore;
//! use ratelimit_tower::{HeaderKey, RateLimitLayer, Usage};
//!
//! let tokens = RateLimitLayer::builder(MemoryStore::new(), HeaderKey::new("x-api-key"))
//!     .rules("40000/min gcra name=tokens")?
//!     .namespace("tokens")
//!     .cost(|_: &http::Request<Body>| 500) // reserved at the door
//!     .usage_extension(true)
//!     .build()?;
//! let app: Router = Router::new()
//!     .route(
//!         "/v1/chat/completions",
//!         post(|usage: Usage| async move {
//!             // ... call the model, count what it answered ...
//!             usage.report(1_234);
//!             "answer"
//!         }),
//!     )
//!     .layer(tokens);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! **The bound.** With at most C requests of one key in flight, each costing at most A
//! and reserving an estimate E, the units charged in any window exceed the limit by at
//! most C × (A − E), and by nothing when E ≥ A: a request is admitted only while what
//! the key has been charged, settled requests at their actual and requests in flight at
//! their estimate, leaves room for its estimate, so the overshoot is what the requests
//! in flight at the last admission turn out to owe beyond their estimates. Debt then
//! holds the key back until it is repaid:
//!
//! * GCRA, the leaky bucket and the token bucket repay debt by time alone: over a long
//!   horizon the units charged never exceed the rate (plus the burst), however large
//!   the estimate errors. Prefer them for token budgets.
//! * The window algorithms (fixed window, sliding window counter, sliding log) hold debt
//!   within their window: what a window has not repaid when it ends is forgiven with it.
//!   Each window keeps the bound above, so over a long horizon the average exceeds the
//!   rate by at most C × (A − E) per period.
//!
//! **What a give-back keeps.** On GCRA, the token bucket and the leaky bucket, a settle
//! below the estimate gives back the difference less what refilled since the check
//! (which other requests may have taken meanwhile): what refilled while the request ran
//! stays charged, up to the whole difference. At `40000/min` that is 40,000 / 60 =
//! 666⅔ tokens per second (a token every 1,500 µs), counted from a clock reading just
//! before the check to the settle, so the check and the handler's work before the
//! stream count as well: a measure over a one-second stream sees a little more. An
//! estimate of 2,000 settled to 200 after a 1 s stream gives back 1,133⅓ tokens, not
//! 1,800: a key otherwise idle is left with its 200 in use as of the settle; a key
//! with other requests charged is left 666⅔ tokens fewer than had the door charged
//! 200. An estimate near the actual keeps this small.
//! The arithmetic is worked out in [`algo`](ratelimit_core::algo#settling-a-charge).
//!
//! One settle adds at most one period's limit of each rule
//! ([`debt_cap`](ratelimit_core::algo::debt_cap); and no more than
//! [`max_debt`](RateLimitLayerBuilder::max_debt)), so a hostile actual (`u64::MAX`)
//! locks a key out for about one period, not for years. A settle makes one store call
//! per request whose actual differs from its estimate, none otherwise; the response (or
//! the last frame of a streamed body) waits for it, so a client's next request sees the
//! settled state in its `RateLimit` field. A settle that fails leaves the estimate
//! charged with a `WARN` (at most every 10 s); a debt is retried once first. What an
//! outage does to estimates and settles: [while the store is down](#while-the-store-is-down).
//! The `llm_gateway`
//! example is a whole proxy: requests per minute, tokens per minute settled from the
//! model's JSON answer and from the last event of its streams.
//! # Requests in flight
//!
//! A `N concurrent` rule (`"100/min; 4 concurrent"`) limits a key's requests in flight,
//! fleet-wide when the store is shared. An admitted request holds a slot until its
//! response body ends or is dropped: the client went away, the handler panicked, or the
//! response future was cancelled before a response. The slot goes back in one store
//! call ([`Store::release`](ratelimit_core::Store::release)), and a store that fails it
//! is asked again three times within about a second, after which the slot frees itself
//! at its deadline (a `WARN` at most every 10 s says so). A store that batches takes the
//! release over ([`Store::release_detached`](ratelimit_core::Store::release_detached);
//! `RedisStore` does): it goes with the store's next call, with the same retries, and
//! the next request of the key through the same store is decided after it. On shutdown,
//! `RedisStore::flush` waits for the releases handed over. While the response runs the
//! layer renews the slot every third of the rule's `timeout`, so a stream longer than
//! the timeout keeps it. A slot taken from the fallback store is given back there (what
//! an outage does to slots: [while the store is down](#while-the-store-is-down)). A
//! concurrency refusal is an ordinary refusal: 429 (gRPC: `RESOURCE_EXHAUSTED`), its
//! `Retry-After` a hint (the earliest deadline of a held slot, at most a second); the
//! `RateLimit` fields describe the rate rules only.
//!
//! # While the store is down
//!
//! With [`FailurePolicy::Fallback`] a request whose store call fails or times out is
//! decided by a [`MemoryStore`](ratelimit_core::MemoryStore) local to the layer, under
//! the fallback rules: the layer's own ([`FailurePolicy::Fallback`] alone), each
//! instance's share ([`fallback_share(N)`](RateLimitLayerBuilder::fallback_share): every
//! limit, burst and capacity divided by N, rounded down), or rules of their own
//! ([`fallback_rules`](RateLimitLayerBuilder::fallback_rules)). Every request asks the
//! store first (a denial still in the deny cache aside), so the first one after the
//! store answers again is decided by the store, once what the fallback admitted for its
//! key is handed over ([switching back](#switching-back)).
//!
//! **Fields.** The fields describe the rules actually enforced. Each fallback rule's item
//! is named as the rule would be (a named rule keeps its name; an unnamed one is named by
//! its own limit, `25-per-1min@api`) with `/fallback` appended:
//!
//! ```text
//! RateLimit-Policy: "api/fallback";q=25;w=60
//! RateLimit: "api/fallback";r=24;t=60
//! ```
//!
//! A distinct name rather than an extra parameter: a client matches `RateLimit` items
//! to `RateLimit-Policy` items by name and ignores parameters it does not know, so under
//! the shared name it would take the share's `r` for the shared quota's. `/` is in no
//! rule name or layer tag, so no fallback item takes a shared rule's name. A refusal the
//! deny cache answers carries the fields of the store that refused (the fallback's, for
//! a denial by the fallback), and once the store answers, the shared items come back.
//!
//! **A cost the share cannot hold.** A request costing more than a rule grants at once
//! is refused with 413 before any store is asked. One that the layer's rules hold but the
//! fallback rules do not (30,000 against `40000/min` shared by 2) is refused with 503
//! ([`RejectReason::CostExceedsShare`]; gRPC `UNAVAILABLE`), the fallback's
//! `RateLimit-Policy`, and a body that says the shared store is unreachable. It is
//! admissible again once the store answers, which the layer cannot foresee: its
//! `Retry-After` is the period of the rule the share cannot hold, at most 10 s, since
//! outages last seconds (`RedisStore` tries to reconnect at least every 2 s) while a
//! rule's period may be a day. Nothing is charged.
//!
//! **Concurrency rules.** `fallback_share(N)` gives each instance `limit / N` slots
//! (`4 concurrent` shared by 4: one slot each) with the rule's timeout. A slot taken from
//! the fallback store is renewed and released there. Slots the store gave before the
//! outage are unknown to the fallback: a key holding all its slots in the store when it
//! fails can have as many again in flight from the instances' fallbacks. Their renewals
//! fail (`DEBUG`) and are tried again every third of the timeout; their releases are
//! tried four times within about 1.3 s, then left to their deadlines (`WARN`), so after
//! the outage the store holds them until then, and the key admits fewer at once. A slot
//! the store let expire meanwhile is found gone by its next renewal (`WARN`), and its
//! request runs on without one. Slots the fallback gave and that are still held when the
//! store answers again are handed to it ([switching back](#switching-back)).
//!
//! **Metered costs.** The estimate is reserved in the fallback store against the share,
//! and the request's settle goes where its charge went, whenever it comes: a charge made
//! by the fallback is settled in the fallback (a give-back there, or debt there of at
//! most one period of the share's limit per settle), also after the store is back; the
//! store never sees it, so debt run up during the outage is not repaid to the shared
//! limit. A charge the store made before the outage and settled during it fails like any
//! settle: the estimate stays charged (a `WARN` at most every 10 s); a debt is tried once
//! more, then lost. Refunds of charging by outcome follow the same path, and a refunded
//! `RateLimit` field is rewritten in the fallback's items.
//!
//! ## Switching back
//!
//! When the store answers again, each instance hands it what its fallback admitted
//! before the store decides those keys again, so that the limit holds across the
//! switch, also when the store restarted empty (the handover re-seeds it). Per key, the
//! layer keeps the time and units of each fallback admission (those closer together
//! than a sixty-fourth of the key's shortest period as one, at the later time; at most
//! 256 per key, the oldest merged into the next: counted longer, never shorter) and the
//! fallback's slots still held, for up to 100,000 keys (a `WARN` says when more are
//! not kept). A key is handed over by its next request, whose check waits for it (a
//! check of cost 0 first, while the store has not been seen answering since the last
//! fallback admission: during the outage that is the one call the check would have
//! been; then the handover's call; another request of the key meanwhile waits for it
//! too, at most the store timeout, else a second, and then follows the failure
//! policy), or, whichever comes first, by a background task that asks the store every
//! 100 ms whether it answers (a check of cost 0 on a pending key) and then hands every
//! pending key over, 64 at a time so that the store batches them. Per rule, what is
//! handed over is what still counts:
//!
//! * fixed window: the fallback's units in the current window (a closed window's count
//!   is gone from the store too);
//! * sliding window counter: those of the last period and one sub-window; sliding log:
//!   those of the last period. Charged now, they count a little longer than they would
//!   have, never shorter;
//! * token bucket, GCRA, leaky bucket: what has not drained, at the rate of the
//!   fallback's rule (the instance's share of the rate: the fleet's shares drain at most
//!   the whole rate together, so the instances' handovers add up to at least what the
//!   fleet's usage would have left in the store's bucket);
//! * concurrency: each slot still held is taken in the store whatever its limit
//!   ([`Store::take_slot`](ratelimit_core::Store::take_slot), which charges the key's
//!   rate rules one unit instead of the handover's debit); the request then holds both,
//!   and its renewals and release go to the store too. The store may then hold more
//!   than `N` slots of the key: it refuses the key's requests until fewer than `N` are
//!   held, so it never counts fewer requests in flight than are running. A slot the
//!   store cannot take that way (the key's state was written under other rules during
//!   the outage, or a server's module is older than the store) is taken by a check of
//!   one unit when the key has room, else stays local until its request ends (`WARN`).
//!
//! The units go in one charge per key, unconditionally
//! ([`Store::settle`](ratelimit_core::Store::settle) from 0: debt
//! where they pass the limit), of the most any rule of the key still counts: a shorter
//! rule may be charged more than its own count, so it refuses longer, never admits
//! more; units above what one charge takes ([`settle_cap`](ratelimit_core::algo::settle_cap))
//! go in several. A handover costs the store one call per key with usage, plus one per
//! slot still held, plus the probes: `BENCHMARKS.md` has the figures. Once every key is
//! handed over, one `INFO` line says what it took (`keys`, `units`, `slots`,
//! `store_calls`, `took_ms`); a handover that fails keeps the usage for the next try
//! (a charge that ran in the store but whose answer was lost is then charged twice: the
//! key refuses longer, never admits more).
//! What the fallback gave back (charging by outcome) is handed over still (it counts
//! more, never less); debt a settle ran up in the fallback is not.
//!
//! **The grace.** The instances return one by one, each when its own connection does,
//! and an instance back decides with the store while another still admits its share
//! locally, which the store cannot count until that instance hands it over. So for
//! [`fallback_grace`](RateLimitLayerBuilder::fallback_grace) (1 s by default) after an
//! instance last decided by its fallback, or after its store last regained a lost
//! connection ([`Store::recovered_at_us`](ratelimit_core::Store::recovered_at_us): a
//! `RedisStore` on one server or behind Sentinels; a Cluster's connection mends itself
//! unseen, so there only the fallback's decisions start it), a request the store admits
//! must fit the instance's share too: the share is asked first (in the fallback store,
//! in process), a request it refuses is refused with the share's fields (and not kept
//! in the deny cache), and what it took goes back when the store refuses. A request
//! admitted by both holds a slot in each, released together. Each instance thus leaves
//! the others' shares free until they are back, and the fleet admits no more than the
//! limit across the switch as long as its instances return within the grace of each
//! other (under traffic `RedisStore` cuts its reconnection pauses to at most 250 ms; in
//! `tests/recovery.rs` four instances were back 150 to 800 ms after Redis). A request whose cost
//! only the share cannot hold is decided by the store alone. The price: for the grace
//! after an outage, or after a single failed store call, an instance admits no more than
//! its share; `fallback_grace(Duration::ZERO)` switches it off.
//!
//! ## What a key may admit across an outage
//!
//! For one key, N instances with `fallback_share(N)`, and a rule of limit `L` per
//! period `P` (`r = L / P`; `B` the burst or capacity of a bucket): the store fails at
//! `t_down` and answers again at `t_up`; each instance switches back at its first store
//! call that succeeds after that (its own connection's return: `RedisStore` reconnects
//! with pauses growing to 2 s, cut to at most 250 ms while requests ask for the store,
//! so that the instances of a fleet under traffic return within about 250 ms of `t_up`
//! and of each other). Two terms bound what the fleet admits beyond the limit
//! in a window `W`:
//!
//! * **before(W)**, what the store admitted in `W` before `t_down`, when `W` holds
//!   `t_down`: the fallbacks start empty and cannot know it (at most `L`; 0 in every
//!   window that does not hold the outage's start). A store restarted empty forgets it
//!   too, and that is all it forgets: the handover gives it the rest back.
//! * **lag(W)**, what fallbacks admitted in `W` that the store had not been handed when
//!   it admitted in `W` for an instance past its grace: their admissions after `t_up`
//!   (an instance whose connection is not back yet decides by its fallback while the
//!   store decides for the others), and every fallback admission in `W` of an instance
//!   that switched back after such an admission (for a bucket, what drained before that
//!   instance's handover is not handed over at all). 0 when every instance that
//!   decides with the store after the outage does so within the grace (it decided by
//!   its fallback, or its connection was lost) and the instances switch back within the
//!   grace of each other; an instance adds at most its share per period while it lags (`BENCHMARKS.md` has the spread measured). Within the grace, an
//!   instance's store admissions are also its share's, so the fleet's shares still add
//!   up to the limit.
//!
//! Then, the fleet's admissions, counting both stores:
//!
//! | rule | over | at most |
//! |---|---|---|
//! | fixed window | each window | `L + before(W) + lag(W)` |
//! | sliding window counter (precision `p`) | each run of `p` aligned sub-windows | `L + before(W) + lag(W)` |
//! | sliding log | each interval of length `P` | `L + before(W) + lag(W)` |
//! | token bucket, GCRA, leaky bucket | each interval `W = [a, b]` | `B + r × (b − a) + before(W) + lag(W)` |
//! | `N concurrent` | each instant `t` | `N + before(t) + lag(t)` in flight |
//!
//! For a concurrency rule, `before(t)` is the store's requests from before the outage
//! still running at `t` and `lag(t)` the fallbacks' requests still running that were
//! admitted after `t_up`, or by an instance that switched back after the store first
//! admitted the key again for an instance past its grace, or whose slot the store could
//! not take at the handover (see above: not for want of room, which a take ignores). Once every instance has handed
//! over, a store that kept its data counts every request in flight (the slots taken
//! whatever the limit, and those from before the outage), so it admits a request only
//! while fewer than `N` run: only requests admitted before the last handover can keep
//! more than `N` in flight, and they only end. A store that came back empty has
//! forgotten `before(t)`, which then counts until those requests end.
//!
//! Without the handover, a window that holds `t_up` gets the limit again from the store
//! on top of what the fallbacks admitted in it: `L + fallback(W)`, up to `2L` (`100/10s`
//! shared by 4, Redis down 3 s across a window's start: 25 by the fallbacks, then 103
//! from the store). With it, a window that does not hold the outage's start admits at
//! most `L + lag(W)`. The deny cache changes none of this: it only refuses. The test
//! `tests/recovery.rs` runs four instances on one redis-server killed for 3 s (restarted
//! with its data and empty, on the module and on Lua), sweeps every window of `10/s`,
//! `100/min fixed-window`, `50/min sliding-window` and `4 concurrent` against these
//! bounds, and checks that the same runs with the handover switched off break them.
//!
//! No other limiter we know of hands an outage's usage over: rate-limiter-flexible's
//! insurance limiter, Envoy and limitador fail open or switch to local counters and back.
//!
//! # Limits per customer
//!
//! Tiers cover plans; a customer with a contract of its own (A 1,000/min, B 50/min,
//! thousands of them, edited in a database) is a resolver:
//! [`limits_for`](RateLimitLayerBuilder::limits_for) answers a client key's own rules, or
//! `None` for its tier's. It is handed the key as the client sent it and the extractor
//! that found it ([`ClientKey`]): behind `HeaderKey::new("x-api-key").or(PeerIp::new())`
//! an API key comes as the header's value and an address is never taken for an API key.
//! The answers are cached (100,000 customers for 60 s of the store's clock by default,
//! [`customer_cache`](RateLimitLayerBuilder::customer_cache)): a cached customer costs
//! the hot path one lock-free lookup, the resolver runs at most once per key per time to
//! live, and concurrent requests of an unknown key wait for one shared call. Every
//! refusal carries the fields of the rules that refused, a customer's own included,
//! also when the deny cache answers it. A customer
//! decides on its client's state in the tier it stands in, so its usage carries when its
//! contract changes; metrics keep the tier's labels, whatever the number of customers. A
//! resolver that fails or panics gives the tier's rules and a `WARN` (at most every 10 s).
//! While the store is down, a customer with rules of its own falls back on its share of
//! them, made as a tier's is (`fallback_share(4)` holds A to 250/min on each instance,
//! B to 12), or on the layer's `fallback_rules`; a share that rounds to 0 (a limit
//! below the number of instances) is 1 a period, so the fleet may admit up to that
//! number, the least a share can hold.
//!
//! # Waiting for a turn (outbound calls)
//!
//! Several instances of a service calling a partner API that allows 10 calls a second
//! together: each call should wait for its turn, not fail. [`ThrottleLayer`] puts a
//! client service (a hyper client, a tonic `Channel`, any `Service<Request>`) behind a
//! store's limits, and [`StoreExt::until_ready`](ratelimit_core::StoreExt::until_ready)
//! does the same without tower. With a shaping rule (`leaky-bucket mode=shaper`) a wait
//! is one store call and one sleep: the store hands each caller its own slot, fleet-wide
//! through Redis, with no retry loop and no thundering herd; with other rules the caller
//! sleeps until the units fit (with a jitter) and asks again. Whatever the algorithm, no
//! window of a rule's period sees more calls than its limit (a partner's count), unless
//! the rule asks for a burst above it. A call whose turn is further
//! away than the maximum wait fails with [`ThrottleError::TooLong`], saying how long it
//! would have waited, and is not charged. See the [`throttle`] module and the `outbound`
//! example (two processes sharing a Redis store).
//!
//! # gRPC
//!
//! The layer goes on a tonic server as it goes on an axum router:
//!
//! ```no_run
//! use ratelimit_core::MemoryStore;
//! use ratelimit_tower::{PeerIp, RateLimitLayer};
//! use std::sync::Arc;
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let store = Arc::new(MemoryStore::new());
//! let (_reporter, health) = tonic_health::server::health_reporter();
//! tonic::transport::Server::builder()
//!     .layer(RateLimitLayer::new(store, PeerIp::new(), "100/min".parse()?))
//!     .add_service(health)
//!     .serve("0.0.0.0:50051".parse()?)
//!     .await?;
//! # Ok(())
//! # }
//! ```
//!
//! * **Any body.** The service's response body is a [`ResponseBody`]: the inner
//!   service's body, or the layer's own bytes for a refusal. So the inner service may
//!   answer with any body type (tonic's does not convert from bytes), and axum's
//!   `Router::layer` / `route_layer` take the service as before.
//! * **The peer.** With the `tonic` feature, [`PeerIp`] (and [`ClientIp`], for the peer
//!   it starts from) read tonic's `TcpConnectInfo`. Without it a tonic server gives no
//!   peer address and every call is refused as misconfigured. (Behind TLS, tonic wraps it
//!   in `TlsConnectInfo`: insert the peer's `SocketAddr` into the extensions in a layer of
//!   your own.)
//! * **Refusals a gRPC client understands.** A request with content type
//!   `application/grpc` (or `application/grpc+proto`, `+json`, ...) is refused with a
//!   trailers-only response: HTTP 200, `content-type: application/grpc`, no body, and the
//!   status in the headers. An HTTP 429 would reach the client as UNAVAILABLE (grpcio,
//!   which commonly retries it at once) or INTERNAL (tonic). The
//!   [`on_rejection`](RateLimitLayerBuilder::on_rejection) hook is not asked: there is
//!   no body to build.
//!
//! | refusal | `grpc-status` |
//! |---|---|
//! | limited, shaping delay above the maximum, cost above capacity | 8 `RESOURCE_EXHAUSTED` |
//! | blocked | 8, or 7 `PERMISSION_DENIED` with [`BlockedStatus::Forbidden`] |
//! | store failed, [`FailurePolicy::FailClosed`]; or a cost above the fallback's share | 14 `UNAVAILABLE` |
//! | no key found (the server's misconfiguration) | 13 `INTERNAL` |
//! | the client left out its key (a header) | 3 `INVALID_ARGUMENT` |
//!
//! Besides `grpc-status`, a refusal carries `grpc-message` (the same sentence as the HTTP
//! body, percent-encoded as the gRPC spec requires), `RateLimit-Policy` and `RateLimit`
//! as metadata, and, when the call can succeed later, the delay twice:
//!
//! * `retry-after` metadata in whole seconds, as in HTTP: any client reads it with
//!   nothing but its metadata API (tonic's `Status::metadata`, grpcio's trailing
//!   metadata);
//! * a `google.rpc.RetryInfo` in `grpc-status-details-bin` (a base64 `google.rpc.Status`),
//!   exact to the nanosecond: the standard of Google's error model (AIP-193), which
//!   `tonic-types` (`StatusExt::get_details_retry_info`), `grpcio-status` and the Google
//!   client libraries decode and retry on.
//!
//! `grpc-retry-pushback-ms` is not sent: only gRPC's built-in retries read it, and only
//! for the codes a client's retry policy lists.
//!
//! An admitted call gets the rate-limit fields as initial metadata, and a shaping rule
//! delays a call as it delays any request (mind the client's deadline: a call delayed
//! past it ends `DEADLINE_EXCEEDED` at the client).
//!
//! # Handlers see the decision
//!
//! Built with [`admission_extension(true)`](RateLimitLayerBuilder::admission_extension),
//! every request the layer passes on carries an [`Admission`] in its extensions: whether
//! the store checked it ([`AdmittedBy`]: the store, the fallback store, or unchecked by
//! fail-open, an exempt key, a missing key admitted, shadow mode) and the rule nearest to
//! its limit ([`Binding`]: limit, remaining, reset). It is there under every policy, so
//! `admission: Admission` in an axum handler never fails because of one. With stacked
//! layers, the innermost one's. It is off by default, as an extensions entry costs every
//! request an allocation whether or not a handler reads it; a handler extracting an
//! `Admission` from a layer built without it is answered 500 with a body that says to
//! turn it on ([`MissingAdmission`]), and `Option<Admission>` extracts `None`.
//!
//! The store's whole [`Decision`](ratelimit_core::Decision) (every rule's outcome) is put
//! beside it for requests a store admitted when the layer is built with
//! [`decision_extension(true)`](RateLimitLayerBuilder::decision_extension); read it as
//! `Option<Extension<Decision>>`, since an unchecked request has none.
//!
//! # Testing your app
//!
//! Everything the layer keeps in time (its deny cache, the fallback store, the cache of
//! limits per customer) runs on the store's clock, so a [`MemoryStore`](ratelimit_core::MemoryStore) on a
//! [`ManualClock`](ratelimit_core::ManualClock) tests the app with the default settings:
//! no paused tokio time, nothing turned off. Build the app in a function generic over the
//! store: `main` passes the store it runs with (`Arc<MemoryStore>`, a `RedisStore`), a
//! test passes `MemoryStore<ManualClock>` (a different type from `MemoryStore`, whose
//! clock is the system's).
//!
//! ```
//! use axum::{body::Body, extract::ConnectInfo, routing::get, Router};
//! use http::{Request, StatusCode};
//! use ratelimit_core::{ManualClock, MemoryStore, Store};
//! use ratelimit_tower::{PeerIp, RateLimitLayer};
//! use std::{net::SocketAddr, time::Duration};
//! use tower::ServiceExt;
//!
//! /// The app, on any store.
//! fn app<S: Store>(store: S) -> Router {
//!     Router::new()
//!         .route("/", get(|| async { "hello" }))
//!         .layer(RateLimitLayer::new(store, PeerIp::new(), "10/min".parse().unwrap()))
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let clock = ManualClock::new(1_700_000_000_000_000);
//! let store: MemoryStore<ManualClock> = MemoryStore::builder().clock(clock.clone()).build();
//! let app = app(store);
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
//!   divides the limits among N instances so the fleet stays within them, and the
//!   fields say so ([while the store is down](#while-the-store-is-down)).
//! * **Shadow mode.** [`shadow`](RateLimitLayerBuilder::shadow) decides and reports (a
//!   `RateLimit-Shadow` field and an `INFO` event) but never refuses: for trying new
//!   limits on real traffic.
//! * **Observability.** `tracing` events with targets under `ratelimit_tower` (`WARN` for
//!   store failures, with the policy applied, at most every 10 s with a count; `DEBUG` for refusals and delays; `TRACE`
//!   for admissions), a `ratelimit_check` span (`DEBUG`) around each store round trip
//!   that does not complete at once, and, with the `metrics` feature, counters labelled
//!   by layer, tier and rule (see below).
//!
//! # Metrics
//!
//! With the `metrics` feature, each layer registers these counters when it is built and
//! when its limits are replaced (install the recorder first):
//!
//! | counter | labels |
//! |---|---|
//! | `ratelimit_admitted_total` | `layer`, `tier`, `rule` (each rule of the tier) |
//! | `ratelimit_limited_total` | `layer`, `tier`, `rule` (each rule that denied) |
//! | `ratelimit_blocked_total` | `layer`, `tier` |
//! | `ratelimit_store_errors_total` | `layer`, `tier`, `policy` (`fail_open`, `fail_closed`, `fallback`) |
//!
//! `layer` is the layer's namespace, `tier` the tier's name (`""` without tiers), `rule`
//! the rule's name or `<limit>-per-<period>`. The tier label is capped: the first 100
//! tier names a layer sees get labels of their own
//! ([`metrics_tier_labels`](RateLimitLayerBuilder::metrics_tier_labels) sets how many);
//! further tiers count under `tier="other"`, `rule="other"`, so the series stay bounded
//! whatever the limits hold.
//!
//! And one histogram, for stores that answer over the network (Redis): how long the
//! store took, from the call to its answer or failure (the store timeout included), per
//! request that reached it. A store that decides in process (`MemoryStore`) answers in
//! nanoseconds and is not timed, and a build without the feature measures nothing.
//!
//! | histogram | labels |
//! |---|---|
//! | `ratelimit_store_duration_seconds` | `layer`, `outcome` (`admitted`, `limited`, `blocked`, `error`) |
//!
//! Give the exporter [`STORE_DURATION_BUCKETS`] (50 µs to 1 s) for it. The 99th
//! percentile per layer over 5 minutes, in Prometheus:
//!
//! ```text
//! histogram_quantile(0.99,
//!   sum by (le, layer) (rate(ratelimit_store_duration_seconds_bucket[5m])))
//! ```
//!
//! and the share of store calls that failed:
//! `sum by (layer) (rate(ratelimit_store_duration_seconds_count{outcome="error"}[5m])) / sum by (layer) (rate(ratelimit_store_duration_seconds_count[5m]))`.
//!
//! # Cost
//!
//! The store is generic, not boxed. With a [`MemoryStore`](ratelimit_core::MemoryStore)
//! (or an `Arc` of one) the check runs synchronously inside `call` without a future;
//! other stores' checks are boxed futures (one allocation per request, small next to a
//! network round trip). An admitted request costs two allocations of the layer's own:
//! the `RateLimit` field and the decision placed in the request's extensions. Under
//! axum's `Router::layer` / `route_layer`, axum boxes the [`ResponseBody`] into its own
//! `Body`: one allocation more, the price of serving any inner body type.

// docs.rs builds with every feature and `--cfg docsrs`: badge items behind a feature.
#![cfg_attr(docsrs, feature(doc_cfg))]

// The README is the crates.io page: its examples must compile like the crate docs'.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

mod admission;
mod body;
mod charge;
mod cost;
mod customer;
mod deny_cache;
mod error;
mod fallback;
mod future;
mod grpc;
pub mod headers;
pub mod key;
mod layer;
mod limiter;
mod limits;
mod meter;
mod metrics;
mod namespace;
mod policy;
mod rejection;
mod service;
mod slot;
pub mod throttle;
mod tier;
mod usage;

#[cfg(feature = "axum")]
pub use admission::MissingAdmission;
pub use admission::{Admission, AdmittedBy, Binding};
pub use body::ResponseBody;
pub use charge::Refused;
pub use cost::{RequestCost, UnitCost};
pub use customer::{DEFAULT_CUSTOMER_CACHE, DEFAULT_CUSTOMER_TTL};
pub use deny_cache::DenyCacheConfig;
pub use error::BuildError;
pub use future::ResponseFuture;
pub use key::{
    ClientIp, ClientKey, Extraction, ForwardedHeader, GlobalKey, HeaderKey, Key, KeyConfigError,
    KeyExtractor, KeyExtractorExt, KeySource, PeerIp,
};
pub use layer::{RateLimitLayer, RateLimitLayerBuilder, DEFAULT_FALLBACK_GRACE, DEFAULT_MAX_DELAY};
pub use limits::{Change, Changes, Limits, LimitsFile, LimitsHandle, LoadError};
pub use metrics::{DEFAULT_METRICS_TIER_LABELS, STORE_DURATION_BUCKETS};
pub use policy::{FailurePolicy, MissingKey};
pub use rejection::{BlockedStatus, OnRejection, PlainText, ProblemJson, RejectReason, Rejection};
pub use service::RateLimit;
pub use throttle::{Throttle, ThrottleError, ThrottleLayer};
pub use tier::{OneTier, SelectTier};
#[cfg(feature = "axum")]
pub use usage::MissingUsage;
pub use usage::Usage;
