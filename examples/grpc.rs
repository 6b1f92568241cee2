//! A gRPC service and an HTTP route sharing one budget per client IP: tonic's health
//! service on `PORT` (50051 when unset) and an axum app on `PORT + 1`, two listeners in
//! one process, one store and one layer.
//!
//! ```sh
//! cargo run -p ratelimit-examples --features grpc --example grpc
//! grpcurl -plaintext localhost:50051 grpc.health.v1.Health/Check   # gRPC
//! curl -i localhost:50052/                                          # HTTP, same budget
//! ```
//!
//! Each client IP gets 5 calls per 10 seconds, gRPC and HTTP together: the layer is built
//! once and cloned onto both servers, and a cloned layer shares its budgets (one
//! namespace). Two listeners rather than one because that is how gRPC is usually
//! deployed (its own port, HTTP/2 only), and because each server then hands the layer the
//! peer address its own way: tonic's `TcpConnectInfo` (read with ratelimit-tower's
//! `tonic` feature) and axum's `ConnectInfo`.
//!
//! The sixth call within the window is refused as each client expects it: the gRPC call
//! with `grpc-status` 8 (RESOURCE_EXHAUSTED), a `retry-after` in its metadata and a
//! `google.rpc.RetryInfo` in `grpc-status-details-bin`; the HTTP request with 429 and
//! `Retry-After`.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::routing::get;
use axum::Router;
use ratelimit_core::MemoryStore;
use ratelimit_examples::serve;
use ratelimit_tower::{PeerIp, RateLimitLayer};
use tonic::transport::Server;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    serve::logging();

    let grpc_port = serve::port(50051)?;
    let http_port = grpc_port
        .checked_add(1)
        .ok_or("PORT must leave room for the HTTP port after it")?;

    let store = Arc::new(MemoryStore::new());
    let per_ip = RateLimitLayer::builder(store, PeerIp::new())
        .rules("5/10s fixed-window name=per-ip")?
        .namespace("example-grpc")
        .build()?;

    let (_reporter, health) = tonic_health::server::health_reporter();
    let grpc = Server::builder()
        .layer(per_ip.clone())
        .add_service(health)
        .serve_with_shutdown(
            SocketAddr::from(([127, 0, 0, 1], grpc_port)),
            serve::ctrl_c(),
        );

    let app = Router::new()
        .route("/", get(|| async { "hello\n" }))
        .layer(per_ip);
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", http_port)).await?;
    let http = axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(serve::ctrl_c());

    println!("gRPC (tonic health service) on 127.0.0.1:{grpc_port}, HTTP on 127.0.0.1:{http_port}");
    println!("  5 calls per 10 s per client IP, gRPC and HTTP together");
    println!("try it:");
    println!(
        "  for i in $(seq 3); do grpcurl -plaintext localhost:{grpc_port} grpc.health.v1.Health/Check; done"
    );
    println!("  for i in $(seq 3); do curl -si localhost:{http_port}/ | head -1; done");

    let (grpc, http) = tokio::join!(grpc, async { http.await });
    grpc?;
    http?;
    Ok(())
}
