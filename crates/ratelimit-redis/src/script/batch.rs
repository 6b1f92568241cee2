//! Checks as the batch functions carry them: a [`CheckJob`] holds one check's key names
//! and packed values until its batch leaves; the calls of `check_many` (one server) and
//! `check_local` (one Cluster node) that decide many jobs in order; and the Cluster slot
//! of a job, by which a Cluster's batch is divided between nodes. The queue that forms
//! the batches is the crate's `batch` module.

use ratelimit_core::RuleSet;

use super::args::{CheckArgs, Time};
use super::load::{Call, Paths, Script, BATCH, CHECK, LOCAL};
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
        let has_log = rules.log_limit() > 0;
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
            packed: CheckArgs::pack(time, cost, ttl_floor_ms, rules),
            rules: rules.len(),
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

    /// The block marker's and the state's names, which every check of the same client
    /// key shares.
    fn shared_names(&self) -> &str {
        &self.names[..self.ends[1]]
    }

    fn key_names(&self) -> impl Iterator<Item = &str> {
        let mut start = 0;
        self.ends[..self.keys].iter().map(move |&end| {
            let name = &self.names[start..end];
            start = end;
            name
        })
    }

    /// The call that decides this check alone: the call of an unbatched check.
    pub(crate) fn single_call<'a>(&self, paths: &'a Paths) -> Call<'a> {
        let mut call = CHECK.call(paths, self.block_name(), self.keys, self.keys + 1);
        for name in self.key_names() {
            call.cmd.arg(name);
        }
        call.cmd.arg(&self.packed[..]);
        call
    }
}

/// The call that decides `jobs` in order, in one run of `check_many`.
pub(crate) fn batch_call<'a, 'j>(
    paths: &'a Paths,
    jobs: impl Iterator<Item = &'j CheckJob> + Clone,
) -> Call<'a> {
    many_call(&BATCH, paths, jobs)
}

/// The call that decides `jobs` in order, in one run of `check_local` on the Cluster
/// node it is sent to: the keys travel as arguments, after the packed values.
pub(crate) fn node_batch_call<'a, 'j>(
    paths: &'a Paths,
    jobs: impl Iterator<Item = &'j CheckJob> + Clone,
) -> Call<'a> {
    many_call(&LOCAL, paths, jobs)
}

fn many_call<'a, 'j>(
    script: &'static Script,
    paths: &'a Paths,
    jobs: impl Iterator<Item = &'j CheckJob> + Clone,
) -> Call<'a> {
    let (count, keys) = jobs
        .clone()
        .fold((0, 0), |(n, keys), job| (n + 1, keys + job.keys));
    let declared = std::ptr::eq(script, *BATCH);
    // A node batch's checks are all of the node serving the first one's slot.
    let first = jobs.clone().next().map_or(&b""[..], CheckJob::block_name);
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
    // Each check's number of keys; `check_many` also learns which checks share their
    // client key with an earlier one (2 more), as those read their keys again after it:
    // a hash set here costs less than the table that would find them there.
    let mut seen = std::collections::HashSet::with_capacity(if declared { count } else { 0 });
    let counts: Vec<u8> = jobs
        .clone()
        .map(|job| {
            let again = declared && !seen.insert(job.shared_names());
            b'0' + job.keys as u8 + if again { 2 } else { 0 }
        })
        .collect();
    call.cmd.arg(counts);
    for job in jobs.clone() {
        call.cmd.arg(&job.packed[..]);
    }
    if !declared {
        for job in jobs {
            for name in job.key_names() {
                call.cmd.arg(name);
            }
        }
    }
    call
}
