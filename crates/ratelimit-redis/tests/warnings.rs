//! What the store says when something it cannot fix goes wrong: a refund that failed
//! (lease mode's and `Store::refund`'s), a server whose function library lacks the
//! functions the store calls. Each is one WARN at once, then at most one per 10 s.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use ratelimit_core::testing::T0_US;
use ratelimit_core::{ManualClock, RuleSet, Store};
use ratelimit_redis::testing::{check_script, wait_connected, RedisServer};
use ratelimit_redis::{redis, RedisStore};
use tracing::subscriber::DefaultGuard;

/// The WARN lines logged on this thread while it lives (the tests run on a
/// current-thread runtime, so the store's tasks log here too).
struct Logs {
    lines: Arc<Mutex<Vec<u8>>>,
    _guard: DefaultGuard,
}

struct Writer(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Writer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Logs {
    fn capture() -> Self {
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = lines.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::WARN)
            .with_ansi(false)
            .with_writer(move || Writer(sink.clone()))
            .finish();
        Self {
            lines,
            _guard: tracing::subscriber::set_default(subscriber),
        }
    }

    /// The WARN lines that contain `text`.
    fn count(&self, text: &str) -> usize {
        let lines = self.lines.lock().unwrap();
        String::from_utf8_lossy(&lines)
            .lines()
            .filter(|line| line.contains("WARN") && line.contains(text))
            .count()
    }
}

async fn store(server: &RedisServer, lease: Option<Duration>, clock: &ManualClock) -> RedisStore {
    let builder = RedisStore::builder()
        .prefix("warnings")
        .timeout(Duration::from_millis(500))
        .clock(clock.clone());
    let builder = match lease {
        Some(length) => builder.lease(length),
        None => builder,
    };
    let store = builder.build(&server.url()).await.expect("store");
    wait_connected(&store).await;
    store
}

#[tokio::test]
async fn a_failed_give_back_warns_at_a_bounded_rate() {
    let logs = Logs::capture();
    let mut server = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let store = store(&server, None, &clock).await;
    let rules: RuleSet = "10/s gcra burst=20".parse().unwrap();
    let charged_at = store.now_us();
    assert!(store.check(b"k", &rules, 1).await.unwrap().is_allowed());
    assert_eq!(logs.count("could not be given back"), 0);
    server.stop();
    for _ in 0..3 {
        let failed = store.refund(b"k", &rules, 1, charged_at).await;
        assert!(failed.is_err_and(|e| e.is_unavailable()));
    }
    assert_eq!(logs.count("could not be given back"), 1);
}

/// Releases handed to the store while Redis stays down: each is tried four times (the
/// first and three retries within about 1.3 s), then one WARN says the slot stays taken,
/// and no more within 10 s; `flush` resolves once they are given up.
#[tokio::test]
async fn a_detached_release_given_up_warns_at_a_bounded_rate() {
    let logs = Logs::capture();
    let mut server = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let store = store(&server, None, &clock).await;
    let rules: RuleSet = "2 concurrent timeout=1h".parse().unwrap();
    let slots: Vec<u64> = [
        store.check(b"k", &rules, 1).await.unwrap(),
        store.check(b"k", &rules, 1).await.unwrap(),
    ]
    .iter()
    .map(|d| d.slot().expect("a slot"))
    .collect();
    server.stop();
    for slot in slots {
        assert!(store.release_detached(b"k", &rules, slot));
    }
    tokio::time::timeout(Duration::from_secs(10), store.flush())
        .await
        .expect("given up after the retries");
    assert_eq!(
        logs.count("a concurrency slot's release failed: the slot stays taken until its deadline"),
        1
    );
    assert!(logs.count("tries=4") == 1, "four tries");
}

#[tokio::test]
async fn a_failed_lease_refund_warns_at_a_bounded_rate() {
    let logs = Logs::capture();
    let mut server = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let lease = Duration::from_millis(20);
    let store = store(&server, Some(lease), &clock).await;
    let rules: RuleSet = "10/s token-bucket capacity=40".parse().unwrap();
    // Seen 3 times: exact; the 4th reserves a block of 4, for each of two keys.
    for key in [b"a", b"b"] {
        for _ in 0..4 {
            assert!(store.check(key, &rules, 1).await.unwrap().is_allowed());
        }
    }
    server.stop();
    clock.advance(lease);
    store.sweep_leases().await;
    assert_eq!(
        logs.count("unspent units could not be given back"),
        1,
        "two refunds failed, one report"
    );
}

#[tokio::test]
async fn a_library_without_the_functions_warns_at_a_bounded_rate() {
    let logs = Logs::capture();
    let server = RedisServer::start();
    let clock = ManualClock::new(T0_US);
    let store = store(&server, None, &clock).await;
    // Something else loads a library of this version's name, without its functions.
    let header = check_script()
        .library
        .lines()
        .next()
        .expect("a shebang line");
    let foreign =
        format!("{header}\nredis.register_function('not_a_limiter', function() return 1 end)\n");
    let mut con = redis::Client::open(server.url())
        .and_then(|c| c.get_connection())
        .expect("connection");
    let _: String = redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg("REPLACE")
        .arg(&foreign)
        .query(&mut con)
        .expect("FUNCTION LOAD");
    let rules: RuleSet = "10/s gcra burst=20".parse().unwrap();
    for _ in 0..3 {
        // Decided all the same, as a script.
        assert!(store.check(b"k", &rules, 1).await.unwrap().is_allowed());
    }
    assert_eq!(logs.count("lacks a function this store calls"), 1);
}
