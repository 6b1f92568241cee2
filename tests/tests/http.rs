//! Real HTTP over loopback against a real axum server, state in a MemoryStore with a
//! manual clock so that every field value is exact.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;
use ratelimit_core::{ManualClock, MemoryStore};
use ratelimit_e2e::{all, client, one, TestServer};
use ratelimit_tower::{ClientIp, ForwardedHeader, GlobalKey, PeerIp, RateLimitLayer};

/// Aligned to the hour, so fixed windows start here.
const T0: u64 = 1_699_999_200_000_000;

fn store() -> (ManualClock, Arc<MemoryStore<ManualClock>>) {
    let clock = ManualClock::new(T0);
    let store = Arc::new(MemoryStore::builder().clock(clock.clone()).build());
    (clock, store)
}

/// The quickstart's shape: `GET /` per IP, `POST /login` with two rules, plus a site-wide
/// per-IP rule around both.
fn site(store: Arc<MemoryStore<ManualClock>>) -> Router {
    let home = RateLimitLayer::builder(store.clone(), PeerIp::new())
        .rules("10/min fixed-window name=per-ip")
        .unwrap()
        .build()
        .unwrap();
    let login = RateLimitLayer::builder(store.clone(), PeerIp::new())
        .rules("1/s fixed-window name=login-1s; 5/min fixed-window name=login-5min")
        .unwrap()
        // The tests move the store's manual clock, not the deny cache's (tokio's) clock.
        .without_deny_cache()
        .build()
        .unwrap();
    let site = RateLimitLayer::builder(store, PeerIp::new())
        .rules("100/h fixed-window name=site")
        .unwrap()
        .build()
        .unwrap();
    Router::new()
        .route("/", get(|| async { "home" }).layer(home))
        .route("/login", post(|| async { "welcome" }).layer(login))
        .layer(site)
}

#[tokio::test]
async fn statuses_and_fields_exactly_as_specified() {
    let (clock, store) = store();
    clock.advance(Duration::from_millis(12_250));
    let server = TestServer::start(site(store)).await;
    let http = client();

    for i in 0..10u64 {
        let res = http.get(server.url("/")).send().await.unwrap();
        assert_eq!(res.status(), 200);
        assert_eq!(
            all(&res, "ratelimit-policy"),
            [r#""per-ip";q=10;w=60"#, r#""site";q=100;w=3600"#]
        );
        assert_eq!(
            all(&res, "ratelimit"),
            [
                format!(r#""per-ip";r={};t=48"#, 9 - i),
                format!(r#""site";r={};t=3588"#, 99 - i)
            ]
        );
        assert_eq!(one(&res, "retry-after"), None);
        assert_eq!(res.text().await.unwrap(), "home");
    }
    let res = http.get(server.url("/")).send().await.unwrap();
    assert_eq!(res.status(), 429);
    // 47.75 s left in the minute: rounded up.
    assert_eq!(one(&res, "retry-after").as_deref(), Some("48"));
    assert_eq!(
        all(&res, "ratelimit"),
        [r#""per-ip";r=0;t=48"#, r#""site";r=90;t=3588"#]
    );
    assert_eq!(
        one(&res, "content-type").as_deref(),
        Some("text/plain; charset=utf-8")
    );
    assert_eq!(
        res.text().await.unwrap(),
        "rate limit exceeded, retry in 48 s\n"
    );
}

#[tokio::test]
async fn rules_stack_per_route() {
    let (clock, store) = store();
    let server = TestServer::start(site(store)).await;
    let http = client();

    let res = http.post(server.url("/login")).send().await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(
        all(&res, "ratelimit-policy"),
        [
            r#""login-1s";q=1;w=1, "login-5min";q=5;w=60"#,
            r#""site";q=100;w=3600"#
        ]
    );
    let res = http.post(server.url("/login")).send().await.unwrap();
    assert_eq!(res.status(), 429);
    assert_eq!(one(&res, "retry-after").as_deref(), Some("1"));

    // One login per second, five per minute; the home page is counted separately.
    let mut admitted = 1;
    for _ in 0..10 {
        clock.advance(Duration::from_secs(1));
        if http
            .post(server.url("/login"))
            .send()
            .await
            .unwrap()
            .status()
            == 200
        {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 5);
    let res = http.get(server.url("/")).send().await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(
        all(&res, "ratelimit")[1],
        // 6 requests count for the site rule: 5 logins admitted and this one (the 7
        // that /login's rules refused gave the site's units back).
        r#""site";r=94;t=3590"#
    );
}

#[tokio::test]
async fn spoofed_forwarded_for_from_an_untrusted_peer_does_not_change_the_key() {
    let (_, store) = store();
    let layer = RateLimitLayer::builder(store.clone(), ClientIp::trusting(["10.0.0.0/8"]).unwrap())
        .rules("3/min fixed-window")
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
    // The test client (127.0.0.1) is not a trusted proxy: every request is its own.
    let mut statuses = Vec::new();
    for i in 0..6 {
        let res = http
            .get(server.url("/"))
            .header("x-forwarded-for", format!("203.0.113.{i}"))
            .send()
            .await
            .unwrap();
        statuses.push(res.status().as_u16());
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429, 429]);
}

#[tokio::test]
async fn behind_a_trusted_proxy_the_rightmost_untrusted_hop_is_the_key() {
    let (_, store) = store();
    for header in [ForwardedHeader::XForwardedFor, ForwardedHeader::Forwarded] {
        let layer = RateLimitLayer::builder(
            store.clone(),
            ClientIp::trusting(["127.0.0.1", "10.0.0.0/8"])
                .unwrap()
                .header(header),
        )
        .rules("2/min fixed-window")
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
        let send = |spoof: &str, client_ip: &str| {
            let (name, value) = match header {
                ForwardedHeader::XForwardedFor => {
                    ("x-forwarded-for", format!("{spoof}, {client_ip}, 10.0.0.7"))
                }
                ForwardedHeader::Forwarded => (
                    "forwarded",
                    format!("for={spoof}, for={client_ip}, for=10.0.0.7"),
                ),
            };
            http.get(server.url("/")).header(name, value).send()
        };
        let (client_a, client_b) = match header {
            ForwardedHeader::XForwardedFor => ("198.51.100.20", "198.51.100.21"),
            ForwardedHeader::Forwarded => ("198.51.100.30", "198.51.100.31"),
        };
        // The client rotates the leftmost (its own) entry: still one key.
        let mut statuses = Vec::new();
        for i in 0..4 {
            let res = send(&format!("192.0.2.{i}"), client_a).await.unwrap();
            statuses.push(res.status().as_u16());
        }
        assert_eq!(statuses, [200, 200, 429, 429], "{header:?}");
        // Another client behind the same proxies has its own budget.
        let res = send("192.0.2.1", client_b).await.unwrap();
        assert_eq!(res.status(), 200);
    }
}

/// Records, in the server's (paused) clock, how long the rest of the stack took.
async fn time_it(req: Request, next: Next) -> Response {
    let start = tokio::time::Instant::now();
    let mut res = next.run(req).await;
    let waited = start.elapsed().as_micros().to_string();
    res.headers_mut()
        .insert("x-waited-us", waited.parse().unwrap());
    res
}

/// The server runs on a paused tokio clock on its own thread; the client uses real
/// time. The shaper's delays are then exact in the server's clock, and cost no real
/// time: the paused clock jumps to each timer as soon as the server is idle.
#[tokio::test]
async fn shaping_delays_measured_on_a_paused_clock() {
    let (_, store) = store();
    let layer = RateLimitLayer::builder(store, GlobalKey)
        .rules("4/s leaky-bucket mode=shaper burst=3")
        .unwrap()
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "shaped" }))
        .layer(layer)
        .layer(middleware::from_fn(time_it));

    let (addr_tx, addr_rx) = std::sync::mpsc::channel::<SocketAddr>();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            addr_tx.send(listener.local_addr().unwrap()).unwrap();
            axum::serve(
                listener,
                app.into_make_service_with_connect_info::<SocketAddr>(),
            )
            .with_graceful_shutdown(async {
                let _ = stop_rx.await;
            })
            .await
            .unwrap();
        });
    });
    let addr = addr_rx.recv().unwrap();
    let http = client();
    let started = std::time::Instant::now();
    let requests = (0..5).map(|_| {
        let http = http.clone();
        async move {
            let res = http.get(format!("http://{addr}/")).send().await.unwrap();
            let waited = one(&res, "x-waited-us").map(|v| v.parse::<u64>().unwrap());
            (res.status().as_u16(), waited)
        }
    });
    let mut results: Vec<(u16, Option<u64>)> = futures_join_all(requests).await;
    results.sort();
    // One at once, three queued 250 ms apart, the fifth refused (queue of 3 full).
    assert_eq!(
        results,
        [
            (200, Some(0)),
            (200, Some(250_000)),
            (200, Some(500_000)),
            (200, Some(750_000)),
            (429, Some(0)),
        ]
    );
    assert!(
        started.elapsed() < Duration::from_millis(700),
        "the paused clock should skip the delays, took {:?}",
        started.elapsed()
    );
    stop_tx.send(()).unwrap();
    server.join().unwrap();
}

/// Runs the futures concurrently, each on its own task.
async fn futures_join_all<F>(futures: impl Iterator<Item = F>) -> Vec<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    let handles: Vec<_> = futures.map(tokio::spawn).collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.unwrap());
    }
    out
}

#[tokio::test]
async fn requests_without_a_key_are_refused_with_what_is_missing() {
    let (_, store) = store();
    let layer = RateLimitLayer::builder(store, |req: &http::Request<Body>| {
        req.headers().get("x-user").map(|v| v.as_bytes().to_vec())
    })
    .rules("1/min")
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
    for _ in 0..3 {
        let res = http.get(server.url("/")).send().await.unwrap();
        assert_eq!(res.status(), 500);
        assert!(one(&res, "ratelimit").is_none());
        assert!(res.text().await.unwrap().contains("found no key"));
    }
    let res = http
        .get(server.url("/"))
        .header("x-user", "u1")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let res = http
        .get(server.url("/"))
        .header("x-user", "u1")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 429);
}
