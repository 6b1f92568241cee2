//! A check Redis decided in time but answered after its caller stopped waiting: the
//! caller got a timeout (and decided by its failure policy), so the check must not also
//! count in Redis. The store reads the late reply and gives the check's units back and
//! its slot free.
//!
//! Redis's replies reach the store through a proxy that holds them back (the requests go
//! through at once, so each check arrives long before its deadline and is decided).

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ratelimit_core::{RuleSet, Store};
use ratelimit_redis::testing::{wait_connected, RedisServer};
use ratelimit_redis::{RedisStore, RedisStoreError};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

/// A TCP proxy to `port` that delays what the server sends by `delay_ms` (0 at first).
/// (Readiness and `try_read`/`try_write`: the tests build without tokio's `io-util`.)
async fn reply_delaying_proxy(port: u16, delay_ms: Arc<AtomicU64>) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let local = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = TcpStream::connect(("127.0.0.1", port)).await else {
                continue;
            };
            let (client, server) = (Arc::new(client), Arc::new(server));
            // Requests at once.
            let (from, to) = (client.clone(), server.clone());
            tokio::spawn(async move {
                while let Some(bytes) = read(&from).await {
                    if !write(&to, &bytes).await {
                        break;
                    }
                }
            });
            // Replies in order, each written `delay_ms` after it was read.
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
            let delay_ms = delay_ms.clone();
            let from = server.clone();
            tokio::spawn(async move {
                while let Some(bytes) = read(&from).await {
                    let due =
                        Instant::now() + Duration::from_millis(delay_ms.load(Ordering::Relaxed));
                    if tx.send((due, bytes)).is_err() {
                        break;
                    }
                }
            });
            tokio::spawn(async move {
                while let Some((due, bytes)) = rx.recv().await {
                    tokio::time::sleep_until(due).await;
                    if !write(&client, &bytes).await {
                        break;
                    }
                }
            });
        }
    });
    local
}

/// What the socket has to read; `None` once it is closed.
async fn read(socket: &TcpStream) -> Option<Vec<u8>> {
    let mut buf = vec![0; 64 * 1024];
    loop {
        socket.readable().await.ok()?;
        match socket.try_read(&mut buf) {
            Ok(0) => return None,
            Ok(n) => return Some(buf[..n].to_vec()),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => return None,
        }
    }
}

/// Writes all of `bytes`; whether the socket took them.
async fn write(socket: &TcpStream, mut bytes: &[u8]) -> bool {
    while !bytes.is_empty() {
        if socket.writable().await.is_err() {
            return false;
        }
        match socket.try_write(bytes) {
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => return false,
        }
    }
    true
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_answered_after_its_caller_stopped_waiting_is_given_back_on_lua() {
    late_checks_are_given_back(RedisServer::start()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_answered_after_its_caller_stopped_waiting_is_given_back_on_the_module() {
    late_checks_are_given_back(RedisServer::start_with_module()).await;
}

async fn late_checks_are_given_back(server: RedisServer) {
    let delay_ms = Arc::new(AtomicU64::new(0));
    let port = reply_delaying_proxy(server.port(), delay_ms.clone()).await;
    let store = RedisStore::builder()
        .prefix("late")
        .timeout(Duration::from_millis(100))
        .build(&format!("redis://127.0.0.1:{port}"))
        .await
        .unwrap();
    wait_connected(&store).await;
    let rules: RuleSet = "10/min fixed-window; 2 concurrent timeout=60s"
        .parse()
        .unwrap();
    let direct = RedisStore::builder()
        .prefix("late")
        .timeout(Duration::from_secs(5))
        .build(&server.url())
        .await
        .unwrap();
    wait_connected(&direct).await;
    // Lone checks and a batch of them: every call's reply comes 150 ms late, past the
    // store's 100 ms timeout and within the 200 ms it waits for a late reply.
    delay_ms.store(150, Ordering::Relaxed);
    let checks: Vec<_> = (0..6)
        .map(|i| {
            let (store, rules) = (store.clone(), rules.clone());
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(20 * (i % 2))).await;
                store.check(b"k", &rules, 1 + i % 2).await
            })
        })
        .collect();
    for check in checks {
        let result = check.await.unwrap();
        assert!(
            matches!(result, Err(RedisStoreError::Timeout(_))),
            "the caller stopped waiting: {result:?}"
        );
    }
    // The late replies arrive, and the store gives every charge back.
    let settled = async {
        loop {
            let peek = direct.check(b"k", &rules, 0).await.unwrap();
            let remaining: Vec<u64> = peek.rules().iter().map(|r| r.remaining).collect();
            if remaining == [10, 2] {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(3), settled)
        .await
        .expect("every late check given back: no units charged, no slot held");
    // With replies on time again, checks charge as ever.
    delay_ms.store(0, Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(400)).await;
    let d = store.check(b"k", &rules, 3).await.unwrap();
    assert!(d.is_allowed());
    assert_eq!(d.rules()[0].remaining, 7);
}
