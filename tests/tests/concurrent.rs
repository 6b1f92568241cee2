//! `N concurrent` over real HTTP: slots held to the end of the response body, released
//! when it ends or the client goes away.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::{Body, Bytes, HttpBody};
use axum::routing::get;
use axum::Router;
use http_body::Frame;
use ratelimit_core::{MemoryStore, Store};
use ratelimit_e2e::{client, one, TestServer};
use ratelimit_redis::testing::{wait_connected, RedisCluster, RedisServer};
use ratelimit_redis::RedisStore;
use ratelimit_tower::{GlobalKey, RateLimitLayer};

/// The handler's own count of requests in flight, and the most it saw at once.
#[derive(Default)]
struct InFlight {
    now: AtomicUsize,
    most: AtomicUsize,
}

impl InFlight {
    async fn hold(&self, for_: Duration) {
        let n = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(n, Ordering::SeqCst);
        tokio::time::sleep(for_).await;
        self.now.fetch_sub(1, Ordering::SeqCst);
    }
}

fn app<S: Store>(store: Arc<S>, flight: Arc<InFlight>) -> Router {
    let layer = RateLimitLayer::builder(store, GlobalKey)
        .rules("100/min; 4 concurrent")
        .unwrap()
        .namespace("conc")
        .build()
        .unwrap();
    Router::new()
        .route(
            "/",
            get(move || {
                let flight = Arc::clone(&flight);
                async move {
                    flight.hold(Duration::from_millis(300)).await;
                    "done"
                }
            }),
        )
        .route(
            "/stream",
            // A body that never ends: only the client going away ends it.
            get(|| async { Body::new(Endless) }),
        )
        .layer(layer)
}

/// A response body that sends nothing and never ends.
struct Endless;

impl HttpBody for Endless {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Poll::Pending
    }
}

/// Fires `n` requests at once at each of `servers` in turn; the statuses.
async fn wave(servers: &[&TestServer], n: usize) -> Vec<u16> {
    let http = client();
    let calls = (0..n).map(|i| {
        let url = servers[i % servers.len()].url("/");
        let http = http.clone();
        tokio::spawn(async move {
            let res = http.get(url).send().await.unwrap();
            let status = res.status().as_u16();
            if status == 429 {
                assert_eq!(one(&res, "retry-after").as_deref(), Some("1"), "a hint");
                assert!(res.headers().get("ratelimit").is_some(), "the rate's field");
            }
            res.bytes().await.unwrap();
            status
        })
    });
    let mut statuses = Vec::new();
    for call in calls.collect::<Vec<_>>() {
        statuses.push(call.await.unwrap());
    }
    statuses
}

async fn twenty_then_the_next_wave(servers: &[&TestServer], flight: &InFlight) {
    let statuses = wave(servers, 20).await;
    let ok = statuses.iter().filter(|&&s| s == 200).count();
    let refused = statuses.iter().filter(|&&s| s == 429).count();
    assert_eq!((ok, refused), (4, 16), "{statuses:?}");
    assert!(flight.most.load(Ordering::SeqCst) <= 4);
    // The slots go when each body has ended, just after the client has read it.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let statuses = wave(servers, 4).await;
    assert_eq!(statuses, [200; 4], "the next wave");
    assert_eq!(flight.most.load(Ordering::SeqCst), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_of_twenty_at_once_then_the_next_wave_on_memory() {
    let flight = Arc::new(InFlight::default());
    let server = TestServer::start(app(Arc::new(MemoryStore::new()), Arc::clone(&flight))).await;
    twenty_then_the_next_wave(&[&server], &flight).await;
}

/// A client that goes away mid-body frees its slot: four endless streams hold all four,
/// and once their clients hang up, four more are admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_frees_its_slot() {
    let flight = Arc::new(InFlight::default());
    let server = TestServer::start(app(Arc::new(MemoryStore::new()), flight)).await;
    let mut streams = Vec::new();
    for _ in 0..4 {
        // A client each: one connection per stream, closed when it is dropped.
        let res = client().get(server.url("/stream")).send().await.unwrap();
        assert_eq!(res.status(), 200);
        streams.push(res);
    }
    let res = client().get(server.url("/stream")).send().await.unwrap();
    assert_eq!(res.status(), 429, "four streams hold the four slots");
    drop(streams);
    let mut admitted = 0;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let res = client().get(server.url("/stream")).send().await.unwrap();
        if res.status() == 200 {
            admitted = 1;
            break;
        }
    }
    assert_eq!(
        admitted, 1,
        "the hung-up streams' slots were never released"
    );
}

/// A store on `server` with a timeout long enough for a loaded machine (the layer fails
/// open on a store timeout by default).
async fn redis_store(server: &RedisServer) -> Arc<RedisStore> {
    let store = RedisStore::builder()
        .timeout(Duration::from_secs(5))
        .build(&server.url())
        .await
        .expect("connect to the test redis-server");
    wait_connected(&store).await;
    Arc::new(store)
}

/// Two app instances, each with its own store, on one redis-server: the slots are the
/// fleet's, never more than four in flight between them.
async fn two_instances_on(redis: &RedisServer) {
    let flight = Arc::new(InFlight::default());
    let a = TestServer::start(app(redis_store(redis).await, Arc::clone(&flight))).await;
    let b = TestServer::start(app(redis_store(redis).await, Arc::clone(&flight))).await;
    twenty_then_the_next_wave(&[&a, &b], &flight).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_of_twenty_between_two_instances_on_redis_lua() {
    two_instances_on(&RedisServer::start()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_of_twenty_between_two_instances_on_the_module() {
    two_instances_on(&RedisServer::start_with_module()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_of_twenty_between_two_instances_on_a_cluster() {
    let cluster = RedisCluster::start();
    let store = || async {
        let store = RedisStore::builder()
            .timeout(Duration::from_secs(5))
            .build_cluster(&cluster.urls())
            .await
            .expect("cluster store");
        wait_connected(&store).await;
        Arc::new(store)
    };
    let flight = Arc::new(InFlight::default());
    let a = TestServer::start(app(store().await, Arc::clone(&flight))).await;
    let b = TestServer::start(app(store().await, Arc::clone(&flight))).await;
    twenty_then_the_next_wave(&[&a, &b], &flight).await;
}

/// The app of [`a_killed_process_loses_its_slots_at_their_deadlines`]: four endless
/// streams hold the slots of `100/min; 4 concurrent timeout=2s`, renewed by the layer.
fn fleet_app(store: Arc<RedisStore>) -> Router {
    let layer = RateLimitLayer::builder(store, GlobalKey)
        .rules("100/min; 4 concurrent timeout=2s")
        .unwrap()
        .namespace("killed")
        .without_deny_cache()
        .build()
        .unwrap();
    Router::new()
        .route("/stream", get(|| async { Body::new(Endless) }))
        .layer(layer)
}

/// Run as a child process by [`a_killed_process_loses_its_slots_at_their_deadlines`]
/// (which sets `RATELIMIT_KILL_CHILD` to the Redis URL and a file): serves [`fleet_app`]
/// and writes its port to the file (the test harness keeps a passing test's output).
/// Alone, a test that does nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_child() {
    let Ok(spec) = std::env::var("RATELIMIT_KILL_CHILD") else {
        return;
    };
    let (url, file) = spec.split_once(' ').unwrap();
    let store = RedisStore::builder()
        .timeout(Duration::from_secs(5))
        .build(url)
        .await
        .unwrap();
    wait_connected(&store).await;
    let server = TestServer::start(fleet_app(Arc::new(store))).await;
    std::fs::write(format!("{file}.tmp"), server.addr().port().to_string()).unwrap();
    std::fs::rename(format!("{file}.tmp"), file).unwrap();
    tokio::time::sleep(Duration::from_secs(600)).await;
}

/// A process killed with `kill -9` while four streams hold the key's four slots: the
/// key admits again within the timeout (2 s) and a renewal interval of the kill, not
/// never.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_process_loses_its_slots_at_their_deadlines() {
    let redis = RedisServer::start();
    let file = std::env::temp_dir().join(format!("ratelimit-kill-{}", std::process::id()));
    let _ = std::fs::remove_file(&file);
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "killed_child", "--test-threads=1"])
        .env(
            "RATELIMIT_KILL_CHILD",
            format!("{} {}", redis.url(), file.display()),
        )
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    let port = loop {
        if let Ok(port) = std::fs::read_to_string(&file) {
            break port.parse::<u16>().unwrap();
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the child never served"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let _ = std::fs::remove_file(&file);
    let mut streams = Vec::new();
    for _ in 0..4 {
        let res = client()
            .get(format!("http://127.0.0.1:{port}/stream"))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200);
        streams.push(res);
    }
    // Past one timeout: the child's renewals keep the slots.
    let here = TestServer::start(fleet_app(redis_store(&redis).await)).await;
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let res = client().get(here.url("/stream")).send().await.unwrap();
    assert_eq!(res.status(), 429, "the child's slots, renewed, are held");
    drop(res);
    child.kill().unwrap(); // SIGKILL: no release, no renewal any more.
    child.wait().unwrap();
    let killed = std::time::Instant::now();
    drop(streams);
    let admitted = loop {
        let res = client().get(here.url("/stream")).send().await.unwrap();
        if res.status() == 200 {
            break killed.elapsed();
        }
        assert!(
            killed.elapsed() < Duration::from_secs(10),
            "never admitted again"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // The timeout plus one renewal interval (2 s / 3), and room for a loaded machine.
    assert!(
        admitted <= Duration::from_millis(2_000 + 667 + 500),
        "admitted again {admitted:?} after the kill"
    );
    println!("admitted again {admitted:?} after the kill");
}
