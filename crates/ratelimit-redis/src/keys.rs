//! Redis key names: `<prefix>:{k<hex of the client key>}:<kind>`.
//!
//! The client key is hex-encoded, so whatever its bytes (braces, colons, CRLF, non-UTF-8,
//! any length) the name is printable, cannot end the hash tag early, and two client keys
//! never share a name. The `k` keeps the tag non-empty for the empty client key (Redis
//! hashes the whole name when the tag is `{}`). Every key of one client carries the same
//! tag, so they share one Cluster slot and one script may touch them all.

use std::fmt::Write as _;

use ratelimit_core::RuleSet;

use crate::error::RedisStoreError;

/// The prefix used when none is configured.
pub(crate) const DEFAULT_PREFIX: &str = "ratelimit";

/// Checks that a prefix cannot disturb the hash tag that follows it.
pub(crate) fn validate_prefix(prefix: &str) -> Result<(), RedisStoreError> {
    if prefix.contains(['{', '}']) {
        return Err(RedisStoreError::InvalidConfig(format!(
            "key prefix {prefix:?} contains `{{` or `}}`, which would change the Redis Cluster \
             hash tag of every key; use a prefix without braces, e.g. \"ratelimit\" or \"app:rl\""
        )));
    }
    Ok(())
}

/// The keys one check touches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CheckKeys {
    /// Block marker of the client key (string).
    pub(crate) block: String,
    /// Rule state of (client key, rule set) (string: a MessagePack array).
    pub(crate) state: String,
    /// Shared sliding log of (client key, rule set) (list).
    pub(crate) log: String,
}

/// `<prefix>:{k<hex>}:`, the part every key of the client shares.
fn client_base(prefix: &str, key: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(prefix.len() + 5 + 2 * key.len() + 24);
    s.push_str(prefix);
    s.push_str(":{k");
    for b in key {
        s.push(HEX[usize::from(b >> 4)] as char);
        s.push(HEX[usize::from(b & 15)] as char);
    }
    s.push_str("}:");
    s
}

pub(crate) fn block_key(prefix: &str, key: &[u8]) -> String {
    let mut s = client_base(prefix, key);
    s.push('b');
    s
}

pub(crate) fn check_keys(prefix: &str, key: &[u8], rules: &RuleSet) -> CheckKeys {
    let base = client_base(prefix, key);
    let mut block = String::with_capacity(base.len() + 1);
    block.push_str(&base);
    block.push('b');
    let mut state = base.clone();
    let _ = write!(state, "s:{:016x}", rules.fingerprint());
    let mut log = base;
    let _ = write!(log, "l:{:016x}", rules.fingerprint());
    CheckKeys { block, state, log }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(text: &str) -> RuleSet {
        text.parse().unwrap()
    }

    #[test]
    fn layout() {
        let r = rules("1/s");
        let k = check_keys("rl", b"a{b}", &r);
        let fp = format!("{:016x}", r.fingerprint());
        assert_eq!(k.block, "rl:{k617b627d}:b");
        assert_eq!(k.state, format!("rl:{{k617b627d}}:s:{fp}"));
        assert_eq!(k.log, format!("rl:{{k617b627d}}:l:{fp}"));
        assert_eq!(block_key("rl", b"a{b}"), k.block);
        assert_eq!(block_key("rl", b""), "rl:{k}:b");
    }

    #[test]
    fn distinct_client_keys_give_distinct_names() {
        let r = rules("1/s");
        let awkward: [&[u8]; 9] = [
            b"",
            b"a",
            b"a:b",
            b"a:",
            b":b",
            b"{a}",
            b"}",
            b"\r\n",
            b"\xff\x00",
        ];
        let mut seen = std::collections::HashSet::new();
        for key in awkward {
            let k = check_keys("rl", key, &r);
            for name in [k.block, k.state, k.log] {
                assert!(name.starts_with("rl:{k"), "{name}");
                assert!(name.is_ascii(), "{name}");
                assert_eq!(name.matches('{').count(), 1, "{name}");
                assert_eq!(name.matches('}').count(), 1, "{name}");
                assert!(seen.insert(name.clone()), "collision on {name}");
            }
        }
    }

    #[test]
    fn prefixes_with_braces_are_refused() {
        assert!(validate_prefix("app:rl").is_ok());
        assert!(validate_prefix("").is_ok());
        for bad in ["{x}", "a{", "}"] {
            let err = validate_prefix(bad).unwrap_err().to_string();
            assert!(err.contains("hash tag"), "{err}");
        }
    }
}
