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
//! - `RATELIMIT.CHECK_STATES numkeys state.. refs packed..` and
//!   `RATELIMIT.CHECK_LOCAL_STATES 0 refs packed.. state..`: `CHECK_MANY` and
//!   `CHECK_LOCAL` in compact form (batch protocol 1, [`PROTOCOL`]), one argument per
//!   check instead of three or four (each argument costs Redis about 600 instructions to
//!   read and free). A check is named by its state key, `<prefix>:{<tag>}:s`; its block
//!   marker's and sliding log's names are the same with `b` and `l` last, the log used
//!   when the packed header has a log limit. The packed values come once each; `refs`
//!   holds 9 bytes per check: the index of its packed value (one byte: at most 256
//!   distinct values per call) and its deadline (µs on the server's clock,
//!   little-endian, 0 for none), which replaces the packed value's own: a batch's
//!   checks differ in nothing else. A state name not ending in `}:s` after a hash tag
//!   fails that check (`RLARGS`); `refs` of the wrong length or referring past the
//!   packed values fail the call before anything is read. Replies as the older form's.
//! - `RATELIMIT.REFUND state now units start granted (id code limit period window)..`:
//!   a lease's unspent units given back (`refund`), by
//!   [`ratelimit_core::algo::refund_unspent`].
//! - `RATELIMIT.GIVE_BACK state [log] packed charged_at`: a check's charge given back
//!   (`give_back`), by [`ratelimit_core::algo::refund`].
//! - `RATELIMIT.DEBIT state [log] packed`: units charged unconditionally, as debt where
//!   a state goes past its limit: the excess of a metered request settled above the
//!   estimate its check charged (`debit`), by [`ratelimit_core::algo::debit`] (batch
//!   protocol 3; a settle below the estimate is `RATELIMIT.GIVE_BACK`'s).
//! - `RATELIMIT.BLOCK marker now length ttl_floor`: a client key blocked (`block.lua`).
//! - `RATELIMIT.RELEASE state now slot`: a concurrency slot freed (`release`), by
//!   [`ratelimit_core::algo::release`]; 1 when it was held and live.
//! - `RATELIMIT.RENEW state now slot timeout ttl_floor`: a live slot's deadline moved to
//!   now plus `timeout` µs (`renew`), by [`ratelimit_core::algo::renew`].
//! - `RATELIMIT.CHECK_STATE state refs packed`: one check in compact form (batch
//!   protocol 2), its state key first so that a Cluster client routes it by the key.
//!   The compact calls of protocol 2 may carry a call id after their `refs`
//!   ([`ratelimit_core::packed::CALL_ID_LEN`] bytes): the module keeps the reply a few
//!   seconds, and a call sent again after a lost connection gets its first run's reply,
//!   or runs if there was none (see the README, "Calls decided once").
//! - Edits decided once (protocol 4): `RATELIMIT.REFUND`, `GIVE_BACK`, `DEBIT`,
//!   `RELEASE` and `RENEW` may take a call id as their last argument (32 hex digits and
//!   a byte 0 or 1, which no argument of theirs is: times and numbers are decimal text,
//!   packed values a multiple of 8 bytes), kept and answered as the compact calls' ids
//!   are.
//! - Edits in batches (protocol 5): a batch (`CHECK_MANY`, `CHECK_LOCAL`, the compact
//!   forms, and a single check's commands) may carry, in place of a check, an edit of a
//!   state after its check: a charge given back, debt, a slot released or renewed, a
//!   lease's unspent units given back, or a block of the key
//!   ([`ratelimit_core::packed::Edit`]: the packed header's first value is `injected +
//!   2 × op`). It runs in its turn as its own command would, on the check's keys, and is
//!   answered `{4, 1}` when it changed the state, `{4, 0}` when not; in a call decided
//!   once, with the call. A store sends settles, releases, renewals, lease refunds and
//!   blocks this way, in the same call as the checks queued with them.
//! - `RATELIMIT.STATS`: what the module keeps across calls (rule sets cached, replies
//!   kept and their bytes).
//! - `RATELIMIT.VERSION`: the module's version, the state format it reads and writes
//!   ([`STATE_FORMAT`]) and its batch protocol ([`PROTOCOL`]; modules before the
//!   compact form answer without it); a store uses the module only when the format is
//!   its own, and the compact form only when every module master reports it.
//!
//! Loaded with the arguments `protocol 0` to `protocol 4` (`--loadmodule <path>
//! protocol 0`), the module serves and reports only what a module of that protocol
//! does: for tests of a rollout across module versions. Other load arguments refuse the
//! load.
//!
//! # What it does like the Lua functions, and how
//!
//! The writes go through the key API and are replicated as their effects, never as the
//! command, whose result depends on the clock: a command's state writes as one `EVAL` of
//! a fixed script that sets each key as the primary did (`SET .. PXAT`, `KEEPTTL`; one
//! write as its `SET`), and
//! the rest as they happen (`DEL`, the sliding log's `LPUSH`/`LTRIM`/`PEXPIREAT`), in the
//! primary's order. A replica and the AOF hold what the primary holds, and a replica
//! needs no module to hold it (only `EVAL`, which every Redis and Valkey runs; a
//! primary whose `EVAL` is renamed away replicates a `SET` per write). The
//! commands are flagged `write deny-oom`, so a server at `maxmemory` refuses them as it
//! refuses the Lua functions. The clock is the server's: the realtime clock Redis's
//! `TIME` reads. A panic in a check is caught at the boundary and answered as that
//! check's error (`RLPANIC`), never an abort of the server; every command runs inside
//! such a boundary, validates every argument and stored value before it writes, and
//! answers errors in printable ASCII. The bounds on what a client can make it do are
//! in the README ("Limits").

mod block;
mod check;
mod commands;
mod edits;
mod keyspace;
mod once;
mod refund;
mod slots;

/// The message of the panic the `test-panic` feature puts in the module (see
/// Cargo.toml); the test harness finds a build with the feature by it.
#[cfg(feature = "test-panic")]
pub const TEST_PANIC: &str = "ratelimit-redis-module test panic (feature test-panic)";

/// The version of the state layout, arguments and replies the module reads and writes:
/// [`ratelimit_core::packed::STATE_FORMAT`], reported by `RATELIMIT.VERSION`.
pub const STATE_FORMAT: u64 = ratelimit_core::packed::STATE_FORMAT;

/// The batch protocol this build serves, reported as `RATELIMIT.VERSION`'s third
/// element: 1, the compact batches (`RATELIMIT.CHECK_STATES`,
/// `RATELIMIT.CHECK_LOCAL_STATES`) besides the older ones; 2, calls decided once: a
/// compact call may carry an id after its `refs` (see the `once` module), whose reply
/// the module keeps a few seconds for a resend after a lost connection, and one check
/// goes as `RATELIMIT.CHECK_STATE state refs packed`; 3, debt: `RATELIMIT.DEBIT`, the
/// excess of a metered request settled above its estimate; 4, edits decided once: the
/// commands that edit a state after its check (`RATELIMIT.GIVE_BACK`, `DEBIT`,
/// `REFUND`, `RELEASE`, `RENEW`) may carry a call id as their last argument, and answer
/// a resend as the compact calls of protocol 2 do; 5, edits in batches: a batch's
/// packed value may be an edit ([`ratelimit_core::packed::Edit`]) instead of a check. A
/// module before the compact batches
/// answers `RATELIMIT.VERSION` with two elements (protocol 0).
pub const PROTOCOL: u8 = 5;

/// The protocol served, [`PROTOCOL`] unless the module was loaded with a lower one.
static SERVED: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(PROTOCOL);

/// The batch protocol the module serves, as loaded.
pub(crate) fn protocol() -> u8 {
    SERVED.load(std::sync::atomic::Ordering::Relaxed)
}

/// The module's load arguments: none, or `protocol 0` to `protocol 4` (the module then
/// serves and reports only what a module of that protocol does: a Cluster's masters
/// with modules of two versions during a rollout, as tests build them). Anything else
/// refuses the load with a message saying what is accepted.
fn protocol_arg(args: &[String]) -> Result<u8, String> {
    match args {
        [] => Ok(PROTOCOL),
        [name, value] if name.eq_ignore_ascii_case("protocol") => match value.parse::<u8>() {
            Ok(p) if p <= PROTOCOL => Ok(p),
            _ => Err(format!(
                "ratelimit: `protocol {value}`: the protocol is 0 to {PROTOCOL}"
            )),
        },
        _ => Err(format!(
            "ratelimit: unknown load arguments {args:?}; the module takes none, or \
             `protocol 0` to `protocol 4` to serve only the commands of modules of that \
             protocol"
        )),
    }
}

// The registration with Redis: `redis_module!` expands to the module's one unsafe entry
// point, the `extern "C"` function Redis calls when it loads the module.
#[allow(unsafe_code, missing_docs)]
mod registration {
    use std::ffi::CString;
    use std::os::raw::c_int;

    use redis_module::{raw, redis_command, redis_module, Context, RedisString, Status};

    use crate::commands::{
        block, check, check_local, check_local_states, check_many, check_state, check_states,
        debit, give_back, refund, release, renew, stats, version,
    };

    /// Reads the load arguments; registers the compact batch commands unless loaded with
    /// `protocol 0`, and the single compact check unless loaded with a protocol below 2
    /// (a module of that protocol does not know them).
    fn init(ctx: &Context, args: &[RedisString]) -> Status {
        let args: Vec<String> = args.iter().map(ToString::to_string).collect();
        let protocol = match super::protocol_arg(&args) {
            Ok(protocol) => protocol,
            Err(message) => {
                ctx.log_warning(&message);
                return Status::Err;
            }
        };
        super::SERVED.store(protocol, std::sync::atomic::Ordering::Relaxed);
        if protocol >= 1 && register_compact(ctx.ctx) != raw::Status::Ok as c_int {
            return Status::Err;
        }
        if protocol >= 2 && register_once(ctx.ctx) != raw::Status::Ok as c_int {
            return Status::Err;
        }
        if protocol >= 3 && register_debit(ctx.ctx) != raw::Status::Ok as c_int {
            return Status::Err;
        }
        Status::Ok
    }

    fn register_compact(ctx: *mut raw::RedisModuleCtx) -> c_int {
        // SAFETY: `ctx` is the context Redis gave `RedisModule_OnLoad`, still loading the
        // module, as for the commands `redis_module!` registers (the macro calls the
        // module API's function pointers, set before `init` runs).
        unsafe {
            redis_command!(
                ctx,
                "ratelimit.check_states",
                check_states,
                "write deny-oom",
                0,
                0,
                0,
                ""
            );
            redis_command!(
                ctx,
                "ratelimit.check_local_states",
                check_local_states,
                "write deny-oom",
                0,
                0,
                0,
                ""
            );
        }
        raw::Status::Ok as c_int
    }

    fn register_once(ctx: *mut raw::RedisModuleCtx) -> c_int {
        // SAFETY: as in `register_compact`.
        unsafe {
            redis_command!(
                ctx,
                "ratelimit.check_state",
                check_state,
                "write deny-oom",
                1,
                1,
                1,
                ""
            );
        }
        raw::Status::Ok as c_int
    }

    fn register_debit(ctx: *mut raw::RedisModuleCtx) -> c_int {
        // SAFETY: as in `register_compact`.
        unsafe {
            // The state alone: the log (of the same hash tag, so of the same slot) may
            // follow it, and a call id the packed values (protocol 4), so that the key
            // range cannot be counted from either end.
            redis_command!(ctx, "ratelimit.debit", debit, "write deny-oom", 1, 1, 1, "");
        }
        raw::Status::Ok as c_int
    }

    redis_module! {
        name: "ratelimit",
        version: 1,
        // Redis's allocator: the module's memory counts in INFO and against maxmemory.
        allocator: (redis_module::alloc::RedisAlloc, redis_module::alloc::RedisAlloc),
        data_types: [],
        init: init,
        commands: [
            ["ratelimit.check", check, "write deny-oom", 1, -2, 1, ""],
            ["ratelimit.check_many", check_many, "write deny-oom", 0, 0, 0, ""],
            ["ratelimit.check_local", check_local, "write deny-oom", 0, 0, 0, ""],
            ["ratelimit.refund", refund, "write deny-oom", 1, 1, 1, ""],
            // The state alone, as for `ratelimit.debit`.
            ["ratelimit.give_back", give_back, "write deny-oom", 1, 1, 1, ""],
            ["ratelimit.block", block, "write deny-oom", 1, 1, 1, ""],
            ["ratelimit.release", release, "write deny-oom", 1, 1, 1, ""],
            ["ratelimit.renew", renew, "write deny-oom", 1, 1, 1, ""],
            ["ratelimit.version", version, "readonly fast", 0, 0, 0, ""],
            ["ratelimit.stats", stats, "readonly fast", 0, 0, 0, ""],
        ],
    }
}
