//! What a store sends when it connects leaves a healthy server's error counters alone:
//! operators alert on `errorstat_*` and on failed calls, so a connection to a server
//! that lacks nothing (the module loaded, or the function library there already) sends
//! nothing that fails. The server's counters are read with inline commands over a raw
//! socket (`RedisServer::command`), which add no errors of their own.

use ratelimit_core::{RuleSet, Store};
use ratelimit_redis::testing::{wait_connected, RedisServer, ServerKind};
use ratelimit_redis::RedisStore;

/// The error counters of `INFO errorstats` and the failed or rejected calls of `INFO
/// commandstats`, one line each; empty on a quiet server.
fn errors(server: &RedisServer) -> Vec<String> {
    let errorstats = server.command("INFO errorstats").unwrap();
    let commandstats = server.command("INFO commandstats").unwrap();
    let failed = |line: &&str| {
        ["failed_calls=", "rejected_calls="].iter().any(|field| {
            line.split(',')
                .filter_map(|f| f.split(':').next_back()?.strip_prefix(field))
                .any(|n| n != "0")
        })
    };
    errorstats
        .lines()
        .filter(|l| l.starts_with("errorstat_"))
        .chain(commandstats.lines().filter(failed))
        .map(str::to_owned)
        .collect()
}

/// How often `INFO commandstats` counts `command` (`"function|load"`), 0 when never.
fn calls(server: &RedisServer, command: &str) -> u64 {
    let stats = server.command("INFO commandstats").unwrap();
    let prefix = format!("cmdstat_{command}:calls=");
    stats
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|rest| rest.split(',').next()?.parse().ok())
        .unwrap_or(0)
}

/// Connects a store, decides a check through it, and drops it: one connection's setup
/// and one call, on a pool of `pool` connections.
async fn connect_and_check(server: &RedisServer, pool: u32) {
    let store = RedisStore::builder()
        .pool_size(pool)
        .build(&server.url())
        .await
        .unwrap();
    wait_connected(&store).await;
    let rules: RuleSet = "10/s; 100/min".parse().unwrap();
    let decision = store.check(b"client", &rules, 1).await.unwrap();
    assert!(decision.is_allowed(), "{decision:?}");
}

async fn quiet_with_the_module(kind: ServerKind) {
    let server = RedisServer::start_kind_with_module(kind);
    connect_and_check(&server, 1).await;
    assert_eq!(
        errors(&server),
        Vec::<String>::new(),
        "{kind:?}: first connect"
    );
    // Connecting again (a restarted app, a new pooled connection) finds all it needs.
    connect_and_check(&server, 3).await;
    assert_eq!(errors(&server), Vec::<String>::new(), "{kind:?}: reconnect");
    // The module serves every call: no Lua is loaded for it.
    assert_eq!(calls(&server, "function|load"), 0, "{kind:?}");
    assert_eq!(calls(&server, "script|load"), 0, "{kind:?}");
}

async fn quiet_without_the_module(kind: ServerKind) {
    let server = RedisServer::start_kind_with(kind, &[]);
    connect_and_check(&server, 1).await;
    assert_eq!(
        errors(&server),
        Vec::<String>::new(),
        "{kind:?}: first connect"
    );
    connect_and_check(&server, 3).await;
    assert_eq!(errors(&server), Vec::<String>::new(), "{kind:?}: reconnect");
    // Loaded by the first connection; the later ones found it there.
    assert_eq!(calls(&server, "function|load"), 1, "{kind:?}");
}

#[tokio::test]
async fn connecting_to_redis_with_the_module_fails_nothing() {
    quiet_with_the_module(ServerKind::Redis).await;
}

#[tokio::test]
async fn connecting_to_valkey_with_the_module_fails_nothing() {
    quiet_with_the_module(ServerKind::Valkey).await;
}

#[tokio::test]
async fn connecting_to_redis_without_the_module_fails_nothing() {
    quiet_without_the_module(ServerKind::Redis).await;
}

#[tokio::test]
async fn connecting_to_valkey_without_the_module_fails_nothing() {
    quiet_without_the_module(ServerKind::Valkey).await;
}
