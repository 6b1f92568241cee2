//! How a client key is held by a store: as itself when short, as a digest when long.
//!
//! A client key is whatever the application extracts from a request: an address, an API
//! key, a header value. The client chooses its bytes and its length, so a store that kept
//! every key verbatim would let one client spend memory (or Redis key-name bytes) in
//! proportion to what it sends. Every store therefore holds a key through [`StoredKey`]:
//!
//! * keys of at most [`MAX_INLINE_KEY_LEN`] bytes are held as they are;
//! * longer keys are held as their 32-byte BLAKE3 digest (derived with a context string of
//!   this crate, so the digest of a key is not the plain BLAKE3 hash of it).
//!
//! BLAKE3 is collision resistant: an attacker who picks keys cannot make two long keys
//! share a state, as they could with a 64-bit hash. Short keys and digests are
//! distinguished by the variant, never by their bytes, so a short key equal to some
//! digest's bytes is still a different key. Every store uses this one mapping, so one
//! client maps to one state wherever its state lives.
//!
//! ```
//! use ratelimit_core::key::{StoredKey, MAX_INLINE_KEY_LEN};
//!
//! assert_eq!(StoredKey::new(b"203.0.113.9"), StoredKey::Inline(b"203.0.113.9"));
//!
//! let long = vec![b'x'; 64 * 1024];
//! let held = StoredKey::new(&long);
//! assert!(matches!(held, StoredKey::Digest(_)));
//! assert!(held.as_bytes().len() <= MAX_INLINE_KEY_LEN);
//! // The same long key always maps to the same digest.
//! assert_eq!(held, StoredKey::new(&long));
//! ```

/// Keys up to this many bytes are held verbatim; longer ones as a [`DIGEST_LEN`]-byte
/// digest.
pub const MAX_INLINE_KEY_LEN: usize = 64;

/// Length of the digest that stands for a long key.
pub const DIGEST_LEN: usize = 32;

/// Domain separation for the key digest: changing it would move every long key's state.
const DIGEST_CONTEXT: &str = "ratelimit 2026-11 client key digest v1";

/// A client key as a store holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StoredKey<'a> {
    /// A key of at most [`MAX_INLINE_KEY_LEN`] bytes, held as it is.
    Inline(&'a [u8]),
    /// The digest of a key longer than [`MAX_INLINE_KEY_LEN`] bytes.
    Digest([u8; DIGEST_LEN]),
}

impl<'a> StoredKey<'a> {
    /// Maps a client key to the form every store holds it in.
    #[must_use]
    #[inline]
    pub fn new(key: &'a [u8]) -> Self {
        if key.len() <= MAX_INLINE_KEY_LEN {
            StoredKey::Inline(key)
        } else {
            StoredKey::Digest(digest(key))
        }
    }

    /// The held bytes: the key itself, or its digest. Two different keys can give equal
    /// bytes (a short key that equals a digest); compare [`StoredKey`]s, or keep the
    /// variant beside the bytes, to tell them apart.
    #[must_use]
    #[inline]
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            StoredKey::Inline(key) => key,
            StoredKey::Digest(digest) => digest,
        }
    }

    /// Whether this is the digest of a long key.
    #[must_use]
    #[inline]
    pub fn is_digest(&self) -> bool {
        matches!(self, StoredKey::Digest(_))
    }
}

/// The digest that stands for a long key, whatever its length.
#[must_use]
pub fn digest(key: &[u8]) -> [u8; DIGEST_LEN] {
    let mut hasher = blake3::Hasher::new_derive_key(DIGEST_CONTEXT);
    hasher.update(key);
    *hasher.finalize().as_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threshold_is_inclusive() {
        let at = [7u8; MAX_INLINE_KEY_LEN];
        let over = [7u8; MAX_INLINE_KEY_LEN + 1];
        assert_eq!(StoredKey::new(&at), StoredKey::Inline(&at));
        assert!(StoredKey::new(&over).is_digest());
    }

    #[test]
    fn digest_is_keyed_and_stable() {
        let key = [b'a'; 100];
        // Not the plain BLAKE3 hash: the context string separates it.
        assert_ne!(digest(&key), *blake3::hash(&key).as_bytes());
        // A fixed vector (also what the Python `blake3` package gives with this context),
        // so a change of context or algorithm (which would move every long
        // key's state in a running fleet) cannot pass unnoticed.
        let hex: String = digest(&key).iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, EXPECTED_DIGEST_OF_100_A);
    }

    #[test]
    fn a_short_key_equal_to_a_digest_is_another_key() {
        let long = [b'z'; 200];
        let d = digest(&long);
        assert_ne!(StoredKey::new(&d), StoredKey::new(&long));
        assert_eq!(
            StoredKey::new(&d).as_bytes(),
            StoredKey::new(&long).as_bytes()
        );
    }

    const EXPECTED_DIGEST_OF_100_A: &str =
        "b815d025993c8bfe3ed852e98fffdf4ff3b8072395084547f290daa296784683";
}
