//! Real HTTP against app instances that share a real redis-server (started here on a free
//! port; the test fails if it cannot start).

use std::time::{Duration, Instant};

use axum::routing::get;
use axum::{Extension, Router};
use ratelimit_e2e::{client, one, TestServer};
use ratelimit_redis::testing::{wait_connected, RedisServer};
use ratelimit_redis::RedisStore;
use ratelimit_tower::{Admission, FailurePolicy, GlobalKey, PeerIp, RateLimitLayer};

const STORE_TIMEOUT: Duration = Duration::from_millis(200);

async fn instance(url: &str, rules: &str, policy: FailurePolicy) -> TestServer {
    instance_and_store(url, rules, policy).await.0
}

async fn instance_and_store(
    url: &str,
    rules: &str,
    policy: FailurePolicy,
) -> (TestServer, RedisStore) {
    let store = RedisStore::builder()
        .timeout(STORE_TIMEOUT)
        .build(url)
        .await
        .expect("connect to the test redis-server");
    wait_connected(&store).await;
    let layer = RateLimitLayer::builder(store.clone(), PeerIp::new())
        .namespace("e2e-instance")
        .rules(rules)
        .unwrap()
        .failure_policy(policy)
        // Every request goes to the store: these tests are about the store.
        .without_deny_cache()
        .build()
        .unwrap();
    let server = TestServer::start(
        Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(layer),
    )
    .await;
    (server, store)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_share_one_limit() {
    const LIMIT: usize = 25;
    let redis = RedisServer::start();
    // An exact rule (sliding log over an hour), so the sum cannot drift at a boundary.
    let rules = format!("{LIMIT}/h sliding-log");
    let a = instance(&redis.url(), &rules, FailurePolicy::FailClosed).await;
    let b = instance(&redis.url(), &rules, FailurePolicy::FailClosed).await;
    let http = client();

    // Both instances hammered at once.
    let mut tasks = Vec::new();
    for i in 0..4 * LIMIT {
        let url = if i % 2 == 0 { a.url("/") } else { b.url("/") };
        let http = http.clone();
        tasks.push(tokio::spawn(async move {
            http.get(url).send().await.unwrap().status().as_u16()
        }));
    }
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.push(t.await.unwrap());
    }
    let admitted = statuses.iter().filter(|&&s| s == 200).count();
    let limited = statuses.iter().filter(|&&s| s == 429).count();
    assert_eq!(admitted, LIMIT, "{statuses:?}");
    assert_eq!(limited, 3 * LIMIT);

    // Each instance reports the shared count.
    let res = http.get(a.url("/")).send().await.unwrap();
    assert_eq!(res.status(), 429);
    assert!(one(&res, "ratelimit").unwrap().contains(";r=0;"));
}

/// Redis stopped (connections refused) and Redis frozen (connections open, no answer):
/// each policy does what it says, and answers within the store timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_policies_when_redis_is_gone() {
    let mut redis = RedisServer::start();
    let rules = "2/h sliding-log";
    let open = instance(&redis.url(), rules, FailurePolicy::FailOpen).await;
    let (closed, closed_store) =
        instance_and_store(&redis.url(), rules, FailurePolicy::FailClosed).await;
    let fallback = instance(&redis.url(), rules, FailurePolicy::Fallback).await;
    let http = client();

    // Healthy: one client key and one rule set in one Redis, so the three instances
    // share one budget.
    let mut healthy = Vec::new();
    for server in [&open, &closed, &fallback] {
        healthy.push(
            http.get(server.url("/"))
                .send()
                .await
                .unwrap()
                .status()
                .as_u16(),
        );
    }
    assert_eq!(healthy, [200, 200, 429]);

    for outage in ["frozen", "stopped"] {
        match outage {
            "frozen" => redis.pause(),
            _ => {
                redis.resume();
                redis.stop();
            }
        }
        let timed = |url: String| {
            let http = http.clone();
            async move {
                let start = Instant::now();
                let res = http.get(url).send().await.unwrap();
                let took = start.elapsed();
                assert!(
                    took < STORE_TIMEOUT + Duration::from_millis(300),
                    "{outage}: answered after {took:?}"
                );
                res
            }
        };
        for _ in 0..3 {
            let res = timed(open.url("/")).await;
            assert_eq!(res.status(), 200, "{outage}: fail open admits");
            assert!(one(&res, "ratelimit").is_none());
            let res = timed(closed.url("/")).await;
            assert_eq!(res.status(), 503, "{outage}: fail closed refuses");
        }
        // The fallback enforces the same rules locally, from a fresh count.
        let mut local = Vec::new();
        for _ in 0..3 {
            local.push(timed(fallback.url("/")).await.status().as_u16());
        }
        if outage == "frozen" {
            assert_eq!(local, [200, 200, 429], "{outage}: fallback limits locally");
        } else {
            // The local store kept its count from the first outage.
            assert_eq!(local, [429, 429, 429], "{outage}: fallback limits locally");
        }
    }

    // Back up (and empty): decisions come from Redis again, on fresh connections, once
    // the store has reconnected by itself.
    redis.restart();
    wait_connected(&closed_store).await;
    let mut back = Vec::new();
    for _ in 0..3 {
        back.push(
            http.get(closed.url("/"))
                .send()
                .await
                .unwrap()
                .status()
                .as_u16(),
        );
    }
    assert_eq!(back, [200, 200, 429]);
}

/// The limit is per rule set in Redis: a global key shared by every client.
#[tokio::test]
async fn global_key_through_redis() {
    let redis = RedisServer::start();
    let store = RedisStore::connect(&redis.url()).await.unwrap();
    wait_connected(&store).await;
    let layer = RateLimitLayer::builder(store, GlobalKey)
        .namespace("e2e-global")
        .rules("3/h sliding-log name=global")
        .unwrap()
        .build()
        .unwrap();
    let server = TestServer::start(
        Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(layer),
    )
    .await;
    let http = client();
    let mut statuses = Vec::new();
    for _ in 0..5 {
        let res = http.get(server.url("/")).send().await.unwrap();
        statuses.push(res.status().as_u16());
        if res.status() == 429 {
            assert_eq!(one(&res, "retry-after").as_deref(), Some("3600"));
        }
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429]);
}

/// What a handler that extracts the layer's `Admission` answers.
async fn admission_handler(Extension(admission): Extension<Admission>) -> String {
    format!(
        "{:?} checked={} remaining={:?}",
        admission.by(),
        admission.is_checked(),
        admission.binding().map(|b| b.remaining)
    )
}

/// Redis stopped: a handler that extracts the `Admission` answers under every policy that
/// admits (fail-open, the fallback store, shadow mode), never a 500 for a missing
/// extension; fail-closed refuses before the handler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handlers_extract_the_admission_with_redis_stopped() {
    let mut redis = RedisServer::start();
    let store = RedisStore::builder()
        .timeout(STORE_TIMEOUT)
        .build(&redis.url())
        .await
        .expect("connect to the test redis-server");
    wait_connected(&store).await;
    let server = |policy: FailurePolicy, shadow: bool| {
        let layer = RateLimitLayer::builder(store.clone(), PeerIp::new())
            .namespace("e2e-admission")
            .rules("2/h sliding-log")
            .unwrap()
            .failure_policy(policy)
            .shadow(shadow)
            .admission_extension(true)
            .build()
            .unwrap();
        TestServer::start(
            Router::new()
                .route("/", get(admission_handler))
                .layer(layer),
        )
    };
    let open = server(FailurePolicy::FailOpen, false).await;
    let closed = server(FailurePolicy::FailClosed, false).await;
    let fallback = server(FailurePolicy::Fallback, false).await;
    let shadow = server(FailurePolicy::FailClosed, true).await;
    let http = client();
    let answer = |url: String| {
        let http = http.clone();
        async move {
            let res = http.get(url).send().await.unwrap();
            let status = res.status().as_u16();
            let text = res.text().await.unwrap();
            if status == 200 {
                text
            } else {
                status.to_string()
            }
        }
    };

    // Healthy: decided by Redis.
    assert_eq!(
        answer(open.url("/")).await,
        "Store checked=true remaining=Some(1)"
    );

    redis.stop();
    for _ in 0..2 {
        assert_eq!(
            answer(open.url("/")).await,
            "FailOpen checked=false remaining=None"
        );
        assert_eq!(answer(closed.url("/")).await, "503");
        assert_eq!(
            answer(shadow.url("/")).await,
            "Shadow checked=false remaining=None"
        );
    }
    let mut local = Vec::new();
    for _ in 0..3 {
        local.push(answer(fallback.url("/")).await);
    }
    assert_eq!(
        local,
        [
            "Fallback checked=true remaining=Some(1)",
            "Fallback checked=true remaining=Some(0)",
            "429"
        ]
    );
}
