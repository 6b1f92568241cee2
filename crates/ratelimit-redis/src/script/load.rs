//! Loading the scripts and telling versions apart: the script forms and the function
//! library of `lua/check.lua`, `SCRIPT LOAD` / `FUNCTION LOAD`, one [`Call`] of a script
//! with what it does when the server lacks it (reload, resend, fall back to `EVALSHA` /
//! `EVAL`), and the library tag that keeps stores of different versions sharing a server
//! apart, which also names the libraries of other versions for
//! [`RedisStore::unload_other_versions`](crate::RedisStore::unload_other_versions).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock, PoisonError, RwLock};

use ratelimit_core::util::BoundedLog;
use ratelimit_core::Clock;
use redis::aio::ConnectionLike;
use redis::{Cmd, ErrorKind, RedisError, RedisResult, ServerErrorKind, Value};

use super::args::CheckArgs;
use crate::keys::key_slot;

/// A Lua script and its SHA1, run with EVALSHA; the decision script also as a Redis
/// function library, run with FCALL.
#[derive(Debug)]
pub(crate) struct Script {
    body: String,
    sha: String,
    function: Option<Function>,
    /// The command of the native module (crate `ratelimit-redis-module`) that stands for
    /// this script, where there is one.
    module: Option<ModuleCommand>,
    /// The module's command that takes this script's checks in compact form (a batch's;
    /// see `script::compact`), where there is one.
    compact: Option<ModuleCommand>,
}

/// A command of the native module that takes a script's keys and arguments.
#[derive(Debug, Clone, Copy)]
struct ModuleCommand {
    name: &'static str,
    /// Whether the number of keys follows the name, as after `FCALL <function>`; the
    /// commands of one client key leave it out (their keys come first, for a Cluster
    /// client to route them by them).
    numkeys: bool,
    /// Whether it takes a batch in compact form (module protocol 1).
    compact: bool,
    /// Whether only modules of protocol 3 have it (`RATELIMIT.DEBIT`): a call goes to
    /// the module only where every module primary reports that protocol, and a server
    /// that answers it as unknown (an older module) gets the Lua function instead.
    debt: bool,
    /// Whether it edits a state after its check (a give-back, a debit, a lease's refund,
    /// a release, a renewal) and so, on a module of protocol 4, takes a call id as its
    /// last argument, to be decided once.
    edit: bool,
}

impl ModuleCommand {
    const fn new(name: &'static str, numkeys: bool) -> Self {
        Self {
            name,
            numkeys,
            compact: false,
            debt: false,
            edit: false,
        }
    }

    /// A command that edits a state after its check (see [`ModuleCommand::edit`]).
    const fn edit(name: &'static str) -> Self {
        Self {
            edit: true,
            ..Self::new(name, false)
        }
    }
}

/// Which form of the decisions a store's calls take: what it learned from its servers,
/// and what its builder asked for.
#[derive(Debug)]
pub(crate) struct Paths {
    /// Servers whose function library lacked a function this store calls, reported at a
    /// bounded rate.
    missing_log: BoundedLog,
    /// The server has Redis functions (Redis 7): checks go as FCALL, else EVALSHA.
    pub(crate) functions: AtomicBool,
    /// Every primary has the native module of this crate's state format: checks go as
    /// its commands.
    pub(crate) module: AtomicBool,
    /// Every primary found with the module serves its batch protocol 1: batches go to it
    /// in compact form (`RATELIMIT.CHECK_STATES`, `RATELIMIT.CHECK_LOCAL_STATES`), else
    /// in the older form, which every version of the module takes.
    pub(crate) compact: AtomicBool,
    /// Every primary found with the module serves its batch protocol 2: compact calls
    /// carry an id, so that a call lost with its connection is sent again and decided
    /// once, and a check alone goes as `RATELIMIT.CHECK_STATE`.
    pub(crate) once: AtomicBool,
    /// Every primary found with the module serves its protocol 3: debt (a settle above
    /// the estimate) goes to `RATELIMIT.DEBIT`, else to the Lua function.
    pub(crate) debt: AtomicBool,
    /// Every primary found with the module serves its protocol 4: the commands that edit
    /// a state after its check (`RATELIMIT.GIVE_BACK`, `DEBIT`, `REFUND`, `RELEASE`,
    /// `RENEW`) carry a call id and are decided once.
    pub(crate) edits_once: AtomicBool,
    /// Every primary found with the module serves its protocol 5 (or none has it): the
    /// edits of a state after its check (give-backs, debt, releases, renewals) queue
    /// with the checks and leave in their batches, else each is a call of its own.
    pub(crate) edits_batched: AtomicBool,
    /// On a Cluster where only some primaries have the module: the slots whose node has
    /// it, one bit each, as of the last node map; a call on a key of such a slot goes as
    /// the module's command, any other as Lua. `None` otherwise.
    module_slots: RwLock<Option<Arc<[u64]>>>,
    /// The primaries found with the module, by `(host, port)` as the Cluster names them.
    module_nodes: RwLock<Vec<(String, u16)>>,
    /// Set when a Cluster master turned out to lack the module (a slot moved to it, or it
    /// lost the module): before the next batch, the masters are asked again which have
    /// it, and the slots of those that do are mapped anew.
    remap: AtomicBool,
}

/// Slots in a Redis Cluster.
const SLOTS: usize = 16384;

impl Paths {
    pub(crate) fn new() -> Self {
        Self {
            missing_log: BoundedLog::new(),
            // Until a server says it has no FCALL.
            functions: AtomicBool::new(true),
            // Until a server says it has the module.
            module: AtomicBool::new(false),
            compact: AtomicBool::new(false),
            once: AtomicBool::new(false),
            debt: AtomicBool::new(false),
            edits_once: AtomicBool::new(false),
            // Until the servers were asked which modules they have.
            edits_batched: AtomicBool::new(false),
            module_slots: RwLock::new(None),
            module_nodes: RwLock::new(Vec::new()),
            remap: AtomicBool::new(false),
        }
    }

    /// Whether the masters should be asked again which have the module, since one turned
    /// out to lack it; cleared by asking.
    pub(crate) fn take_remap(&self) -> bool {
        self.remap.swap(false, Ordering::AcqRel)
    }

    /// A server answered a call of the module's on the key `first_key` as an unknown
    /// command: it lacks the module. On a Cluster whose masters were found with it, only
    /// that key's slot goes to Lua from now on (the master serving it now lacks the
    /// module: a slot moved there, or the node restarted without it) and the masters are
    /// asked again before the next batch; the other masters keep the module. On one
    /// server, every call goes to Lua until a reconnection finds the module again.
    fn module_missing(&self, first_key: Option<&[u8]>) {
        let cluster = !self
            .module_nodes
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .is_empty();
        let (true, Some(key)) = (cluster, first_key) else {
            tracing::info!(
                "the ratelimit module is gone from Redis; rate-limit decisions run as Lua \
                 functions until a reconnection finds it"
            );
            self.module.store(false, Ordering::Relaxed);
            self.set_module_slots(None::<fn(u16) -> bool>);
            return;
        };
        let slot = key_slot(key);
        let mut slots = self
            .module_slots
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        let mut bits = match (&*slots, self.module.load(Ordering::Relaxed)) {
            (_, true) => vec![u64::MAX; SLOTS / 64],
            (Some(bits), false) => bits.to_vec(),
            // Lua everywhere already.
            (None, false) => return,
        };
        bits[usize::from(slot) / 64] &= !(1 << (slot % 64));
        *slots = Some(Arc::from(bits));
        self.module.store(false, Ordering::Relaxed);
        self.remap.store(true, Ordering::Release);
        tracing::debug!(
            slot,
            "a Cluster master lacks the ratelimit module; the slot's decisions run as Lua \
             functions"
        );
    }

    /// A server answered a compact batch as an unknown command: its module is of an
    /// older protocol (a node restarted with an older module). Batches go in the older
    /// form from now on: on a Cluster, until the masters, asked again before the next
    /// batch, all report the compact form; on one server, until a reconnection finds it.
    fn compact_missing(&self) {
        self.compact.store(false, Ordering::Relaxed);
        self.once.store(false, Ordering::Relaxed);
        self.edits_once.store(false, Ordering::Relaxed);
        self.edits_batched.store(false, Ordering::Relaxed);
        let cluster = !self
            .module_nodes
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .is_empty();
        if cluster {
            self.remap.store(true, Ordering::Release);
        }
        tracing::info!(
            "a server's ratelimit module does not know the compact batches (an older \
             version); batches go in the older form"
        );
    }

    /// A server answered `RATELIMIT.DEBIT` as an unknown command: its module is of an
    /// older protocol (a node restarted with an older module). Debt goes to the Lua
    /// function from now on: on a Cluster, until the masters, asked again before the
    /// next batch, all report protocol 3; on one server, until a reconnection finds it.
    fn debt_missing(&self) {
        self.debt.store(false, Ordering::Relaxed);
        let cluster = !self
            .module_nodes
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .is_empty();
        if cluster {
            self.remap.store(true, Ordering::Release);
        }
        tracing::info!(
            "a server's ratelimit module does not know RATELIMIT.DEBIT (an older version); \
             settles above the estimate run as Lua functions"
        );
    }

    /// The primaries found with the module.
    pub(crate) fn module_nodes(&self) -> Vec<(String, u16)> {
        self.module_nodes
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    pub(crate) fn set_module_nodes(&self, with: Vec<(String, u16)>) {
        *self
            .module_nodes
            .write()
            .unwrap_or_else(PoisonError::into_inner) = with;
    }

    /// Whether a call on the key `name` goes to the module: every primary has it, or the
    /// node serving the key's slot does (as far as the last node map says).
    pub(crate) fn module_for(&self, name: &[u8]) -> bool {
        if self.module.load(Ordering::Relaxed) {
            return true;
        }
        let slots = self
            .module_slots
            .read()
            .unwrap_or_else(PoisonError::into_inner);
        slots.as_ref().is_some_and(|bits| {
            let slot = usize::from(key_slot(name));
            bits[slot / 64] >> (slot % 64) & 1 == 1
        })
    }

    /// Records which slots' nodes have the module (`with(slot)`); `None` when all or
    /// none have it.
    pub(crate) fn set_module_slots(&self, with: Option<impl Fn(u16) -> bool>) {
        let bits = with.map(|with| {
            let mut bits = vec![0u64; SLOTS / 64];
            for slot in 0..SLOTS as u16 {
                if with(slot) {
                    bits[usize::from(slot) / 64] |= 1 << (slot % 64);
                }
            }
            Arc::from(bits)
        });
        *self
            .module_slots
            .write()
            .unwrap_or_else(PoisonError::into_inner) = bits;
    }
}

/// A script as a Redis 7 function library: the library code and the function's name.
/// Both carry the script's SHA1, so stores of different versions sharing a server each
/// find their own.
#[derive(Debug)]
struct Function {
    library: String,
    name: String,
}

/// What every library name of the decision functions starts with, whatever the version;
/// the library's tag follows.
const LIBRARY_PREFIX: &str = "ratelimit_";
/// The length of a library's tag: hex digits of the SHA1 of the script form of
/// `check.lua`.
const TAG_LEN: usize = 16;

fn sha1(body: &str) -> String {
    redis::Script::new(body).get_hash().to_owned()
}

impl Script {
    fn new(body: String) -> Self {
        let sha = sha1(&body);
        Self {
            body,
            sha,
            function: None,
            module: None,
            compact: None,
        }
    }

    /// check.lua as one script per entry point (`ENTRIES`), and one function library
    /// registering all of them under names tagged with the SHA1 of the first.
    fn decision_scripts() -> [Self; 8] {
        // A library's top level cannot reach `string` while it loads, so the struct
        // formats come made.
        let code = format!(
            "local HEADER, PER_RULE, MAX_RULES, MAX_STATE, MAX_CONCURRENT, MAX_LOG, HEADER_FORMAT, RULE_FORMAT = {}, {}, {}, {}, {}, {}, '<{}', '<{}'\n{}",
            CheckArgs::HEADER,
            CheckArgs::PER_RULE,
            ratelimit_core::MAX_RULES,
            ratelimit_core::packed::MAX_STATE_VALUES,
            ratelimit_core::MAX_CONCURRENT,
            ratelimit_core::MAX_LOG_LIMIT,
            "d".repeat(CheckArgs::HEADER),
            "d".repeat(CheckArgs::PER_RULE),
            LIBRARY_SOURCE
        );
        let body = |function: &str| format!("{code}\nreturn {function}(KEYS, ARGV)\n");
        let tag = sha1(&body(ENTRIES[0].1))[..TAG_LEN].to_owned();
        let mut library = format!("#!lua name={LIBRARY_PREFIX}{tag}\n{code}\n");
        for (name, function, flags) in ENTRIES {
            library.push_str(&format!(
                "redis.register_function{{function_name='ratelimit_{name}_{tag}', \
                 callback={function}, flags={{{flags}}}}}\n"
            ));
        }
        ENTRIES.map(|(name, function, _)| Self {
            function: Some(Function {
                library: library.clone(),
                name: format!("ratelimit_{name}_{tag}"),
            }),
            module: match name {
                "check" => Some(ModuleCommand::new("RATELIMIT.CHECK", false)),
                "batch" => Some(ModuleCommand::new("RATELIMIT.CHECK_MANY", true)),
                "local" => Some(ModuleCommand::new("RATELIMIT.CHECK_LOCAL", true)),
                "refund" => Some(ModuleCommand::edit("RATELIMIT.REFUND")),
                "give_back" => Some(ModuleCommand::edit("RATELIMIT.GIVE_BACK")),
                "debit" => Some(ModuleCommand {
                    debt: true,
                    ..ModuleCommand::edit("RATELIMIT.DEBIT")
                }),
                "release" => Some(ModuleCommand::edit("RATELIMIT.RELEASE")),
                "renew" => Some(ModuleCommand::edit("RATELIMIT.RENEW")),
                _ => None,
            },
            compact: match name {
                "check" => Some(ModuleCommand {
                    compact: true,
                    ..ModuleCommand::new("RATELIMIT.CHECK_STATE", false)
                }),
                "batch" => Some(ModuleCommand {
                    compact: true,
                    ..ModuleCommand::new("RATELIMIT.CHECK_STATES", true)
                }),
                "local" => Some(ModuleCommand {
                    compact: true,
                    ..ModuleCommand::new("RATELIMIT.CHECK_LOCAL_STATES", true)
                }),
                _ => None,
            },
            ..Self::new(body(function))
        })
    }

    /// The `SCRIPT LOAD` command for this script.
    pub(crate) fn load_cmd(&self) -> Cmd {
        let mut cmd = redis::cmd("SCRIPT");
        cmd.arg("LOAD").arg(&self.body);
        cmd
    }

    /// The `FUNCTION LOAD` command for this script's library, if it has one.
    pub(crate) fn function_load_cmd(&self) -> Option<Cmd> {
        let function = self.function.as_ref()?;
        let mut cmd = redis::cmd("FUNCTION");
        cmd.arg("LOAD").arg(&function.library);
        Some(cmd)
    }

    /// The module's command when `paths` says the servers have the module and it has one
    /// for this script; else `FCALL <function>` when `paths` says the server has
    /// functions and this script is a library, else `EVALSHA <sha>`; then the number of
    /// keys (but for the module's single check), to be followed by the keys and
    /// arguments.
    ///
    /// `first_key` is the call's first key (on a Cluster, all its keys are of the node
    /// serving that key's slot).
    pub(crate) fn call<'a>(
        &'static self,
        paths: &'a Paths,
        first_key: &[u8],
        keys: usize,
        capacity: usize,
    ) -> Call<'a> {
        let module = self.module.filter(|m| {
            (!m.debt || paths.debt.load(Ordering::Relaxed)) && paths.module_for(first_key)
        });
        self.call_as(paths, keys, capacity, module)
    }

    /// The module's command for this script's checks in compact form, when it has one,
    /// `paths` says every module primary takes it, and the call on `first_key` goes to
    /// the module; the number of keys (`keys`) follows it.
    pub(crate) fn compact_call<'a>(
        &'static self,
        paths: &'a Paths,
        first_key: &[u8],
        keys: usize,
        capacity: usize,
    ) -> Option<Call<'a>> {
        let compact = self.compact.filter(|c| {
            paths.compact.load(Ordering::Relaxed)
                // A check alone in compact form is of protocol 2.
                && (c.numkeys || paths.once.load(Ordering::Relaxed))
                && paths.module_for(first_key)
        })?;
        Some(self.call_as(paths, keys, capacity, Some(compact)))
    }

    fn call_as<'a>(
        &'static self,
        paths: &'a Paths,
        keys: usize,
        capacity: usize,
        module: Option<ModuleCommand>,
    ) -> Call<'a> {
        let mut cmd = Cmd::with_capacity(3 + capacity, 64 + 48 * capacity);
        if let Some(command) = module {
            cmd.arg(command.name);
            if command.numkeys {
                cmd.arg(keys);
            }
            return Call {
                script: self,
                cmd,
                fcall: false,
                module: Some(command),
                keys,
                paths,
                once: None,
                keep_ms: 0,
            };
        }
        let fcall = match &self.function {
            Some(function) if paths.functions.load(Ordering::Relaxed) => {
                cmd.arg("FCALL").arg(function.name.as_str());
                true
            }
            _ => {
                cmd.arg("EVALSHA").arg(self.sha.as_str());
                false
            }
        };
        cmd.arg(keys);
        Call {
            script: self,
            cmd,
            fcall,
            module: None,
            keys,
            paths,
            once: None,
            keep_ms: 0,
        }
    }
}

/// The decision library's Lua, its files by concern in the order `lua/check.lua` gives
/// (each reaches what the ones before it define).
const LIBRARY_SOURCE: &str = concat!(
    include_str!("../../lua/check.lua"),
    "\n",
    include_str!("../../lua/algorithms.lua"),
    "\n",
    include_str!("../../lua/carry.lua"),
    "\n",
    include_str!("../../lua/decide.lua"),
    "\n",
    include_str!("../../lua/refund.lua"),
    "\n",
    include_str!("../../lua/debit.lua"),
    "\n",
    include_str!("../../lua/slots.lua"),
    "\n",
    include_str!("../../lua/block.lua"),
    "\n",
    include_str!("../../lua/edits.lua"),
    "\n",
    include_str!("../../lua/once.lua"),
);

/// check.lua's entry points: the name in the library (after `ratelimit_`), the Lua
/// function and the function's flags.
const ENTRIES: [(&str, &str, &str); 8] = [
    ("check", "check_once", ""),
    ("batch", "check_many_once", ""),
    ("local", "check_local_once", "'allow-cross-slot-keys'"),
    ("refund", "refund_once", ""),
    ("give_back", "give_back_once", ""),
    ("debit", "debit_once", ""),
    ("release", "release_once", ""),
    ("renew", "renew_once", ""),
];

/// check.lua's scripts, in the order of `ENTRIES`; see `lua/check.lua` for their
/// contracts.
static DECISIONS: LazyLock<[Script; 8]> = LazyLock::new(Script::decision_scripts);
/// The decision script: one check.
pub(crate) static CHECK: LazyLock<&'static Script> = LazyLock::new(|| &DECISIONS[0]);
/// The batch script: many checks in one call.
pub(crate) static BATCH: LazyLock<&'static Script> = LazyLock::new(|| &DECISIONS[1]);
/// The node batch function: many checks of any slots one Cluster node serves, in one call.
pub(crate) static LOCAL: LazyLock<&'static Script> = LazyLock::new(|| &DECISIONS[2]);
/// The refund of lease mode: units a lease did not spend, given back.
pub(crate) static REFUND: LazyLock<&'static Script> = LazyLock::new(|| &DECISIONS[3]);
/// The refund of charging by outcome: units a check charged, given back.
pub(crate) static GIVE_BACK: LazyLock<&'static Script> = LazyLock::new(|| &DECISIONS[4]);
/// The debt of a metered request settled above its estimate: units charged
/// unconditionally.
pub(crate) static DEBIT: LazyLock<&'static Script> = LazyLock::new(|| &DECISIONS[5]);
/// A concurrency slot freed.
pub(crate) static RELEASE: LazyLock<&'static Script> = LazyLock::new(|| &DECISIONS[6]);
/// A concurrency slot's deadline moved on.
pub(crate) static RENEW: LazyLock<&'static Script> = LazyLock::new(|| &DECISIONS[7]);
/// The block script; see `lua/block.lua` for its contract.
pub(crate) static BLOCK: LazyLock<Script> = LazyLock::new(|| Script {
    module: Some(ModuleCommand::new("RATELIMIT.BLOCK", false)),
    ..Script::new(
        concat!(
            include_str!("../../lua/block.lua"),
            "\nreturn block(KEYS, ARGV)\n"
        )
        .to_owned(),
    )
});

/// The decision script: its body as sent with `SCRIPT LOAD`, its SHA1, its function
/// library, the function's name and the batch function's name.
#[cfg(feature = "testing")]
pub(crate) fn check_forms() -> [&'static str; 5] {
    let function = CHECK.function.as_ref().expect("check.lua is a library");
    let batch = BATCH.function.as_ref().expect("check.lua is a library");
    [
        &CHECK.body,
        &CHECK.sha,
        &function.library,
        &function.name,
        &batch.name,
    ]
}

/// The scripts a store loads when it connects. The decision script's library holds the
/// batch, node batch and refund functions too; the script forms of those (Redis 6.2) are
/// sent with `EVAL` the first time the server does not know them.
pub(crate) fn scripts() -> [&'static Script; 2] {
    [*CHECK, &BLOCK]
}

/// The name of the function library this version loads: `ratelimit_<tag>`.
pub(crate) fn own_library() -> String {
    format!("{LIBRARY_PREFIX}{}", &CHECK.sha[..TAG_LEN])
}

/// Whether the library `name` is the decision library of another version of this crate:
/// `ratelimit_` and a tag of 16 lowercase hex digits, other than this version's. Any
/// other name (another application's library) is never taken for one.
pub(crate) fn is_other_version(name: &str) -> bool {
    name.strip_prefix(LIBRARY_PREFIX).is_some_and(|tag| {
        tag.len() == TAG_LEN
            && tag.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
            && name != own_library()
    })
}

/// `FUNCTION LIST`: the libraries a server holds.
pub(crate) fn function_list_cmd() -> Cmd {
    let mut cmd = redis::cmd("FUNCTION");
    cmd.arg("LIST");
    cmd
}

/// `FUNCTION LIST LIBRARYNAME <library>` of this version's library: whether a server
/// holds it, asked before loading it (a load of a library that is there fails).
pub(crate) fn own_library_list_cmd() -> Cmd {
    let mut cmd = function_list_cmd();
    cmd.arg("LIBRARYNAME").arg(own_library());
    cmd
}

/// Whether a `FUNCTION LIST` reply names this version's library.
pub(crate) fn lists_own_library(reply: &Value) -> bool {
    library_names(reply).is_some_and(|names| names.contains(&own_library()))
}

/// `FUNCTION DELETE <library>`.
pub(crate) fn function_delete_cmd(library: &str) -> Cmd {
    let mut cmd = redis::cmd("FUNCTION");
    cmd.arg("DELETE").arg(library);
    cmd
}

/// The library names in a `FUNCTION LIST` reply: a list of libraries, each a flat list
/// of field names and values (RESP2) or a map (RESP3); `None` for another shape.
pub(crate) fn library_names(reply: &Value) -> Option<Vec<String>> {
    let Value::Array(libraries) = reply else {
        return None;
    };
    let text = |v: &Value| match v {
        Value::BulkString(bytes) => String::from_utf8(bytes.clone()).ok(),
        Value::SimpleString(s) | Value::VerbatimString { text: s, .. } => Some(s.clone()),
        _ => None,
    };
    libraries
        .iter()
        .map(|library| {
            let fields: Vec<(&Value, &Value)> = match library {
                Value::Array(items) => items.chunks_exact(2).map(|f| (&f[0], &f[1])).collect(),
                Value::Map(pairs) => pairs.iter().map(|(k, v)| (k, v)).collect(),
                _ => return None,
            };
            fields
                .into_iter()
                .find(|(k, _)| text(k).as_deref() == Some("library_name"))
                .and_then(|(_, v)| text(v))
        })
        .collect()
}

impl Paths {
    /// Says, at a bounded rate, that a server's library lacks `function` even after the
    /// store loaded it: a library of this version's name from elsewhere, or one removed
    /// again at once, over and over.
    fn missing(&self, function: &str) {
        let now = ratelimit_core::SystemClock.now_us();
        if let Some(count) = self.missing_log.hit(now) {
            tracing::warn!(
                library = %own_library(),
                function,
                calls = count,
                "the Redis function library lacks a function this store calls, even after \
                 loading it (a library of the same name that something else loaded, or one \
                 removed again at once): calls go as scripts (EVALSHA), which costs Redis \
                 more. See FUNCTION LIST; delete the foreign library or give this store's \
                 servers to it alone (reported at most every 10 s, with the calls since the \
                 last report)"
            );
        }
    }
}

/// Whether a `FUNCTION DELETE` failed only because the library is gone already.
pub(crate) fn library_missing(e: &RedisError) -> bool {
    e.to_string().contains("Library not found")
}

/// Whether the server answered that it has no such function (a restart, `FUNCTION
/// FLUSH`, a new node, another version's `unload_other_versions`).
pub(crate) fn function_missing(e: &RedisError) -> bool {
    e.to_string().contains("Function not found")
}

/// Whether the server does not know the command (FCALL before Redis 7).
pub(crate) fn unknown_command(e: &RedisError) -> bool {
    e.to_string().contains("unknown command")
}

/// Whether a `FUNCTION LOAD` failed only because the library is there already.
pub(crate) fn already_loaded(e: &RedisError) -> bool {
    e.to_string().contains("already exists")
}

/// One script call: `FCALL` of the decision function or `EVALSHA` of a script, resent
/// after loading what the server lacks.
#[derive(Debug, Clone)]
pub(crate) struct Call<'a> {
    script: &'static Script,
    pub(crate) cmd: Cmd,
    fcall: bool,
    /// The module's command this call is, if it is one.
    module: Option<ModuleCommand>,
    /// The call's number of keys.
    keys: usize,
    /// Its `functions` cleared, for every later call of the store, when the server has
    /// no FCALL; its `module` when the server has no module.
    paths: &'a Paths,
    /// A call decided once: the position among the command's arguments of the one
    /// that ends with the call's id (a compact call's `refs`, or the id alone).
    once: Option<usize>,
    /// How long Redis keeps a Lua call's record, in ms (see [`Call::arg_once`]).
    keep_ms: u64,
}

impl<'a> Call<'a> {
    /// Whether running this call twice does what running it once does (a block marker
    /// set again), so that it may be sent again when its connection broke with it in
    /// flight. A check charges, a refund gives back: neither is.
    pub(crate) fn repeatable(&self) -> bool {
        std::ptr::eq(self.script, &*BLOCK)
    }

    /// Appends `refs` with a new call id, making this compact call one the module
    /// decides once: sent again after a lost connection, it answers the first run's
    /// reply, or runs if there was none.
    pub(crate) fn arg_refs_once(&mut self, mut refs: Vec<u8>) {
        refs.extend_from_slice(&super::compact::call_id());
        self.once = Some(self.cmd.args_iter().count());
        self.cmd.arg(refs);
    }

    /// Makes this call one decided once where its path keeps the replies of recent
    /// calls: on the Lua functions, its record's name (beside `state`, the state key of
    /// its first client key), how long Redis keeps the record (`keep_ms`, longer than the
    /// store waits to send a call again) and a new call id follow its arguments
    /// (check.lua's `once`); on a module of protocol 4, a command that edits a state
    /// after its check takes the id alone. Other module calls are left as they are (a
    /// check's compact form takes its id with [`arg_refs_once`](Self::arg_refs_once)).
    /// Sent again after a lost connection ([`resent`](Self::resent)), the call answers
    /// its first run's reply, or runs if there was none.
    pub(crate) fn arg_once(&mut self, state: &str, keep_ms: u64) {
        let id = super::compact::text_call_id();
        self.keep_ms = keep_ms;
        match self.module {
            None => {
                self.cmd
                    .arg(crate::keys::record_name(state, &id))
                    .arg(keep_ms);
            }
            Some(m) if m.edit && self.paths.edits_once.load(Ordering::Relaxed) => {}
            Some(_) => return,
        }
        self.once = Some(self.cmd.args_iter().count());
        self.cmd.arg(&id[..]);
    }

    /// This call as sent again after its connection broke with it in flight, when it
    /// is a call decided once; `None` otherwise (it may have run: it must not be sent
    /// again).
    pub(crate) fn resent(&self) -> Option<Call<'a>> {
        let at = self.once?;
        let mut cmd = Cmd::with_capacity(self.cmd.args_iter().count(), 0);
        for (i, arg) in self.cmd.args_iter().enumerate() {
            let redis::Arg::Simple(bytes) = arg else {
                return None;
            };
            if i == at {
                let mut refs = bytes.to_vec();
                *refs.last_mut()? = 1;
                cmd.arg(refs);
            } else {
                cmd.arg(bytes);
            }
        }
        Some(Call {
            script: self.script,
            cmd,
            fcall: self.fcall,
            module: self.module,
            keys: self.keys,
            paths: self.paths,
            once: self.once,
            keep_ms: self.keep_ms,
        })
    }

    /// This compact batch as the module's batch of the older form, which a module of every
    /// version takes (and which goes on to the Lua function if the module is gone);
    /// `None` when its arguments are not a compact batch's. Later batches change as
    /// [`Paths::compact_missing`] says.
    fn as_older(&self) -> Option<Call<'a>> {
        let older = self.script.module?;
        let args: Vec<&[u8]> = self
            .cmd
            .args_iter()
            .skip(1)
            .map(|arg| match arg {
                redis::Arg::Simple(bytes) => bytes,
                _ => &[],
            })
            .collect();
        let local = std::ptr::eq(self.script, *LOCAL);
        let single = !older.numkeys;
        let expanded = if single {
            super::compact::expand_single(&args)?
        } else {
            super::compact::expand(&args, local)?
        };
        self.paths.compact_missing();
        let keys = if local {
            0
        } else if single {
            expanded.len() - 1
        } else {
            std::str::from_utf8(expanded.first()?).ok()?.parse().ok()?
        };
        let mut call = self
            .script
            .call_as(self.paths, keys, expanded.len(), Some(older));
        // `call_as` wrote the number of keys; the expansion starts with it.
        call.cmd = redis::cmd(older.name);
        for arg in expanded {
            call.cmd.arg(arg);
        }
        Some(call)
    }

    /// This module call as a call of the Lua function, for a server that turned out to
    /// lack the module (a restart without it, a failover or a slot move to a node
    /// without it), or, for a command only later modules have, to lack that command;
    /// later calls change as [`Paths::module_missing`] (or [`Paths::debt_missing`])
    /// says.
    fn as_lua(&self) -> Call<'a> {
        let head = match self.module {
            Some(ModuleCommand { numkeys: true, .. }) => 2,
            _ => 1,
        };
        let first_key = match self.cmd.args_iter().nth(head) {
            Some(redis::Arg::Simple(key)) if self.keys > 0 => Some(key),
            _ => None,
        };
        if self.module.is_some_and(|m| m.debt) {
            // An older module: the module stays for everything else.
            self.paths.debt_missing();
        } else {
            self.paths.module_missing(first_key);
        }
        let mut call = self.script.call_as(self.paths, self.keys, 0, None);
        for (i, arg) in self.cmd.args_iter().enumerate().skip(head) {
            if let redis::Arg::Simple(bytes) = arg {
                // The module's call id: the Lua call takes one of its own, with a record.
                if Some(i) != self.once {
                    call.cmd.arg(bytes);
                }
            }
        }
        if self.once.is_some() {
            if let Some(state) = first_key.and_then(|key| std::str::from_utf8(key).ok()) {
                call.arg_once(state, self.keep_ms);
            }
        }
        call
    }

    /// Runs the call. A server that lost the function library (restart, failover to a
    /// node without it, another version's `unload_other_versions`) gets it again and
    /// the call is resent, once; should the function be missing still (removed again
    /// in between, or a library of that name without it), this call goes as EVALSHA of
    /// the script form, which no `FUNCTION DELETE` touches, so it is decided all the
    /// same and nothing loops. A server without functions (Redis 6.2) gets EVALSHA from
    /// now on. EVALSHA falls back to EVAL (which also caches the script in the server
    /// that answers) when that server does not know the script: after `SCRIPT FLUSH`, a
    /// restart, or a failover. Every resend goes to the node owning the keys, which
    /// makes it right for Redis Cluster too.
    pub(crate) async fn invoke<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
    ) -> RedisResult<Value> {
        if self.module.is_some() {
            return match self.cmd.query_async(conn).await {
                Err(e) if unknown_command(&e) => {
                    if !self.module.is_some_and(|m| m.compact) {
                        return Box::pin(self.as_lua().invoke(conn)).await;
                    }
                    match self.as_older() {
                        Some(older) => Box::pin(older.invoke(conn)).await,
                        None => Err(e),
                    }
                }
                other => other,
            };
        }
        match self.cmd.query_async(conn).await {
            Err(e) if self.fcall && function_missing(&e) => {
                tracing::debug!("rate-limit function not loaded in Redis; loading it");
                if let Some(load) = self.script.function_load_cmd() {
                    match load.query_async::<Value>(conn).await {
                        Err(e) if !already_loaded(&e) => return Err(e),
                        _ => {}
                    }
                }
                match self.cmd.query_async(conn).await {
                    Err(e) if function_missing(&e) => {
                        self.paths.missing(self.function_name());
                        let mut evalsha = redis::cmd("EVALSHA");
                        evalsha.arg(self.script.sha.as_str());
                        self.resend(conn, evalsha).await
                    }
                    other => other,
                }
            }
            Err(e) if self.fcall && unknown_command(&e) => {
                tracing::info!("Redis has no FCALL (before 7.0); using EVALSHA");
                self.paths.functions.store(false, Ordering::Relaxed);
                let mut evalsha = redis::cmd("EVALSHA");
                evalsha.arg(self.script.sha.as_str());
                self.resend(conn, evalsha).await
            }
            Err(e) if !self.fcall && e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                tracing::debug!("rate-limit script not cached by Redis; sending it with EVAL");
                let mut eval = redis::cmd("EVAL");
                eval.arg(&self.script.body);
                self.with_head(eval).query_async(conn).await
            }
            other => other,
        }
    }

    /// The name of the function this call is of (empty for a script without one).
    fn function_name(&self) -> &'static str {
        self.script
            .function
            .as_ref()
            .map_or("", |f| f.name.as_str())
    }

    /// This call's keys and arguments after `head` (EVAL or EVALSHA and the script).
    fn with_head(&self, mut head: Cmd) -> Cmd {
        for arg in self.cmd.args_iter().skip(2) {
            if let redis::Arg::Simple(bytes) = arg {
                head.arg(bytes);
            }
        }
        head
    }

    /// Sends the call as `head`, then as EVAL if the server does not know the script.
    async fn resend<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        head: Cmd,
    ) -> RedisResult<Value> {
        match self.with_head(head).query_async(conn).await {
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                let mut eval = redis::cmd("EVAL");
                eval.arg(&self.script.body);
                self.with_head(eval).query_async(conn).await
            }
            other => other,
        }
    }

    /// Runs the call on the Cluster node `routing` names. A node that lost the function
    /// library gets it again (on every primary) and the call is resent there, once (a
    /// function missing still fails the call, having run nothing: the caller sends its
    /// checks one by one, through [`invoke`](Self::invoke)); a node without functions
    /// fails the call, having run nothing, and turns FCALL off for the store.
    pub(crate) async fn invoke_routed(
        &self,
        conn: &mut redis::cluster_async::ClusterConnection,
        routing: &redis::cluster_routing::RoutingInfo,
    ) -> RedisResult<Value> {
        if self.module.is_some() {
            return match route(conn, &self.cmd, routing).await {
                Err(e) if unknown_command(&e) => {
                    if !self.module.is_some_and(|m| m.compact) {
                        return Box::pin(self.as_lua().invoke_routed(conn, routing)).await;
                    }
                    match self.as_older() {
                        Some(older) => Box::pin(older.invoke_routed(conn, routing)).await,
                        None => Err(e),
                    }
                }
                other => other,
            };
        }
        match route(conn, &self.cmd, routing).await {
            Err(e) if self.fcall && function_missing(&e) => {
                if let Some(load) = self.script.function_load_cmd() {
                    match load.query_async::<Value>(conn).await {
                        Err(e) if !already_loaded(&e) => return Err(e),
                        _ => {}
                    }
                }
                route(conn, &self.cmd, routing).await.inspect_err(|e| {
                    if function_missing(e) {
                        self.paths.missing(self.function_name());
                    }
                })
            }
            Err(e) if self.fcall && unknown_command(&e) => {
                // Nothing ran; the caller sends each check alone from now on.
                tracing::info!("Redis has no FCALL (before 7.0); using EVALSHA");
                self.paths.functions.store(false, Ordering::Relaxed);
                Err(e)
            }
            other => other,
        }
    }
}

/// Sends `cmd` where `routing` says. A routed command answers Redis's error as a value;
/// it is made an error here, so that a node without the function is told apart from a
/// reply.
async fn route(
    conn: &mut redis::cluster_async::ClusterConnection,
    cmd: &Cmd,
    routing: &redis::cluster_routing::RoutingInfo,
) -> RedisResult<Value> {
    conn.route_command(cmd.clone(), routing.clone())
        .await
        .and_then(Value::extract_error)
}

/// A request to Redis: a script call or a plain command.
#[derive(Debug)]
pub(crate) enum Request<'a> {
    /// A script, with the NOSCRIPT fallback.
    Call(Call<'a>),
    /// A plain command.
    Cmd(Cmd),
}

impl<'a> Request<'a> {
    /// The request to send again after its connection broke with it in flight: itself
    /// when running it twice does no harm, the resend of a call decided once; `None`
    /// when it may have run and must not run again.
    pub(crate) fn resent(&self) -> Option<Request<'a>> {
        match self {
            Request::Call(call) if call.repeatable() => Some(Request::Call(call.clone())),
            Request::Call(call) => call.resent().map(Request::Call),
            Request::Cmd(cmd) => Some(Request::Cmd(cmd.clone())),
        }
    }

    pub(crate) async fn send<C: ConnectionLike + Send>(&self, conn: &mut C) -> RedisResult<Value> {
        match self {
            Request::Call(call) => call.invoke(conn).await,
            Request::Cmd(cmd) => cmd.query_async(conn).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn other_versions_are_told_by_name() {
        let own = own_library();
        assert!(!is_other_version(&own));
        assert!(is_other_version("ratelimit_0123456789abcdef"));
        for foreign in [
            "ratelimit_0123456789ABCDEF",
            "ratelimit_0123456789abcde",
            "ratelimit_0123456789abcdef0",
            "ratelimit_tools",
            "ratelimit_",
            "myapp_0123456789abcdef",
            "0123456789abcdef",
        ] {
            assert!(!is_other_version(foreign), "{foreign}");
        }
        // The library this version loads is named as `own_library` says.
        let library = CHECK.function.as_ref().expect("check.lua is a library");
        assert!(library.library.starts_with(&format!("#!lua name={own}\n")));
    }

    #[test]
    fn function_list_replies_name_their_libraries() {
        let s = |t: &str| Value::BulkString(t.as_bytes().to_vec());
        let resp2 = Value::Array(vec![
            Value::Array(vec![
                s("library_name"),
                s("ratelimit_0123456789abcdef"),
                s("engine"),
                s("LUA"),
                s("functions"),
                Value::Array(vec![]),
            ]),
            Value::Array(vec![s("engine"), s("LUA"), s("library_name"), s("myapp")]),
        ]);
        assert_eq!(
            library_names(&resp2),
            Some(vec![
                "ratelimit_0123456789abcdef".to_owned(),
                "myapp".to_owned()
            ])
        );
        let resp3 = Value::Array(vec![Value::Map(vec![
            (s("library_name"), Value::SimpleString("myapp".into())),
            (s("engine"), s("LUA")),
        ])]);
        assert_eq!(library_names(&resp3), Some(vec!["myapp".to_owned()]));
        assert_eq!(library_names(&Value::Array(vec![])), Some(vec![]));
        for bad in [
            Value::Nil,
            s("library_name"),
            Value::Array(vec![Value::Int(1)]),
            Value::Array(vec![Value::Array(vec![s("engine"), s("LUA")])]),
        ] {
            assert_eq!(library_names(&bad), None, "{bad:?}");
        }
    }
}
