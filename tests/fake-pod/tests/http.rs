//! Drives the real `ai-lb-fake-pod` binary over HTTP on 127.0.0.1:0: OpenAI responses and
//! usage, SSE chunk counts, vLLM metrics, fault control, CLI validation and shutdown.

use std::process::Stdio;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::time::{timeout, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_ai-lb-fake-pod");
const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

struct Pod {
    child: Child,
    base: String,
    http: reqwest::Client,
    /// `tcp://...` of the KV-event PUB socket, with --kv-events-endpoint.
    kv_events: Option<String>,
}

impl Pod {
    async fn start(args: &[&str]) -> Pod {
        let mut cmd = Command::new(BIN);
        cmd.args(["--listen", "127.0.0.1:0"]);
        if !args.contains(&"--time-scale") {
            cmd.args(["--time-scale", "0.01"]);
        }
        let mut child = cmd
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn fake pod");
        let stdout = child.stdout.take().unwrap();
        let mut lines = BufReader::new(stdout).lines();
        let mut kv_events = None;
        let addr = loop {
            let line = timeout(Duration::from_secs(20), lines.next_line())
                .await
                .expect("LISTENING line within 20 s")
                .unwrap()
                .expect("a stdout line");
            if let Some(ep) = line.strip_prefix("LISTENING kv-events ") {
                kv_events = Some(ep.to_string());
                continue;
            }
            if line.starts_with("LISTENING kv-events-replay ") {
                continue;
            }
            break line
                .strip_prefix("LISTENING http ")
                .unwrap_or_else(|| panic!("unexpected line {line:?}"))
                .to_string();
        };
        Pod {
            child,
            base: format!("http://{addr}"),
            http: reqwest::Client::new(),
            kv_events,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    async fn post(&self, path: &str, body: Value) -> reqwest::Response {
        self.http
            .post(self.url(path))
            .json(&body)
            .send()
            .await
            .unwrap()
    }

    async fn get_json(&self, path: &str) -> Value {
        self.http
            .get(self.url(path))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    async fn metrics(&self) -> String {
        self.http
            .get(self.url("/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    async fn control(&self, body: Value) -> reqwest::Response {
        self.post("/control", body).await
    }
}

/// Value of the sample `name{labels}` (exact label string) in exposition text.
fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|r| r.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no sample {series}"))
        .parse()
        .unwrap()
}

fn series(name: &str) -> String {
    format!("{name}{{model_name=\"{MODEL}\"}}")
}

/// Polls `f` every 20 ms until it returns true or the deadline passes.
async fn eventually<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if f().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("timed out waiting for {what}");
}

fn chat(content: &str, max_tokens: u32) -> Value {
    json!({"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens})
}

#[tokio::test]
async fn non_streaming_usage_header_and_models() {
    let pod = Pod::start(&["--pod-name", "pod-a"]).await;
    let r = pod.post("/v1/chat/completions", chat("abcdefghi", 7)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-fake-pod"], "pod-a");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["object"], "chat.completion");
    // user role + "abcd" "efgh" "i" + generation prompt = 5 prompt tokens
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12})
    );
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    // 7 generated tokens of 4 ASCII bytes each, which re-tokenise to 7 tokens
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(text.len(), 28, "{text:?}");
    assert_eq!(ai_lb_prefix::count_tokens(text), 7, "{text:?}");

    let r = pod
        .post("/v1/completions", json!({"prompt": [1, 2, 3, 4, 5]}))
        .await;
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["usage"]["prompt_tokens"], 5);
    assert_eq!(v["usage"]["completion_tokens"], 128, "default max_tokens");

    let models = pod.get_json("/v1/models").await;
    assert_eq!(models["data"][0]["id"], MODEL);
    let h = pod.http.get(pod.url("/healthz")).send().await.unwrap();
    assert_eq!(h.status(), 200);
    assert_eq!(h.headers()["x-fake-pod"], "pod-a");
}

/// The answer of turn 1, sent back as the assistant message of turn 2, re-tokenises to the
/// generated tokens: turn 2's prompt = turn 1's prompt + the answer + user role + question +
/// generation prompt.
#[tokio::test]
async fn an_answer_sent_back_retokenises_to_the_generated_tokens() {
    let pod = Pod::start(&[]).await;
    let turn1 = json!({"model": MODEL, "max_tokens": 9, "messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]});
    let v: Value = pod
        .post("/v1/chat/completions", turn1.clone())
        .await
        .json()
        .await
        .unwrap();
    let answer = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let p1 = v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(p1, 1 + 2 + 1 + 3 + 1);
    let mut turn2 = turn1;
    let msgs = turn2["messages"].as_array_mut().unwrap();
    msgs.push(json!({"role": "assistant", "content": answer}));
    msgs.push(json!({"role": "user", "content": "and then?"}));
    let v: Value = pod
        .post("/v1/chat/completions", turn2)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(
        v["usage"]["prompt_tokens"].as_u64().unwrap(),
        p1 + 9 + 1 + 3 + 1
    );
}

#[tokio::test]
async fn streaming_sends_one_chunk_per_token_then_usage_and_done() {
    let pod = Pod::start(&[]).await;
    let mut body = chat("hello world!", 12);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let r = pod.post("/v1/chat/completions", body).await;
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let text = r.text().await.unwrap();
    let data: Vec<&str> = text
        .split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| e.strip_prefix("data: ").expect("data: prefix"))
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let token_chunks = chunks
        .iter()
        .filter(|c| !c["choices"].as_array().unwrap().is_empty())
        .count();
    assert_eq!(token_chunks, 12);
    assert_eq!(chunks.len(), 13);
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(chunks[11]["choices"][0]["finish_reason"], "length");
    assert_eq!(
        chunks[12]["usage"],
        json!({"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17})
    );

    // completions without include_usage: tokens then [DONE], no usage chunk
    let r = pod
        .post(
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 4, "stream": true}),
        )
        .await;
    let text = r.text().await.unwrap();
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.len(), 5, "{text}");
    assert!(!text.contains("usage"));
}

#[tokio::test]
async fn metrics_use_vllm_names_and_histograms_grow() {
    let pod = Pod::start(&[]).await;
    let before = pod.metrics().await;
    for name in [
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:inter_token_latency_seconds_count",
    ] {
        assert_eq!(sample(&before, &series(name)), 0.0, "{name}");
    }
    assert!(before.contains("# TYPE vllm:time_to_first_token_seconds histogram"));
    assert!(before.contains(&format!(
        "vllm:time_to_first_token_seconds_bucket{{model_name=\"{MODEL}\",le=\"0.01\"}}"
    )));
    for _ in 0..3 {
        let r = pod.post("/v1/chat/completions", chat("abcd", 5)).await;
        assert_eq!(r.status(), 200);
    }
    let after = pod.metrics().await;
    let count = |name: &str| sample(&after, &series(name));
    assert_eq!(count("vllm:time_to_first_token_seconds_count"), 3.0);
    assert_eq!(count("vllm:e2e_request_latency_seconds_count"), 3.0);
    assert_eq!(count("vllm:inter_token_latency_seconds_count"), 12.0);
    // user role + "abcd" + generation prompt, three times
    assert_eq!(count("vllm:prompt_tokens_total"), 9.0);
    assert_eq!(count("vllm:generation_tokens_total"), 15.0);
    // Queried in prompt tokens; a 3-token prompt has no full block, so nothing hits.
    assert_eq!(count("vllm:prefix_cache_queries_total"), 9.0);
    assert_eq!(count("vllm:prefix_cache_hits_total"), 0.0);
    assert!(after.contains("# TYPE vllm:prefix_cache_hits_total counter"));
    assert!(count("vllm:time_to_first_token_seconds_sum") > 0.0);
    let ok =
        format!("vllm:request_success_total{{finished_reason=\"length\",model_name=\"{MODEL}\"}}");
    assert_eq!(sample(&after, &ok), 3.0);
}

#[tokio::test]
async fn kv_capacity_is_stated_as_vllm_cache_config_info() {
    let info = |text: &str| -> String {
        text.lines()
            .find(|l| l.starts_with("vllm:cache_config_info{"))
            .unwrap_or_else(|| panic!("no vllm:cache_config_info\n{text}"))
            .to_string()
    };
    // The preset's 400 000 tokens are 25 000 blocks of 16.
    let pod = Pod::start(&[]).await;
    let line = info(&pod.metrics().await);
    assert!(line.contains("block_size=\"16\""), "{line}");
    assert!(line.contains("num_gpu_blocks=\"25000\""), "{line}");
    assert!(line.contains("cache_dtype=\"auto\""), "{line}");
    assert!(line.contains("enable_prefix_caching=\"True\""), "{line}");
    assert!(line.ends_with("} 1.0"), "{line}");
    // --kv-cache-tokens 1000: 62 whole blocks (992 tokens), as vLLM rounds down.
    let pod = Pod::start(&["--kv-cache-tokens", "1000"]).await;
    let line = info(&pod.metrics().await);
    assert!(line.contains("num_gpu_blocks=\"62\""), "{line}");
    // --block-size 32 and no prefix caching: 31 blocks of 32.
    let pod = Pod::start(&[
        "--kv-cache-tokens",
        "1000",
        "--block-size",
        "32",
        "--prefix-caching",
        "false",
    ])
    .await;
    let line = info(&pod.metrics().await);
    assert!(line.contains("block_size=\"32\""), "{line}");
    assert!(line.contains("num_gpu_blocks=\"31\""), "{line}");
    assert!(line.contains("enable_prefix_caching=\"False\""), "{line}");
}

/// A completion request for `prompt` (tokenised as is: 4 ASCII bytes a token).
fn completion(prompt: &str, max_tokens: u32) -> Value {
    json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens})
}

#[tokio::test]
async fn a_repeated_prompt_hits_the_prefix_cache() {
    let hits = |text: &str| sample(text, &series("vllm:prefix_cache_hits_total"));
    let prompt = "0123456789abcdef".repeat(75); // 300 tokens
    for caching in ["true", "false"] {
        let pod = Pod::start(&["--prefix-caching", caching]).await;
        for _ in 0..2 {
            let r = pod.post("/v1/completions", completion(&prompt, 4)).await;
            assert_eq!(r.status(), 200);
        }
        let m = pod.metrics().await;
        assert_eq!(
            sample(&m, &series("vllm:prefix_cache_queries_total")),
            600.0
        );
        let cache = pod.get_json("/sim/cache").await;
        if caching == "true" {
            // (300 - 1) / 16 = 18 whole blocks of the second request's prompt.
            assert_eq!(hits(&m), 288.0);
            assert_eq!(cache["prefix_cache_hits_tokens"], 288);
            assert!(cache["blocks_cached"].as_u64().unwrap() >= 18, "{cache}");
        } else {
            assert_eq!(hits(&m), 0.0);
            assert_eq!(cache["blocks_cached"], 0);
        }
        assert_eq!(cache["prefix_cache_queries_tokens"], 600);
        assert_eq!(cache["blocks_used"], 0, "{cache}");
        assert_eq!(cache["num_blocks"], 25_000);
        assert_eq!(cache["kv_events"], Value::Null);
        assert_eq!(sample(&m, &series("vllm:kv_cache_usage_perc")), 0.0);
        // vLLM's POST /reset_prefix_cache empties it (nothing running holds blocks).
        let r = pod.post("/reset_prefix_cache", json!({})).await;
        assert_eq!(r.status(), 200);
        assert_eq!(pod.get_json("/sim/cache").await["blocks_cached"], 0);
        let r = pod.post("/v1/completions", completion(&prompt, 4)).await;
        assert_eq!(r.status(), 200);
        let m = pod.metrics().await;
        let again = if caching == "true" { 288.0 } else { 0.0 };
        assert_eq!(hits(&m), again, "no new hit after the reset");
    }
}

/// One decoded KV event: (tag, block hashes, parent, token ids).
type Ev = (String, Vec<u64>, Option<u64>, Vec<u32>);

/// Decodes a batch `[ts, [event...], rank]` of array-like events.
fn decode_batch(payload: &[u8]) -> Vec<Ev> {
    use rmpv::Value as V;
    let v = rmpv::decode::read_value(&mut &payload[..]).unwrap();
    let batch = v.as_array().unwrap();
    assert_eq!(batch.len(), 3, "[ts, events, data_parallel_rank]");
    assert!(
        batch[0].as_f64().unwrap() > 1.0e9,
        "ts is wall-clock seconds"
    );
    assert_eq!(batch[2].as_u64(), Some(0));
    let ints = |v: &V| -> Vec<u64> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect()
    };
    batch[1]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let e = e.as_array().unwrap();
            let tag = e[0].as_str().unwrap().to_string();
            match tag.as_str() {
                "BlockStored" => {
                    assert_eq!(e.len(), 7);
                    assert_eq!(e[4].as_u64(), Some(16));
                    assert!(e[5].is_nil());
                    assert_eq!(e[6].as_str(), Some("GPU"));
                    let tokens = ints(&e[3]).into_iter().map(|t| t as u32).collect();
                    (tag, ints(&e[1]), e[2].as_u64(), tokens)
                }
                "BlockRemoved" => (tag, ints(&e[1]), None, vec![]),
                _ => (tag, vec![], None, vec![]),
            }
        })
        .collect()
}

/// Batches received so far, in sequence order.
struct Stream {
    rx: tokio::sync::mpsc::UnboundedReceiver<(u64, Vec<Ev>)>,
    seen: Vec<Ev>,
    last: Option<u64>,
}

impl Stream {
    /// Receives batches until `done(seen)` holds (10 s at most per batch), checking that
    /// sequence numbers follow each other.
    async fn until(&mut self, done: impl Fn(&Vec<Ev>) -> bool) {
        while !done(&self.seen) {
            let (seq, evs) = timeout(Duration::from_secs(10), self.rx.recv())
                .await
                .expect("a batch within 10 s")
                .expect("subscriber alive");
            if let Some(l) = self.last {
                assert_eq!(seq, l + 1, "sequence numbers follow each other");
            }
            self.last = Some(seq);
            self.seen.extend(evs);
        }
    }
}

#[tokio::test]
async fn kv_events_stream_stores_chains_and_removals_over_zeromq() {
    use zeromq::{Socket, SocketRecv};
    let pod = Pod::start(&[
        "--kv-events-endpoint",
        "tcp://127.0.0.1:0",
        "--kv-events-topic",
        "kv@pod",
        "--kv-cache-tokens",
        "640",
    ])
    .await;
    let endpoint = pod.kv_events.clone().expect("LISTENING kv-events line");
    let mut sub = zeromq::SubSocket::new();
    sub.connect(&endpoint).await.unwrap();
    sub.subscribe("kv@").await.unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<(u64, Vec<Ev>)>();
    tokio::spawn(async move {
        while let Ok(m) = sub.recv().await {
            let f = m.into_vec();
            assert_eq!(f.len(), 3, "topic, sequence, payload");
            assert_eq!(f[0].as_ref(), b"kv@pod");
            let seq = u64::from_be_bytes(f[1].as_ref().try_into().unwrap());
            if tx.send((seq, decode_batch(&f[2]))).is_err() {
                return;
            }
        }
    });
    // A subscription reaches the publisher asynchronously (ZeroMQ's slow joiner): send
    // one-block probes until a batch arrives.
    let mut st = Stream {
        rx,
        seen: Vec::new(),
        last: None,
    };
    for i in 0.. {
        assert!(i < 500, "no KV event received");
        let r = pod
            .post(
                "/v1/completions",
                completion(&format!("probe {i:04} ").repeat(8), 1),
            )
            .await;
        assert_eq!(r.status(), 200);
        if let Ok((seq, evs)) = st.rx.try_recv() {
            st.last = Some(seq);
            st.seen.extend(evs);
            break;
        }
        tokio::task::yield_now().await;
    }
    let seed = ai_lb_prefix::model_seed(MODEL);
    let text_a = "the quick brown fox jumps over a lazy dog. ".repeat(5); // 215 chars: 54 tokens
    let mut ids_a = Vec::new();
    ai_lb_prefix::tokenize_into(&text_a, &mut ids_a);
    let mut keys_a = Vec::new();
    ai_lb_prefix::block_keys_into(seed, &ids_a, 16, usize::MAX, &mut keys_a);
    assert_eq!(keys_a.len(), 3);
    assert_eq!(
        pod.post("/v1/completions", completion(&text_a, 3))
            .await
            .status(),
        200
    );
    let stored_a = (
        "BlockStored".to_string(),
        keys_a.clone(),
        None,
        ids_a[..48].to_vec(),
    );
    st.until(|seen| seen.contains(&stored_a)).await;
    // The same prompt continued: its first 3 blocks hit, the 4th is stored on the chain.
    let text_b = format!("{text_a} and then it ran away, far far away from here.");
    let mut ids_b = Vec::new();
    ai_lb_prefix::tokenize_into(&text_b, &mut ids_b);
    let mut keys_b = Vec::new();
    ai_lb_prefix::block_keys_into(seed, &ids_b, 16, usize::MAX, &mut keys_b);
    assert_eq!(keys_b[..3], keys_a[..]);
    assert_eq!(
        pod.post("/v1/completions", completion(&text_b, 3))
            .await
            .status(),
        200
    );
    let stored_b = (
        "BlockStored".to_string(),
        keys_b[3..4].to_vec(),
        Some(keys_a[2]),
        ids_b[48..64].to_vec(),
    );
    st.until(|seen| seen.contains(&stored_b)).await;
    // 40 blocks: other prompts push A's blocks out of the LRU.
    for i in 0..8 {
        let filler = format!("filler {i:03} ").repeat(50); // 600 chars: 150 tokens
        assert_eq!(
            pod.post("/v1/completions", completion(&filler, 1))
                .await
                .status(),
            200
        );
    }
    let removed = |seen: &Vec<Ev>| -> Vec<u64> {
        seen.iter()
            .filter(|e| e.0 == "BlockRemoved")
            .flat_map(|e| e.1.clone())
            .collect()
    };
    st.until(|seen| keys_b[..4].iter().all(|k| removed(seen).contains(k)))
        .await;
    let cache = pod.get_json("/sim/cache").await;
    assert!(
        cache["kv_events"]["batches_published"].as_u64().unwrap() > 0,
        "{cache}"
    );
    assert_eq!(cache["kv_events"]["batches_dropped"], 0, "{cache}");
}

#[tokio::test]
async fn control_injects_faults() {
    let pod = Pod::start(&["--pod-name", "pod-f", "--num-gpus", "2"]).await;
    // error_rate 1.0: every request fails with an OpenAI-style 500
    let r = pod.control(json!({"error_rate": 1.0})).await;
    assert_eq!(r.status(), 200);
    for _ in 0..3 {
        let r = pod.post("/v1/chat/completions", chat("x", 2)).await;
        assert_eq!(r.status(), 500);
        assert_eq!(r.headers()["x-fake-pod"], "pod-f");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], 500);
    }
    let m = pod.metrics().await;
    let err =
        format!("vllm:request_success_total{{finished_reason=\"error\",model_name=\"{MODEL}\"}}");
    assert_eq!(sample(&m, &err), 3.0);

    // gpu_utilization, xid, ecc, slowdown reflected in /sim/gpu; queue in metrics
    let r = pod
        .control(json!({"error_rate": 0, "gpu_utilization": 0.73, "xid": 79, "ecc_errors": 2, "slowdown": 2, "queue": 9}))
        .await;
    assert_eq!(r.status(), 200);
    let g = pod.get_json("/sim/gpu").await;
    let gpus = g["gpus"].as_array().unwrap();
    assert_eq!(gpus.len(), 2);
    assert_eq!(gpus[0]["utilization"], 0.73);
    assert_eq!(gpus[1]["utilization"], 0.73);
    assert_eq!(gpus[0]["xid_errors"], 1);
    assert_eq!(gpus[0]["last_xid"], 79);
    assert_eq!(gpus[0]["ecc_uncorrected_errors"], 2);
    assert_eq!(gpus[0]["throttle_reasons"], 8);
    assert!(gpus[0]["uuid"].as_str().unwrap().starts_with("GPU-"));
    assert_ne!(gpus[0]["uuid"], gpus[1]["uuid"]);
    let m = pod.metrics().await;
    assert_eq!(sample(&m, &series("vllm:num_requests_waiting")), 9.0);
    let r = pod.post("/v1/chat/completions", chat("x", 2)).await;
    assert_eq!(r.status(), 200);

    // bad updates are rejected whole, naming field and value
    for (body, needle) in [
        (json!({"bogus": 1}), "bogus"),
        (json!({"slowdown": 0.5}), "0.5"),
        (json!({"error_rate": 2}), "error_rate"),
    ] {
        let r = pod.control(body).await;
        assert_eq!(r.status(), 400);
        let v: Value = r.json().await.unwrap();
        assert!(v["error"]["message"].as_str().unwrap().contains(needle));
    }
    let r = pod
        .http
        .post(pod.url("/control"))
        .body("{")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);

    let r = pod.control(json!({"reset": true})).await;
    assert_eq!(r.status(), 200);
    let f = pod.get_json("/control").await;
    assert_eq!(f["slowdown"], 1.0);
    assert_eq!(f["gpu_utilization"], Value::Null);
    let g = pod.get_json("/sim/gpu").await;
    assert_eq!(g["gpus"][0]["last_xid"], Value::Null);
    assert_eq!(g["gpus"][0]["throttle_reasons"], 0);
}

/// `/sim/gpu` reads NVML's saturated utilisation while one sequence decodes, GPM fields on
/// the Hopper preset (numbers) and `null` on the A100 one.
#[tokio::test]
async fn sim_gpu_reports_nvml_utilization_and_gpm_fields() {
    const GPM: [&str; 4] = [
        "sm_occupancy",
        "sm_utilization",
        "tensor_activity",
        "dram_activity",
    ];
    let h100 = Pod::start(&["--time-scale", "1"]).await;
    let idle = h100.get_json("/sim/gpu").await;
    for f in GPM {
        assert_eq!(idle["gpus"][0][f], 0.0, "{f}");
    }
    assert_eq!(idle["gpus"][0]["utilization"], 0.0);
    let (http, url) = (h100.http.clone(), h100.url("/v1/chat/completions"));
    let one = tokio::spawn(async move { http.post(url).json(&chat("x", 100_000)).send().await });
    // after ~1 s of decoding the whole window is busy
    eventually("NVML utilisation saturated by one sequence", || async {
        let g = h100.get_json("/sim/gpu").await;
        g["gpus"][0]["utilization"].as_f64().unwrap() > 0.99
    })
    .await;
    let g = h100.get_json("/sim/gpu").await;
    assert!(g["gpus"][0]["sm_occupancy"].as_f64().unwrap() < 0.1, "{g}");
    assert!(g["gpus"][0]["dram_activity"].as_f64().unwrap() > 0.5, "{g}");
    one.abort();

    let a100 = Pod::start(&["--preset", "a100-8b"]).await;
    let g = a100.get_json("/sim/gpu").await;
    for f in GPM {
        assert_eq!(g["gpus"][0][f], Value::Null, "{f}");
    }
    // the graded option is accepted (its formula is unit-tested in gpu.rs)
    let graded = Pod::start(&["--gpu-util-model", "graded"]).await;
    assert_eq!(
        graded.get_json("/sim/gpu").await["gpus"][0]["utilization"],
        0.0
    );
}

#[tokio::test]
async fn hang_holds_requests_until_cleared() {
    let pod = Pod::start(&[]).await;
    pod.control(json!({"hang": true})).await;
    let http = pod.http.clone();
    let url = pod.url("/v1/chat/completions");
    let pending = tokio::spawn(async move {
        http.post(url)
            .json(&chat("x", 3))
            .send()
            .await
            .unwrap()
            .status()
    });
    eventually("hung request counted as waiting", || async {
        sample(&pod.metrics().await, &series("vllm:num_requests_waiting")) == 1.0
    })
    .await;
    assert!(!pending.is_finished());
    pod.control(json!({"hang": false})).await;
    let status = timeout(Duration::from_secs(10), pending)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status, 200);
}

#[tokio::test]
async fn freeze_holds_every_route_but_the_gpu_and_control() {
    let pod = Pod::start(&[]).await;
    pod.control(json!({"freeze": true})).await;
    let held: Vec<_> = ["/metrics", "/v1/models", "/health"]
        .iter()
        .map(|path| {
            let (http, url) = (pod.http.clone(), pod.url(path));
            tokio::spawn(async move { http.get(url).send().await.unwrap().status() })
        })
        .collect();
    // Every one of them reached the pod and is held there (not still on its way).
    eventually("the three requests held by the freeze", || async {
        pod.get_json("/control").await["held_by_freeze"] == 3
    })
    .await;
    // The GPU (NVML's stand-in) and the control endpoint still answer while they are held.
    assert_eq!(pod.get_json("/sim/gpu").await["gpus"][0]["index"], 0);
    let control = pod.get_json("/control").await;
    assert_eq!(control["freeze"], true);
    assert_eq!(control["held_by_freeze"], 3, "{control}");
    assert!(
        held.iter().all(|h| !h.is_finished()),
        "a frozen pod answered"
    );
    pod.control(json!({"freeze": false})).await;
    for h in held {
        let status = timeout(Duration::from_secs(10), h).await.unwrap().unwrap();
        assert_eq!(status, 200);
    }
    assert_eq!(pod.get_json("/control").await["held_by_freeze"], 0);
}

#[tokio::test]
async fn malformed_and_unknown_model_requests() {
    let pod = Pod::start(&[]).await;
    for path in ["/v1/chat/completions", "/v1/completions"] {
        let r = pod
            .http
            .post(pod.url(path))
            .header("content-type", "application/json")
            .body("{\"messages\": [")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400);
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["type"], "BadRequestError");
        assert!(v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("invalid JSON"));
    }
    let r = pod
        .post(
            "/v1/completions",
            json!({"model": "other/model", "prompt": "x"}),
        )
        .await;
    assert_eq!(r.status(), 404);
    let v: Value = r.json().await.unwrap();
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("other/model"));
    let r = pod
        .post("/v1/completions", json!({"prompt": "x", "max_tokens": 0}))
        .await;
    assert_eq!(r.status(), 400);
}

#[tokio::test]
async fn outputs_are_deterministic_under_a_seed() {
    let a = Pod::start(&["--seed", "7"]).await;
    let b = Pod::start(&["--seed", "7"]).await;
    let c = Pod::start(&["--seed", "8"]).await;
    let text = |v: Value| {
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let body = chat("same prompt", 16);
    let ta = text(
        a.post("/v1/chat/completions", body.clone())
            .await
            .json()
            .await
            .unwrap(),
    );
    let tb = text(
        b.post("/v1/chat/completions", body.clone())
            .await
            .json()
            .await
            .unwrap(),
    );
    let tc = text(
        c.post("/v1/chat/completions", body)
            .await
            .json()
            .await
            .unwrap(),
    );
    assert_eq!(ta, tb);
    assert_ne!(ta, tc);

    // injected errors follow the seeded RNG: same seed, same request order, same failures
    let mut seq = Vec::new();
    for pod in [&a, &b] {
        pod.control(json!({"error_rate": 0.5})).await;
        let mut statuses = Vec::new();
        for _ in 0..24 {
            statuses.push(
                pod.post("/v1/chat/completions", chat("x", 1))
                    .await
                    .status(),
            );
        }
        seq.push(statuses);
    }
    assert_eq!(seq[0], seq[1]);
    assert!(seq[0].contains(&reqwest::StatusCode::OK));
    assert!(seq[0].contains(&reqwest::StatusCode::INTERNAL_SERVER_ERROR));
}

#[tokio::test]
async fn queueing_beyond_max_num_seqs_and_abort_on_disconnect() {
    let pod = Pod::start(&["--max-num-seqs", "1", "--time-scale", "1"]).await;
    let mut clients = Vec::new();
    for _ in 0..4 {
        let http = pod.http.clone();
        let url = pod.url("/v1/chat/completions");
        clients.push(tokio::spawn(async move {
            let _ = http.post(url).json(&chat("x", 100_000)).send().await;
        }));
    }
    eventually("1 running, 3 waiting", || async {
        let m = pod.metrics().await;
        sample(&m, &series("vllm:num_requests_running")) == 1.0
            && sample(&m, &series("vllm:num_requests_waiting")) == 3.0
    })
    .await;
    // KV use counts tokens held (prefilled + generated), so it is 0 until the running
    // request's first iteration ends: wait for it rather than read once (a race on a busy box).
    eventually("KV cache in use", || async {
        let m = pod.metrics().await;
        sample(&m, &series("vllm:kv_cache_usage_perc")) > 0.0
    })
    .await;
    for c in &clients {
        c.abort();
    }
    eventually("all aborted", || async {
        let m = pod.metrics().await;
        sample(&m, &series("vllm:num_requests_running")) == 0.0
            && sample(&m, &series("vllm:num_requests_waiting")) == 0.0
    })
    .await;
    let m = pod.metrics().await;
    let abort =
        format!("vllm:request_success_total{{finished_reason=\"abort\",model_name=\"{MODEL}\"}}");
    assert_eq!(sample(&m, &abort), 4.0);
}

#[tokio::test]
async fn invalid_flags_exit_nonzero_naming_flag_and_value() {
    let out = Command::new(BIN)
        .args(["--listen", "127.0.0.1:0", "--time-scale", "0"])
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--time-scale") && err.contains("'0'"), "{err}");
    let out = Command::new(BIN)
        .args(["--listen", "127.0.0.1:0"])
        .env("AI_LB_FAKE_POD_PRESET", "tpu-v5")
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--preset") && err.contains("tpu-v5"), "{err}");
    let out = Command::new(BIN)
        .args(["--listen", "127.0.0.1:0"])
        .env("AI_LB_FAKE_POD_GPU_UTIL_MODEL", "busy")
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--gpu-util-model") && err.contains("busy"),
        "{err}"
    );
    for (args, flag, value) in [
        (&["--block-size", "24"][..], "--block-size", "24"),
        (
            &["--kv-events-endpoint", "localhost:5557"][..],
            "--kv-events-endpoint",
            "localhost:5557",
        ),
    ] {
        let out = Command::new(BIN)
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .output()
            .await
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(flag) && err.contains(value), "{err}");
    }
}

#[tokio::test]
async fn sigterm_shuts_down_gracefully() {
    let mut pod = Pod::start(&[]).await;
    let pid = pod.child.id().unwrap().to_string();
    let st = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .await
        .unwrap();
    assert!(st.success());
    let status = timeout(Duration::from_secs(10), pod.child.wait())
        .await
        .expect("exits within 10 s")
        .unwrap();
    assert!(status.success(), "{status:?}");
}

#[tokio::test]
async fn truncate_memory_error_and_malformed_faults() {
    let pod = Pod::start(&[]).await;
    // memory_error_rate 1: vLLM's 500 naming CUDA out-of-memory.
    assert_eq!(
        pod.control(json!({"memory_error_rate": 1.0}))
            .await
            .status(),
        200
    );
    let r = pod.post("/v1/chat/completions", chat("x", 4)).await;
    assert_eq!(r.status(), 500);
    let v: Value = r.json().await.unwrap();
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("CUDA out of memory") && msg.contains("OutOfMemoryError"),
        "{msg}"
    );

    // truncate_rate 1: a stream of max_tokens / 2 tokens, no finish reason, usage or [DONE].
    pod.control(json!({"memory_error_rate": 0, "truncate_rate": 1.0}))
        .await;
    let mut body = chat("hello", 8);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let r = pod.post("/v1/chat/completions", body).await;
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    let data: Vec<Value> = text
        .split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| serde_json::from_str(e.strip_prefix("data: ").unwrap()).expect("JSON, no [DONE]"))
        .collect();
    assert_eq!(data.len(), 4, "{text}");
    assert!(data
        .iter()
        .all(|c| c["choices"][0]["finish_reason"].is_null()));
    // Not streamed: half the tokens and finish_reason null.
    let r = pod.post("/v1/chat/completions", chat("hello", 8)).await;
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], Value::Null);
    assert_eq!(v["usage"]["completion_tokens"], 4);

    // malformed_rate 1: a 200 that is not JSON.
    pod.control(json!({"truncate_rate": 0, "malformed_rate": 1.0}))
        .await;
    let r = pod.post("/v1/chat/completions", chat("hello", 8)).await;
    assert_eq!(r.status(), 200);
    assert!(serde_json::from_str::<Value>(&r.text().await.unwrap()).is_err());
    pod.control(json!({"malformed_rate": 0, "truncate_rate": 1.0}))
        .await;

    for bad in [
        json!({"truncate_rate": 1.5}),
        json!({"memory_error_rate": -1}),
        json!({"malformed_rate": 2}),
    ] {
        assert_eq!(pod.control(bad).await.status(), 400);
    }
    // Off again: whole answers.
    pod.control(json!({"truncate_rate": 0})).await;
    let v: Value = pod
        .post("/v1/chat/completions", chat("hello", 8))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "length");
}

#[tokio::test]
async fn frontend_delay_queues_requests_where_no_metric_sees_them() {
    let pod = Pod::start(&["--pod-name", "pod-fe"]).await;
    let r = pod.control(json!({"frontend_ms": 300})).await;
    assert_eq!(r.status(), 200);
    assert_eq!(pod.get_json("/control").await["frontend_ms"], 300);
    // Three at once: the front end takes them one at a time, 300 ms each.
    let started = Instant::now();
    let send = |c: &'static str| {
        let http = pod.http.clone();
        let url = pod.url("/v1/chat/completions");
        tokio::spawn(async move {
            let r = http.post(url).json(&chat(c, 2)).send().await.unwrap();
            assert_eq!(r.status(), 200);
            started.elapsed()
        })
    };
    let handles = [send("a"), send("b"), send("c")];
    // While they wait in the front end the engine counts none of them.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let m = pod.metrics().await;
    assert_eq!(sample(&m, &series("vllm:num_requests_waiting")), 0.0);
    assert_eq!(sample(&m, &series("vllm:num_requests_running")), 0.0);
    let mut took = Vec::new();
    for h in handles {
        took.push(h.await.unwrap());
    }
    took.sort();
    for (i, t) in took.iter().enumerate() {
        let floor = Duration::from_millis(300 * (i as u64 + 1));
        assert!(
            *t >= floor,
            "request {i} answered after {t:?}, before {floor:?}"
        );
    }
    // The engine's TTFT histogram starts at the engine: it holds none of the front end's wait.
    let m = pod.metrics().await;
    let ttft_sum = sample(&m, &series("vllm:time_to_first_token_seconds_sum"));
    assert!(
        ttft_sum < 0.3,
        "TTFT sum {ttft_sum} s counts the front end's 1.8 s of waiting"
    );
    pod.control(json!({"frontend_ms": 0})).await;
    assert_eq!(pod.get_json("/control").await["frontend_ms"], 0);
    // Bad values are refused, naming the field and value.
    for v in [json!(-1), json!(60_001), json!("x")] {
        let r = pod.control(json!({ "frontend_ms": v })).await;
        assert_eq!(r.status(), 400);
        let v: Value = r.json().await.unwrap();
        assert!(v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("frontend_ms"));
    }
}
