//! A client at its limit, then a flood of distinct one-shot keys through a `MemoryStore`
//! with the default cap: every check of the client must get the answer an untouched state
//! gives (the pure transition replayed beside the store), so it stays limited until its
//! rules give it units back, and memory must level off. Prints the resident set size as
//! the flood goes.
//!
//! ```sh
//! cargo run --release -p ratelimit-core --example flood -- [keys] [rules] [key bytes]
//! cargo run --release -p ratelimit-core --example flood -- 3000000 "5/min fixed-window"
//! # keys the length of a tower layer's store key for an IPv4 client (17: `192.0.2.1`
//! # under the implicit namespace), or longer than a `MemoryStore` entry holds (28)
//! cargo run --release -p ratelimit-core --example flood -- 3000000 "5/h gcra" 28
//! ```
//!
//! The clock is a manual one moved 5 µs per key (200,000 keys/s, about what one core
//! pushes through the store), so 3,000,000 keys span 15 s of the victim's minute and the
//! run is the same on any machine.

use std::time::{Duration, Instant};

use ratelimit_core::algo::{decide, RuleState};
use ratelimit_core::{Clock, ManualClock, MemoryStore, RuleSet};

/// Resident and peak resident set size of this process, in MiB (Linux).
fn rss_mib() -> (f64, f64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            .map_or(f64::NAN, |kb| kb / 1024.0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

fn main() {
    let mut args = std::env::args().skip(1);
    let keys: u32 = args.next().map_or(3_000_000, |a| a.parse().expect("keys"));
    let text = args.next().unwrap_or_else(|| "5/min".to_owned());
    let rules: RuleSet = text.parse().expect("rules");
    let key_len: usize = args.next().map_or(16, |a| a.parse().expect("key bytes"));
    assert!(key_len >= 8, "keys of at least 8 bytes, to be distinct");

    // Start on a minute boundary so a fixed window does not roll over mid-flood.
    let start = 1_700_000_040_000_000;
    let clock = ManualClock::new(start);
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let (rss0, _) = rss_mib();
    println!("rules: {rules}; flood of {keys} one-shot keys of {key_len} bytes; default cap");
    println!("RSS before: {rss0:.1} MiB");

    // The victim's state as the pure transition keeps it, never evicted.
    let mut reference = vec![RuleState::Fresh; rules.len()];
    let mut victim = |now: u64| {
        let got = store.check_now(b"victim", &rules, 1).unwrap();
        let want = decide(&rules, &mut reference, now, 1).decision;
        (got.is_allowed(), got == want)
    };
    let mut admitted = 0;
    while victim(clock.now_us()).0 {
        admitted += 1;
    }
    println!("victim: {admitted} admitted, then denied");

    let began = Instant::now();
    let (mut resets, mut checks, mut limited) = (0u32, 0u32, 0u32);
    let mut key = vec![0u8; key_len];
    for i in 0..keys {
        clock.advance(Duration::from_micros(5));
        // Distinct keys that look like IPv6 addresses (at the default length).
        key[..4].copy_from_slice(&0x2001_0db8u32.to_be_bytes());
        key[key_len - 4..].copy_from_slice(&i.to_be_bytes());
        store.check_now(&key, &rules, 1).unwrap();
        if i % 10_000 == 0 {
            let (allowed, same) = victim(clock.now_us());
            checks += 1;
            limited += u32::from(!allowed);
            if !same {
                resets += 1;
                println!("victim RESET after {i} keys");
            }
        }
        if (i + 1) % 500_000 == 0 {
            let (rss, peak) = rss_mib();
            println!(
                "{:>9} keys: {} tracked, RSS {rss:.1} MiB (peak {peak:.1})",
                i + 1,
                store.len()
            );
        }
    }
    let elapsed = began.elapsed();
    let (rss, peak) = rss_mib();
    println!(
        "after {keys} keys ({:.0} keys/s, {:.1} s of clock): {checks} checks of the victim \
         during the flood, {limited} denied, {resets} differing from its untouched state",
        f64::from(keys) / elapsed.as_secs_f64(),
        (clock.now_us() - start) as f64 / 1e6,
    );
    println!(
        "RSS {rss:.1} MiB, peak {peak:.1} MiB, growth {:.1} MiB",
        peak - rss0
    );
    assert_eq!(resets, 0, "the victim was reset");
}
