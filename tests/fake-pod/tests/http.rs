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
        let line = timeout(Duration::from_secs(20), lines.next_line())
            .await
            .expect("LISTENING line within 20 s")
            .unwrap()
            .expect("a stdout line");
        let addr = line
            .strip_prefix("LISTENING http ")
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"));
        Pod {
            child,
            base: format!("http://{addr}"),
            http: reqwest::Client::new(),
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
    // ceil(9 / 4) = 3 prompt tokens
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10})
    );
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(text.split(' ').count(), 7, "{text}");

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
        json!({"prompt_tokens": 3, "completion_tokens": 12, "total_tokens": 15})
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
    assert_eq!(count("vllm:prompt_tokens_total"), 3.0);
    assert_eq!(count("vllm:generation_tokens_total"), 15.0);
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
    assert!(line.ends_with("} 1.0"), "{line}");
    // --kv-cache-tokens 1000: 62 whole blocks (992 tokens), as vLLM rounds down.
    let pod = Pod::start(&["--kv-cache-tokens", "1000"]).await;
    let line = info(&pod.metrics().await);
    assert!(line.contains("num_gpu_blocks=\"62\""), "{line}");
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
    // The GPU (NVML's stand-in) and the control endpoint still answer while frozen.
    assert_eq!(pod.get_json("/sim/gpu").await["gpus"][0]["index"], 0);
    assert_eq!(pod.get_json("/control").await["freeze"], true);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        held.iter().all(|h| !h.is_finished()),
        "a frozen pod answered"
    );
    pod.control(json!({"freeze": false})).await;
    for h in held {
        let status = timeout(Duration::from_secs(10), h).await.unwrap().unwrap();
        assert_eq!(status, 200);
    }
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
