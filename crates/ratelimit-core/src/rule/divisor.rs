//! Division by a rule's fixed numbers (limit, period, sub-window) without a divide
//! instruction: a multiplier computed once when the rule is built, so a decision pays a
//! multiplication and two shifts instead of a 64-bit division.

/// `n / d` for every `u64` `n`, exactly, by the round-up method of Granlund and Montgomery
/// ("Division by invariant integers using multiplication", 1994, figure 4.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Divisor {
    d: u64,
    m: u64,
    sh1: u32,
    sh2: u32,
}

impl Divisor {
    /// A divisor for `d`, at least 1.
    pub(crate) fn new(d: u64) -> Self {
        assert!(d > 0, "division by zero");
        // l = ceil(log2(d)); m = floor(2^64 × (2^l − d) / d) + 1, which fits in 64 bits.
        let l = 64 - (d - 1).leading_zeros();
        let m = ((1u128 << 64) * ((1u128 << l) - u128::from(d)) / u128::from(d) + 1) as u64;
        Divisor {
            d,
            m,
            sh1: l.min(1),
            sh2: l.saturating_sub(1),
        }
    }

    /// `d`.
    #[inline]
    pub(crate) fn get(self) -> u64 {
        self.d
    }

    /// `n / d`.
    #[inline]
    pub(crate) fn div(self, n: u64) -> u64 {
        let t = ((u128::from(self.m) * u128::from(n)) >> 64) as u64;
        (t + ((n - t) >> self.sh1)) >> self.sh2
    }

    /// `(n / d, n % d)`.
    #[inline]
    pub(crate) fn div_rem(self, n: u64) -> (u64, u64) {
        let q = self.div(n);
        (q, n - q * self.d)
    }

    /// `n / d`, rounded up.
    #[inline]
    pub(crate) fn div_ceil(self, n: u64) -> u64 {
        let (q, r) = self.div_rem(n);
        q + u64::from(r > 0)
    }
}

#[cfg(test)]
mod tests {
    use super::Divisor;
    use proptest::prelude::*;

    #[test]
    fn edges() {
        let ds = [
            1,
            2,
            3,
            7,
            10,
            1_000_000,
            (1 << 51) - 1,
            1 << 51,
            u64::MAX / 2,
            u64::MAX / 2 + 2,
            u64::MAX - 1,
            u64::MAX,
        ];
        let ns = [
            0,
            1,
            2,
            999_999,
            1_000_000,
            1 << 53,
            (1 << 63) - 1,
            1 << 63,
            u64::MAX - 1,
            u64::MAX,
        ];
        for d in ds {
            let div = Divisor::new(d);
            for n in ns
                .into_iter()
                .chain([d - 1, d, d.saturating_add(1), d.wrapping_mul(3)])
            {
                assert_eq!(div.div_rem(n), (n / d, n % d), "{n} / {d}");
                assert_eq!(div.div_ceil(n), n.div_ceil(d), "{n} / {d}");
            }
        }
    }

    proptest! {
        #[test]
        fn matches_the_divide_instruction(d in 1u64.., n: u64, small in 1u64..100_000, shift in 0u32..64) {
            for d in [d, small, d >> shift | 1, 1 << shift] {
                let div = Divisor::new(d);
                prop_assert_eq!(div.div_rem(n), (n / d, n % d));
                prop_assert_eq!(div.div_ceil(n), n.div_ceil(d));
            }
        }
    }
}
