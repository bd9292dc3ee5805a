//! Shared pieces of the filter's end-to-end tests: the plugin config they run with, the
//! scoreboard (status path) reader, and request loops that count which pod served.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::time::Duration;

use ai_lb_e2e::envoy::{Envoy, EnvoyOptions, HttpClient, PodPool};
use serde_json::Value;

mod path;
#[allow(unused_imports)]
pub use path::{Path, BOTH};

pub const STATUS_PATH: &str = "/ai-lb/status";

/// The plugin config: one pool on the `inference` cluster, GPU-only weights unless `extra`
/// overrides them, fast refresh, small breaker; `extra` is merged at the top level.
pub fn config(extra: Value) -> String {
    let mut base = serde_json::json!({
        "pools": [{
            "name": "default",
            "cluster": "inference",
            "agentCluster": "ai_lb_agents",
            "weights": {"gpu": 1.0}
        }],
        "minPods": 1,
        "emaAlpha": 1.0,
        "floorWeight": 0.0,
        "statusPath": STATUS_PATH,
        "debugHeader": "x-ai-lb-debug",
        "cutoffs": {"stalenessMs": 5000},
        "breaker": {"consecutiveFailures": 3, "baseCooldownMs": 1500, "halfOpenProbes": 2},
        "watch": {"refreshMs": 20, "minIntervalMs": 50, "heartbeatMs": 300, "reconnectBaseMs": 100, "reconnectMaxMs": 1000}
    });
    if let (Some(b), Value::Object(e)) = (base.as_object_mut(), extra) {
        for (k, v) in e {
            b.insert(k, v);
        }
    }
    base.to_string()
}

/// Starts Envoy in front of `pool` with `config`.
pub fn envoy_for(pool: &PodPool, config: String) -> Envoy {
    let mut opts = EnvoyOptions::new(config);
    opts.inference = pool.pod_addrs.clone();
    opts.agents = pool.agent_addrs.clone();
    Envoy::start(&opts).unwrap()
}

/// The scoreboard JSON served on the status path.
pub fn scoreboard(envoy: &Envoy) -> Value {
    let r = HttpClient::new(envoy.listener)
        .get(STATUS_PATH, &[("connection", "close")])
        .unwrap();
    assert_eq!(r.status, 200, "status path: {}", r.text());
    serde_json::from_slice(&r.body).unwrap_or_else(|e| panic!("status JSON: {e}: {}", r.text()))
}

/// Reads Envoy stat `name` until `ok` holds for it (up to 5 s) and returns it. The filter
/// exports its counters every 200 ms, so a stat read right after the event can lag it.
pub fn wait_stat(envoy: &Envoy, name: &str, ok: impl Fn(u64) -> bool) -> u64 {
    let mut last = None;
    envoy
        .poll(Duration::from_secs(5), name, || {
            last = envoy.stat(name).ok();
            last.filter(|v| ok(*v))
        })
        .unwrap_or_else(|e| panic!("stat {name} = {last:?}: {e}"))
}

/// The scoreboard row of the pod serving at `addr` (first pool).
pub fn row(sb: &Value, addr: &str) -> Option<Value> {
    sb["pools"][0]["pods"]
        .as_array()?
        .iter()
        .find(|p| p["address"] == addr)
        .cloned()
}

/// The breaker state (`closed`, `half_open`, `open`) the scoreboard shows for pod `i` of
/// `pool` (empty when the pod is not on it).
pub fn breaker_of(envoy: &Envoy, pool: &PodPool, i: usize) -> String {
    row(&scoreboard(envoy), &pool.pod_addrs[i].to_string())
        .and_then(|r| r["breaker"].as_str().map(str::to_string))
        .unwrap_or_default()
}

/// Polls the scoreboard until `ok` holds for it.
pub fn wait_scoreboard(
    envoy: &Envoy,
    what: &str,
    timeout_s: u64,
    ok: impl Fn(&Value) -> bool,
) -> Value {
    let mut last = Value::Null;
    let got = envoy.poll(Duration::from_secs(timeout_s), what, || {
        let sb = scoreboard(envoy);
        if ok(&sb) {
            Some(sb)
        } else {
            last = sb;
            None
        }
    });
    got.unwrap_or_else(|e| panic!("{e}\nlast scoreboard: {last:#}"))
}

/// True when every pod of `pool` has fresh metrics on the scoreboard.
pub fn all_fresh(sb: &Value, pool: &PodPool) -> bool {
    pool.pod_addrs.iter().all(|a| {
        row(sb, &a.to_string())
            .is_some_and(|r| r["metricsAgeMs"].as_u64().is_some_and(|age| age < 1000))
    })
}

/// The filter's decision counters (steered, fallbacks, fail-opens), for failure messages.
pub fn decision_stats(envoy: &Envoy) -> String {
    envoy
        .stats()
        .map(|s| {
            s.iter()
                .filter(|(k, _)| {
                    let k = k
                        .strip_prefix("wasmcustom.")
                        .or_else(|| k.strip_prefix("dynamicmodulescustom."));
                    k.is_some_and(|k| k.starts_with("ailb.") && !k.starts_with("ailb.endpoint."))
                })
                .map(|(k, v)| format!("{k}: {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        })
        .unwrap_or_default()
}

/// Sends `n` sequential GETs and counts the `x-fake-pod` of the answers; every answer must be 200.
pub fn count_served(envoy: &Envoy, n: usize, headers: &[(&str, &str)]) -> BTreeMap<String, usize> {
    let mut client = HttpClient::new(envoy.listener);
    let mut served = BTreeMap::new();
    for i in 0..n {
        let r = client.get("/v1/models", headers).unwrap();
        assert_eq!(r.status, 200, "request {i}: {} {}", r.status, r.text());
        *served
            .entry(r.header("x-fake-pod").unwrap_or("none").to_string())
            .or_insert(0) += 1;
    }
    served
}

/// One completion request (small, fast); returns status and the serving pod.
pub fn complete(client: &mut HttpClient) -> (u16, String) {
    let r = client
        .post_json(
            "/v1/completions",
            &[],
            r#"{"prompt":"hello there","max_tokens":4}"#,
        )
        .unwrap();
    (
        r.status,
        r.header("x-fake-pod").unwrap_or("none").to_string(),
    )
}

/// A completion request body whose prompt is `tokens` tokens for the fake pod (4 characters
/// each), reserving `max_tokens`.
pub fn body(tokens: usize, max_tokens: u32) -> String {
    serde_json::json!({"prompt": "abc ".repeat(tokens), "max_tokens": max_tokens}).to_string()
}

/// Two fake pods with 8 seats each and the KV cache `kv_tokens(i)` for pod `i`, GPU forced to
/// 30 % on both (equal scores), with their agents.
pub fn kv_pool(kv_tokens: impl Fn(usize) -> u64) -> PodPool {
    let pool = PodPool::start_with(2, 1.0, |i| {
        vec![
            "--kv-cache-tokens".to_string(),
            kv_tokens(i).to_string(),
            "--max-num-seqs".to_string(),
            "8".to_string(),
        ]
    })
    .unwrap();
    for i in 0..2 {
        pool.control(i, r#"{"sm_occupancy":0.3}"#).unwrap();
    }
    pool
}

/// Sends `body` straight to the pod at `addr` (not through Envoy) on a thread: its status (0
/// when it failed) and when it ended.
pub fn direct(
    addr: std::net::SocketAddr,
    body: String,
) -> std::thread::JoinHandle<(u16, std::time::Instant)> {
    std::thread::spawn(move || {
        let s = HttpClient::new(addr)
            .with_timeout(Duration::from_secs(60))
            .post_json("/v1/completions", &[("connection", "close")], &body)
            .map(|r| r.status)
            .unwrap_or(0);
        (s, std::time::Instant::now())
    })
}

/// Sends `n` small completion requests through Envoy one after another; each must be 200.
pub fn short_requests(envoy: &Envoy, n: usize) {
    let mut client = HttpClient::new(envoy.listener);
    for _ in 0..n {
        let r = client
            .post_json("/v1/completions", &[], &body(2, 4))
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
    }
}

/// One streamed completion of `max_tokens` through `listener` on a thread: the serving pod
/// and when the stream ended.
pub fn long_stream(
    listener: std::net::SocketAddr,
    max_tokens: u32,
) -> std::thread::JoinHandle<(String, std::time::Instant)> {
    std::thread::spawn(move || {
        let body =
            serde_json::json!({"prompt": "hello there", "max_tokens": max_tokens, "stream": true});
        let r = HttpClient::new(listener)
            .with_timeout(Duration::from_secs(60))
            .post_json(
                "/v1/completions",
                &[("connection", "close")],
                &body.to_string(),
            )
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        let pod = r.header("x-fake-pod").unwrap_or("none").to_string();
        (pod, std::time::Instant::now())
    })
}
