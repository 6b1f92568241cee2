//! Redis key names: `<prefix>:{<tag>}:<kind>`, one set per client key whatever the rules.
//!
//! The tag stands for the client key as the core holds it
//! ([`StoredKey`](ratelimit_core::key::StoredKey)): `k<hex of the key>` for a key of at
//! most 64 bytes, `d<hex of its 32-byte digest>` for a longer one. Whatever the client
//! key's bytes (braces, colons, CRLF, non-UTF-8) or length, a name is printable, at most
//! 130 characters past the prefix, cannot end the hash tag early, and two client keys
//! never share a name: the letter keeps short keys and digests apart, and a 64-byte key
//! is never confused with a digest. The letter also keeps the tag non-empty for the empty
//! client key (Redis hashes the whole name when the tag is `{}`). Every key of one client
//! carries the same tag, so they share one Cluster slot and one script may touch them all.

use ratelimit_core::key::StoredKey;

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

/// The names of one client key's Redis keys, written into one reused buffer.
#[derive(Debug)]
pub(crate) struct KeyNames {
    buf: String,
    /// Length of `<prefix>:{<tag>}:`.
    base: usize,
}

/// The lowercase hex digits of `bytes`, two per byte.
pub(crate) fn hex_digits(bytes: &[u8]) -> impl Iterator<Item = u8> + '_ {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    bytes
        .iter()
        .flat_map(|b| [HEX[usize::from(b >> 4)], HEX[usize::from(b & 15)]])
}

impl KeyNames {
    pub(crate) fn new(prefix: &str, key: &[u8]) -> Self {
        let held = StoredKey::new(key);
        let (letter, bytes) = match &held {
            StoredKey::Inline(key) => ('k', *key),
            StoredKey::Digest(digest) => ('d', &digest[..]),
        };
        let mut buf = String::with_capacity(prefix.len() + 2 * bytes.len() + 24);
        buf.push_str(prefix);
        buf.push_str(":{");
        buf.push(letter);
        buf.extend(hex_digits(bytes).map(char::from));
        buf.push_str("}:");
        let base = buf.len();
        Self { buf, base }
    }

    fn with(&mut self, kind: &str) -> &str {
        self.buf.truncate(self.base);
        self.buf.push_str(kind);
        &self.buf
    }

    /// The block marker of the client key (string).
    pub(crate) fn block(&mut self) -> &str {
        self.with("b")
    }

    /// The rule state of the client key, every rule's by its identity (string).
    pub(crate) fn state(&mut self) -> &str {
        self.with("s")
    }

    /// The sliding log of the client key, shared by every sliding-log rule (list).
    pub(crate) fn log(&mut self) -> &str {
        self.with("l")
    }
}

/// The record of a call decided once on the Lua functions (check.lua's `once`), beside
/// the state key `state` of the call's first client key, so in its slot:
/// `<prefix>:{<tag>}:r<the call's id in 32 hex digits>` (`hex_id`, as the call sends
/// it, flag byte and all). It expires with the keep the call sets; no other name of the
/// store ends in `:r` and hex digits.
pub(crate) fn record_name(state: &str, hex_id: &[u8]) -> String {
    let base = state.strip_suffix('s').unwrap_or(state);
    let hex = hex_id.get(..32).unwrap_or(hex_id);
    let mut name = String::with_capacity(base.len() + 1 + hex.len());
    name.push_str(base);
    name.push('r');
    name.push_str(&String::from_utf8_lossy(hex));
    name
}

/// The Redis Cluster slot of the key `name`: CRC16 (XMODEM) of its hash tag (the text
/// between the first `{` and the next `}`, when not empty), else of the whole name.
pub(crate) fn key_slot(name: &[u8]) -> u16 {
    let tag = name
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &name[open + 1..];
            rest.iter()
                .position(|&b| b == b'}')
                .filter(|&close| close > 0)
                .map(|close| &rest[..close])
        })
        .unwrap_or(name);
    crc16::State::<crc16::XMODEM>::calculate(tag) % 16384
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(prefix: &str, key: &[u8]) -> [String; 3] {
        let mut n = KeyNames::new(prefix, key);
        [
            n.block().to_owned(),
            n.state().to_owned(),
            n.log().to_owned(),
        ]
    }

    #[test]
    fn a_record_shares_its_state_key_s_slot() {
        let mut names = KeyNames::new("rl", b"a{b}");
        let state = names.state().to_owned();
        let record = record_name(&state, &[&b"ab".repeat(16)[..], &[0]].concat());
        assert_eq!(record, format!("rl:{{k617b627d}}:r{}", "ab".repeat(16)));
        assert_eq!(key_slot(record.as_bytes()), key_slot(state.as_bytes()));
    }

    #[test]
    fn layout() {
        assert_eq!(
            all("rl", b"a{b}"),
            [
                "rl:{k617b627d}:b".to_owned(),
                "rl:{k617b627d}:s".to_owned(),
                "rl:{k617b627d}:l".to_owned(),
            ]
        );
        assert_eq!(KeyNames::new("rl", b"").block(), "rl:{k}:b");
    }

    #[test]
    fn long_keys_are_named_by_their_digest() {
        let long = vec![b'x'; 1 << 20];
        let [block, state, _] = all("rl", &long);
        let digest = StoredKey::new(&long);
        let hex: String = digest
            .as_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(block, format!("rl:{{d{hex}}}:b"));
        assert!(state.len() < 100, "{state}");
        // 64 bytes stay inline, 65 do not.
        assert!(all("rl", &[b'y'; 64])[0].starts_with("rl:{k"));
        assert!(all("rl", &[b'y'; 65])[0].starts_with("rl:{d"));
        // A 32-byte key equal to a digest's bytes is still another key.
        assert_ne!(all("rl", digest.as_bytes())[0], block);
    }

    #[test]
    fn distinct_client_keys_give_distinct_names() {
        let long = [b'z'; 100];
        let awkward: [&[u8]; 10] = [
            b"",
            b"a",
            b"a:b",
            b"a:",
            b":b",
            b"{a}",
            b"}",
            b"\r\n",
            b"\xff\x00",
            &long,
        ];
        let mut seen = std::collections::HashSet::new();
        for key in awkward {
            for name in all("rl", key) {
                assert!(name.starts_with("rl:{"), "{name}");
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

    #[test]
    fn slots_follow_redis_cluster_keyslot() {
        // The examples of the CLUSTER KEYSLOT documentation.
        assert_eq!(key_slot(b"somekey"), 11058);
        assert_eq!(key_slot(b"foo{hash_tag}"), 2515);
        assert_eq!(key_slot(b"{hash_tag}bar"), 2515);
        // An empty tag is no tag: the whole name counts.
        assert_ne!(key_slot(b"a{}b"), key_slot(b""));
        assert_eq!(
            key_slot(b"{}{x}"),
            crc16::State::<crc16::XMODEM>::calculate(b"{}{x}") % 16384
        );
    }
}
