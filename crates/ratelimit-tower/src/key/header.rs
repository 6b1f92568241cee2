//! [`HeaderKey`] and [`GlobalKey`].

use std::borrow::Cow;

use http::header::HeaderName;
use http::Request;

use super::{ClientKey, Extraction, Key, KeyExtractor, KeySource};

/// Keys requests by the value of a header, such as an API key. A request without the
/// header (or with an empty one) is the client's omission ([`Extraction::Omitted`]):
/// answered 400 by default (see
/// [`omitted_key_status`](crate::RateLimitLayerBuilder::omitted_key_status)), or keyed
/// another way with [`or`](super::KeyExtractorExt::or), e.g.
/// `HeaderKey::new("x-api-key").or(PeerIp::new())`.
///
/// ```
/// use axum::body::Body;
/// use http::Request;
/// use ratelimit_tower::key::{Extraction, HeaderKey, KeyExtractor};
///
/// let key = HeaderKey::new("x-api-key");
/// let req = Request::builder().header("x-api-key", "k-123").body(Body::empty()).unwrap();
/// assert_eq!(key.extract(&req), Extraction::Key("k-123".into()));
/// assert!(matches!(key.extract(&Request::new(Body::empty())), Extraction::Omitted(_)));
/// ```
#[derive(Debug, Clone)]
pub struct HeaderKey {
    name: HeaderName,
    missing: Cow<'static, str>,
}

impl HeaderKey {
    /// Keys by the header `name`.
    ///
    /// # Panics
    ///
    /// When `name` is not a valid lowercase header name; it is meant to be a literal. Use
    /// [`HeaderKey::from_name`] for names read at run time.
    pub fn new(name: &'static str) -> Self {
        Self::from_name(HeaderName::from_static(name))
    }

    /// Keys by the header `name`.
    pub fn from_name(name: HeaderName) -> Self {
        let missing = format!("the request has no `{name}` header");
        Self {
            name,
            missing: Cow::Owned(missing),
        }
    }
}

impl<B> KeyExtractor<B> for HeaderKey {
    type Key = Key;

    fn extract(&self, req: &Request<B>) -> Extraction<Key> {
        match req.headers().get(&self.name).map(|v| v.as_bytes()) {
            Some(value) if !value.is_empty() => Extraction::Key(value.into()),
            _ => Extraction::Omitted(self.missing.clone()),
        }
    }

    fn source(&self, key: &[u8]) -> ClientKey {
        ClientKey::new(KeySource::Header(self.name.clone()), key)
    }
}

/// One key for every request: a limit on the service as a whole.
///
/// ```
/// use axum::body::Body;
/// use http::Request;
/// use ratelimit_tower::key::{Extraction, GlobalKey, KeyExtractor};
///
/// assert_eq!(GlobalKey.extract(&Request::new(Body::empty())), Extraction::Key("global"));
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct GlobalKey;

impl<B> KeyExtractor<B> for GlobalKey {
    type Key = &'static str;

    fn extract(&self, _: &Request<B>) -> Extraction<&'static str> {
        Extraction::Key("global")
    }

    fn source(&self, key: &[u8]) -> ClientKey {
        ClientKey::new(KeySource::Global, key)
    }
}
