//! What a store does on each new connection: the scripts loaded, the module found (or
//! not), the servers' clocks and eviction policies read.

use std::sync::atomic::Ordering;
use std::sync::PoisonError;
use std::time::Instant;

use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{Cmd, RedisError, RedisResult, Value};

use crate::error::is_connection_error;
use crate::script;
use crate::shared::Shared;

use super::cluster::{Nodes, Primary};
use super::conn::{Conn, Failure};

/// Loads the store's scripts on the server, or on every primary of a Cluster: the
/// script forms (`SCRIPT LOAD`, which never fails), and the decision function library
/// where the server has functions (Redis 7) and lacks it. Returns whether the server has
/// functions.
///
/// The library is asked for by name first (`FUNCTION LIST LIBRARYNAME`) and loaded only
/// on the primaries that lack it: a `FUNCTION LOAD` of a library that is there fails,
/// and every such failure counts in the server's `errorstat_ERR` and the command's
/// `failed_calls`, which operators alert on.
async fn load_scripts(conn: &mut Conn) -> Result<bool, Failure> {
    let mut functions = true;
    for script in script::scripts() {
        for (_, reply) in conn.each_master(script.load_cmd()).await? {
            reply?;
        }
        let Some(load) = script.function_load_cmd() else {
            continue;
        };
        for (primary, listed) in conn.each_master(script::own_library_list_cmd()).await? {
            match listed {
                Ok(reply) if script::lists_own_library(&reply) => continue,
                Ok(_) => {}
                Err(e) if script::unknown_command(&e) => {
                    functions = false;
                    continue;
                }
                Err(e) => return Err(e.into()),
            }
            match on_primary(conn, &primary, load.clone()).await {
                Ok(_) => {}
                // Another store loaded it meanwhile.
                Err(e) if script::already_loaded(&e) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
    Ok(functions)
}

/// Sends `cmd` to `primary` alone: the store's one server, or one Cluster master.
async fn on_primary(conn: &mut Conn, primary: &Primary, cmd: Cmd) -> RedisResult<Value> {
    match (conn, primary) {
        (Conn::Cluster(cluster), Primary::Master { host, port }) => {
            let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                host: host.clone(),
                port: *port,
            });
            cluster
                .route_command(cmd, routing)
                .await
                .and_then(Value::extract_error)
        }
        (Conn::Cluster(cluster), Primary::Server) => cmd.query_async(cluster).await,
        (Conn::Multiplexed(c), _) => cmd.query_async(c).await,
    }
}

/// Finds the native module, and where it does not serve every call, loads the scripts;
/// reads the server's clock and its `maxmemory-policy` (warning when limiter keys can be
/// evicted); remembers whether the server has functions. On a Cluster, the clock and the
/// policy are read from every master: the fastest clock sets the deadlines (see
/// [`RedisClock`](crate::shared::RedisClock)), and each master whose policy can evict is
/// warned about by address.
///
/// With the module on every primary nothing of the Lua is loaded: should the module go
/// (a restart without it), the first call that finds it gone loads the function library
/// (see `Call::invoke`).
pub(super) async fn prepare(conn: &mut Conn, shared: &Shared) -> Result<(), Failure> {
    detect_module(conn, shared, true).await?;
    if !shared.paths.module.load(Ordering::Relaxed) {
        let functions = load_scripts(conn).await?;
        shared.paths.functions.store(functions, Ordering::Relaxed);
    }
    for (_, reply) in conn.each_master(redis::cmd("TIME")).await? {
        let (secs, micros): (u64, u64) =
            redis::from_redis_value(reply?).map_err(RedisError::from)?;
        shared
            .redis_clock
            .observe(secs * 1_000_000 + micros, Instant::now());
    }
    read_policy(conn, shared).await
}

/// Reads `maxmemory-policy` from the server, or from every master of a Cluster (warning
/// about each one whose policy can evict the store's keys). Fails when a master cannot
/// be reached; a master that refuses `CONFIG` is taken as it is.
pub(super) async fn read_policy(conn: &mut Conn, shared: &Shared) -> Result<(), Failure> {
    let mut config = redis::cmd("CONFIG");
    config.arg("GET").arg("maxmemory-policy");
    let mut read = Vec::new();
    for (primary, reply) in conn.each_master(config).await? {
        match reply {
            Ok(reply) => read.extend(policy_in(&reply).map(|policy| (primary, policy))),
            Err(e) if is_connection_error(&e) => return Err(e.into()),
            Err(e) => {
                // Managed services often rename or forbid CONFIG.
                tracing::info!(
                    error = %e,
                    ?primary,
                    "cannot read maxmemory-policy; make sure the Redis server does not evict \
                     rate-limit keys (maxmemory-policy noeviction)"
                );
            }
        }
    }
    for (primary, policy) in &read {
        if let Some(why) = eviction_risk(policy) {
            tracing::warn!(
                maxmemory_policy = %policy,
                ?primary,
                "Redis may evict rate-limit keys: {why}. An evicted key forgets what a client \
                 consumed, so limits admit more than configured. Set `maxmemory-policy \
                 noeviction` (or give the limiter a Redis of its own)."
            );
        }
    }
    // The policy that can evict, if a master has one; else the one all have.
    let policy = read
        .iter()
        .find(|(_, policy)| eviction_risk(policy).is_some())
        .or(read.first())
        .map(|(_, policy)| policy.clone());
    *shared
        .maxmemory_policy
        .write()
        .unwrap_or_else(PoisonError::into_inner) = policy;
    Ok(())
}

/// Finds out which primaries have the native module of this crate's state format: where
/// every one has it, the store decides with its commands; where none has, with the Lua
/// functions; on a Cluster where some have it, each call goes to the module on the nodes
/// that have it and to Lua on the others (by the node map, read here). One INFO line says
/// which path is in use (on a mixed Cluster, one per primary): always at a connection
/// (`announce`), else only when the primaries with the module changed (a Cluster found
/// again after a master answered a module call as unknown).
pub(super) async fn detect_module(
    conn: &mut Conn,
    shared: &Shared,
    announce: bool,
) -> Result<(), Failure> {
    if shared.force_lua {
        shared.paths.module.store(false, Ordering::Relaxed);
        shared.paths.edits_batched.store(true, Ordering::Relaxed);
        shared.paths.set_module_nodes(Vec::new());
        shared.paths.set_module_slots(None::<fn(u16) -> bool>);
        tracing::info!("rate-limit decisions run as Lua functions (force_lua)");
        return Ok(());
    }
    let ours = ratelimit_core::packed::STATE_FORMAT;
    // `RATELIMIT.VERSION` only where the command exists: on a server without the module
    // it fails as an unknown command, counted in `errorstat_ERR` at every connection.
    let mut info = redis::cmd("COMMAND");
    info.arg("INFO").arg("RATELIMIT.VERSION");
    let mut found: Vec<(Primary, Option<ModuleVersion>)> = Vec::new();
    for (primary, known) in conn.each_master(info).await? {
        let version = match known {
            Ok(reply) if !command_known(&reply) => None,
            // Known, or COMMAND refused (renamed or forbidden): ask the module itself.
            _ => on_primary(conn, &primary, redis::cmd("RATELIMIT.VERSION"))
                .await
                .ok()
                .and_then(|r| module_format(&r)),
        };
        found.push((primary, version));
    }
    let has = |f: &Option<ModuleVersion>| f.as_ref().map(|f| f.format) == Some(ours);
    let mut with: Vec<(String, u16)> = found
        .iter()
        .filter(|(_, f)| has(f))
        .filter_map(|(primary, _)| match primary {
            Primary::Master { host, port } => Some((host.clone(), *port)),
            Primary::Server => None,
        })
        .collect();
    with.sort();
    let all = !found.is_empty() && found.iter().all(|(_, f)| has(f));
    let announce = announce
        || shared.paths.module_nodes() != with
        || shared.paths.module.load(Ordering::Relaxed) != all;
    // The compact batches only where every primary with the module takes them: a
    // Cluster amid a rollout of the module's versions sends the older form everywhere.
    let compact = !with.is_empty() || all;
    let compact = compact
        && found
            .iter()
            .filter(|(_, f)| has(f))
            .all(|(_, f)| f.as_ref().is_some_and(|f| f.protocol >= 1));
    shared.paths.compact.store(compact, Ordering::Relaxed);
    // Calls decided once (protocol 2) likewise: only where every module primary keeps
    // the replies of recent calls, so that a resend finds the first run wherever it goes.
    let once = compact
        && found
            .iter()
            .filter(|(_, f)| has(f))
            .all(|(_, f)| f.as_ref().is_some_and(|f| f.protocol >= 2));
    shared.paths.once.store(once, Ordering::Relaxed);
    // Debt (protocol 3) likewise: a module without `RATELIMIT.DEBIT` leaves it to Lua.
    let debt = (!with.is_empty() || all)
        && found
            .iter()
            .filter(|(_, f)| has(f))
            .all(|(_, f)| f.as_ref().is_some_and(|f| f.protocol >= 3));
    shared.paths.debt.store(debt, Ordering::Relaxed);
    // Edits decided once (protocol 4) likewise: an edit carries an id only where every
    // module primary keeps the replies, so that a resend finds the first run.
    let edits_once = (!with.is_empty() || all)
        && found
            .iter()
            .filter(|(_, f)| has(f))
            .all(|(_, f)| f.as_ref().is_some_and(|f| f.protocol >= 4));
    shared.paths.edits_once.store(edits_once, Ordering::Relaxed);
    // Edits in batches (protocol 5): where every module primary takes them, or none has
    // the module (the Lua functions of this version take them).
    let edits_batched = found
        .iter()
        .filter(|(_, f)| has(f))
        .all(|(_, f)| f.as_ref().is_some_and(|f| f.protocol >= 5));
    shared
        .paths
        .edits_batched
        .store(edits_batched, Ordering::Relaxed);
    shared.paths.module.store(all, Ordering::Relaxed);
    shared.paths.set_module_nodes(with.clone());
    let mixed = !all && !with.is_empty();
    if mixed {
        if let Conn::Cluster(cluster) = conn {
            let mut cmd = redis::cmd("CLUSTER");
            cmd.arg("SLOTS");
            let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random);
            let reply = cluster.route_command(cmd, routing).await?;
            match Nodes::parse(&reply) {
                Some(nodes) => nodes.map_module(&shared.paths, &with),
                None => shared.paths.set_module_slots(None::<fn(u16) -> bool>),
            }
        }
    } else {
        shared.paths.set_module_slots(None::<fn(u16) -> bool>);
    }
    let path = |f: &Option<ModuleVersion>| match f {
        Some(ModuleVersion {
            version, format, ..
        }) if *format == ours => {
            format!("in the Redis module ratelimit {version}")
        }
        Some(ModuleVersion {
            version, format, ..
        }) => format!(
            "as Lua functions: the module ratelimit {version} has state format {format}, \
             not {ours}"
        ),
        None => "as Lua functions: no ratelimit module".to_owned(),
    };
    if !announce {
        return Ok(());
    }
    if mixed {
        for (primary, f) in &found {
            tracing::info!(
                ?primary,
                "rate-limit decisions on this primary run {}",
                path(f)
            );
        }
    } else if let Some((_, f)) = found.first() {
        tracing::info!(
            state_format = ours,
            primaries = found.len(),
            compact_batches = compact,
            "rate-limit decisions run {}",
            path(f)
        );
    }
    Ok(())
}

/// Whether a `COMMAND INFO <name>` reply describes the command: one entry, not nil.
fn command_known(reply: &Value) -> bool {
    match reply {
        Value::Array(entries) => entries.iter().any(|e| !matches!(e, Value::Nil)),
        _ => false,
    }
}

/// What a module answers to `RATELIMIT.VERSION`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct ModuleVersion {
    version: String,
    /// The state format it reads and writes.
    format: u64,
    /// Its batch protocol: 1 with the compact batches, 0 (no third element) before them.
    protocol: u64,
}

/// The version, state format and batch protocol in a `RATELIMIT.VERSION` reply; elements
/// past the ones this version reads (a later module's) are left alone.
pub(super) fn module_format(reply: &Value) -> Option<ModuleVersion> {
    let Value::Array(items) = reply else {
        return None;
    };
    let version = match items.first()? {
        Value::SimpleString(s) => s.clone(),
        Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        _ => return None,
    };
    let Value::Int(format) = items.get(1)? else {
        return None;
    };
    let protocol = match items.get(2) {
        Some(Value::Int(protocol)) => u64::try_from(*protocol).unwrap_or(0),
        _ => 0,
    };
    Some(ModuleVersion {
        version,
        format: u64::try_from(*format).ok()?,
        protocol,
    })
}

/// The policy's value in a `CONFIG GET` reply: a map or a flat array.
pub(super) fn policy_in(reply: &Value) -> Option<String> {
    match reply {
        Value::BulkString(bytes) => {
            let s = String::from_utf8_lossy(bytes);
            (s != "maxmemory-policy").then(|| s.into_owned())
        }
        Value::SimpleString(s) => (s != "maxmemory-policy").then(|| s.clone()),
        Value::Array(items) => items.iter().find_map(policy_in),
        Value::Map(pairs) => pairs.iter().find_map(|(_, v)| policy_in(v)),
        _ => None,
    }
}

/// Why `policy` can evict the store's keys, or `None` when it cannot.
pub(super) fn eviction_risk(policy: &str) -> Option<&'static str> {
    if policy == "noeviction" {
        None
    } else if policy.starts_with("allkeys-") {
        Some("the policy evicts any key when memory runs out")
    } else {
        Some("the policy evicts keys with a TTL when memory runs out, and every rate-limit state key has one")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_replies_of_every_module_version_are_read() {
        let version = |protocol| ModuleVersion {
            version: "0.1.0".to_owned(),
            format: 2,
            protocol,
        };
        let reply = |items: &[Value]| {
            let mut all = vec![Value::SimpleString("0.1.0".to_owned()), Value::Int(2)];
            all.extend_from_slice(items);
            Value::Array(all)
        };
        // A module before the compact batches.
        assert_eq!(module_format(&reply(&[])), Some(version(0)));
        assert_eq!(module_format(&reply(&[Value::Int(1)])), Some(version(1)));
        // A later module's extra elements are left alone, and so is a protocol of a
        // shape this version does not know.
        assert_eq!(
            module_format(&reply(&[Value::Int(3), Value::Nil, Value::Int(9)])),
            Some(version(3))
        );
        assert_eq!(module_format(&reply(&[Value::Nil])), Some(version(0)));
        // What a store before the protocol read: the first two elements only (its
        // parser took `items.first()` and `items.get(1)`), so it reads these replies too.
        assert_eq!(module_format(&Value::Array(vec![Value::Int(2)])), None);
        assert_eq!(module_format(&Value::Nil), None);
    }

    #[test]
    fn command_info_tells_a_known_command_from_an_unknown_one() {
        let name = Value::BulkString(b"ratelimit.version".to_vec());
        assert!(command_known(&Value::Array(vec![Value::Array(vec![
            name,
            Value::Int(1)
        ])])));
        // An unknown command is a nil entry; a reply of another shape is no answer.
        assert!(!command_known(&Value::Array(vec![Value::Nil])));
        assert!(!command_known(&Value::Array(vec![])));
        assert!(!command_known(&Value::Nil));
    }

    #[test]
    fn eviction_policies() {
        assert_eq!(eviction_risk("noeviction"), None);
        for evicting in [
            "allkeys-lru",
            "allkeys-lfu",
            "allkeys-random",
            "volatile-lru",
            "volatile-ttl",
        ] {
            assert!(eviction_risk(evicting).is_some(), "{evicting}");
        }
        let flat = Value::Array(vec![
            Value::BulkString(b"maxmemory-policy".to_vec()),
            Value::BulkString(b"allkeys-lru".to_vec()),
        ]);
        assert_eq!(policy_in(&flat).as_deref(), Some("allkeys-lru"));
        let map = Value::Map(vec![(
            Value::BulkString(b"maxmemory-policy".to_vec()),
            Value::BulkString(b"noeviction".to_vec()),
        )]);
        assert_eq!(policy_in(&map).as_deref(), Some("noeviction"));
    }
}
