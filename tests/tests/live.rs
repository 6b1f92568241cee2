//! The `live_limits` example's logic over real HTTP: limits from a TOML file, reloaded
//! while the server runs.

use std::path::PathBuf;
use std::sync::Arc;

use ratelimit_core::{ManualClock, MemoryStore};
use ratelimit_e2e::{client, TestServer};
use ratelimit_examples::live::{app, parse_limits, read_limits, reload};

// Aligned to the hour, so fixed windows start at T0.
const T0: u64 = 1_699_999_200_000_000;

/// A limits file of its own for each test, removed on drop.
struct LimitsFile(PathBuf);

impl LimitsFile {
    fn new(name: &str, text: &str) -> Self {
        let path =
            std::env::temp_dir().join(format!("ratelimit-e2e-{}-{name}.toml", std::process::id()));
        let file = Self(path);
        file.write(text);
        file
    }

    fn write(&self, text: &str) {
        std::fs::write(&self.0, text).expect("write the limits file");
    }
}

impl Drop for LimitsFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

async fn serve(file: &LimitsFile) -> (TestServer, ratelimit_tower::LimitsHandle) {
    let store = Arc::new(MemoryStore::builder().clock(ManualClock::new(T0)).build());
    let (router, handle) = app(store, read_limits(&file.0).unwrap()).unwrap();
    (TestServer::start(router).await, handle)
}

#[tokio::test]
async fn a_reloaded_file_applies_and_a_bad_one_is_refused() {
    let file = LimitsFile::new("reload", "rules = \"2/h fixed-window name=per-ip\"\n");
    let (server, handle) = serve(&file).await;
    let http = client();
    let get = |plan: Option<&str>| {
        let req = http.get(server.url("/"));
        match plan {
            Some(plan) => req.header("x-plan", plan),
            None => req,
        }
        .send()
    };
    let res = get(None).await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(res.headers()["ratelimit-policy"], r#""per-ip";q=2;w=3600"#);
    assert_eq!(
        get(Some("pro")).await.unwrap().status(),
        500,
        "no tier pro yet"
    );

    file.write(
        "rules = \"5/h fixed-window name=per-ip\"\n\n[tiers]\npro = \"50/h fixed-window name=pro\"\n",
    );
    reload(&handle, &file.0).unwrap();
    let res = get(None).await.unwrap();
    assert_eq!(res.headers()["ratelimit-policy"], r#""per-ip";q=5;w=3600"#);
    let res = get(Some("pro")).await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(res.headers()["ratelimit-policy"], r#""pro";q=50;w=3600"#);

    file.write("rules = \"1/h fixed-window\"\n\n[tiers]\npro = \"50/fortnight\"\n");
    let err = reload(&handle, &file.0).unwrap_err();
    assert!(err.contains("line 4"), "{err}");
    let res = get(None).await.unwrap();
    assert_eq!(
        res.headers()["ratelimit-policy"],
        r#""per-ip";q=5;w=3600"#,
        "the running limits stay"
    );
}

#[tokio::test]
async fn a_reload_keeps_the_clients_usage() {
    let store = Arc::new(MemoryStore::builder().clock(ManualClock::new(T0)).build());
    let limits = |text: &str| parse_limits(text).unwrap();
    let (router, handle) = app(store, limits("rules = \"5/h fixed-window\"")).unwrap();
    let server = TestServer::start(router).await;
    let http = client();
    let send = async |n: usize| {
        let mut ok = 0;
        for _ in 0..n {
            if http.get(server.url("/")).send().await.unwrap().status() == 200 {
                ok += 1;
            }
        }
        ok
    };
    assert_eq!(send(3).await, 3);

    handle
        .replace(limits("rules = \"10/h fixed-window\""))
        .unwrap();
    assert_eq!(send(10).await, 7, "3 of 10 already used");

    handle
        .replace(limits("rules = \"3/h fixed-window\""))
        .unwrap();
    assert_eq!(send(1).await, 0, "10 used, more than 3");
}
