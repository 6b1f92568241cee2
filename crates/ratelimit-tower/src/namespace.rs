//! The namespace that sets a layer's budgets apart, and the store-key prefix built from it.

use std::collections::HashMap;
use std::panic::Location;

use parking_lot::Mutex;
use ratelimit_core::util::fnv1a;

use crate::error::BuildError;

/// The namespace given to the builder, checked, or else the one derived from where the
/// layer is built.
pub(crate) fn resolve(
    given: Option<String>,
    location: &Location<'_>,
) -> Result<String, BuildError> {
    match given {
        Some(ns) if ns.is_empty() || ns.len() > 255 => Err(BuildError::BadNamespace(ns)),
        Some(ns) => Ok(ns),
        None => claim(implicit(location), location),
    }
}

/// The characters of an implicit namespace, 6 bits each (base64url's alphabet).
const DIGITS: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";

/// The bits of the call site's hash an implicit namespace carries.
const IMPLICIT_BITS: u32 = 30;

/// `@` and 5 characters for 30 bits of the FNV-1a hash of `file:line:column`: the same in
/// every process running the same build, different for layers built in different places.
///
/// Six bytes, so that the store key of the default tier, `[6] @xxxxx [0]` and an IPv4
/// address of up to 15 characters, is at most 23 bytes: what `MemoryStore` holds in the
/// key's entry without an allocation ([`ratelimit_core::MEMORY_INLINE_KEY_LEN`]).
fn implicit(location: &Location<'_>) -> String {
    let site = format!(
        "{}:{}:{}",
        location.file(),
        location.line(),
        location.column()
    );
    let bits = site_bits(&site);
    let mut ns = String::with_capacity(6);
    ns.push('@');
    for digit in (0..IMPLICIT_BITS / 6).rev() {
        ns.push(char::from(DIGITS[((bits >> (6 * digit)) & 63) as usize]));
    }
    ns
}

/// 30 bits of the FNV-1a hash of a call site, folded so that every bit of the hash counts.
fn site_bits(site: &str) -> u32 {
    let hash = fnv1a(site.as_bytes());
    let folded = hash ^ (hash >> IMPLICIT_BITS) ^ (hash >> (2 * IMPLICIT_BITS));
    (folded & ((1 << IMPLICIT_BITS) - 1)) as u32
}

/// Refuses an implicit namespace that a layer built elsewhere in this process already
/// derived (two call sites whose hashes agree in 30 bits): their budgets would be one.
fn claim(namespace: String, location: &Location<'_>) -> Result<String, BuildError> {
    static CLAIMED: Mutex<Option<HashMap<String, String>>> = Mutex::new(None);
    let here = location.to_string();
    let mut claimed = CLAIMED.lock();
    let owner = claimed
        .get_or_insert_with(HashMap::new)
        .entry(namespace.clone())
        .or_insert_with(|| here.clone());
    if *owner != here {
        return Err(BuildError::ImplicitNamespaceClash {
            namespace,
            here,
            other: owner.clone(),
        });
    }
    Ok(namespace)
}

/// Warns that a layer on a store shared across processes has a namespace derived from
/// where it is built: a deploy that moves that line renames every budget of the layer.
pub(crate) fn warn_implicit(location: &Location<'_>) {
    tracing::warn!(
        location = %location,
        "rate-limit layer built at {location} on a store shared across processes without \
         `.namespace(..)`: its budgets are named by this source location, so a deploy that \
         moves the line starts every client afresh; name them with \
         `RateLimitLayer::builder(store, key).namespace(\"...\")`"
    );
}

/// `[len(namespace)] namespace [len(tier)] tier`, prepended to every client key.
///
/// Length-prefixed, so that no two (namespace, tier, client key) triples give the same
/// bytes: the namespace and tier names are at most 255 bytes (checked when the layer is
/// built).
pub(crate) fn key_prefix(namespace: &str, tier: &str) -> Box<[u8]> {
    let mut prefix = Vec::with_capacity(2 + namespace.len() + tier.len());
    prefix.push(u8::try_from(namespace.len()).expect("checked at build"));
    prefix.extend_from_slice(namespace.as_bytes());
    prefix.push(u8::try_from(tier.len()).expect("checked at build"));
    prefix.extend_from_slice(tier.as_bytes());
    prefix.into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn implicit_namespaces_are_stable_per_call_site() {
        let site = Location::caller();
        assert_eq!(implicit(site), implicit(site));
        assert_eq!(implicit(site).len(), 6);
        assert!(implicit(site).starts_with('@'));
        assert_eq!(resolve(None, site), resolve(None, site));
        assert!(matches!(
            resolve(Some(String::new()), site),
            Err(BuildError::BadNamespace(_))
        ));
        assert!(resolve(Some("x".repeat(256)), site).is_err());
        assert_eq!(resolve(Some("api".into()), site).unwrap(), "api");
    }

    #[test]
    fn the_default_tiers_store_key_of_any_ipv4_client_is_held_inline() {
        let prefix = key_prefix(&implicit(Location::caller()), "");
        assert!(
            prefix.len() + "255.255.255.255".len() <= ratelimit_core::MEMORY_INLINE_KEY_LEN,
            "{prefix:?}"
        );
    }

    #[test]
    fn call_sites_that_hash_alike_are_refused() {
        let a = Location::caller();
        let b = Location::caller();
        let clash = format!("@{}", "Zz9_-"); // claimed for `a`, then asked for by `b`
        assert_eq!(claim(clash.clone(), a), Ok(clash.clone()));
        assert_eq!(claim(clash.clone(), a), Ok(clash.clone()));
        let err = claim(clash.clone(), b).unwrap_err();
        assert_eq!(
            err,
            BuildError::ImplicitNamespaceClash {
                namespace: clash,
                here: b.to_string(),
                other: a.to_string(),
            }
        );
        assert!(err.to_string().contains(".namespace("), "{err}");
    }

    #[test]
    fn implicit_namespaces_spread_over_their_bits() {
        // 20,000 call sites in one file: a 30-bit namespace makes a clash among them
        // unlikely (about 0.2), and many clashes would mean bits that do not vary.
        let mut seen = std::collections::HashSet::new();
        let mut clashes = 0;
        for line in 0..20_000u32 {
            clashes += usize::from(!seen.insert(site_bits(&format!("src/main.rs:{line}:5"))));
        }
        assert!(clashes <= 3, "{clashes} clashes");
    }

    #[test]
    fn prefixes_keep_namespaces_tiers_and_keys_apart() {
        // Without lengths, ("ab", "", "c") and ("a", "b", "c") would both read "abc".
        let a = key_prefix("ab", "");
        let b = key_prefix("a", "b");
        assert_ne!([&a[..], b"c"].concat(), [&b[..], b"c"].concat());
        assert_eq!(&*key_prefix("ns", "pro"), b"\x02ns\x03pro");
    }
}
