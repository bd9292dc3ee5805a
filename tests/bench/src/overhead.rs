//! Decides what the filter costs per request: one Envoy (1 worker) in front of one fast
//! upstream (the loadgen `sink` example answering 2 tokens at once), with the filter (ai-lb's
//! shipped `envoy-config/filter-config.json`; an agent announces the sink as its pod, reading
//! metrics from an idle fake pod, so the filter has pool data and really picks) and without
//! (the same Envoy with plain least_request).
//!
//! Both Envoys run side by side for the whole measurement and the two are measured in
//! alternating rounds (the order flips every round), so slow drift of a shared machine hits
//! both alike; every figure is the median over rounds:
//! - maximum throughput: a closed loop of `workers` keep-alive clients for `secs` against each;
//! - added latency: an open loop at half of plain Envoy's measured maximum, `secs` each, with
//!   the same trace; also straight to the sink, for the floor of the loop itself.

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};

use crate::analysis::{self, Summary};
use crate::calibrate::{fixed_trace, ok_rps, replay};
use crate::scenario::Env;
use crate::topology::{self, Error, PodShape, Policy, Pool};

/// Median of `v` (None when empty).
fn median(mut v: Vec<f64>) -> Option<f64> {
    v.retain(|x| x.is_finite());
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => v.get(n / 2).copied(),
        _ => Some((v.get(n / 2 - 1)? + v.get(n / 2)?) / 2.0),
    }
}

fn lat(s: &Summary) -> Value {
    json!({"e2e_ms": s.e2e_ms, "ttft_ms": s.ttft_ms, "ok": s.ok, "errors": s.errors, "timeouts": s.timeouts})
}

/// Runs the overhead scenario; returns its summary (written by the caller).
pub fn overhead(env: &Env, secs: f64, rounds: usize, workers: usize) -> Result<Value, Error> {
    let dir = env.work.join("overhead");
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let shape = PodShape {
        h100: 1,
        a100: 0,
        time_scale: 1.0,
        max_num_seqs: 256,
        kv_cache_tokens: 400_000,
        sample_interval_ms: 100,
        gpu_sample_interval_ms: None,
    };
    let metrics_pod = Pool::start(&shape, false)?;
    let (_sink, sink) = topology::spawn_sink(2)?;
    let grpc = std::net::SocketAddr::from(([127, 0, 0, 1], ai_lb_e2e::envoy::free_port()?));
    let _agent = topology::spawn_agent(
        "sink",
        grpc,
        metrics_pod.pods[0].addr,
        sink,
        &[],
        256,
        100,
        None,
    )?;
    let upstreams = [sink];
    let agents = [grpc];
    let plain = topology::start_sidecar(Policy::LeastRequest, &upstreams, &agents, 1)?;
    let ailb = topology::start_sidecar(Policy::AiLb, &upstreams, &agents, 1)?;
    let ready = topology::wait_ailb_ready(&ailb, &upstreams, Duration::from_secs(15));
    let url = |p: Policy| match p {
        Policy::AiLb => format!("http://{}", ailb.listener),
        _ => format!("http://{}", plain.listener),
    };
    let order = |round: usize| {
        if round % 2 == 0 {
            [Policy::LeastRequest, Policy::AiLb]
        } else {
            [Policy::AiLb, Policy::LeastRequest]
        }
    };
    // Enough entries that no closed loop runs out (the loop stops at the trace's span).
    let closed_trace = dir.join("closed.jsonl");
    fixed_trace(env, 20_000.0, secs, &closed_trace)?;
    let workers_arg = workers.to_string();
    let closed_args = ["--closed-loop", workers_arg.as_str(), "--threads", "2"];
    let mut max_rounds: Vec<Value> = Vec::new();
    let (mut plain_rps, mut ailb_rps, mut rps_ratios) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..rounds {
        let mut row = serde_json::Map::new();
        for p in order(round) {
            let (s, rs) = replay(
                env,
                &url(p),
                &closed_trace,
                &dir.join(format!("{}.closed.{round}.jsonl", p.name())),
                &closed_args,
            )?;
            let rps = ok_rps(&rs);
            row.insert(
                p.name().into(),
                json!({"ok_rps": rps, "errors": s.errors, "timeouts": s.timeouts, "e2e_ms": s.e2e_ms}),
            );
            match p {
                Policy::AiLb => ailb_rps.push(rps),
                _ => plain_rps.push(rps),
            }
        }
        if let (Some(a), Some(b)) = (ailb_rps.last(), plain_rps.last()) {
            rps_ratios.push(a / b);
        }
        max_rounds.push(Value::Object(row));
    }
    let plain_max = median(plain_rps.clone()).ok_or("no throughput measured")?;
    let half = (plain_max / 2.0).max(1.0);
    let half_trace = dir.join("half.jsonl");
    fixed_trace(env, half, secs, &half_trace)?;
    let mut half_rounds: Vec<Value> = Vec::new();
    let (mut p99_plain, mut p99_ailb, mut p99_direct, mut added) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut p50_plain, mut p50_ailb) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        let mut row = serde_json::Map::new();
        let (direct, _) = replay(
            env,
            &format!("http://{sink}"),
            &half_trace,
            &dir.join(format!("direct.half.{round}.jsonl")),
            &[],
        )?;
        p99_direct.push(direct.e2e_ms.p99.unwrap_or(f64::NAN));
        row.insert("direct_to_sink".into(), lat(&direct));
        for p in order(round) {
            let (s, _) = replay(
                env,
                &url(p),
                &half_trace,
                &dir.join(format!("{}.half.{round}.jsonl", p.name())),
                &[],
            )?;
            let (p50, p99) = (
                s.e2e_ms.p50.unwrap_or(f64::NAN),
                s.e2e_ms.p99.unwrap_or(f64::NAN),
            );
            match p {
                Policy::AiLb => {
                    p99_ailb.push(p99);
                    p50_ailb.push(p50);
                }
                _ => {
                    p99_plain.push(p99);
                    p50_plain.push(p50);
                }
            }
            row.insert(p.name().into(), lat(&s));
        }
        if let (Some(a), Some(b)) = (p99_ailb.last(), p99_plain.last()) {
            added.push(a - b);
        }
        half_rounds.push(Value::Object(row));
    }
    let us = |v: Option<f64>| v.map(|ms| (ms * 1000.0).round());
    Ok(json!({
        "upstream": "loadgen example sink answering 2 tokens at once (SSE); 16-token prompts; one Envoy, 1 worker, per configuration; ai-lb with envoy-config/filter-config.json and an agent announcing the sink (metrics from an idle fake pod)",
        "ailb_ready": ready,
        "secs_per_measurement": secs,
        "rounds": rounds,
        "closed_loop_workers": workers,
        "max_rps": {
            "least_request_median": plain_max,
            "ai_lb_median": median(ailb_rps.clone()),
            "ratio_of_medians": analysis::ratio(median(ailb_rps), Some(plain_max)),
            "ratio_per_round": rps_ratios,
            "rounds": max_rounds,
        },
        "half_load": {
            "rate_rps": half,
            "p99_ms_median": {"least_request": median(p99_plain.clone()), "ai_lb": median(p99_ailb.clone()), "direct_to_sink": median(p99_direct)},
            "p50_ms_median": {"least_request": median(p50_plain.clone()), "ai_lb": median(p50_ailb.clone())},
            "added_p99_us_median_of_rounds": us(median(added.clone())),
            "added_p99_us_per_round": added.iter().map(|d| us(Some(*d))).collect::<Vec<_>>(),
            "added_p50_us": us(median(p50_ailb).zip(median(p50_plain)).map(|(a, b)| a - b)),
            "rounds": half_rounds,
        },
    }))
}

/// Writes `summary.json` and a short `table.md` for the overhead scenario under `out`.
pub fn write(out: &Path, v: &Value) -> Result<(), Error> {
    let dir = out.join("overhead");
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let text = serde_json::to_string_pretty(v).map_err(|e| e.to_string())?;
    std::fs::write(dir.join("summary.json"), text).map_err(|e| e.to_string())?;
    let f = |x: &Value| x.as_f64().map_or("–".to_string(), |v| format!("{v:.2}"));
    let h = &v["half_load"];
    let table = format!(
        "### overhead (1 Envoy worker, fast upstream, {} rounds of {} s, medians)\n\n`{}`\n\n\
         | measure | least_request | ai_lb | ratio / difference |\n|---|---|---|---|\n\
         | max req/s (closed loop, {} clients) | {} | {} | {} |\n\
         | e2e p50 at {} req/s, ms | {} | {} | {} µs |\n\
         | e2e p99 at {} req/s, ms | {} | {} | {} µs (per round: {}) |\n\n\
         Straight to the sink (no Envoy), p99: {} ms.\n",
        v["rounds"],
        v["secs_per_measurement"],
        v["command"].as_str().unwrap_or(""),
        v["closed_loop_workers"],
        f(&v["max_rps"]["least_request_median"]),
        f(&v["max_rps"]["ai_lb_median"]),
        f(&v["max_rps"]["ratio_of_medians"]),
        f(&h["rate_rps"]),
        f(&h["p50_ms_median"]["least_request"]),
        f(&h["p50_ms_median"]["ai_lb"]),
        h["added_p50_us"],
        f(&h["rate_rps"]),
        f(&h["p99_ms_median"]["least_request"]),
        f(&h["p99_ms_median"]["ai_lb"]),
        h["added_p99_us_median_of_rounds"],
        h["added_p99_us_per_round"],
        f(&h["p99_ms_median"]["direct_to_sink"]),
    );
    std::fs::write(dir.join("table.md"), table).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::median;

    #[test]
    fn median_of_odd_even_and_empty() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(vec![f64::NAN]), None);
        assert_eq!(median(vec![]), None);
    }
}
