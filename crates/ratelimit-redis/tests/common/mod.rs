//! Helpers shared by the integration tests.

#![allow(dead_code)] // Each test binary uses a different subset.

use std::collections::HashMap;

use ratelimit_redis::redis::{self, Connection};

/// A store on `cluster` under `prefix` on `clock` (one connection, a generous timeout),
/// and a memory store on the same clock to compare its decisions with.
pub(crate) async fn cluster_stores(
    cluster: &ratelimit_redis::testing::RedisCluster,
    clock: &ratelimit_core::ManualClock,
    prefix: &str,
) -> (
    ratelimit_redis::RedisStore,
    ratelimit_core::MemoryStore<ratelimit_core::ManualClock>,
) {
    let redis = ratelimit_redis::RedisStore::builder()
        .prefix(prefix)
        .pool_size(1)
        .clock(clock.clone())
        .timeout(std::time::Duration::from_secs(5))
        .build_cluster(cluster.urls())
        .await
        .expect("store");
    ratelimit_redis::testing::wait_connected(&redis).await;
    let memory = ratelimit_core::MemoryStore::builder()
        .clock(clock.clone())
        .build();
    (redis, memory)
}

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

/// Whether `name` is the record of a call decided once on the Lua functions
/// (`<prefix>:{<tag>}:r<32 hex digits>`): a key of its own per call, kept seconds.
#[allow(dead_code)]
pub(crate) fn is_record(name: &[u8]) -> bool {
    name.len() > 35
        && name[name.len() - 34..].starts_with(b":r")
        && name[name.len() - 32..]
            .iter()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
}

/// The client key as the hash tag of a store key holds it, `<prefix>:{k<hex>}:...` for a
/// short key, `<prefix>:{d<hex>}:...` for a long key's digest.
pub(crate) fn held_key_of(name: &[u8]) -> StoredKeyBuf {
    let name = std::str::from_utf8(name).expect("store keys are ASCII");
    let open = name.find('{').expect("hash tag") + 1;
    let close = open + name[open..].find('}').expect("hash tag end");
    let (letter, hex) = name[open..close].split_at(1);
    let bytes = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
        .collect();
    match letter {
        "k" => StoredKeyBuf::Inline(bytes),
        "d" => StoredKeyBuf::Digest(bytes),
        other => panic!("unknown tag letter {other:?} in {name}"),
    }
}

/// An owned [`StoredKey`](ratelimit_core::key::StoredKey).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum StoredKeyBuf {
    Inline(Vec<u8>),
    Digest(Vec<u8>),
}

impl StoredKeyBuf {
    /// How the core holds `key`.
    pub(crate) fn of(key: &[u8]) -> Self {
        match ratelimit_core::key::StoredKey::new(key) {
            ratelimit_core::key::StoredKey::Inline(k) => StoredKeyBuf::Inline(k.to_vec()),
            ratelimit_core::key::StoredKey::Digest(d) => StoredKeyBuf::Digest(d.to_vec()),
        }
    }
}

/// Closes every client connection of the server on `port` (`CLIENT KILL TYPE normal`),
/// as a proxy or the server would on a fault; a server that does not answer is skipped.
pub(crate) fn kill_clients(port: u16) {
    let Ok(client) = redis::Client::open(format!("redis://127.0.0.1:{port}/")) else {
        return;
    };
    if let Ok(mut con) = client.get_connection() {
        let _: redis::RedisResult<redis::Value> = redis::cmd("CLIENT")
            .arg("KILL")
            .arg("TYPE")
            .arg("normal")
            .arg("SKIPME")
            .arg("yes")
            .query(&mut con);
    }
}
