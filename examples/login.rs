//! A login guard that counts failed logins only: 5 per 15 minutes per client IP;
//! successful logins are free (charging by outcome).
//!
//! ```sh
//! cargo run -p ratelimit-examples --example login
//! # successes never run out:
//! for i in $(seq 10); do curl -s -o /dev/null -w '%{http_code} ' -X POST -H 'x-password: hunter2' localhost:3000/login; done; echo
//! # the 6th failure gets 429:
//! for i in $(seq 6); do curl -s -o /dev/null -w '%{http_code} ' -X POST -H 'x-password: guess' localhost:3000/login; done; echo
//! ```
//!
//! Serves on 127.0.0.1:3000 (`PORT` to change it).

use std::sync::Arc;

use ratelimit_core::MemoryStore;
use ratelimit_examples::login::{app, FAILED_LOGINS, PASSWORD};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    ratelimit_examples::serve::logging();
    let app = app(Arc::new(MemoryStore::new()));
    ratelimit_examples::serve::serve(app, |addr| {
        println!("serving on http://{addr}");
        println!("  POST /login  {FAILED_LOGINS} per client IP; successful logins are free");
        println!("try it (successes never run out; the 6th failure gets 429):");
        println!(
            "  for i in $(seq 10); do curl -s -o /dev/null -w '%{{http_code}} ' -X POST -H 'x-password: {PASSWORD}' http://{addr}/login; done; echo"
        );
        println!(
            "  for i in $(seq 6); do curl -s -o /dev/null -w '%{{http_code}} ' -X POST -H 'x-password: guess' http://{addr}/login; done; echo"
        );
    })
    .await
}
