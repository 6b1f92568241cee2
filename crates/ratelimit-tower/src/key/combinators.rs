//! Combinators on every extractor: [`ExemptIf`] (deliberate exemptions) and [`Or`] (a
//! fallback key).

use http::Request;
use smallvec::SmallVec;

use super::{ClientKey, Extraction, Key, KeyExtractor};

/// Combinators on every [`KeyExtractor`].
pub trait KeyExtractorExt<B>: KeyExtractor<B> + Sized {
    /// Exempts the requests for which `exempt` is true (health checks, internal callers)
    /// before asking this extractor: they pass without a store call and without fields.
    ///
    /// ```
    /// use axum::body::Body;
    /// use http::Request;
    /// use ratelimit_tower::key::{Extraction, HeaderKey, KeyExtractor, KeyExtractorExt};
    ///
    /// let key = HeaderKey::new("x-api-key").exempt_if(|req: &Request<Body>| req.uri().path() == "/health");
    /// let health = Request::get("/health").body(Body::empty()).unwrap();
    /// assert_eq!(key.extract(&health), Extraction::Exempt);
    /// // Anything else without the header is still a request without a key, not an
    /// // exemption.
    /// let other = Request::get("/orders").body(Body::empty()).unwrap();
    /// assert!(matches!(key.extract(&other), Extraction::Omitted(_)));
    /// ```
    fn exempt_if<F>(self, exempt: F) -> ExemptIf<Self, F>
    where
        F: Fn(&Request<B>) -> bool + Send + Sync + 'static,
    {
        ExemptIf {
            inner: self,
            exempt,
        }
    }

    /// Keys by `fallback` the requests in which this extractor finds no key
    /// ([`Omitted`](Extraction::Omitted) or [`Missing`](Extraction::Missing)): an API key
    /// when the client sends one, else the peer address. An exemption by this extractor
    /// stays an exemption; when neither finds a key, the fallback's answer counts.
    ///
    /// The two extractors' keys never meet: a key from this extractor is held as `0x00`
    /// and its bytes, one from `fallback` as `0x01` and its bytes, so a client cannot send
    /// a header value equal to someone's address and spend that address's budget. These
    /// tagged bytes are the client key [`RateLimitLayer::block`](crate::RateLimitLayer::block)
    /// and [`reset`](crate::RateLimitLayer::reset) take.
    ///
    /// ```
    /// use axum::body::Body;
    /// use http::Request;
    /// use ratelimit_tower::key::{Extraction, HeaderKey, KeyExtractor, KeyExtractorExt, PeerIp};
    /// use std::net::SocketAddr;
    ///
    /// let key = HeaderKey::new("x-api-key").or(PeerIp::new());
    /// let mut req = Request::get("/").body(Body::empty()).unwrap();
    /// let peer: SocketAddr = "192.0.2.7:4000".parse().unwrap();
    /// # #[cfg(feature = "axum")]
    /// req.extensions_mut().insert(axum::extract::ConnectInfo(peer));
    /// # #[cfg(not(feature = "axum"))]
    /// # req.extensions_mut().insert(peer);
    /// assert_eq!(key.extract(&req), Extraction::Key(b"\x01192.0.2.7"[..].into()));
    /// req.headers_mut().insert("x-api-key", "k-123".parse().unwrap());
    /// assert_eq!(key.extract(&req), Extraction::Key(b"\x00k-123"[..].into()));
    /// ```
    fn or<F: KeyExtractor<B>>(self, fallback: F) -> Or<Self, F> {
        Or {
            first: self,
            fallback,
        }
    }
}

impl<B, K: KeyExtractor<B>> KeyExtractorExt<B> for K {}

/// An extractor that exempts some requests first; made by
/// [`KeyExtractorExt::exempt_if`].
#[derive(Debug, Clone)]
pub struct ExemptIf<K, F> {
    inner: K,
    exempt: F,
}

impl<B, K, F> KeyExtractor<B> for ExemptIf<K, F>
where
    K: KeyExtractor<B>,
    F: Fn(&Request<B>) -> bool + Send + Sync + 'static,
{
    type Key = K::Key;

    fn extract(&self, req: &Request<B>) -> Extraction<K::Key> {
        if (self.exempt)(req) {
            return Extraction::Exempt;
        }
        self.inner.extract(req)
    }

    fn source(&self, key: &[u8]) -> ClientKey {
        self.inner.source(key)
    }
}

/// An extractor with a fallback; made by [`KeyExtractorExt::or`].
#[derive(Debug, Clone)]
pub struct Or<A, F> {
    first: A,
    fallback: F,
}

/// `or` as a method of the extractors themselves: they extract from requests of any body
/// type, so the trait method, generic over the body, would leave it to be inferred from
/// nothing. A closure extractor names its body type and takes the trait method.
macro_rules! fallback_method {
    ($([$($p:ident),*] $ty:ty;)*) => {$(
        impl<$($p),*> $ty {
            /// Keys by `fallback` the requests in which this extractor finds no key: see
            /// [`KeyExtractorExt::or`].
            pub fn or<Fb>(self, fallback: Fb) -> Or<Self, Fb> {
                Or {
                    first: self,
                    fallback,
                }
            }
        }
    )*};
}

fallback_method! {
    [] super::HeaderKey;
    [] super::PeerIp;
    [] super::ClientIp;
    [] super::GlobalKey;
    [A, F] Or<A, F>;
    [K, F] ExemptIf<K, F>;
}

impl<B, A, F> KeyExtractor<B> for Or<A, F>
where
    A: KeyExtractor<B>,
    F: KeyExtractor<B>,
{
    type Key = Key;

    fn extract(&self, req: &Request<B>) -> Extraction<Key> {
        match self.first.extract(req) {
            Extraction::Key(key) => Extraction::Key(tagged(0, key.as_ref())),
            Extraction::Exempt => Extraction::Exempt,
            Extraction::Omitted(_) | Extraction::Missing(_) => match self.fallback.extract(req) {
                Extraction::Key(key) => Extraction::Key(tagged(1, key.as_ref())),
                Extraction::Exempt => Extraction::Exempt,
                Extraction::Omitted(why) => Extraction::Omitted(why),
                Extraction::Missing(why) => Extraction::Missing(why),
            },
        }
    }

    fn source(&self, key: &[u8]) -> ClientKey {
        match key.split_first() {
            Some((0, key)) => self.first.source(key),
            Some((1, key)) => self.fallback.source(key),
            // Not a key of this extractor's: as it is.
            _ => ClientKey::new(super::KeySource::Other, key),
        }
    }
}

fn tagged(tag: u8, key: &[u8]) -> Key {
    let mut bytes = SmallVec::with_capacity(1 + key.len());
    bytes.push(tag);
    bytes.extend_from_slice(key);
    Key(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::{GlobalKey, HeaderKey};

    fn with_header(value: &str) -> Request<()> {
        Request::builder()
            .header("x-api-key", value)
            .body(())
            .unwrap()
    }

    #[test]
    fn or_falls_back_and_keeps_the_two_key_spaces_apart() {
        let key = HeaderKey::new("x-api-key").or(GlobalKey);
        assert_eq!(
            key.extract(&with_header("global")),
            Extraction::Key(Key::from(&b"\x00global"[..]))
        );
        assert_eq!(
            key.extract(&Request::new(())),
            Extraction::Key(Key::from(&b"\x01global"[..]))
        );
    }

    #[test]
    fn or_keeps_exemptions_and_reports_the_fallbacks_reason() {
        let exempt = |_: &Request<()>| Extraction::<&'static str>::Exempt;
        let header = HeaderKey::new("x-api-key");
        assert_eq!(
            exempt.or(GlobalKey).extract(&Request::new(())),
            Extraction::Exempt
        );
        let none = |_: &Request<()>| None::<String>;
        assert!(matches!(
            none.or(header.clone()).extract(&Request::new(())),
            Extraction::Omitted(_)
        ));
        assert!(matches!(
            header.or(none).extract(&Request::new(())),
            Extraction::Missing(_)
        ));
    }
}
