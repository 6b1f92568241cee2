//! Waiting for a turn on outbound calls, fleet-wide: every instance of this app calls a
//! partner API through a `ThrottleLayer` on a shared RedisStore, so that together they
//! call it at most 10 times a second; a caller waits for its slot instead of failing.
//!
//! ```sh
//! # the first instance starts the partner on 127.0.0.1:3001 and prints its arrivals
//! REDIS_URL=redis://127.0.0.1:6379 cargo run -p ratelimit-examples --features redis --example outbound
//! # a second instance, in another terminal, calls the same partner
//! PARTNER=127.0.0.1:3001 REDIS_URL=redis://127.0.0.1:6379 cargo run -p ratelimit-examples --features redis --example outbound
//! ```
//!
//! Each instance runs 20 callers for 20 seconds; the partner prints how many calls it got
//! each second: 10, however many instances run.

use std::time::Duration;

use ratelimit_examples::outbound::{callers, partner, PARTNER_LIMIT};
use ratelimit_redis::RedisStore;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    ratelimit_examples::serve::logging();
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let store = RedisStore::builder().build(&url).await?;
    let (addr, arrivals) = match std::env::var("PARTNER") {
        Ok(addr) => (addr.parse()?, None),
        Err(_) => {
            let (addr, arrivals) = partner(3001).await?;
            println!("partner on http://{addr}, limit {PARTNER_LIMIT} for every instance together");
            (addr, Some(arrivals))
        }
    };
    let run = tokio::spawn(callers(store, addr, 20, Duration::from_secs(20)));
    if let Some(arrivals) = arrivals {
        for _ in 0..20 {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let last = arrivals
                .lock()
                .unwrap()
                .iter()
                .next_back()
                .map(|(s, n)| (*s, *n));
            if let Some((second, n)) = last {
                println!("second {second}: {n} calls");
            }
        }
    }
    let calls = run.await?;
    println!(
        "this instance: {} calls answered, {} failed",
        calls.ok, calls.failed
    );
    Ok(())
}
