//! The algorithms of [`ratelimit_core`] inside Redis (7.0 and later) or Valkey, as a
//! module: the decisions `ratelimit-redis` otherwise makes with its Lua functions
//! (`check.lua`), made by the core's own Rust code ([`ratelimit_core::algo::decide`])
//! on the very same keys, state layout, arguments and replies
//! ([`ratelimit_core::packed`]). A store finds the module by itself when it connects
//! and uses it; instances on the module and instances on Lua share keys during a
//! rollout and decide alike.
//!
//! Build and load:
//!
//! ```sh
//! cargo build --release -p ratelimit-redis-module
//! redis-server --loadmodule target/release/libratelimit_redis_module.so
//! # or in redis.conf:  loadmodule /path/to/libratelimit_redis_module.so
//! ```
//!
//! # Commands
//!
//! Each takes its arguments as the Lua function it stands for (see the header of
//! `crates/ratelimit-redis/lua/check.lua`) and answers with the same bytes:
//!
//! - `RATELIMIT.CHECK block state [log] packed`: one check (`check`). The keys come
//!   first, so a Cluster client routes the command by them and the server checks their
//!   slot.
//! - `RATELIMIT.CHECK_MANY numkeys key.. counts packed..`: many checks in order, each
//!   atomic, a failed one answered in its place (`check_many`).
//! - `RATELIMIT.CHECK_LOCAL 0 counts packed.. key..`: the same on one Redis Cluster node
//!   for keys of any slots it serves (`check_local`); a check whose slot it does not
//!   serve is answered `RLMOVED` untouched.
//! - `RATELIMIT.REFUND state now units start granted (id code limit period window)..`:
//!   a lease's unspent units given back (`refund`), by
//!   [`ratelimit_core::algo::refund_unspent`].
//! - `RATELIMIT.GIVE_BACK state [log] packed charged_at`: a check's charge given back
//!   (`give_back`), by [`ratelimit_core::algo::refund`].
//! - `RATELIMIT.BLOCK marker now length ttl_floor`: a client key blocked (`block.lua`).
//! - `RATELIMIT.VERSION`: the module's version and the state format it reads and writes
//!   ([`STATE_FORMAT`]); a store uses the module only when the format is its own.
//!
//! # What it does like the Lua functions, and how
//!
//! The writes go through the key API and are replicated as their effects (`SET .. PXAT`,
//! `DEL`, the sliding log's `LPUSH`/`LTRIM`/`PEXPIREAT`), never as the command, whose
//! result depends on the clock: a replica and the AOF hold what the primary holds. The
//! commands are flagged `write deny-oom`, so a server at `maxmemory` refuses them as it
//! refuses the Lua functions. The clock is the server's: the realtime clock Redis's
//! `TIME` reads. A panic in a check is caught at the boundary and answered as that
//! check's error (`RLPANIC`), never an abort of the server.

mod block;
mod check;
mod commands;
mod keyspace;
mod refund;

/// The message of the panic the `test-panic` feature puts in the module (see
/// Cargo.toml); the test harness finds a build with the feature by it.
#[cfg(feature = "test-panic")]
pub const TEST_PANIC: &str = "ratelimit-redis-module test panic (feature test-panic)";

/// The version of the state layout, arguments and replies the module reads and writes:
/// [`ratelimit_core::packed::STATE_FORMAT`], reported by `RATELIMIT.VERSION`.
pub const STATE_FORMAT: u64 = ratelimit_core::packed::STATE_FORMAT;

// The registration with Redis: `redis_module!` expands to the module's one unsafe entry
// point, the `extern "C"` function Redis calls when it loads the module.
#[allow(unsafe_code, missing_docs)]
mod registration {
    use redis_module::redis_module;

    use crate::commands::{block, check, check_local, check_many, give_back, refund, version};

    redis_module! {
        name: "ratelimit",
        version: 1,
        // Redis's allocator: the module's memory counts in INFO and against maxmemory.
        allocator: (redis_module::alloc::RedisAlloc, redis_module::alloc::RedisAlloc),
        data_types: [],
        commands: [
            ["ratelimit.check", check, "write deny-oom", 1, -2, 1, ""],
            ["ratelimit.check_many", check_many, "write deny-oom", 0, 0, 0, ""],
            ["ratelimit.check_local", check_local, "write deny-oom", 0, 0, 0, ""],
            ["ratelimit.refund", refund, "write deny-oom", 1, 1, 1, ""],
            // The state and, with a sliding log, the log: every argument but the last two.
            ["ratelimit.give_back", give_back, "write deny-oom", 1, -3, 1, ""],
            ["ratelimit.block", block, "write deny-oom", 1, 1, 1, ""],
            ["ratelimit.version", version, "readonly fast", 0, 0, 0, ""],
        ],
    }
}
