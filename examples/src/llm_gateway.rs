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
async fn proxy(Extension(model): Extension<Router>, usage: Usage, req: Request) -> Response {
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
        let mut events_read = StreamUsage::default();
        let events = body.into_data_stream().map(move |chunk| {
            let chunk = chunk.map_err(std::io::Error::other)?;
            if let Some(total) = events_read.feed(&chunk) {
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

/// The longest line of a stream [`StreamUsage`] reads: 64 KiB, far above an event
/// carrying a usage (a few hundred bytes). A longer line is skipped, however it is cut
/// into chunks, so that a stream that never ends a line cannot make the proxy hold more.
pub const MAX_EVENT_LINE: usize = 64 * 1024;

/// The usage in a stream of server-sent events, read as its chunks pass. A chunk boundary
/// falls anywhere (in an event's JSON, in its `data:`, between a `\r` and its `\n`):
/// the part of a line whose end has not arrived is kept until it does, so an event is
/// read whole whatever the chunks, at most [`MAX_EVENT_LINE`] bytes of it.
#[derive(Debug, Default)]
pub struct StreamUsage {
    /// The start of a line whose end is in a later chunk.
    partial: Vec<u8>,
    /// The line being read is longer than `MAX_EVENT_LINE`: it is passed over to its end.
    skipping: bool,
}

impl StreamUsage {
    /// Reads the next `chunk` of the stream: the usage of the last event ending in it
    /// that carries one, if any.
    pub fn feed(&mut self, chunk: &[u8]) -> Option<u64> {
        let mut found = None;
        let mut rest = chunk;
        // An event's lines end with `\n`, `\r\n` or `\r`; the empty line between a
        // `\r` and its `\n` carries nothing.
        while let Some(end) = rest.iter().position(|&b| b == b'\n' || b == b'\r') {
            let (head, tail) = (&rest[..end], &rest[end + 1..]);
            rest = tail;
            if std::mem::take(&mut self.skipping)
                || self.partial.len() + head.len() > MAX_EVENT_LINE
            {
                self.partial.clear();
                continue;
            }
            let total = if self.partial.is_empty() {
                line_usage(head)
            } else {
                self.partial.extend_from_slice(head);
                let total = line_usage(&self.partial);
                self.partial.clear();
                total
            };
            found = total.or(found);
        }
        if !self.skipping {
            if self.partial.len() + rest.len() > MAX_EVENT_LINE {
                self.partial = Vec::new();
                self.skipping = true;
            } else {
                self.partial.extend_from_slice(rest);
            }
        }
        found
    }
}

/// The usage in one line of server-sent events: a `data:` field (the space after the
/// colon optional) holding an event that carries one.
fn line_usage(line: &[u8]) -> Option<u64> {
    let data = line.strip_prefix(b"data:")?;
    let data = data.strip_prefix(b" ").unwrap_or(data);
    total_tokens(&serde_json::from_slice::<Value>(data).ok()?)
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use axum::http::Request;
    use ratelimit_core::{ManualClock, MemoryStore};

    use super::*;

    /// A stream as the model sends it: a delta, the usage, the end.
    const EVENTS: &str = concat!(
        "data: {\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,",
        "\"delta\":{\"content\":\"word word \"}}]}\n\n",
        "data: {\"object\":\"chat.completion.chunk\",\"choices\":[],\"usage\":",
        "{\"prompt_tokens\":4,\"completion_tokens\":30,\"total_tokens\":34}}\n\n",
        "data: [DONE]\n\n",
    );

    /// What a reader finds in `chunks`, the last usage counting; every chunk checked to
    /// leave at most a line's bound held.
    fn read<'a>(chunks: impl IntoIterator<Item = &'a [u8]>) -> Option<u64> {
        let mut reader = StreamUsage::default();
        let mut found = None;
        for chunk in chunks {
            found = reader.feed(chunk).or(found);
            assert!(reader.partial.len() <= MAX_EVENT_LINE);
        }
        found
    }

    fn split_at<'a>(stream: &'a str, marker: &str, offset: usize) -> [&'a [u8]; 2] {
        let at = stream.find(marker).unwrap() + offset;
        let (a, b) = stream.as_bytes().split_at(at);
        [a, b]
    }

    #[test]
    fn an_event_split_across_chunks_is_read_whole() {
        assert_eq!(read([EVENTS.as_bytes()]), Some(34));
        // In the middle of the JSON, of its number, of the `data:` prefix, and between
        // the prefix and its space.
        let usage_event = "data: {\"object\":\"chat.completion.chunk\",\"choices\":[],";
        for (marker, offset) in [
            ("\"usage\"", 4),
            ("\"total_tokens\":34", 16),
            (usage_event, 2),
            (usage_event, 5),
        ] {
            assert_eq!(
                read(split_at(EVENTS, marker, offset)),
                Some(34),
                "{marker} + {offset}"
            );
        }
        // One byte a chunk, and every place for one cut.
        assert_eq!(read(EVENTS.as_bytes().chunks(1)), Some(34));
        for at in 0..=EVENTS.len() {
            let (a, b) = EVENTS.as_bytes().split_at(at);
            assert_eq!(read([a, b]), Some(34), "cut at {at}");
        }
        // Lines ending in `\r\n` or `\r`, one byte a chunk; `data:` without its space.
        for ending in ["\r\n", "\r"] {
            let events = EVENTS.replace('\n', ending);
            assert_eq!(read(events.as_bytes().chunks(1)), Some(34), "{ending:?}");
        }
        let spaceless = EVENTS.replace("data: ", "data:");
        assert_eq!(read(spaceless.as_bytes().chunks(3)), Some(34));
        // No usage, no report.
        assert_eq!(read([&EVENTS.as_bytes()[..60]]), None);
    }

    #[test]
    fn a_line_beyond_the_bound_is_skipped_however_it_is_cut() {
        let long = format!(
            "data: {{\"pad\":\"{}\",\"usage\":{{\"total_tokens\":99}}}}\n\n",
            "x".repeat(MAX_EVENT_LINE)
        );
        let stream = format!("{long}{EVENTS}");
        // The long line's usage is read in no chunking, the events after it in every one.
        assert_eq!(read([long.as_bytes()]), None);
        assert_eq!(read(long.as_bytes().chunks(1000)), None);
        assert_eq!(read([stream.as_bytes()]), Some(34));
        assert_eq!(read(stream.as_bytes().chunks(1)), Some(34));
        assert_eq!(read(stream.as_bytes().chunks(4096)), Some(34));
        // A line of exactly the bound is read.
        let event = "data: {\"usage\":{\"total_tokens\":7}}";
        let at_bound = format!("{event}{}\n", " ".repeat(MAX_EVENT_LINE - event.len()));
        assert_eq!(at_bound.len(), MAX_EVENT_LINE + 1);
        assert_eq!(read(at_bound.as_bytes().chunks(1000)), Some(7));
    }

    /// Through the gateway: a model that sends its stream one byte a chunk is settled to
    /// the usage in it, not left at the estimate.
    #[tokio::test]
    async fn a_stream_cut_into_single_bytes_is_settled_to_its_usage() {
        let model = Router::new().route(
            CHAT,
            post(|| async {
                let bytes = EVENTS
                    .bytes()
                    .map(|b| Ok::<_, Infallible>(Bytes::from(vec![b])));
                let mut response =
                    Body::from_stream(futures_util::stream::iter(bytes)).into_response();
                response.headers_mut().insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("text/event-stream"),
                );
                response
            }),
        );
        let clock = ManualClock::new(1_699_999_200_000_000);
        let gateway = app(Arc::new(MemoryStore::builder().clock(clock).build()), model);
        let call = || {
            Request::post(CHAT)
                .header("x-api-key", "k")
                .header("content-type", "application/json")
                .body(Body::from(r#"{"stream": true, "messages": []}"#))
                .unwrap()
        };
        let tokens_left = |res: &Response| -> u64 {
            let fields: Vec<&str> = (res.headers().get_all("ratelimit").iter())
                .flat_map(|v| v.to_str().unwrap().split(", "))
                .collect();
            let tokens = (fields.iter().find(|f| f.starts_with("\"tokens\"")))
                .unwrap_or_else(|| panic!("no tokens field in {fields:?}"));
            let r = tokens.split(";r=").nth(1).unwrap();
            r.split(';').next().unwrap().parse().unwrap()
        };
        let first = gateway.clone().oneshot(call()).await.unwrap();
        assert_eq!(tokens_left(&first), 40_000 - ESTIMATE);
        let body = axum::body::to_bytes(first.into_body(), 1 << 20)
            .await
            .unwrap();
        assert_eq!(body, EVENTS.as_bytes());
        // Settled to 34 when the body ended: 34 used, and this one's estimate reserved.
        let second = gateway.oneshot(call()).await.unwrap();
        assert_eq!(tokens_left(&second), 40_000 - 34 - ESTIMATE);
    }
}
