//! Replacing a running layer's limits.

use std::fmt;
use std::sync::Arc;

use arc_swap::ArcSwap;

use super::spec::Limits;
use super::version::{Settings, Version};
use crate::error::BuildError;

/// A layer's limits, current version and settings, shared by the layer, its clones, its
/// services and every [`LimitsHandle`].
pub(crate) struct Live {
    /// `ArcSwap`, not a lock: a request loads the current version with a few atomic
    /// operations and no lock, keeps it for its whole decision, and a replacement never
    /// waits for requests nor makes them wait.
    pub(crate) current: ArcSwap<Version>,
    pub(crate) settings: Settings,
}

impl Live {
    pub(crate) fn new(settings: Settings, limits: Limits) -> Result<Self, BuildError> {
        let version = settings.version(limits)?;
        Ok(Self {
            current: ArcSwap::from_pointee(version),
            settings,
        })
    }
}

/// Replaces the limits of a running layer: see
/// [Changing limits](crate#changing-limits). Made by
/// [`RateLimitLayer::limits`](crate::RateLimitLayer::limits); cheap to clone.
///
/// A replacement applies to the layer it came from, every clone of it and every service
/// it made, at once: each request is decided entirely under the limits that were current
/// when it arrived, the old ones or the new ones, never a mix.
///
/// ```
/// use ratelimit_core::MemoryStore;
/// use ratelimit_tower::{GlobalKey, Limits, RateLimitLayer};
///
/// let layer = RateLimitLayer::new(MemoryStore::new(), GlobalKey, "5/h fixed-window".parse()?);
/// let handle = layer.limits();
/// let before = handle.replace(Limits::new("10/h fixed-window".parse()?))?;
/// assert_eq!(before.rules().unwrap().to_string(), "5/1h fixed-window");
/// assert_eq!(layer.rules().to_string(), "10/1h fixed-window");
///
/// // Limits the layer cannot use are refused, and the running ones stay.
/// let err = handle.replace(Limits::tiered().tier("pro", "1/s".parse()?)).unwrap_err();
/// assert!(err.to_string().contains("select_tier"), "{err}");
/// assert_eq!(layer.rules().to_string(), "10/1h fixed-window");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct LimitsHandle {
    pub(crate) live: Arc<Live>,
}

impl LimitsHandle {
    /// The limits in force.
    pub fn current(&self) -> Limits {
        self.live.current.load().limits.clone()
    }

    /// Puts `limits` in force and returns the ones they replace; or, when the layer
    /// cannot use them (the checks of [`build`](crate::RateLimitLayerBuilder::build)),
    /// says what to change and keeps the limits in force.
    ///
    /// What each client has used carries over to the new limits rule by rule (see
    /// [Changing limits](crate#changing-limits)).
    pub fn replace(&self, limits: Limits) -> Result<Limits, BuildError> {
        let version = self.live.settings.version(limits)?;
        let old = self.live.current.swap(Arc::new(version));
        Ok(old.limits.clone())
    }
}

impl fmt::Debug for LimitsHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LimitsHandle")
            .field("namespace", &self.live.settings.namespace)
            .field("limits", &self.live.current.load().limits)
            .finish()
    }
}
