//! Rebalancing of base shares (the demarcation protocol), per (key, rule set) at one
//! instance: what its region's share was denied lately, and when it last asked a donor.

/// One (key, rule set)'s rebalancing state at this instance.
#[derive(Debug)]
pub(crate) struct Transfer {
    /// Units the local share denied since the last round: the demand a transfer sizes on.
    pub(crate) denied: u64,
    /// When the last round started (µs on the local clock); 0: never.
    pub(crate) last_round_us: u64,
    /// A round is in flight (at most one per entry).
    pub(crate) in_flight: bool,
    /// The donor the next round prefers on a tie (an index into the other regions).
    pub(crate) next_donor: usize,
    /// Rounds in a row that moved nothing: the next waits `2^idle_rounds` periods
    /// (at most 8).
    idle_rounds: u32,
    /// The last denial (µs on the local clock), to forget idle entries.
    pub(crate) last_seen_us: u64,
}

impl Transfer {
    pub(crate) fn new(now_us: u64, first_donor: usize) -> Self {
        Self {
            denied: 0,
            last_round_us: 0,
            in_flight: false,
            next_donor: first_donor,
            idle_rounds: 0,
            last_seen_us: now_us,
        }
    }

    /// Counts `cost` units the local share denied at `now_us`, and answers how many
    /// units to ask a donor for if a round is due (none in flight, none started within
    /// `every_us`), marking it started: what the share denied since the last round, or
    /// `u64::MAX` (as much as a donor may give) for a key's first round, whose demand is
    /// not known yet.
    pub(crate) fn note_denied(&mut self, cost: u64, now_us: u64, every_us: u64) -> Option<u64> {
        self.denied = self.denied.saturating_add(cost);
        self.last_seen_us = now_us;
        let wait = every_us.saturating_mul(1 << self.idle_rounds.min(3));
        let due = self.last_round_us == 0 || now_us >= self.last_round_us.saturating_add(wait);
        if self.in_flight || !due {
            return None;
        }
        let first = self.last_round_us == 0;
        self.in_flight = true;
        self.last_round_us = now_us.max(1);
        let denied = std::mem::take(&mut self.denied);
        Some(if first { u64::MAX } else { denied.max(1) })
    }

    /// Ends the round in flight; `moved`: whether it moved units (if not, the next round
    /// waits longer).
    pub(crate) fn finish(&mut self, moved: bool) {
        self.in_flight = false;
        self.idle_rounds = if moved { 0 } else { self.idle_rounds + 1 };
    }

    /// Whether the entry can be forgotten at `now_us` (nothing in flight, no denial for
    /// `idle_us`).
    pub(crate) fn is_idle(&self, now_us: u64, idle_us: u64) -> bool {
        !self.in_flight && now_us.saturating_sub(self.last_seen_us) > idle_us
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_round_per_period_and_none_while_one_is_in_flight() {
        let mut t = Transfer::new(10, 0);
        assert_eq!(
            t.note_denied(3, 10, 100),
            Some(u64::MAX),
            "demand not known yet"
        );
        assert_eq!(t.note_denied(2, 20, 100), None, "in flight");
        t.in_flight = false;
        assert_eq!(t.note_denied(2, 50, 100), None, "within the period");
        assert_eq!(t.note_denied(1, 111, 100), Some(5), "what was denied since");
        t.finish(false);
        assert_eq!(
            t.note_denied(1, 250, 100),
            None,
            "after a round that moved nothing"
        );
        assert_eq!(t.note_denied(1, 311, 100), Some(2));
        t.finish(true);
        assert!(!t.is_idle(320, 100));
        assert!(t.is_idle(500, 100));
        assert_eq!(
            t.note_denied(1, 411, 100),
            Some(1),
            "after a round that moved"
        );
    }
}
