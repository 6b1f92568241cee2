//! Requests sent through a router in process (no sockets), for counting instructions per
//! request with callgrind: the difference between two request counts, divided by the
//! difference, leaves out the set-up.
//!
//! ```sh
//! cargo build --release -p ratelimit-bench --example layer_instructions
//! for n in 2000 12000; do
//!   valgrind --tool=callgrind --callgrind-out-file=cg.$n target/release/examples/layer_instructions fields $n
//! done
//! # (total of cg.12000 - total of cg.2000) / 10000; routers: plain, governor, quiet, fields,
//! # metered (a settle per request: 1 reserved, 2 read from the response head),
//! # metered-even (the head's count equals the estimate: no settle), usage (the handler
//! # reports 2 through `Usage`, settled at the body's end)
//! # concurrent (fields, and a `1000 concurrent` rule beside the rate: a slot taken, renewed
//! # by a task and released at the body's drop)
//! ```

use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use axum::{Extension, Router};
use ratelimit_core::MemoryStore;
use ratelimit_tower::{PeerIp, RateLimitLayer, Usage};
use tower::ServiceExt;
use tower_governor::governor::GovernorConfigBuilder;
use tower_governor::GovernorLayer;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let which = args.next().unwrap_or_else(|| "fields".into());
    let n: usize = args.next().map_or(Ok(10_000), |s| s.parse())?;
    let hello = || Router::new().route("/", get(|| async { "Hello, World!" }));
    let layer = |fields: bool| {
        let rules = if which == "concurrent" {
            "100000000/s; 1000 concurrent"
        } else {
            "100000000/s"
        };
        RateLimitLayer::builder(Arc::new(MemoryStore::new()), PeerIp::new())
            .rules(rules)
            .unwrap()
            .admitted_headers(fields)
            .build()
            .unwrap()
    };
    let app = match which.as_str() {
        "plain" => hello(),
        "governor" => {
            let config = GovernorConfigBuilder::default()
                .per_nanosecond(10)
                .burst_size(u32::MAX)
                .finish()
                .ok_or("tower_governor configuration")?;
            hello().layer(GovernorLayer::new(Arc::new(config)))
        }
        "quiet" => hello().layer(layer(false)),
        "metered" | "metered-even" => {
            let count = if which == "metered" { "2" } else { "1" };
            let counted = Router::new().route(
                "/",
                get(move || async move { ([("x-usage", count)], "Hello, World!") }),
            );
            counted.layer(
                RateLimitLayer::builder(Arc::new(MemoryStore::new()), PeerIp::new())
                    .rules("100000000/s")
                    .unwrap()
                    .settle_from_header("x-usage")
                    .build()
                    .unwrap(),
            )
        }
        "usage" => {
            let reports = Router::new().route(
                "/",
                get(|Extension(usage): Extension<Usage>| async move {
                    usage.report(2);
                    "Hello, World!"
                }),
            );
            reports.layer(
                RateLimitLayer::builder(Arc::new(MemoryStore::new()), PeerIp::new())
                    .rules("100000000/s")
                    .unwrap()
                    .usage_extension(true)
                    .build()
                    .unwrap(),
            )
        }
        "fields" | "concurrent" => hello().layer(layer(true)),
        other => return Err(format!("no router {other:?}").into()),
    };
    // A slot's renewal is a task on a timer: the concurrent row's runtime has one.
    let rt = if which == "concurrent" {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()?
    } else {
        tokio::runtime::Builder::new_current_thread().build()?
    };
    let peer: SocketAddr = "192.0.2.1:40000".parse()?;
    let mut headers = 0;
    rt.block_on(async {
        for _ in 0..n {
            let mut req = axum::http::Request::get("/").body(Body::empty()).unwrap();
            req.extensions_mut().insert(ConnectInfo(peer));
            let res = app.clone().oneshot(req).await.unwrap();
            assert!(res.status().is_success());
            headers += res.headers().len();
            // Read to its end: a metered body settles there.
            http_body_util::BodyExt::collect(res.into_body())
                .await
                .unwrap();
        }
    });
    println!("{which}: {n} requests, {headers} response headers");
    Ok(())
}
