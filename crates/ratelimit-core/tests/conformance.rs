//! The shared conformance suite against the in-memory store.

use ratelimit_core::{testing, MemoryStore};

#[tokio::test]
async fn memory_store_passes_the_conformance_suite() {
    testing::conformance(|clock| async move { MemoryStore::builder().clock(clock).build() }).await;
}

#[tokio::test]
async fn a_tiny_store_passes_too() {
    // Two shards of a few keys each: eviction must not change any decision the suite checks
    // within one case's handful of keys.
    testing::conformance(|clock| async move {
        MemoryStore::builder()
            .clock(clock)
            .shards(2)
            .max_keys(64)
            .build()
    })
    .await;
}
