//! The `live_limits` example's logic over real HTTP: limits from a TOML file, reloaded
//! while the server runs.

use std::path::PathBuf;
use std::sync::Arc;

use ratelimit_core::{ManualClock, MemoryStore};
use ratelimit_e2e::{client, TestServer};
use ratelimit_examples::live::{app, limits_file, parse_limits};

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
    let limits = limits_file(&file.0).load().await.unwrap();
    let (router, handle) = app(store, limits).unwrap();
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
    let res = get(Some("pro")).await.unwrap();
    assert_eq!(res.status(), 200, "no tier pro yet: the top-level rules");
    assert_eq!(res.headers()["ratelimit-policy"], r#""per-ip";q=2;w=3600"#);

    file.write(
        "rules = \"5/h fixed-window name=per-ip\"\n\n[tiers]\npro = \"50/h fixed-window name=pro\"\n",
    );
    limits_file(&file.0).reload(&handle).await.unwrap();
    let res = get(None).await.unwrap();
    assert_eq!(res.headers()["ratelimit-policy"], r#""per-ip";q=5;w=3600"#);
    let res = get(Some("pro")).await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(res.headers()["ratelimit-policy"], r#""pro";q=50;w=3600"#);

    file.write("rules = \"1/h fixed-window\"\n\n[tiers]\npro = \"50/fortnight\"\n");
    let err = limits_file(&file.0).reload(&handle).await.unwrap_err();
    assert!(err.to_string().starts_with("line 4: "), "{err}");
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

#[tokio::test]
async fn a_plan_the_new_file_drops_is_limited_by_the_top_level_rules() {
    let file = LimitsFile::new(
        "dropped",
        "rules = \"2/h fixed-window name=per-ip\"\n\n[tiers]\npro = \"50/h fixed-window name=pro\"\n",
    );
    let (server, handle) = serve(&file).await;
    let http = client();
    let pro = || http.get(server.url("/")).header("x-plan", "pro").send();
    assert_eq!(
        pro().await.unwrap().headers()["ratelimit-policy"],
        r#""pro";q=50;w=3600"#
    );

    file.write("rules = \"2/h fixed-window name=per-ip\"\n");
    let changes = limits_file(&file.0).reload(&handle).await.unwrap();
    assert_eq!(
        changes.to_string(),
        "tier pro removed (was \"50/1h fixed-window name=pro\")"
    );
    let codes = [
        pro().await.unwrap(),
        pro().await.unwrap(),
        pro().await.unwrap(),
    ];
    let codes: Vec<u16> = codes.iter().map(|r| r.status().as_u16()).collect();
    assert_eq!(codes, [200, 200, 429], "2/h per IP, never 500");
}

#[tokio::test]
async fn hostile_files_are_refused_and_the_running_limits_stay() {
    let file = LimitsFile::new("hostile", "rules = \"2/h fixed-window name=per-ip\"\n");
    let (server, handle) = serve(&file).await;
    let before = handle.current();
    let huge = "x".repeat(50 << 20);
    let cases = [
        // 50 MB of rule text: refused after reading the first 1 MiB and a byte.
        format!("rules = \"{huge}\"\n"),
        // Within the size cap, a rule text far above its own cap.
        format!("rules = \"{}\"\n", &huge[..512 << 10]),
        // A tier name of 1,000,000 bytes.
        format!(
            "rules = \"1/s\"\n[tiers]\n{} = \"1/s\"\n",
            &huge[..1_000_000]
        ),
        // 1,025 tiers.
        (0..1025).fold("rules = \"1/s\"\n[tiers]\n".to_owned(), |mut text, i| {
            text.push_str(&format!("t{i} = \"{i}/s\"\n"));
            text
        }),
    ];
    for text in cases {
        file.write(&text);
        let err = limits_file(&file.0).reload(&handle).await.unwrap_err();
        assert!(err.to_string().len() < 1024, "{}", err.to_string().len());
        assert_eq!(handle.current(), before);
    }
    let res = client().get(server.url("/")).send().await.unwrap();
    assert_eq!(res.headers()["ratelimit-policy"], r#""per-ip";q=2;w=3600"#);
}
