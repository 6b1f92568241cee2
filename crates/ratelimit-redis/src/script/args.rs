//! The argument of `lua/check.lua` (and of the native module's commands): how a check's
//! time, cost, TTL floor and rules become the one packed argument the script reads. The
//! layout is the core's `ratelimit_core::packed`; a change of it is a change there and
//! in the script.

use std::time::Duration;

use ratelimit_core::packed;
use ratelimit_core::RuleSet;
use redis::Cmd;

/// Values above this are not exact in Lua's doubles.
pub(crate) const MAX_EXACT: u64 = packed::MAX_EXACT;

/// Block lengths are capped so that `now + length` stays exact in Lua (about 142 years).
const MAX_BLOCK_US: u64 = 1 << 52;

/// A block's length as `lua/block.lua` takes it, in µs; `None` (no end) as the empty
/// argument.
pub(crate) fn block_us(duration: Duration) -> u64 {
    u64::try_from(duration.as_micros()).map_or(MAX_BLOCK_US, |us| us.min(MAX_BLOCK_US))
}

/// The argument layout of `lua/check.lua` as the store sends it. The layout itself is
/// the core's [`ratelimit_core::packed`], which the native module reads too; the reply's
/// shape is [`CheckReply`](super::CheckReply)'s.
///
/// The one argument, `ARGV[1]`, packs [`HEADER`](Self::HEADER) values (injected, now,
/// cost, TTL floor, rules, state width, log limit, log period, layout, deadline) and
/// [`PER_RULE`](Self::PER_RULE) per rule (`code, limit, period_us, a, b, id`) as
/// little-endian doubles, so that the script reads every argument in one C call instead
/// of parsing text (the script derives the struct formats from the lengths). The
/// deadline is on the Redis clock whatever the check's own clock, so a check on an
/// injected clock is turned away past it too.
#[derive(Debug)]
pub(crate) struct CheckArgs;

/// Where a check takes its time from, and when its caller stops waiting.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Time {
    /// The injected clock's reading; `None`: Redis `TIME`.
    pub(crate) now: Option<u64>,
    /// The caller's deadline on the Redis clock, when known (whatever `now` is).
    pub(crate) deadline: Option<u64>,
}

impl Time {
    /// An injected time without a deadline.
    #[cfg(test)]
    pub(crate) fn injected(now: u64) -> Self {
        Self {
            now: Some(now),
            deadline: None,
        }
    }
}

impl CheckArgs {
    /// Values before the first rule.
    pub(crate) const HEADER: usize = packed::HEADER;
    /// Values per rule.
    pub(crate) const PER_RULE: usize = packed::PER_RULE;

    /// The one argument of a check: its values packed.
    pub(crate) fn pack(time: Time, cost: u64, ttl_floor_ms: u64, rules: &RuleSet) -> Vec<u8> {
        packed::pack_check(rules, time.now, cost, ttl_floor_ms, time.deadline)
    }

    /// Appends the arguments of a check to `cmd`.
    pub(crate) fn write(cmd: &mut Cmd, time: Time, cost: u64, ttl_floor_ms: u64, rules: &RuleSet) {
        cmd.arg(Self::pack(time, cost, ttl_floor_ms, rules));
    }

    /// The arguments of a check, for tools that send the script by hand.
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn to_args(
        time: Time,
        cost: u64,
        ttl_floor_ms: u64,
        rules: &RuleSet,
    ) -> Vec<Vec<u8>> {
        let mut cmd = Cmd::new();
        Self::write(&mut cmd, time, cost, ttl_floor_ms, rules);
        cmd.args_iter()
            .map(|arg| match arg {
                redis::Arg::Simple(bytes) => bytes.to_vec(),
                _ => Vec::new(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use ratelimit_core::Rule;

    fn rules(text: &str) -> RuleSet {
        text.parse().unwrap()
    }

    #[test]
    fn rules_are_encoded_for_the_script() {
        let r = rules(
            "5/s fixed-window; 6/s sliding-window precision=4; 7/s sliding-log; \
             8/s token-bucket capacity=9; 10/s gcra burst=3; \
             11/s leaky-bucket mode=meter capacity=4; 12/s leaky-bucket mode=shaper burst=5 delay=2",
        );
        let codes: Vec<[u64; 6]> = r
            .rules()
            .iter()
            .zip(r.rule_ids())
            .map(|(rule, &id)| packed::rule_values(rule, id))
            .collect();
        let s = 1_000_000;
        let ids = r.rule_ids();
        assert_eq!(
            codes,
            [
                [1, 5, s, 0, 0, ids[0]],
                [2, 6, s, 4, s / 4, ids[1]],
                [3, 7, s, 0, 0, ids[2]],
                [4, 8, s, 9, 0, ids[3]],
                [6, 10, s, 3, 0, ids[4]],
                [5, 11, s, 4, 0, ids[5]],
                [5, 12, s, 5, 3, ids[6]],
            ]
        );
        // The layout; entries of 2 + 2 (fixed window), 2 + 6 (sliding window), none (log),
        // 2 + 4 for each of the other four; the log marker.
        assert_eq!(packed::state_width(&r), 1 + 4 + 8 + 4 * 6 + 3);
        let time = Time {
            now: Some(7),
            deadline: Some(9),
        };
        let args = CheckArgs::to_args(time, 2, 60_000, &r);
        let count = CheckArgs::HEADER + CheckArgs::PER_RULE * r.len();
        assert_eq!(args.len(), 1);
        assert_eq!(args[0].len(), 8 * count);
        let values: Vec<f64> = args[0]
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let layout = (r.fingerprint() & ((1 << 52) - 1)) as f64;
        assert_eq!(
            values[..10],
            [1.0, 7.0, 2.0, 60_000.0, 7.0, 40.0, 7.0, 1e6, layout, 9.0]
        );
        assert_eq!(values[10..16], [1.0, 5.0, 1e6, 0.0, 0.0, ids[0] as f64]);
    }

    /// Builds whatever rule the core accepts from arbitrary numbers.
    fn any_rule() -> impl Strategy<Value = Option<Rule>> {
        let extreme = prop_oneof![
            Just(0u64),
            Just(1),
            Just((1 << 51) - 1),
            Just(1 << 51),
            Just((1 << 53) - 1),
            Just(1 << 53),
            Just(u64::MAX - 1),
            Just(u64::MAX),
            any::<u64>(),
            0u64..10_000,
        ];
        (
            0u8..7,
            extreme.clone(),
            extreme.clone(),
            extreme.clone(),
            extreme,
        )
            .prop_map(|(kind, limit, period_us, a, b)| {
                let period = Duration::from_micros(period_us);
                match kind {
                    0 => Rule::fixed_window(limit, period),
                    1 => Rule::sliding_window(limit, period, a),
                    2 => Rule::sliding_log(limit, period),
                    3 => Rule::token_bucket(limit, period, a),
                    4 => Rule::gcra(limit, period, a),
                    5 => Rule::leaky_meter(limit, period, a),
                    _ => Rule::leaky_shaper(limit, period, a, b),
                }
                .ok()
            })
    }

    #[test]
    fn a_shaper_burst_at_the_top_of_u64_is_refused_by_name() {
        let err = Rule::leaky_shaper(1, Duration::from_secs(1), u64::MAX, 0).unwrap_err();
        assert!(err.to_string().contains("burst"), "{err}");
    }

    proptest! {
        /// Issue 9's overflow check for the Redis encoding: whatever rule the core accepts,
        /// its arguments are computed without overflow (debug builds panic on one) and every
        /// value is exact in Lua's doubles.
        #[test]
        fn every_accepted_rule_encodes_exactly(rule in any_rule(), cost in any::<u64>(), now in any::<u64>()) {
            if let Some(rule) = rule {
                let set = RuleSet::new(vec![rule]).unwrap();
                let now = now & MAX_EXACT;
                if set.check_cost(cost).is_ok() {
                    for value in packed::check_values(&set, Some(now), cost, u64::MAX, None) {
                        prop_assert!(value <= MAX_EXACT, "{}: {} is not exact in Lua", set.rules()[0], value);
                    }
                }
                let args = CheckArgs::to_args(Time::injected(now), cost, u64::MAX, &set);
                prop_assert_eq!(args[0].len(), 8 * (CheckArgs::HEADER + CheckArgs::PER_RULE));
            }
        }
    }
}
