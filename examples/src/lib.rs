//! The start-up the example apps share ([`serve::serve`]), and the logic of the
//! `live_limits` example (`live`, with the `live` feature), which the end-to-end tests use.
//!
//! The HTTP benchmark is the `ratelimit-bench` package and the algorithm explorer the
//! `ratelimit-explore` package, so that their dependencies stay out of these examples.

#[cfg(feature = "live")]
pub mod live;
pub mod serve;
