//! Which extractor found a client key: [`KeySource`], and the key with it as a resolver
//! of limits per customer sees it ([`ClientKey`]).

use http::header::HeaderName;

/// The extractor that found a client key.
///
/// Behind [`or`](super::KeyExtractorExt::or) the bytes the layer counts against are
/// tagged with the extractor that produced them (so that a header value can never spend
/// an address's budget); the source tells them apart again, so that an address is never
/// looked up as an API key.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeySource {
    /// A [`HeaderKey`](super::HeaderKey): the value of this header.
    Header(HeaderName),
    /// A [`PeerIp`](super::PeerIp): the peer's address, or its network.
    PeerIp,
    /// A [`ClientIp`](super::ClientIp): the client's address behind trusted proxies, or
    /// its network.
    ClientIp,
    /// [`GlobalKey`](super::GlobalKey): one key for every request.
    Global,
    /// A closure or an extractor of the application's that does not say
    /// ([`KeyExtractor::source`](super::KeyExtractor::source)).
    Other,
}

/// A client key as a resolver of [limits per customer](crate::RateLimitLayerBuilder::limits_for)
/// is handed it: the bytes as the request carried them, and the extractor that found
/// them. Owned, so that the resolver's future may keep it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientKey {
    source: KeySource,
    key: Box<[u8]>,
}

impl ClientKey {
    /// A client key `key` found by `source`.
    pub fn new(source: KeySource, key: impl Into<Box<[u8]>>) -> Self {
        Self {
            source,
            key: key.into(),
        }
    }

    /// The extractor that found the key.
    pub fn source(&self) -> &KeySource {
        &self.source
    }

    /// The key's bytes, as the request carried them (a header's value, an address in
    /// text form).
    pub fn as_bytes(&self) -> &[u8] {
        &self.key
    }

    /// The key as text, when it is UTF-8.
    pub fn as_str(&self) -> Option<&str> {
        std::str::from_utf8(&self.key).ok()
    }

    /// The key's bytes when it is the value of the header `name` (compared without
    /// regard to case), else `None`: what a resolver of API keys looks up.
    ///
    /// ```
    /// use http::header::HeaderName;
    /// use ratelimit_tower::key::{ClientKey, KeySource};
    ///
    /// let api_key = ClientKey::new(KeySource::Header(HeaderName::from_static("x-api-key")), &b"acme"[..]);
    /// assert_eq!(api_key.header("x-api-key"), Some(&b"acme"[..]));
    /// let address = ClientKey::new(KeySource::PeerIp, &b"192.0.2.7"[..]);
    /// assert_eq!(address.header("x-api-key"), None);
    /// ```
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        match &self.source {
            KeySource::Header(header) if header.as_str().eq_ignore_ascii_case(name) => {
                Some(&self.key)
            }
            _ => None,
        }
    }

    /// The key's bytes, owned.
    pub fn into_bytes(self) -> Box<[u8]> {
        self.key
    }
}
