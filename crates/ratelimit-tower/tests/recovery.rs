//! An outage and its recovery, end to end: four instances (each a layer over a
//! `RedisStore` of its own, `fallback_share(4)`) share one real redis-server, which is
//! killed for 3 s and started again, once with its data (saved before the kill) and once
//! empty, on the module and on the Lua functions. Every admission goes into a ledger on
//! one monotonic clock; a checker sweeps every window of every rule and asserts the bound
//! the crate docs state ("While the store is down"), whose `lag` counts only beside a
//! store admission that may have been decided past its instance's grace. With the
//! handover switched off the same checker must fail: the negative control.
//!
//! Rules, each on two keys: `10/s` (GCRA, burst 10), `100/min fixed-window`,
//! `50/min sliding-window` and `4 concurrent` (with a slot timeout of 2 s, so that the
//! slots a kill leaves held in a saved state free themselves within the run). One key of each minute rule has traffic
//! from the start, the other only from the kill on (so that its window holds nothing the
//! store admitted before the outage, and what the fallbacks admitted is all that a store
//! without the handover forgets). A run lasts about 10 s: the minute rules are checked
//! on the windows the outage and the recovery touch, not over whole minutes of traffic.
#![cfg(feature = "axum")]

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::Request as AxumRequest;
use axum::routing::get;
use axum::Router;
use http::Request;
use ratelimit_redis::testing::{wait_connected, RedisServer};
use ratelimit_redis::RedisStore;
use ratelimit_tower::{Admission, AdmittedBy, HeaderKey, RateLimitLayer, DEFAULT_FALLBACK_GRACE};
use tower::ServiceExt;

const INSTANCES: usize = 4;
/// How long Redis is down.
const OUTAGE: Duration = Duration::from_secs(3);
/// Traffic before the kill.
const BEFORE: Duration = Duration::from_millis(1_500);
/// Traffic after the restart: the stores reconnect within about 2 s, and a few 1 s
/// windows follow.
const AFTER: Duration = Duration::from_secs(5);
/// What the store's clock (a reading of Redis's `TIME`) may be off this test's clock by,
/// when telling whether an admission fell within its instance's grace.
const CLOCK_MARGIN_US: u64 = 100_000;
/// How long a request of the concurrency rule runs.
const HOLD: Duration = Duration::from_millis(150);

/// Runs one at a time: the timing of one must not starve another on a small machine.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Gcra,
    Fixed,
    Sliding,
    Slots,
}

impl Kind {
    const ALL: [Kind; 4] = [Kind::Gcra, Kind::Fixed, Kind::Sliding, Kind::Slots];

    fn tier(self) -> &'static str {
        match self {
            Kind::Gcra => "gcra",
            Kind::Fixed => "fixed",
            Kind::Sliding => "sliding",
            Kind::Slots => "slots",
        }
    }

    fn rules(self) -> &'static str {
        match self {
            Kind::Gcra => "10/s",
            Kind::Fixed => "100/min fixed-window",
            Kind::Sliding => "50/min sliding-window",
            Kind::Slots => "4 concurrent timeout=2s",
        }
    }

    fn limit(self) -> u64 {
        match self {
            Kind::Gcra => 10,
            Kind::Fixed => 100,
            Kind::Sliding => 50,
            Kind::Slots => 4,
        }
    }

    fn period_us(self) -> u64 {
        match self {
            Kind::Gcra => 1_000_000,
            Kind::Fixed | Kind::Sliding => 60_000_000,
            Kind::Slots => 0,
        }
    }

    /// The pause between two requests of one instance on one key.
    fn every(self) -> Duration {
        match self {
            Kind::Gcra => Duration::from_millis(40),
            Kind::Fixed | Kind::Sliding => Duration::from_millis(60),
            Kind::Slots => Duration::from_millis(20),
        }
    }
}

/// The keys: two per rule; `late` keys have traffic only from the kill on.
fn keys() -> Vec<(Kind, String, bool)> {
    let mut keys = Vec::new();
    for kind in Kind::ALL {
        for n in 0..2 {
            let late = n == 1 && matches!(kind, Kind::Fixed | Kind::Sliding);
            keys.push((kind, format!("{}-{n}", kind.tier()), late));
        }
    }
    keys
}

/// One admission: who decided it, when its request was sent and when its handler ran
/// (the decision lies between), and when the handler ended (concurrency).
#[derive(Clone, Debug)]
struct Entry {
    instance: usize,
    key: String,
    by: AdmittedBy,
    sent: u64,
    at: u64,
    end: u64,
}

/// One monotonic clock, read as microseconds on the Unix epoch (Redis's `TIME` on this
/// host reads the same clock, so the windows line up with the store's).
#[derive(Clone, Copy)]
struct Clock {
    start: Instant,
    epoch_us: u64,
}

impl Clock {
    fn new() -> Self {
        let epoch_us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_micros() as u64;
        Self {
            start: Instant::now(),
            epoch_us,
        }
    }

    fn us(&self, at: Instant) -> u64 {
        self.epoch_us + at.duration_since(self.start).as_micros() as u64
    }

    fn now(&self) -> u64 {
        self.us(Instant::now())
    }
}

#[derive(Clone, Copy)]
struct Sent(u64);

type Ledger = Arc<Mutex<Vec<Entry>>>;

/// The app of one instance: a handler that writes its admission into the ledger.
fn handler(
    instance: usize,
    ledger: Ledger,
    clock: Clock,
) -> impl Fn(AxumRequest) -> std::pin::Pin<Box<dyn std::future::Future<Output = &'static str> + Send>>
       + Clone
       + Send
       + Sync
       + 'static {
    move |req: AxumRequest| {
        let ledger = Arc::clone(&ledger);
        Box::pin(async move {
            let at = clock.now();
            let by = req.extensions().get::<Admission>().unwrap().by();
            let sent = req.extensions().get::<Sent>().unwrap().0;
            let key = req.headers()["x-key"].to_str().unwrap().to_owned();
            if req.headers()["x-rule"] == "slots" {
                tokio::time::sleep(HOLD).await;
            }
            ledger.lock().unwrap().push(Entry {
                instance,
                key,
                by,
                sent,
                at,
                end: clock.now(),
            });
            "ok"
        })
    }
}

type Selector = fn(&Request<Body>) -> Option<String>;

fn select(req: &Request<Body>) -> Option<String> {
    req.headers()
        .get("x-rule")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    Module,
    Lua,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Restart {
    WithData,
    Empty,
}

/// What a run recorded: the ledger and the outage's edges.
struct Run {
    entries: Vec<Entry>,
    /// When the kill began.
    down: u64,
    /// When the killed server had exited: a request sent until then may have been decided
    /// by it, before the outage.
    dead: u64,
    /// When the restarted server answered `PING`.
    up: u64,
}

async fn run(path: Path, restart: Restart, handover: bool) -> Run {
    let mut server = match path {
        Path::Module => RedisServer::start_with_module(),
        Path::Lua => RedisServer::start(),
    };
    let clock = Clock::new();
    let ledger: Ledger = Arc::default();
    let mut apps = Vec::new();
    for instance in 0..INSTANCES {
        let store = RedisStore::builder()
            .force_lua(path == Path::Lua)
            .build(&server.url())
            .await
            .unwrap();
        wait_connected(&store).await;
        assert_eq!(store.uses_module(), path == Path::Module);
        let mut builder = RateLimitLayer::builder(store, HeaderKey::new("x-key"))
            .namespace("recovery")
            .fallback_share(NonZeroU32::new(INSTANCES as u32).unwrap())
            .fallback_handover(handover)
            .admission_extension(true)
            .store_timeout(Duration::from_millis(500))
            // Every request reaches a store: the deny cache only ever refuses, so it can
            // only lower the counts, and it would hide from the negative control what
            // the handover changes (a fallback's refusal is cached to the window's end).
            .without_deny_cache()
            .select_tier(select as Selector)
            .default_tier("gcra");
        for kind in Kind::ALL {
            builder = builder.tier(kind.tier(), kind.rules().parse().unwrap());
        }
        let layer = builder.build().unwrap();
        let handle = handler(instance, Arc::clone(&ledger), clock);
        apps.push(Router::new().route("/", get(handle)).layer(layer));
    }

    // Clear of a minute's end, so that the minute rules' windows hold the whole run.
    let run_us = (BEFORE + OUTAGE + AFTER + Duration::from_secs(2)).as_micros() as u64;
    let into_minute = clock.now() % 60_000_000;
    if into_minute + run_us > 60_000_000 {
        tokio::time::sleep(Duration::from_micros(60_000_000 - into_minute + 100_000)).await;
    }

    let stop = Arc::new(AtomicBool::new(false));
    let late_go = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for (instance, app) in apps.iter().enumerate() {
        // Three requests at once per instance on a concurrency key, one on the others.
        let tasks_of = |kind| if kind == Kind::Slots { 3 } else { 1 };
        for (kind, key, late) in keys()
            .into_iter()
            .flat_map(|k| std::iter::repeat_n(k.clone(), tasks_of(k.0)))
        {
            let (app, stop, late_go) = (app.clone(), Arc::clone(&stop), Arc::clone(&late_go));
            tasks.push(tokio::spawn(async move {
                // Spread the instances' requests apart.
                tokio::time::sleep(kind.every() * instance as u32 / INSTANCES as u32).await;
                while !stop.load(Ordering::Relaxed) {
                    if !late || late_go.load(Ordering::Relaxed) {
                        let mut req = Request::get("/")
                            .header("x-key", &key)
                            .header("x-rule", kind.tier())
                            .body(Body::empty())
                            .unwrap();
                        req.extensions_mut().insert(Sent(clock.now()));
                        let res = app.clone().oneshot(req).await.unwrap();
                        let _ = axum::body::to_bytes(res.into_body(), usize::MAX).await;
                    }
                    tokio::time::sleep(kind.every()).await;
                }
            }));
        }
    }

    tokio::time::sleep(BEFORE).await;
    if restart == Restart::WithData {
        let saved = server.command("SAVE").unwrap();
        assert!(saved.starts_with("+OK"), "SAVE answered {saved:?}");
    }
    let down = clock.now();
    server.stop();
    let dead = clock.now();
    late_go.store(true, Ordering::Relaxed);
    tokio::time::sleep(OUTAGE).await;
    tokio::task::block_in_place(|| server.restart());
    let up = clock.now();
    if restart == Restart::WithData {
        let keys = server.command("DBSIZE").unwrap();
        assert_ne!(
            keys.trim(),
            ":0",
            "the data saved before the kill should be back"
        );
    }
    tokio::time::sleep(AFTER).await;
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.unwrap();
    }
    let entries = ledger.lock().unwrap().clone();
    Run {
        entries,
        down,
        dead,
        up,
    }
}

/// What one key's admissions in one window (or interval) are made of.
#[derive(Default, Debug)]
struct Parts {
    /// Admissions that certainly fell in it (sent and handled inside).
    certain: u64,
    /// Decided by the store before the outage (sent before the killed server had exited),
    /// possibly inside.
    store_before: u64,
    /// Decided by a fallback, possibly inside, per instance, before the store first
    /// admitted the key again.
    fallback: [u64; INSTANCES],
    /// Decided by a fallback, possibly inside, once Redis answered again: the fallback
    /// and the store decided side by side (each instance switches back when its own
    /// connection is back).
    lag: u64,
    /// The first time a store admission after the outage may have been decided inside,
    /// and the instance it was for (whose key was handed over before).
    first_store_after: Option<(u64, usize)>,
    /// A store admission after the outage, possibly inside, that its instance may have
    /// decided past its grace (without its share: see `Grace`).
    unguarded: bool,
}

/// Each instance's fallback admissions (every key's), to tell the store's admissions
/// that certainly fell within their instance's grace (`fallback_grace`, the default:
/// after the instance's last fallback decision, a store admission must fit its share
/// too). Those do not make `lag`: the shares of the fleet, fallbacks and grace alike,
/// add up to the limit.
struct Grace {
    fallbacks: [Vec<(u64, u64)>; INSTANCES],
}

impl Grace {
    fn new(run: &Run) -> Self {
        let mut fallbacks: [Vec<(u64, u64)>; INSTANCES] = Default::default();
        for e in &run.entries {
            if e.by == AdmittedBy::Fallback {
                fallbacks[e.instance].push((e.sent, e.at));
            }
        }
        Self { fallbacks }
    }

    /// Whether a store admission was certainly decided within its instance's grace: a
    /// fallback admission of the instance, decided before it was sent, whose grace
    /// outlasts its answer (by the clocks' margin).
    fn guarded(&self, e: &Entry) -> bool {
        let grace = DEFAULT_FALLBACK_GRACE.as_micros() as u64;
        self.fallbacks[e.instance]
            .iter()
            .any(|&(sent, at)| at <= e.sent && e.at + CLOCK_MARGIN_US < sent + grace)
    }
}

/// Each instance's switch back for a key: when the first request the store decided
/// after the outage ran (its key was handed over before).
fn switches(entries: &[&Entry], up: u64) -> [Option<u64>; INSTANCES] {
    let mut switched = [None; INSTANCES];
    for e in entries {
        if e.by == AdmittedBy::Store && e.sent >= up {
            let s = &mut switched[e.instance];
            *s = Some(s.map_or(e.at, |t: u64| t.min(e.at)));
        }
    }
    switched
}

/// The `lag` of a window: the fallback admissions of `parts` the store had not been
/// handed when it admitted inside (those made once Redis answered again, and those of
/// instances that switched back after the store's first admission inside), when a store
/// admission inside may have been decided past its instance's grace; else none.
fn lagging(parts: &Parts, switched: &[Option<u64>; INSTANCES]) -> u64 {
    if !parts.unguarded {
        return 0;
    }
    parts.lag
        + (0..INSTANCES)
            .filter(|&i| match (switched[i], parts.first_store_after) {
                (_, None) | (None, Some(_)) => true,
                (Some(s), Some((first, by))) => by != i && s > first,
            })
            .map(|i| parts.fallback[i])
            .sum::<u64>()
}

/// When the store first admitted the key after the outage, for any instance, and for
/// which instance.
fn first_store(entries: &[&Entry], up: u64) -> (u64, usize) {
    entries
        .iter()
        .filter(|e| e.by == AdmittedBy::Store && e.sent >= up)
        .map(|e| (e.sent, e.instance))
        .min()
        .unwrap_or((u64::MAX, INSTANCES))
}

fn parts_in(entries: &[&Entry], from: u64, to: u64, run: &Run, grace: &Grace) -> Parts {
    let (dead, up) = (run.dead, run.up);
    let mut parts = Parts::default();
    for e in entries {
        let certain = e.sent >= from && e.at < to;
        let maybe = e.at >= from && e.sent < to;
        if certain {
            parts.certain += 1;
        }
        if !maybe {
            continue;
        }
        match e.by {
            AdmittedBy::Store if e.sent <= dead => parts.store_before += 1,
            AdmittedBy::Store if e.sent >= up => {
                parts.unguarded |= !grace.guarded(e);
                let t = (e.sent.max(from), e.instance);
                parts.first_store_after = Some(parts.first_store_after.map_or(t, |f| f.min(t)));
            }
            AdmittedBy::Fallback if e.at >= up => parts.lag += 1,
            AdmittedBy::Fallback => parts.fallback[e.instance] += 1,
            _ => {}
        }
    }
    parts
}

/// Sweeps every window of every key and answers the violations of the bound, one line
/// each, and a summary line per key.
fn check(run: &Run) -> (Vec<String>, String) {
    let grace = Grace::new(run);
    let mut violations = Vec::new();
    let mut summary = String::new();
    let mut by_key: BTreeMap<(Kind, String), Vec<&Entry>> = BTreeMap::new();
    let kinds: BTreeMap<String, Kind> = keys().into_iter().map(|(k, key, _)| (key, k)).collect();
    for e in &run.entries {
        by_key
            .entry((kinds[&e.key], e.key.clone()))
            .or_default()
            .push(e);
    }
    for ((kind, key), entries) in &by_key {
        let (down, up) = (run.down, run.up);
        let switched = switches(entries, up);
        let limit = kind.limit();
        let fallback: u64 = entries
            .iter()
            .filter(|e| e.by == AdmittedBy::Fallback)
            .count() as u64;
        let store_after = entries
            .iter()
            .filter(|e| e.by == AdmittedBy::Store && e.sent >= up)
            .count();
        let mut worst = (0i64, String::new());
        let mut note = |excess: i64, what: String| {
            if excess > worst.0 || worst.1.is_empty() {
                worst = (excess, what.clone());
            }
            if excess > 0 {
                violations.push(format!("{key} ({}): {what}", kind.rules()));
            }
        };
        match kind {
            // Every aligned window (precision 1: the counter's window is the minute).
            Kind::Fixed | Kind::Sliding => {
                let period = kind.period_us();
                let first = entries.iter().map(|e| e.sent).min().unwrap() / period;
                let last = entries.iter().map(|e| e.at).max().unwrap() / period;
                for w in first..=last {
                    let (from, to) = (w * period, (w + 1) * period);
                    let parts = parts_in(entries, from, to, run, &grace);
                    let before = if to > down { parts.store_before } else { 0 };
                    let pend = lagging(&parts, &switched);
                    let bound = limit + before + pend;
                    note(
                        parts.certain as i64 - bound as i64,
                        format!(
                            "window {w}: {} admitted, bound {bound} = {limit} + {before} \
                             before the outage + {pend} pending",
                            parts.certain
                        ),
                    );
                }
            }
            // Every interval between two admissions: at most the burst plus the rate
            // times the interval.
            Kind::Gcra => {
                let mut sorted = entries.clone();
                sorted.sort_by_key(|e| e.sent);
                for (i, a) in sorted.iter().enumerate() {
                    for b in &sorted[i..] {
                        let (from, to) = (a.sent, b.at + 1);
                        let parts = parts_in(entries, from, to, run, &grace);
                        let rate = ((to - from) * limit).div_ceil(kind.period_us());
                        let before = if to > down { parts.store_before } else { 0 };
                        let pend = lagging(&parts, &switched);
                        let bound = limit + rate + before + pend;
                        note(
                            parts.certain as i64 - bound as i64,
                            format!(
                                "[{from}, {to}): {} admitted, bound {bound} = {limit} + {rate} \
                                 + {before} before the outage + {pend} pending",
                                parts.certain
                            ),
                        );
                    }
                }
            }
            // Every instant a request started: in flight at most N, plus the store's
            // requests from before the outage, plus the fallbacks' requests admitted once
            // Redis answered again, or by instances that switched back after the store
            // first admitted the key again.
            Kind::Slots => {
                let (first_store, first_by) = first_store(entries, up);
                for e in entries {
                    let t = e.at;
                    let running: Vec<&&Entry> =
                        entries.iter().filter(|o| o.at <= t && t < o.end).collect();
                    let before = running
                        .iter()
                        .filter(|o| o.by == AdmittedBy::Store && o.sent <= run.dead)
                        .count() as u64;
                    // Only beside a store admission past its instance's grace.
                    let unguarded = running
                        .iter()
                        .any(|o| o.by == AdmittedBy::Store && o.sent >= up && !grace.guarded(o));
                    let pend = running
                        .iter()
                        .filter(|_| unguarded)
                        .filter(|o| o.by == AdmittedBy::Fallback)
                        .filter(|o| {
                            o.at >= up
                                || (o.instance != first_by
                                    && switched[o.instance].is_none_or(|s| s > first_store))
                        })
                        .filter(|_| first_store != u64::MAX)
                        .count() as u64;
                    let bound = limit + before + pend;
                    note(
                        running.len() as i64 - bound as i64,
                        format!(
                            "at {t}: {} in flight, bound {bound} = {limit} + {before} before the \
                             outage + {pend} pending",
                            running.len()
                        ),
                    );
                }
            }
        }
        let switch_ms: Vec<String> = switched
            .iter()
            .map(|s| s.map_or("-".into(), |s| format!("{}", s.saturating_sub(up) / 1000)))
            .collect();
        let _ = writeln!(
            summary,
            "{key:10} {:22} {:4} admitted, {fallback:3} by the fallbacks, {store_after:3} by \
             the store after; closest: {} ({}); switch back (ms after up): {}",
            kind.rules(),
            entries.len(),
            worst.0,
            worst.1,
            switch_ms.join(" ")
        );
    }
    (violations, summary)
}

async fn holds(path: Path, restart: Restart) {
    let _serial = SERIAL.lock().await;
    let run = run(path, restart, true).await;
    let (violations, summary) = check(&run);
    eprintln!("{path:?}, restart {restart:?}, handover on:\n{summary}");
    let fallback = run
        .entries
        .iter()
        .filter(|e| e.by == AdmittedBy::Fallback)
        .count();
    assert!(
        fallback > 0,
        "the fallbacks admitted nothing: no outage was seen"
    );
    assert!(
        violations.is_empty(),
        "{} violations of the bound:\n{}",
        violations.len(),
        violations.join("\n")
    );
}

async fn fails_without_handover(path: Path, restart: Restart) {
    let _serial = SERIAL.lock().await;
    let run = run(path, restart, false).await;
    let (violations, summary) = check(&run);
    eprintln!("{path:?}, restart {restart:?}, handover OFF:\n{summary}");
    assert!(
        !violations.is_empty(),
        "the negative control passed the checker: it should not"
    );
    eprintln!(
        "{} violations, e.g.:\n{}",
        violations.len(),
        violations[..violations.len().min(5)].join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn module_restarted_with_its_data() {
    holds(Path::Module, Restart::WithData).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn module_restarted_empty() {
    holds(Path::Module, Restart::Empty).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lua_restarted_with_its_data() {
    holds(Path::Lua, Restart::WithData).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lua_restarted_empty() {
    holds(Path::Lua, Restart::Empty).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_handover_the_checker_fails_module() {
    fails_without_handover(Path::Module, Restart::WithData).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_handover_the_checker_fails_lua() {
    fails_without_handover(Path::Lua, Restart::Empty).await;
}

/// Four instances whose fallbacks admitted one request on each of `keys` keys of their
/// own (`100/min fixed-window`) while Redis was down; Redis restarted empty.
async fn down_with_usage(path: Path, keys: usize) -> (RedisServer, Vec<Router>, Ledger, Clock) {
    let mut server = match path {
        Path::Module => RedisServer::start_with_module(),
        Path::Lua => RedisServer::start(),
    };
    let clock = Clock::new();
    let ledger: Ledger = Arc::default();
    let mut apps = Vec::new();
    for instance in 0..INSTANCES {
        let store = RedisStore::builder()
            .force_lua(path == Path::Lua)
            .build(&server.url())
            .await
            .unwrap();
        wait_connected(&store).await;
        let layer = RateLimitLayer::builder(store, HeaderKey::new("x-key"))
            .rules("100/min fixed-window")
            .unwrap()
            .namespace("switch")
            .fallback_share(NonZeroU32::new(INSTANCES as u32).unwrap())
            .admission_extension(true)
            .without_deny_cache()
            .build()
            .unwrap();
        let handle = handler(instance, Arc::clone(&ledger), clock);
        apps.push(Router::new().route("/", get(handle)).layer(layer));
    }
    server.stop();
    for (instance, app) in apps.iter().enumerate() {
        for k in 0..keys {
            let req = Request::get("/")
                .header("x-key", format!("{instance}-{k}"))
                .header("x-rule", "fixed")
                .extension(Sent(clock.now()))
                .body(Body::empty())
                .unwrap();
            let res = app.clone().oneshot(req).await.unwrap();
            assert_eq!(res.status(), http::StatusCode::OK);
        }
    }
    (server, apps, ledger, clock)
}

/// The `INFO` lines the handovers log, kept for the figures.
#[derive(Clone, Default)]
struct Lines(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Lines {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Lines {
    /// The handover lines since the last call.
    fn take(&self) -> Vec<String> {
        let text = String::from_utf8(std::mem::take(&mut *self.0.lock().unwrap())).unwrap();
        text.lines()
            .filter(|l| l.contains("handed it what the fallback admitted"))
            .map(|l| {
                let fields = l.split("again ").nth(1).unwrap_or(l);
                fields.replace("namespace=\"switch\" ", "")
            })
            .collect()
    }
}

/// The figures of `BENCHMARKS.md` ("Switching back after an outage"): what a handover
/// costs the store, and how long after Redis answers the first check is decided by it.
/// Run with `cargo test -p ratelimit-tower --all-features --test recovery
/// switch_figures -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measures; run by hand for BENCHMARKS.md"]
async fn switch_figures() {
    let _serial = SERIAL.lock().await;
    let lines = Lines::default();
    let writer = lines.clone();
    let _ = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .try_init();
    for path in [Path::Module, Path::Lua] {
        // The handover alone: no traffic after the restart, so every call Redis counts
        // is the stores' (their setup, the probes and the handover).
        for keys in [1, 1_000] {
            let (mut server, _apps, _ledger, _clock) = down_with_usage(path, keys).await;
            lines.take();
            tokio::task::block_in_place(|| server.restart());
            let up = Instant::now();
            let mut seen = Vec::new();
            while seen.len() < INSTANCES && up.elapsed() < Duration::from_secs(10) {
                tokio::time::sleep(Duration::from_millis(1)).await;
                seen.extend(lines.take());
            }
            let done = up.elapsed();
            // Whatever else the stores send (their reconnections) settles first.
            tokio::time::sleep(Duration::from_millis(500)).await;
            let stats = server.command("INFO commandstats").unwrap();
            let calls: Vec<String> = stats
                .lines()
                .filter(|l| l.starts_with("cmdstat_"))
                .map(|l| {
                    let (name, rest) = l.split_once(':').unwrap();
                    let n = rest.split(',').next().unwrap();
                    format!("{}: {}", &name[8..], n.trim_start_matches("calls="))
                })
                .collect();
            eprintln!(
                "{path:?}: {INSTANCES} instances x {keys} keys with usage, Redis restarted \
                 empty: the last handover done {done:?} after it answered; the handovers:\n  \
                 {}\n  Redis's calls since it answered: {}",
                seen.join("\n  "),
                calls.join(", ")
            );
        }
        // The first check Redis decides: each instance sends a request every 5 ms on a
        // key its fallback admitted on, Redis down about 0 s and 3 s (the store's
        // reconnection pauses grow with the outage).
        for outage in [Duration::ZERO, OUTAGE] {
            let (mut server, apps, ledger, clock) = down_with_usage(path, 1).await;
            let stop = Arc::new(AtomicBool::new(false));
            let mut tasks = Vec::new();
            for (instance, app) in apps.iter().enumerate() {
                let (app, stop) = (app.clone(), Arc::clone(&stop));
                tasks.push(tokio::spawn(async move {
                    while !stop.load(Ordering::Relaxed) {
                        let req = Request::get("/")
                            .header("x-key", format!("{instance}-0"))
                            .header("x-rule", "fixed")
                            .extension(Sent(clock.now()))
                            .body(Body::empty())
                            .unwrap();
                        let _ = app.clone().oneshot(req).await.unwrap();
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                }));
            }
            tokio::time::sleep(outage).await;
            tokio::task::block_in_place(|| server.restart());
            let up = clock.now();
            tokio::time::sleep(Duration::from_secs(4)).await;
            stop.store(true, Ordering::Relaxed);
            for task in tasks {
                task.await.unwrap();
            }
            let entries = ledger.lock().unwrap();
            let firsts: Vec<String> = (0..INSTANCES)
                .map(|i| {
                    entries
                        .iter()
                        .filter(|e| e.instance == i && e.by == AdmittedBy::Store && e.sent >= up)
                        .map(|e| e.at - up)
                        .min()
                        .map_or("none".into(), |us| format!("{} ms", us / 1000))
                })
                .collect();
            eprintln!(
                "{path:?}, down {outage:?} plus the restart: first check decided by Redis \
                 after it answered, per instance: {}",
                firsts.join(", ")
            );
            lines.take();
        }
    }
}
