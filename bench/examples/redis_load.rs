//! Checks through one `RedisStore` against a redis-server that is already running, for
//! profiling that server (`perf record -p`, or the server run under `valgrind
//! --tool=callgrind` and reset with `callgrind_control -z` after the warm-up). It prints
//! the decisions per second and the server's CPU time per decision.
//!
//! ```sh
//! redis-server --port 6399 --save '' --appendonly no &
//! REDIS_URL=redis://127.0.0.1:6399 TOTAL=100000 TASKS=64 KEYS=10000 \
//!   RULES="100/s gcra burst=100" cargo run --release -p ratelimit-bench --example redis_load
//! ```
//!
//! `PING=1` sends a `PING` per decision instead, through one multiplexed connection: the
//! floor the store's figures are compared with.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ratelimit_bench::{env_or, redis_cpu_seconds};
use ratelimit_core::{RuleSet, Store};
use ratelimit_redis::testing::wait_connected;
use ratelimit_redis::RedisStore;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let url = std::env::var("REDIS_URL").expect("REDIS_URL: the server to load");
    let total = env_or("TOTAL", 100_000);
    let tasks = env_or("TASKS", 64);
    let keys = env_or("KEYS", 10_000);
    let ping = env_or("PING", 0) == 1;
    let rules: RuleSet = std::env::var("RULES")
        .unwrap_or_else(|_| "100/s gcra burst=100".into())
        .parse()
        .expect("RULES: a rule set");
    let client = redis::Client::open(url.as_str()).unwrap();
    let mut admin = client.get_multiplexed_async_connection().await.unwrap();
    let store = RedisStore::builder()
        .prefix("load")
        .timeout(Duration::from_secs(5))
        .build(&url)
        .await
        .unwrap();
    wait_connected(&store).await;
    // Warm up: the function loaded, every key's state written once.
    for k in 0..keys.min(1000) {
        store
            .check(format!("{k:012}").as_bytes(), &rules, 1)
            .await
            .unwrap();
    }
    let cpu_before = server_cpu(&mut admin).await;
    let started = Instant::now();
    let next = Arc::new(AtomicU64::new(0));
    let mut handles = Vec::new();
    for _ in 0..tasks {
        let (store, rules, next, client) =
            (store.clone(), rules.clone(), next.clone(), admin.clone());
        handles.push(tokio::spawn(async move {
            let mut con = client;
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= total {
                    break;
                }
                if ping {
                    let _: String = redis::cmd("PING").query_async(&mut con).await.unwrap();
                } else {
                    let key = format!("{:012}", i.wrapping_mul(0x9E37_79B9_7F4A_7C15) % keys);
                    store.check(key.as_bytes(), &rules, 1).await.unwrap();
                }
            }
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
    let elapsed = started.elapsed().as_secs_f64();
    let cpu = server_cpu(&mut admin).await - cpu_before;
    println!(
        "{total} decisions in {elapsed:.2} s ({:.0}/s); redis-server CPU {:.2} µs/decision",
        total as f64 / elapsed,
        cpu * 1e6 / total as f64
    );
}

/// The server's `used_cpu_user + used_cpu_sys`, in seconds.
async fn server_cpu(con: &mut redis::aio::MultiplexedConnection) -> f64 {
    let info: String = redis::cmd("INFO")
        .arg("cpu")
        .query_async(con)
        .await
        .unwrap();
    redis_cpu_seconds(&info)
}
