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

use std::path::Path;

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use http::Request;
use ratelimit_core::Store;
use ratelimit_tower::{Limits, LimitsHandle, PeerIp, RateLimitLayer};

/// The budgets' name: fixed, so that every instance and every deploy shares them.
pub const NAMESPACE: &str = "live-limits";

/// Reads limits from TOML text; an error names the line and what to change.
pub fn parse_limits(text: &str) -> Result<Limits, String> {
    let limits: Limits = toml::from_str(text).map_err(|e| e.to_string())?;
    if limits.rules().is_none() {
        return Err(
            "no top-level `rules`: add a line such as `rules = \"60/min\"`, the \
                    limits of requests without an x-plan header"
                .into(),
        );
    }
    Ok(limits)
}

/// Reads the limits in the file at `path`.
pub fn read_limits(path: &Path) -> Result<Limits, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    parse_limits(&text).map_err(|e| format!("{}: {e}", path.display()))
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

/// Reads the file at `path` and puts its limits in force, logging what changed (`INFO`)
/// or why the file was refused (`ERROR`, the running limits staying).
pub fn reload(handle: &LimitsHandle, path: &Path) -> Result<(), String> {
    let result = read_limits(path).and_then(|limits| {
        let new = limits.clone();
        let old = handle
            .replace(limits)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(changes(&old, &new))
    });
    match &result {
        Ok(changes) if changes.is_empty() => tracing::info!("limits reloaded: no change"),
        Ok(changes) => tracing::info!("limits reloaded: {}", changes.join("; ")),
        Err(e) => tracing::error!("limits not reloaded, the running ones stay: {e}"),
    }
    result.map(drop)
}

/// What differs between `old` and `new`, tier by tier (`""` is the top-level rules).
pub fn changes(old: &Limits, new: &Limits) -> Vec<String> {
    let name = |tier: &str| {
        if tier.is_empty() {
            "rules".to_owned()
        } else {
            format!("tier {tier}")
        }
    };
    let tiers = |l: &Limits| {
        let mut names: Vec<String> = l.tiers().map(|(n, _)| n.to_owned()).collect();
        names.insert(0, String::new());
        names
    };
    let mut all = tiers(old);
    all.extend(tiers(new).into_iter().filter(|n| !tiers(old).contains(n)));
    all.into_iter()
        .filter_map(
            |tier| match (old.tier_rules(&tier), new.tier_rules(&tier)) {
                (Some(a), Some(b)) if a == b => None,
                (Some(a), Some(b)) => Some(format!("{}: \"{a}\" -> \"{b}\"", name(&tier))),
                (None, Some(b)) => Some(format!("{} added: \"{b}\"", name(&tier))),
                (Some(a), None) => Some(format!("{} removed (was \"{a}\")", name(&tier))),
                (None, None) => None,
            },
        )
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changes_name_each_tier() {
        let old =
            "rules = \"5/h fixed-window\"\n[tiers]\npro = \"50/h\"\ngone = \"1/s sliding-log\"\n";
        let new =
            "rules = \"10/h fixed-window\"\n[tiers]\npro = \"50/h\"\nnew = \"2/s sliding-log\"\n";
        let (old, new) = (parse_limits(old).unwrap(), parse_limits(new).unwrap());
        assert_eq!(
            changes(&old, &new),
            [
                "rules: \"5/1h fixed-window\" -> \"10/1h fixed-window\"",
                "tier gone removed (was \"1/1s sliding-log\")",
                "tier new added: \"2/1s sliding-log\"",
            ]
        );
        assert!(changes(&new, &new).is_empty());
    }

    #[test]
    fn a_bad_file_names_its_line() {
        let err = parse_limits("rules = \"5/h\"\n[tiers]\npro = \"50/fortnight\"\n").unwrap_err();
        assert!(err.contains("line 3"), "{err}");
        let err = parse_limits("[tiers]\npro = \"50/h\"\n").unwrap_err();
        assert!(err.contains("top-level `rules`"), "{err}");
    }
}
