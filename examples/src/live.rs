//! The `live_limits` example's logic: limits read from a TOML file, reloaded while the
//! app serves.
//!
//! The file holds the top-level `rules` (requests without an `x-plan` header) and an
//! optional `[tiers]` table of plan name = rules:
//!
//! ```toml
//! rules = "5/min sliding-window name=per-ip"
//!
//! [tiers]
//! pro = "100/min sliding-window name=pro"
//! ```
//!
//! A plan the file does not list (yet, or any more) is limited by the top-level rules,
//! with a `WARN` naming it.

use std::path::PathBuf;

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use http::Request;
use ratelimit_core::Store;
use ratelimit_tower::{Limits, LimitsFile, LimitsHandle, PeerIp, RateLimitLayer};

/// The budgets' name: fixed, so that every instance and every deploy shares them.
pub const NAMESPACE: &str = "live-limits";

/// Reads limits from TOML text; an error names the line and what to change, in one line.
pub fn parse_limits(text: &str) -> Result<Limits, String> {
    let limits: Limits = toml::from_str(text).map_err(|e| {
        // toml's own message quotes the offending line whole; a log wants the line number.
        let message = e.message().trim_end();
        match e.span() {
            Some(span) => {
                let line = text[..span.start.min(text.len())].matches('\n').count() + 1;
                format!("line {line}: {message}")
            }
            None => message.to_owned(),
        }
    })?;
    if limits.rules().is_none() {
        return Err(
            "no top-level `rules`: add a line such as `rules = \"60/min\"`, the \
                    limits of requests without an x-plan header (or in a plan the file \
                    does not list)"
                .into(),
        );
    }
    Ok(limits)
}

/// The limits file at `path`, read with [`parse_limits`] within the library's bounds
/// (1 MiB, 1,024 tiers).
pub fn limits_file(path: impl Into<PathBuf>) -> LimitsFile {
    LimitsFile::new(path, parse_limits)
}

/// `GET /` on `store`, limited per client IP under `limits`, the tier chosen by the
/// `x-plan` request header; and the handle that replaces the limits.
pub fn app<S: Store>(store: S, limits: Limits) -> Result<(Router, LimitsHandle), String> {
    let layer = RateLimitLayer::builder(store, PeerIp::new())
        .namespace(NAMESPACE)
        .limits(limits)
        .select_tier(|req: &Request<Body>| {
            req.headers()
                .get("x-plan")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        })
        .build()
        .map_err(|e| e.to_string())?;
    let handle = layer.limits();
    let app = Router::new()
        .route("/", get(|| async { "hello\n" }))
        .layer(layer);
    Ok((app, handle))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_file_names_its_line() {
        let err = parse_limits("rules = \"5/h\"\n[tiers]\npro = \"50/fortnight\"\n").unwrap_err();
        assert!(err.starts_with("line 3: "), "{err}");
        assert!(!err.contains('\n'), "one line: {err}");
        let err = parse_limits("[tiers]\npro = \"50/h\"\n").unwrap_err();
        assert!(err.contains("top-level `rules`"), "{err}");
    }
}
