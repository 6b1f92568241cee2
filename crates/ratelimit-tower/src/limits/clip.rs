//! Values in log lines and errors, cut to a bounded length.

use std::fmt;

/// The most bytes of one value a log line or an error shows.
pub(crate) const MAX_SHOWN: usize = 200;

/// Shows at most [`MAX_SHOWN`] bytes of a value (cut at a character boundary, control
/// characters escaped), then `…[N more bytes]`: a value read from a file or a request can
/// be any size, and a log line carrying it whole can be megabytes.
pub(crate) struct Clip<'a>(pub(crate) &'a str);

impl Clip<'_> {
    /// The clipped value as an owned string, for errors that outlive the input.
    pub(crate) fn owned(value: &str) -> String {
        Clip(value).to_string()
    }
}

impl fmt::Display for Clip<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut shown = 0;
        for (at, c) in self.0.char_indices() {
            let escaped = c.is_control().then(|| c.escape_default().to_string());
            let len = escaped.as_ref().map_or(c.len_utf8(), String::len);
            if shown + len > MAX_SHOWN {
                return write!(f, "…[{} more bytes]", self.0.len() - at);
            }
            shown += len;
            match escaped {
                Some(e) => f.write_str(&e)?,
                None => fmt::Write::write_char(f, c)?,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_values_are_cut_with_a_marker() {
        assert_eq!(Clip("short").to_string(), "short");
        let long = "é".repeat(1000);
        let shown = Clip(&long).to_string();
        assert!(shown.starts_with(&"é".repeat(100)), "{shown}");
        assert!(shown.ends_with("…[1800 more bytes]"), "{shown}");
        assert!(shown.len() < MAX_SHOWN + 30);
        assert_eq!(Clip("a\nb").to_string(), "a\\nb");
        // Escapes count against the bound too.
        let controls = "\u{1}".repeat(1000);
        assert!(Clip(&controls).to_string().len() < MAX_SHOWN + 30);
    }
}
