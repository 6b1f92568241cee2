//! `N concurrent` in process: a slot held from admission to the end of the response body,
//! released when the body ends or is dropped, when the response future is dropped
//! (cancelled, or the handler panicked), and renewed while a long response runs.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use ratelimit_core::{ManualClock, MemoryStore, RuleSet};
use ratelimit_tower::{GlobalKey, RateLimitLayer};
use tokio::sync::mpsc;
use tower::{Layer, Service, ServiceExt};

/// A gate, and what opens it.
fn gate() -> (mpsc::UnboundedSender<()>, Gate) {
    let (tx, rx) = mpsc::unbounded_channel();
    (tx, Arc::new(Mutex::new(rx)))
}

fn open(tx: &mpsc::UnboundedSender<()>, n: usize) {
    for _ in 0..n {
        tx.send(()).unwrap();
    }
}

const T0: u64 = 1_699_999_200_000_000;

/// Lets chunks of [`Chunks`] bodies through, one per unit sent.
type Gate = Arc<Mutex<mpsc::UnboundedReceiver<()>>>;

/// A body that sends `left` chunks, each once its gate lets one through.
#[derive(Debug)]
struct Chunks {
    gate: Gate,
    left: usize,
}

impl Body for Chunks {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.left == 0 {
            return Poll::Ready(None);
        }
        let passed = self.gate.lock().unwrap().poll_recv(cx);
        match passed {
            Poll::Ready(_) => {
                self.left -= 1;
                Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"x")))))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

fn store(clock: &ManualClock) -> Arc<MemoryStore<ManualClock>> {
    Arc::new(MemoryStore::builder().clock(clock.clone()).build())
}

fn layer(
    store: Arc<MemoryStore<ManualClock>>,
    rules: &str,
) -> RateLimitLayer<Arc<MemoryStore<ManualClock>>, GlobalKey> {
    RateLimitLayer::builder(store, GlobalKey)
        .rules(rules)
        .unwrap()
        .namespace("conc")
        .without_deny_cache()
        .build()
        .unwrap()
}

/// A response whose body sends `chunks` chunks, each once `gate` has a permit for it.
fn chunked(
    gate: &Gate,
    chunks: usize,
) -> impl Service<
    Request<()>,
    Response = Response<Chunks>,
    Error = Infallible,
    Future = std::future::Ready<Result<Response<Chunks>, Infallible>>,
> + Clone {
    let gate = Arc::clone(gate);
    tower::service_fn(move |_: Request<()>| {
        std::future::ready(Ok(Response::new(Chunks {
            gate: Arc::clone(&gate),
            left: chunks,
        })))
    })
}

async fn call<S, B>(svc: &S) -> Response<B>
where
    S: Service<Request<()>, Response = Response<B>> + Clone,
    S::Error: std::fmt::Debug,
{
    svc.clone().oneshot(Request::new(())).await.unwrap()
}

#[tokio::test]
async fn the_slot_goes_when_the_body_ends_or_is_dropped() {
    let clock = ManualClock::new(T0);
    let (tx, gate) = gate();
    let svc = layer(store(&clock), "10/s; 1 concurrent").layer(chunked(&gate, 2));
    let first = call(&svc).await;
    assert_eq!(first.status(), StatusCode::OK);
    let refused = call(&svc).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.headers()["retry-after"], "1");
    // The rate's fields only: the concurrency rule has no item.
    assert_eq!(
        refused.headers()["ratelimit-policy"],
        "\"10-per-1s@conc\";q=10;w=1"
    );
    // Half the body: still held.
    open(&tx, 1);
    let mut body = first.into_body();
    body.frame().await.unwrap().unwrap();
    assert_eq!(call(&svc).await.status(), StatusCode::TOO_MANY_REQUESTS);
    open(&tx, 1);
    body.frame().await.unwrap().unwrap();
    assert!(body.frame().await.is_none(), "the end");
    // Ended, not yet dropped: released already.
    let second = call(&svc).await;
    assert_eq!(second.status(), StatusCode::OK);
    drop(body);
    assert_eq!(call(&svc).await.status(), StatusCode::TOO_MANY_REQUESTS);
    // Dropped before its end (the client went away).
    drop(second);
    assert_eq!(call(&svc).await.status(), StatusCode::OK);
}

#[tokio::test]
async fn a_cancelled_or_panicking_request_frees_its_slot() {
    let clock = ManualClock::new(T0);
    let layer = layer(store(&clock), "1 concurrent timeout=1h");
    let hangs = layer.layer(tower::service_fn(|_: Request<()>| {
        std::future::pending::<Result<Response<Chunks>, Infallible>>()
    }));
    let panics = layer.layer(tower::service_fn(|_: Request<()>| async {
        if true {
            panic!("handler panicked");
        }
        Ok::<Response<Chunks>, Infallible>(Response::new(Chunks {
            gate: gate().1,
            left: 0,
        }))
    }));
    let (_tx, gate) = gate();
    let ok = layer.layer(chunked(&gate, 0));

    let pending = hangs.clone().oneshot(Request::new(()));
    let mut pending = Box::pin(pending);
    assert!(
        futures_poll_once(&mut pending).await.is_none(),
        "still in the handler"
    );
    assert_eq!(call(&ok).await.status(), StatusCode::TOO_MANY_REQUESTS);
    drop(pending);
    let res = call(&ok).await;
    assert_eq!(res.status(), StatusCode::OK);
    drop(res);

    let panicked = tokio::spawn(panics.oneshot(Request::new(()))).await;
    assert!(panicked.unwrap_err().is_panic());
    assert_eq!(
        call(&ok).await.status(),
        StatusCode::OK,
        "freed by the panic"
    );
}

/// Polls `fut` once; its output if it was ready.
async fn futures_poll_once<F: Future + Unpin>(fut: &mut F) -> Option<F::Output> {
    std::future::poll_fn(|cx| {
        Poll::Ready(match Pin::new(&mut *fut).poll(cx) {
            Poll::Ready(out) => Some(out),
            Poll::Pending => None,
        })
    })
    .await
}

/// A response that runs past the timeout keeps its slot, renewed every third of it; at
/// its end the slot goes.
#[tokio::test(start_paused = true)]
async fn a_long_response_keeps_its_slot_renewed() {
    let clock = ManualClock::new(T0);
    let (tx, gate) = gate();
    let svc = layer(store(&clock), "1 concurrent timeout=300ms").layer(chunked(&gate, 1));
    let long = call(&svc).await;
    assert_eq!(long.status(), StatusCode::OK);
    // Two seconds, more than six timeouts, in steps of the renewal interval.
    for _ in 0..20 {
        clock.advance(Duration::from_millis(100));
        tokio::time::advance(Duration::from_millis(100)).await;
        for _ in 0..4 {
            tokio::task::yield_now().await;
        }
        assert_eq!(call(&svc).await.status(), StatusCode::TOO_MANY_REQUESTS);
    }
    open(&tx, 1);
    long.into_body().collect().await.unwrap();
    assert_eq!(call(&svc).await.status(), StatusCode::OK);
}

/// Without anyone renewing it (its process died), a slot frees at its deadline.
#[tokio::test]
async fn a_slot_nobody_releases_frees_at_its_deadline() {
    let clock = ManualClock::new(T0);
    let store = store(&clock);
    let rules: RuleSet = "1 concurrent timeout=2s".parse().unwrap();
    use ratelimit_core::Store;
    let held = store.check(b"k", &rules, 1).await.unwrap();
    assert!(held.slot().is_some());
    assert!(!store.check(b"k", &rules, 1).await.unwrap().is_allowed());
    clock.advance(Duration::from_secs(2));
    assert!(store.check(b"k", &rules, 1).await.unwrap().is_allowed());
}

/// A store that decides through futures (not in process) and fails the first `failing`
/// releases, counting every release asked of it.
struct FlakyReleases {
    inner: MemoryStore<ManualClock>,
    failing: usize,
    releases: std::sync::atomic::AtomicUsize,
}

#[derive(Debug)]
struct Down;

impl std::fmt::Display for Down {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("store down")
    }
}

impl std::error::Error for Down {}

impl ratelimit_core::Store for FlakyReleases {
    type Error = Down;

    async fn check(
        &self,
        key: &[u8],
        rules: &RuleSet,
        cost: u64,
    ) -> Result<ratelimit_core::Decision, Down> {
        self.inner.check_now(key, rules, cost).map_err(|_| Down)
    }

    async fn block(&self, _: &[u8], _: Option<Duration>) -> Result<(), Down> {
        Ok(())
    }

    async fn unblock(&self, _: &[u8]) -> Result<(), Down> {
        Ok(())
    }

    async fn reset(&self, _: &[u8], _: &RuleSet) -> Result<(), Down> {
        Ok(())
    }

    async fn release(&self, key: &[u8], _: &RuleSet, slot: u64) -> Result<bool, Down> {
        let n = self
            .releases
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if n < self.failing {
            return Err(Down);
        }
        Ok(self.inner.release_now(key, slot))
    }

    fn now_us(&self) -> u64 {
        use ratelimit_core::Clock;
        self.inner.clock().now_us()
    }
}

async fn release_after_failures(failing: usize) -> (usize, StatusCode) {
    let clock = ManualClock::new(T0);
    let store = Arc::new(FlakyReleases {
        inner: MemoryStore::builder().clock(clock.clone()).build(),
        failing,
        releases: Default::default(),
    });
    let (_tx, gate) = gate();
    let svc = RateLimitLayer::builder(Arc::clone(&store), GlobalKey)
        .rules("1 concurrent timeout=1h")
        .unwrap()
        .namespace("flaky")
        .without_deny_cache()
        .build()
        .unwrap()
        .layer(chunked(&gate, 0));
    let res = call(&svc).await;
    assert_eq!(res.status(), StatusCode::OK);
    res.into_body().collect().await.unwrap();
    // The retries wait 50 ms, 250 ms and 1 s.
    for _ in 0..40 {
        tokio::time::advance(Duration::from_millis(50)).await;
        tokio::task::yield_now().await;
    }
    let releases = store.releases.load(std::sync::atomic::Ordering::SeqCst);
    (releases, call(&svc).await.status())
}

/// A release the store fails is sent again (three more times within about a second);
/// one that never goes through leaves the slot to its deadline.
#[tokio::test(start_paused = true)]
async fn a_failed_release_is_retried_then_left_to_the_deadline() {
    assert_eq!(release_after_failures(0).await, (1, StatusCode::OK));
    assert_eq!(release_after_failures(2).await, (3, StatusCode::OK));
    assert_eq!(
        release_after_failures(usize::MAX).await,
        (4, StatusCode::TOO_MANY_REQUESTS)
    );
}
