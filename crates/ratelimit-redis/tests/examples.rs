//! The documentation's examples, run for real against a started redis-server.

use std::time::Duration;

use ratelimit_core::{Outcome, RuleSet, Store};
use ratelimit_redis::bb8;
use ratelimit_redis::bb8_redis::RedisConnectionManager;
use ratelimit_redis::testing::{wait_connected, RedisCluster, RedisServer};
use ratelimit_redis::RedisStore;

#[tokio::test]
async fn crate_docs_example() {
    let server = RedisServer::start();
    // As in the crate docs, with the server's URL.
    let store = RedisStore::connect(&server.url()).await.unwrap();
    wait_connected(&store).await;
    // The DomainTools rules: 1 per second, 20 per minute, 200 per hour, 800 per day.
    let rules: RuleSet =
        "1/s sliding-log; 20/min sliding-log; 200/h sliding-log; 800/day sliding-log"
            .parse()
            .unwrap();
    let decision = store.check(b"203.0.113.7", &rules, 1).await.unwrap();
    assert!(decision.is_allowed());
    assert_eq!(
        decision
            .rules()
            .iter()
            .map(|r| r.remaining)
            .collect::<Vec<_>>(),
        [0, 19, 199, 799]
    );
    let decision = store.check(b"203.0.113.7", &rules, 1).await.unwrap();
    assert_eq!(decision.outcome(), Outcome::Limited);
    let retry = decision.retry_after().unwrap();
    assert!(retry > Duration::from_millis(900) && retry <= Duration::from_secs(1));
}

#[tokio::test]
async fn redis_store_docs_example() {
    let server = RedisServer::start();
    // The docs show a 20 ms timeout; a loaded CI machine gets more.
    let store = RedisStore::builder()
        .prefix("api")
        .timeout(Duration::from_secs(2))
        .build(&server.url())
        .await
        .unwrap();
    wait_connected(&store).await;
    let rules: RuleSet = "10/s gcra burst=20; 1000/h sliding-window precision=6"
        .parse()
        .unwrap();
    let decision = store.check(b"203.0.113.7", &rules, 1).await.unwrap();
    assert!(decision.is_allowed());
    assert_eq!(decision.retry_after(), None);
    assert_eq!(store.prefix(), "api");
}

#[tokio::test]
async fn cluster_store_docs_example() {
    let cluster = RedisCluster::start();
    let store = RedisStore::builder()
        .build_cluster(cluster.urls())
        .await
        .unwrap();
    wait_connected(&store).await;
    let rules: RuleSet = "1/s sliding-log; 20/min sliding-log".parse().unwrap();
    assert!(store
        .check(b"user-42", &rules, 1)
        .await
        .unwrap()
        .is_allowed());
    assert!(!store
        .check(b"user-42", &rules, 1)
        .await
        .unwrap()
        .is_allowed());
}

#[tokio::test]
async fn a_pool_the_application_already_has() {
    let server = RedisServer::start();
    let manager = RedisConnectionManager::new(server.url()).unwrap();
    // bb8's defaults, PING on checkout included: slower, still correct.
    let pool = bb8::Pool::builder()
        .max_size(2)
        .build(manager)
        .await
        .unwrap();
    let store = RedisStore::builder()
        .prefix("mine")
        .timeout(Duration::from_secs(5))
        .build_with_pool(pool.clone());
    let rules: RuleSet = "2/min fixed-window".parse().unwrap();
    // The scripts were never loaded: the first call sends them.
    assert!(store.check(b"k", &rules, 1).await.unwrap().is_allowed());
    assert!(store.check(b"k", &rules, 1).await.unwrap().is_allowed());
    assert!(!store.check(b"k", &rules, 1).await.unwrap().is_allowed());
    store
        .block(b"k", Some(Duration::from_secs(1)))
        .await
        .unwrap();
    assert_eq!(
        store.check(b"k", &rules, 1).await.unwrap().outcome(),
        Outcome::Blocked
    );
    // The application's pool is still its own.
    let mut conn = pool.get().await.unwrap();
    let pong: String = ratelimit_redis::redis::cmd("PING")
        .query_async(&mut *conn)
        .await
        .unwrap();
    assert_eq!(pong, "PONG");
}

#[test]
#[should_panic(expected = "hash tag")]
fn build_with_pool_refuses_a_prefix_with_braces() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let manager = RedisConnectionManager::new("redis://127.0.0.1:1/").unwrap();
        let pool = bb8::Pool::builder().build_unchecked(manager);
        let _ = RedisStore::builder().prefix("{x}").build_with_pool(pool);
    });
}
