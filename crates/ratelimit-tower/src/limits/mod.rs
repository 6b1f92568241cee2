//! A layer's limits: as configured ([`Limits`]), as built for requests (one version at a
//! time), and replaced while the layer runs ([`LimitsHandle`]).

mod handle;
mod spec;
mod version;

pub use handle::LimitsHandle;
pub(crate) use handle::Live;
pub use spec::Limits;
pub(crate) use version::{Settings, Version};
