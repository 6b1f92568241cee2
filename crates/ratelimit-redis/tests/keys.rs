//! Keys are data, never syntax: awkward client keys neither collide, nor escape the
//! prefix, nor split one client's keys across Redis Cluster slots.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use ratelimit_core::{Outcome, RuleSet, Store};
use ratelimit_redis::redis;
use ratelimit_redis::testing::{wait_connected, RedisCluster, RedisServer};
use ratelimit_redis::{RedisStore, RedisStoreError};

/// Client keys chosen to break naive key building.
fn awkward_keys() -> Vec<Vec<u8>> {
    let mut keys: Vec<Vec<u8>> = [
        &b""[..],
        b"a",
        b"a:b",
        b"a:",
        b":b",
        b"{a}",
        b"a}",
        b"{",
        b"}",
        b"{}",
        b"}:b",
        b"k}:s:0000000000000000",
        b"ratelimit:{k61}:b",
        b"\r\n*1\r\n$4\r\nPING\r\n",
        b"*",
        b"\xff\xfe\x00\x7b\x7d",
        "żółw".as_bytes(),
    ]
    .iter()
    .map(|k| k.to_vec())
    .collect();
    keys.push(vec![b'x'; 10 * 1024]);
    keys.push(vec![b'{'; 10 * 1024]);
    keys
}

/// Rules that write each of a client's keys: the state, and the sliding log.
fn rules() -> RuleSet {
    "1/min fixed-window; 2/min gcra burst=2; 1/min sliding-log; 5/min sliding-window precision=2"
        .parse()
        .unwrap()
}

/// Uses every key once, blocks it, and checks that each key stands alone.
async fn exercise(store: &impl Store<Error = RedisStoreError>, keys: &[Vec<u8>]) {
    let rules = rules();
    for key in keys {
        let d = store.check(key, &rules, 1).await.unwrap();
        assert!(d.is_allowed(), "first use of {key:?}: {d:?}");
        store
            .block(key, Some(Duration::from_secs(600)))
            .await
            .unwrap();
    }
    for key in keys {
        let d = store.check(key, &rules, 1).await.unwrap();
        assert_eq!(d.outcome(), Outcome::Blocked, "{key:?}");
        store.unblock(key).await.unwrap();
        let d = store.check(key, &rules, 1).await.unwrap();
        assert_eq!(
            d.outcome(),
            Outcome::Limited,
            "{key:?} used once already: {d:?}"
        );
        store
            .block(key, Some(Duration::from_secs(600)))
            .await
            .unwrap();
    }
}

/// Groups the store keys by the client key in their hash tag, asserting that every key
/// is behind `prefix`, printable, and has exactly one hash tag.
fn keys_by_client(
    all: Vec<Vec<u8>>,
    prefix: &str,
) -> BTreeMap<common::StoredKeyBuf, BTreeSet<String>> {
    let mut by_client: BTreeMap<common::StoredKeyBuf, BTreeSet<String>> = BTreeMap::new();
    for name in all {
        let text = String::from_utf8(name.clone()).expect("printable key names");
        assert!(
            text.starts_with(&format!("{prefix}:{{k"))
                || text.starts_with(&format!("{prefix}:{{d")),
            "{text} escapes {prefix}"
        );
        assert!(text.bytes().all(|b| b.is_ascii_graphic()), "{text:?}");
        assert_eq!(text.matches('{').count(), 1, "{text}");
        assert_eq!(text.matches('}').count(), 1, "{text}");
        // Bounded whatever the client key's length: a 32-byte digest at most.
        assert!(text.len() <= prefix.len() + 2 * 64 + 24, "{text}");
        by_client
            .entry(common::held_key_of(&name))
            .or_default()
            .insert(text);
    }
    by_client
}

fn assert_layout(by_client: &BTreeMap<common::StoredKeyBuf, BTreeSet<String>>, keys: &[Vec<u8>]) {
    let expected: BTreeSet<common::StoredKeyBuf> =
        keys.iter().map(|k| common::StoredKeyBuf::of(k)).collect();
    let found: BTreeSet<common::StoredKeyBuf> = by_client.keys().cloned().collect();
    assert_eq!(
        found, expected,
        "hex decoding gives back exactly the client keys, long ones as their digest"
    );
    for (client, names) in by_client {
        // Block marker, state and sliding log: one of each per client, whatever the rules
        // (besides the records of recent calls on the Lua functions, which expire).
        let kept: Vec<&String> = names
            .iter()
            .filter(|name| !common::is_record(name.as_bytes()))
            .collect();
        assert_eq!(kept.len(), 3, "{client:?}: {names:?}");
    }
}

#[tokio::test]
async fn awkward_keys_stay_apart_and_behind_the_prefix() {
    let server = RedisServer::start();
    let store = RedisStore::builder()
        .prefix("app:rl")
        .timeout(Duration::from_secs(5))
        .build(&server.url())
        .await
        .unwrap();
    wait_connected(&store).await;
    let keys = awkward_keys();
    exercise(&store, &keys).await;
    let mut con = common::conn(&server.url());
    let by_client = keys_by_client(common::all_keys(&mut con), "app:rl");
    assert_layout(&by_client, &keys);

    // Another prefix on the same server shares nothing.
    let other = RedisStore::builder()
        .prefix("app:rl2")
        .timeout(Duration::from_secs(5))
        .build(&server.url())
        .await
        .unwrap();
    wait_connected(&other).await;
    for key in &keys {
        let d = other.check(key, &rules(), 1).await.unwrap();
        assert!(d.is_allowed(), "{key:?} under another prefix: {d:?}");
    }
}

#[tokio::test]
async fn a_prefix_that_would_change_the_hash_tag_is_refused() {
    let server = RedisServer::start();
    for prefix in ["{rl}", "rl{", "rl}"] {
        let err = RedisStore::builder()
            .prefix(prefix)
            .build(&server.url())
            .await
            .unwrap_err();
        assert!(matches!(err, RedisStoreError::InvalidConfig(_)), "{err:?}");
        assert!(err.to_string().contains("hash tag"), "{err}");
    }
}

#[tokio::test]
async fn each_clients_keys_share_one_cluster_slot() {
    let cluster = RedisCluster::start();
    let store = RedisStore::builder()
        .prefix("rl")
        .timeout(Duration::from_secs(5))
        .build_cluster(cluster.urls())
        .await
        .unwrap();
    wait_connected(&store).await;
    let keys = awkward_keys();
    exercise(&store, &keys).await;

    let mut all = Vec::new();
    let mut per_node = Vec::new();
    for url in cluster.urls() {
        let found = common::all_keys(&mut common::conn(&url));
        per_node.push(found.len());
        all.extend(found);
    }
    let by_client = keys_by_client(all, "rl");
    assert_layout(&by_client, &keys);

    let mut con = common::conn(&cluster.urls()[0]);
    let mut slots = BTreeSet::new();
    for (client, names) in &by_client {
        let client_slots: BTreeSet<u16> = names
            .iter()
            .map(|name| {
                redis::cmd("CLUSTER")
                    .arg("KEYSLOT")
                    .arg(name)
                    .query(&mut con)
                    .unwrap()
            })
            .collect();
        assert_eq!(
            client_slots.len(),
            1,
            "{client:?} spans slots {client_slots:?}"
        );
        slots.extend(client_slots);
    }
    // Different clients spread over slots and nodes.
    assert!(slots.len() > 10, "{slots:?}");
    assert!(
        per_node.iter().all(|n| *n > 0),
        "keys per node: {per_node:?}"
    );
}

#[tokio::test]
async fn a_mebibyte_key_is_one_client_under_a_bounded_name() {
    let server = RedisServer::start();
    let store = RedisStore::builder()
        .prefix("rl")
        .timeout(Duration::from_secs(5))
        .build(&server.url())
        .await
        .unwrap();
    wait_connected(&store).await;
    let rules: RuleSet = "2/min fixed-window".parse().unwrap();
    let mut huge = vec![b'k'; 1 << 20];
    assert!(store.check(&huge, &rules, 1).await.unwrap().is_allowed());
    assert!(store.check(&huge, &rules, 1).await.unwrap().is_allowed());
    assert_eq!(
        store.check(&huge, &rules, 1).await.unwrap().outcome(),
        Outcome::Limited
    );
    // One byte different is another client.
    huge[12345] = b'j';
    assert!(store.check(&huge, &rules, 1).await.unwrap().is_allowed());
    let mut con = common::conn(&server.url());
    let (records, names): (Vec<Vec<u8>>, Vec<Vec<u8>>) = common::all_keys(&mut con)
        .into_iter()
        .partition(|name| common::is_record(name));
    assert_eq!(names.len(), 2, "{names:?}");
    // One record per call, bounded as the names are (32 hex digits more).
    assert_eq!(records.len(), 4, "{records:?}");
    for name in records {
        assert!(name.len() < 100 + 34, "{}", String::from_utf8_lossy(&name));
    }
    for name in names {
        assert!(name.len() < 100, "{}", String::from_utf8_lossy(&name));
    }
}
