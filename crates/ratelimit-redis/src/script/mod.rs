//! The Rust side of the store's Lua scripts (`lua/check.lua`, `lua/block.lua`), one
//! concern per module:
//!
//! - [`args`]: the argument layout of `check.lua`, how a check's values are packed;
//! - [`reply`]: how its reply becomes a decision or an error, and how a batch reply
//!   divides into one reply per check;
//! - [`load`]: the scripts and the function library, loading them, calling them with
//!   the fallbacks for a server that lacks them, and the library tag of each version;
//! - [`batch`]: one check as a batch carries it, and the calls that decide many checks.

mod args;
mod batch;
mod compact;
mod load;
mod reply;

pub(crate) use args::{block_us, CheckArgs, Time, MAX_EXACT};
pub(crate) use batch::{batch_call, node_batch_call, CheckJob};
#[cfg(feature = "testing")]
pub(crate) use load::check_forms;
pub(crate) use load::{
    already_loaded, function_delete_cmd, function_list_cmd, function_missing, is_other_version,
    library_missing, library_names, lists_own_library, own_library_list_cmd, scripts,
    unknown_command, Call, Paths, Request, Script, BLOCK, DEBIT, GIVE_BACK, REFUND, RELEASE, RENEW,
};
pub(crate) use reply::CheckReply;
