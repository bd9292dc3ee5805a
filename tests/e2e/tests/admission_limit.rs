//! Decides whether token-weighted admission holds in a real Envoy (`--concurrency 2`, so two
//! worker VMs share one bucket through shared data): at ~3x the configured rate, the cost
//! admitted per 10 s window (as actual usage, after reconciliation) stays within ±2% of
//! rate x window; 429s carry `retry-after`, `x-ratelimit-*` and the OpenAI error body; the
//! reconciled total (reserved + charged - refunded) equals the usage the pods reported, for
//! JSON and SSE responses; malformed JSON gets a 400 OpenAI error.
//!
//! `cargo test -p ai-lb-e2e --test admission_limit -- --nocapture` prints the measured ratio
//! and the prompt estimation error.

mod filter_common;

use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use ai_lb_e2e::envoy::{Envoy, HttpClient, PodPool, Response};
use ai_lb_filter_core::admission::config::CostConfig;
use ai_lb_filter_core::admission::cost::{cost_from_body, Endpoint};
use ai_lb_filter_core::admission::UsageScanner;
use filter_common::*;
use serde_json::{json, Value};

/// Weighted tokens per second of the tenant's bucket.
const RATE: u64 = 2_000;
/// Bucket size: small next to RATE x WINDOW, so the window measures the rate.
const BURST: u64 = 2_000;
const WARMUP: Duration = Duration::from_secs(2);
const WINDOW: Duration = Duration::from_secs(10);
const THREADS: usize = 5;
const TENANT: &str = "team-a";

/// One request as the client saw it.
#[derive(Debug, Clone)]
struct Sent {
    at: Duration,
    status: u16,
    /// Weighted usage the pod reported (text weight 1: prompt + completion tokens).
    actual: Option<u64>,
    /// The filter's prompt estimate for this body (same core code, default cost config).
    estimated_prompt: u64,
    prompt_tokens: Option<u64>,
}

fn body_for(i: usize) -> (String, bool) {
    let words = [
        "the GPU is busy",
        "please summarise the following paragraph about token buckets and fairness",
        "hello there, how are you today? I would like a short poem about Envoy sidecars",
        "count: 1 2 3 4 5 6 7 8 9 10 11 12",
    ];
    let prompt = words[i % words.len()];
    let stream = i % 3 == 0;
    let mut b = json!({"prompt": prompt, "max_tokens": 24 + (i % 5) as u64 * 8});
    if stream {
        b["stream"] = json!(true);
        b["stream_options"] = json!({"include_usage": true});
    }
    (b.to_string(), stream)
}

fn usage_of(r: &Response) -> Option<ai_lb_filter_core::admission::Usage> {
    let mut s = UsageScanner::new();
    s.feed(&r.body);
    s.usage()
}

fn config() -> String {
    filter_common::config(json!({
        "admission": {
            "tenantKey": ["header:x-tenant-id"],
            "tenants": {"default": {"tokensPerSecond": RATE, "burst": BURST}},
            "cost": {"defaultOutputTokens": 16}
        }
    }))
}

fn stat(envoy: &Envoy, name: &str) -> u64 {
    envoy
        .stat(&format!("wasmcustom.ailb.admission.{name}"))
        .unwrap_or(0)
}

#[test]
fn admitted_cost_follows_the_rate_and_reconciles_to_actual_usage() {
    let pool = PodPool::start(2, 0.01).unwrap();
    let envoy = envoy_for(&pool, config());
    let mut client = HttpClient::new(envoy.listener);

    // Malformed JSON: 400 in OpenAI's shape, before any bucket is touched.
    let r = client
        .post_json(
            "/v1/completions",
            &[("x-tenant-id", "someone-else")],
            "{\"prompt\": ",
        )
        .unwrap();
    assert_eq!(r.status, 400, "{}", r.text());
    let e: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(e["error"]["type"], "invalid_request_error", "{e}");
    assert_eq!(stat(&envoy, "malformed_bodies"), 1);

    // Load: THREADS clients paced to ~3x RATE in weighted tokens.
    let cost_cfg = CostConfig {
        default_output_tokens: 16,
        ..CostConfig::default()
    };
    let per_req = {
        let mut sum = 0;
        for i in 0..20 {
            let (b, _) = body_for(i);
            sum += cost_from_body(&cost_cfg, Endpoint::Completions, b.as_bytes())
                .unwrap()
                .weighted;
        }
        sum as f64 / 20.0
    };
    let req_per_s = 3.0 * RATE as f64 / per_req;
    let interval = Duration::from_secs_f64(THREADS as f64 / req_per_s);
    let log: Arc<Mutex<Vec<Sent>>> = Arc::default();
    let first_429: Arc<Mutex<Option<Response>>> = Arc::default();
    let t0 = Instant::now();
    let end = WARMUP + WINDOW + Duration::from_millis(500);
    let mut handles = Vec::new();
    for t in 0..THREADS {
        let log = log.clone();
        let first_429 = first_429.clone();
        let addr = envoy.listener;
        let cost_cfg = cost_cfg.clone();
        handles.push(thread::spawn(move || {
            let mut c = HttpClient::new(addr);
            let mut k = 0u32;
            loop {
                // Pacing (open-loop schedule), staggered per thread.
                let due = interval.mul_f64(f64::from(k) + t as f64 / THREADS as f64);
                k += 1;
                if due > end {
                    break;
                }
                if let Some(wait) = due.checked_sub(t0.elapsed()) {
                    thread::sleep(wait);
                }
                let i = t * 1000 + k as usize;
                let (body, _) = body_for(i);
                let at = t0.elapsed();
                let r = c
                    .post_json("/v1/completions", &[("x-tenant-id", TENANT)], &body)
                    .unwrap();
                let est = cost_from_body(&cost_cfg, Endpoint::Completions, body.as_bytes())
                    .map(|c| c.text_tokens)
                    .unwrap_or(0);
                let usage = (r.status == 200).then(|| usage_of(&r)).flatten();
                if r.status == 429 {
                    let mut f = first_429.lock().unwrap();
                    if f.is_none() {
                        *f = Some(r.clone());
                    }
                } else {
                    assert_eq!(r.status, 200, "{}", r.text());
                    assert!(
                        r.header("x-ratelimit-limit").is_some(),
                        "admitted responses carry x-ratelimit-*: {:?}",
                        r.headers
                    );
                }
                log.lock().unwrap().push(Sent {
                    at,
                    status: r.status,
                    actual: usage.map(|u| u.prompt_tokens + u.completion_tokens),
                    estimated_prompt: est,
                    prompt_tokens: usage.map(|u| u.prompt_tokens),
                });
            }
        }));
    }
    for h in handles {
        h.join().unwrap();
    }
    let log = log.lock().unwrap().clone();

    // The 429 shape.
    let r = first_429
        .lock()
        .unwrap()
        .clone()
        .expect("3x the rate must see 429s");
    assert!(r
        .header("retry-after")
        .and_then(|v| v.parse::<u64>().ok())
        .is_some_and(|s| s >= 1));
    assert_eq!(
        r.header("x-ratelimit-limit"),
        Some(BURST.to_string().as_str())
    );
    assert!(r.header("x-ratelimit-remaining").is_some());
    assert!(r.header("x-ratelimit-reset").is_some());
    let e: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(e["error"]["type"], "tokens", "{e}");
    assert_eq!(e["error"]["code"], "rate_limit_exceeded", "{e}");

    // Every admitted response reported usage (JSON and SSE alike).
    let ok: Vec<&Sent> = log.iter().filter(|s| s.status == 200).collect();
    let rejected = log.iter().filter(|s| s.status == 429).count() as u64;
    assert!(ok.iter().all(|s| s.actual.is_some()), "a 200 without usage");

    // The window: offered and admitted cost, by send time.
    let in_window = |s: &Sent| s.at >= WARMUP && s.at < WARMUP + WINDOW;
    let admitted: u64 = ok
        .iter()
        .filter(|s| in_window(s))
        .filter_map(|s| s.actual)
        .sum();
    let offered_n = log.iter().filter(|s| in_window(s)).count() as f64;
    let offered = offered_n * per_req;
    let target = RATE as f64 * WINDOW.as_secs_f64();
    let ratio = admitted as f64 / target;
    println!(
        "admission window {:?}: admitted {admitted} weighted tokens of {target} (ratio {ratio:.4}); \
         offered ~{offered:.0} ({:.2}x) in {offered_n} requests; {} admitted, {rejected} rejected overall",
        WINDOW,
        offered / target,
        ok.len()
    );
    assert!(
        offered / target >= 2.0,
        "the load was too light to saturate the bucket ({:.2}x)",
        offered / target
    );
    assert!(
        (ratio - 1.0).abs() <= 0.02,
        "admitted {admitted} in the window, {target} configured (ratio {ratio:.4})"
    );

    // Prompt estimation error, measured against what the pods counted.
    let errs: Vec<f64> = ok
        .iter()
        .filter_map(|s| {
            let p = s.prompt_tokens? as f64;
            (p > 0.0).then(|| (s.estimated_prompt as f64 - p) / p * 100.0)
        })
        .collect();
    let mean_abs = errs.iter().map(|e| e.abs()).sum::<f64>() / errs.len().max(1) as f64;
    let mean = errs.iter().sum::<f64>() / errs.len().max(1) as f64;
    println!(
        "prompt estimate vs the fake pod's count (ceil(chars/4)): mean {mean:+.1}%, mean |error| {mean_abs:.1}% over {} requests",
        errs.len()
    );

    // Reconciliation: the bucket was charged exactly what the pods reported.
    let actual_total: u64 = ok.iter().filter_map(|s| s.actual).sum();
    let n_ok = ok.len() as u64;
    envoy
        .poll(
            Duration::from_secs(10),
            "every admitted request settled",
            || (stat(&envoy, "settled") + stat(&envoy, "reservations_kept") >= n_ok).then_some(()),
        )
        .unwrap_or_else(|e| panic!("{e}: {}", decision_stats(&envoy)));
    let reserved = stat(&envoy, "tokens_reserved");
    let charged = stat(&envoy, "tokens_charged");
    let refunded = stat(&envoy, "tokens_refunded");
    println!(
        "reconciliation: reserved {reserved} + charged {charged} - refunded {refunded} = {} ; \
         pods reported {actual_total}",
        reserved + charged - refunded
    );
    assert_eq!(stat(&envoy, "reservations_kept"), 0);
    assert_eq!(stat(&envoy, "store_contended"), 0);
    assert_eq!(reserved + charged - refunded, actual_total);
    assert_eq!(stat(&envoy, "tokens_actual"), actual_total);
    let per = |what: &str| stat(&envoy, &format!("tenant.{TENANT}.standard.{what}"));
    assert_eq!(per("admitted"), n_ok);
    assert_eq!(per("rate_limited"), rejected);
    assert_eq!(stat(&envoy, "rate_limited"), rejected);
    assert!(
        !envoy.wasm_failed(),
        "wasm trapped:\n{}",
        envoy.log_tail(40)
    );
}
