//! Checks as the batch functions carry them: a [`CheckJob`] holds one check's key names
//! and packed values until its batch leaves; the calls of `check_many` (one server) and
//! `check_local` (one Cluster node) that decide many jobs in order; and the Cluster slot
//! of a job, by which a Cluster's batch is divided between nodes. The queue that forms
//! the batches is the crate's `batch` module.

use ratelimit_core::packed::{self, REF_LEN};
use ratelimit_core::RuleSet;

use super::args::{CheckArgs, Time};
use super::compact;
use super::load::{Call, Paths, Script, BATCH, CHECK, LOCAL};
use super::reply::CheckReply;
use crate::keys::{key_slot, KeyNames};

/// One check as a batch carries it: its key names, its packed values, its number of rules.
#[derive(Debug)]
pub(crate) struct CheckJob {
    /// The key names one after the other; each ends at `ends[i]`.
    names: String,
    ends: [usize; 3],
    keys: usize,
    packed: Vec<u8>,
    /// Rules of the check, which the length of its reply depends on.
    pub(crate) rules: usize,
    /// When the check was sent, on the store's reading of the Redis clock: no later
    /// than it charged, the time its charge is given back from when its caller stopped
    /// waiting ([`CheckJob::undo`]).
    pub(crate) sent_at: u64,
}

impl CheckJob {
    /// The check of `key` under `rules` for `cost` units, with keys under `prefix`.
    pub(crate) fn new(
        prefix: &str,
        key: &[u8],
        rules: &RuleSet,
        time: Time,
        cost: u64,
        ttl_floor_ms: u64,
    ) -> Self {
        Self::with_packed(
            prefix,
            key,
            rules.log_limit() > 0,
            CheckArgs::pack(time, cost, ttl_floor_ms, rules),
            rules.len(),
        )
    }

    /// An edit of `key`'s state after its check, carried by a batch in place of a check
    /// ([`packed::Edit`]): for a settle, of the check of `rules` (`None` for a slot's
    /// edit) for `units` units at the injected time `now`. Its reply is `{4, 0 or 1}`
    /// ([`CheckReply::edited`](super::CheckReply::edited)).
    pub(crate) fn edit(
        prefix: &str,
        key: &[u8],
        rules: Option<&RuleSet>,
        edit: packed::Edit,
        now: Option<u64>,
        units: u64,
        ttl_floor_ms: u64,
    ) -> Self {
        let rules = rules.filter(|_| edit.has_rules());
        Self::with_packed(
            prefix,
            key,
            rules.is_some_and(|rules| rules.log_limit() > 0),
            packed::pack_edit(edit, rules, now, units, ttl_floor_ms),
            0,
        )
    }

    /// An edit (see [`edit`](Self::edit)) of the state named `state`, a name of the
    /// store's (`..{tag}:s`, whose block marker's name ends in `b` in its place): a lease's
    /// refund, which knows its state by name.
    pub(crate) fn edit_of_state(
        state: &str,
        rules: &RuleSet,
        edit: packed::Edit,
        now: Option<u64>,
        units: u64,
        ttl_floor_ms: u64,
    ) -> Self {
        let mut names = String::with_capacity(2 * state.len());
        names.push_str(state.strip_suffix('s').unwrap_or(state));
        names.push('b');
        let block = names.len();
        names.push_str(state);
        let end = names.len();
        CheckJob {
            names,
            ends: [block, end, end],
            keys: 2,
            packed: packed::pack_edit(edit, Some(rules), now, units, ttl_floor_ms),
            rules: 0,
            sent_at: 0,
        }
    }

    fn with_packed(prefix: &str, key: &[u8], has_log: bool, packed: Vec<u8>, rules: usize) -> Self {
        let mut names = KeyNames::new(prefix, key);
        let mut all = String::with_capacity(3 * (prefix.len() + 48));
        let mut ends = [0; 3];
        all.push_str(names.block());
        ends[0] = all.len();
        all.push_str(names.state());
        ends[1] = all.len();
        if has_log {
            all.push_str(names.log());
        }
        ends[2] = all.len();
        CheckJob {
            names: all,
            ends,
            keys: 2 + usize::from(has_log),
            packed,
            rules,
            sent_at: 0,
        }
    }

    /// The edits that undo this check, which `reply` says admitted and charged: its
    /// units given back and its slot released, as jobs of the same key (none when it
    /// was refused, a peek, or is no check; for a take, its slot released). For a check
    /// whose caller stopped waiting (a timeout) after it was sent: the caller decided
    /// without it (a failure policy), so it must not also count in Redis.
    pub(crate) fn undo(&self, reply: &[u8]) -> Vec<CheckJob> {
        // The check's header and rules, to read its reply as any check's is read (an
        // edit's packed value is no check: it is undone by nothing).
        let Ok((header, rule_bytes)) = packed::Header::parse(&self.packed) else {
            // A take that its caller stopped waiting for: its slot goes back (its unit
            // stays, as a debt does).
            if let (Ok(Some((packed::Edit::Take, header, _))), Ok(Some(slot))) = (
                packed::parse_edit(&self.packed),
                CheckReply::edit_value(reply),
            ) {
                let edit = packed::Edit::Release { slot };
                let release = packed::pack_edit(edit, None, header.now, 0, header.ttl_floor_ms);
                return vec![self.sibling(release, 2, 0)];
            }
            return Vec::new();
        };
        let Ok(rules) = packed::PackedRules::parse(rule_bytes, &header) else {
            return Vec::new();
        };
        let decision = match CheckReply::decision_from(rules.rules(), reply) {
            Ok(Ok((decision, _))) if decision.is_allowed() => decision,
            _ => return Vec::new(),
        };
        let mut undo = Vec::new();
        if header.cost > 0 {
            // The check's own packed values as a give-back (`packed::Edit`): the op in
            // the first value, the charge's time where the deadline was.
            let mut give_back = self.packed.clone();
            let first = u64::from(header.now.is_some()) + 2;
            let charged_at = header.now.unwrap_or(self.sent_at);
            give_back[..8].copy_from_slice(&(first as f64).to_le_bytes());
            let at = 8 * (packed::HEADER - 1);
            give_back[at..at + 8].copy_from_slice(&(charged_at as f64).to_le_bytes());
            undo.push(self.sibling(give_back, self.keys, 0));
        }
        if let Some(slot) = decision.slot() {
            let edit = packed::Edit::Release { slot };
            let release = packed::pack_edit(edit, None, header.now, 0, header.ttl_floor_ms);
            undo.push(self.sibling(release, 2, 0));
        }
        undo
    }

    /// A job on this job's key names (the first `keys` of them) with its own packed value.
    fn sibling(&self, packed: Vec<u8>, keys: usize, rules: usize) -> CheckJob {
        let names = self.names[..self.ends[keys - 1]].to_owned();
        let mut ends = self.ends;
        for end in &mut ends[keys..] {
            *end = names.len();
        }
        CheckJob {
            names,
            ends,
            keys,
            packed,
            rules,
            sent_at: 0,
        }
    }

    /// The Redis Cluster slot of the check's keys (all share one hash tag).
    pub(crate) fn slot(&self) -> u16 {
        key_slot(self.block_name())
    }

    /// The name of the check's first key, its block marker.
    fn block_name(&self) -> &[u8] {
        &self.names.as_bytes()[..self.ends[0]]
    }

    /// The name of the check's state key, which every check of the same client key
    /// shares (and from which the module derives the others in a compact batch).
    fn state_name(&self) -> &[u8] {
        &self.names.as_bytes()[self.ends[0]..self.ends[1]]
    }

    fn key_names(&self) -> impl Iterator<Item = &str> {
        let mut start = 0;
        self.ends[..self.keys].iter().map(move |&end| {
            let name = &self.names[start..end];
            start = end;
            name
        })
    }

    /// The call that decides this check alone: the call of an unbatched check, decided
    /// once (its records kept `keep_ms` on the Lua functions).
    pub(crate) fn single_call<'a>(&self, paths: &'a Paths, keep_ms: u64) -> Call<'a> {
        // Where the module decides calls once (protocol 2): `state refs packed`, which
        // a lost connection does not fail.
        if let Some(mut call) = CHECK.compact_call(paths, self.block_name(), 1, 3) {
            call.cmd.arg(self.state_name());
            let mut refs = Vec::with_capacity(REF_LEN + packed::CALL_ID_LEN);
            let deadline = packed::value(&self.packed, packed::HEADER - 1).filter(|&d| d > 0);
            packed::write_ref(&mut refs, 0, deadline);
            call.arg_refs_once(refs);
            call.cmd.arg(&self.packed[..]);
            return call;
        }
        let mut call = CHECK.call(paths, self.block_name(), self.keys, self.keys + 1);
        for name in self.key_names() {
            call.cmd.arg(name);
        }
        call.cmd.arg(&self.packed[..]);
        call.arg_once(self.state_str(), keep_ms);
        call
    }

    /// The state key's name as text (every name is printable: see `keys`).
    fn state_str(&self) -> &str {
        &self.names[self.ends[0]..self.ends[1]]
    }
}

/// The call that decides `jobs` in order, in one run of `check_many`, decided once (its
/// record kept `keep_ms` on the Lua functions).
pub(crate) fn batch_call<'a, 'j>(
    paths: &'a Paths,
    keep_ms: u64,
    jobs: impl Iterator<Item = &'j CheckJob> + Clone,
) -> Call<'a> {
    many_call(&BATCH, paths, keep_ms, jobs)
}

/// The call that decides `jobs` in order, in one run of `check_local` on the Cluster
/// node it is sent to: the keys travel as arguments, after the packed values.
pub(crate) fn node_batch_call<'a, 'j>(
    paths: &'a Paths,
    keep_ms: u64,
    jobs: impl Iterator<Item = &'j CheckJob> + Clone,
) -> Call<'a> {
    many_call(&LOCAL, paths, keep_ms, jobs)
}

fn many_call<'a, 'j>(
    script: &'static Script,
    paths: &'a Paths,
    keep_ms: u64,
    jobs: impl Iterator<Item = &'j CheckJob> + Clone,
) -> Call<'a> {
    let (count, keys) = jobs
        .clone()
        .fold((0, 0), |(n, keys), job| (n + 1, keys + job.keys));
    let declared = std::ptr::eq(script, *BATCH);
    // A node batch's checks are all of the node serving the first one's slot.
    let first = jobs.clone().next().map_or(&b""[..], CheckJob::block_name);
    if let Some(call) = compact_call(script, paths, first, count, declared, jobs.clone()) {
        return call;
    }
    let mut call = script.call(
        paths,
        first,
        if declared { keys } else { 0 },
        keys + 1 + count,
    );
    if declared {
        for job in jobs.clone() {
            for name in job.key_names() {
                call.cmd.arg(name);
            }
        }
    }
    let counts = compact::key_counts(
        jobs.clone().map(|job| (job.state_name(), job.keys)),
        count,
        declared,
    );
    call.cmd.arg(counts);
    for job in jobs.clone() {
        call.cmd.arg(&job.packed[..]);
    }
    let mut jobs = jobs;
    // The record beside the first check's keys: on a Cluster, of the slot the node
    // serves, by which the batch went to it.
    let first = jobs.clone().next().map(CheckJob::state_str);
    if !declared {
        for job in jobs.by_ref() {
            for name in job.key_names() {
                call.cmd.arg(name);
            }
        }
    }
    if let Some(first) = first {
        call.arg_once(first, keep_ms);
    }
    call
}

/// The call of `many_call` in the module's compact form (see `script::compact`), when the
/// module serving it takes that form and the checks have at most 256 distinct packed
/// values.
fn compact_call<'a, 'j>(
    script: &'static Script,
    paths: &'a Paths,
    first: &[u8],
    count: usize,
    declared: bool,
    jobs: impl Iterator<Item = &'j CheckJob> + Clone,
) -> Option<Call<'a>> {
    if count == 0 {
        return None;
    }
    let mut call = script.compact_call(
        paths,
        first,
        if declared { count } else { 0 },
        2 + 2 * count,
    )?;
    let (refs, packs) = compact::refs(jobs.clone().map(|job| &job.packed[..]), count)?;
    if declared {
        for job in jobs.clone() {
            call.cmd.arg(job.state_name());
        }
    }
    if paths.once.load(std::sync::atomic::Ordering::Relaxed) {
        call.arg_refs_once(refs);
    } else {
        call.cmd.arg(refs);
    }
    for pack in packs {
        call.cmd.arg(pack);
    }
    if !declared {
        for job in jobs {
            call.cmd.arg(job.state_name());
        }
    }
    Some(call)
}
