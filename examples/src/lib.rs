//! Examples of the ratelimit crates, and the library behind them.
//!
//! [`explore`] replays traffic through every algorithm and charts the difference; the
//! `explore` example is its command line. [`serve::serve`] starts the example servers.

pub mod explore;
pub mod serve;
