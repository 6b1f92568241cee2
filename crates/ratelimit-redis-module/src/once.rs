//! Calls decided once: the replies of recent calls by their id, so that a call whose
//! connection broke before its reply arrived can be sent again and get the reply of the
//! run that happened, or run now if it never did, never run twice.
//!
//! A call of batch protocol 2 carries [`ID_LEN`] bytes after its `refs`: a 16-byte id
//! its sender makes unique, and a byte that is 1 when the call is sent again. Redis runs
//! commands one at a time and drops what a closed connection had not yet sent it, so a
//! call sent again finds its first run recorded here, or there was none. Records are
//! kept [`KEEP_US`] and within [`BUDGET`] bytes, the oldest dropped first: a resent call
//! whose id is not found while records younger than the store's longest resend window
//! were dropped for room cannot tell whether it ran, and is refused (`RLUNKNOWN`,
//! nothing written); the store reports that check failed.
//!
//! The records live in this server's memory only: after a failover, a call resent to
//! the new primary runs there even if the old one ran it and replicated its writes
//! (charged twice, never admitted twice: see the module README).

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::rc::Rc;

/// Bytes of a call's id after its `refs`: 16 of id, then 1 (1: sent again).
pub(crate) const ID_LEN: usize = ratelimit_core::packed::CALL_ID_LEN;

/// How long a reply is kept, in µs on the server's clock: longer than any store waits
/// to send a call again (its timeout, capped at [`RESEND_WINDOW_US`]).
pub(crate) const KEEP_US: u64 = 10_000_000;

/// The longest a store waits before it sends a call again, in µs: a resend whose id is
/// unknown is run when no record younger than this was dropped for room.
pub(crate) const RESEND_WINDOW_US: u64 = 5_000_000;

/// The most bytes the records take (replies and their bookkeeping).
pub(crate) const BUDGET: usize = 16 << 20;

/// Bookkeeping per record beside its reply: the id twice, the map's and the queue's
/// slots, the reply's header.
const OVERHEAD: usize = 96;

type Id = [u8; 16];

#[derive(Default)]
struct Replies {
    map: HashMap<Id, Rc<[u8]>>,
    /// In order of recording: the id, when, and the record's bytes.
    order: VecDeque<(Id, u64, usize)>,
    bytes: usize,
    /// The newest recording time among records dropped for room (not for age).
    dropped_young: u64,
}

thread_local! {
    // Commands run on Redis's main thread, one at a time.
    static REPLIES: RefCell<Replies> = RefCell::new(Replies::default());
}

/// A call's id and whether it is sent again, from the [`ID_LEN`] bytes after its refs.
pub(crate) fn parse_id(bytes: &[u8]) -> Option<(Id, bool)> {
    let (id, flag) = bytes.split_at_checked(16)?;
    let id: Id = id.try_into().ok()?;
    match flag {
        [0] => Some((id, false)),
        [1] => Some((id, true)),
        _ => None,
    }
}

/// Bytes of an edit's call id (protocol 4), its last argument: the 16-byte id as 32
/// lowercase hex digits, then the flag byte (1: sent again). Printable but for the flag:
/// a server without the module echoes an unknown command's arguments in its error, which
/// the client must parse; the echo stops at a first send's flag, 0.
pub(crate) const TEXT_ID_LEN: usize = 2 * 16 + 1;

/// An edit's call id and whether it is sent again, from its [`TEXT_ID_LEN`] bytes.
pub(crate) fn parse_text_id(bytes: &[u8]) -> Option<(Id, bool)> {
    let (hex, flag) = bytes.split_at_checked(2 * 16)?;
    let mut id: Id = [0; 16];
    for (byte, pair) in id.iter_mut().zip(hex.chunks_exact(2)) {
        let digit = |c: u8| match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            _ => None,
        };
        *byte = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    match flag {
        [0] => Some((id, false)),
        [1] => Some((id, true)),
        _ => None,
    }
}

/// What to do with a call of id `id`.
pub(crate) enum Seen {
    /// It ran: its reply.
    Ran(Rc<[u8]>),
    /// It did not run: run it.
    New,
    /// Sent again, and whether it ran cannot be told (its record may have been dropped
    /// for room): refuse it.
    Unknown,
}

/// Whether the call `id` ran, at `now` µs.
pub(crate) fn seen(id: &Id, resent: bool, now: u64) -> Seen {
    REPLIES.with(|r| {
        let mut r = r.borrow_mut();
        r.expire(now);
        match r.map.get(id) {
            Some(reply) => Seen::Ran(reply.clone()),
            None if resent && r.dropped_young + RESEND_WINDOW_US > now => Seen::Unknown,
            None => Seen::New,
        }
    })
}

/// Records the reply of the call `id`, which ran at `now` µs.
pub(crate) fn record(id: Id, reply: &[u8], now: u64) {
    let size = reply.len() + OVERHEAD;
    if size > BUDGET {
        return;
    }
    REPLIES.with(|r| {
        let mut r = r.borrow_mut();
        while r.bytes + size > BUDGET {
            let Some((old, at, bytes)) = r.order.pop_front() else {
                break;
            };
            r.map.remove(&old);
            r.bytes -= bytes;
            r.dropped_young = r.dropped_young.max(at);
        }
        if r.map.insert(id, Rc::from(reply)).is_none() {
            r.order.push_back((id, now, size));
            r.bytes += size;
        }
    });
}

impl Replies {
    fn expire(&mut self, now: u64) {
        while let Some(&(id, at, bytes)) = self.order.front() {
            if at + KEEP_US > now {
                break;
            }
            self.order.pop_front();
            self.map.remove(&id);
            self.bytes -= bytes;
        }
    }
}

/// The records kept: how many, and their bytes.
pub(crate) fn usage() -> (usize, usize) {
    REPLIES.with(|r| {
        let r = r.borrow();
        (r.map.len(), r.bytes)
    })
}
