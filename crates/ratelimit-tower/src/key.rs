//! Which client a request counts against: the [`KeyExtractor`] trait and ready-made
//! extractors (peer IP, client IP behind trusted proxies, a header value, one global key).

use std::fmt::{self, Write as _};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use http::header::{HeaderName, FORWARDED};
use http::Request;
use ipnet::IpNet;
use smallvec::SmallVec;

/// Picks the key a request is counted against; `None` means the request is not limited
/// by this layer.
///
/// Implemented for closures `Fn(&Request<B>) -> Option<K>` where `K` is any owned byte
/// string (`String`, `Vec<u8>`, `&'static str`, [`Key`]), and by the extractors of this
/// module.
///
/// ```
/// use axum::body::Body;
/// use http::Request;
/// use ratelimit_tower::KeyExtractor;
///
/// // Limit per user id, set by an authentication layer that runs first.
/// #[derive(Clone)]
/// struct UserId(String);
/// let by_user = |req: &Request<Body>| req.extensions().get::<UserId>().map(|u| u.0.clone());
///
/// let mut req = Request::new(Body::empty());
/// assert_eq!(by_user.extract(&req), None);
/// req.extensions_mut().insert(UserId("alice".into()));
/// assert_eq!(by_user.extract(&req).as_deref(), Some("alice"));
/// ```
pub trait KeyExtractor<B>: Send + Sync + 'static {
    /// The key: any bytes, never interpreted (it may come from the client).
    type Key: AsRef<[u8]> + Send + Sync + 'static;

    /// The key for `req`, or `None` to let the request through unlimited.
    fn extract(&self, req: &Request<B>) -> Option<Self::Key>;
}

impl<B, F, K> KeyExtractor<B> for F
where
    F: Fn(&Request<B>) -> Option<K> + Send + Sync + 'static,
    K: AsRef<[u8]> + Send + Sync + 'static,
{
    type Key = K;

    fn extract(&self, req: &Request<B>) -> Option<K> {
        self(req)
    }
}

/// A key as produced by the ready-made extractors: short keys (any IP address in text
/// form) are held inline, without allocating.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key(SmallVec<[u8; 48]>);

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

/// An extractor or trusted-proxy list that cannot be built, with what to change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyConfigError {
    /// A trusted proxy entry is neither an IP address nor a CIDR network.
    #[error(
        "trusted proxy {0:?} is not an IP address or CIDR network; write e.g. `10.0.0.0/8`, \
         `192.0.2.7` or `fd00::/8`"
    )]
    BadProxy(String),
    /// A prefix length beyond the address size.
    #[error("{family} prefix length must be between 1 and {max} (got {got})")]
    BadPrefix {
        /// `IPv4` or `IPv6`.
        family: &'static str,
        /// The prefix asked for.
        got: u8,
        /// The address size in bits.
        max: u8,
    },
}

/// How addresses are grouped into keys: an IPv6 client usually holds a whole /64 (or
/// more), so limiting single IPv6 addresses would let it rotate through 2^64 keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Grouping {
    v4_prefix: u8,
    v6_prefix: u8,
}

impl Default for Grouping {
    fn default() -> Self {
        Grouping {
            v4_prefix: 32,
            v6_prefix: 64,
        }
    }
}

impl Grouping {
    fn v6(mut self, prefix: u8) -> Result<Self, KeyConfigError> {
        if prefix == 0 || prefix > 128 {
            return Err(KeyConfigError::BadPrefix {
                family: "IPv6",
                got: prefix,
                max: 128,
            });
        }
        self.v6_prefix = prefix;
        Ok(self)
    }

    fn v4(mut self, prefix: u8) -> Result<Self, KeyConfigError> {
        if prefix == 0 || prefix > 32 {
            return Err(KeyConfigError::BadPrefix {
                family: "IPv4",
                got: prefix,
                max: 32,
            });
        }
        self.v4_prefix = prefix;
        Ok(self)
    }

    /// `203.0.113.7`, `203.0.113.0/24`, `2001:db8:1:2::/64`; an IPv4-mapped IPv6 address
    /// counts as the IPv4 address it carries.
    fn key(self, ip: IpAddr) -> Key {
        let mut key = Key(SmallVec::new());
        // Writing into a Key cannot fail.
        let _ = match ip.to_canonical() {
            IpAddr::V4(v4) if self.v4_prefix == 32 => {
                // By hand into one buffer: `Display` for addresses is slow, and this runs
                // per request.
                let mut text = [0u8; 15];
                let mut len = 0;
                for (i, octet) in v4.octets().into_iter().enumerate() {
                    if i > 0 {
                        text[len] = b'.';
                        len += 1;
                    }
                    if octet >= 100 {
                        text[len] = b'0' + octet / 100;
                        len += 1;
                    }
                    if octet >= 10 {
                        text[len] = b'0' + octet / 10 % 10;
                        len += 1;
                    }
                    text[len] = b'0' + octet % 10;
                    len += 1;
                }
                key.0.extend_from_slice(&text[..len]);
                Ok(())
            }
            IpAddr::V4(v4) => {
                let mask = u32::MAX << (32 - self.v4_prefix);
                let net = Ipv4Addr::from(u32::from(v4) & mask);
                write!(key, "{net}/{}", self.v4_prefix)
            }
            IpAddr::V6(v6) if self.v6_prefix == 128 => write!(key, "{v6}"),
            IpAddr::V6(v6) => {
                let mask = u128::MAX << (128 - self.v6_prefix);
                let net = Ipv6Addr::from(u128::from(v6) & mask);
                write!(key, "{net}/{}", self.v6_prefix)
            }
        };
        key
    }
}

static WARNED_NO_PEER: AtomicBool = AtomicBool::new(false);

fn peer_ip<B>(req: &Request<B>) -> Option<IpAddr> {
    #[cfg(feature = "axum")]
    if let Some(info) = req
        .extensions()
        .get::<axum::extract::ConnectInfo<SocketAddr>>()
    {
        return Some(info.0.ip());
    }
    let found = req.extensions().get::<SocketAddr>().map(SocketAddr::ip);
    if found.is_none() && !WARNED_NO_PEER.swap(true, Ordering::Relaxed) {
        // Without the peer address nothing is limited: say so once, loudly.
        tracing::error!(
            "rate limiting by IP, but the request carries no peer address; serve the app with \
             `into_make_service_with_connect_info::<SocketAddr>()` (axum) or insert the \
             `SocketAddr` into the request extensions; these requests are not limited"
        );
    }
    found
}

/// Keys requests by the address of the immediate peer (the TCP connection), IPv6 grouped
/// by /64.
///
/// With axum, serve the router with
/// `into_make_service_with_connect_info::<SocketAddr>()`; other servers insert the peer's
/// `SocketAddr` into the request extensions. A request without either is not limited
/// (and an error is logged once). Behind a reverse proxy every client has the proxy's
/// address: use [`ClientIp`] there.
///
/// ```
/// use axum::body::Body;
/// use http::Request;
/// use ratelimit_tower::{KeyExtractor, PeerIp};
///
/// let mut req = Request::new(Body::empty());
/// req.extensions_mut().insert("[2001:db8:1:2:aaaa::1]:4711".parse::<std::net::SocketAddr>().unwrap());
/// let key = PeerIp::new().extract(&req).unwrap();
/// assert_eq!(key.to_string(), "2001:db8:1:2::/64");
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct PeerIp {
    grouping: Grouping,
}

impl PeerIp {
    /// Keys by peer address; IPv4 addresses whole, IPv6 by /64.
    pub fn new() -> Self {
        Self::default()
    }

    /// Groups IPv6 addresses by their first `prefix` bits (1..=128; 128 keys each address).
    pub fn ipv6_prefix(self, prefix: u8) -> Result<Self, KeyConfigError> {
        Ok(Self {
            grouping: self.grouping.v6(prefix)?,
        })
    }

    /// Groups IPv4 addresses by their first `prefix` bits (1..=32; 32 by default).
    pub fn ipv4_prefix(self, prefix: u8) -> Result<Self, KeyConfigError> {
        Ok(Self {
            grouping: self.grouping.v4(prefix)?,
        })
    }
}

impl<B> KeyExtractor<B> for PeerIp {
    type Key = Key;

    fn extract(&self, req: &Request<B>) -> Option<Key> {
        peer_ip(req).map(|ip| self.grouping.key(ip))
    }
}

/// Which header trusted proxies write the client chain into.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ForwardedHeader {
    /// `X-Forwarded-For: client, proxy1, proxy2` (the default).
    #[default]
    XForwardedFor,
    /// RFC 7239 `Forwarded: for=client, for="[2001:db8::1]:4711"`.
    Forwarded,
}

/// Keys requests by the client address as reported by trusted reverse proxies.
///
/// The forwarding header is read only when the immediate peer is a trusted proxy, and
/// then from the right: each trusted hop is skipped and the first untrusted address is
/// the client. The leftmost entries are whatever the client sent and are never believed.
/// Only one header is read ([`ForwardedHeader`], `X-Forwarded-For` by default): the one
/// your proxies write. Reading a second one that they merely pass through would let
/// clients choose their own key.
///
/// ```
/// use axum::body::Body;
/// use http::Request;
/// use ratelimit_tower::{ClientIp, KeyExtractor};
/// use std::net::SocketAddr;
///
/// let key = ClientIp::trusting(["10.0.0.0/8"]).unwrap();
///
/// // Through the load balancer 10.0.0.2: the client spoofed the first entry.
/// let mut req = Request::builder()
///     .header("x-forwarded-for", "1.1.1.1, 198.51.100.7, 10.0.0.3")
///     .body(Body::empty())
///     .unwrap();
/// req.extensions_mut().insert("10.0.0.2:1234".parse::<SocketAddr>().unwrap());
/// assert_eq!(key.extract(&req).unwrap().to_string(), "198.51.100.7");
///
/// // Straight from the internet: the header is ignored.
/// req.extensions_mut().insert("203.0.113.9:1234".parse::<SocketAddr>().unwrap());
/// assert_eq!(key.extract(&req).unwrap().to_string(), "203.0.113.9");
/// ```
#[derive(Debug, Clone)]
pub struct ClientIp {
    trusted: Arc<[IpNet]>,
    header: ForwardedHeader,
    grouping: Grouping,
}

fn parse_net(text: &str) -> Option<IpNet> {
    let text = text.trim();
    text.parse::<IpNet>()
        .ok()
        .or_else(|| text.parse::<IpAddr>().ok().map(IpNet::from))
        .map(|net| match net {
            // Match IPv4-mapped peers against IPv4 networks.
            IpNet::V6(v6) if v6.addr().to_ipv4_mapped().is_some() && v6.prefix_len() >= 96 => {
                let v4 = v6.addr().to_ipv4_mapped().expect("checked above");
                IpNet::V4(ipnet::Ipv4Net::new(v4, v6.prefix_len() - 96).expect("<= 32"))
            }
            other => other.trunc(),
        })
}

impl ClientIp {
    /// Trusts the proxies in `proxies` (addresses or CIDR networks, e.g. `10.0.0.0/8`,
    /// `::1`); fails on the first entry that is neither.
    pub fn trusting<I, T>(proxies: I) -> Result<Self, KeyConfigError>
    where
        I: IntoIterator<Item = T>,
        T: AsRef<str>,
    {
        let trusted = proxies
            .into_iter()
            .map(|p| {
                parse_net(p.as_ref()).ok_or_else(|| KeyConfigError::BadProxy(p.as_ref().into()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            trusted: trusted.into(),
            header: ForwardedHeader::default(),
            grouping: Grouping::default(),
        })
    }

    /// Reads `header` instead of `X-Forwarded-For`.
    #[must_use]
    pub fn header(mut self, header: ForwardedHeader) -> Self {
        self.header = header;
        self
    }

    /// Groups IPv6 addresses by their first `prefix` bits (1..=128; 64 by default).
    pub fn ipv6_prefix(mut self, prefix: u8) -> Result<Self, KeyConfigError> {
        self.grouping = self.grouping.v6(prefix)?;
        Ok(self)
    }

    /// Groups IPv4 addresses by their first `prefix` bits (1..=32; 32 by default).
    pub fn ipv4_prefix(mut self, prefix: u8) -> Result<Self, KeyConfigError> {
        self.grouping = self.grouping.v4(prefix)?;
        Ok(self)
    }

    fn is_trusted(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        self.trusted.iter().any(|net| net.contains(&ip))
    }

    /// The client address of `req`: the peer when it is not a trusted proxy, otherwise the
    /// rightmost untrusted hop of the forwarding header.
    pub fn client_ip<B>(&self, req: &Request<B>) -> Option<IpAddr> {
        let peer = peer_ip(req)?;
        if !self.is_trusted(peer) {
            return Some(peer);
        }
        let mut client = peer;
        let mut hops: SmallVec<[&str; 8]> = SmallVec::new();
        match self.header {
            ForwardedHeader::XForwardedFor => {
                for value in req.headers().get_all(&X_FORWARDED_FOR) {
                    let Ok(value) = value.to_str() else {
                        // An unreadable line: trust nothing to the left of the proxies.
                        hops.clear();
                        continue;
                    };
                    hops.extend(value.split(','));
                }
            }
            ForwardedHeader::Forwarded => {
                for value in req.headers().get_all(FORWARDED) {
                    let Ok(value) = value.to_str() else {
                        hops.clear();
                        continue;
                    };
                    hops.extend(split_unquoted(value, ',').map(forwarded_for));
                }
            }
        }
        for hop in hops.iter().rev() {
            match parse_hop(hop) {
                Some(ip) => {
                    client = ip;
                    if !self.is_trusted(ip) {
                        return Some(ip);
                    }
                }
                // An obfuscated or garbled hop: the last address we could vouch for is
                // the best that is known.
                None => return Some(client),
            }
        }
        Some(client)
    }
}

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// Splits on `sep` outside double quotes.
fn split_unquoted(text: &str, sep: char) -> impl Iterator<Item = &str> {
    let mut quoted = false;
    let mut escaped = false;
    text.split(move |c: char| {
        if escaped {
            escaped = false;
            return false;
        }
        match c {
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            c if c == sep && !quoted => return true,
            _ => {}
        }
        false
    })
}

/// The `for=` parameter of one `Forwarded` element, or "" when it has none.
fn forwarded_for(element: &str) -> &str {
    split_unquoted(element, ';')
        .filter_map(|pair| pair.split_once('='))
        .find(|(name, _)| name.trim().eq_ignore_ascii_case("for"))
        .map_or("", |(_, value)| value.trim().trim_matches('"'))
}

/// `192.0.2.1`, `192.0.2.1:80`, `2001:db8::1`, `[2001:db8::1]`, `[2001:db8::1]:80`.
fn parse_hop(hop: &str) -> Option<IpAddr> {
    let hop = hop.trim();
    if let Ok(ip) = hop.parse::<IpAddr>() {
        return Some(ip);
    }
    if let Ok(sock) = hop.parse::<SocketAddr>() {
        return Some(sock.ip());
    }
    hop.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .and_then(|h| h.parse::<Ipv6Addr>().ok())
        .map(IpAddr::V6)
}

impl<B> KeyExtractor<B> for ClientIp {
    type Key = Key;

    fn extract(&self, req: &Request<B>) -> Option<Key> {
        self.client_ip(req).map(|ip| self.grouping.key(ip))
    }
}

/// Keys requests by the value of a header, such as an API key; requests without it are
/// not limited by this layer.
///
/// ```
/// use axum::body::Body;
/// use http::Request;
/// use ratelimit_tower::{HeaderKey, KeyExtractor};
///
/// let key = HeaderKey::new("x-api-key");
/// let req = Request::builder().header("x-api-key", "k-123").body(Body::empty()).unwrap();
/// assert_eq!(key.extract(&req).unwrap().as_bytes(), b"k-123");
/// assert!(key.extract(&Request::new(Body::empty())).is_none());
/// ```
#[derive(Debug, Clone)]
pub struct HeaderKey {
    name: HeaderName,
}

impl HeaderKey {
    /// Keys by the header `name`.
    ///
    /// # Panics
    ///
    /// When `name` is not a valid header name; it is meant to be a literal. Use
    /// [`HeaderKey::from_name`] for names read at run time.
    pub fn new(name: &'static str) -> Self {
        Self {
            name: HeaderName::from_static(name),
        }
    }

    /// Keys by the header `name`.
    pub fn from_name(name: HeaderName) -> Self {
        Self { name }
    }
}

impl<B> KeyExtractor<B> for HeaderKey {
    type Key = Key;

    fn extract(&self, req: &Request<B>) -> Option<Key> {
        let value = req.headers().get(&self.name)?.as_bytes();
        (!value.is_empty()).then(|| value.into())
    }
}

/// One key for every request: a limit on the service as a whole.
///
/// ```
/// use axum::body::Body;
/// use http::Request;
/// use ratelimit_tower::{GlobalKey, KeyExtractor};
///
/// assert_eq!(GlobalKey.extract(&Request::new(Body::empty())), Some("global"));
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct GlobalKey;

impl<B> KeyExtractor<B> for GlobalKey {
    type Key = &'static str;

    fn extract(&self, _: &Request<B>) -> Option<&'static str> {
        Some("global")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(peer: &str, headers: &[(&str, &str)]) -> Request<()> {
        let mut b = Request::builder();
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        let mut r = b.body(()).unwrap();
        r.extensions_mut()
            .insert(peer.parse::<SocketAddr>().unwrap());
        r
    }

    #[test]
    fn ipv6_grouping_and_mapped_ipv4() {
        let k = PeerIp::new();
        let a = k.extract(&req("[2001:db8:1:2:aaaa::1]:1", &[])).unwrap();
        let b = k.extract(&req("[2001:db8:1:2:bbbb::9]:1", &[])).unwrap();
        let c = k.extract(&req("[2001:db8:1:3::1]:1", &[])).unwrap();
        assert_eq!(a, b);
        assert_ne!(a, c);
        let mapped = k.extract(&req("[::ffff:192.0.2.1]:1", &[])).unwrap();
        assert_eq!(mapped.to_string(), "192.0.2.1");
        for ip in ["0.0.0.0", "9.10.99.100", "255.255.255.255", "203.0.113.7"] {
            let key = k.extract(&req(&format!("{ip}:1"), &[])).unwrap();
            assert_eq!(key.to_string(), ip);
        }
        let k56 = PeerIp::new().ipv6_prefix(56).unwrap();
        assert_eq!(
            k56.extract(&req("[2001:db8:1:2ff::1]:1", &[]))
                .unwrap()
                .to_string(),
            "2001:db8:1:200::/56"
        );
        let full = PeerIp::new().ipv6_prefix(128).unwrap();
        assert_eq!(
            full.extract(&req("[2001:db8::1]:1", &[]))
                .unwrap()
                .to_string(),
            "2001:db8::1"
        );
        let v4 = PeerIp::new().ipv4_prefix(24).unwrap();
        assert_eq!(
            v4.extract(&req("192.0.2.77:1", &[])).unwrap().to_string(),
            "192.0.2.0/24"
        );
        assert!(PeerIp::new().ipv6_prefix(0).is_err());
        assert!(PeerIp::new().ipv6_prefix(129).is_err());
        assert!(PeerIp::new().ipv4_prefix(33).is_err());
    }

    #[test]
    fn no_peer_means_not_limited() {
        let r = Request::new(());
        assert!(PeerIp::new().extract(&r).is_none());
        assert!(ClientIp::trusting(["10.0.0.0/8"])
            .unwrap()
            .extract(&r)
            .is_none());
    }

    #[test]
    fn untrusted_peer_ignores_forwarding_headers() {
        let k = ClientIp::trusting(["10.0.0.0/8"]).unwrap();
        let r = req("203.0.113.5:9", &[("x-forwarded-for", "1.2.3.4")]);
        assert_eq!(k.client_ip(&r), Some("203.0.113.5".parse().unwrap()));
        let k = k.header(ForwardedHeader::Forwarded);
        let r = req("203.0.113.5:9", &[("forwarded", "for=1.2.3.4")]);
        assert_eq!(k.client_ip(&r), Some("203.0.113.5".parse().unwrap()));
    }

    #[test]
    fn rightmost_untrusted_hop_across_header_lines() {
        let k = ClientIp::trusting(["10.0.0.0/8", "fd00::/8"]).unwrap();
        let r = req(
            "10.1.1.1:9",
            &[
                ("x-forwarded-for", "6.6.6.6, 198.51.100.7"),
                ("x-forwarded-for", "10.0.0.3, [fd00::1]:443"),
            ],
        );
        assert_eq!(k.client_ip(&r), Some("198.51.100.7".parse().unwrap()));
        // Every hop trusted: the leftmost is the best known.
        let r = req("10.1.1.1:9", &[("x-forwarded-for", "10.0.0.9, 10.0.0.3")]);
        assert_eq!(k.client_ip(&r), Some("10.0.0.9".parse().unwrap()));
        // No header: the proxy itself.
        let r = req("10.1.1.1:9", &[]);
        assert_eq!(k.client_ip(&r), Some("10.1.1.1".parse().unwrap()));
        // Garbage to the right of the chain stops at the last trusted hop.
        let r = req("10.1.1.1:9", &[("x-forwarded-for", "6.6.6.6, nonsense")]);
        assert_eq!(k.client_ip(&r), Some("10.1.1.1".parse().unwrap()));
    }

    #[test]
    fn forwarded_header_rfc7239() {
        let k = ClientIp::trusting(["127.0.0.1", "10.0.0.0/8"])
            .unwrap()
            .header(ForwardedHeader::Forwarded);
        let r = req(
            "127.0.0.1:9",
            &[(
                "forwarded",
                r#"for=6.6.6.6;proto=http, for="[2001:db8:cafe::17]:4711";by=10.0.0.1, For=10.0.0.2"#,
            )],
        );
        assert_eq!(k.client_ip(&r), Some("2001:db8:cafe::17".parse().unwrap()));
        assert_eq!(
            KeyExtractor::<()>::extract(&k, &r).unwrap().to_string(),
            "2001:db8:cafe::/64"
        );
        let r = req("127.0.0.1:9", &[("forwarded", "for=_hidden, for=10.0.0.2")]);
        assert_eq!(k.client_ip(&r), Some("10.0.0.2".parse().unwrap()));
        // X-Forwarded-For is not read when Forwarded is configured.
        let r = req("127.0.0.1:9", &[("x-forwarded-for", "6.6.6.6")]);
        assert_eq!(k.client_ip(&r), Some("127.0.0.1".parse().unwrap()));
    }

    #[test]
    fn trusted_proxy_parsing() {
        assert!(ClientIp::trusting(["10.0.0.0/8", "::1", " 192.0.2.1 "]).is_ok());
        let err = ClientIp::trusting(["10.0.0.0/33"]).unwrap_err();
        assert!(err.to_string().contains("10.0.0.0/33"));
        // A mapped peer matches an IPv4 network, and a mapped network an IPv4 peer.
        let k = ClientIp::trusting(["::ffff:10.0.0.0/104"]).unwrap();
        let r = req("10.2.3.4:1", &[("x-forwarded-for", "198.51.100.1")]);
        assert_eq!(k.client_ip(&r), Some("198.51.100.1".parse().unwrap()));
        let k = ClientIp::trusting(["10.0.0.0/8"]).unwrap();
        let r = req(
            "[::ffff:10.2.3.4]:1",
            &[("x-forwarded-for", "198.51.100.1")],
        );
        assert_eq!(k.client_ip(&r), Some("198.51.100.1".parse().unwrap()));
    }

    #[test]
    fn header_and_global_keys() {
        let r = req("192.0.2.1:1", &[("x-api-key", "")]);
        assert!(HeaderKey::new("x-api-key").extract(&r).is_none());
        assert_eq!(GlobalKey.extract(&r), Some("global"));
    }

    #[test]
    fn key_display_escapes_control_bytes() {
        let k = Key::from(&b"a\nb\xff"[..]);
        assert_eq!(k.to_string(), "a\\nb\\xff");
    }
}
