//! Serving an example app: the start-up every example shares.

use std::net::SocketAddr;

use axum::Router;

/// Serves `app` on 127.0.0.1 at `PORT` (3000 when unset) until Ctrl-C, with each
/// connection's peer address available to the key extractors. `banner` gets the bound
/// address, to print what is served.
pub async fn serve(
    app: Router,
    banner: impl FnOnce(SocketAddr),
) -> Result<(), Box<dyn std::error::Error>> {
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port(3000)?)).await?;
    banner(listener.local_addr()?);
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(ctrl_c())
    .await?;
    Ok(())
}

/// The port in `PORT`, or `default` when unset.
pub fn port(default: u16) -> Result<u16, String> {
    match std::env::var("PORT") {
        Ok(p) => p
            .parse()
            .map_err(|_| format!("PORT must be a port number, got {p:?}")),
        Err(_) => Ok(default),
    }
}

/// Resolves at Ctrl-C: the examples' graceful shutdown.
pub async fn ctrl_c() {
    let _ = tokio::signal::ctrl_c().await;
}

/// Logs to stderr at `RUST_LOG`, by default `INFO` and the limiter's refusals and delays
/// (`DEBUG`).
pub fn logging() {
    logging_at("info,ratelimit_tower=debug");
}

/// Logs to stderr at `RUST_LOG`, by default at `default` (an `EnvFilter` directive such
/// as `"info"`).
pub fn logging_at(default: &str) {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default)),
        )
        .init();
}
