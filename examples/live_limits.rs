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
//! refused (`ERROR`), the running limits staying; a file above 1 MiB or with more than
//! 1,024 tiers is refused (see `ratelimit_tower::LimitsFile`). A plan the file does not
//! list is limited by the top-level rules, with a `WARN` naming it.

use std::sync::Arc;

use ratelimit_core::MemoryStore;
use ratelimit_examples::live::{app, limits_file};
use ratelimit_examples::serve::serve;
use tokio::signal::unix::{signal, SignalKind};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    ratelimit_examples::serve::logging_at("info");

    let file = limits_file(
        std::env::var_os("LIMITS").ok_or("set LIMITS to the path of a TOML limits file")?,
    );
    let limits = file.load().await?;
    tracing::info!(
        "limits from {}: {} tiers",
        file.path().display(),
        limits.tiers().count()
    );
    let (app, handle) = app(Arc::new(MemoryStore::new()), limits)?;

    let mut hangups = signal(SignalKind::hangup())?;
    tokio::spawn(async move {
        while hangups.recv().await.is_some() {
            // Read, parsed and compared off the runtime's workers, within the file's
            // bounds; logged either way, a refused file leaving the running limits.
            let _ = file.reload(&handle).await;
        }
    });

    serve(app, |addr| {
        println!("serving http://{addr}/ ; edit the limits file, then send SIGHUP");
    })
    .await
}
