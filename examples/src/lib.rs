//! The start-up the example apps share ([`serve::serve`]), and the apps of the examples
//! the end-to-end tests drive: `login` (charging by outcome), `llm_gateway` (metered
//! costs) and `live_limits` (`live`,
//! with the `live` feature).
//!
//! The HTTP benchmark is the `ratelimit-bench` package and the algorithm explorer the
//! `ratelimit-explore` package, so that their dependencies stay out of these examples.

#[cfg(feature = "live")]
pub mod live;
pub mod llm_gateway;
pub mod login;
#[cfg(feature = "redis")]
pub mod outbound;
pub mod serve;
