//! A minimal OpenAI-style SSE server for measuring the load generator itself and what a proxy
//! costs per request (not a pod model): answers at once with `chunks` content chunks and a
//! usage chunk, then `data: [DONE]`, rotating `x-fake-pod` over `pods` names.
//! Usage: `cargo run --release --example sink -- 18080 3 16`.
//! A fourth argument `gap_ms` > 0 streams the chunks one by one, `gap_ms` apart (each its own
//! write, as a model server streams tokens), instead of in one write.
//! A fifth argument `openai` makes every chunk a whole `chat.completion.chunk` object as vLLM's
//! OpenAI server writes it (id, object, created, model, choices with logprobs and
//! finish_reason, `"usage":null`; about 230 bytes a chunk); `short` (the default) keeps the
//! minimal chunks (about 80 bytes).
//! `GET /metrics` answers a fixed vLLM page of an idle pod (nothing running or waiting, an empty
//! KV cache, `vllm:cache_config_info` with 16-token blocks), so a picker that scrapes its pods
//! (the llm-d endpoint picker baseline) can use the sink as a pod.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::Response;
use axum::routing::{get, post};
use axum::Router;

struct Cfg {
    next: AtomicU64,
    pods: u64,
    body: Bytes,
    /// The chunks one by one (streamed when `gap` is non-zero).
    chunks: Vec<Bytes>,
    gap: std::time::Duration,
}

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

/// The idle vLLM page of `GET /metrics`.
const METRICS: &str = "\
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",gpu_memory_utilization=\"0.9\",num_cpu_blocks=\"None\",num_gpu_blocks=\"25000\",num_gpu_blocks_override=\"None\",sliding_window=\"None\"} 1.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 0.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 0.0
";

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

async fn metrics() -> Response<Body> {
    Response::builder()
        .header("content-type", "text/plain; version=0.0.4")
        .body(Body::from(METRICS))
        .unwrap_or_default()
}

/// The SSE events of one answer: `chunks` content chunks, then the usage chunk and `[DONE]`.
fn parts(chunks: u32, openai: bool) -> Vec<String> {
    let mut parts = Vec::new();
    for i in 0..chunks {
        parts.push(if openai {
            let finish = if i + 1 == chunks { "\"length\"" } else { "null" };
            format!(
                "data: {{\"id\":\"chatcmpl-5f0c3a9e8d7b4e1f9a2c6b3d8e7f1a20\",\"object\":\"chat.completion.chunk\",\"created\":1733480000,\"model\":\"{MODEL}\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\" t{i}\"}},\"logprobs\":null,\"finish_reason\":{finish}}}],\"usage\":null}}\n\n"
            )
        } else {
            format!(
                "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"t{i} \"}}}}],\"usage\":null}}\n\n"
            )
        });
    }
    let usage = format!(
        "\"usage\":{{\"prompt_tokens\":1,\"completion_tokens\":{chunks},\"total_tokens\":{}}}",
        chunks + 1
    );
    parts.push(if openai {
        format!(
            "data: {{\"id\":\"chatcmpl-5f0c3a9e8d7b4e1f9a2c6b3d8e7f1a20\",\"object\":\"chat.completion.chunk\",\"created\":1733480000,\"model\":\"{MODEL}\",\"choices\":[],{usage}}}\n\ndata: [DONE]\n\n"
        )
    } else {
        format!("data: {{\"choices\":[],{usage}}}\n\ndata: [DONE]\n\n")
    });
    parts
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let port: u16 = args.get(1).map_or(Ok(18080), |s| s.parse())?;
    let pods: u64 = args.get(2).map_or(Ok(3), |s| s.parse())?;
    let chunks: u32 = args.get(3).map_or(Ok(16), |s| s.parse())?;
    let gap_ms: u64 = args.get(4).map_or(Ok(0), |s| s.parse())?;
    let openai = match args.get(5).map(String::as_str) {
        None | Some("short") => false,
        Some("openai") => true,
        Some(other) => anyhow::bail!("chunk shape {other:?}: expected `short` or `openai`"),
    };
    let parts = parts(chunks, openai);
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
        .route("/metrics", get(metrics))
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
