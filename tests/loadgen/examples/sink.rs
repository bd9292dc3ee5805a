//! A minimal OpenAI-style SSE server for measuring the load generator itself (not a pod
//! model): answers at once with `chunks` content chunks and a usage chunk, rotating
//! `x-fake-pod` over `pods` names. Usage: `cargo run --release --example sink -- 18080 3 16`.
//! A fourth argument `gap_ms` > 0 streams the chunks one by one, `gap_ms` apart (each its own
//! write, as a model server streams tokens), instead of in one write.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::Response;
use axum::routing::post;
use axum::Router;

struct Cfg {
    next: AtomicU64,
    pods: u64,
    body: Bytes,
    /// The chunks one by one (streamed when `gap` is non-zero).
    chunks: Vec<Bytes>,
    gap: std::time::Duration,
}

async fn chat(State(c): State<Arc<Cfg>>, _body: Bytes) -> Response<Body> {
    let i = c.next.fetch_add(1, Ordering::Relaxed) % c.pods;
    let body = if c.gap.is_zero() {
        Body::from(c.body.clone())
    } else {
        let (chunks, gap) = (c.chunks.clone(), c.gap);
        Body::from_stream(futures::stream::unfold(0usize, move |n| {
            let next = chunks.get(n).cloned();
            async move {
                if n > 0 {
                    tokio::time::sleep(gap).await;
                }
                next.map(|b| (Ok::<Bytes, std::io::Error>(b), n + 1))
            }
        }))
    };
    Response::builder()
        .header("content-type", "text/event-stream")
        .header("x-fake-pod", format!("pod-{i}"))
        .body(body)
        .unwrap_or_default()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let port: u16 = args.get(1).map_or(Ok(18080), |s| s.parse())?;
    let pods: u64 = args.get(2).map_or(Ok(3), |s| s.parse())?;
    let chunks: u32 = args.get(3).map_or(Ok(16), |s| s.parse())?;
    let gap_ms: u64 = args.get(4).map_or(Ok(0), |s| s.parse())?;
    let mut parts = Vec::new();
    for i in 0..chunks {
        parts.push(format!(
            "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"t{i} \"}}}}],\"usage\":null}}\n\n"
        ));
    }
    parts.push(format!(
        "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":1,\"completion_tokens\":{chunks},\"total_tokens\":{}}}}}\n\ndata: [DONE]\n\n",
        chunks + 1
    ));
    let body = parts.concat();
    let cfg = Arc::new(Cfg {
        next: AtomicU64::new(0),
        pods: pods.max(1),
        body: Bytes::from(body),
        chunks: parts.into_iter().map(Bytes::from).collect(),
        gap: std::time::Duration::from_millis(gap_ms),
    });
    let app = Router::new()
        .route("/v1/chat/completions", post(chat))
        .with_state(cfg);
    // A deep accept backlog: a full one drops SYNs, which clients retry only after 1 s.
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.set_reuseaddr(true)?;
    socket.bind(std::net::SocketAddr::from(([127, 0, 0, 1], port)))?;
    let listener = socket.listen(8192)?;
    eprintln!("sink on {}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}
