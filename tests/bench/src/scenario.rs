//! Decides how each benchmark scenario runs: its parameters (fixed here, before any result was
//! seen), the seeded trace every policy replays, the split of that trace across the client
//! sidecars (request i goes to sidecar i mod N), the fault injected mid-run, and what is written
//! (summary JSON with ratios, a markdown table, per-request records for the plots).

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ai_lb_loadgen::stats::Record;
use serde::Serialize;
use serde_json::{json, Value};

use crate::analysis::{self, Summary};
use crate::topology::{self, Error, Policy, Pool};

/// Which arrival process.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arrival {
    Poisson,
    /// Gamma gaps, coefficient of variation 3.
    Bursty,
}

/// Which workload.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Workload {
    ShareGpt,
    /// ShareGPT-like short traffic plus a burst of long prompts.
    Hol,
}

/// A fault injected into pod 0 (an h100) at the middle of the run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Fault {
    /// Pod 0 runs 5x slower; its GPU reports the HW-slowdown throttle reason, as a thermally
    /// or power-throttled GPU does.
    Slowdown5x,
    /// The same slowdown, not shown by the GPU (e.g. a noisy neighbour): only latency and
    /// load signals reveal it.
    Slowdown5xSilent,
    Errors50,
    Sigstop,
}

/// A load scenario.
#[derive(Debug, Clone, PartialEq)]
pub struct Load {
    pub name: String,
    pub workload: Workload,
    pub arrival: Arrival,
    /// Fraction of measured pool capacity.
    pub load: f64,
    pub fault: Option<Fault>,
}

/// Parses `sharegpt-poisson-80`, `sharegpt-bursty-95`, `hol-poisson-80`, `fault-slowdown`,
/// `fault-slowdown-silent`, `fault-errors`, `fault-sigstop`.
pub fn parse_load(name: &str) -> Result<Load, Error> {
    let bad = || {
        format!(
            "unknown scenario {name:?}: expected calibrate, overhead, freshness, \
             <sharegpt|hol>-<poisson|bursty>-<percent of capacity>, or fault-<slowdown|slowdown-silent|errors|sigstop>"
        )
    };
    let parts: Vec<&str> = name.split('-').collect();
    let fault_kind = match parts.as_slice() {
        ["fault", kind] => Some(*kind),
        ["fault", "slowdown", "silent"] => Some("slowdown-silent"),
        _ => None,
    };
    if let Some(kind) = fault_kind {
        let fault = match kind {
            "slowdown" => Fault::Slowdown5x,
            "slowdown-silent" => Fault::Slowdown5xSilent,
            "errors" => Fault::Errors50,
            "sigstop" => Fault::Sigstop,
            _ => return Err(bad()),
        };
        return Ok(Load {
            name: name.into(),
            workload: Workload::ShareGpt,
            arrival: Arrival::Poisson,
            load: 0.8,
            fault: Some(fault),
        });
    }
    let [w, a, pct] = parts.as_slice() else {
        return Err(bad());
    };
    let workload = match *w {
        "sharegpt" => Workload::ShareGpt,
        "hol" => Workload::Hol,
        _ => return Err(bad()),
    };
    let arrival = match *a {
        "poisson" => Arrival::Poisson,
        "bursty" => Arrival::Bursty,
        _ => return Err(bad()),
    };
    let load = match pct.parse::<u32>() {
        Ok(p) if (1..=200).contains(&p) => f64::from(p) / 100.0,
        _ => {
            return Err(format!(
                "scenario {name:?}: load {pct:?} must be a percent in 1..=200"
            ))
        }
    };
    Ok(Load {
        name: name.into(),
        workload,
        arrival,
        load,
        fault: None,
    })
}

/// Everything a run needs that does not depend on the scenario.
#[derive(Debug, Clone)]
pub struct Env {
    pub loadgen: PathBuf,
    /// Scratch for traces and records (not committed).
    pub work: PathBuf,
    /// Committed results.
    pub out: PathBuf,
    pub sidecars: usize,
    pub duration_s: f64,
    pub timeout_s: f64,
    pub seed: u64,
    /// Pool capacity, requests/s of the sharegpt workload.
    pub capacity_rps: f64,
    /// The HOL burst: long requests and when.
    pub hol_count: u32,
    pub hol_at_s: f64,
    /// Policies to run, in order (default: all three).
    pub policies: Vec<Policy>,
}

/// The loadgen flags that define a workload (stated in BENCHMARKS.md).
pub fn workload_args(w: Workload, env: &Env) -> Vec<String> {
    let mut a: Vec<String> = vec![
        "--workload".into(),
        match w {
            Workload::ShareGpt => "sharegpt",
            Workload::Hol => "hol",
        }
        .into(),
        // loadgen defaults, spelled out: lognormal prompt mean 250 / output mean 200, sigma 1.
        "--prompt-mean".into(),
        "250".into(),
        "--output-mean".into(),
        "200".into(),
        "--prompt-max".into(),
        "4096".into(),
        "--output-max".into(),
        "2048".into(),
    ];
    if w == Workload::Hol {
        a.extend([
            "--hol-at".to_string(),
            format!("{}s", env.hol_at_s),
            "--hol-count".into(),
            env.hol_count.to_string(),
            "--hol-spread".into(),
            "500ms".into(),
            "--hol-prompt-tokens".into(),
            "4000".into(),
            "--hol-output-tokens".into(),
            "1000".into(),
        ]);
    }
    a
}

/// Writes the seeded trace of `load` (rate = load × capacity) to `path`.
pub fn make_trace(load: &Load, env: &Env, path: &Path) -> Result<f64, Error> {
    let rate = load.load * env.capacity_rps;
    let mut args = vec![
        "--dry-run".to_string(),
        "--seed".into(),
        env.seed.to_string(),
        "--rate".into(),
        format!("{rate:.3}"),
        "--duration".into(),
        format!("{}s", env.duration_s),
        "--arrival".into(),
        match load.arrival {
            Arrival::Poisson => "poisson",
            Arrival::Bursty => "gamma",
        }
        .into(),
        "--cv".into(),
        "3".into(),
        "--trace-out".into(),
        path.display().to_string(),
    ];
    args.extend(workload_args(load.workload, env));
    run_quiet(&env.loadgen, &args)?;
    Ok(rate)
}

fn run_quiet(bin: &Path, args: &[String]) -> Result<(), Error> {
    let out = Command::new(bin)
        .args(args)
        .output()
        .map_err(|e| format!("running {}: {e}", bin.display()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{} {:?} failed ({}): {}",
            bin.display(),
            args,
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// Splits a JSONL trace into `n` files, line i to file i mod n.
pub fn split_trace(path: &Path, n: usize, dir: &Path) -> Result<Vec<PathBuf>, Error> {
    let f = File::open(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    let paths: Vec<PathBuf> = (0..n)
        .map(|i| dir.join(format!("trace.{i}.jsonl")))
        .collect();
    let mut outs = paths
        .iter()
        .map(|p| File::create(p).map_err(|e| format!("creating {}: {e}", p.display())))
        .collect::<Result<Vec<_>, _>>()?;
    for (i, line) in BufReader::new(f).lines().enumerate() {
        let line = line.map_err(|e| format!("reading {}: {e}", path.display()))?;
        if let Some(o) = outs.get_mut(i % n) {
            writeln!(o, "{line}").map_err(|e| e.to_string())?;
        }
    }
    Ok(paths)
}

/// Reads loadgen `--records` files.
pub fn read_records(paths: &[PathBuf]) -> Result<Vec<Record>, Error> {
    let mut v = Vec::new();
    for p in paths {
        let f = File::open(p).map_err(|e| format!("reading {}: {e}", p.display()))?;
        for (n, line) in BufReader::new(f).lines().enumerate() {
            let line = line.map_err(|e| e.to_string())?;
            if line.trim().is_empty() {
                continue;
            }
            let r: Record = serde_json::from_str(&line)
                .map_err(|e| format!("{} line {}: {e}", p.display(), n + 1))?;
            v.push(r);
        }
    }
    v.sort_by_key(|r| r.id);
    Ok(v)
}

/// Loadgen processes replaying sub-traces against sidecars.
fn spawn_loadgens(
    env: &Env,
    urls: &[SocketAddr],
    traces: &[PathBuf],
    dir: &Path,
    tag: &str,
) -> Result<(Vec<Child>, Vec<PathBuf>), Error> {
    let mut children = Vec::new();
    let mut records = Vec::new();
    for (i, (url, trace)) in urls.iter().zip(traces).enumerate() {
        let rec = dir.join(format!("{tag}.records.{i}.jsonl"));
        let log = dir.join(format!("{tag}.loadgen.{i}.log"));
        let log_f = File::create(&log).map_err(|e| format!("creating {}: {e}", log.display()))?;
        let log_e = log_f.try_clone().map_err(|e| e.to_string())?;
        let c = ai_lb_e2e::process::die_with_parent(&mut Command::new(&env.loadgen))
            .arg("--url")
            .arg(format!("http://{url}"))
            .arg("--trace-in")
            .arg(trace)
            .arg("--timeout")
            .arg(format!("{}s", env.timeout_s))
            .arg("--records")
            .arg(&rec)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log_f))
            .stderr(Stdio::from(log_e))
            .spawn()
            .map_err(|e| format!("starting loadgen: {e}"))?;
        children.push(c);
        records.push(rec);
    }
    Ok((children, records))
}

fn wait_all(children: &mut [Child], deadline: Duration) -> Result<(), Error> {
    let end = Instant::now() + deadline;
    for c in children.iter_mut() {
        loop {
            match c.try_wait() {
                Ok(Some(st)) if st.success() => break,
                Ok(Some(st)) => return Err(format!("loadgen exited with {st}")),
                Ok(None) if Instant::now() < end => std::thread::sleep(Duration::from_millis(100)),
                Ok(None) => {
                    let _ = c.kill();
                    let _ = c.wait();
                    return Err(format!("loadgen still running after {deadline:?}"));
                }
                Err(e) => return Err(format!("waiting for loadgen: {e}")),
            }
        }
    }
    Ok(())
}

/// What one policy did on one scenario.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyResult {
    pub policy: &'static str,
    pub all: Summary,
    /// Per tag (`short`, `long`) for the HOL workload.
    pub by_tag: std::collections::BTreeMap<String, Summary>,
    /// Fault runs: share of requests sent to the faulty pod before/after the fault.
    pub fault: Option<Value>,
    /// Whether the ai-lb sidecars listed every pod before the run started.
    pub ailb_ready: Option<bool>,
    /// ai-lb only: the filter's pool-wide counters (`wasmcustom.ailb.*` except per-endpoint
    /// ones) at the end of the run, summed over the sidecars: fallbacks, fail-opens, cuts of a
    /// model server that stopped answering, breaker openings, ...
    pub filter_counters: Option<std::collections::BTreeMap<String, u64>>,
}

/// Runs `policy` on `trace` with the pool; returns the merged records and the result.
pub fn run_policy(
    policy: Policy,
    load: &Load,
    env: &Env,
    pool: &mut Pool,
    trace: &Path,
    dir: &Path,
) -> Result<(Vec<Record>, PolicyResult), Error> {
    eprintln!("[bench] {}: {} ...", load.name, policy.name());
    let mut sidecars = Vec::new();
    for _ in 0..env.sidecars {
        sidecars.push(topology::start_sidecar(
            policy,
            &pool.addrs(),
            &pool.agent_addrs(),
            1,
        )?);
    }
    let ailb_ready = (policy == Policy::AiLb).then(|| {
        sidecars
            .iter()
            .all(|s| topology::wait_ailb_ready(s, &pool.addrs(), Duration::from_secs(15)))
    });
    let traces = split_trace(trace, env.sidecars, dir)?;
    let urls: Vec<SocketAddr> = sidecars.iter().map(|s| s.listener).collect();
    let started = Instant::now();
    let (mut children, rec_paths) = spawn_loadgens(env, &urls, &traces, dir, policy.name())?;
    let fault_at = Duration::from_secs_f64(env.duration_s / 2.0);
    // What reached the pods (retries hide failed attempts from the clients).
    let probe = load.fault.map(|_| {
        let admins = sidecars.iter().map(|s| s.admin).collect();
        crate::attempts::Probe::start(pool.addrs(), 0, admins, started)
    });
    let mut fault_done = false;
    let mut cut_watch = None;
    if let Some(f) = load.fault {
        std::thread::sleep(fault_at.saturating_sub(started.elapsed()));
        match f {
            Fault::Slowdown5x => pool.control(0, r#"{"slowdown":5}"#)?,
            Fault::Slowdown5xSilent => pool.control(0, r#"{"slowdown":5,"throttle":false}"#)?,
            Fault::Errors50 => pool.control(0, r#"{"error_rate":0.5}"#)?,
            Fault::Sigstop => pool.pods[0].proc.sigstop()?,
        }
        fault_done = true;
        // When each sidecar's routing cut the pod (a slowed pod is penalised, not cut).
        if policy == Policy::AiLb && matches!(f, Fault::Errors50 | Fault::Sigstop) {
            cut_watch = Some(crate::attempts::CutWatch::start(
                urls.clone(),
                pool.addrs()[0].to_string(),
                started,
                Duration::from_secs(10),
            ));
        }
    }
    let waited = wait_all(
        &mut children,
        Duration::from_secs_f64(env.duration_s + env.timeout_s + 30.0),
    );
    let attempts =
        probe.map(|p| p.finish(0, fault_at.as_secs_f64() * 1000.0, env.duration_s * 1000.0));
    if fault_done {
        match load.fault {
            Some(Fault::Sigstop) => pool.pods[0].proc.sigcont()?,
            Some(_) => pool.control(0, r#"{"reset":true}"#)?,
            None => {}
        }
    }
    let cut_ms = cut_watch.map(crate::attempts::CutWatch::finish);
    let filter_counters = (policy == Policy::AiLb).then(|| filter_counters(&sidecars));
    drop(sidecars);
    waited?;
    // Per sidecar (each replays its own sub-trace), then merged in id order.
    let per_sidecar = rec_paths
        .iter()
        .map(|p| read_records(std::slice::from_ref(p)))
        .collect::<Result<Vec<_>, _>>()?;
    let mut records: Vec<Record> = per_sidecar.iter().flatten().cloned().collect();
    records.sort_by_key(|r| r.id);
    pool.wait_idle(Duration::from_secs_f64(env.timeout_s + 30.0))?;
    let timeout_ms = env.timeout_s * 1000.0;
    let refs: Vec<&Record> = records.iter().collect();
    let all = analysis::summarize(&refs, timeout_ms);
    let mut by_tag = std::collections::BTreeMap::new();
    for tag in ["short", "long"] {
        let sub: Vec<&Record> = records.iter().filter(|r| r.tag.as_str() == tag).collect();
        if !sub.is_empty() && load.workload == Workload::Hol {
            by_tag.insert(tag.to_string(), analysis::summarize(&sub, timeout_ms));
        }
    }
    let fault = load.fault.map(|_| {
        let pod = pool.pods[0].name.as_str();
        let t = fault_at.as_secs_f64() * 1000.0;
        let series = analysis::share_over_time(&refs, pod, 250.0, env.duration_s * 1000.0);
        json!({
            "pod": pod,
            "fault_at_ms": t,
            "share_before_10s": analysis::share_between(&refs, pod, t - 10_000.0, t),
            "share_first_1s_after": analysis::share_between(&refs, pod, t, t + 1000.0),
            "share_1s_to_2s_after": analysis::share_between(&refs, pod, t + 1000.0, t + 2000.0),
            "share_2s_to_end": analysis::share_between(&refs, pod, t + 2000.0, f64::INFINITY),
            "share_per_250ms": series,
            "attempts": attempts,
            "sidecar_cut_ms_after_fault": cut_ms.as_ref().map(|c| {
                c.iter().map(|x| x.map(|x| x - t)).collect::<Vec<_>>()
            }),
            "after_own_cut": cut_ms
                .as_ref()
                .map(|c| analysis::after_cut(&per_sidecar, c, pod)),
        })
    });
    Ok((
        records,
        PolicyResult {
            policy: policy.name(),
            all,
            by_tag,
            fault,
            ailb_ready,
            filter_counters,
        },
    ))
}

/// The filter's counters summed over `sidecars` (see [`PolicyResult::filter_counters`]); a
/// sidecar whose admin page does not answer adds nothing.
fn filter_counters(
    sidecars: &[ai_lb_e2e::envoy::Envoy],
) -> std::collections::BTreeMap<String, u64> {
    let mut sum = std::collections::BTreeMap::new();
    for s in sidecars {
        let Ok(stats) = s.stats() else { continue };
        for (k, v) in stats {
            if let Some(name) = k.strip_prefix("wasmcustom.ailb.") {
                if !name.starts_with("endpoint.") {
                    *sum.entry(name.to_string()).or_insert(0) += v;
                }
            }
        }
    }
    sum
}

/// Runs every policy on one load scenario; writes `<out>/<name>/summary.json` and `table.md`,
/// and the merged records to `<work>/<name>/<policy>.jsonl` (for plots).
pub fn run_load(load: &Load, env: &Env, pool: &mut Pool, cmd: &str) -> Result<Value, Error> {
    let dir = env.work.join(&load.name);
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let trace = dir.join("trace.jsonl");
    let rate = make_trace(load, env, &trace)?;
    let mut results = Vec::new();
    for &policy in &env.policies {
        let (records, r) = run_policy(policy, load, env, pool, &trace, &dir)?;
        let merged = dir.join(format!("{}.jsonl", policy.name()));
        let mut f = File::create(&merged).map_err(|e| e.to_string())?;
        for rec in &records {
            let line = serde_json::to_string(rec).map_err(|e| e.to_string())?;
            writeln!(f, "{line}").map_err(|e| e.to_string())?;
        }
        results.push(r);
    }
    let summary = summarize_policies(load, env, rate, &results, cmd);
    write_outputs(
        &env.out.join(&load.name),
        &summary,
        &table(load, &results, rate, env, cmd),
    )?;
    Ok(summary)
}

fn summarize_policies(
    load: &Load,
    env: &Env,
    rate: f64,
    results: &[PolicyResult],
    cmd: &str,
) -> Value {
    let find = |p: &str| results.iter().find(|r| r.policy == p);
    let (rr, lr, ai) = (find("round_robin"), find("least_request"), find("ai_lb"));
    let ratio_pair = |pick: fn(&PolicyResult) -> Option<&Summary>| {
        let (Some(ai), Some(lr), Some(rr)) = (ai, lr, rr) else {
            return json!(null);
        };
        match (pick(ai), pick(lr), pick(rr)) {
            (Some(a), Some(l), Some(r)) => json!({
                "ai_lb_over_least_request": analysis::ratios(a, l),
                "ai_lb_over_round_robin": analysis::ratios(a, r),
            }),
            _ => json!(null),
        }
    };
    json!({
        "scenario": load.name,
        "command": cmd,
        "workload": format!("{:?}", load.workload),
        "arrival": format!("{:?}", load.arrival),
        "load_fraction": load.load,
        "rate_rps": rate,
        "capacity_rps": env.capacity_rps,
        "duration_s": env.duration_s,
        "client_timeout_s": env.timeout_s,
        "sidecars": env.sidecars,
        "seed": env.seed,
        "policies": results,
        "ratios": ratio_pair(|r| Some(&r.all)),
        "ratios_short": ratio_pair(|r| r.by_tag.get("short")),
    })
}

fn write_outputs(dir: &Path, summary: &Value, table: &str) -> Result<(), Error> {
    std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let text = serde_json::to_string_pretty(summary).map_err(|e| e.to_string())?;
    std::fs::write(dir.join("summary.json"), text).map_err(|e| e.to_string())?;
    std::fs::write(dir.join("table.md"), table).map_err(|e| e.to_string())?;
    Ok(())
}

fn f1(v: Option<f64>) -> String {
    v.map_or("–".into(), |x| format!("{x:.0}"))
}

/// A share as a percentage with two decimals.
fn pct(v: Option<f64>) -> String {
    v.map_or("–".into(), |x| format!("{:.2} %", x * 100.0))
}

fn f2(v: Option<f64>) -> String {
    v.map_or("–".into(), |x| format!("{x:.2}"))
}

fn row(name: &str, s: &Summary) -> String {
    format!(
        "| {name} | {} | {} | {} | {} | {} | {} | {:.2}% | {:.2}% | {:.0} | {} |\n",
        f1(s.ttft_ms.p50),
        f1(s.ttft_ms.p90),
        f1(s.ttft_ms.p99),
        f1(s.e2e_ms.p50),
        f1(s.e2e_ms.p90),
        f1(s.e2e_ms.p99),
        s.timeout_rate * 100.0,
        s.error_rate * 100.0,
        s.output_tokens_per_s,
        f1(s.dispatch_lag_ms.p99),
    )
}

fn ratio_rows(this: &Summary, base: &Summary, label: &str) -> String {
    let r = analysis::ratios(this, base);
    format!(
        "| {label} | | | {} | | | {} | {} | | {} | |\n",
        f2(r.ttft_p99),
        f2(r.e2e_p99),
        f2(r.timeout_rate),
        f2(r.throughput),
    )
}

/// The markdown table of one scenario (all requests, and short requests for HOL).
pub fn table(load: &Load, results: &[PolicyResult], rate: f64, env: &Env, cmd: &str) -> String {
    let mut t = format!(
        "### {} ({:.1} req/s = {:.0}% of {:.1} req/s capacity, {} s, seed {}, timeout {} s)\n\n`{cmd}`\n\n",
        load.name,
        rate,
        load.load * 100.0,
        env.capacity_rps,
        env.duration_s,
        env.seed,
        env.timeout_s
    );
    let mut sets: Vec<(&str, Vec<(&str, &Summary)>)> = vec![(
        "all requests",
        results.iter().map(|r| (r.policy, &r.all)).collect(),
    )];
    if load.workload == Workload::Hol {
        sets.push((
            "short requests only",
            results
                .iter()
                .filter_map(|r| r.by_tag.get("short").map(|s| (r.policy, s)))
                .collect(),
        ));
    }
    for (label, rows) in sets {
        t.push_str(&format!(
            "{label}: TTFT / e2e in ms (timeouts counted at the timeout)\n\n\
             | policy | TTFT p50 | p90 | p99 | e2e p50 | p90 | p99 | timeouts | errors | out tok/s | lag p99 |\n\
             |---|---|---|---|---|---|---|---|---|---|---|\n"
        ));
        for (p, s) in &rows {
            t.push_str(&row(p, s));
        }
        let get = |n: &str| rows.iter().find(|(p, _)| *p == n).map(|(_, s)| *s);
        if let (Some(a), Some(l), Some(r)) =
            (get("ai_lb"), get("least_request"), get("round_robin"))
        {
            t.push_str(&ratio_rows(a, l, "ai_lb / least_request"));
            t.push_str(&ratio_rows(a, r, "ai_lb / round_robin"));
        }
        t.push('\n');
    }
    t.push_str("per-pod share of answered requests:\n\n| policy |");
    let pods: Vec<String> = results
        .first()
        .map(|r| r.all.pod_share.keys().cloned().collect())
        .unwrap_or_default();
    for p in &pods {
        t.push_str(&format!(" {p} |"));
    }
    t.push_str("\n|---|");
    t.push_str(&"---|".repeat(pods.len()));
    t.push('\n');
    for r in results {
        t.push_str(&format!("| {} |", r.policy));
        for p in &pods {
            t.push_str(&format!(
                " {:.3} |",
                r.all.pod_share.get(p).copied().unwrap_or(0.0)
            ));
        }
        t.push('\n');
    }
    for r in results {
        if let Some(f) = &r.fault {
            t.push_str(&format!(
                "\n{}: share to {} before fault (10 s) {}, first 1 s after {}, 1–2 s after {}, 2 s–end {}",
                r.policy,
                f["pod"].as_str().unwrap_or("?"),
                f2(f["share_before_10s"].as_f64()),
                f2(f["share_first_1s_after"].as_f64()),
                f2(f["share_1s_to_2s_after"].as_f64()),
                f2(f["share_2s_to_end"].as_f64()),
            ));
            let a = &f["attempts"];
            t.push_str(&format!(
                "; attempts reaching it (pod-side, retries included): share 10 s before {}, after the fault {}",
                pct(a["pod_share_of_attempts_10s_before"].as_f64()),
                pct(a["pod_share_of_attempts_after_fault"].as_f64()),
            ));
            if let Some(ms) = a["first_breaker_open_ms_after_fault"].as_f64() {
                t.push_str(&format!(
                    ", first breaker opened {ms:.0} ms after the fault, after that {} of attempts ({} of {}), {} openings",
                    pct(a["pod_share_of_attempts_after_first_open"].as_f64()),
                    f1(a["attempts_at_pod_after_first_open"].as_f64()),
                    f1(a["attempts_all_pods_after_first_open"].as_f64()),
                    a["breaker_openings_after_fault"].as_u64().unwrap_or(0),
                ));
            }
            if let Some(share) = a["sidecar_share_after_own_open"].as_f64() {
                t.push_str(&format!(
                    "; per sidecar, after its own breaker first opened ({} of {} sidecars, at {} ms): {} of its picks went to the pod ({} of {})",
                    a["sidecars_opened"].as_u64().unwrap_or(0),
                    env.sidecars,
                    a["sidecar_first_open_ms_after_fault"]
                        .as_array()
                        .map(|v| v
                            .iter()
                            .filter_map(Value::as_f64)
                            .map(|x| format!("{x:.0}"))
                            .collect::<Vec<_>>()
                            .join("/"))
                        .unwrap_or_default(),
                    pct(Some(share)),
                    a["sidecar_picks_of_pod_after_own_open"].as_u64().unwrap_or(0),
                    a["sidecar_steered_after_own_open"].as_u64().unwrap_or(0),
                ));
            }
            if let Some(cuts) = f["sidecar_cut_ms_after_fault"].as_array() {
                let c = &f["after_own_cut"];
                let times = |v: &Value| {
                    v.as_array()
                        .map(|v| {
                            v.iter()
                                .map(|x| x.as_f64().map_or("never".into(), |x| format!("{x:.0}")))
                                .collect::<Vec<_>>()
                                .join("/")
                        })
                        .unwrap_or_default()
                };
                let sent = c["sent_to_pod"].as_u64().unwrap_or(0);
                t.push_str(&format!(
                    "; each sidecar's status page first showed the pod cut {} ms after the fault ({} of {} sidecars); sent to the pod after the sender's own cut: {sent} requests",
                    times(&Value::Array(cuts.clone())),
                    c["sidecars_cut"].as_u64().unwrap_or(0),
                    env.sidecars,
                ));
                if sent > 0 {
                    t.push_str(&format!(
                        ", {} of them timed out (sent {} ms after the cut)",
                        c["timeouts"].as_u64().unwrap_or(0),
                        times(&c["sent_ms_after_cut"]),
                    ));
                }
            }
        }
        if let Some(c) = &r.filter_counters {
            let nonzero: Vec<String> = c
                .iter()
                .filter(|(_, v)| **v > 0)
                .map(|(k, v)| format!("{k} {v}"))
                .collect();
            t.push_str(&format!(
                "\n{} filter counters at the end, summed over the {} sidecars (non-zero only): {}",
                r.policy,
                env.sidecars,
                if nonzero.is_empty() {
                    "none".to_string()
                } else {
                    nonzero.join(", ")
                }
            ));
        }
        if r.ailb_ready == Some(false) {
            t.push_str(&format!(
                "\n**{}: the sidecars' /ai-lb/status did not list every pod before the run**",
                r.policy
            ));
        }
    }
    t.push('\n');
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scenario_names_parse_or_say_why_not() {
        let l = parse_load("sharegpt-bursty-95").unwrap();
        assert_eq!(l.arrival, Arrival::Bursty);
        assert!((l.load - 0.95).abs() < 1e-12);
        assert_eq!(
            parse_load("fault-sigstop").unwrap().fault,
            Some(Fault::Sigstop)
        );
        assert_eq!(
            parse_load("fault-slowdown-silent").unwrap().fault,
            Some(Fault::Slowdown5xSilent)
        );
        assert!(parse_load("fault-slowdown-loud").is_err());
        let e = parse_load("sharegpt-poisson-x").unwrap_err();
        assert!(e.contains("\"x\""), "{e}");
        assert!(parse_load("nonsense").unwrap_err().contains("nonsense"));
    }

    #[test]
    fn split_sends_line_i_to_file_i_mod_n() {
        let dir = std::env::temp_dir().join(format!("ai-lb-bench-split-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("t.jsonl");
        std::fs::write(&p, "a\nb\nc\nd\ne\n").unwrap();
        let parts = split_trace(&p, 2, &dir).unwrap();
        assert_eq!(std::fs::read_to_string(&parts[0]).unwrap(), "a\nc\ne\n");
        assert_eq!(std::fs::read_to_string(&parts[1]).unwrap(), "b\nd\n");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
