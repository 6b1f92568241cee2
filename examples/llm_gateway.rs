//! An LLM gateway: per API key, 60 requests a minute (4 in flight) and 40,000 tokens a
//! minute, the tokens settled to what the model answered (in its JSON `usage`, or in the
//! last event of its stream) once the response has ended.
//!
//! ```sh
//! cargo run -p ratelimit-examples --example llm_gateway
//! # each answer costs 2,000 tokens: 20 are answered, the 21st is refused (429)
//! for i in $(seq 21); do curl -s -o /dev/null -w '%{http_code} ' -H 'x-api-key: demo' -H 'content-type: application/json' -d '{"max_tokens": 1996, "messages": [{"role": "user", "content": "one two three four"}]}' localhost:3000/v1/chat/completions; done; echo
//! # a stream, its usage in its last event; the RateLimit field shows the tokens left
//! curl -iN -H 'x-api-key: demo2' -H 'content-type: application/json' -d '{"stream": true, "max_tokens": 30, "messages": []}' localhost:3000/v1/chat/completions
//! ```
//!
//! Serves on 127.0.0.1:3000 (`PORT` to change it), in front of an in-process stand-in
//! for the model.

use std::sync::Arc;

use ratelimit_core::MemoryStore;
use ratelimit_examples::llm_gateway::{app, fake_model, CHAT, ESTIMATE, REQUESTS, TOKENS};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    ratelimit_examples::serve::logging();
    let app = app(Arc::new(MemoryStore::new()), fake_model());
    ratelimit_examples::serve::serve(app, |addr| {
        println!("serving on http://{addr}");
        println!("  POST {CHAT}  per x-api-key: {REQUESTS}; {TOKENS}");
        println!("  ({ESTIMATE} tokens reserved at the door, settled to the model's count)");
        println!("try it (each answer costs 2,000 tokens: the 21st is refused, and the");
        println!("RateLimit field shows the tokens settled):");
        println!(
            "  for i in $(seq 21); do curl -s -o /dev/null -w '%{{http_code}} ' -H 'x-api-key: demo' -H 'content-type: application/json' -d '{{\"max_tokens\": 1996, \"messages\": [{{\"role\": \"user\", \"content\": \"one two three four\"}}]}}' http://{addr}{CHAT}; done; echo"
        );
        println!(
            "  curl -N -H 'x-api-key: demo2' -H 'content-type: application/json' -d '{{\"stream\": true, \"max_tokens\": 30, \"messages\": []}}' http://{addr}{CHAT}"
        );
    })
    .await
}
