//! HTTP load on loopback, servers side by side: plain axum, `RateLimitLayer` on a
//! `MemoryStore`, `RateLimitLayer` on a `RedisStore`, tower_governor (which sends no
//! rate-limit fields by default), and `RateLimitLayer` on a `MemoryStore` without the
//! fields on admitted responses (to compare like with like).
//!
//! ```sh
//! cargo run --release -p ratelimit-bench --example http_bench
//! ```
//!
//! Each server answers `GET /` with "Hello, World!", keyed by peer IP, with limits far
//! above what the load reaches: the figures are the cost of the admitted path. The load
//! is `wrk` (on `PATH`), one run per server with the same settings, after a warm-up.
//! Redis is a `redis-server` started on a free port, or `REDIS_URL`.
//!
//! The servers take turns for `ROUNDS` rounds, each round starting with the next server,
//! and each figure is the median (and the best) of its rounds, so that background load
//! and position in the sequence do not favour one server. Besides requests/s and p99,
//! the CPU time the server process (and the local redis-server) spent per request is
//! measured from `/proc`: on a machine shared with other work it is the steadier figure.
//!
//! `PIN=1` runs the server and a local redis-server on CPU 0 and wrk on CPU 1 (`taskset`):
//! steadier on an otherwise idle two-core machine, much worse when other work shares CPU 0.
//!
//! Two more servers measure the denial path: one client (wrk, one peer IP) flooding
//! `RateLimitLayer` + `MemoryStore` under `1/h` and tower_governor under one request per
//! hour, so that every request after the first is refused (429).
//!
//! `MODULE=1` starts the local redis-server with the native module loaded
//! (`$RATELIMIT_MODULE`, else one `testing::module_file` builds: build it with `cargo
//! build --release -p ratelimit-redis-module` and set `RATELIMIT_MODULE` to
//! `target/release/libratelimit_redis_module.so` to measure the release build), and adds
//! a server whose `RedisStore` is forced onto the Lua functions on that same redis-server:
//! the module's layer and the Lua one measured side by side in one run.
//!
//! Settings (environment): `DURATION` seconds per run (10), `ROUNDS` (3), `CONNECTIONS`
//! (64), `WRK_THREADS` (1), `SERVER_THREADS` tokio workers (1), `REDIS_POOL` connections
//! (the store's default), `PIN` (0), `MODULE` (0).

use std::net::SocketAddr;
use std::process::Command;
use std::sync::Arc;

use axum::routing::get;
use axum::Router;
use ratelimit_bench::{cpu_seconds, env_or};
use ratelimit_core::MemoryStore;
use ratelimit_redis::testing::wait_connected;
use ratelimit_redis::RedisStore;
use ratelimit_tower::{PeerIp, RateLimitLayer};
use tower_governor::governor::GovernorConfigBuilder;
use tower_governor::GovernorLayer;

/// High enough that nothing is ever refused during a run (GCRA, burst = limit).
const RULES: &str = "100000000/s";

type Error = Box<dyn std::error::Error>;

/// One wrk run against one server.
#[derive(Debug, Clone, Copy)]
struct Sample {
    requests_per_sec: f64,
    p99_ms: f64,
    non_2xx: u64,
    /// Server process CPU per request, µs.
    server_cpu_us: f64,
    /// Local redis-server CPU per request, µs.
    redis_cpu_us: f64,
}

fn main() -> Result<(), Error> {
    let duration = env_or("DURATION", 10);
    let connections = env_or("CONNECTIONS", 64);
    let wrk_threads = env_or("WRK_THREADS", 1);
    let server_threads = env_or("SERVER_THREADS", 1) as usize;
    let rounds = env_or("ROUNDS", 3).max(1) as usize;

    // On two cores the scheduler sometimes puts the load generator on the server's core
    // and sometimes not, and throughput halves or doubles with it; pinning avoids that
    // when nothing else runs.
    let pin = std::env::var("PIN").is_ok_and(|v| v == "1") && pin_self_to_cpu0();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(server_threads)
        .enable_all()
        .build()?;

    let module = std::env::var("MODULE").is_ok_and(|v| v == "1");
    let mut redis_server = None;
    let redis_url = match std::env::var("REDIS_URL") {
        Ok(url) => url,
        Err(_) => {
            let server = if module {
                ratelimit_redis::testing::RedisServer::start_with_module()
            } else {
                ratelimit_redis::testing::RedisServer::start()
            };
            let url = server.url();
            redis_server = Some(server);
            url
        }
    };
    let redis_pid = redis_server.as_ref().and_then(|s| s.pid());

    let hello = || Router::new().route("/", get(|| async { "Hello, World!" }));
    let memory = RateLimitLayer::builder(Arc::new(MemoryStore::new()), PeerIp::new())
        .rules(RULES)?
        .build()?;
    let memory_quiet = RateLimitLayer::builder(Arc::new(MemoryStore::new()), PeerIp::new())
        .rules(RULES)?
        .admitted_headers(false)
        .build()?;
    let memory_deny =
        RateLimitLayer::new(Arc::new(MemoryStore::new()), PeerIp::new(), "1/h".parse()?);
    let governor_deny = GovernorConfigBuilder::default()
        .per_second(3600)
        .burst_size(1)
        .finish()
        .ok_or("tower_governor configuration")?;
    let redis_layer = |force_lua: bool| -> Result<_, Error> {
        let mut builder = RedisStore::builder().force_lua(force_lua);
        if let Some(size) = std::env::var("REDIS_POOL")
            .ok()
            .and_then(|v| v.parse().ok())
        {
            builder = builder.pool_size(size);
        }
        let store = rt.block_on(builder.build(&redis_url))?;
        rt.block_on(wait_connected(&store));
        if module && !force_lua && !store.uses_module() {
            return Err("MODULE=1 but the store does not use the module".into());
        }
        Ok(RateLimitLayer::builder(store, PeerIp::new())
            .namespace("http-bench")
            .rules(RULES)?
            .build()?)
    };
    let redis = redis_layer(false)?;
    let governor = GovernorConfigBuilder::default()
        .per_nanosecond(10)
        .burst_size(u32::MAX)
        .finish()
        .ok_or("tower_governor configuration")?;

    // The last two refuse every request after the first: the denial path.
    const DENYING: usize = 2;
    let mut servers: Vec<(&'static str, Router)> = vec![
        ("plain axum", hello()),
        ("RateLimitLayer + MemoryStore", hello().layer(memory)),
        (
            if module {
                "RateLimitLayer + RedisStore (module)"
            } else {
                "RateLimitLayer + RedisStore"
            },
            hello().layer(redis),
        ),
        (
            "tower_governor",
            hello().layer(GovernorLayer::new(Arc::new(governor))),
        ),
        (
            "RateLimitLayer + MemoryStore, no admitted fields",
            hello().layer(memory_quiet),
        ),
        (
            "denial: RateLimitLayer + MemoryStore",
            hello().layer(memory_deny),
        ),
        (
            "denial: tower_governor",
            hello().layer(GovernorLayer::new(Arc::new(governor_deny))),
        ),
    ];
    if module {
        // Before the denying servers, which come last.
        let at = servers.len() - DENYING;
        servers.insert(
            at,
            (
                "RateLimitLayer + RedisStore (Lua)",
                hello().layer(redis_layer(true)?),
            ),
        );
    }

    if pin {
        println!("server (and local redis-server) pinned to CPU 0, wrk to CPU 1");
    }
    println!(
        "wrk -t{wrk_threads} -c{connections} -d{duration}s --latency, {rounds} round(s); \
         server: {server_threads} tokio worker(s); rules {RULES:?} per peer IP (never refused)"
    );
    let me = std::process::id();
    let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); servers.len()];
    for round in 0..rounds {
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
            let cpu_before = (cpu_seconds(me), redis_pid.map(cpu_seconds));
            let run = wrk(&url, wrk_threads, connections, duration, pin)?;
            let cpu_after = (cpu_seconds(me), redis_pid.map(cpu_seconds));
            let _ = stop_tx.send(());
            rt.block_on(server)??;
            let per_request = |before: f64, after: f64| (after - before) * 1e6 / run.requests;
            let sample = Sample {
                requests_per_sec: run.requests_per_sec,
                p99_ms: run.p99_ms,
                non_2xx: run.non_2xx,
                server_cpu_us: per_request(cpu_before.0, cpu_after.0),
                redis_cpu_us: match (cpu_before.1, cpu_after.1) {
                    (Some(b), Some(a)) => per_request(b, a),
                    _ => 0.0,
                },
            };
            println!(
                "round {round}: {name:<48} {:>8.0} req/s  p99 {:>6.2} ms  server CPU {:>5.1} µs/req  \
                 redis CPU {:>5.1} µs/req  non-2xx {}",
                sample.requests_per_sec,
                sample.p99_ms,
                sample.server_cpu_us,
                sample.redis_cpu_us,
                sample.non_2xx
            );
            samples[i].push(sample);
        }
    }

    let median_of = |s: &[Sample], f: fn(&Sample) -> f64| {
        let mut v: Vec<f64> = s.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let base = &samples[0];
    let (base_rps, base_p99, base_cpu) = (
        median_of(base, |s| s.requests_per_sec),
        median_of(base, |s| s.p99_ms),
        median_of(base, |s| s.server_cpu_us),
    );
    let base_best = base.iter().map(|s| s.requests_per_sec).fold(0.0, f64::max);
    println!();
    println!(
        "| server | requests/s | × plain | best requests/s | × plain | p99 | × plain | \
         server CPU/request | Redis CPU/request |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut medians = Vec::new();
    for ((name, _), s) in servers.iter().zip(&samples) {
        let rps = median_of(s, |s| s.requests_per_sec);
        let best = s.iter().map(|s| s.requests_per_sec).fold(0.0, f64::max);
        let p99 = median_of(s, |s| s.p99_ms);
        let cpu = median_of(s, |s| s.server_cpu_us);
        let redis = median_of(s, |s| s.redis_cpu_us);
        println!(
            "| {name} | {rps:.0} | {:.2} | {best:.0} | {:.2} | {p99:.2} ms | {:.2} | {cpu:.1} µs ({:.2}×) | {} |",
            rps / base_rps,
            best / base_best,
            p99 / base_p99,
            cpu / base_cpu,
            if redis > 0.0 { format!("{redis:.1} µs") } else { "".into() },
        );
        medians.push((rps, best, cpu));
    }
    println!();
    println!(
        "MemoryStore layer vs tower_governor: {:.2}× requests/s (median), {:.2}× (best), \
         {:.2}× server CPU per request",
        medians[1].0 / medians[3].0,
        medians[1].1 / medians[3].1,
        medians[1].2 / medians[3].2,
    );
    let (layer, governor) = (medians.len() - 2, medians.len() - 1);
    println!(
        "Denial path, MemoryStore layer vs tower_governor: {:.2}× requests/s (median), \
         {:.2}× server CPU per request",
        medians[layer].0 / medians[governor].0,
        medians[layer].2 / medians[governor].2,
    );
    let admitting = samples.len() - DENYING;
    if samples[..admitting].iter().flatten().any(|s| s.non_2xx > 0) {
        return Err("some requests were refused: the limits must stay above the load".into());
    }
    Ok(())
}

/// What one wrk run reports.
struct WrkRun {
    requests: f64,
    requests_per_sec: f64,
    p99_ms: f64,
    non_2xx: u64,
}

fn wrk(url: &str, threads: u64, connections: u64, secs: u64, pin: bool) -> Result<WrkRun, Error> {
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
    let missing = |what: &str| format!("no {what} in wrk output:\n{text}");
    let lines = || text.lines().map(str::trim);
    let requests_per_sec = lines()
        .find_map(|l| l.strip_prefix("Requests/sec:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| missing("Requests/sec"))?;
    let requests = lines()
        .find(|l| l.contains(" requests in "))
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .ok_or_else(|| missing("request count"))?;
    let p99_ms = lines()
        .find_map(|l| l.strip_prefix("99%"))
        .and_then(|v| parse_latency_ms(v.trim()))
        .ok_or_else(|| missing("99% latency"))?;
    let non_2xx = lines()
        .find_map(|l| l.strip_prefix("Non-2xx or 3xx responses:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    Ok(WrkRun {
        requests,
        requests_per_sec,
        p99_ms,
        non_2xx,
    })
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
