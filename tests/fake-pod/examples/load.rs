//! Measures the pod's own CPU cost: N closed-loop streaming clients against one running pod
//! for D seconds; prints requests and tokens per second. Usage:
//! `cargo run --release -p ai-lb-fake-pod --example load -- http://127.0.0.1:PORT 200 10`

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let base = args
        .get(1)
        .cloned()
        .unwrap_or_else(|| "http://127.0.0.1:8000".into());
    let clients: usize = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(100);
    let secs: u64 = args.get(3).map(|s| s.parse()).transpose()?.unwrap_or(10);
    let http = reqwest::Client::new();
    let reqs = Arc::new(AtomicU64::new(0));
    let bytes = Arc::new(AtomicU64::new(0));
    let end = Instant::now() + Duration::from_secs(secs);
    let mut tasks = Vec::new();
    for i in 0..clients {
        let (http, base, reqs, bytes) = (http.clone(), base.clone(), reqs.clone(), bytes.clone());
        tasks.push(tokio::spawn(async move {
            while Instant::now() < end {
                let body = serde_json::json!({
                    "messages": [{"role": "user", "content": format!("client {i} ").repeat(64)}],
                    "max_tokens": 128, "stream": true,
                });
                let Ok(r) = http
                    .post(format!("{base}/v1/chat/completions"))
                    .json(&body)
                    .send()
                    .await
                else {
                    // Back off instead of spinning when the pod is unreachable.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                };
                let mut s = r.bytes_stream();
                while let Some(Ok(b)) = s.next().await {
                    bytes.fetch_add(b.len() as u64, Ordering::Relaxed);
                }
                reqs.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    let r = reqs.load(Ordering::Relaxed);
    println!(
        "{clients} clients, {secs} s: {:.1} req/s, {:.0} tokens/s (approx), {:.1} MB streamed",
        r as f64 / secs as f64,
        r as f64 * 128.0 / secs as f64,
        bytes.load(Ordering::Relaxed) as f64 / 1e6
    );
    Ok(())
}
