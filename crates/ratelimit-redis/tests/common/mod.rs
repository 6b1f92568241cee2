//! Helpers shared by the integration tests.

#![allow(dead_code)] // Each test binary uses a different subset.

use std::collections::HashMap;

use ratelimit_redis::redis::{self, Connection};

/// A plain synchronous connection for inspecting the server.
pub(crate) fn conn(url: &str) -> Connection {
    redis::Client::open(url)
        .and_then(|c| c.get_connection())
        .unwrap_or_else(|e| panic!("connect to {url}: {e}"))
}

/// `INFO commandstats` as command -> (calls, usec_per_call).
pub(crate) fn commandstats(con: &mut Connection) -> HashMap<String, (u64, f64)> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(con)
        .expect("INFO commandstats");
    let mut stats = HashMap::new();
    for line in info.lines() {
        let Some((name, fields)) = line
            .strip_prefix("cmdstat_")
            .and_then(|l| l.split_once(':'))
        else {
            continue;
        };
        let field = |key: &str| {
            fields
                .split(',')
                .find_map(|f| f.strip_prefix(key)?.strip_prefix('='))
                .unwrap_or("0")
                .to_owned()
        };
        let calls: u64 = field("calls").parse().expect("calls");
        let usec: f64 = field("usec_per_call").parse().expect("usec_per_call");
        stats.insert(name.to_owned(), (calls, usec));
    }
    stats
}

/// Resets `INFO commandstats`.
pub(crate) fn reset_stats(con: &mut Connection) {
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query(con)
        .expect("CONFIG RESETSTAT");
}

/// Every key of the database.
pub(crate) fn all_keys(con: &mut Connection) -> Vec<Vec<u8>> {
    redis::cmd("KEYS").arg("*").query(con).expect("KEYS")
}

/// The client key encoded in a store key's hash tag, `<prefix>:{k<hex>}:...`.
pub(crate) fn client_key_of(name: &[u8]) -> Vec<u8> {
    let name = std::str::from_utf8(name).expect("store keys are ASCII");
    let open = name.find("{k").expect("hash tag") + 2;
    let close = open + name[open..].find('}').expect("hash tag end");
    let hex = &name[open..close];
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
        .collect()
}
