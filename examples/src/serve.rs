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
    let port: u16 = match std::env::var("PORT") {
        Ok(p) => p
            .parse()
            .map_err(|_| format!("PORT must be a port number, got {p:?}"))?,
        Err(_) => 3000,
    };
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    banner(listener.local_addr()?);
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await?;
    Ok(())
}
