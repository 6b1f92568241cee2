//! HTTP load on loopback, servers side by side: plain axum, `RateLimitLayer` on a
//! `MemoryStore`, `RateLimitLayer` on a `RedisStore`, tower_governor (which sends no
//! rate-limit fields by default), and `RateLimitLayer` on a `MemoryStore` without the
//! fields on admitted responses (to compare like with like).
//!
//! ```sh
//! cargo run --release -p ratelimit-examples --example http_bench
//! ```
//!
//! Each server answers `GET /` with "Hello, World!", keyed by peer IP, with limits far
//! above what the load reaches: the figures are the cost of the admitted path. The load
//! is `wrk` (on `PATH`), one run per server with the same settings, after a warm-up.
//! Redis is a `redis-server` started on a free port, or `REDIS_URL`.
//!
//! The servers take turns for `ROUNDS` rounds, each round starting with the next server,
//! and each figure is the median (and the best) of its rounds, so that background load
//! and position in the sequence do not favour one server.
//!
//! `PIN=1` runs the server and a local redis-server on CPU 0 and wrk on CPU 1 (`taskset`):
//! steadier on an otherwise idle two-core machine, much worse when other work shares CPU 0.
//!
//! Settings (environment): `DURATION` seconds per run (10), `ROUNDS` (3), `CONNECTIONS`
//! (64), `WRK_THREADS` (1), `SERVER_THREADS` tokio workers (1).

use std::net::SocketAddr;
use std::process::Command;
use std::sync::Arc;

use axum::routing::get;
use axum::Router;
use ratelimit_core::MemoryStore;
use ratelimit_redis::RedisStore;
use ratelimit_tower::{PeerIp, RateLimitLayer};
use tower_governor::governor::GovernorConfigBuilder;
use tower_governor::GovernorLayer;

/// High enough that nothing is ever refused during a run (GCRA, burst = limit).
const RULES: &str = "100000000/s";

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

struct Run {
    name: &'static str,
    requests_per_sec: f64,
    p99_ms: f64,
    best_requests_per_sec: f64,
    best_p99_ms: f64,
    non_2xx: u64,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let duration = env_or("DURATION", 10);
    let connections = env_or("CONNECTIONS", 64);
    let wrk_threads = env_or("WRK_THREADS", 1);
    let server_threads = env_or("SERVER_THREADS", 1) as usize;
    let rounds = env_or("ROUNDS", 3).max(1);

    // On two cores the scheduler sometimes puts the load generator on the server's core
    // and sometimes not, and throughput halves or doubles with it; pinning avoids that
    // when nothing else runs.
    let pin = std::env::var("PIN").is_ok_and(|v| v == "1") && pin_self_to_cpu0();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(server_threads)
        .enable_all()
        .build()?;

    let _redis_server;
    let redis_url = match std::env::var("REDIS_URL") {
        Ok(url) => url,
        Err(_) => {
            let server = ratelimit_redis::testing::RedisServer::start();
            let url = server.url();
            _redis_server = server;
            url
        }
    };

    let hello = || Router::new().route("/", get(|| async { "Hello, World!" }));
    let memory = RateLimitLayer::builder(Arc::new(MemoryStore::new()), PeerIp::new())
        .rules(RULES)?
        .build()?;
    let mut redis_builder = RedisStore::builder();
    if let Some(size) = std::env::var("REDIS_POOL")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        redis_builder = redis_builder.pool_size(size);
    }
    let memory_quiet = RateLimitLayer::builder(Arc::new(MemoryStore::new()), PeerIp::new())
        .rules(RULES)?
        .admitted_headers(false)
        .build()?;
    let redis_store = rt.block_on(redis_builder.build(&redis_url))?;
    let redis = RateLimitLayer::builder(redis_store, PeerIp::new())
        .rules(RULES)?
        .build()?;
    let governor = GovernorConfigBuilder::default()
        .per_nanosecond(10)
        .burst_size(u32::MAX)
        .finish()
        .ok_or("tower_governor configuration")?;

    let servers: Vec<(&'static str, Router)> = vec![
        ("plain axum", hello()),
        ("RateLimitLayer + MemoryStore", hello().layer(memory)),
        ("RateLimitLayer + RedisStore", hello().layer(redis)),
        (
            "tower_governor",
            hello().layer(GovernorLayer::new(Arc::new(governor))),
        ),
        (
            "RateLimitLayer + MemoryStore, no admitted fields",
            hello().layer(memory_quiet),
        ),
    ];

    if pin {
        println!(
            "server (and local redis-server) pinned to CPU 0, wrk to CPU 1 (PIN=0 to turn off)"
        );
    }
    println!(
        "wrk -t{wrk_threads} -c{connections} -d{duration}s --latency, {rounds} round(s), median; \
         server: {server_threads} tokio worker(s); rules {RULES:?} per peer IP (never refused)"
    );
    let mut samples: Vec<Vec<(f64, f64, u64)>> = vec![Vec::new(); servers.len()];
    for round in 0..rounds as usize {
        // Each round starts with the next server, so that no server always runs right
        // after the same neighbour or at the same point of a background load pattern.
        for i in (0..servers.len()).map(|i| (i + round) % servers.len()) {
            let (name, app) = (servers[i].0, servers[i].1.clone());
            let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
            let addr = listener.local_addr()?;
            let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
            let server = rt.spawn(async move {
                axum::serve(
                    listener,
                    app.into_make_service_with_connect_info::<SocketAddr>(),
                )
                .with_graceful_shutdown(async {
                    let _ = stop_rx.await;
                })
                .await
            });
            let url = format!("http://{addr}/");
            wrk(&url, wrk_threads, connections, 2, pin)?; // warm-up
            let run = wrk(&url, wrk_threads, connections, duration, pin)?;
            let _ = stop_tx.send(());
            rt.block_on(server)??;
            println!(
                "round {round}: {name:<48} {:>10.0} req/s  p99 {:>6.2} ms  non-2xx {}",
                run.0, run.1, run.2
            );
            samples[i].push(run);
        }
    }
    let runs: Vec<Run> = servers
        .iter()
        .zip(samples)
        .map(|((name, _), s)| Run {
            name,
            requests_per_sec: median(s.iter().map(|r| r.0).collect()),
            p99_ms: median(s.iter().map(|r| r.1).collect()),
            best_requests_per_sec: s.iter().map(|r| r.0).fold(0.0, f64::max),
            best_p99_ms: s.iter().map(|r| r.1).fold(f64::INFINITY, f64::min),
            non_2xx: s.iter().map(|r| r.2).sum(),
        })
        .collect();

    let base = &runs[0];
    println!();
    println!("| server | requests/s (median) | × plain | p99 (median) | × plain | requests/s (best) | × plain | p99 (best) | × plain |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &runs {
        println!(
            "| {} | {:.0} | {:.2} | {:.2} ms | {:.2} | {:.0} | {:.2} | {:.2} ms | {:.2} |",
            r.name,
            r.requests_per_sec,
            r.requests_per_sec / base.requests_per_sec,
            r.p99_ms,
            r.p99_ms / base.p99_ms,
            r.best_requests_per_sec,
            r.best_requests_per_sec / base.best_requests_per_sec,
            r.best_p99_ms,
            r.best_p99_ms / base.best_p99_ms,
        );
    }
    let governor = &runs[3];
    println!();
    println!(
        "MemoryStore layer vs tower_governor: {:.2}× requests/s (median), {:.2}× (best)",
        runs[1].requests_per_sec / governor.requests_per_sec,
        runs[1].best_requests_per_sec / governor.best_requests_per_sec
    );
    if runs.iter().any(|r| r.non_2xx > 0) {
        return Err("some requests were refused: the limits must stay above the load".into());
    }
    Ok(())
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// Runs wrk; returns (requests/s, p99 in ms, non-2xx responses).
fn wrk(
    url: &str,
    threads: u64,
    connections: u64,
    secs: u64,
    pin: bool,
) -> Result<(f64, f64, u64), Box<dyn std::error::Error>> {
    let mut command = if pin {
        let mut c = Command::new("taskset");
        c.args(["-c", "1", "wrk"]);
        c
    } else {
        Command::new("wrk")
    };
    let out = command
        .args([
            format!("-t{threads}"),
            format!("-c{connections}"),
            format!("-d{secs}s"),
            "--latency".into(),
            url.into(),
        ])
        .output()
        .map_err(|e| format!("cannot run wrk (install it, e.g. `apt-get install wrk`): {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!("wrk failed: {text}{}", String::from_utf8_lossy(&out.stderr)).into());
    }
    let rps = text
        .lines()
        .find_map(|l| l.strip_prefix("Requests/sec:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| format!("no Requests/sec in wrk output:\n{text}"))?;
    let p99 = text
        .lines()
        .map(str::trim)
        .find_map(|l| l.strip_prefix("99%"))
        .and_then(|v| parse_latency_ms(v.trim()))
        .ok_or_else(|| format!("no 99% latency in wrk output:\n{text}"))?;
    let non_2xx = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("Non-2xx or 3xx responses:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    Ok((rps, p99, non_2xx))
}

/// Pins this process (all its threads, and children started later) to CPU 0 with
/// `taskset`; false when that is not possible (no `taskset`, a single CPU).
fn pin_self_to_cpu0() -> bool {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    cpus >= 2
        && Command::new("taskset")
            .args(["-a", "-p", "-c", "0", &std::process::id().to_string()])
            .output()
            .is_ok_and(|o| o.status.success())
}

/// "812.00us", "1.23ms", "2.00s" in milliseconds.
fn parse_latency_ms(text: &str) -> Option<f64> {
    let split = text.find(|c: char| c.is_ascii_alphabetic())?;
    let (number, unit) = text.split_at(split);
    let number: f64 = number.parse().ok()?;
    Some(match unit {
        "us" => number / 1_000.0,
        "ms" => number,
        "s" => number * 1_000.0,
        "m" => number * 60_000.0,
        _ => return None,
    })
}
