//! The namespace that sets a layer's budgets apart, and the store-key prefix built from it.

use std::panic::Location;

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
        None => Ok(implicit(location)),
    }
}

/// `@` and 16 hex digits of the FNV-1a hash of `file:line:column`: the same in every
/// process running the same build, different for layers built in different places.
fn implicit(location: &Location<'_>) -> String {
    let site = format!(
        "{}:{}:{}",
        location.file(),
        location.line(),
        location.column()
    );
    format!("@{:016x}", fnv1a(site.as_bytes()))
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
        assert_eq!(implicit(site).len(), 17);
        assert!(matches!(
            resolve(Some(String::new()), site),
            Err(BuildError::BadNamespace(_))
        ));
        assert!(resolve(Some("x".repeat(256)), site).is_err());
        assert_eq!(resolve(Some("api".into()), site).unwrap(), "api");
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
