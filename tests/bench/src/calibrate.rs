//! Decides the pool's capacity and the filter's overhead by measurement: each preset's
//! saturated output-token rate (one pod overloaded directly, tokens counted by the pod's own
//! `vllm:generation_tokens_total` over the steady part of the overload), converted to
//! requests/s of the benchmark workload; and one Envoy (1 worker) in front of a fast pod, with
//! and without the filter, for maximum req/s and added p99 at half load.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ai_lb_loadgen::stats::{Outcome, Record};
use serde_json::{json, Value};

use crate::analysis;
use crate::scenario::{read_records, workload_args, Env, Workload};
use crate::topology::{self, Error, PodShape, Policy, Pool};

/// Mean `max_tokens` of the sharegpt workload, from a large seeded dry-run trace.
pub fn mean_output_tokens(env: &Env) -> Result<f64, Error> {
    let path = env.work.join("mean-trace.jsonl");
    let mut args = vec![
        "--dry-run".to_string(),
        "--seed".into(),
        "12345".into(),
        "--rate".into(),
        "1000".into(),
        "--requests".into(),
        "20000".into(),
        "--trace-out".into(),
        path.display().to_string(),
    ];
    args.extend(workload_args(Workload::ShareGpt, env));
    let out = Command::new(&env.loadgen)
        .args(&args)
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(format!(
            "loadgen dry run failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let text = std::fs::read_to_string(&path).map_err(|e| e.to_string())?;
    let v: Vec<f64> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|j| j["max_tokens"].as_f64())
        .collect();
    if v.is_empty() {
        return Err("empty dry-run trace".into());
    }
    Ok(v.iter().sum::<f64>() / v.len() as f64)
}

/// Overloads the first pod of each preset at `rate` req/s for `secs`; returns capacity.
pub fn calibrate(
    env: &Env,
    pool: &Pool,
    shape: &PodShape,
    rate: f64,
    secs: f64,
) -> Result<Value, Error> {
    let dir = env.work.join("calibrate");
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let mut probes = Vec::new();
    for preset in ["h100-8b", "a100-8b"] {
        if let Some(i) = pool.pods.iter().position(|p| p.preset == preset) {
            probes.push((preset, i));
        }
    }
    let trace = dir.join("overload.jsonl");
    let mut args = vec![
        "--dry-run".to_string(),
        "--seed".into(),
        env.seed.to_string(),
        "--rate".into(),
        rate.to_string(),
        "--duration".into(),
        format!("{secs}s"),
        "--trace-out".into(),
        trace.display().to_string(),
    ];
    args.extend(workload_args(Workload::ShareGpt, env));
    let st = Command::new(&env.loadgen)
        .args(&args)
        .stdout(Stdio::null())
        .status()
        .map_err(|e| e.to_string())?;
    if !st.success() {
        return Err(format!("loadgen dry run failed: {st}"));
    }
    let mut children = Vec::new();
    for (_, i) in &probes {
        let c = Command::new(&env.loadgen)
            .arg("--url")
            .arg(format!("http://{}", pool.pods[*i].addr))
            .arg("--trace-in")
            .arg(&trace)
            .arg("--timeout")
            .arg(format!("{}s", secs))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| e.to_string())?;
        children.push(c);
    }
    let start = Instant::now();
    let warm = Duration::from_secs_f64(secs * 0.3);
    std::thread::sleep(warm);
    let t0 = start.elapsed();
    let before: Vec<f64> = probes
        .iter()
        .map(|(_, i)| pool.generated_tokens(*i))
        .collect::<Result<_, _>>()?;
    std::thread::sleep(Duration::from_secs_f64(secs).saturating_sub(start.elapsed()));
    let t1 = start.elapsed();
    let after: Vec<f64> = probes
        .iter()
        .map(|(_, i)| pool.generated_tokens(*i))
        .collect::<Result<_, _>>()?;
    for mut c in children {
        let _ = c.kill();
        let _ = c.wait();
    }
    pool.wait_idle(Duration::from_secs(60))?;
    let dt = (t1 - t0).as_secs_f64();
    let mean_out = mean_output_tokens(env)?;
    let mut per_preset = serde_json::Map::new();
    let mut pool_tokens = 0.0;
    for (k, (preset, _)) in probes.iter().enumerate() {
        let tps = (after[k] - before[k]) / dt;
        let n = if *preset == "h100-8b" {
            shape.h100
        } else {
            shape.a100
        };
        pool_tokens += tps * n as f64;
        per_preset.insert(
            preset.to_string(),
            json!({"tokens_per_s": tps, "rps": tps / mean_out, "pods": n}),
        );
    }
    Ok(json!({
        "overload_rate_rps_per_pod": rate,
        "overload_secs": secs,
        "measured_window_s": dt,
        "mean_output_tokens": mean_out,
        "per_preset": per_preset,
        "pool_tokens_per_s": pool_tokens,
        "capacity_rps": pool_tokens / mean_out,
    }))
}

fn fixed_trace(env: &Env, rate: f64, secs: f64, path: &Path) -> Result<(), Error> {
    let st = Command::new(&env.loadgen)
        .args([
            "--dry-run",
            "--seed",
            &env.seed.to_string(),
            "--rate",
            &rate.to_string(),
            "--duration",
            &format!("{secs}s"),
            "--workload",
            "fixed",
            "--prompt-tokens",
            "16",
            "--output-tokens",
            "2",
            "--trace-out",
            &path.display().to_string(),
        ])
        .stdout(Stdio::null())
        .status()
        .map_err(|e| e.to_string())?;
    if st.success() {
        Ok(())
    } else {
        Err(format!("loadgen dry run failed: {st}"))
    }
}

fn replay(
    env: &Env,
    url: &str,
    trace: &Path,
    rec: &PathBuf,
) -> Result<(analysis::Summary, Vec<Record>), Error> {
    let st = Command::new(&env.loadgen)
        .args(["--url", url, "--timeout", "10s", "--trace-in"])
        .arg(trace)
        .arg("--records")
        .arg(rec)
        .stdout(Stdio::null())
        .status()
        .map_err(|e| e.to_string())?;
    if !st.success() {
        return Err(format!("loadgen failed: {st}"));
    }
    let rs = read_records(std::slice::from_ref(rec))?;
    let refs: Vec<_> = rs.iter().collect();
    let s = analysis::summarize(&refs, 10_000.0);
    Ok((s, rs))
}

/// Completed requests per second: ok requests / (first send → last completion).
fn ok_rps(records: &[Record]) -> f64 {
    let ok: Vec<&Record> = records
        .iter()
        .filter(|r| r.outcome == Outcome::Ok)
        .collect();
    let first = ok
        .iter()
        .map(|r| r.sent_us as f64 / 1000.0)
        .fold(f64::INFINITY, f64::min);
    let last = ok
        .iter()
        .map(|r| r.sent_us as f64 / 1000.0 + r.e2e_ms.unwrap_or(0.0))
        .fold(0.0, f64::max);
    if last > first {
        ok.len() as f64 / ((last - first) / 1000.0)
    } else {
        0.0
    }
}

/// One Envoy with 1 worker in front of one fast upstream (the loadgen `sink` example answering
/// 2 tokens at once), with the filter (ai-lb; an agent announces the sink as its pod, reading
/// metrics from an idle fake pod, so the filter has pool data and really picks) and without
/// (plain least_request).
pub fn overhead(env: &Env, high_rate: f64, secs: f64) -> Result<Value, Error> {
    let dir = env.work.join("overhead");
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let shape = PodShape {
        h100: 1,
        a100: 0,
        time_scale: 1.0,
        max_num_seqs: 256,
        kv_cache_tokens: 400_000,
    };
    let metrics_pod = Pool::start(&shape, false)?;
    let (_sink, sink) = topology::spawn_sink(2)?;
    let grpc = SocketAddr::from(([127, 0, 0, 1], ai_lb_e2e::envoy::free_port()?));
    let _agent = topology::spawn_agent("sink", grpc, metrics_pod.pods[0].addr, sink, &[], 256)?;
    let upstreams = [sink];
    let agents = [grpc];
    let high = dir.join("high.jsonl");
    fixed_trace(env, high_rate, secs, &high)?;
    let mut max_rps = serde_json::Map::new();
    let mut cap = f64::INFINITY;
    for policy in [Policy::LeastRequest, Policy::AiLb] {
        let envoy = topology::start_sidecar(policy, &upstreams, &agents, 1)?;
        if policy == Policy::AiLb {
            topology::wait_ailb_ready(&envoy, &upstreams, Duration::from_secs(15));
        }
        let url = format!("http://{}", envoy.listener);
        let (s, rs) = replay(
            env,
            &url,
            &high,
            &dir.join(format!("{}.high.jsonl", policy.name())),
        )?;
        let rps = ok_rps(&rs);
        if policy == Policy::LeastRequest {
            cap = rps;
        }
        max_rps.insert(
            policy.name().into(),
            json!({"ok": s.ok, "ok_rps": rps, "e2e_ms": s.e2e_ms, "timeouts": s.timeouts, "errors": s.errors, "dispatch_lag_ms": s.dispatch_lag_ms}),
        );
        drop(envoy);
    }
    let half = (cap / 2.0).max(1.0);
    let half_trace = dir.join("half.jsonl");
    fixed_trace(env, half, secs * 2.0, &half_trace)?;
    let mut at_half = serde_json::Map::new();
    let (direct, _) = replay(
        env,
        &format!("http://{sink}"),
        &half_trace,
        &dir.join("direct.half.jsonl"),
    )?;
    at_half.insert(
        "direct_to_pod".into(),
        json!({"e2e_ms": direct.e2e_ms, "ttft_ms": direct.ttft_ms}),
    );
    for policy in [Policy::LeastRequest, Policy::AiLb] {
        let envoy = topology::start_sidecar(policy, &upstreams, &agents, 1)?;
        if policy == Policy::AiLb {
            topology::wait_ailb_ready(&envoy, &upstreams, Duration::from_secs(15));
        }
        let (s, _) = replay(
            env,
            &format!("http://{}", envoy.listener),
            &half_trace,
            &dir.join(format!("{}.half.jsonl", policy.name())),
        )?;
        at_half.insert(
            policy.name().into(),
            json!({"e2e_ms": s.e2e_ms, "ttft_ms": s.ttft_ms, "ok": s.ok, "errors": s.errors, "timeouts": s.timeouts}),
        );
        drop(envoy);
    }
    let p99 = |k: &str| at_half.get(k).and_then(|v| v["e2e_ms"]["p99"].as_f64());
    let rps = |k: &str| max_rps.get(k).and_then(|v| v["ok_rps"].as_f64());
    Ok(json!({
        "upstream": "loadgen example sink answering 2 tokens at once; 16-token prompts; ai-lb agent announcing the sink, metrics from an idle fake pod",
        "offered_rps_for_max": high_rate,
        "secs": secs,
        "max": max_rps,
        "rps_ratio_filter_over_plain": analysis::ratio(rps("ai_lb"), rps("least_request")),
        "half_load_rps": half,
        "at_half_load": at_half,
        "added_p99_ms": match (p99("ai_lb"), p99("least_request")) {
            (Some(a), Some(b)) => json!(a - b),
            _ => json!(null),
        },
    }))
}
