//! A limiter key (a check's state, a block marker), read and written through the parts
//! of Redis's key API that the `redis-module` crate does not wrap: the hot path of every
//! committed check, and the one way the module writes a limiter key (checks, refunds and
//! blocks alike, each replicated as a `SET` with its expiry: `PXAT`, `KEEPTTL` or none);
//! and a Cluster node's answer to whether it serves a check's slot.
//!
//! The crate's `RedisKeyWritable` writes a string through `StringTruncate` and a second
//! `StringDMA` (a new key: an object and its buffer allocated, then copied into), sets a
//! relative expiry only, and its `Context::replicate` copies every argument into a new
//! Redis string and builds the argument vector by reallocation. Here a new value is one
//! Redis string handed to the key and to the replicated command alike (`StringSet`), an
//! existing value is rewritten in place (resized first when its length changes), the
//! expiry is the absolute one the replicas receive (`SetAbsExpire`: primary and
//! replicas expire the key at the same millisecond), and `RedisModule_Replicate` gets its arguments as they are (`sbsl`).
//! Together they cut what a write costs the server by a quarter, and a committed check's
//! whole cost by a fifth (new keys) to 29 % (keys checked again; BENCHMARKS.md).
//!
//! This is the module's one place of `unsafe` besides its registration: each block calls
//! one function of Redis's module API on a key this type keeps open or a string its
//! caller holds, or reads the value's buffer while the borrow checker keeps the key
//! unwritten.
#![allow(unsafe_code)]

use std::os::raw::{c_char, c_longlong};
use std::ptr;

use redis_module::{raw, Context, KeyType, RedisString};

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
    ctx: &'a Context,
    key: *mut raw::RedisModuleKey,
}

impl<'a> StateKey<'a> {
    pub(crate) fn open(ctx: &'a Context, name: &RedisString) -> Self {
        let key = raw::open_key(
            ctx.get_raw(),
            name.inner,
            raw::KeyMode::READ | raw::KeyMode::WRITE,
        );
        StateKey { ctx, key }
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
        let rewritten = match self.buffer_of_len(value.len()) {
            // The common case, a key checked again: its buffer rewritten (resized first
            // when a slot was taken or freed), nothing allocated for the key, its expiry
            // untouched.
            Some(buffer) => {
                buffer.copy_from_slice(value);
                None
            }
            // A new key, or one of another type: one string for the key and the
            // replicated command.
            None => {
                // `StringSet` replaces the key, expiry included: one to keep is read first.
                if expiry == Expiry::Kept {
                    kept = self.abs_expire();
                }
                let string = RedisString::create_from_slice(ptr::null_mut(), value);
                if raw::string_set(self.key, string.inner) != raw::Status::Ok {
                    return Err("RLSTATE the state could not be written".to_owned());
                }
                Some(string)
            }
        };
        let value = match &rewritten {
            Some(string) => Value::String(string),
            None => Value::Bytes(value),
        };
        if replicate_set(self.ctx, name, value, expiry) != raw::Status::Ok as i32 {
            return Err("RLSTATE the state's write could not be replicated".to_owned());
        }
        let at = match expiry {
            Expiry::At(at_ms) | Expiry::AtLeast(at_ms) => {
                c_longlong::try_from(at_ms).unwrap_or(c_longlong::MAX)
            }
            Expiry::Kept => match (kept, &rewritten) {
                (Some(at), Some(_)) => at,
                _ => return Ok(()),
            },
            Expiry::Never => {
                // SAFETY: as for RedisModule_Replicate in `replicate_set`.
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
        // SAFETY: as for RedisModule_Replicate in `replicate_set`.
        let set_abs_expire =
            unsafe { raw::RedisModule_SetAbsExpire }.expect("RedisModule_SetAbsExpire");
        // SAFETY: `self.key` is open for writing and holds the string just written.
        if unsafe { set_abs_expire(self.key, at) } != raw::Status::Ok as i32 {
            return Err("RLSTATE the state's expiry could not be set".to_owned());
        }
        Ok(())
    }

    /// The key's expiry as an absolute time in ms, when it has one.
    fn abs_expire(&self) -> Option<c_longlong> {
        // SAFETY: as for RedisModule_Replicate in `replicate_set`.
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

/// The value of a replicated `SET`: the string the key now holds, or the bytes of a
/// value rewritten in place.
enum Value<'a> {
    String(&'a RedisString),
    Bytes(&'a [u8]),
}

/// Replicates `SET name value` with `expiry`'s option, the arguments as they are.
fn replicate_set(ctx: &Context, name: &RedisString, value: Value<'_>, expiry: Expiry) -> i32 {
    // SAFETY: the module API's function pointers are written once, when Redis loads the
    // module, before any command runs.
    let replicate = unsafe { raw::RedisModule_Replicate }.expect("RedisModule_Replicate");
    let ctx = ctx.get_raw();
    let set = c"SET".as_ptr();
    // SAFETY, for each call below: its format names what follows it, in order: `s` a
    // RedisModuleString* (Redis takes a reference), `b` a buffer as a pointer and its
    // length (copied into a new string), `l` a long long; every string and buffer is
    // alive for the call.
    match (value, expiry) {
        (Value::Bytes(bytes), Expiry::At(at_ms) | Expiry::AtLeast(at_ms)) => {
            PXAT.with(|pxat| unsafe {
                replicate(
                    ctx,
                    set,
                    c"sbsl".as_ptr(),
                    name.inner,
                    bytes.as_ptr().cast::<c_char>(),
                    bytes.len(),
                    pxat.inner,
                    c_longlong::try_from(at_ms).unwrap_or(c_longlong::MAX),
                )
            })
        }
        (Value::String(string), Expiry::At(at_ms) | Expiry::AtLeast(at_ms)) => {
            PXAT.with(|pxat| unsafe {
                replicate(
                    ctx,
                    set,
                    c"sssl".as_ptr(),
                    name.inner,
                    string.inner,
                    pxat.inner,
                    c_longlong::try_from(at_ms).unwrap_or(c_longlong::MAX),
                )
            })
        }
        (Value::Bytes(bytes), Expiry::Kept) => unsafe {
            replicate(
                ctx,
                set,
                c"sbc".as_ptr(),
                name.inner,
                bytes.as_ptr().cast::<c_char>(),
                bytes.len(),
                c"KEEPTTL".as_ptr(),
            )
        },
        (Value::String(string), Expiry::Kept) => unsafe {
            replicate(
                ctx,
                set,
                c"ssc".as_ptr(),
                name.inner,
                string.inner,
                c"KEEPTTL".as_ptr(),
            )
        },
        (Value::Bytes(bytes), Expiry::Never) => unsafe {
            replicate(
                ctx,
                set,
                c"sb".as_ptr(),
                name.inner,
                bytes.as_ptr().cast::<c_char>(),
                bytes.len(),
            )
        },
        (Value::String(string), Expiry::Never) => unsafe {
            replicate(ctx, set, c"ss".as_ptr(), name.inner, string.inner)
        },
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
    // SAFETY: as for RedisModule_Replicate in `replicate_set`.
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
    // SAFETY: as for RedisModule_Replicate in `replicate_set`.
    let Some(key_exists) = (unsafe { raw::RedisModule_KeyExists }) else {
        return false;
    };
    // SAFETY: `name` is a live Redis string; RM_KeyExists looks the key up without
    // opening it or touching its access time.
    unsafe { key_exists(ctx.get_raw(), name.inner) != 0 }
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
