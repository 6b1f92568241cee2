//! The `llm_gateway` example's app: a proxy in front of a language model that limits each
//! API key to 60 requests a minute, 4 in flight at once, and 40,000 tokens a minute, the
//! tokens counted from what the model answered.
//!
//! A request's tokens are known only once the model has answered: in the `usage` of its
//! JSON answer, or in the last event of its stream. The token layer reserves an estimate
//! at the door ([`ESTIMATE`]) and settles it to the actual count when the response body
//! ends, reported by the proxy through [`Usage`]: an answer shorter than the estimate
//! gives the rest back, a longer one is charged in full, as debt the key repays before
//! it is admitted again.
//!
//! The model is [`fake_model`], an in-process stand-in that answers OpenAI-shaped JSON
//! (`usage.total_tokens`) and server-sent events whose last event carries the usage.

use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Json, Router};
use futures_util::StreamExt;
use ratelimit_core::Store;
use ratelimit_tower::{HeaderKey, RateLimitLayer, Usage};
use serde_json::{json, Value};
use tower::ServiceExt;

/// Requests per API key: started per minute, and in flight at once (a stream holds its
/// slot to its end).
pub const REQUESTS: &str = "60/min name=requests; 4 concurrent name=in-flight";

/// Tokens per API key, settled to what the model answered. GCRA repays debt by time, so
/// over any long run a key gets at most 40,000 tokens a minute however wrong the
/// estimates.
pub const TOKENS: &str = "40000/min gcra name=tokens";

/// The tokens reserved at the door, before the model has answered.
pub const ESTIMATE: u64 = 500;

/// The path of the chat endpoint, the model's and the gateway's alike.
pub const CHAT: &str = "/v1/chat/completions";

/// The gateway, its limits in `store`, proxying to `model` (in process).
pub fn app<S: Store + Clone>(store: S, model: Router) -> Router {
    let api_key = || HeaderKey::new("x-api-key");
    let requests = RateLimitLayer::builder(store.clone(), api_key())
        .rules(REQUESTS)
        .expect("the rule text is valid")
        .namespace("llm-requests")
        .build()
        .expect("the layer's configuration is valid");
    let tokens = RateLimitLayer::builder(store, api_key())
        .rules(TOKENS)
        .expect("the rule text is valid")
        .namespace("llm-tokens")
        .cost(|_: &Request| ESTIMATE)
        .usage_extension(true)
        .build()
        .expect("the layer's configuration is valid");
    Router::new()
        .route(CHAT, post(proxy))
        .layer(Extension(model))
        // The request budget outside: a request refused for tokens gives its request
        // back, one refused for requests never reserves tokens.
        .layer(tokens)
        .layer(requests)
}

/// Forwards the call to the model and reports the tokens it answered with: from the JSON
/// answer at once, from a stream's events as they pass.
async fn proxy(
    Extension(model): Extension<Router>,
    Extension(usage): Extension<Usage>,
    req: Request,
) -> Response {
    let answer = match model.oneshot(req).await {
        Ok(answer) => answer,
        Err(never) => match never {},
    };
    let streamed = answer
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|t| t.as_bytes().starts_with(b"text/event-stream"));
    let (parts, body) = answer.into_parts();
    if streamed {
        let events = body.into_data_stream().map(move |chunk| {
            let chunk = chunk.map_err(std::io::Error::other)?;
            if let Some(total) = stream_usage(&chunk) {
                usage.report(total);
            }
            Ok::<Bytes, std::io::Error>(chunk)
        });
        return Response::from_parts(parts, Body::from_stream(events));
    }
    let Ok(bytes) = axum::body::to_bytes(body, 1 << 20).await else {
        return (StatusCode::BAD_GATEWAY, "the model's answer is too long\n").into_response();
    };
    if let Some(total) = serde_json::from_slice::<Value>(&bytes)
        .ok()
        .and_then(|v| total_tokens(&v))
    {
        usage.report(total);
    }
    Response::from_parts(parts, Body::from(bytes))
}

/// `usage.total_tokens` of an OpenAI-shaped answer or stream event.
fn total_tokens(value: &Value) -> Option<u64> {
    value.get("usage")?.get("total_tokens")?.as_u64()
}

/// The usage in a chunk of server-sent events, if one of its events carries it.
fn stream_usage(chunk: &[u8]) -> Option<u64> {
    let text = std::str::from_utf8(chunk).ok()?;
    text.lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .filter_map(|data| serde_json::from_str::<Value>(data).ok())
        .find_map(|event| total_tokens(&event))
}

/// An in-process stand-in for a model server: `POST /v1/chat/completions` with
/// `{"messages": [...], "max_tokens": n, "stream": bool}` answers `max_tokens` (100 when
/// unset) words, and a prompt's tokens are its words. Streamed, it sends one event per
/// ten words, then an event with the usage, then `[DONE]`. `"think_ms": n` makes it take
/// that long (at most 10 s) before it answers.
pub fn fake_model() -> Router {
    Router::new().route(CHAT, post(complete))
}

async fn complete(Json(call): Json<Value>) -> Response {
    let prompt_tokens: u64 = call["messages"]
        .as_array()
        .map(|messages| {
            messages
                .iter()
                .filter_map(|m| m["content"].as_str())
                .map(|c| c.split_whitespace().count() as u64)
                .sum()
        })
        .unwrap_or(0);
    let completion_tokens = call["max_tokens"].as_u64().unwrap_or(100).min(100_000);
    if let Some(ms) = call["think_ms"].as_u64() {
        tokio::time::sleep(std::time::Duration::from_millis(ms.min(10_000))).await;
    }
    let usage = json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    });
    if call["stream"].as_bool() != Some(true) {
        let answer = json!({
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant",
                "content": "word ".repeat(completion_tokens as usize).trim_end()}}],
            "usage": usage,
        });
        return Json(answer).into_response();
    }
    let chunks = completion_tokens.div_ceil(10);
    let deltas = (0..chunks).map(move |i| {
        let words = (completion_tokens - i * 10).min(10) as usize;
        let event = json!({"object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"content": "word ".repeat(words)}}]});
        format!("data: {event}\n\n")
    });
    let last = json!({"object": "chat.completion.chunk", "choices": [], "usage": usage});
    let events = deltas
        .chain([format!("data: {last}\n\n"), "data: [DONE]\n\n".to_owned()])
        .map(|event| Ok::<Bytes, Infallible>(Bytes::from(event)));
    let mut response = Body::from_stream(futures_util::stream::iter(events)).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    response
}
