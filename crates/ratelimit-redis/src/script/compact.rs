//! The compact form of a batch for the native module (its batch protocol 1:
//! `RATELIMIT.CHECK_STATES numkeys state.. refs packed..` on one server,
//! `RATELIMIT.CHECK_LOCAL_STATES 0 refs packed.. state..` on one Cluster node): one
//! argument per check, its state key (the module derives the block marker's and the
//! log's names, which differ in the last byte only), and the checks' packed values once
//! each, referred to from one `refs` argument. Reading an argument from the socket and
//! freeing it costs Redis about 600 instructions; the older form sends three or four per
//! check.
//!
//! `refs` holds [`packed::REF_LEN`] bytes per check ([`packed::write_ref`]): the index
//! of its packed value among the distinct ones (one byte: at most [`MAX_DISTINCT`] per
//! call; a batch of more goes in the older form), then its deadline. The deadline is the one value that differs between the checks of a batch (each
//! caller's timeout runs from its own call), so it travels in `refs` and the packed
//! values are told apart without it; the module ignores the packed values' own.
//!
//! Also the older form's key counts, which both forms' builders share, and the compact
//! arguments turned back into the older form's, for a server whose module turned out not
//! to know the compact form (a node restarted with an older module).

use std::collections::HashMap;
use std::ops::Range;

use ratelimit_core::packed::{self, Header, REF_LEN};

/// The most distinct packed values one compact call refers to (a one-byte index).
pub(crate) const MAX_DISTINCT: usize = 256;

/// Where a packed check holds its deadline: the header's last value.
const DEADLINE: Range<usize> = 8 * (packed::HEADER - 1)..8 * packed::HEADER;

/// A packed check without its deadline: the bytes before it and after it.
type SansDeadline<'p> = (&'p [u8], &'p [u8]);

/// A packed check without its deadline: what the checks sharing a packed value share.
fn sans_deadline(pack: &[u8]) -> SansDeadline<'_> {
    match (pack.get(..DEADLINE.start), pack.get(DEADLINE.end..)) {
        (Some(head), Some(tail)) => (head, tail),
        _ => (pack, &[]),
    }
}

/// The `refs` of checks with the packed values `packs`, and the distinct packed values
/// they refer to, in order of first use; `None` when there are more than
/// [`MAX_DISTINCT`].
pub(crate) fn refs<'p>(
    packs: impl Iterator<Item = &'p [u8]>,
    checks: usize,
) -> Option<(Vec<u8>, Vec<&'p [u8]>)> {
    let mut refs = Vec::with_capacity(checks * REF_LEN);
    let mut distinct: Vec<&'p [u8]> = Vec::new();
    // Most batches carry one rule set at one cost: the last check's value is tried
    // first, the map only when there are several.
    let mut index: HashMap<SansDeadline<'p>, u8> = HashMap::new();
    let mut last: Option<(SansDeadline<'p>, u8)> = None;
    for pack in packs {
        let key = sans_deadline(pack);
        let i = match last {
            Some((seen, i)) if seen == key => i,
            _ => match index.get(&key) {
                Some(&i) => i,
                None => {
                    if distinct.len() == MAX_DISTINCT {
                        return None;
                    }
                    let i = distinct.len() as u8;
                    distinct.push(pack);
                    index.insert(key, i);
                    i
                }
            },
        };
        last = Some((key, i));
        let deadline = packed::value(pack, packed::HEADER - 1).filter(|&d| d > 0);
        packed::write_ref(&mut refs, i, deadline);
    }
    Some((refs, distinct))
}

/// The older form's key count of each check, from its state key's name and its number
/// of keys (2, or 3 with a sliding log): `b'2'`/`b'3'`, and for `check_many`
/// (`declared`) 2 more for a check whose client key an earlier check of the batch has,
/// as those read their keys again after it (a hash set here costs less than the table
/// that would find them in Lua).
pub(crate) fn key_counts<'n>(
    checks: impl Iterator<Item = (&'n [u8], usize)>,
    count: usize,
    declared: bool,
) -> Vec<u8> {
    let mut seen = std::collections::HashSet::with_capacity(if declared { count } else { 0 });
    checks
        .map(|(state, keys)| {
            let again = declared && !seen.insert(state);
            b'0' + keys as u8 + if again { 2 } else { 0 }
        })
        .collect()
}

/// The arguments after the command's name of the older form (`numkeys key.. counts
/// packed..`, or for a node's batch, `local`, `0 counts packed.. key..`) of a compact
/// call's arguments after its name; `None` when they are not a compact call's.
pub(crate) fn expand(args: &[&[u8]], local: bool) -> Option<Vec<Vec<u8>>> {
    let (states, refs, packs) = if local {
        let refs = without_id(args.get(1)?);
        let n = refs.len() / REF_LEN;
        let packs_end = args.len().checked_sub(n)?;
        (&args[packs_end..], refs, args.get(2..packs_end)?)
    } else {
        let n: usize = std::str::from_utf8(args.first()?).ok()?.parse().ok()?;
        let states = args.get(1..1 + n)?;
        let (refs, packs) = args.get(1 + n..)?.split_first()?;
        (states, without_id(refs), packs)
    };
    if refs.len() != states.len() * REF_LEN {
        return None;
    }
    let mut keys: Vec<Vec<u8>> = Vec::with_capacity(3 * states.len());
    let mut checks = Vec::with_capacity(states.len());
    let mut own_packs = Vec::with_capacity(states.len());
    for (state, entry) in states.iter().zip(refs.chunks_exact(REF_LEN)) {
        let (index, deadline) = packed::read_ref(entry)?;
        let mut pack = packs.get(index)?.to_vec();
        pack.get_mut(DEADLINE)?
            .copy_from_slice(&(deadline.unwrap_or(0) as f64).to_le_bytes());
        let log = match packed::parse_edit(&pack) {
            Ok(Some((_, header, _))) => header.log_limit > 0,
            Ok(None) => Header::parse(&pack).ok()?.0.log_limit > 0,
            Err(_) => return None,
        };
        let sibling = |kind: u8| {
            let mut name = state.to_vec();
            *name.last_mut()? = kind;
            Some(name)
        };
        keys.push(sibling(b'b')?);
        keys.push(state.to_vec());
        if log {
            keys.push(sibling(b'l')?);
        }
        checks.push((*state, 2 + usize::from(log)));
        own_packs.push(pack);
    }
    let counts = key_counts(checks.iter().copied(), checks.len(), !local);
    let mut out = Vec::with_capacity(2 + keys.len() + own_packs.len());
    out.push(if local { 0 } else { keys.len() }.to_string().into_bytes());
    if local {
        out.push(counts);
        out.extend(own_packs);
        out.extend(keys);
    } else {
        out.extend(keys);
        out.push(counts);
        out.extend(own_packs);
    }
    Some(out)
}

/// A compact call's `refs` without the call's id, if they carry one.
fn without_id(refs: &[u8]) -> &[u8] {
    if refs.len() % REF_LEN == packed::CALL_ID_LEN % REF_LEN {
        refs.get(..refs.len() - packed::CALL_ID_LEN).unwrap_or(refs)
    } else {
        refs
    }
}

/// The arguments after the command's name of the module's older single check
/// (`block state [log] packed`) of a single compact check's (`state refs packed`);
/// `None` when they are not one's.
pub(crate) fn expand_single(args: &[&[u8]]) -> Option<Vec<Vec<u8>>> {
    let [state, refs, pack] = args else {
        return None;
    };
    let expanded = expand(&[b"1", state, refs, pack], false)?;
    // `numkeys key.. counts packed`: the keys and the packed check.
    let n: usize = std::str::from_utf8(expanded.first()?).ok()?.parse().ok()?;
    let mut out: Vec<Vec<u8>> = expanded.get(1..1 + n)?.to_vec();
    out.push(expanded.get(2 + n)?.clone());
    Some(out)
}

/// A call id: 8 bytes random per process, 8 of a counter, then the flag byte (0: a
/// first send). Unique across a fleet but for a chance of 2^-64 per pair of processes.
pub(crate) fn call_id() -> [u8; packed::CALL_ID_LEN] {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::LazyLock;
    // RandomState seeds from the OS's random source once per process.
    static PROCESS: LazyLock<u64> = LazyLock::new(|| {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos(),
        );
        h.write_u32(std::process::id());
        h.finish()
    });
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut id = [0; packed::CALL_ID_LEN];
    id[..8].copy_from_slice(&PROCESS.to_le_bytes());
    id[8..16].copy_from_slice(&COUNTER.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    id
}

/// A call id as the calls that carry it alone take it (check.lua's `once`, the module's
/// edits of protocol 4): the 16 bytes of [`call_id`] as 32 lowercase hex digits, then
/// the flag byte (0: a first send; 1: sent again). Printable but for the flag: a server
/// that does not know the command echoes its arguments in the error, which a client
/// must be able to parse, and the echo stops at the flag's 0 (C strings).
pub(crate) fn text_call_id() -> [u8; 2 * 16 + 1] {
    let id = call_id();
    let mut text = [0; 2 * 16 + 1];
    for (digit, hex) in text.iter_mut().zip(crate::keys::hex_digits(&id[..16])) {
        *digit = hex;
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use ratelimit_core::RuleSet;

    fn pack(rules: &str, cost: u64, deadline: Option<u64>) -> Vec<u8> {
        let rules: RuleSet = rules.parse().unwrap();
        packed::pack_check(&rules, None, cost, 0, deadline)
    }

    #[test]
    fn checks_differing_in_their_deadline_share_a_packed_value() {
        let a = pack("10/s", 1, Some(1_000));
        let b = pack("10/s", 1, Some(2_000));
        let c = pack("10/s", 2, None);
        let (refs, distinct) = refs([&a[..], &b[..], &c[..], &a[..]].into_iter(), 4).unwrap();
        assert_eq!(distinct, vec![&a[..], &c[..]]);
        let entries: Vec<(usize, Option<u64>)> = refs
            .chunks(REF_LEN)
            .map(|e| packed::read_ref(e).unwrap())
            .collect();
        assert_eq!(
            entries,
            [
                (0, Some(1_000)),
                (0, Some(2_000)),
                (1, None),
                (0, Some(1_000))
            ]
        );
    }

    #[test]
    fn more_than_256_distinct_values_are_refused() {
        let packs: Vec<Vec<u8>> = (1..=257).map(|cost| pack("1000/s", cost, None)).collect();
        assert!(refs(packs.iter().take(256).map(|p| &p[..]), 256).is_some());
        assert!(refs(packs.iter().map(|p| &p[..]), 257).is_none());
    }

    #[test]
    fn a_compact_call_expands_to_the_older_form() {
        let a = pack("10/s", 1, Some(5));
        let log = pack("10/s sliding-log", 1, None);
        let (refs, distinct) = refs([&a[..], &log[..], &a[..]].into_iter(), 3).unwrap();
        let states: [&[u8]; 3] = [b"p:{x}:s", b"p:{y}:s", b"p:{x}:s"];
        let mut args: Vec<&[u8]> = vec![b"3"];
        args.extend(states);
        args.push(&refs);
        args.extend(distinct.iter().copied());
        let many = expand(&args, false).unwrap();
        let s = |t: &str| t.as_bytes().to_vec();
        assert_eq!(
            many,
            [
                s("7"),
                s("p:{x}:b"),
                s("p:{x}:s"),
                s("p:{y}:b"),
                s("p:{y}:s"),
                s("p:{y}:l"),
                s("p:{x}:b"),
                s("p:{x}:s"),
                s("234"),
                a.clone(),
                log.clone(),
                a.clone(),
            ]
        );
        let mut local: Vec<&[u8]> = vec![b"0", &refs];
        local.extend(distinct.iter().copied());
        local.extend(states);
        let node = expand(&local, true).unwrap();
        assert_eq!(node[..2], [s("0"), s("232")]);
        assert_eq!(node[2..5], [a.clone(), log, a]);
        assert_eq!(node[5], s("p:{x}:b"));
        assert_eq!(node.len(), 5 + 7);
        // Not a compact call's arguments.
        assert!(expand(&[b"1", b"p:{x}:s", b"short"], false).is_none());
        assert!(expand(&[b"x"], false).is_none());
        assert!(expand(&[b"0", &[0; REF_LEN]], true).is_none());
    }
}
