//! A layer's limits: as configured ([`Limits`]), as built for requests (one version at a
//! time), replaced while the layer runs ([`LimitsHandle`]), and read from a file
//! ([`LimitsFile`]).

mod clip;
mod file;
mod handle;
mod spec;
mod version;

pub(crate) use clip::Clip;
pub use file::{Change, Changes, LimitsFile, LoadError};
pub use handle::LimitsHandle;
pub(crate) use handle::Live;
pub use spec::Limits;
pub(crate) use version::{Settings, TierRef, Version};
