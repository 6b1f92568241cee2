//! Redis store for [`ratelimit_core`]: a fleet of app servers sharing limits, each
//! decision atomic in a Lua function and many decisions per call under load, on one
//! server, a Redis Cluster, or the primary of a Sentinel-managed service.
//!
//! [`RedisStore`] implements the core [`Store`](ratelimit_core::Store) trait and makes
//! exactly the decisions [`MemoryStore`](ratelimit_core::MemoryStore) makes: the Lua is an
//! integer translation of the core's algorithms, one function per algorithm, and the
//! core's conformance suite runs against it.
//!
//! ```no_run
//! use ratelimit_core::{RuleSet, Store};
//! use ratelimit_redis::RedisStore;
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let store = RedisStore::connect("redis://127.0.0.1:6379/").await?;
//! // The DomainTools rules: 1 per second, 20 per minute, 200 per hour, 800 per day.
//! let rules: RuleSet = "1/s sliding-log; 20/min sliding-log; 200/h sliding-log; 800/day sliding-log"
//!     .parse()?;
//! let decision = store.check(b"203.0.113.7", &rules, 1).await?;
//! if !decision.is_allowed() {
//!     println!("429, retry after {:?}", decision.retry_after());
//! }
//! # Ok(())
//! # }
//! ```
//!
//! # Topologies
//!
//! One store type over every topology; only the builder's last call differs:
//! [`build`](RedisStoreBuilder::build) (one server, over a few multiplexed connections),
//! [`build_cluster`](RedisStoreBuilder::build_cluster) (the `redis` crate's cluster
//! connection, which follows slots and failovers) and
//! [`build_sentinel`](RedisStoreBuilder::build_sentinel) (the primary that Redis Sentinel
//! names; after a failover the store asks the Sentinels again). Every call goes through
//! one timeout and one script-loading path whatever the topology.
//!
//! # Starting and running without Redis
//!
//! Building a store fails only on configuration errors (a malformed URL, an empty node
//! list, a bad prefix, a service no Sentinel knows), never because Redis is unreachable:
//! an app deployed or scaled out during a Redis outage starts. The build tries to connect
//! once within the connect timeout; without an answer the store starts unconnected.
//! While it has no connection, checks fail at once with
//! [`RedisStoreError::Connection`] (no check waits for a server that is not there) and the
//! caller's failure policy decides, e.g. the tower layer's fail open, fail closed or
//! local fallback. Meanwhile the store reconnects by itself in the background, pausing
//! 50 ms, then twice as long after each failed attempt, up to 2 s; while checks keep
//! coming, a check that finds no connection cuts the pause short (at most every 250 ms),
//! so a store under traffic is back within about 250 ms of Redis, and an idle one backs
//! off. Each (re)connection
//! sets the connection up as the first one: loads the function library, reads `TIME`
//! (for deadlines) and `maxmemory-policy` (on a Cluster, from every master, and again
//! whenever the cluster connection lost a node and reconnects: a dropped connection, a
//! restarted or promoted node, once every master answers). A store
//! over the application's pool or cluster connection does the same on its first call,
//! and over a pool again after replacing dead connections. Failed attempts are logged as a WARN at most
//! every 10 s with their count; the recovery as one INFO line.
//! [`RedisStore::is_connected`] and [`RedisStore::connected`] tell whether a connection
//! is up, for readiness probes.
//!
//! # One round trip per check, many checks per round trip
//!
//! A check is one call of `lua/check.lua`, however many rules: the key's block marker and
//! every rule's state are read with one `MGET`, decided and written inside Redis, all or
//! nothing, so concurrent app servers never admit more than the rules allow. On Redis 7
//! the script is loaded as a function library (`FUNCTION LOAD`) and each check is one
//! `FCALL`: the script's functions are then created once per server instead of once per
//! call, which saved Redis 17 to 21 % of its time per check in the crate's benchmark
//! (see BENCHMARKS.md). On Redis 6.2 (no
//! functions) each check is one `EVALSHA`. When Redis forgets the library or the script
//! (`FUNCTION FLUSH`, `SCRIPT FLUSH`, a restart, a failover) the store loads it again
//! once and resends the call.
//!
//! Checks that queue while the store's calls are in flight (one per connection) leave
//! together as one call of the library's batch function, which decides them in order,
//! each exactly as it would be decided alone (the whole call is atomic), with one read of
//! `TIME` and one `MGET` of block markers and states for all, and answers with one packed
//! string. There is no timer: a lone check leaves at once, as the plain one-check call,
//! so latency at low concurrency does not grow; under load, batches form by themselves
//! and Redis and the app spend less per decision.
//! [`max_batch`](RedisStoreBuilder::max_batch) bounds a batch (default 64; 1 turns
//! batching off) and [`batch_wait`](RedisStoreBuilder::batch_wait) optionally holds a
//! batch open to fill it. One check's failure (a value the store did not write, a
//! deadline passed, an error raised while deciding it) fails that check only; a reply
//! that cannot be divided into one answer per check fails the checks of that call, none
//! charged twice. Caller deadlines hold per check. On a Cluster (Redis 7), a batch goes
//! as one call per node, routed by the slot map the store reads with `CLUSTER SLOTS`: the
//! node's function reaches the keys of its slots itself (flag `allow-cross-slot-keys`)
//! and turns away, uncharged, any check whose slot it no longer serves, which then goes
//! as a call of its own (following MOVED) while the map is read again. Before Redis
//! 7, a Cluster's checks go one call each.
//!
//! What follows a check goes the same way: a settle's give-back or debt, a concurrency
//! slot's release and renewal, a lease's refund of its unspent units, a block, and the
//! edits that undo a check whose caller stopped waiting queue with the checks and leave
//! in the same calls, each decided in its turn (in order per key: a check queued after
//! its key's block is refused by it) and answered in its place. A metered,
//! concurrency-limited request (check, settle, release) then costs about as many Redis
//! calls as a bare check: in the crate's fleet benchmark, 0.262 calls per decision with
//! checks alone, 0.264 with a release after each and 0.265 with a settle after each
//! (BENCHMARKS.md). On the native module this needs its batch protocol 5; against an
//! older module each goes as a call of its own.
//!
//! A release or a settle that no caller waits for (the tower layer's releases, once a
//! response has ended) is handed over with `Store::release_detached` and
//! `Store::settle_detached`: queued without a task, a timer or a reply channel of its
//! own, its reply read by the store, sent again after a lost connection, a failed
//! release tried again after 50 ms, 250 ms and 1 s (a debt once more after 50 ms; a
//! give-back is not: twice would lend), and a failure that stays reported in a `WARN` at
//! most every 10 s. A check queued after it through the same store is decided after it,
//! also one that could have gone alone at once. [`RedisStore::flush`] waits until every
//! one handed over is done with: await it when shutting down.
//!
//! Work in Redis is O(1) per rule for fixed window, token bucket, leaky bucket and GCRA,
//! O(precision) for the sliding window counter, and a few `LINDEX` for the sliding log
//! (one list per client key, trimmed to the largest sliding-log limit and read by binary
//! search). No sorted sets, no scans.
//!
//! # The native module
//!
//! Where the server loads the crate `ratelimit-redis-module` (`redis-server --loadmodule
//! libratelimit_redis_module.so`, or `loadmodule` in redis.conf; its README says how to
//! build it), the store decides with the module's commands instead of the Lua functions:
//! the core's own algorithms compiled into Redis, on the same keys, state layout,
//! arguments and replies, so nothing else changes (same decisions, same failure
//! policies), and stores on both paths can share keys during a rollout. The store asks
//! every primary for the module (`RATELIMIT.VERSION`) at each (re)connection and uses it
//! where a primary has it with the store's state format: everywhere when all have it; on
//! a Cluster where only some do (a rollout), for the keys of the slots those masters
//! serve, the others staying on Lua. One INFO line says which path is in use (one per
//! master on such a Cluster). A server that loses the module (a restart or a failover
//! without it) gets the call as a Lua function, and the store stays on Lua until it
//! reconnects. Checks, blocks, lease refunds, refunds of charges and settles all go to
//! the module: a store on it runs no Lua (but for the debt of a settle above its
//! estimate on a module older than batch protocol 3, which lacks `RATELIMIT.DEBIT`:
//! that call goes to Lua, everything else stays on the module).
//! [`RedisStoreBuilder::force_lua`] keeps the Lua path; [`RedisStore::uses_module`]
//! tells which is in use.
//!
//! # Lease mode
//!
//! Opt-in with [`RedisStoreBuilder::lease`]; exact mode (every check one call) is the
//! default. In lease mode a store instance that sees a (key, rule set) take at least 4
//! units within a lease length reserves a block of units for it in one call (an ordinary check
//! of the block's cost: Redis charges it atomically, and a block on the key is checked in
//! the same call) and spends it locally, without a call, until the block runs out or the
//! lease ends: reservation time + lease length on the store's clock, and for a fixed
//! window never past the window's end. The block is the number of units the instance saw
//! for the key over the last lease length, at least 2 and at most 1/8 of the smallest
//! capacity of the rule set's rules (so that no instance holds more than an eighth of a
//! limit and a fleet cannot strand it); a key seen once or rarely (a block would mostly
//! come back as a refund, one call more than exact checks), a check that costs a whole
//! block, a rule set with a capacity under 16 and a peek (cost 0) are decided exactly.
//!
//! When Redis refuses a reservation, the instance asks once more for what Redis said is
//! left (at least the check's own cost). When that is refused too, it answers refusals
//! locally, with the refusal's fields and the time left as `retry_after`, until that
//! `retry_after` has passed, then asks again; a block without end is answered locally
//! the same way, without a `retry_after`, and asked about again after each lease length
//! (so an unblock, like a new block, is noticed within one). A local answer says, per
//! rule: the limit; as remaining, the units this instance still holds; the reset Redis
//! gave at the reservation less the time since.
//!
//! While one check of an instance reserves for a (key, rule set), the instance's other
//! checks of it wait for that reservation and then spend from it. A leased check returns
//! within the store's [`timeout`](RedisStoreBuilder::timeout), however many calls it
//! makes or waits for (a refund, a reservation, a second one, another check's
//! reservation): past it, it fails with [`RedisStoreError::Timeout`] like an exact check.
//!
//! Units a lease did not spend go back when it ends (`refund` in `lua/check.lua`): on the
//! key's next check, and from a sweep that runs every half lease length for as long as
//! the store lives ([`RedisStore::sweep_leases`] runs it at once), so a key that goes quiet returns
//! its units within about one lease length. A fixed window gets them back if the window
//! is still the reservation's. GCRA, leaky meters and token buckets get back the part of
//! the charge that has not drained yet by the time of the refund: units whose time has
//! passed are not given back, since other instances may meanwhile have been charged on a
//! bucket that would have been full but for the reservation, and returning them would
//! admit more than the exact limiter. A refund that fails (Redis unreachable) leaves its
//! units charged until the key's state expires, as a crashed instance's would, and is
//! logged as a WARN (at most every 10 s, with a count).
//!
//! **The promise.** Over any interval, a fleet in lease mode admits no more than the exact
//! limiter admits over that interval extended by the lease length: for GCRA with burst B
//! and emission interval T, at most B + floor((b - a + lease) / T) units in [a, b].
//! Every unit admitted locally was charged in Redis at most one lease length earlier, and
//! a refund leaves Redis no looser than if the reservation had charged that many fewer.
//! The property tests in `tests/lease.rs` hold several instances on one server to it.
//!
//! Per algorithm:
//!
//! - fixed window, token bucket, leaky bucket as a meter, GCRA: leased;
//! - sliding window counter: exact (a unit charged to a sub-window cannot be moved to a
//!   later one, and one given back after the sub-window ended would count twice);
//! - sliding log: exact (a reservation would write timestamps for units never used, and
//!   they cannot be taken out of the shared log exactly);
//! - leaky bucket as a shaper: exact (its admissions carry delays that depend on every
//!   admission before them).
//!
//! A rule set is leased only when every one of its rules is.
//!
//! **Blocks** are checked in every reservation: a block placed through another instance
//! takes effect on a leasing instance at its next reservation, at most one lease length
//! later; one placed through the instance itself (or a reset) drops its leases for the
//! key at once. **Stranded units:** an instance that stops while holding a lease takes at
//! most its block with it; they count until the algorithm refills them (GCRA, buckets) or
//! the window ends, as if spent. **Redis down:** an instance spends what it holds, then
//! its checks fail as in exact mode and the caller's failure policy decides; refunds
//! that cannot be sent are dropped (the units strand as above). **Memory:** the table
//! holds at most 65,536 (key, rule set) pairs; ended leases and idle keys are dropped by
//! the sweep, and past the cap new keys are decided exactly. Under Redis `TIME` the lease
//! runs on this host's clock, and a fixed window's end is this host's estimate of
//! Redis's.
//!
//! # Time
//!
//! By default time comes from the Redis server's `TIME`, read inside the script: app
//! servers with skewed clocks still agree. [`RedisStoreBuilder::clock`] injects a clock
//! instead (tests, the conformance suite). Either may go back (a failover to a server
//! whose clock is behind, a test): every algorithm then decides as
//! [`MemoryStore`](ratelimit_core::MemoryStore) does, the sliding log as if at its newest
//! entry's time (see [`algo`](ratelimit_core::algo#a-clock-that-steps-back)).
//!
//! # Keys and TTLs
//!
//! Keys are `<prefix>:{<tag>}:b` (block marker), `<prefix>:{<tag>}:s` (a string: the
//! state of every rule, as little-endian doubles holding integers, written with its
//! expiry in one `SET`) and `<prefix>:{<tag>}:l` (a list: the sliding log shared by every
//! sliding-log rule), where `<tag>` stands for the client key as the core holds it
//! ([`StoredKey`](ratelimit_core::key::StoredKey)): `k` and the key in hex for a key of
//! at most 64 bytes, `d` and its 32-byte BLAKE3 digest in hex for a longer one. Client
//! keys are data, never syntax: any bytes (braces, colons, CRLF, non-UTF-8) map to
//! distinct printable names that stay behind the prefix; names stay under 150 bytes
//! whatever the key's length, so a megabyte of key costs Redis what a short key costs;
//! and all keys of one client share one hash tag, hence one Cluster slot. A long key maps
//! to the same state in [`MemoryStore`](ratelimit_core::MemoryStore) and here.
//!
//! The names carry no rules: a client's state belongs to the client key (the middleware
//! puts its namespace and tier in it), and inside the state string each rule's entry is
//! tagged with the rule's identity
//! ([`RuleSet::rule_ids`](ratelimit_core::RuleSet::rule_ids): its name, else its
//! algorithm and period). A check under changed rules (a new limit, a new rule, app
//! servers of a fleet on two versions at once) reads each rule's entry by identity and
//! carries it exactly as [`MemoryStore`](ratelimit_core::MemoryStore) does (the core's
//! [`algo`](ratelimit_core::algo#changing-rules) says what carries: counts and log
//! entries as they are, what a token bucket or a GCRA or leaky bucket client used turned
//! into the new limit's terms, a new rule, algorithm or period fresh); the state is
//! rewritten in the new rules' layout when that check commits, so entries of rules the
//! new set lacks are dropped then. A denial after such a conversion writes the carried
//! entries too (the conversion depends on the time, and the next check must not convert
//! again): under a layout no rule set has, so the next check reads them entry by entry.
//! The string starts with the writer's layout, so a check under the same rules reads it
//! in place; token bucket, leaky bucket and GCRA entries also keep the limit and capacity
//! they were written under, which the carry needs. The state stays O(rules): a few doubles per rule.
//!
//! Every key expires when its state becomes equivalent to a fresh one (the core's
//! `expires_at`, rounded up to the millisecond): no cleanup job exists or is needed. The
//! state string expires with the longest-lived of the rules that last wrote it (a rule
//! dropped from the set stops counting at the next commit, which sets the TTL anew); the
//! sliding log with the longest sliding-log period, and the state says until when the
//! log counts, so a log left by rules that no longer have one is ignored and dropped.
//! Block markers expire with the block; a block without end has no TTL. Under an
//! injected clock, TTLs are relative and never shorter than
//! [`RedisStoreBuilder::ttl_floor`]. [`reset`](ratelimit_core::Store::reset) deletes the
//! client's state and log, whatever rules it names; a block stays.
//!
//! Upgrading from a version that named state by rule set: the old keys
//! (`...:s:<fingerprint>`, `...:l:<fingerprint>`) are no longer read and expire on their
//! own; each client starts from a fresh state once.
//!
//! # Running Redis for a limiter
//!
//! - **Eviction.** An evicted key forgets what its client consumed, and the limit admits
//!   more than configured. Run the limiter's Redis with `maxmemory-policy noeviction`:
//!   `allkeys-*` policies evict any key, `volatile-*` ones any key with a TTL, and every
//!   state key has one. The store reads the policy when it connects (on a Cluster, from
//!   every master) and logs a warning (`tracing`, level WARN, naming the master on a
//!   Cluster) for any other policy; [`RedisStore::maxmemory_policy`] tells what it read. Under `noeviction` a full Redis refuses the writes: checks fail with
//!   [`RedisStoreError::Script`] (OOM) and the caller's failure policy decides, visibly.
//! - **Restarts.** Without persistence (no RDB, no AOF) a restart empties Redis: every
//!   client starts from a fresh state, so each may use its full limit again once, and
//!   blocks are lifted. With `appendonly yes` and `appendfsync everysec` at most about a
//!   second of checks is forgotten. A failover to a replica loses the writes not yet
//!   replicated (asynchronous replication), the same kind of loss.
//! - **Timeouts.** A check that times out on the client may still reach Redis when the
//!   server catches up (after a `DEBUG SLEEP`, a slow `KEYS`, a fork). The store sends
//!   each check's deadline on the Redis clock (learned from `TIME` at connect, on a
//!   Cluster from every master, the fastest clock winning; reply delays only make it
//!   later, never earlier), and the script decides and charges nothing when it starts
//!   past it: a stall no longer turns into a burst of charges the callers never saw. The
//!   bound is the clock estimate's error (the reply time of the reading, well under a
//!   millisecond on a LAN). This holds on an injected clock too (the deadline goes
//!   beside the injected time, and the script reads `TIME` to compare), and for a store
//!   over the application's pool or cluster connection from its first call on (that
//!   call reads the clock; it has no deadline itself).
//! - **Foreign values.** The store owns the keys under its prefix. A value it did not
//!   write at a state or log key (another type, or bytes it cannot read) is read as an
//!   empty state and replaced by the next check, with a warning in the log (at most one
//!   per 10 s per store, counting the values replaced since the last); a block
//!   marker that is not a time is dropped. Nothing stays broken, but the client got a
//!   fresh state: give the store a prefix nothing else uses.
//!
//! # Upgrading
//!
//! Each version of the crate loads `lua/check.lua` as a function library of its own,
//! `ratelimit_<tag>` (the tag is 16 hex digits of the script's SHA1; the functions
//! carry it too), so that during a rolling deploy instances of the old and the new
//! version share a Redis, each calling its own functions with its own argument layout.
//! A library stays on the server until it is removed (RDB and AOF keep it, replicas
//! copy it), so every upgrade would leave the previous one behind.
//!
//! [`RedisStore::unload_other_versions`] removes them: on every primary (each master of
//! a Cluster; the current primary of a Sentinel service, whose replicas follow) it
//! deletes each library named `ratelimit_` and 16 hex digits but the store's own, and
//! returns their names. Other applications' libraries stay. Run it once every instance
//! runs the new version, e.g. as the last step of the deploy, from one instance or a
//! one-off task:
//!
//! ```no_run
//! # use ratelimit_redis::RedisStore;
//! # async fn run(store: RedisStore) -> Result<(), ratelimit_redis::RedisStoreError> {
//! let removed = store.unload_other_versions().await?;
//! println!("removed the function libraries of earlier versions: {removed:?}");
//! # Ok(())
//! # }
//! ```
//!
//! Running it too early is safe. An instance of an older version whose library is gone
//! is told "Function not found" by its next call, loads its library again and sends the
//! call again, once; should the function be missing still (removed again in between),
//! that call goes as the script form (`EVALSHA`, then `EVAL`), which `FUNCTION DELETE`
//! does not touch. Every check is decided, none twice. The older library is back then,
//! so run the method again once the old instances are gone. Nothing removes libraries
//! by itself: two versions never take turns removing each other's.
//!
//! Scripts that earlier versions cached with `SCRIPT LOAD` (the `EVALSHA` forms, the
//! block and refund scripts) stay in the script cache until a restart or `SCRIPT
//! FLUSH`; they take a little memory and nothing else, and `SCRIPT FLUSH` is harmless
//! to running stores, which send a script again with `EVAL` when Redis lacks it. Under
//! an ACL, the method needs `FUNCTION LIST` and `FUNCTION DELETE`.
//!
//! # Failures
//!
//! Every call is bounded by a timeout (default 50 ms) and fails with a typed
//! [`RedisStoreError`] saying what failed: connection, timeout, script, unexpected reply,
//! wrong type, configuration. Nothing panics. A connection that fails is dropped and a
//! new one opened at once, then with growing pauses as above, so the same store recovers
//! when Redis comes back. Whether to fail open or closed is the caller's policy.
//!
//! A check is decided once even when its caller stops waiting. Each check carries its
//! caller's deadline on the Redis clock, and Redis charges nothing for a check it reaches
//! after it. A check Redis decided in time but whose answer came late (past the caller's
//! timeout, or the caller dropped its future) was charged while its caller, told
//! [`RedisStoreError::Timeout`], decided without it (fail open, or a local fallback).
//! So the store reads a call's reply up to twice its timeout, and it undoes a check
//! that admitted after its caller had gone: it gives the units back and releases the
//! slot, queued with the checks. A reply later than that is not read, and its charge
//! stays until it drains (`tests/late_replies.rs`: replies held back 150 ms against a
//! 100 ms timeout, every charge given back, Lua and module).
//!
//! A call lost with its connection (a restart, a failover, `CLIENT KILL`, a dropped
//! socket) may have run in Redis before the connection broke, and nothing tells whether
//! it did. So every call that charges or gives back (a check or a batch of them, a
//! settle's give-back or debit, a lease's refund, a release, a renewal) carries an id,
//! and its reply is kept for a while: the call is sent again on the next connection,
//! within the caller's timeout, and answered the first run's reply if it ran, or run if
//! it never arrived; decided once, not failed. On the Lua functions the reply goes to a
//! record key beside the call's first client key (`<prefix>:{<tag>}:r<id>`, one `SET`
//! per call however many checks it carries, expiring after twice the store's timeout and
//! a second); it is written with the call's other effects, so a replica that takes over
//! after a failover holds it as it holds the state. On the native module the replies
//! stay in the server's memory (checks from batch protocol 2, the other calls from
//! protocol 4; see the module's README): after a failover, a call the old primary ran
//! and replicated and the new one is sent again is charged twice (never admitted twice).
//! Under `CLIENT KILL` every 100 ms, 8,000 checks from 64 tasks, and as many requests
//! that check a `4 concurrent` key, settle and release: none failed, none charged twice,
//! no settle or release lost, on Lua and on the module, Redis and Valkey
//! (`tests/in_flight.rs`). A block is set again as it is; a lease's reservation goes
//! through the check path.
//!
//! Calls the server answered without running are sent again: a missing script or
//! function, a moved slot, and errors that prove nothing ran (`READONLY` from a demoted
//! primary, `MASTERDOWN`, `LOADING`, `CLUSTERDOWN`, `TRYAGAIN`, `ASK`, a Cluster node the
//! client has no connection to), after short pauses (2 ms doubling to 50 ms) with the
//! slot map read again, until another answer or the timeout; a Cluster node batch
//! refused so goes check by check to where each key is served. So are calls that may
//! run twice (a block, a reset). A call made while the connection was lost under a
//! second ago waits for the reconnection's first attempt rather than fail at once; once
//! an attempt failed, calls fail fast until the server is back. The Cluster
//! connection's own retries are off; the store follows `MOVED` itself.
//!
//! Requires Redis 6.2 or newer, or Valkey. Tested on Redis 7.0.15 and Valkey 9.1.2, on one
//! server and on a Cluster, through the Lua functions and through the native module.
//!
//! # Features
//!
//! - `testing`: `testing::RedisServer`, `testing::RedisCluster` and
//!   `testing::RedisSentinel`, throwaway servers on free ports for tests (the first two
//!   also on Valkey, `testing::ServerKind`, and with the native module loaded), and
//!   `testing::wait_connected`, which waits for a store's first connection.

// docs.rs builds with every feature and `--cfg docsrs`: badge items behind a feature.
#![cfg_attr(docsrs, feature(doc_cfg))]

// The README is the crates.io page: its examples must compile like the crate docs'.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

// A check goes one way down, each layer knowing only the one below it: `store` (the
// public API) → `lease` (lease mode's table, in front of) → `exact` (each operation as
// the module's or the Lua function's call, built by `script`) → `batch` (many checks per
// call) → `transport` (connections, Cluster routing, setup on connect). `shared` (the
// configuration and what the transport learned), `keys`, `script` and `error` are
// leaves every layer may use.
mod batch;
mod error;
mod exact;
mod keys;
mod lease;
mod options;
mod script;
mod shared;
mod store;
#[cfg(feature = "testing")]
pub mod testing;
mod transport;

pub use error::RedisStoreError;
pub use store::{RedisStore, RedisStoreBuilder};

/// Re-exported so a pool can be built for [`RedisStoreBuilder::build_with_pool`] without
/// naming the exact versions.
pub use bb8;
pub use bb8_redis;
pub use redis;
