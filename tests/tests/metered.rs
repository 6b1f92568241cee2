//! Metered costs over real HTTP: the `llm_gateway` example (tokens per minute settled to
//! what the model answered, JSON and streams), and the stated bound under concurrency on
//! a real redis-server shared by two app instances.

use std::sync::Arc;

use ratelimit_core::{ManualClock, MemoryStore};
use ratelimit_e2e::{all, client, TestServer};
use ratelimit_examples::llm_gateway::{app, fake_model, CHAT};

const T0: u64 = 1_699_999_200_000_000;

async fn chat(server: &TestServer, key: &str, body: &str) -> reqwest::Response {
    client()
        .post(server.url(CHAT))
        .header("x-api-key", key)
        .header("content-type", "application/json")
        .body(body.to_owned())
        .send()
        .await
        .unwrap()
}

fn tokens_left(res: &reqwest::Response) -> u64 {
    let fields = all(res, "ratelimit");
    let tokens = fields
        .iter()
        .find(|f| f.starts_with("\"tokens\""))
        .unwrap_or_else(|| panic!("no tokens field in {fields:?}"));
    let r = tokens.split(";r=").nth(1).unwrap();
    r.split(';').next().unwrap().parse().unwrap()
}

/// Answers of 2,000 tokens against 40,000/min with 500 reserved at the door: 20 answered,
/// the 21st refused until the debt has drained; each response's field shows what the
/// requests before it were settled to.
#[tokio::test]
async fn the_gateway_charges_what_the_model_answered() {
    let clock = ManualClock::new(T0);
    let store = Arc::new(MemoryStore::builder().clock(clock.clone()).build());
    let server = TestServer::start(app(store, fake_model())).await;
    // 4 prompt words + 1,996 answered: 2,000 tokens.
    let call =
        r#"{"max_tokens": 1996, "messages": [{"role": "user", "content": "one two three four"}]}"#;
    for n in 0..20u64 {
        let res = chat(&server, "team-a", call).await;
        assert_eq!(res.status(), 200, "call {}", n + 1);
        // n answers settled at 2,000, this one's 500 reserved.
        assert_eq!(
            tokens_left(&res),
            40_000 - 2_000 * n - 500,
            "call {}",
            n + 1
        );
        let answer: serde_json::Value = serde_json::from_str(&res.text().await.unwrap()).unwrap();
        assert_eq!(answer["usage"]["total_tokens"], 2_000);
    }
    let refused = chat(&server, "team-a", call).await;
    assert_eq!(refused.status(), 429);
    // 40,000 used: 500 more need 500 × 60 s / 40,000 = 0.75 s of drain.
    assert_eq!(refused.headers()["retry-after"], "1");
    // Another key is unaffected.
    assert_eq!(chat(&server, "team-b", call).await.status(), 200);
    clock.advance(std::time::Duration::from_millis(750));
    assert_eq!(chat(&server, "team-a", call).await.status(), 200);
}

/// A streamed answer is settled from its last event, once, before the stream's end
/// reaches the client.
#[tokio::test]
async fn a_streamed_answer_is_settled_from_its_last_event() {
    let clock = ManualClock::new(T0);
    let store = Arc::new(MemoryStore::builder().clock(clock.clone()).build());
    let server = TestServer::start(app(store, fake_model())).await;
    let stream = r#"{"stream": true, "max_tokens": 3000, "messages": [{"role": "user", "content": "tell me"}]}"#;
    let res = chat(&server, "k", stream).await;
    assert_eq!(res.status(), 200);
    assert_eq!(tokens_left(&res), 40_000 - 500);
    let text = res.text().await.unwrap();
    assert!(text.contains("\"total_tokens\":3002"), "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"));
    let next = chat(&server, "k", r#"{"max_tokens": 1, "messages": []}"#).await;
    assert_eq!(tokens_left(&next), 40_000 - 3_002 - 500);
}

/// At most 4 calls of a key in flight: of 6 at once to a model that thinks for 300 ms, 4
/// are answered and 2 refused; once they have ended, the key is served again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_holds_four_calls_in_flight_per_key() {
    let store = Arc::new(MemoryStore::new());
    let server = Arc::new(TestServer::start(app(store, fake_model())).await);
    let slow = r#"{"think_ms": 300, "max_tokens": 10, "messages": []}"#;
    let calls: Vec<_> = (0..6)
        .map(|_| {
            let server = Arc::clone(&server);
            tokio::spawn(async move { chat(&server, "k", slow).await.status().as_u16() })
        })
        .collect();
    let mut statuses = Vec::new();
    for call in calls {
        statuses.push(call.await.unwrap());
    }
    statuses.sort_unstable();
    assert_eq!(statuses, [200, 200, 200, 200, 429, 429]);
    assert_eq!(chat(&server, "k", slow).await.status(), 200);
}

mod bound {
    //! The stated bound under concurrency, on a real redis-server shared by two app
    //! instances (two `RedisStore`s): with at most C requests in flight, each costing at
    //! most A against an estimate E, what GCRA admits in any span t is at most its burst
    //! plus the rate over t plus C × (A − E); over the run, the average stays at the rate.

    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    use axum::body::Body;
    use axum::http::Request;
    use axum::routing::get;
    use axum::Router;
    use ratelimit_redis::testing::{wait_connected, RedisServer};
    use ratelimit_redis::RedisStore;
    use ratelimit_tower::{HeaderKey, RateLimitLayer};
    use tower::ServiceExt;

    const LIMIT: u64 = 2_000; // per second, burst 2,000
    const C: u64 = 50;
    const E: u64 = 20;
    const A: u64 = 100;
    const RUN: Duration = Duration::from_secs(3);

    async fn instance(redis: &RedisServer) -> Router {
        let store = RedisStore::builder()
            .timeout(Duration::from_secs(5))
            .build(&redis.url())
            .await
            .unwrap();
        wait_connected(&store).await;
        let layer = RateLimitLayer::builder(store, HeaderKey::new("x-api-key"))
            .rules(&format!("{LIMIT}/s gcra name=tokens"))
            .unwrap()
            .namespace("bound")
            .cost(|_: &Request<Body>| E)
            .settle_from_header("x-usage")
            .build()
            .unwrap();
        Router::new()
            .route(
                "/",
                get(|req: Request<Body>| async move {
                    let actual = req.headers()["x-actual"].clone();
                    // Work of random length, so that settles interleave with checks.
                    let ms = actual.to_str().unwrap().parse::<u64>().unwrap() % 7;
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    ([("x-usage", actual)], "ok")
                }),
            )
            .layer(layer)
    }

    async fn run(redis: RedisServer) {
        let apps = [instance(&redis).await, instance(&redis).await];
        let start = Instant::now();
        // (ms since start at admission, actual) of every admitted request.
        let admitted = Arc::new(Mutex::new(Vec::new()));
        let refused = Arc::new(AtomicU64::new(0));
        let clients: Vec<_> = (0..C)
            .map(|i| {
                let app = apps[(i % 2) as usize].clone();
                let admitted = Arc::clone(&admitted);
                let refused = Arc::clone(&refused);
                tokio::spawn(async move {
                    let mut seed = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
                    while start.elapsed() < RUN {
                        seed ^= seed << 13;
                        seed ^= seed >> 7;
                        seed ^= seed << 17;
                        let actual = 1 + seed % A;
                        let req = Request::get("/")
                            .header("x-api-key", "tenant")
                            .header("x-actual", actual.to_string())
                            .body(Body::empty())
                            .unwrap();
                        let at = start.elapsed();
                        let res = app.clone().oneshot(req).await.unwrap();
                        match res.status().as_u16() {
                            200 => admitted.lock().unwrap().push((at, actual)),
                            429 => {
                                refused.fetch_add(1, Ordering::Relaxed);
                                tokio::time::sleep(Duration::from_millis(2)).await;
                            }
                            other => panic!("status {other}"),
                        }
                    }
                })
            })
            .collect();
        for client in clients {
            client.await.unwrap();
        }
        let admitted = admitted.lock().unwrap().clone();
        let total: u64 = admitted.iter().map(|(_, a)| a).sum();
        let (first, last) = (admitted[0].0, admitted.last().unwrap().0);
        let span = last.saturating_sub(first);
        // Each admission's time is read before its check, so a span measured here is at
        // most the store's plus one request's time; 100 ms of rate covers that.
        let slack = LIMIT / 10;
        let bound = |t: Duration| {
            LIMIT
                + u64::try_from(u128::from(LIMIT) * t.as_micros() / 1_000_000).unwrap()
                + C * (A - E)
                + slack
        };
        assert!(
            total <= bound(span),
            "{total} units admitted over {span:?}: more than the bound {}",
            bound(span)
        );
        // The bound in every 1 s span, not only the whole run's.
        for (i, &(from, _)) in admitted.iter().enumerate() {
            let within: u64 = admitted[i..]
                .iter()
                .take_while(|(at, _)| *at <= from + Duration::from_secs(1))
                .map(|(_, a)| a)
                .sum();
            assert!(
                within <= bound(Duration::from_secs(1)),
                "{within} in 1 s from {from:?}"
            );
        }
        // The limiter was the bottleneck: refusals, and admissions near the rate.
        let refused = refused.load(Ordering::Relaxed);
        assert!(
            refused > 100,
            "only {refused} refused: the load did not press the limit"
        );
        let rate = (total - LIMIT.min(total)) as f64 / span.as_secs_f64();
        assert!(
            rate > LIMIT as f64 * 0.5,
            "{rate:.0} units/s after the burst: far under the limit"
        );
        eprintln!(
            "{} admitted, {refused} refused, {total} units over {span:?}: {rate:.0}/s after \
             the burst, bound {}",
            admitted.len(),
            bound(span)
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_settles_stay_within_the_bound_on_lua() {
        run(RedisServer::start()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_settles_stay_within_the_bound_on_the_module() {
        run(RedisServer::start_with_module()).await;
    }
}
