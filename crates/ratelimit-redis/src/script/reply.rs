//! How a reply of `lua/check.lua` becomes a [`Decision`], or an error that says what was
//! wrong with it; and how a batch reply divides into one reply per check.

use std::ops::Range;
use std::time::Duration;

use ratelimit_core::{Decision, RuleOutcome, RuleSet};

use super::args::MAX_EXACT;
use crate::error::RedisStoreError;

/// The shape of a reply of `lua/check.lua`: the one place it is written down on the Rust
/// side (the arguments are [`CheckArgs`](super::CheckArgs)'s).
///
/// The reply is one string of little-endian doubles, every one an integer (cheaper for
/// Redis to send than an array): `{1, block left}`, `{3, Redis time}` or
/// `{status, delay, 4 values per rule}`. In a batch reply, the replies of the checks
/// follow one another; a check that failed is `{-1, n}` and its error message of `n`
/// bytes.
#[derive(Debug)]
pub(crate) struct CheckReply;

/// What one check's reply says: its decision and whether the script found and discarded
/// a value it did not write; or, as `Err`, the Redis time at which the check arrived
/// past its deadline and was not run.
pub(crate) type Decided = Result<(Decision, bool), u64>;

impl CheckReply {
    /// The length in bytes of the reply at the start of `bytes` in a batch reply, for a
    /// check of `rules` rules: `Ok` for a decision, `Err` with the message's range for a
    /// check that failed; `None` when `bytes` cannot hold one.
    pub(crate) fn len(rules: usize, bytes: &[u8]) -> Option<Result<usize, Range<usize>>> {
        let value = |i: usize| {
            let chunk = bytes.get(8 * i..8 * i + 8)?;
            Some(f64::from_le_bytes(chunk.try_into().ok()?))
        };
        let len = match value(0)? {
            -1.0 => {
                let n = value(1)?;
                if !(n >= 0.0 && n.fract() == 0.0 && n <= bytes.len() as f64) {
                    return None;
                }
                let range = 16..16 + n as usize;
                return (range.end <= bytes.len()).then_some(Err(range));
            }
            // A block, a late check, an edit's `{4, 0 or 1}`.
            1.0 | 3.0 | 4.0 => 16,
            0.0 | 2.0 => 16 + 32 * rules,
            _ => return None,
        };
        (len <= bytes.len()).then_some(Ok(len))
    }

    /// Whether an edit carried by a batch changed the state, from its reply `{4, 0 or
    /// 1}` ([`ratelimit_core::packed::encode_edit`]).
    pub(crate) fn edited(bytes: &[u8]) -> Result<bool, RedisStoreError> {
        let value = |i: usize| {
            let chunk = bytes.get(8 * i..8 * i + 8)?;
            Some(f64::from_le_bytes(chunk.try_into().ok()?))
        };
        match (bytes.len(), value(0), value(1)) {
            (16, Some(4.0), Some(changed)) if changed == 0.0 || changed == 1.0 => {
                Ok(changed == 1.0)
            }
            _ => Err(unexpected(
                "an edit should answer {4, 0 or 1}",
                &Bytes(bytes),
            )),
        }
    }

    /// The number a take carried by a batch answers, from its reply `{4, slot}`
    /// ([`ratelimit_core::packed::encode_edit_value`]): the slot, `None` for `{4, 0}`.
    pub(crate) fn edit_value(bytes: &[u8]) -> Result<Option<u64>, RedisStoreError> {
        let value = |i: usize| {
            let chunk = bytes.get(8 * i..8 * i + 8)?;
            Some(f64::from_le_bytes(chunk.try_into().ok()?))
        };
        match (bytes.len(), value(0), value(1)) {
            (16, Some(4.0), Some(slot))
                if slot >= 0.0 && slot.fract() == 0.0 && slot <= MAX_EXACT as f64 =>
            {
                // Exact: an integer below 2^53.
                Ok((slot > 0.0).then_some(slot as u64))
            }
            _ => Err(unexpected(
                "a take should answer {4, its slot or 0}",
                &Bytes(bytes),
            )),
        }
    }

    /// Turns the bytes of a check's reply into a [`Decided`].
    pub(crate) fn decision_from(rules: &RuleSet, bytes: &[u8]) -> Result<Decided, RedisStoreError> {
        let reply = &Bytes(bytes);
        let mut ints = [0i64; 2 + 4 * ratelimit_core::MAX_RULES];
        if !bytes.len().is_multiple_of(8) {
            return Err(unexpected("the reply should be whole doubles", reply));
        }
        if bytes.len() / 8 > ints.len() {
            return Err(unexpected("too many values", reply));
        }
        for (slot, chunk) in ints.iter_mut().zip(bytes.chunks_exact(8)) {
            let x = f64::from_le_bytes(chunk.try_into().expect("8 bytes"));
            // Exact integers only: the script's values stay below 2^53.
            if !(x.fract() == 0.0 && x.abs() <= MAX_EXACT as f64) {
                return Err(unexpected("the check script should return integers", reply));
            }
            *slot = x as i64;
        }
        let ints = &ints[..bytes.len() / 8];
        let us = |n: i64| u64::try_from(n).map(Duration::from_micros).ok();
        match ints {
            [1, -1] => Ok(Ok((Decision::blocked(None), false))),
            [1, left] => us(*left)
                .map(|left| Ok((Decision::blocked(Some(left)), false)))
                .ok_or_else(|| unexpected("a block's time left cannot be negative", reply)),
            [3, now] => u64::try_from(*now)
                .map(Err)
                .map_err(|_| unexpected("Redis time cannot be negative", reply)),
            [status @ (0 | 2), delay, per_rule @ ..] if per_rule.len() == 4 * rules.len() => {
                let delay = us(*delay).ok_or_else(|| unexpected("negative delay", reply))?;
                let mut outcomes = Vec::with_capacity(rules.len());
                for (rule, r) in rules.rules().iter().zip(per_rule.chunks_exact(4)) {
                    let (Some(remaining), Some(reset), Some(retry)) =
                        (u64::try_from(r[1]).ok(), us(r[2]), us(r[3]))
                    else {
                        return Err(unexpected("negative rule values", reply));
                    };
                    let allowed = match r[0] {
                        1 => true,
                        0 => false,
                        _ => return Err(unexpected("allowed must be 0 or 1", reply)),
                    };
                    outcomes.push(RuleOutcome {
                        allowed,
                        limit: rule.limit(),
                        remaining,
                        reset_after: reset,
                        retry_after: (!allowed).then_some(retry),
                    });
                }
                // A slot's number comes as its rule's retry (an admitting rule has none).
                let slot = rules
                    .concurrent()
                    .and_then(|at| per_rule.get(4 * at..4 * at + 4))
                    .and_then(|r| (r[0] == 1 && r[3] > 0).then(|| r[3].unsigned_abs()));
                let decision = Decision::from_rules(outcomes, delay).with_slot(slot);
                Ok(Ok((decision, *status == 2)))
            }
            _ => Err(unexpected(
                &format!(
                    "the check script should return {{1, left}} or {{0, delay, 4 values x {} rules}}",
                    rules.len()
                ),
                reply,
            )),
        }
    }
}

fn unexpected(what: &str, reply: &dyn std::fmt::Debug) -> RedisStoreError {
    RedisStoreError::UnexpectedReply(format!("{what}, got {reply:?}"))
}

/// A reply's bytes as the error messages show them: the doubles they pack.
struct Bytes<'a>(&'a [u8]);

impl std::fmt::Debug for Bytes<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut list = f.debug_list();
        for chunk in self.0.chunks(8) {
            match <[u8; 8]>::try_from(chunk) {
                Ok(bytes) => list.entry(&f64::from_le_bytes(bytes)),
                Err(_) => list.entry(&chunk),
            };
        }
        list.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn rules(text: &str) -> RuleSet {
        text.parse().unwrap()
    }

    /// A reply as the script packs it.
    fn ints(v: &[i64]) -> Vec<u8> {
        v.iter().flat_map(|&n| (n as f64).to_le_bytes()).collect()
    }

    #[test]
    fn replies_become_decisions() {
        let r = rules("10/s fixed-window; 2/s leaky-bucket mode=shaper burst=4 delay=1");
        let (d, healed) =
            CheckReply::decision_from(&r, &ints(&[0, 500, 1, 9, 1000, 0, 1, 3, 2000, 0]))
                .unwrap()
                .unwrap();
        assert!(d.is_allowed());
        assert!(!healed);
        assert_eq!(d.delay(), Duration::from_micros(500));
        assert_eq!(d.rules()[0].remaining, 9);
        assert_eq!(d.rules()[1].limit, 2);
        let (d, healed) =
            CheckReply::decision_from(&r, &ints(&[2, 0, 1, 9, 1000, 7, 0, 0, 2000, 300]))
                .unwrap()
                .unwrap();
        assert!(!d.is_allowed());
        assert!(healed);
        assert_eq!(d.retry_after(), Some(Duration::from_micros(300)));
        assert_eq!(d.rules()[0].retry_after, None);
        assert_eq!(
            CheckReply::decision_from(&r, &ints(&[1, -1]))
                .unwrap()
                .unwrap()
                .0,
            Decision::blocked(None)
        );
        assert_eq!(
            CheckReply::decision_from(&r, &ints(&[1, 5]))
                .unwrap()
                .unwrap()
                .0,
            Decision::blocked(Some(Duration::from_micros(5)))
        );
        assert_eq!(
            CheckReply::decision_from(&r, &ints(&[3, 1_763_683_200_000_000])).unwrap(),
            Err(1_763_683_200_000_000)
        );
    }

    #[test]
    fn a_batch_reply_divides_into_one_reply_per_check() {
        let bytes = |v: &[f64]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
        // A decision of 2 rules, a block, a check too late, then an error entry.
        let decided = bytes(&[0.0, 0.0, 1.0, 9.0, 1.0, 0.0, 1.0, 3.0, 1.0, 0.0]);
        assert_eq!(CheckReply::len(2, &decided), Some(Ok(80)));
        assert_eq!(CheckReply::len(3, &decided), None, "too short for 3 rules");
        assert_eq!(CheckReply::len(5, &bytes(&[1.0, -1.0])), Some(Ok(16)));
        assert_eq!(CheckReply::len(5, &bytes(&[3.0, 1e15])), Some(Ok(16)));
        // An edit's reply, whatever the rules.
        assert_eq!(CheckReply::len(0, &bytes(&[4.0, 1.0])), Some(Ok(16)));
        assert!(CheckReply::edited(&bytes(&[4.0, 1.0])).unwrap());
        assert!(!CheckReply::edited(&bytes(&[4.0, 0.0])).unwrap());
        for bad in [
            bytes(&[4.0, 2.0]),
            bytes(&[1.0, 1.0]),
            bytes(&[4.0, 1.0, 0.0]),
        ] {
            assert!(CheckReply::edited(&bad).is_err(), "{bad:?}");
        }
        let mut failed = bytes(&[-1.0, 7.0]);
        failed.extend_from_slice(b"RLSTATE and more");
        assert_eq!(CheckReply::len(1, &failed), Some(Err(16..23)));
        for bad in [
            bytes(&[-1.0, 99.0]),
            bytes(&[-1.0, 0.5]),
            bytes(&[-1.0, -3.0]),
            bytes(&[5.0, 0.0]),
            bytes(&[f64::NAN, 0.0]),
            bytes(&[1.0]),
            vec![0; 7],
        ] {
            assert_eq!(CheckReply::len(1, &bad), None, "{bad:?}");
        }
    }

    #[test]
    fn malformed_replies_are_errors() {
        let r = rules("10/s");
        for bad in [
            ints(&[]),
            ints(&[0, 0, 1, 2, 3]),
            ints(&[0, 0, 2, 1, 1, 1]),
            ints(&[0, -1, 1, 1, 1, 1]),
            ints(&[3, 0, 1, 1, 1, 1]),
            ints(&[1, -2]),
            ints(&[2, 0]),
            ints(&[0; 80]),
            ints(&[0, 0, 1, 1 << 54, 1, 1]),
            vec![0; 12],
            [0.0, 0.0, 1.0, 1.5, 1.0, 1.0]
                .iter()
                .flat_map(|x: &f64| x.to_le_bytes())
                .collect(),
            [0.0, 0.0, 1.0, f64::NAN, 1.0, 1.0]
                .iter()
                .flat_map(|x: &f64| x.to_le_bytes())
                .collect(),
        ] {
            let err = CheckReply::decision_from(&r, &bad).unwrap_err();
            assert!(
                matches!(err, RedisStoreError::UnexpectedReply(_)),
                "{err:?}"
            );
        }
    }

    proptest! {
        /// Whatever integers come back, decoding answers a decision or an error, never a
        /// panic.
        #[test]
        fn any_reply_decodes_or_errs(values in proptest::collection::vec(any::<i64>(), 0..12)) {
            let r = rules("10/s; 5/min sliding-log");
            let _ = CheckReply::decision_from(&r, &ints(&values));
            let mut shaped = vec![0, values.first().copied().unwrap_or(0)];
            shaped.extend(values.iter().copied().chain(std::iter::repeat(1)).take(8));
            let _ = CheckReply::decision_from(&r, &ints(&shaped));
        }
    }
}
