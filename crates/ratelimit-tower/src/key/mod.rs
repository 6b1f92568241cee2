//! Which client a request counts against: the [`KeyExtractor`] trait, what it answers
//! ([`Extraction`]: a key, a deliberate exemption, or no key found), and ready-made
//! extractors (peer IP, client IP behind trusted proxies, a header value, one global key).
//!
//! A request is always limited, exempt, or refused. A request without what the client
//! should send (a header) is the client's mistake: refused with 400 by default, or keyed
//! another way with [`or`](KeyExtractorExt::or). A request without what the server should
//! provide (a peer address, an extension an authentication layer sets) is a
//! misconfiguration: the layer follows its [`MissingKey`](crate::MissingKey) policy,
//! which refuses with 500 by default.
//!
//! Logs above `TRACE` never show a client key, only its [`log_digest`].

use std::borrow::Cow;
use std::fmt::{self, Write as _};

use http::Request;
use smallvec::SmallVec;

mod client_ip;
mod combinators;
mod forwarded;
mod header;
mod ip;
mod source;

pub use client_ip::{ClientIp, ForwardedHeader};
pub use combinators::{ExemptIf, KeyExtractorExt, Or};
pub use header::{GlobalKey, HeaderKey};
pub use ip::{KeyConfigError, PeerIp};
pub use source::{ClientKey, KeySource};

/// What a [`KeyExtractor`] found in a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Extraction<K> {
    /// Count the request against this key.
    Key(K),
    /// Deliberately not limited (an allow-listed network, a health check): passes without
    /// a store call and without rate-limit fields.
    Exempt,
    /// The client left out what the key is made of (a header): the client's mistake,
    /// answered with a client error (400 by default, see
    /// [`omitted_key_status`](crate::RateLimitLayerBuilder::omitted_key_status)). The text
    /// says what is missing; it goes into the response body.
    Omitted(Cow<'static, str>),
    /// The server did not provide what the key is made of: a misconfiguration (the app is
    /// served without peer addresses, an authentication layer runs after this one). The
    /// text says what is missing; it goes into the log and the 500 body.
    Missing(Cow<'static, str>),
}

/// Picks the key a request is counted against.
///
/// Implemented by the extractors of this module and by closures
/// `Fn(&Request<B>) -> Option<K>` (where `None` is "no key found", a misconfiguration)
/// or `Fn(&Request<B>) -> Extraction<K>` (to exempt requests deliberately), where `K` is
/// any owned byte string (`String`, `Vec<u8>`, `&'static str`, [`Key`]).
///
/// ```
/// use axum::body::Body;
/// use http::Request;
/// use ratelimit_tower::key::{Extraction, KeyExtractor};
///
/// // Limit per user id, set by an authentication layer that runs first.
/// #[derive(Clone)]
/// struct UserId(String);
/// let by_user = |req: &Request<Body>| req.extensions().get::<UserId>().map(|u| u.0.clone());
///
/// let mut req = Request::new(Body::empty());
/// assert!(matches!(by_user.extract(&req), Extraction::Missing(_)));
/// req.extensions_mut().insert(UserId("alice".into()));
/// assert_eq!(by_user.extract(&req), Extraction::Key("alice".to_string()));
/// ```
pub trait KeyExtractor<B>: Send + Sync + 'static {
    /// The key: any bytes, never interpreted (it may come from the client).
    type Key: AsRef<[u8]> + Send + Sync + 'static;

    /// The key for `req`, an exemption, or what is missing.
    fn extract(&self, req: &Request<B>) -> Extraction<Self::Key>;

    /// Which extractor found `key`, a key this extractor answered, and the key as that
    /// extractor found it: what a resolver of [limits per
    /// customer](crate::RateLimitLayerBuilder::limits_for) is handed. A combinator that
    /// tags its keys ([`or`](KeyExtractorExt::or)) takes its tag off here.
    ///
    /// [`KeySource::Other`] and the key as it is by default; an extractor of the
    /// application's may say more.
    fn source(&self, key: &[u8]) -> ClientKey {
        ClientKey::new(KeySource::Other, key)
    }
}

/// What a key-extracting closure may return: `Option<K>` (`None` is "no key found") or
/// [`Extraction<K>`].
pub trait IntoExtraction {
    /// The key type.
    type Key: AsRef<[u8]> + Send + Sync + 'static;

    /// The extraction this value stands for.
    fn into_extraction(self) -> Extraction<Self::Key>;
}

impl<K: AsRef<[u8]> + Send + Sync + 'static> IntoExtraction for Option<K> {
    type Key = K;

    fn into_extraction(self) -> Extraction<K> {
        match self {
            Some(key) => Extraction::Key(key),
            None => Extraction::Missing(Cow::Borrowed(
                "the key extractor found no key in the request (a closure answered `None`)",
            )),
        }
    }
}

impl<K: AsRef<[u8]> + Send + Sync + 'static> IntoExtraction for Extraction<K> {
    type Key = K;

    fn into_extraction(self) -> Extraction<K> {
        self
    }
}

impl<B, F, T> KeyExtractor<B> for F
where
    F: Fn(&Request<B>) -> T + Send + Sync + 'static,
    T: IntoExtraction,
{
    type Key = T::Key;

    fn extract(&self, req: &Request<B>) -> Extraction<T::Key> {
        self(req).into_extraction()
    }
}

/// A key as produced by the ready-made extractors: short keys (any IP address in text
/// form) are held inline, without allocating.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key(pub(crate) SmallVec<[u8; 48]>);

impl Key {
    /// The key's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl AsRef<[u8]> for Key {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl From<&[u8]> for Key {
    fn from(bytes: &[u8]) -> Self {
        Key(SmallVec::from_slice(bytes))
    }
}

impl From<&str> for Key {
    fn from(text: &str) -> Self {
        text.as_bytes().into()
    }
}

impl From<String> for Key {
    fn from(text: String) -> Self {
        text.into_bytes().into()
    }
}

impl From<Vec<u8>> for Key {
    fn from(bytes: Vec<u8>) -> Self {
        Key(SmallVec::from_vec(bytes))
    }
}

impl fmt::Write for Key {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        self.0.extend_from_slice(s.as_bytes());
        Ok(())
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&KeyDisplay(&self.0), f)
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({:?})", KeyDisplay(&self.0).to_string())
    }
}

/// What the layer's logs above `TRACE` show for the client key `client` (as the key
/// extractor gives it): `#` and 8 hex digits of its digest. The same key gives the same
/// text in every process, so an operator who knows a client's key can find its lines.
///
/// ```
/// use ratelimit_tower::key::log_digest;
///
/// let shown = log_digest(b"k-secret-123").to_string();
/// assert_eq!(shown.len(), 9);
/// assert!(!shown.contains("secret"));
/// ```
pub fn log_digest(client: &[u8]) -> impl fmt::Display + '_ {
    KeyDigest(client)
}

/// A client key in logs above `TRACE`: a short digest, computed only when the event is
/// recorded.
pub(crate) struct KeyDigest<'a>(pub(crate) &'a [u8]);

impl fmt::Display for KeyDigest<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let digest = ratelimit_core::key::digest(self.0);
        f.write_char('#')?;
        for b in &digest[..4] {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// Shows client-controlled bytes in logs without letting them forge log lines.
pub(crate) struct KeyDisplay<'a>(pub(crate) &'a [u8]);

impl fmt::Display for KeyDisplay<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for chunk in self.0.utf8_chunks() {
            for c in chunk.valid().chars() {
                if c.is_control() {
                    write!(f, "{}", c.escape_default())?;
                } else {
                    f.write_char(c)?;
                }
            }
            for b in chunk.invalid() {
                write!(f, "\\x{b:02x}")?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_display_escapes_control_bytes() {
        let k = Key::from(&b"a\nb\xff"[..]);
        assert_eq!(k.to_string(), "a\\nb\\xff");
    }

    #[test]
    fn closures_returning_none_report_a_missing_key() {
        let f = |_: &Request<()>| None::<String>;
        assert!(matches!(
            f.extract(&Request::new(())),
            Extraction::Missing(_)
        ));
        let g = |_: &Request<()>| Extraction::<&'static str>::Exempt;
        assert_eq!(g.extract(&Request::new(())), Extraction::Exempt);
    }
}
