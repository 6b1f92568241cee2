//! Many checks per Redis call: checks that queue while a call is in flight leave
//! together as one call of `check_many`, which decides them in order, each as atomically
//! as alone. The edits of a state after its check (a charge given back, debt, a slot
//! released or renewed) queue here too, as jobs of their own kind (see
//! `CheckJob::edit`), and leave in the same calls in their turn.
//!
//! No timer by default: a batch is whatever queued, so a lone check leaves at once (as
//! one plain `check` call, exactly what an unbatched store sends, straight from the
//! caller's task when no call is in flight) and latency at low concurrency does not
//! grow. Under load, the calls in flight are bounded (one per
//! connection) and checks arriving meanwhile wait in the queue for the next call, up to
//! the batch size; `batch_wait` optionally holds a batch open a little longer to fill it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;

use redis::Value;
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};

use crate::error::{classify, ran_nothing, RedisStoreError};
use crate::script::{
    batch_call, function_missing, node_batch_call, unknown_command, CheckJob, CheckReply, Request,
};
use crate::shared::Shared;
use crate::transport::{Nodes, Transport};

/// How a store batches.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Settings {
    /// The most checks in one call.
    pub(crate) max: usize,
    /// How long a batch waits for more checks once its first arrived (none by default).
    pub(crate) wait: Option<Duration>,
    /// Calls in flight at once.
    pub(crate) in_flight: usize,
}

/// A check waiting for its batch.
struct Job {
    check: CheckJob,
    reply: Reply,
}

/// Who takes a job's reply.
enum Reply {
    /// A caller, until its timeout.
    Caller(oneshot::Sender<Result<Vec<u8>, RedisStoreError>>),
    /// No one: an edit handed over to run in its own time ([`Batcher::detach`]).
    Detached(Detached),
}

impl Reply {
    /// Whether no one waits any more: a caller that stopped waiting is not charged. A
    /// detached edit is always wanted.
    fn is_closed(&self) -> bool {
        match self {
            Self::Caller(reply) => reply.is_closed(),
            Self::Detached(_) => false,
        }
    }
}

/// An edit no caller waits for (a release, a settle's give-back or debt, after the
/// response): its failure is retried while tries are left, then reported.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Detached {
    /// What it is, for the report.
    pub(crate) what: &'static str,
    /// What a failure leaves, for the report.
    pub(crate) leaves: &'static str,
    /// The waits before each try after the first: only for an edit whose second run
    /// changes nothing more (a release frees a slot once), or limits more, never less (a
    /// debt charged twice).
    pub(crate) retries: &'static [Duration],
    /// Tries made so far.
    pub(crate) tried: usize,
}

/// The queue of a store's checks and the task that sends them, the layer between the
/// exact path (which hands it checks and other requests) and the transport (which it
/// hands calls).
#[derive(Debug)]
pub(crate) struct Batcher {
    /// `None` when every check is a call of its own (a batch size of 1).
    queue: Option<mpsc::UnboundedSender<Job>>,
    /// One permit per call that may be in flight.
    slots: Arc<Semaphore>,
    transport: Arc<Transport>,
    shared: Arc<Shared>,
    /// Every check waits in the queue (a batch wait is set), none goes alone at once.
    always_queue: bool,
    /// Jobs queued and not yet in a batch that holds its call's permit: while any are,
    /// a check queues behind them rather than going alone, so that it never overtakes
    /// an edit queued before it (a detached release of its key).
    queued: Arc<AtomicUsize>,
}

impl Batcher {
    /// Starts the sending task (none for a batch size of 1); it ends when the batcher is
    /// dropped.
    pub(crate) fn start(
        transport: Arc<Transport>,
        shared: Arc<Shared>,
        settings: Settings,
    ) -> Self {
        let slots = Arc::new(Semaphore::new(settings.in_flight.max(1)));
        let queued = Arc::new(AtomicUsize::new(0));
        let queue = (settings.max > 1).then(|| {
            let (queue, jobs) = mpsc::unbounded_channel();
            tokio::spawn(dispatch(
                transport.clone(),
                shared.clone(),
                Queue {
                    jobs,
                    requeue: Requeue {
                        queue: queue.downgrade(),
                        queued: queued.clone(),
                    },
                },
                slots.clone(),
                settings,
            ));
            queue
        });
        Self {
            queue,
            slots,
            transport,
            shared,
            always_queue: settings.wait.is_some(),
            queued,
        }
    }

    /// Sends a request that is not a check, within the store's timeout.
    pub(crate) async fn call(&self, request: &Request<'_>) -> Result<Value, RedisStoreError> {
        self.transport.call(request, self.shared.timeout).await
    }

    /// Queues `check` and waits for its reply (the bytes `check` would have answered
    /// alone), at most until the store's timeout. The call that carries it waits longer
    /// for its reply ([`late_wait`]): a check that charged after its caller stopped
    /// waiting is undone ([`deliver`]).
    pub(crate) async fn decide(&self, check: CheckJob) -> Result<Vec<u8>, RedisStoreError> {
        let timeout = self.shared.timeout;
        let (reply, answer) = oneshot::channel();
        let job = Job {
            check,
            reply: Reply::Caller(reply),
        };
        match &self.queue {
            None => self.alone(job, None),
            Some(queue) => {
                // A free slot means no call is in flight and no batch waits for one: the
                // check goes at once, as a call of its own, without waiting for the
                // sending task. (Semaphore permits go to waiters first, so this never
                // overtakes a batch that waits.) With a batch wait, checks wait for
                // company instead.
                let free = (!self.always_queue && self.queued.load(Ordering::Acquire) == 0)
                    .then(|| self.slots.clone().try_acquire_owned().ok())
                    .flatten();
                if free.is_some() {
                    self.alone(job, free);
                } else if !self.enqueue(queue, job) {
                    return Err(RedisStoreError::UnexpectedReply(
                        "the store's sending task has stopped".into(),
                    ));
                }
            }
        }
        match tokio::time::timeout(timeout, answer).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(RedisStoreError::UnexpectedReply(
                "the store's sending task dropped a check".into(),
            )),
            Err(_) => Err(RedisStoreError::Timeout(timeout)),
        }
    }

    /// Queues the edit `check` with the checks, for no caller to wait on: its reply is
    /// read by the batcher, which retries a failure as `detached` allows and reports one
    /// that stays. `false` (nothing queued) for a store that sends each check alone, or
    /// whose sending task has stopped.
    pub(crate) fn detach(&self, check: CheckJob, detached: Detached) -> bool {
        let Some(queue) = &self.queue else {
            return false;
        };
        let reply = Reply::Detached(detached);
        self.shared.detached.start();
        if !self.enqueue(queue, Job { check, reply }) {
            self.shared.detached.end();
            return false;
        }
        true
    }

    /// Resolves once every detached edit queued so far is answered or given up (its
    /// retries included).
    pub(crate) async fn flushed(&self) {
        self.shared.detached.none().await;
    }

    fn enqueue(&self, queue: &mpsc::UnboundedSender<Job>, job: Job) -> bool {
        enqueue(&self.queued, queue, job)
    }

    /// The queue, held weakly, for the jobs a reply makes.
    fn requeue(&self) -> Undo {
        let queue = self.queue.as_ref()?.downgrade();
        let queued = self.queued.clone();
        Some(Requeue { queue, queued })
    }

    /// Sends `job` as a call of its own, holding `slot` until its reply: in a task of its
    /// own, so that its reply is read (and the check undone) when its caller stops
    /// waiting.
    fn alone(&self, job: Job, slot: Option<OwnedSemaphorePermit>) {
        let (transport, shared) = (self.transport.clone(), self.shared.clone());
        let undo = self.requeue();
        tokio::spawn(async move {
            let reply = single(&transport, &shared, &job.check).await;
            deliver(&transport, &shared, &undo, job, reply);
            drop(slot);
        });
    }
}

/// How long a call's reply is awaited: twice the store's timeout, past its callers' own
/// wait, so that a check Redis decided in time but answered late is seen and undone
/// rather than left charged. (A check Redis reaches past its caller's deadline charges
/// nothing.)
fn late_wait(shared: &Shared) -> Duration {
    shared.timeout.saturating_mul(2)
}

/// Where the edits that undo a check, and the retries of a detached edit, go: the queue
/// of the batcher's checks (none for a store that sends each check alone).
type Undo = Option<Requeue>;

/// The queue's sending end, held weakly: nothing is queued once the batcher is gone.
#[derive(Clone)]
struct Requeue {
    queue: mpsc::WeakUnboundedSender<Job>,
    /// As [`Batcher::queued`].
    queued: Arc<AtomicUsize>,
}

impl Requeue {
    /// Queues `job` behind the jobs queued meanwhile; `false` when the batcher or its
    /// sending task is gone.
    fn send(&self, job: Job) -> bool {
        self.queue
            .upgrade()
            .is_some_and(|queue| enqueue(&self.queued, &queue, job))
    }
}

/// Puts `job` in `queue`, counted in `queued` until the sending task takes it into a
/// batch; `false` when the task has stopped.
fn enqueue(queued: &AtomicUsize, queue: &mpsc::UnboundedSender<Job>, job: Job) -> bool {
    queued.fetch_add(1, Ordering::AcqRel);
    if queue.send(job).is_err() {
        queued.fetch_sub(1, Ordering::AcqRel);
        return false;
    }
    true
}

/// Hands `reply` to `job`'s caller. When the caller stopped waiting (its timeout; it
/// decided without the store, by its failure policy) and the reply is a check that
/// admitted, the check must not also count in Redis: its units are given back and its
/// slot released, queued with the checks (`undo`) where the servers take edits in
/// batches (on a module older than that, the charge stays until it drains, and that is
/// reported).
fn deliver(
    transport: &Arc<Transport>,
    shared: &Arc<Shared>,
    undo: &Undo,
    job: Job,
    reply: Result<Vec<u8>, RedisStoreError>,
) {
    let sender = match job.reply {
        Reply::Caller(sender) => sender,
        Reply::Detached(detached) => {
            return detached_done(shared, undo, job.check, detached, reply)
        }
    };
    let Err(Ok(bytes)) = sender.send(reply) else {
        return;
    };
    let edits = job.check.undo(&bytes);
    if edits.is_empty() {
        return;
    }
    if !shared.paths.edits_batched.load(Ordering::Relaxed) {
        tracing::warn!(
            prefix = %shared.prefix,
            "a check whose caller stopped waiting had charged; the server's module is older \
             than edits in batches, so the charge stays until it drains"
        );
        return;
    }
    let Some(queue) = undo.as_ref().filter(|q| q.queue.strong_count() > 0) else {
        tokio::spawn(undo_checks(transport.clone(), shared.clone(), edits));
        return;
    };
    // In order, behind the checks queued meanwhile: the give-back, then the release.
    let mut answers = Vec::with_capacity(edits.len());
    for check in edits {
        let (reply, answer) = oneshot::channel();
        let reply = Reply::Caller(reply);
        if !queue.send(Job { check, reply }) {
            break;
        }
        answers.push(answer);
    }
    tokio::spawn(undone(shared.clone(), answers));
}

/// Reads the reply of a detached edit: a failure goes into the queue again after its
/// wait while tries are left (from a task of its own, so the batch's other replies are
/// not held up), else it is reported, at a bounded rate.
fn detached_done(
    shared: &Arc<Shared>,
    undo: &Undo,
    check: CheckJob,
    detached: Detached,
    reply: Result<Vec<u8>, RedisStoreError>,
) {
    let error = match reply {
        Ok(bytes) => match CheckReply::len(0, &bytes) {
            Some(Err(message)) => check_error(&bytes[message], shared.timeout),
            _ => return shared.detached.end(),
        },
        Err(e) => e,
    };
    if error.to_string().contains(OLDER_MODULE) {
        // As `Exact::edit_job` does for an edit awaited: later edits go alone. This one
        // has no call of its own to fall back on here.
        shared.paths.edits_batched.store(false, Ordering::Relaxed);
    }
    if let (Some(&wait), Some(queue)) = (detached.retries.get(detached.tried), undo.clone()) {
        let job = Job {
            check,
            reply: Reply::Detached(Detached {
                tried: detached.tried + 1,
                ..detached
            }),
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            tokio::time::sleep(wait).await;
            if !queue.send(job) {
                tracing::debug!("a detached edit's retry found the store gone");
                shared.detached.end();
            }
        });
        return;
    }
    shared.detached.end();
    if let Some(count) = shared.detached_log.hit(shared.now_us()) {
        // A call that timed out may have run all the same: what it leaves is unknown.
        let leaves = if matches!(error, RedisStoreError::Timeout(_)) {
            "no answer in time, so it may or may not have run"
        } else {
            detached.leaves
        };
        tracing::warn!(
            prefix = %shared.prefix,
            error = %error,
            tries = detached.tried + 1,
            failures = count,
            "a {} failed: {} (reported at most every 10 s, with the failures since the \
             last report)",
            detached.what,
            leaves
        );
    }
}

/// Waits for the edits that undo a check, queued with the checks, and says how they
/// went. Boxed, as [`undo_checks`].
fn undone(
    shared: Arc<Shared>,
    answers: Vec<oneshot::Receiver<Result<Vec<u8>, RedisStoreError>>>,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
    Box::pin(async move {
        let mut outcome = Ok(());
        for answer in answers {
            outcome = match tokio::time::timeout(late_wait(&shared), answer).await {
                Ok(Ok(Ok(bytes))) => match CheckReply::len(0, &bytes) {
                    Some(Err(message)) => Err(String::from_utf8_lossy(&bytes[message]).into()),
                    _ => Ok(()),
                },
                Ok(Ok(Err(e))) => Err(e.to_string()),
                Ok(Err(_)) => Err("the store's sending task dropped it".to_owned()),
                Err(_) => Err("no answer in time".to_owned()),
            };
            if outcome.is_err() {
                break;
            }
        }
        report_undo(&shared, outcome);
    })
}

/// Sends `undo` (the edits of [`CheckJob::undo`]) in order, each a call of its own.
/// Boxed: the calls' futures would otherwise nest in every spawned call's type, past
/// what rustc lays out by default in the crates that await a check.
fn undo_checks(
    transport: Arc<Transport>,
    shared: Arc<Shared>,
    undo: Vec<CheckJob>,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
    Box::pin(async move {
        let mut outcome = Ok(());
        for edit in undo {
            if let Err(e) = single(&transport, &shared, &edit).await {
                outcome = Err(e.to_string());
                break;
            }
        }
        report_undo(&shared, outcome);
    })
}

/// Says how undoing a check whose caller stopped waiting went: `Err` the failure of the
/// first edit that did not run (those after it were not sent or not awaited).
fn report_undo(shared: &Shared, outcome: Result<(), String>) {
    match outcome {
        Err(error) => tracing::warn!(
            prefix = %shared.prefix,
            error = %error,
            "a check whose caller stopped waiting had charged, and its charge could not be \
             given back: it stays until it drains"
        ),
        Ok(()) => tracing::debug!(
            prefix = %shared.prefix,
            "a check whose caller stopped waiting had charged; its charge was given back"
        ),
    }
}

/// The sending task's end of the queue.
struct Queue {
    jobs: mpsc::UnboundedReceiver<Job>,
    /// The queue's sending end, for the edits that undo or retry a job, and its count
    /// of jobs not yet taken into a batch ([`Batcher::queued`]).
    requeue: Requeue,
}

async fn dispatch(
    transport: Arc<Transport>,
    shared: Arc<Shared>,
    Queue {
        jobs: mut queue,
        requeue,
    }: Queue,
    slots: Arc<Semaphore>,
    settings: Settings,
) {
    let queued = requeue.queued.clone();
    let undo = Some(requeue);
    let max = settings.max.max(1);
    let mut jobs = Vec::with_capacity(max);
    loop {
        let Some(first) = queue.recv().await else {
            return;
        };
        // Then wait for a free slot: what queues meanwhile leaves together.
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        jobs.push(first);
        while jobs.len() < max {
            match queue.try_recv() {
                Ok(job) => jobs.push(job),
                Err(_) => break,
            }
        }
        if let Some(wait) = settings.wait {
            let until = tokio::time::Instant::now() + wait;
            while jobs.len() < max {
                match tokio::time::timeout_at(until, queue.recv()).await {
                    Ok(Some(job)) => jobs.push(job),
                    _ => break,
                }
            }
        }
        // Taken, with the permit of their call held: a check that finds the count at 0
        // and a free permit overtakes none of them.
        queued.fetch_sub(jobs.len(), Ordering::AcqRel);
        let batch = std::mem::replace(&mut jobs, Vec::with_capacity(max));
        let (transport, shared, undo) = (transport.clone(), shared.clone(), undo.clone());
        tokio::spawn(async move {
            send(&transport, &shared, &undo, batch).await;
            drop(slot);
        });
    }
}

/// Sends one batch and hands each check its reply.
async fn send(transport: &Arc<Transport>, shared: &Arc<Shared>, undo: &Undo, mut batch: Vec<Job>) {
    // A caller that stopped waiting is not charged.
    batch.retain(|job| !job.reply.is_closed());
    if batch.len() > 1 && transport.is_cluster() {
        match transport.nodes().await {
            Some(nodes) => return per_node(transport, shared, undo, &nodes, batch).await,
            // The slot map could not be read (a node unreachable): each check alone,
            // routed by its key. A batch of keys of many slots would be refused whole.
            None => {
                join_all(batch.into_iter().map(|job| async move {
                    let reply = single(transport, shared, &job.check).await;
                    deliver(transport, shared, undo, job, reply);
                }))
                .await;
                return;
            }
        }
    }
    if let [job] = &batch[..] {
        let reply = single(transport, shared, &job.check).await;
        if let Some(job) = batch.pop() {
            deliver(transport, shared, undo, job, reply);
        }
        return;
    }
    if batch.is_empty() {
        return;
    }
    let call = batch_call(
        &shared.paths,
        shared.record_keep_ms(),
        batch.iter().map(|job| &job.check),
    );
    let reply = transport
        .call(&Request::Call(call), late_wait(shared))
        .await;
    answer(transport, shared, undo, batch, reply);
}

/// Sends a Cluster's batch as one call per node, the checks of each node in their order.
/// Without functions (before Redis 7), each check goes as a call of its own.
async fn per_node(
    transport: &Arc<Transport>,
    shared: &Arc<Shared>,
    undo: &Undo,
    nodes: &Nodes,
    batch: Vec<Job>,
) {
    let mut groups: Vec<(u16, u16, Vec<Job>)> = Vec::new();
    for job in batch {
        let slot = job.check.slot();
        let node = if shared.paths.functions.load(Ordering::Relaxed) {
            nodes.of(slot)
        } else {
            // Every check a group of its own.
            u16::try_from(groups.len()).unwrap_or(u16::MAX)
        };
        match groups.iter_mut().find(|group| group.0 == node) {
            Some(group) => group.2.push(job),
            None => groups.push((node, slot, vec![job])),
        }
    }
    join_all(
        groups
            .into_iter()
            .map(|(_, slot, jobs)| on_node(transport, shared, undo, slot, jobs)),
    )
    .await;
}

/// Sends `jobs` to the node serving `slot`, then each check the node turned away (its
/// slot is elsewhere now; nothing was charged for it) as a call of its own, in order.
async fn on_node(
    transport: &Arc<Transport>,
    shared: &Arc<Shared>,
    undo: &Undo,
    slot: u16,
    mut jobs: Vec<Job>,
) {
    if jobs.len() == 1 {
        if let Some(job) = jobs.pop() {
            let reply = single(transport, shared, &job.check).await;
            deliver(transport, shared, undo, job, reply);
        }
        return;
    }
    let call = node_batch_call(
        &shared.paths,
        shared.record_keep_ms(),
        jobs.iter().map(|job| &job.check),
    );
    let reply = transport.call_on(slot, &call, late_wait(shared)).await;
    // Only an answer that says nothing ran sends the checks again: a call lost with its
    // connection may have charged them.
    let ran_nothing = match &reply {
        // The node has no functions (before Redis 7), or the function was missing even
        // after loading the library (removed again in between): each check alone falls
        // back to the script form.
        Err(RedisStoreError::Script(e)) if function_missing(e) || unknown_command(e) => true,
        // The node no longer serves the slots, or the Cluster is amid a failover: each
        // check alone goes where its key is served now, once the slots are read again.
        Err(RedisStoreError::Script(e) | RedisStoreError::Connection(e)) if ran_nothing(e) => {
            transport.nodes_stale();
            true
        }
        _ => false,
    };
    if ran_nothing {
        for job in jobs {
            let reply = single(transport, shared, &job.check).await;
            deliver(transport, shared, undo, job, reply);
        }
        return;
    }
    let moved = answer(transport, shared, undo, jobs, reply);
    if !moved.is_empty() {
        transport.nodes_stale();
    }
    for job in moved {
        let reply = single(transport, shared, &job.check).await;
        deliver(transport, shared, undo, job, reply);
    }
}

/// Hands each check of `batch` its part of `reply`; returns the checks a Cluster node
/// turned away unanswered.
fn answer(
    transport: &Arc<Transport>,
    shared: &Arc<Shared>,
    undo: &Undo,
    batch: Vec<Job>,
    reply: Result<Value, RedisStoreError>,
) -> Vec<Job> {
    let timeout = shared.timeout;
    let bytes = match reply {
        Ok(Value::BulkString(bytes)) => bytes,
        Ok(other) => {
            let e = RedisStoreError::UnexpectedReply(format!(
                "the batch script should return a string, got {other:?}"
            ));
            fail_all(transport, shared, undo, batch, &e);
            return Vec::new();
        }
        Err(e) => {
            fail_all(transport, shared, undo, batch, &e);
            return Vec::new();
        }
    };
    let Some(parts) = split(&batch, &bytes) else {
        let e = RedisStoreError::UnexpectedReply(format!(
            "the batch script's reply of {} bytes does not hold {} replies",
            bytes.len(),
            batch.len()
        ));
        fail_all(transport, shared, undo, batch, &e);
        return Vec::new();
    };
    let mut moved = Vec::new();
    for (job, part) in batch.into_iter().zip(parts) {
        let reply = match part {
            Ok(range) => Ok(bytes[range].to_vec()),
            Err(range) if bytes[range.clone()].starts_with(MOVED) => {
                moved.push(job);
                continue;
            }
            Err(range) => Err(check_error(&bytes[range], timeout)),
        };
        deliver(transport, shared, undo, job, reply);
    }
    moved
}

/// What a module older than edits in batches (protocol 5) answers an edit in a batch:
/// its check's parse refuses the header's first value, before anything is read.
pub(crate) const OLDER_MODULE: &str = "injected is 0 or 1";

/// How `check_local` answers a check whose slot the node does not serve.
const MOVED: &[u8] = b"RLMOVED";

/// Sends one check as a call of its own.
async fn single(
    transport: &Transport,
    shared: &Shared,
    check: &CheckJob,
) -> Result<Vec<u8>, RedisStoreError> {
    let reply = transport
        .call(
            &Request::Call(check.single_call(&shared.paths, shared.record_keep_ms())),
            late_wait(shared),
        )
        .await?;
    match reply {
        Value::BulkString(bytes) => Ok(bytes),
        other => Err(RedisStoreError::UnexpectedReply(format!(
            "the check script should return a string, got {other:?}"
        ))),
    }
}

/// Where each check's reply lies in a batch reply: `Ok` a decision's bytes, `Err` an
/// error message's; `None` when the reply does not divide into exactly one per check.
fn split(
    batch: &[Job],
    bytes: &[u8],
) -> Option<Vec<Result<std::ops::Range<usize>, std::ops::Range<usize>>>> {
    let mut parts = Vec::with_capacity(batch.len());
    let mut at = 0;
    for job in batch {
        match CheckReply::len(job.check.rules, &bytes[at..])? {
            Ok(len) => {
                parts.push(Ok(at..at + len));
                at += len;
            }
            Err(message) => {
                parts.push(Err(at + message.start..at + message.end));
                at += message.end;
            }
        }
    }
    (at == bytes.len()).then_some(parts)
}

fn fail_all(
    transport: &Arc<Transport>,
    shared: &Arc<Shared>,
    undo: &Undo,
    batch: Vec<Job>,
    e: &RedisStoreError,
) {
    for job in batch {
        deliver(transport, shared, undo, job, Err(e.clone()));
    }
}

/// The error of one check of a batch, from its message, as if Redis had answered it.
pub(crate) fn check_error(message: &[u8], timeout: Duration) -> RedisStoreError {
    let text: String = String::from_utf8_lossy(message)
        .chars()
        .map(|c| if c == '\r' || c == '\n' { ' ' } else { c })
        .collect();
    match redis::parse_redis_value(format!("-{text}\r\n").as_bytes()).and_then(Value::extract_error)
    {
        Err(e) => classify(e, timeout),
        Ok(_) => RedisStoreError::UnexpectedReply(format!("a check failed: {text}")),
    }
}
