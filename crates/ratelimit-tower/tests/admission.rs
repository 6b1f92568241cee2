//! With `admission_extension(true)`, every admitted request carries an `Admission`,
//! whatever admitted it: a handler that extracts it answers under every failure policy,
//! in shadow mode, for exempt keys and for missing keys admitted by policy. Without it
//! (the default), no request carries one.
#![cfg(feature = "axum")]

mod common;
use common::Down;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use axum::{Extension, Router};
use http::Request;
use http_body_util::BodyExt;
use ratelimit_core::{Decision, ManualClock, MemoryStore, Store};
use ratelimit_tower::{
    Admission, FailurePolicy, MissingKey, PeerIp, RateLimitLayer, RateLimitLayerBuilder,
};
use tower::ServiceExt;

const T0: u64 = 1_699_999_200_000_000;

/// What a handler sees: how the request was admitted, whether it was checked, the units
/// the binding rule has left, and whether the whole decision came with it.
async fn show(
    Extension(admission): Extension<Admission>,
    decision: Option<Extension<Decision>>,
) -> String {
    format!(
        "{:?} checked={} remaining={:?} decision={}",
        admission.by(),
        admission.is_checked(),
        admission.binding().map(|b| b.remaining),
        decision.is_some_and(|Extension(d)| d.is_allowed()),
    )
}

fn app<S: Store, K>(layer: RateLimitLayer<S, K>) -> Router
where
    K: ratelimit_tower::KeyExtractor<Body>,
{
    Router::new().route("/", get(show)).layer(layer)
}

fn from(ip: &str) -> Request<Body> {
    let mut req = Request::get("/").body(Body::empty()).unwrap();
    let addr: SocketAddr = format!("{ip}:40000").parse().unwrap();
    req.extensions_mut().insert(ConnectInfo(addr));
    req
}

/// The status and body of each of `requests`.
async fn answers(app: &Router, requests: impl IntoIterator<Item = Request<Body>>) -> Vec<String> {
    let mut out = Vec::new();
    for req in requests {
        let res = app.clone().oneshot(req).await.unwrap();
        let status = res.status().as_u16();
        let body = res.into_body().collect().await.unwrap().to_bytes();
        let body = String::from_utf8(body.to_vec()).unwrap();
        out.push(if status == 200 {
            body
        } else {
            status.to_string()
        });
    }
    out
}

fn memory() -> Arc<MemoryStore<ManualClock>> {
    Arc::new(MemoryStore::builder().clock(ManualClock::new(T0)).build())
}

fn down() -> Down {
    Down {
        clock: Some(ManualClock::new(T0)),
        ..Down::default()
    }
}

fn builder<S: Store>(store: S, rules: &str) -> RateLimitLayerBuilder<S, PeerIp> {
    RateLimitLayer::builder(store, PeerIp::new())
        .rules(rules)
        .unwrap()
        .namespace("admission")
        .admission_extension(true)
}

fn three(ip: &str) -> [Request<Body>; 3] {
    [from(ip), from(ip), from(ip)]
}

#[tokio::test]
async fn checked_requests_name_their_binding_rule() {
    let want = [
        "Store checked=true remaining=Some(1) decision=false",
        "Store checked=true remaining=Some(0) decision=false",
        "429",
    ];
    // In process; a store that answers through a future is `tests/redis.rs`'s (e2e).
    let now = app(builder(memory(), "2/min; 10/min").build().unwrap());
    assert_eq!(answers(&now, three("192.0.2.1")).await, want);
}

#[tokio::test]
async fn the_whole_decision_comes_with_it_on_request() {
    // Known at once (in process), and once a store's future has answered (the store
    // down, decided by the fallback store after it).
    let now = app(builder(memory(), "1/min")
        .decision_extension(true)
        .build()
        .unwrap());
    assert_eq!(
        answers(&now, [from("192.0.2.1"), from("192.0.2.1")]).await,
        ["Store checked=true remaining=Some(0) decision=true", "429"]
    );
    let later = app(builder(down(), "1/min")
        .failure_policy(FailurePolicy::Fallback)
        .decision_extension(true)
        .build()
        .unwrap());
    assert_eq!(
        answers(&later, [from("192.0.2.1"), from("192.0.2.1")]).await,
        [
            "Fallback checked=true remaining=Some(0) decision=true",
            "429"
        ]
    );
    // Off by default.
    let default = app(builder(memory(), "1/min").build().unwrap());
    assert_eq!(
        answers(&default, [from("192.0.2.1")]).await,
        ["Store checked=true remaining=Some(0) decision=false"]
    );
    // Unchecked: the admission, and no decision.
    let open = app(builder(down(), "1/min")
        .decision_extension(true)
        .build()
        .unwrap());
    assert_eq!(
        answers(&open, [from("192.0.2.1")]).await,
        ["FailOpen checked=false remaining=None decision=false"]
    );
}

#[tokio::test]
async fn every_failure_policy_with_the_store_down() {
    let open = app(builder(down(), "2/min").build().unwrap());
    assert_eq!(
        answers(&open, three("192.0.2.1")).await,
        ["FailOpen checked=false remaining=None decision=false"; 3]
    );
    let closed = app(builder(down(), "2/min")
        .failure_policy(FailurePolicy::FailClosed)
        .build()
        .unwrap());
    assert_eq!(answers(&closed, three("192.0.2.1")).await, ["503"; 3]);
    let fallback = app(builder(down(), "2/min")
        .failure_policy(FailurePolicy::Fallback)
        .build()
        .unwrap());
    assert_eq!(
        answers(&fallback, three("192.0.2.1")).await,
        [
            "Fallback checked=true remaining=Some(1) decision=false",
            "Fallback checked=true remaining=Some(0) decision=false",
            "429"
        ]
    );
    // A store that never answers, given up on after the store timeout.
    let hung = app(builder(
        Down {
            hang: true,
            ..down()
        },
        "2/min",
    )
    .store_timeout(Duration::from_millis(5))
    .build()
    .unwrap());
    assert_eq!(
        answers(&hung, [from("192.0.2.1")]).await,
        ["FailOpen checked=false remaining=None decision=false"]
    );
}

#[tokio::test]
async fn shadow_mode_passes_with_what_would_have_happened() {
    let shadow = app(builder(memory(), "1/min").shadow(true).build().unwrap());
    assert_eq!(
        answers(&shadow, three("192.0.2.1")).await,
        [
            "Store checked=true remaining=Some(0) decision=false",
            "Shadow checked=false remaining=Some(0) decision=false",
            "Shadow checked=false remaining=Some(0) decision=false",
        ]
    );
    let closed = app(builder(down(), "1/min")
        .failure_policy(FailurePolicy::FailClosed)
        .shadow(true)
        .build()
        .unwrap());
    assert_eq!(
        answers(&closed, [from("192.0.2.1")]).await,
        ["Shadow checked=false remaining=None decision=false"]
    );
}

#[tokio::test]
async fn exempt_and_missing_keys_admitted_by_policy() {
    let exempt = app(RateLimitLayer::builder(
        memory(),
        PeerIp::new().exempt(["10.0.0.0/8"]).unwrap(),
    )
    .rules("1/min")
    .unwrap()
    .namespace("admission")
    .admission_extension(true)
    .build()
    .unwrap());
    assert_eq!(
        answers(&exempt, three("10.1.2.3")).await,
        ["Exempt checked=false remaining=None decision=false"; 3]
    );
    let admit = app(builder(memory(), "1/min")
        .on_missing_key(MissingKey::Admit)
        .build()
        .unwrap());
    let bare = || Request::get("/").body(Body::empty()).unwrap();
    assert_eq!(
        answers(&admit, [bare(), bare()]).await,
        ["MissingKey checked=false remaining=None decision=false"; 2]
    );
    // Refused by default: no handler runs.
    let refuse = app(builder(memory(), "1/min").build().unwrap());
    assert_eq!(answers(&refuse, [bare()]).await, ["500"]);
}

#[tokio::test(start_paused = true)]
async fn a_shaped_request_knows_its_delay() {
    let store = memory();
    let layer = builder(store, "1/s leaky-bucket mode=shaper burst=2 delay=0")
        .build()
        .unwrap();
    let app = Router::new()
        .route(
            "/",
            get(|Extension(a): Extension<Admission>| async move {
                format!("{:?} {:?}", a.by(), a.delay())
            }),
        )
        .layer(layer);
    let got = answers(&app, [from("192.0.2.1"), from("192.0.2.1")]).await;
    assert_eq!(got, ["Store 0ns", "Store 1s"]);
}

/// What a handler that asks whether there is an admission sees.
async fn maybe(
    admission: Option<Extension<Admission>>,
    decision: Option<Extension<Decision>>,
) -> String {
    format!(
        "admission={:?} decision={}",
        admission.map(|Extension(a)| a.by()),
        decision.is_some(),
    )
}

#[tokio::test]
async fn no_admission_unless_asked_for() {
    let bare = || {
        RateLimitLayer::builder(memory(), PeerIp::new().exempt(["10.0.0.0/8"]).unwrap())
            .rules("1/min")
            .unwrap()
            .namespace("admission")
    };
    // Checked by the store, exempt, and in shadow mode past a refusal.
    assert_eq!(
        answers(
            &app_of(bare(), maybe),
            [from("192.0.2.1"), from("10.1.2.3")]
        )
        .await,
        ["admission=None decision=false"; 2]
    );
    assert_eq!(
        answers(
            &app_of(bare().shadow(true), maybe),
            [from("192.0.2.1"), from("192.0.2.1")]
        )
        .await,
        ["admission=None decision=false"; 2]
    );
    // The store down, failing open; the decision alone when only it is asked for.
    let open = app_of(builder(down(), "1/min").admission_extension(false), maybe);
    assert_eq!(
        answers(&open, [from("192.0.2.1")]).await,
        ["admission=None decision=false"]
    );
    let decision = app_of(
        builder(memory(), "1/min")
            .admission_extension(false)
            .decision_extension(true),
        maybe,
    );
    assert_eq!(
        answers(&decision, [from("192.0.2.1")]).await,
        ["admission=None decision=true"]
    );
    // A handler that requires it is answered 500 by axum, not run without it.
    let required = app_of(builder(memory(), "1/min").admission_extension(false), show);
    assert_eq!(answers(&required, [from("192.0.2.1")]).await, ["500"]);
    // Extracted as `Admission`: the 500's body says what to change; as
    // `Option<Admission>`, none; with the option on, the admission.
    let direct = |enabled: bool| {
        app_of(
            builder(memory(), "1/min").admission_extension(enabled),
            |admission: Admission| async move { format!("{:?}", admission.by()) },
        )
    };
    let res = direct(false).oneshot(from("192.0.2.1")).await.unwrap();
    assert_eq!(res.status(), 500);
    let body = res.into_body().collect().await.unwrap().to_bytes();
    let body = String::from_utf8(body.to_vec()).unwrap();
    assert!(body.contains(".admission_extension(true)"), "{body}");
    assert_eq!(answers(&direct(true), [from("192.0.2.1")]).await, ["Store"]);
    let optional = |enabled: bool| {
        app_of(
            builder(memory(), "1/min").admission_extension(enabled),
            |admission: Option<Admission>| async move { format!("{:?}", admission.map(|a| a.by())) },
        )
    };
    assert_eq!(
        answers(&optional(false), [from("192.0.2.1")]).await,
        ["None"]
    );
    assert_eq!(
        answers(&optional(true), [from("192.0.2.1")]).await,
        ["Some(Store)"]
    );
}

fn app_of<S: Store, H, T>(builder: RateLimitLayerBuilder<S, PeerIp>, handler: H) -> Router
where
    H: axum::handler::Handler<T, ()>,
    T: 'static,
{
    Router::new()
        .route("/", get(handler))
        .layer(builder.build().unwrap())
}
