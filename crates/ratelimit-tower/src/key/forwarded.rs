//! Reading forwarding headers from the right.
//!
//! Trusted proxies append to the right of whatever the client sent, so only a suffix of
//! the header is vouched for. These functions walk elements from the rightmost one
//! backwards and never look at more than the caller asks for: bytes left of the first
//! untrusted hop (non-UTF-8, unclosed quotes, 40,000 entries) are never read.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

/// Splits `line` into elements at `sep` from the right. With `quotes`, separators inside
/// double quotes (as a well-formed element written by a proxy would hold them) do not
/// split.
pub(crate) struct RevElements<'a> {
    rest: Option<&'a [u8]>,
    sep: u8,
    quotes: bool,
}

impl<'a> RevElements<'a> {
    pub(crate) fn new(line: &'a [u8], sep: u8, quotes: bool) -> Self {
        Self {
            rest: Some(line),
            sep,
            quotes,
        }
    }
}

impl<'a> Iterator for RevElements<'a> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        let rest = self.rest?;
        let mut quoted = false;
        for i in (0..rest.len()).rev() {
            match rest[i] {
                b'"' if self.quotes => quoted = !quoted,
                c if c == self.sep && !quoted => {
                    self.rest = Some(&rest[..i]);
                    return Some(&rest[i + 1..]);
                }
                _ => {}
            }
        }
        self.rest = None;
        Some(rest)
    }
}

fn trim(bytes: &[u8]) -> &[u8] {
    bytes.trim_ascii()
}

/// The address of one `X-Forwarded-For` element; `None` for anything else.
pub(crate) fn xff_hop(element: &[u8]) -> Option<IpAddr> {
    parse_hop(trim(element))
}

/// The `for=` address of one `Forwarded` element; `None` when it has none or it is not
/// an address (`for=unknown`, `for=_hidden`, garbage).
pub(crate) fn forwarded_hop(element: &[u8]) -> Option<IpAddr> {
    RevElements::new(element, b';', true).find_map(|pair| {
        let eq = pair.iter().position(|&b| b == b'=')?;
        let (name, value) = (trim(&pair[..eq]), trim(&pair[eq + 1..]));
        if !name.eq_ignore_ascii_case(b"for") {
            return None;
        }
        let value = value
            .strip_prefix(b"\"")
            .and_then(|v| v.strip_suffix(b"\""))
            .unwrap_or(value);
        Some(parse_hop(value))
    })?
}

/// `192.0.2.1`, `192.0.2.1:80`, `2001:db8::1`, `[2001:db8::1]`, `[2001:db8::1]:80`.
fn parse_hop(hop: &[u8]) -> Option<IpAddr> {
    // The longest form, a bracketed IPv6 address with a port, is well under 64 bytes.
    if hop.len() > 64 {
        return None;
    }
    let hop = std::str::from_utf8(hop).ok()?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elements_from_the_right() {
        let parts: Vec<_> = RevElements::new(b"a, b,c", b',', false).collect();
        assert_eq!(parts, [&b"c"[..], b" b", b"a"]);
        let parts: Vec<_> = RevElements::new(br#"for="x, y", for=z"#, b',', true).collect();
        assert_eq!(parts, [&b" for=z"[..], br#"for="x, y""#]);
        // An unclosed quote on the left does not swallow the well-formed right.
        let parts: Vec<_> = RevElements::new(br#"for="x, for=1.2.3.4"#, b',', true).collect();
        assert_eq!(parts[0], b" for=1.2.3.4");
    }

    #[test]
    fn hops() {
        assert_eq!(xff_hop(b" 192.0.2.1 "), Some("192.0.2.1".parse().unwrap()));
        assert_eq!(
            xff_hop(b"[2001:db8::1]:80"),
            Some("2001:db8::1".parse().unwrap())
        );
        assert_eq!(xff_hop(b"\xff"), None);
        assert_eq!(
            forwarded_hop(br#"by=10.0.0.1;For="[2001:db8::17]:4711";proto=http"#),
            Some("2001:db8::17".parse().unwrap())
        );
        assert_eq!(forwarded_hop(b"for=_hidden"), None);
        assert_eq!(forwarded_hop(b"proto=http"), None);
    }
}
