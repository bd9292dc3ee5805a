//! Decides the pool's capacity and the filter's overhead by measurement: each preset's
//! saturated output-token rate (one pod overloaded directly, tokens counted by the pod's own
//! `vllm:generation_tokens_total` over the steady part of the overload), converted to
//! requests/s of the benchmark workload.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ai_lb_loadgen::stats::{Outcome, Record};
use serde_json::{json, Value};

use crate::analysis;
use crate::scenario::{read_records, workload_args, Env, Workload};
use crate::topology::{Error, PodShape, Pool};

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
        let c = ai_lb_e2e::process::die_with_parent(&mut Command::new(&env.loadgen))
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

pub(crate) fn fixed_trace(env: &Env, rate: f64, secs: f64, path: &Path) -> Result<(), Error> {
    let st = ai_lb_e2e::process::die_with_parent(&mut Command::new(&env.loadgen))
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

/// Replays `trace` against `url` with the loadgen (open loop unless `extra` says otherwise),
/// records to `rec`.
pub(crate) fn replay(
    env: &Env,
    url: &str,
    trace: &Path,
    rec: &PathBuf,
    extra: &[&str],
) -> Result<(analysis::Summary, Vec<Record>), Error> {
    let st = ai_lb_e2e::process::die_with_parent(&mut Command::new(&env.loadgen))
        .args(["--url", url, "--timeout", "10s", "--trace-in"])
        .arg(trace)
        .args(extra)
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
pub(crate) fn ok_rps(records: &[Record]) -> f64 {
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
