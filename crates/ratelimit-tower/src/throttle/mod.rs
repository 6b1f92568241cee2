//! Waiting for a turn on outbound calls: [`ThrottleLayer`] puts a client service (a
//! hyper client, a tonic `Channel`, anything `Service<Request>`) behind a store's
//! limits, so that every instance of an app together calls a partner at most as often
//! as the partner allows, and a caller waits for its slot instead of failing.
//!
//! A throttle counts as a partner does: no window of a rule's period sees more calls
//! than the rule's limit, whatever its algorithm (a fixed window alone lets twice the
//! limit through across a boundary, a GCRA or token bucket a full burst and then its
//! refill), unless the rule asks for a burst above the limit (`burst=`, `capacity=`),
//! which is then the most in any window. Rules that could exceed it are checked beside
//! an exact sliding log of that many calls per period, in the same store call.
//!
//! Each call waits with [`StoreExt::until_ready`](ratelimit_core::StoreExt::until_ready):
//! with a shaping rule (`leaky-bucket mode=shaper`) one store call hands out the call's
//! slot and the caller sleeps until it (no retry loop, no thundering herd); with other
//! rules it sleeps until the units fit and asks again. A call whose turn is further
//! away than the maximum wait fails with [`ThrottleError::TooLong`], which says how long
//! it would have waited; nothing is charged for it.
//!
//! ```
//! use std::time::Duration;
//! use ratelimit_core::MemoryStore;
//! use ratelimit_tower::ThrottleLayer;
//! use tower::{service_fn, Layer, Service, ServiceExt};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // Every instance together: 10 calls a second to the partner, queued for up to 5 s.
//! let layer = ThrottleLayer::new(
//!     MemoryStore::new(),
//!     "partner-api",
//!     "10/s leaky-bucket mode=shaper burst=100".parse()?,
//!     Duration::from_secs(5),
//! );
//! let mut client = layer.layer(service_fn(|req: &'static str| async move {
//!     Ok::<_, std::convert::Infallible>(format!("sent {req}"))
//! }));
//! let reply = client.ready().await?.call("ping").await?;
//! assert_eq!(reply, "sent ping");
//! # Ok(()) }
//! ```

mod layer;
mod rules;
mod service;

pub use layer::ThrottleLayer;
pub use service::{Throttle, ThrottleError};
