//! Bytes per tracked key: one million distinct keys (IPv4 addresses as text), each checked
//! once against one GCRA rule, in MemoryStore and in governor's keyed limiter.
//!
//! `cargo bench -p ratelimit-core --bench memory`

use std::alloc::System;
use std::num::NonZeroU32;

use governor::{Quota, RateLimiter};
use ratelimit_core::{MemoryStore, RuleSet};
use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

const KEYS: u32 = 1_000_000;

fn key(i: u32) -> String {
    let [a, b, c, d] = (0x0a00_0000 + i).to_be_bytes();
    format!("{a}.{b}.{c}.{d}")
}

fn main() {
    let keys: Vec<String> = (0..KEYS).map(key).collect();
    let avg_key = keys.iter().map(String::len).sum::<usize>() as f64 / f64::from(KEYS);

    let region = Region::new(GLOBAL);
    let store = MemoryStore::builder().max_keys(2_000_000).build();
    // A slow quota, so no entry expires (and is swept) during the run.
    let rules: RuleSet = "10/h gcra burst=10".parse().unwrap();
    for k in &keys {
        store.check_now(k.as_bytes(), &rules, 1).unwrap();
    }
    let stats = region.change();
    let ours = (stats.bytes_allocated as f64 - stats.bytes_deallocated as f64) / f64::from(KEYS);
    assert_eq!(store.len(), KEYS as usize);

    let region = Region::new(GLOBAL);
    let quota =
        Quota::per_second(NonZeroU32::new(100).unwrap()).allow_burst(NonZeroU32::new(10).unwrap());
    let governor = RateLimiter::keyed(quota);
    for k in &keys {
        let _ = governor.check_key(k);
    }
    let stats = region.change();
    let theirs = (stats.bytes_allocated as f64 - stats.bytes_deallocated as f64) / f64::from(KEYS);

    println!("keys: {KEYS}, average key length {avg_key:.1} bytes");
    println!("MemoryStore (1 GCRA rule):   {ours:.1} bytes per tracked key (live heap)");
    println!("governor keyed (DashMap):    {theirs:.1} bytes per tracked key (live heap)");
    println!("ratio ours / governor:       {:.2}", ours / theirs);
    drop((store, governor));
}
