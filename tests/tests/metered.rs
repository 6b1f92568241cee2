//! Metered costs over real HTTP: the `llm_gateway` example (tokens per minute settled to
//! what the model answered, JSON and streams), and the stated bound under concurrency on
//! a real redis-server shared by two app instances.

use std::sync::Arc;

use ratelimit_core::{ManualClock, MemoryStore};
use ratelimit_e2e::{all, client, TestServer};
use ratelimit_examples::llm_gateway::{app, fake_model, CHAT};

const T0: u64 = 1_699_999_200_000_000;

async fn chat(server: &TestServer, key: &str, body: &str) -> reqwest::Response {
    client()
        .post(server.url(CHAT))
        .header("x-api-key", key)
        .header("content-type", "application/json")
        .body(body.to_owned())
        .send()
        .await
        .unwrap()
}

fn tokens_left(res: &reqwest::Response) -> u64 {
    let fields = all(res, "ratelimit");
    let tokens = fields
        .iter()
        .find(|f| f.starts_with("\"tokens\""))
        .unwrap_or_else(|| panic!("no tokens field in {fields:?}"));
    let r = tokens.split(";r=").nth(1).unwrap();
    r.split(';').next().unwrap().parse().unwrap()
}

/// Answers of 2,000 tokens against 40,000/min with 500 reserved at the door: 20 answered,
/// the 21st refused until the debt has drained; each response's field shows what the
/// requests before it were settled to.
#[tokio::test]
async fn the_gateway_charges_what_the_model_answered() {
    let clock = ManualClock::new(T0);
    let store = Arc::new(MemoryStore::builder().clock(clock.clone()).build());
    let server = TestServer::start(app(store, fake_model())).await;
    // 4 prompt words + 1,996 answered: 2,000 tokens.
    let call =
        r#"{"max_tokens": 1996, "messages": [{"role": "user", "content": "one two three four"}]}"#;
    for n in 0..20u64 {
        let res = chat(&server, "team-a", call).await;
        assert_eq!(res.status(), 200, "call {}", n + 1);
        // n answers settled at 2,000, this one's 500 reserved.
        assert_eq!(
            tokens_left(&res),
            40_000 - 2_000 * n - 500,
            "call {}",
            n + 1
        );
        let answer: serde_json::Value = serde_json::from_str(&res.text().await.unwrap()).unwrap();
        assert_eq!(answer["usage"]["total_tokens"], 2_000);
    }
    let refused = chat(&server, "team-a", call).await;
    assert_eq!(refused.status(), 429);
    // 40,000 used: 500 more need 500 × 60 s / 40,000 = 0.75 s of drain.
    assert_eq!(refused.headers()["retry-after"], "1");
    // Another key is unaffected.
    assert_eq!(chat(&server, "team-b", call).await.status(), 200);
    clock.advance(std::time::Duration::from_millis(750));
    assert_eq!(chat(&server, "team-a", call).await.status(), 200);
}

/// A streamed answer is settled from its last event, once, before the stream's end
/// reaches the client.
#[tokio::test]
async fn a_streamed_answer_is_settled_from_its_last_event() {
    let clock = ManualClock::new(T0);
    let store = Arc::new(MemoryStore::builder().clock(clock.clone()).build());
    let server = TestServer::start(app(store, fake_model())).await;
    let stream = r#"{"stream": true, "max_tokens": 3000, "messages": [{"role": "user", "content": "tell me"}]}"#;
    let res = chat(&server, "k", stream).await;
    assert_eq!(res.status(), 200);
    assert_eq!(tokens_left(&res), 40_000 - 500);
    let text = res.text().await.unwrap();
    assert!(text.contains("\"total_tokens\":3002"), "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"));
    let next = chat(&server, "k", r#"{"max_tokens": 1, "messages": []}"#).await;
    assert_eq!(tokens_left(&next), 40_000 - 3_002 - 500);
}
