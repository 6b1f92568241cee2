//! Helpers for the end-to-end tests: a real axum server on a free loopback port, and an
//! HTTP client that ignores proxy settings from the environment.

use std::future::IntoFuture;
use std::net::SocketAddr;

use axum::Router;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// An axum app served on `127.0.0.1` and a free port, with the peer address available to
/// the key extractors; stopped on drop.
#[derive(Debug)]
pub struct TestServer {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl TestServer {
    /// Serves `app` on the current tokio runtime.
    pub async fn start(app: Router) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a free loopback port");
        let addr = listener.local_addr().expect("bound address");
        let serve = axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        );
        let task = tokio::spawn(async move {
            serve.into_future().await.expect("serve");
        });
        Self { addr, task }
    }

    /// Serves `app` as a server set up without peer addresses would: plain
    /// `axum::serve(listener, app)`, no `into_make_service_with_connect_info`.
    pub async fn start_without_peer_addresses(app: Router) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a free loopback port");
        let addr = listener.local_addr().expect("bound address");
        let serve = axum::serve(listener, app);
        let task = tokio::spawn(async move {
            serve.into_future().await.expect("serve");
        });
        Self { addr, task }
    }

    /// `http://127.0.0.1:<port><path>`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A client that talks to loopback directly, whatever `HTTP_PROXY` says.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("build the HTTP client")
}

/// The values of every `name` field of `res`, in order.
pub fn all(res: &reqwest::Response, name: &str) -> Vec<String> {
    res.headers()
        .get_all(name)
        .iter()
        .map(|v| v.to_str().expect("ASCII field").to_owned())
        .collect()
}

/// The single value of `name`, if present.
pub fn one(res: &reqwest::Response, name: &str) -> Option<String> {
    let values = all(res, name);
    assert!(values.len() <= 1, "{name} appears {} times", values.len());
    values.into_iter().next()
}
