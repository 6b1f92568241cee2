//! Lease mode under faults: two stores leasing one hot key from 16 tasks while the
//! server's connections are cut (`CLIENT KILL`) and the server restarts, over and over.
//! Every check returns within the store's timeout (plus scheduling slack): none waits
//! for a reservation that ended, or for one that never will.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ratelimit_core::{RuleSet, Store};
use ratelimit_redis::testing::{wait_connected, RedisServer};
use ratelimit_redis::RedisStore;

const TIMEOUT: Duration = Duration::from_millis(50);
const LEASE: Duration = Duration::from_millis(100);
/// Generous: a check slower than its timeout by this much hangs; scheduling on a loaded
/// 2-core machine never takes this long.
const MARGIN: Duration = Duration::from_secs(1);
const TASKS: usize = 16;

fn rules() -> RuleSet {
    "20000/s gcra burst=4000".parse().unwrap()
}

async fn store(url: &str) -> RedisStore {
    let store = RedisStore::builder()
        .prefix("leasefaults")
        .timeout(TIMEOUT)
        .lease(LEASE)
        .build(url)
        .await
        .expect("store");
    wait_connected(&store).await;
    store
}

async fn every_check_returns_in_time(module: bool) {
    let server = if module {
        RedisServer::start_with_module()
    } else {
        RedisServer::start()
    };
    let stores = [store(&server.url()).await, store(&server.url()).await];
    assert_eq!(stores[0].uses_module(), module);
    let stop = Arc::new(AtomicBool::new(false));
    let (admitted, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            let store = stores[t % 2].clone();
            let (stop, admitted, failed) = (stop.clone(), admitted.clone(), failed.clone());
            tokio::spawn(async move {
                let rules = rules();
                let mut slowest = Duration::ZERO;
                while !stop.load(Ordering::Relaxed) {
                    let started = Instant::now();
                    let check = store.check(b"hot", &rules, 1);
                    match tokio::time::timeout(TIMEOUT + MARGIN, check).await {
                        Ok(Ok(_)) => admitted.fetch_add(1, Ordering::Relaxed),
                        Ok(Err(e)) => {
                            assert!(e.is_unavailable(), "{e}");
                            failed.fetch_add(1, Ordering::Relaxed)
                        }
                        Err(_) => panic!("a leased check did not return within {MARGIN:?}"),
                    };
                    slowest = slowest.max(started.elapsed());
                    // Other tasks (the sweep, the reconnection) get their turn.
                    tokio::task::yield_now().await;
                }
                slowest
            })
        })
        .collect();
    let port = server.port();
    let server = tokio::task::spawn_blocking(move || {
        let mut server = server;
        for round in 0..4 {
            for _ in 0..15 {
                std::thread::sleep(Duration::from_millis(40));
                common::kill_clients(port);
            }
            if round < 3 {
                server.restart();
            }
        }
        server
    })
    .await
    .expect("faults");
    for store in &stores {
        wait_connected(store).await;
    }
    // A while without faults: the stores go back to leasing.
    tokio::time::sleep(LEASE * 3).await;
    stop.store(true, Ordering::Relaxed);
    let mut slowest = Duration::ZERO;
    for task in tasks {
        slowest = slowest.max(task.await.expect("no check hung"));
    }
    let (admitted, failed) = (
        admitted.load(Ordering::Relaxed),
        failed.load(Ordering::Relaxed),
    );
    assert!(
        admitted > 0 && failed > 0,
        "{admitted} admitted, {failed} failed"
    );
    assert!(
        slowest <= TIMEOUT + MARGIN,
        "the slowest check took {slowest:?}"
    );
    drop(server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leased_checks_return_in_time_under_kills_and_restarts() {
    every_check_returns_in_time(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leased_checks_return_in_time_under_kills_and_restarts_in_the_module() {
    every_check_returns_in_time(true).await;
}
