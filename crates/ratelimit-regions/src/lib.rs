//! One rate limit across regions, decided locally, with a bound that holds through a
//! partition.
//!
//! An API served from R regions that keeps one limiter per region admits R times the
//! limit; one global Redis adds a cross-region round trip to every request.
//! [`RegionStore`] does neither: every region holds a **base share** of each rule in its
//! own store, and the rest, the **pool**, lives at each key's **home region**, from which
//! every instance reserves blocks of units ahead of need. Every decision is local: one
//! call to the region's store (none under its instance lease), or pool units the
//! instance already holds. It implements [`ratelimit_core::Store`], so the tower layer
//! works on it unchanged: `RateLimitLayer::new(store, key, rules)`.
//!
//! ```
//! use std::sync::Arc;
//! use ratelimit_core::{MemoryStore, RuleSet, Store};
//! use ratelimit_regions::{RegionStore, Regions};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // Two regions' servers (in production: a `RedisStore` per region, see the README).
//! let eu = Arc::new(MemoryStore::new());
//! let us = Arc::new(MemoryStore::new());
//! let regions = Regions::even(["eu", "us"])?; // g = 0.5: a quarter each, half pooled
//! let rules: RuleSet = "100/min gcra".parse()?;
//! let store = RegionStore::builder(regions)
//!     .region("eu")
//!     .local(Arc::clone(&eu))
//!     .link("eu", Arc::clone(&eu))
//!     .link("us", Arc::clone(&us))
//!     .rules(&rules) // refuse at start-up what cannot be bounded
//!     .build()?;
//! // eu's base share is 25 at once; then pool units come from the key's home.
//! let mut admitted = 0;
//! for _ in 0..40 {
//!     if store.check(b"customer-7", &rules, 1).await?.is_allowed() {
//!         admitted += 1;
//!     }
//!     tokio::task::yield_now().await; // let the pool's reservation run
//! }
//! assert!(admitted >= 25 && admitted <= 100, "{admitted}");
//! # Ok(())
//! # }
//! ```
//!
//! # The design
//!
//! * **Base shares.** Region r enforces every rule scaled by `f_r = (1 − g) · w_r / Σ w`
//!   ([`Regions`]): a GCRA of burst B and emission interval T becomes burst `⌊f_r·B⌋` and
//!   interval `T / f_r` (the limit scaled, the period kept), a token bucket or leaky
//!   meter likewise, a fixed window `⌊f_r·L⌋` per window. Rounding is always down, so
//!   the shares never add up to more than the rule.
//! * **The pool.** The key's home region enforces the rule scaled by g (default 0.5) on
//!   a key of its own. When the local share denies, the instance spends pool units it
//!   holds. It reserves them from home with an ordinary check of a block's cost (the
//!   same reservation as the Redis store's lease mode), before it runs out (at half a
//!   block, the block being what the instance asked of the pool over the last pool
//!   lease, at most an eighth of the pool's capacity), in the background: no decision
//!   waits for another region. A block may be spent until its reservation's **send
//!   time** plus ℓ_g ([`Regions::pool_lease`]) on the local clock (and, with a fixed
//!   window, never past home's window end, converted from the send time), so every pool
//!   unit is spent at most ℓ_g after home charged it, whatever the clocks of the two
//!   regions say. What a block has left then goes back with the store's refund (a
//!   GCRA or bucket gets back only what has not drained yet; a fixed window only within
//!   the same window). The pool is held per instance, not per region: each instance
//!   reserves for itself.
//! * **Rebalancing** ([below](#rebalancing)): when a region's share denies a key and
//!   the pool units run short, an instance there asks another region, in the
//!   background, to give units of its share (donor first), at most once per T_rb per
//!   key.
//! * **Home.** FNV-1a of the key modulo R, [`Regions::home_by_tier`] (a layer tier
//!   pinned to a region), or [`Regions::home_by`] (any function of the key: by
//!   customer).
//! * **Sliding windows and logs** pool nothing (g = 0 for a rule set that has one) and
//!   are not rebalanced: a unit charged to a sub-window or a log entry cannot be spent
//!   later, or given back in another region, without counting twice. Their base shares
//!   are `w_r / Σ w`.
//! * **Refused** when the store is built ([`RegionStoreBuilder::rules`]) or at the
//!   check: `N concurrent` rules and leaky shapers, whose in-flight slots and delays
//!   cannot be divided into shares; and a rule whose share for some region rounds to 0
//!   units.
//!
//! # Rebalancing
//!
//! Shares are configured by weight; demand moves. When the local share denies a key and
//! the instance holds too few pool units for it (and at most once per T_rb for that key
//! at that instance,
//! [`RegionStoreBuilder::rebalance_every`], default 1 s), the instance runs a round of
//! the demarcation protocol in the background, with the operations every store already
//! has (no script changes):
//!
//! 1. **The donor shrinks first.** The instance peeks (a check of cost 0, which
//!    consumes nothing) at the key's share in every other region with a share, picks
//!    the one with the most units free, and asks it for Δ with an ordinary check of
//!    cost Δ on **that region's store**, on the key's share there (the same store key
//!    and scaled rules that region's own instances decide on). Admitted means the
//!    donor's share had Δ units free and they are now spent there; refused (its own
//!    demand took them since the peek) means nothing moved: a denial consumes nothing.
//!    Δ is what the local share denied since the instance's last round (the key's
//!    first round asks the most), at most half what the donor has free and half the
//!    smaller of the two shares' bursts, and at least 2 units and more than the local
//!    share refills over a cross-region round trip (what drains before the give-back,
//!    step 2), or no ask (a share whose burst is below 4 units is not rebalanced).
//! 2. **The recipient grows only by that, and only after the reply.** It gives Δ back to
//!    its own share with the local store's give-back ([`refund`](ratelimit_core::Store::refund)),
//!    dated at a reading of the local store's clock taken **before the donor's check
//!    was sent**, and only if the grant came within ℓ_g of the send (with a fixed
//!    window, never past the donor's window end converted from the send time, as for a
//!    pool block). A GCRA, token bucket or leaky meter then gets back only what has not
//!    drained at the share's rate since the send, a fixed window only within the
//!    window of the send; a share never holds more than its own burst.
//! 3. **A lost message loses capacity, never creates it.** A reply that is lost (a
//!    timeout, a reset, a partition) or late leaves Δ charged at the donor and gives the
//!    recipient nothing: at most `⌊min(B_d, B_r)/2⌋` units per round, which the donor's
//!    share refills at its rate.
//!
//! What moves is units a share holds, not the shares: `f_r` stays the configured weight
//! (a share's rate and burst are unchanged), so a region that stays hot asks again each
//! round, and an idle share lends what it refills. A round runs when the local share
//! denies a key and the pool holds too little for it; a round that moved nothing doubles
//! the wait before the next (up to 8 T_rb). Every decision stays local: a round costs
//! R − 1 peeks and at most one ask across regions, and one local give-back, per hot key
//! per instance per T_rb; [`RegionStats`] counts them.
//!
//! # The bound
//!
//! Let ℓ_i be the instance lease of the regions' stores (0 for exact stores) and ℓ_g
//! the pool lease. In any interval of length Δ, across every region:
//!
//! | algorithm | admitted at most |
//! |---|---|
//! | GCRA (burst B, interval T), token bucket (capacity B), leaky meter (capacity B) | `B + ⌊(Δ + (1−g)·ℓ_i + g·ℓ_g) / T⌋` |
//! | fixed window | L per window |
//! | sliding window counter (g = 0, precision p) | L in any p consecutive sub-windows, so in any interval of `P·(1 − 1/p)` |
//! | sliding log (g = 0) | L in any window of the period |
//!
//! Rebalancing adds nothing to any row (derivation below).
//!
//! *Derivation* (GCRA; buckets are the same arithmetic). Region r's share admits at most
//! `B_r + ⌊(Δ + ℓ_i)·L_r/P⌋` (the store's lease promise for burst `B_r = ⌊f_r·B⌋` and
//! limit `L_r = ⌊f_r·L⌋` per period P), the pool at most `B_g + ⌊(Δ + ℓ_g)·L_g/P⌋`
//! (every unit charged at home at most ℓ_g before it is spent; a refund leaves home no
//! looser than a smaller reservation). The sum of floors is at most the floor of the
//! sum, `Σ B_r + B_g ≤ B`, `Σ L_r ≤ (1−g)·L` and `L_g ≤ g·L`. A fixed window: the
//! shares and the pool each admit at most their part within the window (a pool block
//! ends with home's window), and the parts add up to at most L. The sliding window and
//! log: each region's share keeps its own algorithm's promise for `L_r`, and `Σ L_r ≤ L`.
//!
//! *Rebalancing* (GCRA, token bucket, leaky meter). Compare the shares' states with
//! those of an **instant** system, in which every granted transfer's Δ is added to the
//! recipient's share (up to its burst) at the very moment the donor's share was
//! charged. There, a transfer never raises the sum of the shares' levels, each level
//! stays within its burst, and the derivation above holds unchanged. In the real
//! system the credit comes a flight time τ later, and the give-back dated at the send
//! returns at most `Δ − τ·L_r/P` (what has not drained at the recipient's rate since
//! the send, which is before the donor's charge). Over τ, the instant system's
//! recipient can lose to its burst cap at most what its share refilled, `τ·L_r/P`, of
//! the credit it got early. So, by induction over the events, every share's level in
//! the real system is at most its level in the instant one; every admission and every
//! donor charge the real system makes, the instant one could make too, and the instant
//! one keeps the bound: **the added term is 0**. (The comparison is of the regions'
//! stores; an instance lease spends what its store granted within ℓ_i, as before.) A
//! reply that never arrives (or
//! arrives after the deadline) is a donor charge with no credit: lower levels, fewer
//! admissions. *Fixed window:* a credit is applied only within the window of its send
//! and before the donor's window end converted from the send time, so the donor's
//! charge and the recipient's credit fall in one window and a window's total over the
//! regions does not grow. This holds with the regions' clocks agreeing on window
//! boundaries (as for the pool's blocks). The give-back's date is read from the local
//! store's clock, which must not run ahead of the time the store decides on (the Redis
//! store's reading of its server's `TIME` never does once it has heard from the
//! server): a reading ahead by ε would give back up to `ε·L_r/P` more, as any refund
//! would.
//!
//! **Partitions.** The bound holds through any partition, with no fail-open choice:
//!
//! * a region cut off from the others decides on its base share and the blocks it holds,
//!   which expire within ℓ_g; what it cannot reach is lost capacity, never extra;
//! * with the home region down (or cut off), every region runs on its base share: at
//!   most `(1−g)·L`, fewer admissions only;
//! * a lost reservation reply (a connection reset after home charged) strands its units
//!   at home until they drain: fewer admissions, never a unit spent twice;
//! * a rebalancing round across a partition fails or times out: the recipient gives its
//!   share nothing, and the donor, if it was charged, has up to `⌊min(B_d, B_r)/2⌋`
//!   units fewer until its share refills them; a cut-off region keeps what it was given
//!   before the cut (units of its own share, spent at its own rate), never more;
//! * a region's store that **loses its state** (a restart without persistence, a
//!   failover without its last writes) starts that region's shares full again, once:
//!   up to `f_r·B` (fixed window: `f_r·L` in that window) more, as a single store that
//!   loses its state admits up to B more. If it was some keys' home, their pools start
//!   full too: `g·B` more, once.
//!
//! What the design costs: a region can take only `f_r·B` at once, `(f_r + g)·B` once it
//! holds pool units; an idle region's share reaches the others only through
//! rebalancing, a round trip after their share denies and at most half a burst per
//! round (utilisation under shifting demand); and blocks and resets cross every
//! region.
//!
//! # Operations
//!
//! * [`block`](ratelimit_core::Store::block) / `unblock` / `reset` reach every region
//!   (through the links); a region a partition hides gets the block when it is sent
//!   again. An instance spends the pool units it holds before it asks its region's
//!   share, so a block placed through another instance stops it within ℓ_g (within ℓ_i
//!   once it holds none); a block through the instance itself drops its units at once.
//! * [`refund`](ratelimit_core::Store::refund) gives nothing back and `settle` charges
//!   an excess only (to the local share): the store does not know whether a check's
//!   units came from the share or the pool, and giving back to the wrong one could admit
//!   more than the bound.
//! * [`RegionStore::flush`] gives back the pool units an instance holds (at shutdown);
//!   [`RegionStore::stats`] counts decisions, pool admissions, transfers and
//!   cross-region calls.
//!
//! Single-region users pay nothing for any of this: it is a crate of its own, and the
//! other stores are unchanged.

// The README is the crates.io page: its examples must compile like the crate docs'.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

mod config;
mod error;
mod pool;
mod rebalance;
mod store;

pub use config::{Regions, Shares, DEFAULT_POOL_LEASE, MAX_REGIONS};
pub use error::RegionsError;
pub use store::{RegionStats, RegionStore, RegionStoreBuilder, DEFAULT_REBALANCE_EVERY, MAX_POOLS};
