//! The shared conformance suite against the in-memory store: each case its own test.

use ratelimit_core::{conformance_tests, MemoryStore};

conformance_tests! {
    mod memory_store {
        run: |test| futures::executor::block_on(test),
        store: |clock| async move { MemoryStore::builder().clock(clock).build() },
    }
}

// Two shards of a few keys each: eviction must not change any decision the suite checks
// within one case's handful of keys.
conformance_tests! {
    mod tiny_memory_store {
        run: |test| futures::executor::block_on(test),
        store: |clock| async move {
            MemoryStore::builder()
                .clock(clock)
                .shards(2)
                .max_keys(64)
                .build()
        },
    }
}

/// The all-in-one runner still runs every case.
#[tokio::test]
async fn the_whole_suite_runs_in_one_call() {
    ratelimit_core::testing::conformance(|clock| async move {
        MemoryStore::builder().clock(clock).build()
    })
    .await;
}
