//! One store over every topology: the primary Redis Sentinel names (across a failover),
//! and what the store reads about the server (or each Cluster master) at connect.

use std::time::Duration;

use ratelimit_core::{Outcome, RuleSet, Store};
use ratelimit_redis::testing::{
    wait_connected, RedisCluster, RedisSentinel, RedisServer, CONNECT_WAIT, SENTINEL_SERVICE,
};
use ratelimit_redis::{RedisStore, RedisStoreError};

fn rules() -> RuleSet {
    "10/min fixed-window; 10/min sliding-log".parse().unwrap()
}

#[tokio::test]
async fn sentinel_store_follows_a_failover_without_losing_counts() {
    follows_a_failover(RedisSentinel::start(), false).await;
}

/// The same with the module on both servers: the store finds it on the new primary and
/// the state the old one's module wrote carries over.
#[tokio::test]
async fn sentinel_store_on_the_module_follows_a_failover() {
    follows_a_failover(RedisSentinel::start_with_module(), true).await;
}

#[tokio::test]
async fn sentinel_store_on_valkey_with_the_module_follows_a_failover() {
    follows_a_failover(RedisSentinel::start_valkey_with_module(), true).await;
}

/// Checks through the Sentinel-named primary, fails over, and requires the counts, the
/// path (module or Lua) and blocks to carry on on the new primary.
async fn follows_a_failover(set: RedisSentinel, module: bool) {
    let store = RedisStore::builder()
        .timeout(Duration::from_secs(5))
        .build_sentinel([set.url()], SENTINEL_SERVICE)
        .await
        .unwrap();
    wait_connected(&store).await;
    assert!(store.pool().is_none());
    assert_eq!(store.uses_module(), module);
    let rules = rules();
    for _ in 0..6 {
        assert!(store.check(b"k", &rules, 1).await.unwrap().is_allowed());
    }
    set.failover().unwrap();
    assert_eq!(
        set.current_primary_port().unwrap(),
        set.replica().port(),
        "the replica was promoted"
    );
    // The old primary now answers writes with READONLY, or closed the store's
    // connection when it was demoted: the store asks the Sentinel again and carries on
    // with the new primary, which has the counts. A check sent on the closed connection
    // fails (it may have run, for all the store can tell), once per connection.
    let (mut admitted, mut limited, mut failed) = (0, 0, 0);
    for _ in 0..10 {
        match store.check(b"k", &rules, 1).await {
            Ok(d) if d.is_allowed() => admitted += 1,
            Ok(d) => {
                assert_eq!(d.outcome(), Outcome::Limited);
                limited += 1;
            }
            Err(e) if e.is_unavailable() && failed == 0 => {
                failed += 1;
                wait_connected(&store).await;
            }
            Err(e) => panic!("the store should have found the new primary: {e:?}"),
        }
    }
    // 6 of the limit's 10 were used before the failover: 4 more are admitted, then it
    // limits. The failed check ran nowhere (its connection was closed before it).
    assert_eq!((admitted, limited + failed), (4, 6), "{failed} failed");
    assert_eq!(store.uses_module(), module, "the path on the new primary");
    // Blocks go to the new primary too.
    store.block(b"k2", None).await.unwrap();
    assert_eq!(
        store.check(b"k2", &rules, 1).await.unwrap().outcome(),
        Outcome::Blocked
    );
}

#[tokio::test]
async fn sentinel_misconfiguration_is_an_error() {
    let set = RedisSentinel::start();
    // The Sentinels' answer comes with the first connection attempt; an attempt that
    // outlasts the connect timeout (a loaded machine) would start the store unconnected.
    let err = RedisStore::builder()
        .connect_timeout(CONNECT_WAIT)
        .build_sentinel([set.url()], "no-such-service")
        .await
        .unwrap_err();
    assert!(matches!(err, RedisStoreError::InvalidConfig(_)), "{err:?}");
    assert!(err.to_string().contains("service name"), "{err}");
    let err = RedisStore::builder()
        .build_sentinel(Vec::<String>::new(), SENTINEL_SERVICE)
        .await
        .unwrap_err();
    assert!(matches!(err, RedisStoreError::InvalidConfig(_)), "{err:?}");
}

#[tokio::test]
async fn the_eviction_policy_is_read_at_connect() {
    let evicting = RedisServer::start_with(&["--maxmemory-policy", "allkeys-lru"]);
    let store = RedisStore::connect(&evicting.url()).await.unwrap();
    wait_connected(&store).await;
    assert_eq!(store.maxmemory_policy().as_deref(), Some("allkeys-lru"));
    // Over the application's pool: read on the first call.
    let pool = ratelimit_redis::bb8::Pool::builder()
        .build(ratelimit_redis::bb8_redis::RedisConnectionManager::new(evicting.url()).unwrap())
        .await
        .unwrap();
    let pooled = RedisStore::builder().build_with_pool(pool);
    assert_eq!(pooled.maxmemory_policy(), None);
    assert!(pooled.check(b"k", &rules(), 1).await.unwrap().is_allowed());
    assert_eq!(pooled.maxmemory_policy().as_deref(), Some("allkeys-lru"));

    let safe = RedisServer::start_with(&["--maxmemory-policy", "noeviction"]);
    let store = RedisStore::connect(&safe.url()).await.unwrap();
    wait_connected(&store).await;
    assert_eq!(store.maxmemory_policy().as_deref(), Some("noeviction"));

    // A server that forbids CONFIG (as managed services do) still serves the store.
    let locked = RedisServer::start_with(&["--rename-command", "CONFIG", "\"\""]);
    let store = RedisStore::connect(&locked.url()).await.unwrap();
    wait_connected(&store).await;
    assert_eq!(store.maxmemory_policy(), None);
    assert!(store.check(b"k", &rules(), 1).await.unwrap().is_allowed());
}

/// On a Cluster the policy is read from every master: one that can evict is reported,
/// whichever master it is, by a store that connects itself and by one over the
/// application's cluster connection (which reads it on its first call).
#[tokio::test]
async fn the_eviction_policy_is_read_from_every_cluster_master() {
    let cluster = RedisCluster::start();
    let set_policy = |node: &RedisServer, policy: &str| {
        let reply = node
            .command(&format!("CONFIG SET maxmemory-policy {policy}"))
            .unwrap();
        assert!(reply.starts_with("+OK"), "{reply}");
    };
    let store = RedisStore::builder()
        .build_cluster(cluster.urls())
        .await
        .unwrap();
    wait_connected(&store).await;
    assert_eq!(store.maxmemory_policy().as_deref(), Some("noeviction"));
    for (i, bad) in cluster.nodes().iter().enumerate() {
        set_policy(bad, "allkeys-lru");
        let store = RedisStore::builder()
            .build_cluster(cluster.urls())
            .await
            .unwrap();
        wait_connected(&store).await;
        assert_eq!(
            store.maxmemory_policy().as_deref(),
            Some("allkeys-lru"),
            "the bad policy on master {i}"
        );
        let conn = ratelimit_redis::redis::cluster::ClusterClient::new(cluster.urls())
            .unwrap()
            .get_async_connection()
            .await
            .unwrap();
        let given = RedisStore::builder().build_with_cluster_connection(conn);
        assert!(given.check(b"k", &rules(), 1).await.unwrap().is_allowed());
        assert_eq!(
            given.maxmemory_policy().as_deref(),
            Some("allkeys-lru"),
            "over a given connection, the bad policy on master {i}"
        );
        set_policy(bad, "noeviction");
    }
}

/// A Cluster node the cluster connection reconnects to is asked for its policy again:
/// here a master reconfigured to evict while the store's connections to it were cut.
#[tokio::test]
async fn a_cluster_master_reconnected_to_is_asked_for_its_policy_again() {
    let cluster = RedisCluster::start();
    let store = RedisStore::builder()
        .timeout(Duration::from_millis(500))
        .build_cluster(cluster.urls())
        .await
        .unwrap();
    wait_connected(&store).await;
    assert_eq!(store.maxmemory_policy().as_deref(), Some("noeviction"));
    let node = &cluster.nodes()[1];
    let reply = node
        .command("CONFIG SET maxmemory-policy volatile-lru")
        .unwrap();
    assert!(reply.starts_with("+OK"), "{reply}");
    let reply = node.command("CLIENT KILL TYPE normal").unwrap();
    assert!(reply.starts_with(':'), "{reply}");
    // Checks of keys all over the slots reach the node, find its connection gone, and
    // the cluster connection reconnects to it.
    let started = std::time::Instant::now();
    let mut i = 0u64;
    while store.maxmemory_policy().as_deref() != Some("volatile-lru") {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the policy was not read again: {:?}",
            store.maxmemory_policy()
        );
        let _ = store.check(&i.to_be_bytes(), &rules(), 1).await;
        i += 1;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
