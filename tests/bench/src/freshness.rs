//! Decides how fresh the filter's view of the pool is, and what freshness buys: for each agent
//! sample (push) interval of the sweep, a fresh pool with its agents at that interval, then
//! - reaction: with no traffic, pod 0 is forced to 99 % GPU (over the 0.95 hard limit) and every
//!   ai-lb sidecar's status page is polled until it shows the pod cut; the time from the fault
//!   call to that view, per sidecar and toggle, is the "change → routing change" latency (every
//!   decision after it avoids the pod). The fault is then cleared and the next toggle waits
//!   until every sidecar sees the pod back;
//! - routing quality: ai-lb on the sharegpt-poisson-80 trace, against least_request on the same
//!   trace in the same run (measured once: least_request does not read the agents).

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use ai_lb_e2e::envoy::{self, Envoy};

use crate::analysis::{self, Pcts};
use crate::scenario::{self, Env};
use crate::topology::{self, Error, PodShape, Policy, Pool};

/// The sweep of agent sample intervals, ms (the issue asks for 10 ms to 5 s).
pub const SWEEP_MS: [u64; 6] = [10, 50, 100, 500, 1000, 5000];

/// Whether `sidecar`'s scoreboard shows the pod at `addr` cut (None: no answer or not listed).
fn shows_cut(sidecar: &Envoy, addr: &str) -> Option<bool> {
    let r = envoy::http_get(sidecar.listener, "/ai-lb/status").ok()?;
    let v: Value = serde_json::from_slice(&r.body).ok()?;
    let pods = v["pools"][0]["pods"].as_array()?;
    let pod = pods.iter().find(|p| p["address"].as_str() == Some(addr))?;
    Some(!pod["cut"].is_null())
}

/// Polls every sidecar until each shows `want` for `addr`; returns each one's wait since
/// `t0`, ms (None for a sidecar that did not within `deadline`).
fn wait_view(
    sidecars: &[Envoy],
    addr: &str,
    want: bool,
    t0: Instant,
    deadline: Duration,
) -> Vec<Option<f64>> {
    let mut seen: Vec<Option<f64>> = vec![None; sidecars.len()];
    while seen.iter().any(Option::is_none) && t0.elapsed() < deadline {
        for (s, slot) in sidecars.iter().zip(seen.iter_mut()) {
            if slot.is_none() && shows_cut(s, addr) == Some(want) {
                *slot = Some(t0.elapsed().as_secs_f64() * 1000.0);
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    seen
}

/// Change → routing-change latencies over `toggles` faults of pod 0.
fn reaction(pool: &Pool, env: &Env, interval_ms: u64, toggles: usize) -> Result<Value, Error> {
    let mut sidecars = Vec::new();
    for _ in 0..env.sidecars {
        sidecars.push(topology::start_sidecar(
            Policy::AiLb,
            &pool.addrs(),
            &pool.agent_addrs(),
            1,
        )?);
    }
    let ready = sidecars
        .iter()
        .all(|s| topology::wait_ailb_ready(s, &pool.addrs(), Duration::from_secs(15)));
    let addr = pool.pods[0].addr.to_string();
    // Generous: a few sample intervals plus the heartbeat and the filter's refresh.
    let deadline = Duration::from_millis(interval_ms * 4 + 5_000);
    let (mut cut_ms, mut back_ms, mut missed) = (Vec::new(), Vec::new(), 0usize);
    for _ in 0..toggles {
        let t0 = Instant::now();
        pool.control(0, r#"{"gpu_utilization":0.99}"#)?;
        for w in wait_view(&sidecars, &addr, true, t0, deadline) {
            match w {
                Some(ms) => cut_ms.push(ms),
                None => missed += 1,
            }
        }
        let t1 = Instant::now();
        pool.control(0, r#"{"reset":true}"#)?;
        for w in wait_view(&sidecars, &addr, false, t1, deadline) {
            match w {
                Some(ms) => back_ms.push(ms),
                None => missed += 1,
            }
        }
    }
    Ok(json!({
        "ailb_ready": ready,
        "toggles": toggles,
        "sidecars": env.sidecars,
        "cut_ms": Pcts::of(cut_ms),
        "readmitted_ms": Pcts::of(back_ms),
        "not_seen_within_deadline": missed,
        "deadline_ms": deadline.as_millis() as u64,
    }))
}

/// Runs the sweep over `intervals`; returns the summary (written by the caller).
pub fn freshness(
    env: &Env,
    shape: &PodShape,
    intervals: &[u64],
    toggles: usize,
    cmd: &str,
) -> Result<Value, Error> {
    let load = scenario::parse_load("sharegpt-poisson-80")?;
    let dir = env.work.join("freshness");
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let trace = dir.join("trace.jsonl");
    let rate = scenario::make_trace(&load, env, &trace)?;
    let mut baseline: Option<analysis::Summary> = None;
    let mut points = Vec::new();
    for &ms in intervals {
        eprintln!("[bench] freshness: agents sampling every {ms} ms");
        let mut shape = shape.clone();
        shape.sample_interval_ms = ms;
        let mut pool = Pool::start(&shape, true)?;
        let pdir = dir.join(format!("{ms}ms"));
        std::fs::create_dir_all(&pdir).map_err(|e| e.to_string())?;
        if baseline.is_none() {
            let (_, r) =
                scenario::run_policy(Policy::LeastRequest, &load, env, &mut pool, &trace, &pdir)?;
            baseline = Some(r.all);
        }
        let react = reaction(&pool, env, ms, toggles)?;
        let (_, r) = scenario::run_policy(Policy::AiLb, &load, env, &mut pool, &trace, &pdir)?;
        let ratios = baseline.as_ref().map(|b| analysis::ratios(&r.all, b));
        points.push(json!({
            "sample_interval_ms": ms,
            "reaction": react,
            "ai_lb": r.all,
            "ailb_ready": r.ailb_ready,
            "over_least_request": ratios,
        }));
    }
    Ok(json!({
        "scenario": "freshness",
        "command": cmd,
        "trace": load.name,
        "rate_rps": rate,
        "capacity_rps": env.capacity_rps,
        "duration_s": env.duration_s,
        "client_timeout_s": env.timeout_s,
        "sidecars": env.sidecars,
        "seed": env.seed,
        "least_request": baseline,
        "points": points,
    }))
}

fn f0(v: &Value) -> String {
    v.as_f64().map_or("–".into(), |x| format!("{x:.0}"))
}

fn f2(v: &Value) -> String {
    v.as_f64().map_or("–".into(), |x| format!("{x:.2}"))
}

/// The markdown table of the sweep.
pub fn table(v: &Value) -> String {
    let mut t = format!(
        "### freshness (agent sample interval sweep; {} ai-lb sidecars; trace {} at {:.1} req/s, {} s, seed {})\n\n`{}`\n\n\
         least_request on the same trace: TTFT p99 {} ms, e2e p99 {} ms.\n\n\
         | sample interval | change → routing change p50 / p99 / max, ms (n) | readmitted p99, ms | ai_lb TTFT p50 / p99, ms | ai_lb e2e p99, ms | p99 TTFT / least_request | p99 e2e / least_request |\n\
         |---|---|---|---|---|---|---|\n",
        v["sidecars"],
        v["trace"].as_str().unwrap_or(""),
        v["rate_rps"].as_f64().unwrap_or(0.0),
        v["duration_s"],
        v["seed"],
        v["command"].as_str().unwrap_or(""),
        f0(&v["least_request"]["ttft_ms"]["p99"]),
        f0(&v["least_request"]["e2e_ms"]["p99"]),
    );
    for p in v["points"].as_array().into_iter().flatten() {
        let r = &p["reaction"];
        t.push_str(&format!(
            "| {} ms | {} / {} / {} ({}{}) | {} | {} / {} | {} | {} | {} |\n",
            p["sample_interval_ms"],
            f0(&r["cut_ms"]["p50"]),
            f0(&r["cut_ms"]["p99"]),
            f0(&r["cut_ms"]["max"]),
            r["cut_ms"]["count"],
            match r["not_seen_within_deadline"].as_u64() {
                Some(0) | None => String::new(),
                Some(n) => format!(", {n} not seen"),
            },
            f0(&r["readmitted_ms"]["p99"]),
            f0(&p["ai_lb"]["ttft_ms"]["p50"]),
            f0(&p["ai_lb"]["ttft_ms"]["p99"]),
            f0(&p["ai_lb"]["e2e_ms"]["p99"]),
            f2(&p["over_least_request"]["ttft_p99"]),
            f2(&p["over_least_request"]["e2e_p99"]),
        ));
    }
    t
}
