//! Limits read from a file, bounded, off the request path.

use std::collections::HashMap;
use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ratelimit_core::RuleSet;

use super::clip::Clip;
use super::handle::LimitsHandle;
use super::spec::Limits;
use crate::error::BuildError;

/// How many changes a reload's log line lists before `and N more`.
const LISTED_CHANGES: usize = 8;

type Parse = dyn Fn(&str) -> Result<Limits, String> + Send + Sync;

/// A limits file: read, checked and put in force by [`reload`](Self::reload) (say on
/// `SIGHUP`), without letting the file take the service down.
///
/// - The file is read up to [`max_bytes`](Self::max_bytes) (1 MiB by default) and no
///   further: a larger file (or `/dev/zero`) is refused after reading at most one byte
///   more than the cap.
/// - Limits with more than [`max_tiers`](Self::max_tiers) tiers (1,024 by default) are
///   refused. Tier names are at most 64 bytes and, read through serde, a rule text at
///   most [`Limits::MAX_RULE_TEXT`] bytes (see [`Limits`]).
/// - Reading, parsing, checking, comparing with the limits in force and building the new
///   ones run in [`tokio::task::spawn_blocking`], never on the runtime's workers, so
///   requests go on being answered meanwhile; the comparison is linear in the number of
///   tiers.
/// - A reload logs one line: `INFO` with what changed, or `ERROR` with why the file was
///   refused, the limits in force staying. Every value in it (path, error, rule texts) is
///   cut to 200 bytes with a `…[N more bytes]` marker, and at most 8 changes are listed.
///
/// The format is the caller's: `parse` turns the file's text into [`Limits`], e.g. TOML
/// through serde (feature `serde`):
///
/// ```no_run
/// # #[cfg(feature = "serde")]
/// # async fn run(handle: ratelimit_tower::LimitsHandle) -> Result<(), ratelimit_tower::LoadError> {
/// use ratelimit_tower::{Limits, LimitsFile};
///
/// let file = LimitsFile::new("limits.toml", |text: &str| toml::from_str::<Limits>(text));
/// let limits = file.load().await?; // at start-up, to build the layer with
/// # let _ = limits;
/// // Then on each SIGHUP (see the `live_limits` example). Logged either way; a refused
/// // file leaves the limits in force.
/// let _ = file.reload(&handle).await;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct LimitsFile {
    path: Arc<Path>,
    parse: Arc<Parse>,
    max_bytes: u64,
    max_tiers: usize,
}

impl LimitsFile {
    /// The default [`max_bytes`](Self::max_bytes): 1 MiB.
    pub const DEFAULT_MAX_BYTES: u64 = 1 << 20;

    /// The default [`max_tiers`](Self::max_tiers).
    pub const DEFAULT_MAX_TIERS: usize = 1024;

    /// The file at `path`, its text read into limits by `parse`.
    pub fn new<E: fmt::Display>(
        path: impl Into<PathBuf>,
        parse: impl Fn(&str) -> Result<Limits, E> + Send + Sync + 'static,
    ) -> Self {
        Self {
            path: path.into().into(),
            parse: Arc::new(move |text| parse(text).map_err(|e| e.to_string())),
            max_bytes: Self::DEFAULT_MAX_BYTES,
            max_tiers: Self::DEFAULT_MAX_TIERS,
        }
    }

    /// Refuses files larger than `bytes` (1 MiB by default), reading no more than one
    /// byte past it.
    #[must_use]
    pub fn max_bytes(mut self, bytes: u64) -> Self {
        self.max_bytes = bytes;
        self
    }

    /// Refuses limits with more than `tiers` named tiers (1,024 by default).
    #[must_use]
    pub fn max_tiers(mut self, tiers: usize) -> Self {
        self.max_tiers = tiers;
        self
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads and checks the file (in a blocking task), for building a layer at start-up.
    /// Logs nothing: at start-up the caller decides what a bad file means.
    pub async fn load(&self) -> Result<Limits, LoadError> {
        let file = self.clone();
        blocking(move || file.read()).await
    }

    /// Reads the file and puts its limits in force through `handle` (all in a blocking
    /// task), logging what changed (`INFO`) or why the file was refused (`ERROR`, the
    /// limits in force staying); returns what it logged.
    pub async fn reload(&self, handle: &LimitsHandle) -> Result<Changes, LoadError> {
        let (file, handle) = (self.clone(), handle.clone());
        let result = blocking(move || {
            let new = file.read()?;
            let old = handle.replace(new.clone()).map_err(LoadError::Refused)?;
            Ok(Changes::between(&old, &new))
        })
        .await;
        let path = self.path.to_string_lossy();
        match &result {
            Ok(changes) => tracing::info!(path = %Clip(&path), "limits reloaded: {changes}"),
            Err(error) => tracing::error!(
                path = %Clip(&path),
                "limits not reloaded, the running ones stay: {error}"
            ),
        }
        result
    }

    /// Reads, parses and checks the file; blocking.
    fn read(&self) -> Result<Limits, LoadError> {
        let file = std::fs::File::open(&self.path).map_err(LoadError::Read)?;
        let mut bytes = Vec::new();
        file.take(self.max_bytes.saturating_add(1))
            .read_to_end(&mut bytes)
            .map_err(LoadError::Read)?;
        if bytes.len() as u64 > self.max_bytes {
            return Err(LoadError::TooLarge {
                max_bytes: self.max_bytes,
            });
        }
        let text = String::from_utf8(bytes).map_err(|e| LoadError::NotUtf8 {
            at: e.utf8_error().valid_up_to(),
        })?;
        let limits = (self.parse)(&text).map_err(LoadError::Parse)?;
        if limits.tiers.len() > self.max_tiers {
            return Err(LoadError::TooManyTiers {
                tiers: limits.tiers.len(),
                max_tiers: self.max_tiers,
            });
        }
        limits.validate().map_err(LoadError::Refused)?;
        Ok(limits)
    }
}

impl fmt::Debug for LimitsFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LimitsFile")
            .field("path", &self.path)
            .field("max_bytes", &self.max_bytes)
            .field("max_tiers", &self.max_tiers)
            .finish_non_exhaustive()
    }
}

async fn blocking<R: Send + 'static>(
    f: impl FnOnce() -> Result<R, LoadError> + Send + 'static,
) -> Result<R, LoadError> {
    tokio::task::spawn_blocking(f)
        .await
        .unwrap_or_else(|e| Err(LoadError::Parse(format!("the parser panicked: {e}"))))
}

/// Why a limits file was refused. Its message shows at most 200 bytes of any value taken
/// from the file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LoadError {
    /// The file cannot be opened or read.
    #[error("cannot read the limits file: {0}")]
    Read(std::io::Error),
    /// The file is larger than [`LimitsFile::max_bytes`].
    #[error("the limits file is larger than {max_bytes} bytes: shorten it or raise `max_bytes`")]
    TooLarge {
        /// The cap.
        max_bytes: u64,
    },
    /// The file is not UTF-8 text.
    #[error("the limits file is not UTF-8 text (at byte {at})")]
    NotUtf8 {
        /// The offset of the first byte that is not.
        at: usize,
    },
    /// The parser refused the text; its message, cut to 200 bytes.
    #[error("{}", Clip(.0))]
    Parse(String),
    /// More tiers than [`LimitsFile::max_tiers`].
    #[error("{tiers} tiers, more than {max_tiers}: merge tiers or raise `max_tiers`")]
    TooManyTiers {
        /// The tiers in the file.
        tiers: usize,
        /// The cap.
        max_tiers: usize,
    },
    /// Limits the layer cannot use.
    #[error("{}", Clip(&.0.to_string()))]
    Refused(BuildError),
}

/// What a reload changed, tier by tier (`rules` is the tier `""`): its `Display` lists
/// at most 8 changes, each rule text cut to 200 bytes, then how many more.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Changes(Vec<Change>);

/// One tier's change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// A tier with new rules: name, old rules, new rules.
    Changed(String, RuleSet, RuleSet),
    /// A new tier.
    Added(String, RuleSet),
    /// A tier no longer in the limits, with its rules.
    Removed(String, RuleSet),
    /// Another default tier: old, new.
    DefaultTier(String, String),
}

impl Changes {
    /// What differs from `old` to `new`: changed and removed tiers in `old`'s order, then
    /// added ones in `new`'s, then the default tier. Linear in the number of tiers.
    pub fn between(old: &Limits, new: &Limits) -> Self {
        let new_tiers: HashMap<&str, &RuleSet> = new.all_tiers().collect();
        let old_tiers: HashMap<&str, &RuleSet> = old.all_tiers().collect();
        let mut changes = Vec::new();
        for (name, a) in old.all_tiers() {
            match new_tiers.get(name) {
                Some(b) if a == *b => {}
                Some(b) => changes.push(Change::Changed(name.into(), a.clone(), (*b).clone())),
                None => changes.push(Change::Removed(name.into(), a.clone())),
            }
        }
        for (name, b) in new.all_tiers() {
            if !old_tiers.contains_key(name) {
                changes.push(Change::Added(name.into(), b.clone()));
            }
        }
        let default = |l: &Limits| l.default_tier.clone().unwrap_or_default();
        if default(old) != default(new) {
            changes.push(Change::DefaultTier(default(old), default(new)));
        }
        Self(changes)
    }

    /// Nothing changed.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The changes.
    pub fn iter(&self) -> impl Iterator<Item = &Change> {
        self.0.iter()
    }
}

/// `rules` for the tier `""`, else `tier <name>`.
struct TierName<'a>(&'a str);

impl fmt::Display for TierName<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            f.write_str("rules")
        } else {
            write!(f, "tier {}", Clip(self.0))
        }
    }
}

/// A rule set's text, cut to 200 bytes.
struct Text<'a>(&'a RuleSet);

impl fmt::Display for Text<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "\"{}\"", Clip(&self.0.to_string()))
    }
}

impl fmt::Display for Change {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Change::Changed(name, a, b) => {
                write!(f, "{}: {} -> {}", TierName(name), Text(a), Text(b))
            }
            Change::Added(name, b) => write!(f, "{} added: {}", TierName(name), Text(b)),
            Change::Removed(name, a) => write!(f, "{} removed (was {})", TierName(name), Text(a)),
            Change::DefaultTier(a, b) => {
                write!(
                    f,
                    "default tier {:?} -> {:?}",
                    Clip(a).to_string(),
                    Clip(b).to_string()
                )
            }
        }
    }
}

impl fmt::Display for Changes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("no change");
        }
        for (i, change) in self.0.iter().take(LISTED_CHANGES).enumerate() {
            let sep = if i == 0 { "" } else { "; " };
            write!(f, "{sep}{change}")?;
        }
        if self.0.len() > LISTED_CHANGES {
            write!(f, "; and {} more", self.0.len() - LISTED_CHANGES)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(text: &str) -> RuleSet {
        text.parse().unwrap()
    }

    #[test]
    fn changes_name_each_tier() {
        let old = Limits::new(rules("5/h fixed-window"))
            .tier("pro", rules("50/h"))
            .tier("gone", rules("1/s sliding-log"));
        let new = Limits::new(rules("10/h fixed-window"))
            .tier("pro", rules("50/h"))
            .tier("new", rules("2/s sliding-log"))
            .default_tier("pro");
        assert_eq!(
            Changes::between(&old, &new).to_string(),
            "rules: \"5/1h fixed-window\" -> \"10/1h fixed-window\"; \
             tier gone removed (was \"1/1s sliding-log\"); \
             tier new added: \"2/1s sliding-log\"; default tier \"\" -> \"pro\""
        );
        assert!(Changes::between(&new, &new).is_empty());
        assert_eq!(Changes::between(&new, &new).to_string(), "no change");
    }
}
