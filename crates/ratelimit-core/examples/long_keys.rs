//! Memory per key does not grow with the key's length: distinct 64 KiB keys through a
//! `MemoryStore`, with the resident set size before and after.
//!
//! ```sh
//! cargo run --release -p ratelimit-core --example long_keys -- [keys] [key bytes]
//! ```
//!
//! The keys are made one at a time in a single buffer, so the process holds no more than
//! one key at once and the growth is the store's.

use ratelimit_core::{ManualClock, MemoryStore, RuleSet};

/// Resident set size of this process, in MiB (Linux).
fn rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let keys: u32 = args.next().map_or(5_000, |a| a.parse().expect("keys"));
    let len: usize = args
        .next()
        .map_or(64 * 1024, |a| a.parse().expect("key bytes"));
    let clock = ManualClock::new(1_700_000_000_000_000);
    let store = MemoryStore::builder().clock(clock).build();
    let rules: RuleSet = "100/min".parse().expect("rules");

    let mut key = vec![b'x'; len];
    let before = rss_mib();
    for i in 0..keys {
        key[..4].copy_from_slice(&i.to_be_bytes());
        assert!(store.check_now(&key, &rules, 1).unwrap().is_allowed());
    }
    let after = rss_mib();
    assert_eq!(store.len(), keys as usize);
    println!(
        "{keys} distinct keys of {len} bytes: RSS {before:.1} -> {after:.1} MiB, growth {:.2} MiB ({:.0} bytes per key)",
        after - before,
        (after - before) * 1024.0 * 1024.0 / f64::from(keys)
    );
}
