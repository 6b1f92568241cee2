//! The limiter a layer's services share: its state ([`Limiter`]) and the pipeline that
//! turns a request into a [`Verdict`] (key extraction, tier selection, the deny cache, the
//! store's decision, failure and misconfiguration policies, shadow mode). The service and
//! its future only carry verdicts out.

mod decide;
mod handover;
mod refuse;
mod settle;
mod slot;
mod state;
mod verdict;

pub(crate) use handover::Handover;
pub(crate) use state::{ChargeWhen, Limiter};
pub(crate) use verdict::{Begin, CheckFuture, Pass, Verdict};
