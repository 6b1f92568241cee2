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
    /// When `name` is not a valid lowercase header name (`"x api key"`, `"X-Api-Key"`);
    /// it is meant to be a literal, and the message names it. For a name read at run
    /// time, parse it and handle the error: `HeaderKey::from_name(name.parse()?)`
    /// ([`HeaderKey::from_name`]).
    pub fn new(name: &'static str) -> Self {
        match HeaderName::from_bytes(name.as_bytes()) {
            // `from_bytes` lowers the case; a literal written otherwise is refused, as
            // `HeaderName::from_static` refuses it, rather than keyed by another spelling.
            Ok(parsed) if parsed.as_str() == name => Self::from_name(parsed),
            Ok(parsed) => panic!(
                "HeaderKey::new({name:?}): header names are written in lowercase here: \
                 HeaderKey::new({:?})",
                parsed.as_str()
            ),
            Err(_) => panic!(
                "HeaderKey::new({name:?}): not a valid header name (a token: letters, digits \
                 and !#$%&'*+-.^_`|~, no spaces); for a name read at run time use \
                 HeaderKey::from_name(name.parse()?), which lets you handle the error"
            ),
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[should_panic(
        expected = "HeaderKey::new(\"x api key\"): not a valid header name (a token: letters, \
                    digits and !#$%&'*+-.^_`|~, no spaces); for a name read at run time use \
                    HeaderKey::from_name(name.parse()?)"
    )]
    fn an_invalid_name_panics_naming_it_and_from_name() {
        let _ = HeaderKey::new("x api key");
    }

    #[test]
    #[should_panic(
        expected = "HeaderKey::new(\"X-Api-Key\"): header names are written in lowercase here: \
                    HeaderKey::new(\"x-api-key\")"
    )]
    fn an_uppercase_name_panics_with_its_lowercase_spelling() {
        let _ = HeaderKey::new("X-Api-Key");
    }

    #[test]
    fn a_name_read_at_run_time_goes_through_from_name() {
        let read = String::from("x api key");
        assert!(read.parse::<HeaderName>().is_err());
        let read = String::from("x-api-key");
        let key = HeaderKey::from_name(read.parse().unwrap());
        let req = Request::builder()
            .header("x-api-key", "k-1")
            .body(())
            .unwrap();
        assert_eq!(key.extract(&req), Extraction::Key("k-1".into()));
        // A standard header's name too.
        let _ = HeaderKey::new("authorization");
    }
}
