//! Limits read from a file and reloaded on SIGHUP, without restarting and without
//! resetting anyone's usage.
//!
//! ```sh
//! printf 'rules = "5/min name=per-ip"\n[tiers]\npro = "100/min name=pro"\n' > limits.toml
//! LIMITS=limits.toml cargo run -p ratelimit-examples --features live --example live_limits
//! curl -i localhost:3000/                     # 5 a minute per client IP
//! curl -i -H 'x-plan: pro' localhost:3000/    # 100 a minute
//! # edit limits.toml, then:
//! kill -HUP $(pgrep live_limits)
//! ```
//!
//! `LIMITS` names the file (top level `rules = "<rule text>"`, an optional `[tiers]`
//! table of name = rule text, chosen by the `x-plan` request header); `PORT` the port
//! (3000 by default). A reload logs what changed (`INFO`), or why the new file was
//! refused (`ERROR`), the running limits staying.

use std::path::PathBuf;
use std::sync::Arc;

use ratelimit_core::MemoryStore;
use ratelimit_examples::live::{app, read_limits, reload};
use ratelimit_examples::serve::serve;
use tokio::signal::unix::{signal, SignalKind};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    ratelimit_examples::serve::logging_at("info");

    let path = PathBuf::from(
        std::env::var_os("LIMITS").ok_or("set LIMITS to the path of a TOML limits file")?,
    );
    let limits = read_limits(&path)?;
    tracing::info!("limits from {}: {limits}", path.display());
    let (app, handle) = app(Arc::new(MemoryStore::new()), limits)?;

    let mut hangups = signal(SignalKind::hangup())?;
    tokio::spawn(async move {
        while hangups.recv().await.is_some() {
            // Refusals are logged; the running limits stay.
            let _ = reload(&handle, &path);
        }
    });

    serve(app, |addr| {
        println!("serving http://{addr}/ ; edit the limits file, then send SIGHUP");
    })
    .await
}
