//! The acceptance rig of multiregion.md §4: three regions, three instances each, the nine
//! scenarios (and a sliding log, g = 0) held to the stated bound on the Lua functions and
//! on the native module, and both negative controls caught by the same checker.
//!
//! Time is compressed: W = 1 s, ℓ_i = 50 ms, ℓ_g = 250 ms, 30 ± 10 ms one way between
//! regions. Each scenario runs `RATELIMIT_REGIONS_SECONDS` (default 5) seconds; run with
//! `--nocapture` for the report (utilisation, latency, cross-region calls). The region
//! stores rebalance their shares (T_rb = 1 s, the default; `RATELIMIT_REGIONS_REBALANCE`
//! = a T_rb in milliseconds, or `off`).

mod rig;

use std::sync::Arc;
use std::time::Duration;

use ratelimit_core::RuleSet;
use ratelimit_redis::redis;
use ratelimit_redis::testing::LinkMode;
use ratelimit_regions::Regions;
use rig::{
    check, credit_first_deciders, diff, drive, key_name, percentile, reference, region_deciders,
    seconds, total_stats, uncoordinated_deciders, Bound, Decide, Demand, Event, Keys, Load, Rig,
    Run, LEASE_G, LEASE_I, R,
};

/// One rig at a time: they are timed, and the machine has two cores.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const PER_REGION: usize = 3;

fn regions() -> Regions {
    Regions::even(["r0", "r1", "r2"])
        .unwrap()
        .pooled(0.5)
        .unwrap()
        .pool_lease(LEASE_G)
}

/// (1 − g)·ℓ_i + g·ℓ_g for g = 0.5.
fn slack_us(g: f64) -> u64 {
    ((1.0 - g) * LEASE_I.as_micros() as f64 + g * LEASE_G.as_micros() as f64) as u64
}

fn steady(total: f64) -> Demand {
    Arc::new(move |_, _| total / (R * PER_REGION) as f64)
}

struct Scenario {
    load: Load,
    events: Vec<(f64, Event)>,
    extra: u64,
    /// Utilisation this scenario must reach (steady load: 0.9).
    min_utilisation: f64,
}

fn event(f: impl FnMut(&mut Rig) + Send + 'static) -> Event {
    Box::new(f)
}

fn scenarios(tag: &str) -> Vec<Scenario> {
    let s = seconds();
    let gcra: RuleSet = "200/s gcra burst=200".parse().unwrap();
    let fixed: RuleSet = "200/s fixed-window".parse().unwrap();
    let regions = regions();
    let load = |n: &'static str, rules: &RuleSet, demand: Demand| Load {
        name: n,
        rules: rules.clone(),
        key_prefix: format!("{tag}-{n}"),
        keys: Keys::One,
        demand,
        window_bursts: None,
        seconds: s,
    };
    let home_of = |n: &str| regions.home(&key_name(&format!("{tag}-{n}"), 0));
    let (cut0, cut1) = (0.3 * s, 0.7 * s);
    let mut out = Vec::new();

    out.push(Scenario {
        load: load("1-steady", &gcra, steady(300.0)),
        events: vec![],
        extra: 0,
        min_utilisation: 0.9,
    });

    let moving: Demand = Arc::new(|t, region| {
        let hot = (t / 2.0) as usize % R;
        let share = if region == hot { 0.8 } else { 0.1 };
        300.0 * share / PER_REGION as f64
    });
    // The buckets are held to the same formula as GCRA (B = the capacity).
    let token: RuleSet = "200/s token-bucket capacity=200".parse().unwrap();
    let meter: RuleSet = "200/s leaky-bucket mode=meter capacity=200"
        .parse()
        .unwrap();
    out.push(Scenario {
        load: load("2-moving", &token, moving),
        events: vec![],
        extra: 0,
        min_utilisation: 0.0,
    });

    let mut bursts = load("3-bursts", &fixed, steady(0.0));
    bursts.window_bursts = Some(40);
    out.push(Scenario {
        load: bursts,
        events: vec![],
        extra: 0,
        min_utilisation: 0.0,
    });

    let away = (home_of("4-nonhome-cut") + 1) % R;
    out.push(Scenario {
        load: load("4-nonhome-cut", &gcra, steady(300.0)),
        events: vec![
            (
                cut0,
                event(move |rig| rig.isolate(away, LinkMode::BlackHole)),
            ),
            (cut1, event(|rig| rig.heal())),
        ],
        extra: 0,
        min_utilisation: 0.0,
    });

    let home = home_of("5-home-cut");
    out.push(Scenario {
        load: load("5-home-cut", &gcra, steady(300.0)),
        events: vec![
            (
                cut0,
                event(move |rig| rig.isolate(home, LinkMode::BlackHole)),
            ),
            (cut1, event(|rig| rig.heal())),
        ],
        extra: 0,
        min_utilisation: 0.0,
    });

    let mut flaps = Vec::new();
    let mut k = 1;
    while 0.3 * f64::from(k) < s - 0.3 {
        let region = (k as usize / 2) % R;
        flaps.push((
            0.3 * f64::from(k),
            if k % 2 == 1 {
                event(move |rig: &mut Rig| rig.isolate(region, LinkMode::BlackHole))
            } else {
                event(|rig: &mut Rig| rig.heal())
            },
        ));
        k += 1;
    }
    out.push(Scenario {
        load: load("6-flapping", &meter, steady(300.0)),
        events: flaps,
        extra: 0,
        min_utilisation: 0.0,
    });

    let home = home_of("7-resets");
    let mut resets = Vec::new();
    let mut t = 0.5;
    while t < s - 0.5 {
        resets.push((
            t,
            event(move |rig: &mut Rig| {
                for other in 0..R {
                    if other != home {
                        rig.link(other, home).reset();
                        rig.link(home, other).reset();
                    }
                }
            }),
        ));
        t += 0.07;
    }
    out.push(Scenario {
        load: load("7-resets", &gcra, steady(300.0)),
        events: resets,
        extra: 0,
        min_utilisation: 0.0,
    });

    let restarted = (home_of("8-restart") + 1) % R;
    let base_burst = regions
        .split(&gcra)
        .unwrap()
        .base(restarted)
        .unwrap()
        .rules()[0]
        .capacity();
    out.push(Scenario {
        load: load("8-restart", &gcra, steady(300.0)),
        events: vec![(
            0.5 * s,
            event(move |rig: &mut Rig| rig.servers[restarted].restart()),
        )],
        // The stated caveat: a region's store that loses its state adds f_r·B, once.
        extra: base_burst,
        min_utilisation: 0.0,
    });

    let mut zipf = load(
        "9-zipf",
        &"20/s gcra burst=20".parse().unwrap(),
        steady(600.0),
    );
    zipf.keys = Keys::Zipf { n: 200, s: 1.1 };
    out.push(Scenario {
        load: zipf,
        events: vec![],
        extra: 0,
        min_utilisation: 0.0,
    });

    // Beyond the nine: all the demand in one region, moving every 2 s (the other
    // regions idle): what rebalancing is for.
    let sun: Demand = Arc::new(|t, region| {
        if (t / 2.0) as usize % R == region {
            300.0 / PER_REGION as f64
        } else {
            0.0
        }
    });
    out.push(Scenario {
        load: load("11-follow-the-sun", &gcra, sun),
        events: vec![],
        extra: 0,
        min_utilisation: 0.0,
    });

    // Beyond the nine: a sliding log pools nothing (g = 0) and holds L in any window,
    // with a non-home region black-holed for a while (it needs no other region).
    let log: RuleSet = "200/s sliding-log".parse().unwrap();
    let away = (home_of("10-sliding-log") + 1) % R;
    out.push(Scenario {
        load: load("10-sliding-log", &log, steady(300.0)),
        events: vec![
            (
                cut0,
                event(move |rig| rig.isolate(away, LinkMode::BlackHole)),
            ),
            (cut1, event(|rig| rig.heal())),
        ],
        extra: 0,
        min_utilisation: 0.0,
    });
    out
}

struct Report {
    admitted: u64,
    reference: u64,
    violations: u64,
    margin: i64,
}

async fn report(
    name: &str,
    path: &str,
    run: &Run,
    rules: &RuleSet,
    prefix: &str,
    bound: Bound,
) -> Report {
    let verdict = check(run, rules, bound);
    let exact = reference(run, rules, prefix).await;
    let admitted = run.admissions.len() as u64;
    println!(
        "{path:6} {name:16} decisions {:6} admitted {:5} exact {:5} utilisation {:.3} \
         violations {} worst margin {:4} p50 {:6} us p99 {:6} us errors {}",
        run.decisions,
        admitted,
        exact,
        admitted as f64 / exact.max(1) as f64,
        verdict.violations,
        verdict.worst_margin,
        percentile(&run.latencies_us, 0.5),
        percentile(&run.latencies_us, 0.99),
        run.errors,
    );
    Report {
        admitted,
        reference: exact,
        violations: verdict.violations,
        margin: verdict.worst_margin,
    }
}

async fn all_scenarios(module: bool) {
    let _serial = SERIAL.lock().await;
    let path = if module { "module" } else { "lua" };
    let mut rig = Rig::start(module).await;
    let regions = regions();
    let instances = rig.instances(&regions, PER_REGION).await;
    let mut failures = Vec::new();
    let only = std::env::var("RATELIMIT_REGIONS_ONLY").unwrap_or_default();
    for scenario in scenarios(path) {
        if !scenario.load.name.contains(only.as_str()) {
            continue;
        }
        let before = total_stats(&instances);
        let deciders = region_deciders(&instances, &scenario.load.rules);
        let run = drive(&mut rig, &scenario.load, deciders, scenario.events).await;
        let mut held = 0;
        for i in &instances {
            held += i.store.flush().await;
        }
        let stats = diff(before, total_stats(&instances));
        let bound = Bound {
            slack_us: slack_us(regions.pooled_fraction()),
            extra: scenario.extra,
        };
        let r = report(
            scenario.load.name,
            path,
            &run,
            &scenario.load.rules,
            &scenario.load.key_prefix,
            bound,
        )
        .await;
        println!(
            "{path:6} {:16} base {} pool {} reservations {} (failed {}) units reserved {} \
             refunded {} (held at the end {held}) refund failed {}; transfers asked {} granted {} \
             failed {} units moved {} lost {}; cross-region calls per 1,000 decisions {:.1}",
            scenario.load.name,
            stats.base_admitted,
            stats.pool_admitted,
            stats.reservations,
            stats.reservations_failed,
            stats.units_reserved,
            stats.units_refunded,
            stats.units_refund_failed,
            stats.transfers_asked,
            stats.transfers_granted,
            stats.transfers_failed,
            stats.units_moved,
            stats.units_lost,
            stats.cross_region_calls as f64 * 1000.0 / stats.decisions.max(1) as f64,
        );
        if r.violations > 0 {
            failures.push(format!(
                "{}: {} violations (worst margin {})",
                scenario.load.name, r.violations, r.margin
            ));
        }
        let utilisation = r.admitted as f64 / r.reference.max(1) as f64;
        if utilisation < scenario.min_utilisation {
            failures.push(format!(
                "{}: utilisation {utilisation:.3} below {}",
                scenario.load.name, scenario.min_utilisation
            ));
        }
        assert!(
            rig.servers.iter().all(|s| s.is_running()),
            "a region's server died"
        );
    }
    assert!(failures.is_empty(), "{path}: {failures:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nine_scenarios_hold_the_bound_on_lua() {
    all_scenarios(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nine_scenarios_hold_the_bound_on_the_module() {
    all_scenarios(true).await;
}

/// Design C of multiregion.md: a G-counter per fixed window (region → count) in every
/// region's Redis, admitted locally against the sum, own counts copied to the other
/// regions every 50 ms with a max-merge.
const ADMIT: &str = r"
local sum = 0
for _, v in ipairs(redis.call('HVALS', KEYS[1])) do sum = sum + tonumber(v) end
if sum + 1 > tonumber(ARGV[2]) then return 0 end
redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
redis.call('PEXPIRE', KEYS[1], 5000)
return 1
";
const MERGE: &str = r"
local cur = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
if tonumber(ARGV[2]) > cur then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  redis.call('PEXPIRE', KEYS[1], 5000)
end
return 1
";

fn window_key(key: &[u8], period_us: u64) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64;
    format!("gc:{}:{}", String::from_utf8_lossy(key), now / period_us)
}

async fn connection(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_controls_fail_the_checker() {
    let _serial = SERIAL.lock().await;
    let s = seconds();
    let mut rig = Rig::start(false).await;
    let regions = regions();
    let instances = rig.instances(&regions, PER_REGION).await;

    // 1. Every region limits on its own: about R·L.
    let gcra: RuleSet = "200/s gcra burst=200".parse().unwrap();
    let load = Load {
        name: "uncoordinated",
        rules: gcra.clone(),
        key_prefix: "nc-uncoordinated".into(),
        keys: Keys::One,
        demand: steady(700.0),
        window_bursts: None,
        seconds: s,
    };
    let run = drive(
        &mut rig,
        &load,
        uncoordinated_deciders(&instances, &gcra),
        vec![],
    )
    .await;
    let bound = Bound {
        slack_us: slack_us(0.5),
        extra: 0,
    };
    let r = report("uncoordinated", "lua", &run, &gcra, &load.key_prefix, bound).await;
    assert!(
        r.violations > 0,
        "the checker must catch R independent limiters"
    );
    let ratio = r.admitted as f64 / r.reference as f64;
    println!("uncoordinated: admitted {ratio:.2} x what one exact limiter admits (R = {R})");
    assert!(
        ratio > 2.0,
        "R independent limiters admit about R·L, got {ratio:.2}"
    );

    // 2. A broken rebalancing: a recipient that credits its share before the donor's
    //    reply. Every region is overloaded, so donors have nothing free: the protocol
    //    moves (nearly) nothing and holds the bound, and crediting first creates what
    //    the donors refuse.
    let overload = |name: &'static str| Load {
        name,
        rules: gcra.clone(),
        key_prefix: format!("nc-{name}"),
        keys: Keys::One,
        demand: steady(600.0),
        window_bursts: None,
        seconds: s,
    };
    let honest = overload("donor-first");
    let before = total_stats(&instances);
    let run = drive(
        &mut rig,
        &honest,
        region_deciders(&instances, &gcra),
        vec![],
    )
    .await;
    let moved = diff(before, total_stats(&instances));
    let r = report("donor-first", "lua", &run, &gcra, &honest.key_prefix, bound).await;
    println!(
        "donor-first, every region overloaded: transfers asked {} granted {}, units moved {}",
        moved.transfers_asked, moved.transfers_granted, moved.units_moved
    );
    assert_eq!(r.violations, 0, "the protocol holds the bound");
    let broken = overload("credit-first");
    let deciders = credit_first_deciders(&rig, &instances, &regions, &gcra).await;
    let run = drive(&mut rig, &broken, deciders, vec![]).await;
    let r = report(
        "credit-first",
        "lua",
        &run,
        &gcra,
        &broken.key_prefix,
        bound,
    )
    .await;
    assert!(
        r.violations > 0,
        "the checker must catch a recipient that credits before the donor's reply"
    );

    // 3. Merged counters (design C) under a partition of region 1 for the whole run.
    let fixed: RuleSet = "200/s fixed-window".parse().unwrap();
    let period = fixed.rules()[0].period_us();
    let limit = fixed.rules()[0].limit();
    let mut locals = Vec::new();
    let mut remotes = Vec::new();
    for from in 0..R {
        locals.push(connection(&rig.url(from, from)).await);
        let mut row = Vec::new();
        for to in 0..R {
            row.push(if to == from {
                None
            } else {
                Some(connection(&rig.url(from, to)).await)
            });
        }
        remotes.push(row);
    }
    let key = key_name("nc-merged", 0);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut replicators = Vec::new();
    for from in 0..R {
        let mut local = locals[from].clone();
        let row = remotes[from].clone();
        let stop = Arc::clone(&stop);
        let key = key.clone();
        replicators.push(tokio::spawn(async move {
            let merge = redis::Script::new(MERGE);
            // The longest round of this replicator: part of the sync delay D.
            let mut longest = Duration::ZERO;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let round = std::time::Instant::now();
                tokio::time::sleep(Duration::from_millis(50)).await;
                let wk = window_key(&key, period);
                let own: Option<u64> = redis::cmd("HGET")
                    .arg(&wk)
                    .arg(from)
                    .query_async(&mut local)
                    .await
                    .unwrap_or(None);
                if let Some(own) = own {
                    // Sent, not awaited: a black-holed link must not hold up the next
                    // round on a live one.
                    for conn in row.iter().flatten() {
                        let (mut conn, merge, wk) = (conn.clone(), merge.clone(), wk.clone());
                        tokio::spawn(async move {
                            let mut invocation = merge.key(&wk);
                            invocation.arg(from).arg(own);
                            let call = invocation.invoke_async::<i64>(&mut conn);
                            let _ = tokio::time::timeout(Duration::from_millis(500), call).await;
                        });
                    }
                }
                longest = longest.max(round.elapsed());
            }
            longest
        }));
    }
    let deciders: Vec<(usize, usize, Decide)> = instances
        .iter()
        .map(|i| {
            let conn = locals[i.region].clone();
            let region = i.region;
            let decide: Decide = Arc::new(move |key: Vec<u8>| {
                let mut conn = conn.clone();
                Box::pin(async move {
                    let admitted: i64 = redis::Script::new(ADMIT)
                        .key(window_key(&key, period))
                        .arg(region)
                        .arg(limit)
                        .invoke_async(&mut conn)
                        .await
                        .map_err(|e| e.to_string())?;
                    Ok(admitted == 1)
                })
            });
            (i.region, i.index, decide)
        })
        .collect();
    let load = Load {
        name: "merged-partition",
        rules: fixed.clone(),
        key_prefix: "nc-merged".into(),
        keys: Keys::One,
        demand: steady(600.0),
        window_bursts: None,
        seconds: s,
    };
    rig.isolate(1, LinkMode::BlackHole);
    let run = drive(&mut rig, &load, deciders, vec![]).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut round = Duration::ZERO;
    for r in replicators {
        round = round.max(r.await.unwrap());
    }
    let r = report(
        "merged-partition",
        "lua",
        &run,
        &fixed,
        &load.key_prefix,
        bound,
    )
    .await;
    assert!(
        r.violations > 0,
        "the checker must catch merged counters under a partition"
    );
    // C's own formula under a partition into k = 2 sides: k·L per window, plus what the
    // other regions of a side admit within one sync delay D (the longest replicator
    // round, plus 40 ms one way and 10 ms for the call) at ρ = 200/s each.
    let d = round + Duration::from_millis(50);
    let own = Bound {
        slack_us: 0,
        extra: limit + (R as u64 - 1) * (200.0 * d.as_secs_f64()).ceil() as u64,
    };
    let c = check(&run, &fixed, own);
    println!(
        "merged-partition against its own formula (2L + (R-1)·ρ·D per window, D = {d:?}): violations {} worst margin {}",
        c.violations, c.worst_margin
    );
    assert_eq!(c.violations, 0, "design C stays within its own formula");
}
