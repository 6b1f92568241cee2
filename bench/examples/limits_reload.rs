//! Reloading the `live_limits` example's limits file while requests flow: how long the
//! slowest request takes while a file of 1,024 tiers is reloaded over and over, and while
//! hostile files (50 MB of rule text, 50 MB of comment padding, 70,000 tiers) are
//! refused; how long each reload or refusal takes, and what it does to the RSS.
//!
//! ```sh
//! cargo run --release -p ratelimit-bench --example limits_reload
//! ```
//!
//! Requests go through the example's router in process (no sockets), from 4 tasks on a
//! runtime of 2 workers, each with a tier picked from the file's; the reloads run as the
//! example runs them, through `ratelimit_tower::LimitsFile::reload`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::Request;
use axum::Router;
use ratelimit_core::MemoryStore;
use ratelimit_examples::live::{app, limits_file};
use tower::ServiceExt;

const TIERS: usize = 1024;
const LOAD_TASKS: usize = 4;

fn tiers_file(dir: &Path, name: &str, tiers: usize, limit: usize) -> PathBuf {
    let mut text = format!("rules = \"{limit}/min name=per-ip\"\n\n[tiers]\n");
    for i in 0..tiers {
        text.push_str(&format!(
            "plan-{i} = \"{}/min sliding-window precision=6 name=plan-{i}; 10/s gcra\"\n",
            limit + i
        ));
    }
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write a limits file");
    path
}

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Sends requests until `stop`; returns each one's latency.
async fn load(app: Router, task: usize, stop: Arc<AtomicBool>) -> Vec<Duration> {
    let mut latencies = Vec::new();
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let plan = format!("plan-{}", (n as usize * 7 + task * 131) % (TIERS + 8));
        let peer: SocketAddr = format!("10.0.{}.{}:4000", task, n % 250).parse().unwrap();
        let mut req = Request::get("/")
            .header("x-plan", plan)
            .body(Body::empty())
            .unwrap();
        req.extensions_mut().insert(ConnectInfo(peer));
        let started = Instant::now();
        let res = app.clone().oneshot(req).await.unwrap();
        assert!(res.status().as_u16() < 500, "{}", res.status());
        latencies.push(started.elapsed());
        n += 1;
        // Let the other tasks (and the reloads' wake-ups) in, as a server's
        // connections would.
        tokio::task::yield_now().await;
    }
    latencies
}

/// Runs `phase` while the load runs; prints the slowest request and the phase's own
/// figures.
async fn under_load<F, Fut>(app: &Router, name: &str, phase: F)
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = String>,
{
    let stop = Arc::new(AtomicBool::new(false));
    let tasks: Vec<_> = (0..LOAD_TASKS)
        .map(|t| tokio::spawn(load(app.clone(), t, Arc::clone(&stop))))
        .collect();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let rss_before = rss_kib();
    let figures = phase().await;
    let rss_after = rss_kib();
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.store(true, Ordering::Relaxed);
    let mut latencies = Vec::new();
    for task in tasks {
        latencies.extend(task.await.unwrap());
    }
    latencies.sort_unstable();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let p999 = latencies[latencies.len() * 999 / 1000];
    let over = latencies
        .iter()
        .filter(|d| **d > Duration::from_millis(50))
        .count();
    println!(
        "{name:<38} {figures:<36} requests {:>7}, p99.9 {:>5.2} ms, slowest {:>6.2} ms, {over} over 50 ms; RSS {:+} KiB",
        latencies.len(),
        ms(p999),
        ms(latencies[latencies.len() - 1]),
        rss_after as i64 - rss_before as i64,
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("limits-reload-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let a = tiers_file(&dir, "a.toml", TIERS, 100);
    let b = tiers_file(&dir, "b.toml", TIERS, 200);
    let limits = limits_file(&a).load().await?;
    let (app, handle) = app(Arc::new(MemoryStore::new()), limits)?;

    under_load(&app, "no reload", || async { String::new() }).await;

    under_load(&app, "1,024 tiers reloaded 20 times", || async {
        let mut longest = Duration::ZERO;
        for i in 0..20 {
            let file = limits_file(if i % 2 == 0 { &b } else { &a });
            let started = Instant::now();
            let changes = file.reload(&handle).await.expect("a valid file");
            assert_eq!(changes.iter().count(), TIERS + 1);
            longest = longest.max(started.elapsed());
        }
        format!("longest reload {:.1} ms", longest.as_secs_f64() * 1e3)
    })
    .await;

    let hostile = [
        (
            "50 MB rule text",
            format!("rules = \"{}/min\"\n", "1".repeat(50 << 20)),
        ),
        (
            "50 MB of comment padding",
            format!("{}rules = \"1/s\"\n", "# padding\n".repeat(5 << 20)),
        ),
        (
            "70,000 tiers in under 1 MiB",
            (0..70_000).fold("rules=\"1/s\"\n[tiers]\n".to_owned(), |mut t, i| {
                t.push_str(&format!("{i:x}=\"1/s\"\n"));
                t
            }),
        ),
    ];
    for (name, text) in hostile {
        let path = dir.join("hostile.toml");
        std::fs::write(&path, text)?;
        under_load(&app, &format!("refusing {name}"), || async {
            let started = Instant::now();
            let err = limits_file(&path).reload(&handle).await.unwrap_err();
            format!(
                "refused in {:.1} ms ({} B error)",
                started.elapsed().as_secs_f64() * 1e3,
                err.to_string().len()
            )
        })
        .await;
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
