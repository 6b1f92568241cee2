//! [`ExemptIf`]: deliberate exemptions on top of any extractor.

use http::Request;

use super::{Extraction, KeyExtractor};

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
    /// // Anything else without the header is still a missing key, not an exemption.
    /// let other = Request::get("/orders").body(Body::empty()).unwrap();
    /// assert!(matches!(key.extract(&other), Extraction::Missing(_)));
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
}
