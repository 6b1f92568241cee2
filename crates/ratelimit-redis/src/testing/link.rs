//! [`LinkProxy`]: one direction of a network link between two regions, on loopback.

use std::collections::VecDeque;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// What a [`LinkProxy`] does with the bytes it carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkMode {
    /// Forwards each chunk after the link's one-way delay (plus jitter), in order.
    Up,
    /// Holds every socket open and forwards nothing, as a partition does: clients see
    /// timeouts, not errors. What was sent meanwhile is delivered, in order, once the
    /// link is [`Up`](LinkMode::Up) again (as TCP retransmits after a partition heals).
    BlackHole,
}

/// A TCP forwarder from a local port to a target port, standing for the network between
/// two regions: a one-way delay `d ± jitter` in each direction of every connection
/// (order kept), a black hole ([`LinkMode::BlackHole`]) and a reset of every
/// connection ([`LinkProxy::reset`], e.g. in the middle of a call, so that the server
/// runs it and the reply is lost). One proxy per directed pair of regions: the clients
/// of region A connect to region B's server through `proxy(A→B).url()`, and traffic
/// inside a region goes direct.
///
/// In-process (tokio tasks on the caller's runtime), so it needs no root and slows no
/// other loopback traffic, as `tc netem` would. Dropping the proxy closes its listener
/// and every connection.
///
/// ```no_run
/// use ratelimit_redis::testing::{LinkMode, LinkProxy, RedisServer};
/// use std::time::Duration;
///
/// # async fn run() {
/// let home = RedisServer::start();
/// let link = LinkProxy::start(home.port(), Duration::from_millis(30), Duration::from_millis(10))
///     .await
///     .unwrap();
/// // A store built on `link.url()` reaches `home` 30 ± 10 ms away.
/// link.set_mode(LinkMode::BlackHole); // a partition
/// link.set_mode(LinkMode::Up); // healed
/// link.reset(); // every connection closed
/// # }
/// ```
#[derive(Debug)]
pub struct LinkProxy {
    port: u16,
    state: Arc<LinkState>,
    accept: JoinHandle<()>,
}

#[derive(Debug)]
struct LinkState {
    target: SocketAddr,
    mode: watch::Sender<LinkMode>,
    delay: Mutex<(Duration, Duration)>,
    connections: Mutex<Vec<JoinHandle<()>>>,
    /// A small deterministic generator for the jitter.
    seed: Mutex<u64>,
}

impl LinkState {
    fn one_way(&self) -> Duration {
        let (delay, jitter) = *self.delay.lock().expect("link delay lock");
        if jitter.is_zero() {
            return delay;
        }
        let mut seed = self.seed.lock().expect("link seed lock");
        // xorshift64*
        *seed ^= *seed >> 12;
        *seed ^= *seed << 25;
        *seed ^= *seed >> 27;
        let r = seed.wrapping_mul(0x2545_f491_4f6c_dd1d);
        let span = u64::try_from(jitter.as_micros()).unwrap_or(u64::MAX / 4) * 2 + 1;
        let offset = Duration::from_micros(r % span);
        (delay + offset).saturating_sub(jitter)
    }
}

impl LinkProxy {
    /// Listens on a free port of `127.0.0.1` and forwards every connection to
    /// `127.0.0.1:target_port`, each chunk `delay ± jitter` later, starting
    /// [`Up`](LinkMode::Up).
    pub async fn start(target_port: u16, delay: Duration, jitter: Duration) -> io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let state = Arc::new(LinkState {
            target: SocketAddr::from(([127, 0, 0, 1], target_port)),
            mode: watch::channel(LinkMode::Up).0,
            delay: Mutex::new((delay, jitter.min(delay))),
            connections: Mutex::new(Vec::new()),
            seed: Mutex::new(0x9e37_79b9_7f4a_7c15 ^ u64::from(port)),
        });
        let accept = tokio::spawn(accept_loop(listener, Arc::clone(&state)));
        Ok(Self {
            port,
            state,
            accept,
        })
    }

    /// The port clients connect to.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:<port>/`: the target server, through the link.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Switches the link [`Up`](LinkMode::Up) or into a
    /// [`BlackHole`](LinkMode::BlackHole); connections stay open either way.
    pub fn set_mode(&self, mode: LinkMode) {
        self.state.mode.send_replace(mode);
    }

    /// The current mode.
    pub fn mode(&self) -> LinkMode {
        *self.state.mode.borrow()
    }

    /// Changes the one-way delay and its jitter (at most the delay) for what is sent
    /// from now on.
    pub fn set_delay(&self, delay: Duration, jitter: Duration) {
        *self.state.delay.lock().expect("link delay lock") = (delay, jitter.min(delay));
    }

    /// Closes every open connection at once, both ends, dropping what is in transit;
    /// new connections are accepted as before.
    pub fn reset(&self) {
        let connections =
            std::mem::take(&mut *self.state.connections.lock().expect("link connections"));
        for connection in connections {
            connection.abort();
        }
    }
}

impl Drop for LinkProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.reset();
    }
}

async fn accept_loop(listener: TcpListener, state: Arc<LinkState>) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        let task = tokio::spawn(connection(client, Arc::clone(&state)));
        let mut connections = state.connections.lock().expect("link connections");
        connections.retain(|c| !c.is_finished());
        connections.push(task);
    }
}

/// One connection: two directions, each a reader that stamps chunks with their delivery
/// time and a writer that delivers them in order, when due and the link is up. Aborting
/// the task drops both sockets.
async fn connection(client: TcpStream, state: Arc<LinkState>) {
    let Ok(server) = TcpStream::connect(state.target).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let up = direction(client_read, server_write, Arc::clone(&state));
    let down = direction(server_read, client_write, state);
    // Either direction ending (a close, an error) ends the connection.
    tokio::select! {
        () = up => {}
        () = down => {}
    }
}

/// Chunks on their way, each with its delivery time.
type InTransit = VecDeque<(Instant, Vec<u8>)>;

async fn direction(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    state: Arc<LinkState>,
) {
    let queue: Arc<Mutex<InTransit>> = Arc::default();
    let notify = Arc::new(tokio::sync::Notify::new());
    let mut mode = state.mode.subscribe();
    let writer = {
        let queue = Arc::clone(&queue);
        let notify = Arc::clone(&notify);
        async move {
            loop {
                let next = queue.lock().expect("link queue").front().map(|(at, _)| *at);
                let Some(at) = next else {
                    notify.notified().await;
                    continue;
                };
                tokio::time::sleep_until(at).await;
                // A black hole holds what is due until the link is up again.
                if mode.wait_for(|m| *m == LinkMode::Up).await.is_err() {
                    return;
                }
                let chunk = queue.lock().expect("link queue").pop_front();
                if let Some((_, bytes)) = chunk {
                    if to.write_all(&bytes).await.is_err() {
                        return;
                    }
                }
            }
        }
    };
    let reader = async move {
        let mut last = Instant::now();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    // Order is kept: no chunk overtakes the one before it.
                    let at = (Instant::now() + state.one_way()).max(last);
                    last = at;
                    queue
                        .lock()
                        .expect("link queue")
                        .push_back((at, buf[..n].to_vec()));
                    notify.notify_one();
                }
            }
        }
    };
    tokio::select! {
        () = writer => {}
        () = reader => {}
    }
}
