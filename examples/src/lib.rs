//! The start-up the example apps share: [`serve::serve`].
//!
//! The HTTP benchmark is the `ratelimit-bench` package and the algorithm explorer the
//! `ratelimit-explore` package, so that their dependencies stay out of these examples.

pub mod serve;
