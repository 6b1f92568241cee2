//! Pool units an instance holds: blocks reserved at a key's home region, each spendable
//! until its expiry (its reservation's send time plus ℓ_g), in expiry order.

use std::collections::VecDeque;

use ratelimit_core::RuleSet;

/// Units reserved at home in one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Block {
    /// Units not yet spent.
    pub(crate) units: u64,
    /// Spendable while the local clock reads less than this (µs).
    pub(crate) expiry_us: u64,
    /// The home store's clock before the reservation was sent: what a refund names.
    pub(crate) charged_at: u64,
}

/// One (key, rule set)'s pool at this instance.
#[derive(Debug)]
pub(crate) struct Entry {
    pub(crate) home: usize,
    /// The pool's rules at home, which a refund names.
    pub(crate) pool: RuleSet,
    blocks: VecDeque<Block>,
    /// A reservation is in flight (at most one per entry).
    pub(crate) reserving: bool,
    /// No reservation before this time (after a refusal or a failure).
    pub(crate) not_before_us: u64,
    /// Units asked of the pool in the current and the previous lease length.
    window_start_us: u64,
    current: u64,
    previous: u64,
    pub(crate) last_seen_us: u64,
}

impl Entry {
    pub(crate) fn new(home: usize, pool: RuleSet, now_us: u64) -> Self {
        Self {
            home,
            pool,
            blocks: VecDeque::new(),
            reserving: false,
            not_before_us: 0,
            window_start_us: now_us,
            current: 0,
            previous: 0,
            last_seen_us: now_us,
        }
    }

    /// Counts `cost` units asked of the pool at `now_us`.
    pub(crate) fn note_demand(&mut self, cost: u64, now_us: u64, lease_us: u64) {
        if now_us >= self.window_start_us.saturating_add(lease_us) {
            self.previous = if now_us < self.window_start_us.saturating_add(2 * lease_us) {
                self.current
            } else {
                0
            };
            self.current = 0;
            self.window_start_us = now_us;
        }
        self.current = self.current.saturating_add(cost);
        self.last_seen_us = now_us;
    }

    /// Units asked per lease length lately.
    pub(crate) fn demand(&self) -> u64 {
        self.current.max(self.previous)
    }

    /// Takes the blocks whose expiry has come (`now_us` at or past it), for a refund.
    pub(crate) fn take_expired(&mut self, now_us: u64, out: &mut Vec<Block>) {
        self.blocks.retain(|b| {
            if now_us >= b.expiry_us {
                if b.units > 0 {
                    out.push(*b);
                }
                false
            } else {
                true
            }
        });
    }

    /// Takes every block, for a refund (a reset, a flush).
    pub(crate) fn take_all(&mut self, out: &mut Vec<Block>) {
        out.extend(self.blocks.drain(..).filter(|b| b.units > 0));
    }

    /// Units spendable now (expired blocks taken out first).
    pub(crate) fn live(&self) -> u64 {
        self.blocks.iter().map(|b| b.units).sum()
    }

    /// Whether nothing is held or in flight.
    pub(crate) fn is_idle(&self) -> bool {
        self.blocks.is_empty() && !self.reserving
    }

    /// Spends `cost` units from the blocks that expire first, if they hold that many
    /// together; else spends nothing.
    pub(crate) fn spend(&mut self, cost: u64) -> bool {
        if self.live() < cost {
            return false;
        }
        let mut left = cost;
        for block in &mut self.blocks {
            let take = block.units.min(left);
            block.units -= take;
            left -= take;
            if left == 0 {
                break;
            }
        }
        self.blocks.retain(|b| b.units > 0);
        true
    }

    /// Adds a granted block, keeping the blocks in expiry order.
    pub(crate) fn add(&mut self, block: Block) {
        let at = self
            .blocks
            .iter()
            .position(|b| b.expiry_us > block.expiry_us)
            .unwrap_or(self.blocks.len());
        self.blocks.insert(at, block);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry() -> Entry {
        Entry::new(0, "10/s".parse().unwrap(), 0)
    }

    #[test]
    fn spends_the_earliest_expiry_first_and_only_whole_costs() {
        let mut e = entry();
        e.add(Block {
            units: 3,
            expiry_us: 200,
            charged_at: 1,
        });
        e.add(Block {
            units: 2,
            expiry_us: 100,
            charged_at: 2,
        });
        assert!(!e.spend(6));
        assert!(e.spend(3));
        assert_eq!(e.live(), 2);
        let mut out = Vec::new();
        e.take_expired(100, &mut out);
        assert!(out.is_empty(), "the block expiring at 100 was spent");
        e.take_expired(200, &mut out);
        assert_eq!(out.iter().map(|b| b.units).sum::<u64>(), 2);
        assert!(e.is_idle());
    }

    #[test]
    fn demand_counts_the_last_two_lease_lengths() {
        let mut e = entry();
        e.note_demand(5, 10, 100);
        e.note_demand(1, 120, 100);
        assert_eq!(e.demand(), 5);
        e.note_demand(1, 500, 100);
        assert_eq!(e.demand(), 1);
    }
}
