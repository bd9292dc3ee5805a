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

/// The capacity of a pool shaped `shape` from a saved calibration: each preset's measured
/// requests/s times its pods, so a calibration serves every mix of the presets it measured
/// (pods of one preset are identical); None when it lacks one of the pool's presets or was
/// measured with other pod settings.
pub fn pool_capacity(saved: &Value, shape: &PodShape) -> Option<f64> {
    if saved["pod_settings"] != json!(pod_settings(shape)) {
        return None;
    }
    shape
        .kinds
        .iter()
        .map(|(preset, n)| Some(saved["per_preset"][preset]["rps"].as_f64()? * *n as f64))
        .sum()
}

/// What besides the preset sets a pod's capacity.
fn pod_settings(shape: &PodShape) -> String {
    format!(
        "max_num_seqs {}, kv_cache_tokens {}, time_scale {}",
        shape.max_num_seqs, shape.kv_cache_tokens, shape.time_scale
    )
}

/// The first pod of each preset in the pool, in pool order: the pods a calibration overloads.
pub fn probes(pool: &Pool) -> Vec<(&'static str, usize)> {
    let mut probes: Vec<(&'static str, usize)> = Vec::new();
    for (i, pod) in pool.pods.iter().enumerate() {
        if !probes.iter().any(|(p, _)| *p == pod.preset) {
            probes.push((pod.preset, i));
        }
    }
    probes
}

/// While `children` overload the `probes`, each probed pod's output-token rate over the last
/// 70 % of `secs` (its own `vllm:generation_tokens_total`); then stops the children, waits for
/// the pool to drain, and returns per preset `{tokens_per_s, rps, pods}` (rps = tokens/s over
/// `mean_out`, pods = that preset's pods in the pool) with the pool's total tokens/s.
pub fn measure_overload(
    pool: &Pool,
    probes: &[(&'static str, usize)],
    children: Vec<std::process::Child>,
    secs: f64,
    mean_out: f64,
) -> Result<(serde_json::Map<String, Value>, f64, f64), Error> {
    let start = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(secs * 0.3));
    let t0 = start.elapsed();
    let read = || -> Result<Vec<f64>, Error> {
        probes
            .iter()
            .map(|(_, i)| pool.generated_tokens(*i))
            .collect()
    };
    let before = read();
    std::thread::sleep(Duration::from_secs_f64(secs).saturating_sub(start.elapsed()));
    let t1 = start.elapsed();
    let after = read();
    for mut c in children {
        let _ = c.kill();
        let _ = c.wait();
    }
    let (before, after) = (before?, after?);
    pool.wait_idle(Duration::from_secs(60))?;
    let dt = (t1 - t0).as_secs_f64();
    let mut per_preset = serde_json::Map::new();
    let mut pool_tokens = 0.0;
    for (k, (preset, _)) in probes.iter().enumerate() {
        let tps =
            (after.get(k).copied().unwrap_or(0.0) - before.get(k).copied().unwrap_or(0.0)) / dt;
        let n = pool.pods.iter().filter(|p| p.preset == *preset).count();
        pool_tokens += tps * n as f64;
        per_preset.insert(
            preset.to_string(),
            json!({"tokens_per_s": tps, "rps": tps / mean_out, "pods": n}),
        );
    }
    Ok((per_preset, pool_tokens, dt))
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
    let probes = probes(pool);
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
    let mean_out = mean_output_tokens(env)?;
    let (per_preset, pool_tokens, dt) = measure_overload(pool, &probes, children, secs, mean_out)?;
    Ok(json!({
        "pod_settings": pod_settings(shape),
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
    fixed_trace_sized(env, rate, secs, 16, 2, path)
}

/// [`fixed_trace`] with `prompt_tokens` (the loadgen writes 4 characters a token into the one
/// user message) and `max_tokens` = `output_tokens`.
pub(crate) fn fixed_trace_sized(
    env: &Env,
    rate: f64,
    secs: f64,
    prompt_tokens: u32,
    output_tokens: u32,
    path: &Path,
) -> Result<(), Error> {
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
            &prompt_tokens.to_string(),
            "--output-tokens",
            &output_tokens.to_string(),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topology::parse_pool;

    fn shape(pool: &str) -> PodShape {
        PodShape {
            kinds: parse_pool(pool).unwrap(),
            kv_events: true,
            time_scale: 1.0,
            max_num_seqs: 8,
            kv_cache_tokens: 12_500,
            sample_interval_ms: 50,
            gpu_sample_interval_ms: None,
        }
    }

    #[test]
    fn a_saved_calibration_serves_every_mix_of_its_presets() {
        let saved = json!({
            "pod_settings": "max_num_seqs 8, kv_cache_tokens 12500, time_scale 1",
            "per_preset": {"h100-8b": {"rps": 8.0}, "a100-8b": {"rps": 5.0}},
        });
        assert_eq!(pool_capacity(&saved, &shape("h100:4,a100:4")), Some(52.0));
        assert_eq!(pool_capacity(&saved, &shape("h100:2,a100:6")), Some(46.0));
        // A preset it did not measure, or other pod settings: calibrate again.
        assert_eq!(pool_capacity(&saved, &shape("h100:2,l40s:2")), None);
        let mut other = shape("h100:4");
        other.max_num_seqs = 16;
        assert_eq!(pool_capacity(&saved, &other), None);
    }
}
