//! Measures admission control in a real Envoy (`--concurrency 2`): how closely the token-weighted
//! limiter holds its configured rate per 1 s and 10 s window at 1x, 3x and 10x offered load
//! (fake pods + agents upstream), and what request-body buffering + costing adds to latency
//! (interleaved A/B: the same plugin config with and without `admission`, same stub upstream).
//!
//! Run by hand (needs the wasm filter, `ai-lb-agent` and `ai-lb-fake-pod` built):
//! `cargo run --release -p ai-lb-e2e --example admission_bench -- [--secs 30] [--pairs 3000]
//! [--only accuracy|latency] [--out bench-results/admission.json]`
//!
//! Accuracy: open-loop paced clients send a mix of JSON and SSE completions for one tenant per
//! load level; every request's admitted cost is what the pod reported (prompt + completion
//! tokens, text weight 1), binned by the client's send time into windows aligned to
//! `load start + warm-up` (non-overlapping 1 s and 10 s windows). The ratio per window is
//! admitted weighted tokens / (rate x window length). The filter's own accounting
//! (`tokens_reserved + tokens_charged - tokens_refunded`) is checked against the pods' total.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use ai_lb_e2e::envoy::{Envoy, EnvoyOptions, HttpClient, PodPool, StubUpstream};
use ai_lb_filter_core::admission::config::CostConfig;
use ai_lb_filter_core::admission::cost::{cost_from_body, Endpoint};
use ai_lb_filter_core::admission::UsageScanner;
use serde_json::{json, Value};

/// Weighted tokens per second of each tenant's bucket.
const RATE: u64 = 2_000;
/// Bucket size: one second of rate, small next to a 10 s window.
const BURST: u64 = 2_000;
const WARMUP: Duration = Duration::from_secs(2);
const DEFAULT_OUTPUT_TOKENS: u32 = 16;

struct Args {
    secs: u64,
    pairs: usize,
    accuracy: bool,
    latency: bool,
    out: String,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        secs: 30,
        pairs: 3000,
        accuracy: true,
        latency: true,
        out: "bench-results/admission.json".into(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let val = it
            .next()
            .ok_or_else(|| format!("flag {flag} needs a value"))?;
        let bad = |why: &str| format!("{flag} {val:?}: {why}");
        match flag.as_str() {
            "--secs" => {
                a.secs = val.parse().map_err(|_| bad("not a whole number"))?;
                if a.secs < 10 || a.secs % 10 != 0 {
                    return Err(bad("must be a multiple of 10, at least 10"));
                }
            }
            "--pairs" => {
                a.pairs = val.parse().map_err(|_| bad("not a whole number"))?;
                if a.pairs < 100 {
                    return Err(bad("must be at least 100"));
                }
            }
            "--only" => match val.as_str() {
                "accuracy" => a.latency = false,
                "latency" => a.accuracy = false,
                _ => return Err(bad("must be accuracy or latency")),
            },
            "--out" => a.out = val,
            _ => return Err(format!("unknown flag {flag:?}")),
        }
    }
    Ok(a)
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

/// The plugin config (as the e2e tests use it), plus `extra` at the top level.
fn plugin_config(extra: Value) -> String {
    let mut base = json!({
        "pools": [{
            "name": "default",
            "cluster": "inference",
            "agentCluster": "ai_lb_agents",
            "weights": {"gpu": 1.0}
        }],
        "minPods": 1,
        "emaAlpha": 1.0,
        "floorWeight": 0.0,
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

fn admission(rate: u64, burst: u64) -> Value {
    json!({"admission": {
        "tenantKey": ["header:x-tenant-id"],
        "tenants": {"default": {"tokensPerSecond": rate, "burst": burst}},
        "cost": {"defaultOutputTokens": DEFAULT_OUTPUT_TOKENS}
    }})
}

fn adm_stat(stats: &BTreeMap<String, u64>, name: &str) -> u64 {
    stats
        .get(&format!("wasmcustom.ailb.admission.{name}"))
        .copied()
        .unwrap_or(0)
}

/// min, median, max.
fn summary(mut v: Vec<f64>) -> Value {
    if v.is_empty() {
        return Value::Null;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let median = if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    };
    json!({"n": n, "min": round4(v[0]), "median": round4(median), "max": round4(v[n - 1])})
}

fn round4(x: f64) -> f64 {
    (x * 10_000.0).round() / 10_000.0
}

/// The completion body of request `i` (a third stream with usage); the same mix as the
/// `admission_limit` e2e test.
fn completion_body(i: usize) -> String {
    let words = [
        "the GPU is busy",
        "please summarise the following paragraph about token buckets and fairness",
        "hello there, how are you today? I would like a short poem about Envoy sidecars",
        "count: 1 2 3 4 5 6 7 8 9 10 11 12",
    ];
    let mut b = json!({"prompt": words[i % words.len()], "max_tokens": 24 + (i % 5) as u64 * 8});
    if i % 3 == 0 {
        b["stream"] = json!(true);
        b["stream_options"] = json!({"include_usage": true});
    }
    b.to_string()
}

#[derive(Clone, Copy)]
struct Sent {
    at: Duration,
    status: u16,
    /// prompt + completion tokens the pod reported (200 only).
    actual: Option<u64>,
    /// Send to full response.
    took: Duration,
}

/// One load level: `factor` x RATE offered (by the filter's own cost estimate) for WARMUP +
/// `secs`, one fresh tenant.
fn accuracy_level(envoy: &Envoy, factor: f64, secs: u64) -> Result<Value, String> {
    let tenant = format!("bench-{factor}x");
    let cost_cfg = CostConfig {
        default_output_tokens: DEFAULT_OUTPUT_TOKENS,
        ..CostConfig::default()
    };
    let mut sum = 0u64;
    for i in 0..60 {
        sum += cost_from_body(
            &cost_cfg,
            Endpoint::Completions,
            completion_body(i).as_bytes(),
        )
        .map_err(|e| format!("costing the bench body: {e:?}"))?
        .weighted;
    }
    let per_req = sum as f64 / 60.0;
    let req_per_s = factor * RATE as f64 / per_req;
    let threads = ((req_per_s / 12.0).ceil() as usize).clamp(4, 48);
    let interval = Duration::from_secs_f64(threads as f64 / req_per_s);
    let window = Duration::from_secs(secs);
    let end = WARMUP + window + Duration::from_millis(300);
    let before = envoy.stats()?;
    let load_before = loadavg();
    let log: Arc<Mutex<Vec<Sent>>> = Arc::default();
    let errors: Arc<Mutex<Vec<String>>> = Arc::default();
    let t0 = Instant::now();
    let mut handles = Vec::new();
    for t in 0..threads {
        let (log, errors, tenant) = (log.clone(), errors.clone(), tenant.clone());
        let addr = envoy.listener;
        handles.push(thread::spawn(move || {
            let mut c = HttpClient::new(addr).with_timeout(Duration::from_secs(10));
            let mut k = 0u32;
            loop {
                let due = interval.mul_f64(f64::from(k) + t as f64 / threads as f64);
                k += 1;
                if due > end {
                    break;
                }
                if let Some(wait) = due.checked_sub(t0.elapsed()) {
                    thread::sleep(wait);
                }
                let body = completion_body(t * 100_000 + k as usize);
                let at = t0.elapsed();
                let res = c.post_json("/v1/completions", &[("x-tenant-id", &tenant)], &body);
                let took = t0.elapsed().saturating_sub(at);
                match res {
                    Ok(r) => {
                        let actual = (r.status == 200)
                            .then(|| {
                                let mut s = UsageScanner::new();
                                s.feed(&r.body);
                                s.usage().map(|u| u.prompt_tokens + u.completion_tokens)
                            })
                            .flatten();
                        if let Ok(mut l) = log.lock() {
                            l.push(Sent {
                                at,
                                status: r.status,
                                actual,
                                took,
                            });
                        }
                    }
                    Err(e) => {
                        if let Ok(mut l) = errors.lock() {
                            l.push(e);
                        }
                    }
                }
            }
        }));
    }
    for h in handles {
        h.join()
            .map_err(|_| "a client thread panicked".to_string())?;
    }
    let load_after = loadavg();
    let log = log.lock().map_err(|e| e.to_string())?.clone();
    let errors = errors.lock().map_err(|e| e.to_string())?.clone();
    let ok: Vec<Sent> = log.iter().copied().filter(|s| s.status == 200).collect();
    let n_ok = ok.len() as u64;
    let no_usage = ok.iter().filter(|s| s.actual.is_none()).count();
    let rejected = log.iter().filter(|s| s.status == 429).count();
    let other = log.len() - ok.len() - rejected;

    // Windows: [WARMUP + k*len, WARMUP + (k+1)*len) by send time.
    let ratios = |len: Duration| -> Vec<f64> {
        let n = (window.as_millis() / len.as_millis()) as usize;
        let mut admitted = vec![0u64; n];
        for s in &ok {
            if let Some(d) = s.at.checked_sub(WARMUP) {
                let k = (d.as_nanos() / len.as_nanos()) as usize;
                if let Some(slot) = admitted.get_mut(k) {
                    *slot += s.actual.unwrap_or(0);
                }
            }
        }
        let target = RATE as f64 * len.as_secs_f64();
        admitted.iter().map(|&a| a as f64 / target).collect()
    };
    let r1 = ratios(Duration::from_secs(1));
    // Per 1 s window: requests sent and the slowest response (stalls show here).
    let mut sent_1s = vec![0u64; secs as usize];
    let mut slowest_ms = vec![0u64; secs as usize];
    for s in &log {
        if let Some(d) = s.at.checked_sub(WARMUP) {
            let k = d.as_secs() as usize;
            if let (Some(n), Some(m)) = (sent_1s.get_mut(k), slowest_ms.get_mut(k)) {
                *n += 1;
                *m = (*m).max(s.took.as_millis() as u64);
            }
        }
    }
    let r10 = ratios(Duration::from_secs(10));
    let offered_n = log
        .iter()
        .filter(|s| s.at >= WARMUP && s.at < WARMUP + window)
        .count() as f64;
    let offered_x = offered_n * per_req / (RATE as f64 * window.as_secs_f64());

    // The filter's accounting against the pods' reports.
    let settled = |s: &BTreeMap<String, u64>| {
        adm_stat(s, "settled") + adm_stat(s, "reservations_kept")
            - adm_stat(&before, "settled")
            - adm_stat(&before, "reservations_kept")
    };
    let after = envoy
        .poll(Duration::from_secs(10), "admitted requests settled", || {
            envoy.stats().ok().filter(|s| settled(s) >= n_ok)
        })
        .or_else(|_| envoy.stats())?;
    let delta = |name: &str| adm_stat(&after, name) as i64 - adm_stat(&before, name) as i64;
    let filter_net = delta("tokens_reserved") + delta("tokens_charged") - delta("tokens_refunded");
    let pods_total: u64 = ok.iter().filter_map(|s| s.actual).sum();
    let within = |v: &[f64]| v.iter().filter(|r| (*r - 1.0).abs() <= 0.02).count();

    let out = json!({
        "offered_factor_target": factor,
        "offered_factor_measured": round4(offered_x),
        "mean_estimated_cost_per_request": round4(per_req),
        "client_threads": threads,
        "requests": log.len(), "admitted": n_ok, "rejected_429": rejected, "other_status": other,
        "client_errors": errors.len(), "admitted_without_usage": no_usage,
        "window_1s_ratio": summary(r1.clone()),
        "window_1s_within_2pct": within(&r1),
        "window_1s_ratios": r1.iter().map(|r| round4(*r)).collect::<Vec<_>>(),
        "window_1s_requests_sent": sent_1s,
        "window_1s_slowest_response_ms": slowest_ms,
        "window_10s_ratio": summary(r10.clone()),
        "window_10s_ratios": r10.iter().map(|r| round4(*r)).collect::<Vec<_>>(),
        "window_10s_within_2pct": within(&r10),
        "filter_reserved_plus_charged_minus_refunded": filter_net,
        "pods_reported_total": pods_total,
        "reservations_kept": delta("reservations_kept"),
        "store_contended": delta("store_contended"),
        "loadavg_before": load_before, "loadavg_after": load_after,
    });
    println!(
        "{factor:>4}x: offered {offered_x:.2}x, {} req ({n_ok} ok, {rejected} 429, {other} other, {} errors); \
         1 s ratio {}; 10 s ratio {}; filter net {filter_net} vs pods {pods_total}; load {load_after}",
        log.len(),
        errors.len(),
        out["window_1s_ratio"],
        out["window_10s_ratio"],
    );
    Ok(out)
}

fn accuracy(secs: u64) -> Result<Value, String> {
    let pool = PodPool::start(2, 0.01)?;
    let mut opts = EnvoyOptions::new(plugin_config(admission(RATE, BURST)));
    opts.inference = pool.pod_addrs.clone();
    opts.agents = pool.agent_addrs.clone();
    let envoy = Envoy::start(&opts)?;
    let mut levels = Vec::new();
    for factor in [1.0, 3.0, 10.0] {
        levels.push(accuracy_level(&envoy, factor, secs)?);
    }
    if envoy.wasm_failed() {
        return Err(format!("wasm trapped:\n{}", envoy.log_tail(40)));
    }
    Ok(json!({
        "rate_tokens_per_s": RATE, "burst": BURST, "warmup_s": WARMUP.as_secs(),
        "measured_s": secs, "pods": 2, "pod_time_scale": 0.01,
        "cost_counted_as": "pod-reported prompt+completion tokens of each 200, binned by client send time",
        "windows_aligned_to": "load start + warm-up, non-overlapping",
        "levels": levels,
    }))
}

/// A typical chat request of about 1 KB.
fn chat_body() -> String {
    let user = "Please review the following paragraph and suggest improvements. ".repeat(12);
    json!({
        "model": "llama-3-8b",
        "messages": [
            {"role": "system", "content": "You are a careful, concise assistant."},
            {"role": "user", "content": user}
        ],
        "max_tokens": 16,
        "temperature": 0.2
    })
    .to_string()
}

fn percentiles(mut v: Vec<f64>) -> (f64, f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    (at(0.5), at(0.9), at(0.99), mean)
}

fn latency(pairs: usize) -> Result<Value, String> {
    let stub = StubUpstream::start()?;
    let start = |extra: Value| -> Result<Envoy, String> {
        let mut o = EnvoyOptions::new(plugin_config(extra));
        o.inference = vec![stub.addr];
        Envoy::start(&o)
    };
    let plain = start(json!({}))?;
    // A bucket that never runs dry: every request is costed and admitted.
    let adm = start(admission(1_000_000_000, 1_000_000_000))?;
    let body = chat_body();
    let headers = [("x-tenant-id", "bench")];
    let mut ca = HttpClient::new(plain.listener);
    let mut cb = HttpClient::new(adm.listener);
    let one = |c: &mut HttpClient| -> Result<f64, String> {
        let t = Instant::now();
        let r = c.post_json("/v1/chat/completions", &headers, &body)?;
        let us = t.elapsed().as_secs_f64() * 1e6;
        if r.status != 200 {
            return Err(format!("status {}: {}", r.status, r.text()));
        }
        Ok(us)
    };
    let warm = 200;
    for _ in 0..warm {
        one(&mut ca)?;
        one(&mut cb)?;
    }
    let before = adm.stats()?;
    let load_before = loadavg();
    let (mut a, mut b, mut d) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..pairs {
        // Alternate which goes first, so order effects cancel.
        let (x, y) = if i % 2 == 0 {
            let x = one(&mut ca)?;
            (x, one(&mut cb)?)
        } else {
            let y = one(&mut cb)?;
            (one(&mut ca)?, y)
        };
        a.push(x);
        b.push(y);
        d.push(y - x);
    }
    let load_after = loadavg();
    let after = adm.stats()?;
    let costed = adm_stat(&after, "tenant.bench.standard.admitted")
        - adm_stat(&before, "tenant.bench.standard.admitted");
    let (a50, a90, a99, am) = percentiles(a);
    let (b50, b90, b99, bm) = percentiles(b);
    let (d50, _, _, dm) = percentiles(d);
    println!(
        "latency ({pairs} interleaved pairs, {} B body): without admission p50 {a50:.0} us p99 {a99:.0} us; \
         with p50 {b50:.0} us p99 {b99:.0} us; added p50 {:+.0} us ({:.3}x), p99 {:+.0} us ({:.3}x); \
         paired diff median {d50:+.0} us; {costed} costed; load {load_after}",
        body.len(),
        b50 - a50,
        b50 / a50,
        b99 - a99,
        b99 / a99
    );
    if plain.wasm_failed() || adm.wasm_failed() {
        return Err("wasm trapped in the latency run".into());
    }
    let r = |x: f64| (x * 10.0).round() / 10.0;
    Ok(json!({
        "pairs": pairs, "warmup_pairs": warm, "body_bytes": body.len(),
        "path": "/v1/chat/completions", "upstream": "StubUpstream (harness), one endpoint",
        "client": "one thread, keep-alive connection per Envoy, sequential, A/B order alternating",
        "without_admission_us": {"p50": r(a50), "p90": r(a90), "p99": r(a99), "mean": r(am)},
        "with_admission_us": {"p50": r(b50), "p90": r(b90), "p99": r(b99), "mean": r(bm)},
        "added_us": {"p50": r(b50 - a50), "p90": r(b90 - a90), "p99": r(b99 - a99), "mean": r(bm - am)},
        "ratio": {"p50": round4(b50 / a50), "p90": round4(b90 / a90), "p99": round4(b99 / a99)},
        "paired_difference_us": {"median": r(d50), "mean": r(dm)},
        "admission_admitted_in_run": costed,
        "loadavg_before": load_before, "loadavg_after": load_after,
    }))
}

fn main() {
    if let Err(e) = run() {
        eprintln!("admission_bench: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let args = parse_args()?;
    let started = loadavg();
    let mut out = json!({
        "bench": "admission",
        "envoy_concurrency": 2,
        "machine": "2 cores, shared with other work",
        "loadavg_at_start": started,
    });
    if args.latency {
        out["latency"] = latency(args.pairs)?;
    }
    if args.accuracy {
        out["accuracy"] = accuracy(args.secs)?;
    }
    out["loadavg_at_end"] = json!(loadavg());
    let text = serde_json::to_string_pretty(&out).map_err(|e| e.to_string())?;
    std::fs::write(&args.out, text + "\n").map_err(|e| format!("writing {}: {e}", args.out))?;
    println!("wrote {}", args.out);
    Ok(())
}
