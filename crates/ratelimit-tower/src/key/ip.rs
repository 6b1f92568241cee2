//! Keys from IP addresses: grouping, CIDR lists, and [`PeerIp`].

use std::borrow::Cow;
use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use http::Request;
use ipnet::IpNet;
use smallvec::SmallVec;

use super::{ClientKey, Extraction, Key, KeyExtractor, KeySource};

/// An extractor, trusted-proxy list or exempt-network list that cannot be built, with
/// what to change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyConfigError {
    /// A trusted proxy entry is neither an IP address nor a CIDR network.
    #[error(
        "trusted proxy {0:?} is not an IP address or CIDR network; write e.g. `10.0.0.0/8`, \
         `192.0.2.7` or `fd00::/8`"
    )]
    BadProxy(String),
    /// An exempt network entry is neither an IP address nor a CIDR network.
    #[error(
        "exempt network {0:?} is not an IP address or CIDR network; write e.g. `10.0.0.0/8`, \
         `192.0.2.7` or `fd00::/8`"
    )]
    BadExempt(String),
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
pub(crate) struct Grouping {
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
    pub(crate) fn v6(mut self, prefix: u8) -> Result<Self, KeyConfigError> {
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

    pub(crate) fn v4(mut self, prefix: u8) -> Result<Self, KeyConfigError> {
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
    pub(crate) fn key(self, ip: IpAddr) -> Key {
        let mut key = Key(SmallVec::new());
        // Writing into a Key cannot fail.
        let _ = match ip.to_canonical() {
            IpAddr::V4(v4) if self.v4_prefix == 32 => {
                // From a table into the key's own inline buffer: `Display` for addresses
                // is slow, and this runs per request.
                let mut text = [0u8; 48];
                let mut len = 0;
                for (i, octet) in v4.octets().into_iter().enumerate() {
                    if i > 0 {
                        text[len] = b'.';
                        len += 1;
                    }
                    let (digits, n) = OCTETS[usize::from(octet)];
                    text[len..len + 3].copy_from_slice(&digits);
                    len += usize::from(n);
                }
                return Key(SmallVec::from_buf_and_len(text, len));
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

/// How an IP extractor turns the address it found into an extraction: grouped into a
/// key, exempt, or missing.
#[derive(Debug, Clone, Default)]
pub(crate) struct Keying {
    pub(crate) grouping: Grouping,
    pub(crate) exempt: Networks,
}

impl Keying {
    #[inline]
    pub(crate) fn extraction(&self, ip: Option<IpAddr>) -> Extraction<Key> {
        match ip {
            Some(ip) if self.exempt.contains(ip) => Extraction::Exempt,
            Some(ip) => Extraction::Key(self.grouping.key(ip)),
            None => Extraction::Missing(Cow::Borrowed(NO_PEER)),
        }
    }
}

/// The grouping and exemption options every IP extractor offers, on its `keying` field.
macro_rules! ip_key_options {
    ($whose:literal) => {
        /// Groups IPv6 addresses by their first `prefix` bits (1..=128; 64 by default, 128
        /// keys each address).
        pub fn ipv6_prefix(mut self, prefix: u8) -> Result<Self, KeyConfigError> {
            self.keying.grouping = self.keying.grouping.v6(prefix)?;
            Ok(self)
        }

        /// Groups IPv4 addresses by their first `prefix` bits (1..=32; 32 by default).
        pub fn ipv4_prefix(mut self, prefix: u8) -> Result<Self, KeyConfigError> {
            self.keying.grouping = self.keying.grouping.v4(prefix)?;
            Ok(self)
        }

        #[doc = concat!("Exempts ", $whose, " in `networks` (addresses or CIDR networks) from the")]
        /// limit: their requests pass without a store call and without fields. Replaces
        /// an earlier list; fails on the first entry that is neither an address nor a
        /// network.
        pub fn exempt<I, T>(mut self, networks: I) -> Result<Self, KeyConfigError>
        where
            I: IntoIterator<Item = T>,
            T: AsRef<str>,
        {
            self.keying.exempt =
                $crate::key::ip::Networks::parse(networks, KeyConfigError::BadExempt)?;
            Ok(self)
        }
    };
}
pub(crate) use ip_key_options;

/// The decimal text of every octet value, left-aligned in three bytes, and its length.
static OCTETS: [([u8; 3], u8); 256] = {
    let mut table = [([0u8; 3], 0u8); 256];
    let mut i = 0;
    while i < 256 {
        let v = i as u8;
        table[i] = if v >= 100 {
            ([b'0' + v / 100, b'0' + v / 10 % 10, b'0' + v % 10], 3)
        } else if v >= 10 {
            ([b'0' + v / 10, b'0' + v % 10, 0], 2)
        } else {
            ([b'0' + v, 0, 0], 1)
        };
        i += 1;
    }
    table
};

/// A list of networks (trusted proxies, exempt clients), matched with IPv4-mapped IPv6
/// addresses counted as IPv4.
#[derive(Debug, Clone, Default)]
pub(crate) struct Networks(Arc<[IpNet]>);

impl Networks {
    pub(crate) fn parse<I, T>(
        entries: I,
        error: fn(String) -> KeyConfigError,
    ) -> Result<Self, KeyConfigError>
    where
        I: IntoIterator<Item = T>,
        T: AsRef<str>,
    {
        let nets = entries
            .into_iter()
            .map(|p| parse_net(p.as_ref()).ok_or_else(|| error(p.as_ref().into())))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self(nets.into()))
    }

    #[inline]
    pub(crate) fn contains(&self, ip: IpAddr) -> bool {
        if self.0.is_empty() {
            return false;
        }
        let ip = ip.to_canonical();
        self.0.iter().any(|net| net.contains(&ip))
    }
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

const NO_PEER: &str =
    "rate limiting by IP, but the request carries no peer address; serve the app with \
     `into_make_service_with_connect_info::<SocketAddr>()` (axum), enable the `tonic` \
     feature of ratelimit-tower (tonic servers), or insert the peer's `SocketAddr` into \
     the request extensions";

/// The peer address of `req`: axum's `ConnectInfo<SocketAddr>`, tonic's
/// `TcpConnectInfo`, or a bare `SocketAddr`.
pub(crate) fn peer_ip<B>(req: &Request<B>) -> Option<IpAddr> {
    #[cfg(feature = "axum")]
    if let Some(info) = req
        .extensions()
        .get::<axum::extract::ConnectInfo<SocketAddr>>()
    {
        return Some(info.0.ip());
    }
    #[cfg(feature = "tonic")]
    if let Some(addr) = req
        .extensions()
        .get::<tonic::transport::server::TcpConnectInfo>()
        .and_then(tonic::transport::server::TcpConnectInfo::remote_addr)
    {
        return Some(addr.ip());
    }
    req.extensions().get::<SocketAddr>().map(SocketAddr::ip)
}

/// Keys requests by the address of the immediate peer (the TCP connection), IPv6 grouped
/// by /64.
///
/// With axum, serve the router with
/// `into_make_service_with_connect_info::<SocketAddr>()`; with tonic, enable this crate's
/// `tonic` feature (the peer is read from tonic's `TcpConnectInfo`); other servers insert
/// the peer's `SocketAddr` into the request extensions. A request with none of these is "no key found"
/// ([`Extraction::Missing`]): refused with a 500 that says so unless the layer's
/// [`MissingKey`](crate::MissingKey) policy says otherwise. Behind a reverse proxy every
/// client has the proxy's address: use [`ClientIp`](super::ClientIp) there.
///
/// ```
/// use axum::body::Body;
/// use http::Request;
/// use ratelimit_tower::key::{Extraction, KeyExtractor, PeerIp};
///
/// let key = PeerIp::new().exempt(["10.0.0.0/8"]).unwrap();
/// let mut req = Request::new(Body::empty());
/// req.extensions_mut().insert("[2001:db8:1:2:aaaa::1]:4711".parse::<std::net::SocketAddr>().unwrap());
/// let Extraction::Key(k) = key.extract(&req) else { panic!() };
/// assert_eq!(k.to_string(), "2001:db8:1:2::/64");
///
/// // The monitoring network is deliberately not limited.
/// req.extensions_mut().insert("10.1.2.3:4711".parse::<std::net::SocketAddr>().unwrap());
/// assert_eq!(key.extract(&req), Extraction::Exempt);
/// ```
#[derive(Debug, Clone, Default)]
pub struct PeerIp {
    keying: Keying,
}

impl PeerIp {
    /// Keys by peer address; IPv4 addresses whole, IPv6 by /64.
    pub fn new() -> Self {
        Self::default()
    }

    ip_key_options!("peers");
}

impl<B> KeyExtractor<B> for PeerIp {
    type Key = Key;

    fn extract(&self, req: &Request<B>) -> Extraction<Key> {
        self.keying.extraction(peer_ip(req))
    }

    fn source(&self, key: &[u8]) -> ClientKey {
        ClientKey::new(KeySource::PeerIp, key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(peer: &str) -> Request<()> {
        let mut r = Request::new(());
        r.extensions_mut()
            .insert(peer.parse::<SocketAddr>().unwrap());
        r
    }

    fn key(k: &PeerIp, peer: &str) -> String {
        match k.extract(&req(peer)) {
            Extraction::Key(k) => k.to_string(),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn ipv6_grouping_and_mapped_ipv4() {
        let k = PeerIp::new();
        assert_eq!(key(&k, "[2001:db8:1:2:aaaa::1]:1"), "2001:db8:1:2::/64");
        assert_eq!(key(&k, "[2001:db8:1:2:bbbb::9]:1"), "2001:db8:1:2::/64");
        assert_eq!(key(&k, "[2001:db8:1:3::1]:1"), "2001:db8:1:3::/64");
        assert_eq!(key(&k, "[::ffff:192.0.2.1]:1"), "192.0.2.1");
        for ip in ["0.0.0.0", "9.10.99.100", "255.255.255.255", "203.0.113.7"] {
            assert_eq!(key(&k, &format!("{ip}:1")), ip);
        }
        let k56 = PeerIp::new().ipv6_prefix(56).unwrap();
        assert_eq!(key(&k56, "[2001:db8:1:2ff::1]:1"), "2001:db8:1:200::/56");
        let full = PeerIp::new().ipv6_prefix(128).unwrap();
        assert_eq!(key(&full, "[2001:db8::1]:1"), "2001:db8::1");
        let v4 = PeerIp::new().ipv4_prefix(24).unwrap();
        assert_eq!(key(&v4, "192.0.2.77:1"), "192.0.2.0/24");
        assert!(PeerIp::new().ipv6_prefix(0).is_err());
        assert!(PeerIp::new().ipv6_prefix(129).is_err());
        assert!(PeerIp::new().ipv4_prefix(33).is_err());
    }

    #[test]
    fn no_peer_is_a_missing_key_not_an_exemption() {
        match PeerIp::new().extract(&Request::new(())) {
            Extraction::Missing(why) => {
                assert!(why.contains("into_make_service_with_connect_info"))
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn exempt_networks() {
        let k = PeerIp::new().exempt(["10.0.0.0/8", "::1"]).unwrap();
        assert_eq!(k.extract(&req("10.9.9.9:1")), Extraction::Exempt);
        assert_eq!(k.extract(&req("[::ffff:10.9.9.9]:1")), Extraction::Exempt);
        assert_eq!(k.extract(&req("[::1]:1")), Extraction::Exempt);
        assert_eq!(key(&k, "11.0.0.1:1"), "11.0.0.1");
        let err = PeerIp::new().exempt(["10.0.0.0/8", "ten"]).unwrap_err();
        assert!(err.to_string().contains("\"ten\""), "{err}");
    }
}
