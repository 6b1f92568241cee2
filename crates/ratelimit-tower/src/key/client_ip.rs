//! [`ClientIp`]: the client address reported by trusted reverse proxies.

use std::net::IpAddr;

use http::header::{HeaderName, FORWARDED};
use http::Request;

use super::forwarded::{forwarded_hop, xff_hop, RevElements};
use super::ip::{ip_key_options, peer_ip, KeyConfigError, Keying, Networks};
use super::{ClientKey, Extraction, Key, KeyExtractor, KeySource};

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
/// the client. Whatever lies left of it is what the client sent and is never read, so no
/// bytes a client writes there (non-UTF-8, unclosed quotes, garbage, tens of thousands of
/// entries) change its key or cost more than the hops the proxies appended. A hop that is
/// not an address (`unknown`, an obfuscated `_id`) stops the walk at the last address a
/// trusted proxy vouched for.
///
/// Only one header is read ([`ForwardedHeader`], `X-Forwarded-For` by default): the one
/// your proxies write. Reading a second one that they merely pass through would let
/// clients choose their own key.
///
/// ```
/// use axum::body::Body;
/// use http::Request;
/// use ratelimit_tower::key::{ClientIp, Extraction, KeyExtractor};
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
/// assert_eq!(key.client_ip(&req), Some("198.51.100.7".parse().unwrap()));
///
/// // Straight from the internet: the header is ignored.
/// req.extensions_mut().insert("203.0.113.9:1234".parse::<SocketAddr>().unwrap());
/// let Extraction::Key(k) = key.extract(&req) else { panic!() };
/// assert_eq!(k.to_string(), "203.0.113.9");
/// ```
#[derive(Debug, Clone)]
pub struct ClientIp {
    trusted: Networks,
    header: ForwardedHeader,
    keying: Keying,
}

/// Reads the address of one element of a forwarding header.
type HopParser = fn(&[u8]) -> Option<IpAddr>;

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

impl ClientIp {
    /// Trusts the proxies in `proxies` (addresses or CIDR networks, e.g. `10.0.0.0/8`,
    /// `::1`); fails on the first entry that is neither.
    pub fn trusting<I, T>(proxies: I) -> Result<Self, KeyConfigError>
    where
        I: IntoIterator<Item = T>,
        T: AsRef<str>,
    {
        Ok(Self {
            trusted: Networks::parse(proxies, KeyConfigError::BadProxy)?,
            header: ForwardedHeader::default(),
            keying: Keying::default(),
        })
    }

    /// Reads `header` instead of `X-Forwarded-For`.
    #[must_use]
    pub fn header(mut self, header: ForwardedHeader) -> Self {
        self.header = header;
        self
    }

    ip_key_options!("clients (by the address this extractor finds)");

    /// The client address of `req`: the peer when it is not a trusted proxy, otherwise the
    /// rightmost untrusted hop of the forwarding header; `None` without a peer address.
    pub fn client_ip<B>(&self, req: &Request<B>) -> Option<IpAddr> {
        let peer = peer_ip(req)?;
        if !self.trusted.contains(peer) {
            return Some(peer);
        }
        let (name, sep_quotes, hop): (&HeaderName, bool, HopParser) = match self.header {
            ForwardedHeader::XForwardedFor => (&X_FORWARDED_FOR, false, xff_hop),
            ForwardedHeader::Forwarded => (&FORWARDED, true, forwarded_hop),
        };
        // The last line was added by the nearest proxy: walk lines, then elements, from
        // the right, and stop at the first address no trusted proxy vouches for.
        let mut client = peer;
        for line in req.headers().get_all(name).iter().rev() {
            for element in RevElements::new(line.as_bytes(), b',', sep_quotes) {
                match hop(element) {
                    Some(ip) => {
                        client = ip;
                        if !self.trusted.contains(ip) {
                            return Some(ip);
                        }
                    }
                    None => return Some(client),
                }
            }
        }
        Some(client)
    }
}

impl<B> KeyExtractor<B> for ClientIp {
    type Key = Key;

    fn extract(&self, req: &Request<B>) -> Extraction<Key> {
        self.keying.extraction(self.client_ip(req))
    }

    fn source(&self, key: &[u8]) -> ClientKey {
        ClientKey::new(KeySource::ClientIp, key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;
    use proptest::prelude::*;
    use std::net::SocketAddr;

    fn req(peer: &str, headers: &[(&str, &[u8])]) -> Request<()> {
        let mut r = Request::new(());
        for (k, v) in headers {
            r.headers_mut().append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_bytes(v).unwrap(),
            );
        }
        r.extensions_mut()
            .insert(peer.parse::<SocketAddr>().unwrap());
        r
    }

    fn ip(s: &str) -> Option<IpAddr> {
        Some(s.parse().unwrap())
    }

    #[test]
    fn untrusted_peer_ignores_forwarding_headers() {
        let k = ClientIp::trusting(["10.0.0.0/8"]).unwrap();
        let r = req("203.0.113.5:9", &[("x-forwarded-for", b"1.2.3.4")]);
        assert_eq!(k.client_ip(&r), ip("203.0.113.5"));
        let k = k.header(ForwardedHeader::Forwarded);
        let r = req("203.0.113.5:9", &[("forwarded", b"for=1.2.3.4")]);
        assert_eq!(k.client_ip(&r), ip("203.0.113.5"));
        assert!(matches!(
            k.extract(&Request::new(())),
            Extraction::Missing(_)
        ));
    }

    #[test]
    fn rightmost_untrusted_hop_across_header_lines() {
        let k = ClientIp::trusting(["10.0.0.0/8", "fd00::/8"]).unwrap();
        let r = req(
            "10.1.1.1:9",
            &[
                ("x-forwarded-for", b"6.6.6.6, 198.51.100.7"),
                ("x-forwarded-for", b"10.0.0.3, [fd00::1]:443"),
            ],
        );
        assert_eq!(k.client_ip(&r), ip("198.51.100.7"));
        // Every hop trusted: the leftmost is the best known.
        let r = req("10.1.1.1:9", &[("x-forwarded-for", b"10.0.0.9, 10.0.0.3")]);
        assert_eq!(k.client_ip(&r), ip("10.0.0.9"));
        // No header: the proxy itself.
        assert_eq!(k.client_ip(&req("10.1.1.1:9", &[])), ip("10.1.1.1"));
        // Garbage where the proxy writes stops at the last trusted hop.
        let r = req("10.1.1.1:9", &[("x-forwarded-for", b"6.6.6.6, nonsense")]);
        assert_eq!(k.client_ip(&r), ip("10.1.1.1"));
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
                br#"for=6.6.6.6;proto=http, for="[2001:db8:cafe::17]:4711";by=10.0.0.1, For=10.0.0.2"#,
            )],
        );
        assert_eq!(k.client_ip(&r), ip("2001:db8:cafe::17"));
        let Extraction::Key(key) = KeyExtractor::<()>::extract(&k, &r) else {
            panic!()
        };
        assert_eq!(key.to_string(), "2001:db8:cafe::/64");
        let r = req(
            "127.0.0.1:9",
            &[("forwarded", b"for=_hidden, for=10.0.0.2")],
        );
        assert_eq!(k.client_ip(&r), ip("10.0.0.2"));
        // X-Forwarded-For is not read when Forwarded is configured.
        let r = req("127.0.0.1:9", &[("x-forwarded-for", b"6.6.6.6")]);
        assert_eq!(k.client_ip(&r), ip("127.0.0.1"));
    }

    #[test]
    fn trusted_proxy_parsing() {
        assert!(ClientIp::trusting(["10.0.0.0/8", "::1", " 192.0.2.1 "]).is_ok());
        let err = ClientIp::trusting(["10.0.0.0/33"]).unwrap_err();
        assert!(err.to_string().contains("10.0.0.0/33"));
        // A mapped peer matches an IPv4 network, and a mapped network an IPv4 peer.
        let k = ClientIp::trusting(["::ffff:10.0.0.0/104"]).unwrap();
        let r = req("10.2.3.4:1", &[("x-forwarded-for", b"198.51.100.1")]);
        assert_eq!(k.client_ip(&r), ip("198.51.100.1"));
        let k = ClientIp::trusting(["10.0.0.0/8"]).unwrap();
        let r = req(
            "[::ffff:10.2.3.4]:1",
            &[("x-forwarded-for", b"198.51.100.1")],
        );
        assert_eq!(k.client_ip(&r), ip("198.51.100.1"));
    }

    #[test]
    fn poisoned_client_prefixes_keep_the_client_key() {
        let xff = ClientIp::trusting(["10.0.0.0/8"]).unwrap();
        let r = req("10.0.0.2:1", &[("x-forwarded-for", b"\xff, 203.0.113.9")]);
        assert_eq!(xff.client_ip(&r), ip("203.0.113.9"));
        let fwd = xff.clone().header(ForwardedHeader::Forwarded);
        let r = req(
            "10.0.0.2:1",
            &[("forwarded", br#"for="x, for=203.0.113.9"#)],
        );
        assert_eq!(fwd.client_ip(&r), ip("203.0.113.9"));
        // 40,000 entries of client-written junk: only the last one is read.
        let mut long = "1.1.1.1, ".repeat(40_000).into_bytes();
        long.extend_from_slice(b"203.0.113.9");
        let r = req("10.0.0.2:1", &[("x-forwarded-for", &long)]);
        assert_eq!(xff.client_ip(&r), ip("203.0.113.9"));
    }

    #[test]
    fn exempt_clients_by_their_forwarded_address() {
        let k = ClientIp::trusting(["10.0.0.0/8"])
            .unwrap()
            .exempt(["192.0.2.0/24"])
            .unwrap();
        let r = req("10.0.0.2:1", &[("x-forwarded-for", b"192.0.2.5")]);
        assert_eq!(k.extract(&r), Extraction::Exempt);
        let r = req(
            "10.0.0.2:1",
            &[("x-forwarded-for", b"192.0.2.5, 198.51.100.1")],
        );
        assert!(matches!(k.extract(&r), Extraction::Key(_)));
    }

    fn header_bytes() -> impl Strategy<Value = Vec<u8>> {
        // Every byte a header value may carry: visible ASCII, space, tab, obs-text.
        proptest::collection::vec(
            prop_oneof![
                Just(b'\t'),
                0x20u8..=0x7e,
                0x80u8..=0xff,
                Just(b'"'),
                Just(b','),
                Just(b';')
            ],
            0..200,
        )
    }

    proptest! {
        #[test]
        fn any_client_prefix_keeps_the_proxy_vouched_hop(prefix in header_bytes(), separate_line in any::<bool>()) {
            let client = "203.0.113.9";
            let xff = ClientIp::trusting(["10.0.0.0/8"]).unwrap();
            let fwd = xff.clone().header(ForwardedHeader::Forwarded);
            for (k, name, entry) in [
                (&xff, "x-forwarded-for", format!("{client}, 10.0.0.7")),
                (&fwd, "forwarded", format!("for={client}, for=10.0.0.7")),
            ] {
                // What the trusted proxies do: append the client's address (and their own
                // hop) to whatever came in, on the same line or on a line of their own.
                let r = if separate_line {
                    req("10.0.0.2:1", &[(name, &prefix), (name, entry.as_bytes())])
                } else {
                    let mut line = prefix.clone();
                    line.extend_from_slice(format!(", {entry}").as_bytes());
                    req("10.0.0.2:1", &[(name, &line)])
                };
                prop_assert_eq!(k.client_ip(&r), ip(client));
            }
        }
    }
}
