//! The rate-limit fields as a client reads them: parsed with an independent Structured
//! Field Values parser (RFC 9651, the `sfv` crate), not compared as text.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use http::{HeaderMap, Request, StatusCode};
use ratelimit_core::{ManualClock, MemoryStore};
use ratelimit_tower::{GlobalKey, RateLimitLayer};
use tower::ServiceExt;

/// One list item: its name and its integer parameters.
type Item = (String, BTreeMap<String, i64>);

/// The items of the list field `name`, over all of its lines, as RFC 9651 reads them.
fn items(headers: &HeaderMap, name: &str) -> Vec<Item> {
    let mut list = sfv::List::new();
    for line in headers.get_all(name) {
        sfv::Parser::new(line.as_bytes())
            .parse_list_with_visitor(&mut list)
            .unwrap_or_else(|e| panic!("{name}: {line:?} is not an sf-list: {e}"));
    }
    list.into_iter()
        .map(|entry| match entry {
            sfv::ListEntry::Item(item) => {
                let name = item.bare_item.as_string().expect("an sf-string name");
                let params = item
                    .params
                    .iter()
                    .map(|(k, v)| {
                        let v = v.as_integer().unwrap_or_else(|| panic!("{k:?} = {v:?}"));
                        (k.as_str().to_owned(), i64::from(v))
                    })
                    .collect();
                (name.as_str().to_owned(), params)
            }
            inner @ sfv::ListEntry::InnerList(_) => panic!("{name}: an inner list {inner:?}"),
        })
        .collect()
}

/// What a client may rely on: unique names, one `RateLimit` item per policy, integer
/// parameters, `r` within `q`, `w` at least 1 s when given.
fn check(headers: &HeaderMap) -> (BTreeMap<String, BTreeMap<String, i64>>, Vec<Item>) {
    let policies = items(headers, "ratelimit-policy");
    let names: BTreeSet<&str> = policies.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names.len(), policies.len(), "names repeat: {policies:?}");
    let policies: BTreeMap<String, BTreeMap<String, i64>> = policies.into_iter().collect();
    let limits = items(headers, "ratelimit");
    assert_eq!(
        limits.len(),
        policies.len(),
        "{limits:?} against {policies:?}"
    );
    for (name, params) in &limits {
        let policy = &policies[name];
        assert!(params["r"] >= 0 && params["t"] >= 0, "{name}: {params:?}");
        assert!(
            params["r"] <= policy["q"],
            "{name}: r above q: {params:?} {policy:?}"
        );
        if let Some(w) = policy.get("w") {
            assert!(*w >= 1, "{name}: {policy:?}");
        }
    }
    (policies, limits)
}

fn store() -> (ManualClock, Arc<MemoryStore<ManualClock>>) {
    // On a whole hour, 20 s in: windows are partly used.
    let clock = ManualClock::new(1_699_999_200_000_000 + 20_000_000);
    (
        clock.clone(),
        Arc::new(MemoryStore::builder().clock(clock).build()),
    )
}

async fn send(app: &Router) -> http::Response<Body> {
    app.clone()
        .oneshot(Request::get("/").body(Body::empty()).unwrap())
        .await
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn stacked_layers_with_the_same_rules_announce_items_a_client_can_tell_apart() {
    let (_, store) = store();
    // Built in two places: two namespaces, two budgets.
    let login = RateLimitLayer::new(
        store.clone(),
        GlobalKey,
        "10/min; 5/min name=login".parse().unwrap(),
    );
    let site = RateLimitLayer::new(store, GlobalKey, "10/min; 100/h".parse().unwrap());
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(login)
        .layer(site);
    let res = send(&app).await;
    assert_eq!(res.status(), StatusCode::OK);
    let (policies, limits) = check(res.headers());
    assert_eq!(policies.len(), 4, "{policies:?}");
    assert!(
        policies.contains_key("login"),
        "named rules keep their name"
    );
    assert_eq!(limits.len(), 4);
}

#[tokio::test(start_paused = true)]
async fn remaining_stays_within_quota_for_bursty_rules() {
    let (_, store) = store();
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        RateLimitLayer::builder(store, GlobalKey)
            .rules(
                "2/s leaky-bucket mode=shaper burst=10; 4/s token-bucket capacity=9; \
                 2/s gcra burst=6",
            )
            .unwrap()
            .build()
            .unwrap(),
    );
    for _ in 0..3 {
        let res = send(&app).await;
        assert_eq!(res.status(), StatusCode::OK);
        check(res.headers());
    }
}

#[tokio::test(start_paused = true)]
async fn windows_that_are_not_whole_seconds_are_never_announced_longer() {
    let (_, store) = store();
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        RateLimitLayer::builder(store, GlobalKey)
            .rules("3/1500ms fixed-window name=a; 2/500ms sliding-log name=b; 5/2s name=c")
            .unwrap()
            .build()
            .unwrap(),
    );
    let res = send(&app).await;
    let (policies, _) = check(res.headers());
    assert_eq!(policies["a"].get("w"), None, "{policies:?}");
    assert_eq!(policies["b"].get("w"), None, "{policies:?}");
    assert_eq!(policies["c"]["w"], 2);
}

#[tokio::test(start_paused = true)]
async fn sliding_windows_reset_within_the_documented_bound() {
    let (clock, store) = store();
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        RateLimitLayer::builder(store, GlobalKey)
            .rules(
                "10/min sliding-window precision=1 name=p1; \
                 10/min sliding-window precision=4 name=p4; 10/min sliding-log name=log",
            )
            .unwrap()
            .build()
            .unwrap(),
    );
    for _ in 0..60 {
        let res = send(&app).await;
        let (policies, limits) = check(res.headers());
        for (name, params) in limits {
            let w = policies[&name]["w"];
            let bound = match name.as_str() {
                "p1" => 2 * w,
                "p4" => w + w / 4,
                _ => w,
            };
            assert!(
                params["t"] <= bound,
                "{name}: t={} above {bound}",
                params["t"]
            );
        }
        clock.advance(Duration::from_secs(3));
    }
}

/// A response whose units went back shows its quota whole, and a whole quota has nothing
/// to wait for: `t` is 0, for every algorithm.
#[tokio::test(start_paused = true)]
async fn a_refunded_response_shows_a_whole_quota_with_nothing_to_wait_for() {
    for algorithm in [
        "fixed-window",
        "sliding-window precision=3",
        "sliding-log",
        "gcra",
        "token-bucket",
        "leaky-bucket",
    ] {
        let (_, store) = store();
        let app = Router::new()
            .route("/ok", get(|| async { "welcome" }))
            .route("/fail", get(|| async { StatusCode::UNAUTHORIZED }))
            .layer(
                RateLimitLayer::builder(store, GlobalKey)
                    .rules(&format!("5/15min {algorithm} name=failed-logins"))
                    .unwrap()
                    // Only failed logins count.
                    .charge_when(|res: &http::response::Parts| !res.status.is_success())
                    .build()
                    .unwrap(),
            );
        let get = |path: &'static str| {
            app.clone()
                .oneshot(Request::get(path).body(Body::empty()).unwrap())
        };
        let ok = get("/ok").await.unwrap();
        let (_, limits) = check(ok.headers());
        assert_eq!(
            limits,
            [(
                "failed-logins".to_owned(),
                [("r".to_owned(), 5), ("t".to_owned(), 0)].into()
            )],
            "{algorithm}: the unit went back"
        );
        let failed = get("/fail").await.unwrap();
        let (_, limits) = check(failed.headers());
        assert_eq!(limits[0].1["r"], 4, "{algorithm}: a failure counts");
        assert!(limits[0].1["t"] > 0, "{algorithm}: {limits:?}");
    }
}
