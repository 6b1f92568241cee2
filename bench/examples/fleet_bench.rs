//! Fleet load: several `RedisStore` instances (the app servers of a fleet) sharing limits
//! through a 3-master Redis Cluster started on this machine, on Zipf-distributed keys.
//!
//! ```sh
//! cargo run --release -p ratelimit-bench --example fleet_bench
//! ```
//!
//! Each instance is a store with its own cluster connection, driven by `TASKS` tokio
//! tasks that each check one key at a time as fast as answers come back, for `DURATION`
//! seconds. Keys are drawn from `KEYS` client keys with a Zipf law of exponent `ZIPF_S`
//! (key k is drawn with probability proportional to 1/k^s): a few hot keys, a long tail.
//!
//! Printed per run:
//!
//! * decisions/s over the whole fleet;
//! * Redis CPU per decision: each master's `used_cpu_user + used_cpu_sys` (from `INFO
//!   cpu`) over the run, divided by every decision of the fleet, per master and summed;
//!   with what that cost allows: the decisions/s 3 masters could serve with a core each,
//!   if the load spread as it did here (the busiest master is the limit) and if it spread
//!   evenly;
//! * Redis calls per decision (`FCALL`, `EVALSHA`, the module's `RATELIMIT.CHECK*` and
//!   its edits, `RELEASE`, `RENEW`, `GIVE_BACK`, `DEBIT` and `REFUND`, from `INFO
//!   commandstats`, all masters);
//! * Redis socket reads and writes per decision (`total_reads_processed`,
//!   `total_writes_processed`, all masters) and the kernel's share of the masters' CPU:
//!   pipelined calls share a read and a write, so these, more than the calls, set what a
//!   decision costs Redis outside its command;
//! * slot checks per decision: the `EXISTS` calls (all masters) by which the module's
//!   per-node batches ask whether the node serves a check's slot (one per slot per call
//!   once the slot proves stable);
//! * app CPU per decision: this process's user + system time (all instances) per decision;
//! * admitted against the bound: for the rule `RULE` (a GCRA rule; burst B, rate r), no key
//!   may be admitted more than B + r x (elapsed + lease) over the run. The run counts the
//!   keys above that bound (must be 0) and reports the fleet's admitted total against the
//!   most an exact limiter could have admitted of what was offered, sum over keys of
//!   min(offered, B + r x elapsed).
//!
//! Releases and settles go as the layer sends them: handed to the store, which queues
//! them with its next batch and reads their replies itself (`Store::release_detached`,
//! `Store::settle_detached`), so that the task's next check does not wait for them.
//! `DETACHED=0` spawns each as a task that awaits the store's answer instead (what the
//! layer does for a store that does not take them).
//!
//! Settings (environment): `INSTANCES` (4), `TASKS` per instance (16), `DURATION` seconds
//! (10), `KEYS` (100000), `ZIPF_S` (1.1), `RULE` (`100/s gcra burst=50`), `CONCURRENT`
//! (0; N: a `N concurrent timeout=60s` rule beside `RULE`, each slot an admitted check
//! takes released at once), `SETTLE` (0; 1: each check charges an estimate of 2 units
//! and each admitted one is settled at once with an actual drawn from 0 to 4, as a
//! metered gateway does; the run prints how many settles it made, and the count of keys
//! over the bound does not apply, since a settle gives units back), `POOL` (the
//! store's default), `LEASE` in ms (0: exact mode; else the stores are built with
//! `.lease(..)` and the bound widens by the lease length), `MODULE` (1: every node loads
//! the native module, `$RATELIMIT_MODULE` or one `testing::module_file` builds; build it
//! with `cargo build --release -p ratelimit-redis-module` and point `RATELIMIT_MODULE`
//! at `target/release/libratelimit_redis_module.so` to measure the release build).
//!
//! The store's batching (see `RedisStoreBuilder`), each left at the store's default when
//! unset: `MAX_BATCH` (the most checks in one call, before the Cluster splits it per
//! node), `BATCH_WAIT_US` (how long a batch is held open for more checks, in µs; 0: none),
//! `TIMEOUT_MS` (the store's call timeout: a batch wait counts against it). `POOL` is the
//! calls a store keeps in flight at once on a Cluster (its batcher's slots).
//!
//! The masters' process ids are printed before the run, for a profiler to attach to one
//! (`perf record -p PID`); the warm-up lasts a second, so attach after it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rand_distr::Zipf;
use ratelimit_bench::{cpu_seconds, env_or, info_field, redis_cpu_seconds};
use ratelimit_core::{Algorithm, Rule, RuleSet, Store};
use ratelimit_redis::testing::{wait_connected, RedisCluster};
use ratelimit_redis::RedisStore;

type Error = Box<dyn std::error::Error + Send + Sync>;

/// What one task saw: per key, offered and admitted; errors; latencies in µs.
#[derive(Default)]
struct TaskTally {
    keys: HashMap<u32, (u32, u32)>,
    errors: u64,
    /// The first error's message, to say what the errors were.
    first_error: Option<String>,
    latencies_us: Vec<u32>,
    /// Settles made (`SETTLE=1`), and those whose actual differed from the estimate (a
    /// store call each).
    settles: u64,
    settles_changed: u64,
}

/// A master's counters at one moment.
#[derive(Debug, Clone, Copy, Default)]
struct NodeStats {
    cpu_s: f64,
    /// The kernel's part of `cpu_s` (`used_cpu_sys`).
    sys_s: f64,
    calls: u64,
    /// Socket reads and writes of client connections (`total_reads_processed`,
    /// `total_writes_processed`): a fleet call costs Redis per read and write it takes,
    /// and pipelined calls share them.
    reads: u64,
    writes: u64,
    /// `EXISTS` calls: the module's per-node batches (`RATELIMIT.CHECK_LOCAL`) ask the
    /// node whether it serves a check's slot with one, through the command table.
    slot_checks: u64,
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let instances = env_or("INSTANCES", 4) as usize;
    let tasks = env_or("TASKS", 16) as usize;
    let duration = Duration::from_secs(env_or("DURATION", 10));
    let keys = env_or("KEYS", 100_000);
    let zipf_s: f64 = std::env::var("ZIPF_S")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1.1);
    let rule_text = std::env::var("RULE").unwrap_or_else(|_| "100/s gcra burst=50".to_owned());
    let rules: RuleSet = rule_text.parse()?;
    let (burst, rate_per_s) = gcra_bound(&rules)?;
    // The rate rule's bound holds with a concurrency rule beside it: a slot only refuses.
    let concurrent = env_or("CONCURRENT", 0);
    let settle = env_or("SETTLE", 0) == 1;
    let rules = if concurrent > 0 {
        RuleSet::new(
            rules
                .rules()
                .iter()
                .cloned()
                .chain([Rule::concurrent(concurrent, Duration::from_secs(60))?]),
        )?
    } else {
        rules
    };
    // Read before the cluster starts, so a bad value stops the run at once.
    let pool = env_set("POOL")?;
    let max_batch = env_set("MAX_BATCH")?;
    let batch_wait_us = env_set("BATCH_WAIT_US")?;
    let timeout_ms = env_set("TIMEOUT_MS")?;

    let cluster = if std::env::var("MODULE").is_ok_and(|v| v == "1") {
        RedisCluster::start_with_module()
    } else {
        RedisCluster::start()
    };
    println!(
        "fleet: {instances} store instances x {tasks} tasks, 3-master cluster on this machine, \
         {keys} keys, Zipf s={zipf_s}, rule `{rule_text}`, {} s per run",
        duration.as_secs()
    );

    let lease_ms = env_or("LEASE", 0);
    let mut builder = RedisStore::builder()
        .prefix("fleet")
        .lease(Duration::from_millis(lease_ms));
    if let Some(pool) = pool {
        builder = builder.pool_size(u32::try_from(pool)?);
    }
    if let Some(max) = max_batch {
        builder = builder.max_batch(usize::try_from(max)?);
    }
    if let Some(wait) = batch_wait_us {
        builder = builder.batch_wait(Duration::from_micros(wait));
    }
    if let Some(timeout) = timeout_ms {
        builder = builder.timeout(Duration::from_millis(timeout));
    }
    println!(
        "store: POOL={} MAX_BATCH={} BATCH_WAIT_US={} TIMEOUT_MS={}",
        shown(pool),
        shown(max_batch),
        shown(batch_wait_us),
        shown(timeout_ms),
    );
    println!(
        "masters: {}",
        cluster
            .nodes()
            .iter()
            .map(|n| format!(
                "port {} pid {}",
                n.port(),
                n.pid().map_or("?".to_owned(), |p| p.to_string())
            ))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let mut stores = Vec::with_capacity(instances);
    for _ in 0..instances {
        let store = builder.clone().build_cluster(cluster.urls()).await?;
        wait_connected(&store).await;
        if stores.is_empty() {
            println!(
                "decisions: {}",
                if store.uses_module() {
                    "native module"
                } else {
                    "Lua functions"
                }
            );
        }
        stores.push(Arc::new(store));
    }

    let key_names: Arc<Vec<Vec<u8>>> = Arc::new(
        (1..=keys)
            .map(|k| format!("client-{k}").into_bytes())
            .collect(),
    );
    let zipf = Zipf::new(keys as f64, zipf_s)?;

    // One short run first: connections opened, functions loaded, caches warm.
    let _ = drive(
        &stores,
        tasks,
        &rules,
        &key_names,
        zipf,
        Duration::from_secs(1),
        settle,
    )
    .await;
    for node in cluster.nodes() {
        node.command("FLUSHALL")?;
        node.command("CONFIG RESETSTAT")?;
    }

    let before: Vec<NodeStats> = cluster
        .nodes()
        .iter()
        .map(node_stats)
        .collect::<Result<_, _>>()?;
    let app_before = cpu_seconds(std::process::id());
    let started = Instant::now();
    let tallies = drive(&stores, tasks, &rules, &key_names, zipf, duration, settle).await;
    let elapsed = started.elapsed().as_secs_f64();
    let app_cpu = cpu_seconds(std::process::id()) - app_before;
    let after: Vec<NodeStats> = cluster
        .nodes()
        .iter()
        .map(node_stats)
        .collect::<Result<_, _>>()?;

    // Merge the tallies.
    let mut per_key: HashMap<u32, (u64, u64)> = HashMap::new();
    let mut errors = 0;
    let mut first_error = None;
    let mut latencies = Vec::new();
    let (mut settles, mut settles_changed) = (0, 0);
    for tally in tallies {
        errors += tally.errors;
        settles += tally.settles;
        settles_changed += tally.settles_changed;
        first_error = first_error.or(tally.first_error);
        latencies.extend(tally.latencies_us);
        for (k, (offered, admitted)) in tally.keys {
            let e = per_key.entry(k).or_default();
            e.0 += u64::from(offered);
            e.1 += u64::from(admitted);
        }
    }
    latencies.sort_unstable();
    let decisions: u64 = per_key.values().map(|&(o, _)| o).sum();
    let admitted: u64 = per_key.values().map(|&(_, a)| a).sum();

    // The exact limiter's ceiling over the run, and the bound a lease would widen.
    let lease_s = lease_ms as f64 / 1e3;
    let ceiling = |extra_s: f64| burst + rate_per_s * (elapsed + extra_s);
    let exact_most: f64 = per_key
        .values()
        .map(|&(offered, _)| (offered as f64).min(ceiling(0.0).floor()))
        .sum();
    let over_bound = per_key
        .values()
        .filter(|&&(_, a)| a as f64 > ceiling(lease_s).floor())
        .count();
    let hottest = per_key.iter().max_by_key(|(_, &(o, _))| o);

    let cpu_per_master: Vec<f64> = before
        .iter()
        .zip(&after)
        .map(|(b, a)| (a.cpu_s - b.cpu_s) * 1e6 / decisions.max(1) as f64)
        .collect();
    let redis_us: f64 = cpu_per_master.iter().sum();
    let busiest = cpu_per_master.iter().copied().fold(0.0, f64::max);
    let calls: u64 = before
        .iter()
        .zip(&after)
        .map(|(b, a)| a.calls - b.calls)
        .sum();

    println!();
    println!("| mode | decisions/s | Redis CPU µs/decision (per master) | Redis CPU µs/decision (sum) | calls/decision | app CPU µs/decision | p50 / p99 ms | admitted / exact most | keys over bound | errors |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    println!(
        "| {} | {:.0} | {} | {:.2} | {:.3} | {:.2} | {:.2} / {:.2} | {} / {:.0} ({:.3}) | {} | {} |",
        if lease_ms == 0 {
            "exact".to_owned()
        } else {
            format!("lease {lease_ms} ms")
        },
        decisions as f64 / elapsed,
        cpu_per_master
            .iter()
            .map(|c| format!("{c:.2}"))
            .collect::<Vec<_>>()
            .join(" · "),
        redis_us,
        calls as f64 / decisions.max(1) as f64,
        app_cpu * 1e6 / decisions.max(1) as f64,
        percentile(&latencies, 0.50) / 1e3,
        percentile(&latencies, 0.99) / 1e3,
        admitted,
        exact_most,
        admitted as f64 / exact_most.max(1.0),
        if settle {
            "n/a".to_owned()
        } else {
            over_bound.to_string()
        },
        errors,
    );
    if settle {
        println!(
            "settles: {settles} ({settles_changed} with an actual other than the estimate, a \
             store operation each; {:.3} per decision)",
            settles_changed as f64 / decisions.max(1) as f64
        );
    }
    if let Some(error) = first_error {
        println!("errors: {errors}, the first: {error}");
    }
    if let Some((k, &(offered, admitted))) = hottest {
        println!(
            "hottest key client-{k}: offered {offered}, admitted {admitted} ({:.3} of the exact \
             ceiling {:.0}), bound {:.0}",
            admitted as f64 / ceiling(0.0),
            ceiling(0.0),
            ceiling(lease_s).floor()
        );
    }
    let sum = |f: fn(&NodeStats) -> f64| -> f64 {
        before.iter().zip(&after).map(|(b, a)| f(a) - f(b)).sum()
    };
    let per_decision = |n: f64| n / decisions.max(1) as f64;
    println!(
        "Redis, all masters: {:.3} socket reads and {:.3} socket writes per decision; \
         {:.3} slot checks (EXISTS) per decision; {:.0} % of its CPU in the kernel",
        per_decision(sum(|n| n.reads as f64)),
        per_decision(sum(|n| n.writes as f64)),
        per_decision(sum(|n| n.slot_checks as f64)),
        100.0 * sum(|n| n.sys_s) / sum(|n| n.cpu_s).max(f64::MIN_POSITIVE),
    );
    println!(
        "3 masters, one core each, allow: {:.0} decisions/s with this run's spread (busiest \
         master {busiest:.2} µs/decision), {:.0} decisions/s spread evenly",
        1e6 / busiest.max(f64::MIN_POSITIVE),
        3e6 / redis_us.max(f64::MIN_POSITIVE),
    );
    Ok(())
}

/// A whole number from the environment, `None` when unset; a value that is not one is
/// refused rather than silently replaced by the default.
fn env_set(name: &str) -> Result<Option<u64>, Error> {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .map(Some)
            .map_err(|e| format!("{name}={v}: {e}; expected a whole number").into()),
        Err(_) => Ok(None),
    }
}

/// A setting as the header prints it: unset, the store's default.
fn shown(value: Option<u64>) -> String {
    value.map_or_else(|| "default".to_owned(), |v| v.to_string())
}

/// Burst and rate per second of a one-rule GCRA set: what the admitted bound needs.
fn gcra_bound(rules: &RuleSet) -> Result<(f64, f64), Error> {
    let [rule]: &[Rule; 1] = rules
        .rules()
        .try_into()
        .map_err(|_| "RULE must be one GCRA rule")?;
    match rule.algorithm() {
        Algorithm::Gcra { burst } => Ok((
            burst as f64,
            rule.limit() as f64 / rule.period().as_secs_f64(),
        )),
        _ => Err("RULE must be a GCRA rule (the admitted bound is computed for GCRA)".into()),
    }
}

/// Runs every instance's tasks for `duration` and returns what each task saw.
async fn drive(
    stores: &[Arc<RedisStore>],
    tasks: usize,
    rules: &RuleSet,
    keys: &Arc<Vec<Vec<u8>>>,
    zipf: Zipf<f64>,
    duration: Duration,
    settle: bool,
) -> Vec<TaskTally> {
    let deadline = Instant::now() + duration;
    let detached = env_or("DETACHED", 1) == 1;
    let mut handles = Vec::new();
    for (i, store) in stores.iter().enumerate() {
        for t in 0..tasks {
            let store = Arc::clone(store);
            let rules = rules.clone();
            let keys = Arc::clone(keys);
            let seed = (i * tasks + t) as u64;
            handles.push(tokio::spawn(async move {
                let mut rng = SmallRng::seed_from_u64(seed);
                let mut tally = TaskTally::default();
                let mut after = tokio::task::JoinSet::new();
                while Instant::now() < deadline {
                    // Zipf draws 1..=n as floats.
                    let k = rng.sample(zipf) as u32;
                    let start = Instant::now();
                    let key = &keys[k as usize - 1];
                    let charged_at = store.now_us();
                    let estimate = if settle { 2 } else { 1 };
                    let decision = store.check(key, &rules, estimate).await;
                    let micros = start.elapsed().as_micros();
                    tally
                        .latencies_us
                        .push(u32::try_from(micros).unwrap_or(u32::MAX));
                    let entry = tally.keys.entry(k).or_default();
                    match decision {
                        Ok(d) => {
                            entry.0 += 1;
                            entry.1 += u32::from(d.is_allowed());
                            // As the layer settles and releases: after the response,
                            // spawned; the client's next request does not wait for them.
                            let actual = rng.random_range(0..=4);
                            let settle = (settle && d.is_allowed()).then_some(actual);
                            if let Some(actual) = settle {
                                tally.settles += 1;
                                tally.settles_changed += u64::from(actual != estimate);
                            }
                            // Handed to the store to send with its next batch, as
                            // the layer hands them over when the store takes them;
                            // else spawned, as the layer does for other stores.
                            let settle = settle.filter(|&actual| {
                                !(detached
                                    && store
                                        .settle_detached(key, &rules, estimate, actual, charged_at))
                            });
                            let slot = d.slot().filter(|&slot| {
                                !(detached && store.release_detached(key, &rules, slot))
                            });
                            if settle.is_some() || slot.is_some() {
                                let (store, rules) = (Arc::clone(&store), rules.clone());
                                let key = key.clone();
                                after.spawn(async move {
                                    if let Some(actual) = settle {
                                        store
                                            .settle(&key, &rules, estimate, actual, charged_at)
                                            .await?;
                                    }
                                    if let Some(slot) = slot {
                                        store.release(&key, &rules, slot).await?;
                                    }
                                    Ok::<_, ratelimit_redis::RedisStoreError>(())
                                });
                                while let Some(done) = after.try_join_next() {
                                    if let Ok(Err(e)) = done {
                                        tally.errors += 1;
                                        tally.first_error.get_or_insert_with(|| e.to_string());
                                    }
                                }
                            }
                        }
                        Err(e) => {
                            tally.errors += 1;
                            tally.first_error.get_or_insert_with(|| e.to_string());
                        }
                    }
                }
                while let Some(done) = after.join_next().await {
                    if let Ok(Err(e)) = done {
                        tally.errors += 1;
                        tally.first_error.get_or_insert_with(|| e.to_string());
                    }
                }
                tally
            }));
        }
    }
    let mut tallies = Vec::with_capacity(handles.len());
    for handle in handles {
        tallies.push(handle.await.expect("a load task panicked"));
    }
    tallies
}

/// A master's CPU seconds, decision calls and socket reads and writes so far.
fn node_stats(node: &ratelimit_redis::testing::RedisServer) -> Result<NodeStats, Error> {
    let cpu = node.command("INFO cpu")?;
    let stats = node.command("INFO commandstats")?;
    // `cmdstat_<name>:calls=<n>,...`: the calls of every command `counted` names.
    let calls_of = |counted: &dyn Fn(&str) -> bool| -> u64 {
        stats
            .lines()
            .filter_map(|l| l.strip_prefix("cmdstat_")?.split_once(':'))
            .filter(|(name, _)| counted(name))
            .filter_map(|(_, fields)| {
                fields
                    .split(',')
                    .find_map(|f| f.strip_prefix("calls=")?.parse::<u64>().ok())
            })
            .sum()
    };
    let calls = calls_of(&|name| {
        name == "fcall"
            || name == "evalsha"
            || name.starts_with("ratelimit.check")
            || [
                "ratelimit.release",
                "ratelimit.renew",
                "ratelimit.give_back",
                "ratelimit.debit",
                "ratelimit.refund",
            ]
            .contains(&name)
    });
    let slot_checks = calls_of(&|name| name == "exists");
    let info_stats = node.command("INFO stats")?;
    Ok(NodeStats {
        slot_checks,
        cpu_s: redis_cpu_seconds(&cpu),
        sys_s: info_field(&cpu, "used_cpu_sys"),
        calls,
        reads: info_field(&info_stats, "total_reads_processed") as u64,
        writes: info_field(&info_stats, "total_writes_processed") as u64,
    })
}

/// The `q` quantile of sorted latencies, in µs.
fn percentile(sorted: &[u32], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * q).round() as usize;
    f64::from(sorted[i])
}
