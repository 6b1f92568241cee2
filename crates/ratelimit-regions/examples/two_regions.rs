//! One limit across two regions on one machine: `eu` and `us`, each with its own
//! redis-server, 30 ms apart (a `LinkProxy` each way), one instance per region behind the
//! usual tower layer.
//!
//! ```sh
//! cargo run -p ratelimit-regions --example two_regions
//! ```
//!
//! It starts its own `redis-server`s on free ports (install `redis-server`, e.g.
//! `apt-get install redis-server`; they are killed when the example ends) and prints what
//! each region admitted of 200 requests of one API key in 2 s, against the stated bound;
//! then cuts `us` off from `eu` and shows that both keep deciding locally, within the
//! same bound.

use std::time::{Duration, Instant};

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use http::{Request, StatusCode};
use ratelimit_core::RuleSet;
use ratelimit_redis::testing::{wait_connected, LinkMode, LinkProxy, RedisServer};
use ratelimit_redis::RedisStore;
use ratelimit_regions::{RegionStore, Regions};
use ratelimit_tower::key::HeaderKey;
use ratelimit_tower::RateLimitLayer;
use tower::ServiceExt;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The knobs: the regions and their weights (even here), the pooled fraction g, and
    // the pool lease ℓ_g.
    let regions = Regions::even(["eu", "us"])?
        .pooled(0.5)?
        .pool_lease(Duration::from_secs(1));
    // 600 per minute with a burst of 60: T = 100 ms, B = 60.
    let rules: RuleSet = "600/min gcra burst=60".parse()?;
    let shares = regions.split(&rules)?;
    println!("rule            {rules}");
    println!("eu's share      {}", shares.base(0).expect("eu has weight"));
    println!("us's share      {}", shares.base(1).expect("us has weight"));
    println!("pool (at home)  {}", shares.pool().expect("g > 0"));

    let servers = [RedisServer::start(), RedisServer::start()];
    let delay = Duration::from_millis(30);
    // links[from][to]: what region `from` dials to reach region `to`'s server.
    let eu_to_us = LinkProxy::start(servers[1].port(), delay, Duration::ZERO).await?;
    let us_to_eu = LinkProxy::start(servers[0].port(), delay, Duration::ZERO).await?;
    let url = |from: usize, to: usize| match (from, to) {
        (0, 1) => eu_to_us.url(),
        (1, 0) => us_to_eu.url(),
        _ => servers[to].url(),
    };
    let mut apps = Vec::new();
    for (region, server) in servers.iter().enumerate() {
        // This region's store, exact (ℓ_i = 0); `.lease(..)` would add (1 − g)·ℓ_i.
        let local = RedisStore::builder()
            .prefix("demo")
            .build(&server.url())
            .await?;
        wait_connected(&local).await;
        let mut builder = RegionStore::builder(regions.clone())
            .region(regions.name(region))
            .local(local)
            .rules(&rules);
        for to in 0..2 {
            // Links: exact stores with a timeout above the cross-region round trip.
            let link = RedisStore::builder()
                .prefix("demo")
                .timeout(Duration::from_millis(300))
                .build(&url(region, to))
                .await?;
            wait_connected(&link).await;
            builder = builder.link(regions.name(to), link);
        }
        let store = builder.build()?;
        let app = Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(RateLimitLayer::new(
                store.clone(),
                HeaderKey::new("x-api-key"),
                rules.clone(),
            ));
        apps.push((store, app));
    }
    println!();

    let bound = |seconds: f64| 60 + ((seconds * 1000.0 + 0.5 * 1000.0) / 100.0) as u64;
    for round in ["linked", "us cut off from eu"] {
        if round != "linked" {
            eu_to_us.set_mode(LinkMode::BlackHole);
            us_to_eu.set_mode(LinkMode::BlackHole);
            tokio::time::sleep(Duration::from_secs(3)).await; // the blocks expire
        }
        let start = Instant::now();
        let mut admitted = [0u32; 2];
        for i in 0..200 {
            let region = i % 2;
            let request = Request::get("/")
                .header("x-api-key", "k-customer-7")
                .body(Body::empty())?;
            let response = apps[region].1.clone().oneshot(request).await?;
            if response.status() == StatusCode::OK {
                admitted[region] += 1;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let took = start.elapsed().as_secs_f64();
        println!(
            "{round}: eu admitted {}, us admitted {}, together {} in {took:.1} s; \
             the bound B + ⌊(Δ + (1−g)·ℓ_i + g·ℓ_g)/T⌋ = 60 + ⌊({took:.1} s + 0.5 s)/100 ms⌋ = {}",
            admitted[0],
            admitted[1],
            admitted[0] + admitted[1],
            bound(took),
        );
        for (store, _) in &apps {
            let s = store.stats();
            println!(
                "  {}: {} from its share, {} from pool units; {} cross-region calls so far",
                regions.name(store.region()),
                s.base_admitted,
                s.pool_admitted,
                s.cross_region_calls
            );
        }
    }
    println!(
        "\nCut off, each region runs on its share plus the pool units it still held (they \
         expire within ℓ_g): fewer admissions, never more than the bound."
    );
    Ok(())
}
