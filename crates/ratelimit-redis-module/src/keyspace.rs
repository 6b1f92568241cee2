//! A limiter key (a check's state, a block marker), read and written through the parts
//! of Redis's key API that the `redis-module` crate does not wrap: the hot path of every
//! committed check, and the one way the module writes a limiter key (checks, refunds and
//! blocks alike); their replication; and a Cluster node's answer to whether it serves a
//! check's slot.
//!
//! The crate's `RedisKeyWritable` writes a string through `StringTruncate` and a second
//! `StringDMA` (a new key: an object and its buffer allocated, then copied into), sets a
//! relative expiry only, and its `Context::replicate` copies every argument into a new
//! Redis string and builds the argument vector by reallocation. Here a new value is one
//! Redis string set on the key (`StringSet`), an existing value is rewritten in place
//! (resized first when its length changes), and the expiry is the absolute one the
//! replicas receive (`SetAbsExpire`: primary and replicas expire the key at the same
//! millisecond).
//!
//! A command's state writes are replicated together when it ends, as one `EVAL` of a
//! fixed script that runs `SET key value PXAT at` (or `KEEPTTL`, or no expiry) for each,
//! in order ([`replicate_writes`]; a command's one write, as its `SET`): the replicas and
//! the AOF get the writes' effects, as with a `SET` each, and need no module. A `SET`
//! replicated per write cost the server a lookup of the command by name and a new vector
//! of arguments each time, about a fifth of a committed check in a batch
//! (BENCHMARKS.md).
//!
//! This is the module's one place of `unsafe` besides its registration: each block calls
//! one function of Redis's module API on a key this type keeps open or a string its
//! caller holds, or reads the value's buffer while the borrow checker keeps the key
//! unwritten.
#![allow(unsafe_code)]

use std::os::raw::{c_char, c_longlong};
use std::ptr;

use ratelimit_core::algo::RuleState;
use ratelimit_core::packed::{self, Header, PackedRules};
use redis_module::{raw, Context, KeyType, RedisString};
use smallvec::SmallVec;

thread_local! {
    /// The `PXAT` of every replicated `SET`, referenced rather than created per write.
    /// Never freed: it lives as long as the module, and a thread-local with a destructor
    /// would run it after Redis shut down.
    static PXAT: std::mem::ManuallyDrop<RedisString> = std::mem::ManuallyDrop::new(
        RedisString::create_from_slice(ptr::null_mut(), b"PXAT"),
    );
}

/// A key opened for reading and writing, closed when dropped.
pub(crate) struct StateKey<'a> {
    key: *mut raw::RedisModuleKey,
    _ctx: std::marker::PhantomData<&'a Context>,
}

impl<'a> StateKey<'a> {
    pub(crate) fn open(ctx: &'a Context, name: &RedisString) -> Self {
        let key = raw::open_key(
            ctx.get_raw(),
            name.inner,
            raw::KeyMode::READ | raw::KeyMode::WRITE,
        );
        StateKey {
            key,
            _ctx: std::marker::PhantomData,
        }
    }

    pub(crate) fn key_type(&self) -> KeyType {
        // SAFETY: `self.key` is open until `self` is dropped; RM_KeyType takes any open
        // key (and NULL).
        unsafe { raw::RedisModule_KeyType.expect("RedisModule_KeyType")(self.key) }.into()
    }

    /// The key's string value, read in place; `None` for a key of another type (or none).
    pub(crate) fn string(&self) -> Option<&[u8]> {
        if self.key_type() != KeyType::String {
            return None;
        }
        let mut len = 0;
        let ptr = raw::string_dma(self.key, &mut len, raw::KeyMode::READ);
        if ptr.is_null() {
            return None;
        }
        // SAFETY: RM_StringDMA returned the value's buffer of `len` bytes; it stays valid
        // while the key is open and unwritten, which the borrow of `self` ensures (every
        // write takes `&mut self`).
        Some(unsafe { std::slice::from_raw_parts(ptr.cast::<u8>(), len) })
    }

    /// Writes `value` as the key's string, replacing whatever the key held, with the
    /// expiry `expiry` says, and replicates the write as its effect: `SET name value`
    /// followed by `PXAT at_ms`, `KEEPTTL`, or nothing. Every write of a limiter key the
    /// module makes goes through here (a check's state, a refund, a block marker).
    pub(crate) fn write(
        &mut self,
        name: &RedisString,
        value: &[u8],
        expiry: Expiry,
    ) -> Result<(), String> {
        // Decided before the write: `StringSet` drops the key's expiry.
        let expiry = match expiry {
            Expiry::AtLeast(at_ms) => Expiry::At(
                self.abs_expire()
                    .and_then(|at| u64::try_from(at).ok())
                    .map_or(at_ms, |at| at.max(at_ms)),
            ),
            other => other,
        };
        let mut kept = None;
        let replaced = match self.buffer_of_len(value.len()) {
            // The common case, a key checked again: its buffer rewritten (resized first
            // when a slot was taken or freed), nothing allocated for the key, its expiry
            // untouched.
            Some(buffer) => {
                buffer.copy_from_slice(value);
                false
            }
            // A new key, or one of another type: a new string.
            None => {
                // `StringSet` replaces the key, expiry included: one to keep is read first.
                if expiry == Expiry::Kept {
                    kept = self.abs_expire();
                }
                let string = RedisString::create_from_slice(ptr::null_mut(), value);
                if raw::string_set(self.key, string.inner) != raw::Status::Ok {
                    return Err("RLSTATE the state could not be written".to_owned());
                }
                true
            }
        };
        defer_set(name, value, expiry);
        let at = match expiry {
            Expiry::At(at_ms) | Expiry::AtLeast(at_ms) => {
                c_longlong::try_from(at_ms).unwrap_or(c_longlong::MAX)
            }
            Expiry::Kept => match (kept, replaced) {
                (Some(at), true) => at,
                _ => return Ok(()),
            },
            Expiry::Never => {
                // SAFETY: as in `Held::of` (the API's function pointers).
                let set_expire =
                    unsafe { raw::RedisModule_SetExpire }.expect("RedisModule_SetExpire");
                // SAFETY: `self.key` is open for writing and holds the string just written.
                let status =
                    unsafe { set_expire(self.key, c_longlong::from(raw::REDISMODULE_NO_EXPIRE)) };
                return if status == raw::Status::Ok as i32 {
                    Ok(())
                } else {
                    Err("RLSTATE the state's expiry could not be removed".to_owned())
                };
            }
        };
        // SAFETY: as in `Held::of` (the API's function pointers).
        let set_abs_expire =
            unsafe { raw::RedisModule_SetAbsExpire }.expect("RedisModule_SetAbsExpire");
        // SAFETY: `self.key` is open for writing and holds the string just written.
        if unsafe { set_abs_expire(self.key, at) } != raw::Status::Ok as i32 {
            return Err("RLSTATE the state's expiry could not be set".to_owned());
        }
        Ok(())
    }

    /// Writes `states` (after a commit, a refund or a debt under `rules`) as [`write`]
    /// does, encoded by [`packed::encode_state`] with the log marker's time `log_until`.
    /// The encoding goes through the command thread's one buffer, so that no write
    /// allocates a vector of its own (an allocation and its free cost about a twentieth
    /// of an edit in a batch).
    ///
    /// [`write`]: Self::write
    pub(crate) fn write_state(
        &mut self,
        name: &RedisString,
        header: &Header,
        rules: &PackedRules,
        states: &[RuleState],
        log_until: u64,
        expiry: Expiry,
    ) -> Result<(), String> {
        thread_local! {
            static BUFFER: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
        }
        // Taken, not borrowed: nothing below can find it in use.
        let mut buffer = BUFFER.take();
        buffer.clear();
        packed::encode_state(&mut buffer, header, rules, states, log_until);
        let written = self.write(name, &buffer, expiry);
        BUFFER.set(buffer);
        written
    }

    /// The key's expiry as an absolute time in ms, when it has one.
    fn abs_expire(&self) -> Option<c_longlong> {
        // SAFETY: as in `Held::of` (the API's function pointers).
        let get_abs_expire =
            unsafe { raw::RedisModule_GetAbsExpire }.expect("RedisModule_GetAbsExpire");
        // SAFETY: `self.key` is open until `self` is dropped; RM_GetAbsExpire takes any
        // open key and answers REDISMODULE_NO_EXPIRE for one without an expiry (or none).
        let at = unsafe { get_abs_expire(self.key) };
        (at != c_longlong::from(raw::REDISMODULE_NO_EXPIRE)).then_some(at)
    }

    /// The value's buffer for writing, when the key holds a string: resized to `len`
    /// bytes in place when it has another length (`StringTruncate` reallocates the
    /// buffer alone, where `StringSet` would replace the key's object and expiry).
    fn buffer_of_len(&mut self, len: usize) -> Option<&mut [u8]> {
        if self.key_type() != KeyType::String {
            return None;
        }
        let mut have = 0;
        let mut ptr = raw::string_dma(self.key, &mut have, raw::KeyMode::WRITE);
        if ptr.is_null() {
            return None;
        }
        if have != len {
            if raw::string_truncate(self.key, len) != raw::Status::Ok {
                return None;
            }
            ptr = raw::string_dma(self.key, &mut have, raw::KeyMode::WRITE);
            if ptr.is_null() || have != len {
                return None;
            }
        }
        // SAFETY: RM_StringDMA in write mode returned the value's own buffer (unshared)
        // of `len` bytes, valid while the key is open and not resized; the borrow of
        // `self` ensures both.
        Some(unsafe { std::slice::from_raw_parts_mut(ptr.cast::<u8>(), len) })
    }
}

/// When a written key expires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Expiry {
    /// At this time, in ms since the Unix epoch: primary and replicas expire the key at
    /// the same millisecond (`SET .. PXAT`).
    At(u64),
    /// When it did before the write (`SET .. KEEPTTL`): a refund only makes a state
    /// expire sooner in truth, so its expiry can stay.
    Kept,
    /// Never: a block without end (`SET` without an expiry).
    Never,
    /// At this time or when it did before the write, whichever is later: a renewed slot
    /// makes a state matter longer, never shorter.
    AtLeast(u64),
}

/// The script a replica runs for a command's state writes: for each key, in order,
/// `SET key value` with `PXAT` the time after the value, `KEEPTTL` for `k`, or no
/// expiry for an empty one. The values and times come in one argument, each a value's
/// and a time's lengths (two 4-byte little-endian numbers) and their bytes. Replicas,
/// the AOF and every server without the module run it alike.
const WRITES_SCRIPT: &[u8] = b"local writes, at = ARGV[1], 1 \
for _, key in ipairs(KEYS) do \
local n, m, from = struct.unpack('<I4I4', writes, at) \
local value, expiry = writes:sub(from, from + n - 1), writes:sub(from + n, from + n + m - 1) \
at = from + n + m \
if expiry == 'k' then redis.call('SET', key, value, 'KEEPTTL') \
elseif expiry == '' then redis.call('SET', key, value) \
else redis.call('SET', key, value, 'PXAT', expiry) end end";

/// A string this module holds a reference to, freed when dropped.
struct Held(*mut raw::RedisModuleString);

impl Held {
    /// A new reference to `string`.
    fn of(string: *mut raw::RedisModuleString) -> Self {
        // SAFETY: the module API's function pointers are written once, when Redis loads
        // the module, before any command runs; `string` is a live Redis string, whose
        // count of references RM_RetainString (context NULL) raises by one.
        unsafe {
            raw::RedisModule_RetainString.expect("RedisModule_RetainString")(
                ptr::null_mut(),
                string,
            );
        }
        Held(string)
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        // SAFETY: `self.0` holds one reference of this module's, given up here once.
        unsafe {
            raw::RedisModule_FreeString.expect("RedisModule_FreeString")(ptr::null_mut(), self.0);
        }
    }
}

/// The state writes of the running command, not yet replicated: their keys, and their
/// values and expiries as [`WRITES_SCRIPT`] reads them. Kept across commands, so that
/// its buffers are allocated once.
#[derive(Default)]
struct Writes {
    keys: Vec<Held>,
    values: Vec<u8>,
}

thread_local! {
    /// Commands run on Redis's main thread, one at a time: what the running one wrote.
    static WRITES: std::cell::RefCell<Writes> = std::cell::RefCell::default();
    /// [`WRITES_SCRIPT`], referenced rather than created per command; never freed, as
    /// `PXAT`.
    static SCRIPT: std::mem::ManuallyDrop<RedisString> = std::mem::ManuallyDrop::new(
        RedisString::create_from_slice(ptr::null_mut(), WRITES_SCRIPT),
    );
}

/// Keeps the write of `name` for [`replicate_writes`] at the command's end.
fn defer_set(name: &RedisString, value: &[u8], expiry: Expiry) {
    let mut digits = [0; 20];
    let expiry: &[u8] = match expiry {
        Expiry::At(at_ms) | Expiry::AtLeast(at_ms) => decimal(at_ms, &mut digits),
        Expiry::Kept => b"k",
        Expiry::Never => b"",
    };
    let key = Held::of(name.inner);
    WRITES.with_borrow_mut(|writes| {
        writes.keys.push(key);
        for part in [value, expiry] {
            // No client's bytes reach here: every value the module writes is one it
            // encoded (a state, at most `packed::MAX_STATE_BYTES`, or a block marker of
            // at most 20 digits), and an expiry is at most 20 digits.
            let len = u32::try_from(part.len()).expect("a state is far below 4 GiB");
            writes.values.extend_from_slice(&len.to_le_bytes());
        }
        writes.values.extend_from_slice(value);
        writes.values.extend_from_slice(expiry);
    });
}

/// `n` in decimal, written at the end of `digits`.
fn decimal(mut n: u64, digits: &mut [u8; 20]) -> &[u8] {
    let mut at = digits.len();
    loop {
        at -= 1;
        // Below 10.
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return &digits[at..];
        }
    }
}

/// Replicates the state writes the running command made so far, in the order it made
/// them: several as one `EVAL` of [`WRITES_SCRIPT`], where a `SET` each costs the server
/// a lookup of the command by name and a vector of new strings per write (about a fifth
/// of a committed check, BENCHMARKS.md), these cost it one lookup and two strings per
/// command; one as its `SET`. Called when a command ends, and before any other write is
/// replicated, so that replicas apply every write in the primary's order. Where the
/// server has no `EVAL` to replicate (renamed away), each write goes as its own `SET`.
pub(crate) fn replicate_writes(ctx: &Context) {
    WRITES.with_borrow_mut(|writes| {
        if writes.keys.is_empty() {
            return;
        }
        replicate_all(ctx, writes);
        writes.keys.clear();
        writes.values.clear();
    });
}

fn replicate_all(ctx: &Context, writes: &Writes) {
    let raw_ctx = ctx.get_raw();
    let keys: SmallVec<[_; 64]> = writes.keys.iter().map(|key| key.0).collect();
    // One write goes as its `SET`: the same one lookup of a command, and fewer strings.
    if keys.len() > 1 && replicate_eval(raw_ctx, &keys, &writes.values) {
        return;
    }
    let mut rest = writes.values.as_slice();
    for key in &keys {
        let replicated = next_write(rest).is_some_and(|(value, expiry, after)| {
            rest = after;
            replicate_set(raw_ctx, *key, value, expiry) == raw::Status::Ok as i32
        });
        if !replicated {
            ctx.log_warning("ratelimit: a state's write could not be replicated");
        }
    }
}

/// The first write of `values` as [`defer_set`] lays them out (a value's and an
/// expiry's lengths, then their bytes), and the writes after it.
fn next_write(values: &[u8]) -> Option<(&[u8], &[u8], &[u8])> {
    let (n, rest) = values.split_first_chunk::<4>()?;
    let (m, rest) = rest.split_first_chunk::<4>()?;
    let (value, rest) = rest.split_at_checked(usize::try_from(u32::from_le_bytes(*n)).ok()?)?;
    let (expiry, rest) = rest.split_at_checked(usize::try_from(u32::from_le_bytes(*m)).ok()?)?;
    Some((value, expiry, rest))
}

/// Replicates the writes of `keys`, their values and expiries `values` as
/// [`WRITES_SCRIPT`] reads them, as one `EVAL` of it; `false` where the server has no
/// `EVAL` to replicate.
fn replicate_eval(
    raw_ctx: *mut raw::RedisModuleCtx,
    keys: &[*mut raw::RedisModuleString],
    values: &[u8],
) -> bool {
    // SAFETY: as in `Held::of`.
    let replicate = unsafe { raw::RedisModule_Replicate }.expect("RedisModule_Replicate");
    // SAFETY: the format `slvb` takes a RedisModuleString* (the script), a long long
    // (the number of keys), a vector (a pointer to RedisModuleString*s and their count),
    // then a buffer (a pointer and its length, copied into a new string); every string
    // and the buffer are alive for the call, and Redis takes references of its own.
    let status = SCRIPT.with(|script| unsafe {
        replicate(
            raw_ctx,
            c"EVAL".as_ptr(),
            c"slvb".as_ptr(),
            script.inner,
            c_longlong::try_from(keys.len()).unwrap_or(c_longlong::MAX),
            keys.as_ptr(),
            keys.len(),
            values.as_ptr().cast::<c_char>(),
            values.len(),
        )
    });
    status == raw::Status::Ok as i32
}

/// Replicates `SET name value` with `expiry`'s option: `PXAT expiry`, `KEEPTTL` for
/// `k`, nothing for an empty one.
fn replicate_set(
    ctx: *mut raw::RedisModuleCtx,
    name: *mut raw::RedisModuleString,
    value: &[u8],
    expiry: &[u8],
) -> i32 {
    // SAFETY: as in `Held::of`.
    let replicate = unsafe { raw::RedisModule_Replicate }.expect("RedisModule_Replicate");
    let set = c"SET".as_ptr();
    let (v, n) = (value.as_ptr().cast::<c_char>(), value.len());
    // SAFETY, for each call below: its format names what follows it, in order: `s` a
    // RedisModuleString* (Redis takes a reference), `b` a buffer as a pointer and its
    // length (copied into a new string), `c` a C string; every string and buffer is
    // alive for the call.
    match expiry {
        b"k" => unsafe { replicate(ctx, set, c"sbc".as_ptr(), name, v, n, c"KEEPTTL".as_ptr()) },
        b"" => unsafe { replicate(ctx, set, c"sb".as_ptr(), name, v, n) },
        at => PXAT.with(|pxat| unsafe {
            replicate(
                ctx,
                set,
                c"sbsb".as_ptr(),
                name,
                v,
                n,
                pxat.inner,
                at.as_ptr().cast::<c_char>(),
                at.len(),
            )
        }),
    }
}

impl Drop for StateKey<'_> {
    fn drop(&mut self) {
        raw::close_key(self.key);
    }
}

impl std::fmt::Debug for StateKey<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateKey").finish_non_exhaustive()
    }
}

/// The slots a Cluster node found, within one call, that it serves and is not moving:
/// a later check of such a slot in the same call needs no question, since a slot's state
/// cannot change while the command runs.
pub(crate) struct StableSlots([u64; 16384 / 64]);

impl StableSlots {
    pub(crate) fn new() -> Self {
        Self([0; 16384 / 64])
    }

    fn contains(&self, slot: u16) -> bool {
        self.0[usize::from(slot / 64)] >> (slot % 64) & 1 == 1
    }

    fn insert(&mut self, slot: u16) {
        self.0[usize::from(slot / 64)] |= 1 << (slot % 64);
    }
}

/// Whether this Cluster node serves the slot of a check's `keys`: an error message that
/// says why not, for the check's `RLMOVED` entry.
///
/// The keys must share one slot (the store gives a check's keys one hash tag), which is
/// checked here; then one of them goes through the command table as `EXISTS`, which Redis
/// refuses for a slot the node does not serve, or one migrating away whose key has left
/// (the redirection a client would get): with an error reply on Redis 7.2 and later
/// (`E`), without a reply before. The module API has no cheaper way to ask; one key by
/// reference, and the call made here rather than through the `redis-module` crate's
/// wrapping, costs about a third less than the keys through `Context::call_ext`.
///
/// A key that is absent yet served (`EXISTS` answers 0) tells that its slot is neither
/// migrating away (the server would have sent the client to the other node) nor
/// importing (the store never sends `ASKING`): the slot goes into `stable`, and the
/// call's later checks of it skip the question. A key that exists tells nothing of the
/// slot's other keys while it migrates, so the next check asks again.
pub(crate) fn served(
    ctx: &Context,
    keys: &[&RedisString],
    stable: &mut StableSlots,
) -> Result<(), String> {
    let Some((first, rest)) = keys.split_first() else {
        return Ok(());
    };
    let slot = key_slot(first.as_slice());
    if rest.iter().any(|key| key_slot(key.as_slice()) != slot) {
        return Err("CROSSSLOT the check's keys are not in one slot".to_owned());
    }
    if stable.contains(slot) {
        return Ok(());
    }
    // SAFETY: as in `Held::of` (the API's function pointers).
    let call = unsafe { raw::RedisModule_Call }.expect("RedisModule_Call");
    // SAFETY: the format `sE` takes one RedisModuleString*, which follows it (`E`: errors
    // as replies); the reply, when there is one, is freed below and not used after.
    let reply = unsafe {
        call(
            ctx.get_raw(),
            c"EXISTS".as_ptr(),
            c"sE".as_ptr(),
            first.inner,
        )
    };
    if reply.is_null() {
        return Err("this node does not serve the keys' slot".to_owned());
    }
    let answer = match raw::call_reply_type(reply) {
        raw::ReplyType::Integer => {
            if raw::call_reply_integer(reply) == 0 {
                stable.insert(slot);
            }
            Ok(())
        }
        raw::ReplyType::Error => Err(raw::call_reply_string(reply).unwrap_or_default()),
        _ => Err("this node does not serve the keys' slot".to_owned()),
    };
    raw::free_call_reply(reply);
    answer
}

/// Whether this node holds the key `name` (a live one): a Cluster node serves a
/// command on a key it holds, whatever its slot's migration state, so an edit of such a
/// key needs no [`served`] question. `false` where the server has no `KeyExists`
/// (before Redis 7), so that the question is asked.
pub(crate) fn exists_here(ctx: &Context, name: &RedisString) -> bool {
    key_exists(ctx, name).unwrap_or(false)
}

/// Whether the key `name` may exist here: `false` only when the server says it does not
/// (a live key), which costs a lookup and no open key; `true` where the server has no
/// `KeyExists` (before Redis 7), so that the caller opens it.
pub(crate) fn may_exist(ctx: &Context, name: &RedisString) -> bool {
    key_exists(ctx, name).unwrap_or(true)
}

/// Whether the key `name` exists (a live one), as `RedisModule_KeyExists` says; `None`
/// where the server has none (before Redis 7).
fn key_exists(ctx: &Context, name: &RedisString) -> Option<bool> {
    // SAFETY: as in `Held::of`.
    let key_exists = unsafe { raw::RedisModule_KeyExists }?;
    // SAFETY: `name` is a live Redis string; RM_KeyExists looks the key up without
    // opening it or touching its access time.
    Some(unsafe { key_exists(ctx.get_raw(), name.inner) != 0 })
}

/// A key's Cluster slot, as Redis computes it: CRC16 (XMODEM) of its hash tag, or of the
/// whole key, modulo 16384.
fn key_slot(key: &[u8]) -> u16 {
    crc16::State::<crc16::XMODEM>::calculate(hash_tag(key).unwrap_or(key)) & 0x3fff
}

/// A key's hash tag, as Redis reads it: what is between its first `{` and the next `}`,
/// when that is not empty.
pub(crate) fn hash_tag(key: &[u8]) -> Option<&[u8]> {
    let open = key.iter().position(|&b| b == b'{')?;
    let inside = &key[open + 1..];
    let close = inside.iter().position(|&b| b == b'}')?;
    (close > 0).then_some(&inside[..close])
}
