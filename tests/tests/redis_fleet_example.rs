//! The `redis_fleet` example started while Redis is down: it serves under its failure
//! policies, then limits through Redis once Redis is up, without a restart, with what
//! it admitted meanwhile handed over to Redis.

use std::num::NonZeroU32;

use ratelimit_e2e::{client, TestServer};
use ratelimit_redis::testing::{wait_connected, RedisServer};

#[allow(dead_code)]
#[path = "../../examples/redis_fleet.rs"]
mod redis_fleet;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleet_example_starts_without_redis_and_limits_through_it_once_up() {
    let mut redis = RedisServer::start();
    redis.stop();
    // The only test in this file: nothing else reads the environment meanwhile.
    std::env::set_var("REDIS_URL", redis.url());
    let (store, _) = redis_fleet::store_from_env()
        .await
        .expect("Redis being down is no reason not to start");
    assert!(!store.is_connected());
    let two = NonZeroU32::new(2).unwrap();
    let a = TestServer::start(redis_fleet::app(store.clone(), two).unwrap()).await;
    let http = client();
    let status = |res: reqwest::Response| res.status().as_u16();

    // Down: `/` is limited locally (half of 10 per minute), logins are refused.
    for _ in 0..3 {
        assert_eq!(status(http.get(a.url("/")).send().await.unwrap()), 200);
    }
    assert_eq!(
        status(http.post(a.url("/login")).send().await.unwrap()),
        503
    );

    // Up: the same instance, not restarted, now shares the limit with a second one.
    redis.restart();
    wait_connected(&store).await;
    let (other, _) = redis_fleet::store_from_env().await.unwrap();
    wait_connected(&other).await;
    let b = TestServer::start(redis_fleet::app(other, two).unwrap()).await;
    let mut admitted = 0;
    for i in 0..14 {
        let server = if i % 2 == 0 { &a } else { &b };
        match status(http.get(server.url("/")).send().await.unwrap()) {
            200 => admitted += 1,
            429 => {}
            s => panic!("unexpected status {s}"),
        }
    }
    // The fleet's 10 per minute in Redis, less the three admissions the fallback made
    // while it was down: the instance hands them over before Redis decides the key again.
    assert_eq!(admitted, 7);
    assert_eq!(
        status(http.post(a.url("/login")).send().await.unwrap()),
        200
    );
}
