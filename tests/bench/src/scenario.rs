//! Decides how each benchmark scenario runs: its parameters (fixed here, before any result was
//! seen), the seeded trace every policy replays, the split of that trace across the client
//! sidecars (request i goes to sidecar i mod N), the fault injected mid-run, and what is written
//! (summary JSON with ratios, a markdown table, per-request records for the plots).
//!
//! The prefix-cache workloads (`prefix-*`, `multiturn-*`; docs/benchmark-workloads.md) are
//! loaded as fractions of the capacity measured FOR THAT WORKLOAD (one pod per preset
//! overloaded directly, as `calibrate.rs` does for ShareGPT, saved per workload), start every
//! policy from equally cold pod caches, and report each policy's hit rate from the pods'
//! prefix-cache counters and every request's no-queue TTFT floor (`floor.rs`).

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ai_lb_loadgen::stats::{Record, Sessions};
use serde::Serialize;
use serde_json::{json, Value};

use crate::analysis::{self, CacheReport, Pcts, Summary};
use crate::floor;
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
    /// Groups sharing a long system prompt (llm-d's shared-prefix profile, scaled).
    SharedPrefix,
    /// Sessions resending their conversation every turn.
    MultiTurn,
}

impl Workload {
    /// Whether requests share prefixes: such runs start from cold pod caches and are loaded
    /// against their own measured capacity.
    pub fn uses_prefix_cache(self) -> bool {
        matches!(self, Workload::SharedPrefix | Workload::MultiTurn)
    }

    /// The loadgen's `--workload` value.
    pub fn loadgen_name(self) -> &'static str {
        match self {
            Workload::ShareGpt => "sharegpt",
            Workload::Hol => "hol",
            Workload::SharedPrefix => "shared-prefix",
            Workload::MultiTurn => "multi-turn",
        }
    }
}

/// Shared-prefix defaults: llm-d's profile (150 groups, 6 000-token system prompt, 1 200-token
/// questions, 1 000-token answers, 8 pods) scaled to the bench pool; the ratios kept are in
/// docs/benchmark-workloads.md.
pub const PREFIX_GROUPS: u32 = 40;
pub const PREFIX_SYSTEM_TOKENS: u32 = 900;
pub const PREFIX_USERS: u32 = 5;
pub const PREFIX_QUESTION_TOKENS: u32 = 180;
pub const PREFIX_ANSWER_TOKENS: u32 = 150;
/// Multi-turn defaults (docs/benchmark-workloads.md).
pub const TURN_GROUPS: u32 = 8;
pub const TURN_SYSTEM_TOKENS: u32 = 300;
pub const TURNS: (u32, u32) = (2, 6);
pub const TURN_QUESTION_TOKENS: u32 = 100;
pub const TURN_ANSWER_TOKENS: u32 = 100;
pub const THINK_MEAN_S: f64 = 1.0;
pub const THINK_MAX_S: f64 = 10.0;

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
    /// Pod 0 fails every request for 8 s, then heals only partly (fails 15 % of requests for
    /// 15 s), then heals for good: what a restarted server still warming up does. Shows what
    /// a breaker that closes on its probes does next (`ai_lb_ramp` against `ai_lb`).
    Flap,
    /// A noisy but healthy pool, then a real fault: from the start every pod fails 10 % of
    /// its requests, and in turn each pod (one at a time, 3 s each) bursts to 30 %; none is
    /// sick. At the middle pod 0 starts failing 50 % (the others' noise goes on). Breaker
    /// openings before the fault are false trips; the time from the fault to each sidecar's
    /// cut of pod 0 is the detection time (`ai_lb_adaptive` against `ai_lb`).
    Noisy,
    /// Pod 0 (an h100) runs 2.5x slower, not shown by its GPU (no throttle reason) and under
    /// the 3x of the pool median that `cutoffs.slowItlRatio` penalises: only its latency tells
    /// (`misleading-slow`, issue 30 part 1: `ai_lb_learned` against `ai_lb`).
    SlowMildSilent,
    /// Pod 0's API server front end turns slow ([`FRONTEND_MS`] a request, one at a time,
    /// before its engine sees the request: a CPU-starved server process): requests queue where
    /// no metric of the pod shows them, so its engine looks less busy than it is and the static
    /// formula sends it more (`misleading-frontend`, issue 30 part 1: `ai_lb_learned` against
    /// `ai_lb`; least_request sees its own requests pile up there).
    FrontendSlow,
    /// Pod 0's GPU memory starts growing with its load (the fake pod's `memory_growth`): it
    /// holds steady at 60 % of the sequences pod 0 runs when the fault starts, and each one
    /// over grows it so that that load grows it about [`OOM_GROWTH_BYTES_PER_S`]; at the GPU's
    /// total it OOM-crashes (every request in flight fails) and restarts after 5 s. Requests
    /// lost to the crashes: `ai_lb` (`preOom` on by default) against `ai_lb_no_preoom`.
    Oom,
}

/// [`Fault::FrontendSlow`]'s time per request in pod 0's front end (ms): at most 5 requests a
/// second get through, under the 5.5–6 a second an even share of an 80 % load brings an h100,
/// so a policy that keeps sending it its share builds a queue there without bound.
/// `AI_LB_BENCH_FRONTEND_MS` sets another (120 left every policy's share under what it passes).
const FRONTEND_MS: u64 = 200;

fn frontend_ms() -> Result<u64, Error> {
    match std::env::var("AI_LB_BENCH_FRONTEND_MS") {
        Err(_) => Ok(FRONTEND_MS),
        Ok(v) => v
            .parse::<u64>()
            .ok()
            .filter(|ms| *ms <= 60_000)
            .ok_or_else(|| {
                format!("AI_LB_BENCH_FRONTEND_MS={v:?}: not an integer within 0..=60000 (ms)")
            }),
    }
}

/// How fast [`Fault::Oom`] grows pod 0's memory at the load it has when the fault starts.
const OOM_GROWTH_BYTES_PER_S: f64 = 1.5e9;

/// The `memory_growth` fault for a pod running `running` sequences now (see [`Fault::Oom`]).
fn oom_fault(running: f64) -> String {
    let running = running.max(2.0);
    let sustained = 0.6 * running;
    let per_seq = OOM_GROWTH_BYTES_PER_S / (running - sustained);
    format!(
        r#"{{"memory_growth":{{"bytes_per_s_per_seq":{per_seq},"sustained_seqs":{sustained},"restart_ms":5000}}}}"#
    )
}

/// Background error rate of every pod in [`Fault::Noisy`], and a pod's during its burst;
/// `AI_LB_BENCH_NOISE=<background>,<burst>` (e.g. `0.08,0.2`) sets others.
const NOISE_RATE: f64 = 0.10;
const NOISE_BURST_RATE: f64 = 0.30;

/// [`NOISE_RATE`] and [`NOISE_BURST_RATE`], or `AI_LB_BENCH_NOISE`'s (each within 0..=1).
fn noise_rates() -> Result<(f64, f64), Error> {
    let Ok(v) = std::env::var("AI_LB_BENCH_NOISE") else {
        return Ok((NOISE_RATE, NOISE_BURST_RATE));
    };
    let parse = |s: &str| {
        s.trim()
            .parse::<f64>()
            .ok()
            .filter(|x| (0.0..=1.0).contains(x))
    };
    match v.split_once(',') {
        Some((a, b)) => match (parse(a), parse(b)) {
            (Some(a), Some(b)) => Ok((a, b)),
            _ => Err(format!(
                "AI_LB_BENCH_NOISE={v:?}: expected <background>,<burst> within 0..=1"
            )),
        },
        None => Err(format!(
            "AI_LB_BENCH_NOISE={v:?}: expected <background>,<burst>"
        )),
    }
}
/// How long each burst lasts; the pods burst one after another.
const NOISE_BURST: Duration = Duration::from_secs(3);

/// Runs [`Fault::Noisy`]'s noise on `pods` until `stop`: each pod at [`NOISE_RATE`] but the one
/// whose turn it is ([`NOISE_BURST_RATE`] for [`NOISE_BURST`]); pod 0 is left alone once
/// `faulted` (its fault is set by the run). A failed control request is reported, not fatal.
fn start_noise(
    (background, burst): (f64, f64),
    pods: Vec<(SocketAddr, String)>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    faulted: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<()> {
    use std::sync::atomic::Ordering;
    std::thread::spawn(move || {
        let started = Instant::now();
        let mut set: Vec<Option<f64>> = vec![None; pods.len()];
        while !stop.load(Ordering::Relaxed) {
            let turn = (started.elapsed().as_millis() / NOISE_BURST.as_millis()) as usize;
            for (i, (addr, name)) in pods.iter().enumerate() {
                if i == 0 && faulted.load(Ordering::Relaxed) {
                    continue;
                }
                let rate = if turn % pods.len() == i {
                    burst
                } else {
                    background
                };
                if set.get(i).copied().flatten() != Some(rate) {
                    let json = format!(r#"{{"error_rate":{rate}}}"#);
                    match topology::control(*addr, name, &json) {
                        Ok(()) => {
                            if let Some(s) = set.get_mut(i) {
                                *s = Some(rate);
                            }
                        }
                        Err(e) => eprintln!("[bench] fault-noisy: {e}"),
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    })
}

/// Runs the rest of [`Fault::Flap`] on pod `addr` (its first phase already set): after 8 s it
/// fails 15 % of requests (under the agents' error-rate trip of 25 %, so its breaker closes on
/// passing probes), 15 s later none. A failed control request is reported, not fatal
/// (the run's records show what the pod did).
fn start_flap(addr: SocketAddr, name: String) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        for (after, json) in [
            (Duration::from_secs(8), r#"{"error_rate":0.15}"#),
            (Duration::from_secs(15), r#"{"error_rate":0.0}"#),
        ] {
            std::thread::sleep(after);
            if let Err(e) = topology::control(addr, &name, json) {
                eprintln!("[bench] fault-flap: {e}");
            }
        }
    })
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

/// Parses `sharegpt-poisson-80`, `sharegpt-bursty-95`, `hol-poisson-80`, `prefix-poisson-80`,
/// `prefix-bursty-80`, `multiturn-poisson-80`, `fault-slowdown`, `fault-slowdown-silent`,
/// `fault-errors`, `fault-sigstop`, `fault-flap`, `fault-noisy`, `misleading-slow`,
/// `misleading-frontend`.
pub fn parse_load(name: &str) -> Result<Load, Error> {
    let bad = || {
        format!(
            "unknown scenario {name:?}: expected calibrate, overhead, freshness, \
             <sharegpt|hol|prefix|multiturn>-<poisson|bursty>-<percent of capacity>, or fault-<slowdown|slowdown-silent|errors|sigstop|flap|noisy|oom>, misleading-<slow|frontend>"
        )
    };
    let misleading = match name {
        "misleading-slow" => Some(Fault::SlowMildSilent),
        "misleading-frontend" => Some(Fault::FrontendSlow),
        _ => None,
    };
    if let Some(fault) = misleading {
        return Ok(Load {
            name: name.into(),
            workload: Workload::ShareGpt,
            arrival: Arrival::Poisson,
            load: 0.8,
            fault: Some(fault),
        });
    }
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
            "flap" => Fault::Flap,
            "noisy" => Fault::Noisy,
            "oom" => Fault::Oom,
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
        "prefix" => Workload::SharedPrefix,
        "multiturn" => Workload::MultiTurn,
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
    /// The pods' shape, for the floor, the cache flush and the saved calibrations.
    pub time_scale: f64,
    pub max_num_seqs: u32,
    pub kv_cache_tokens: u64,
    /// Calibration of the prefix-cache workloads: overload per probed pod (req/s; multi-turn
    /// uses a closed loop instead), seconds, and whether to measure again even when saved.
    pub cal_rate: f64,
    pub cal_secs: f64,
    pub recalibrate: bool,
    /// The HOL burst: long requests and when.
    pub hol_count: u32,
    pub hol_at_s: f64,
    /// Policies to run, in order (default: all three).
    pub policies: Vec<Policy>,
}

/// The loadgen flags that define a workload (stated in BENCHMARKS.md and
/// docs/benchmark-workloads.md).
pub fn workload_args(w: Workload, env: &Env) -> Vec<String> {
    let strings = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<String>>();
    match w {
        Workload::SharedPrefix => {
            return strings(&[
                "--workload",
                "shared-prefix",
                "--groups",
                &PREFIX_GROUPS.to_string(),
                "--system-tokens",
                &PREFIX_SYSTEM_TOKENS.to_string(),
                "--users-per-group",
                &PREFIX_USERS.to_string(),
                "--question-tokens",
                &PREFIX_QUESTION_TOKENS.to_string(),
                "--question-sigma",
                "0.3",
                "--question-min",
                "8",
                "--question-max",
                &(4 * PREFIX_QUESTION_TOKENS).to_string(),
                "--answer-tokens",
                &PREFIX_ANSWER_TOKENS.to_string(),
                "--answer-sigma",
                "0",
                "--zipf",
                "0",
            ])
        }
        Workload::MultiTurn => {
            return strings(&[
                "--workload",
                "multi-turn",
                "--groups",
                &TURN_GROUPS.to_string(),
                "--system-tokens",
                &TURN_SYSTEM_TOKENS.to_string(),
                "--turns",
                &format!("{}..{}", TURNS.0, TURNS.1),
                "--question-tokens",
                &TURN_QUESTION_TOKENS.to_string(),
                "--question-sigma",
                "0.3",
                "--question-min",
                "8",
                "--question-max",
                &(4 * TURN_QUESTION_TOKENS).to_string(),
                "--answer-tokens",
                &TURN_ANSWER_TOKENS.to_string(),
                "--answer-sigma",
                "0",
                "--think-mean",
                &format!("{THINK_MEAN_S}s"),
                "--think-sigma",
                "1",
                "--think-max",
                &format!("{THINK_MAX_S}s"),
                "--zipf",
                "0",
            ])
        }
        Workload::ShareGpt | Workload::Hol => {}
    }
    let mut a: Vec<String> = vec![
        "--workload".into(),
        w.loadgen_name().into(),
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

/// Mean turns per session of the multi-turn workload (uniform in [min, max]).
pub fn mean_turns() -> f64 {
    f64::from(TURNS.0 + TURNS.1) / 2.0
}

/// The loadgen `--rate` of `load` at `capacity` requests/s: requests/s, or for multi-turn
/// sessions/s (requests/s over the mean turns per session).
pub fn loadgen_rate(load: &Load, capacity_rps: f64) -> f64 {
    let rps = load.load * capacity_rps;
    match load.workload {
        Workload::MultiTurn => rps / mean_turns(),
        _ => rps,
    }
}

/// Writes the seeded trace of `load` (rate = load × capacity, sharegpt's unless given) to
/// `path`; returns the requests/s it stands for.
pub fn make_trace(load: &Load, env: &Env, path: &Path) -> Result<f64, Error> {
    make_trace_at(load, env, env.capacity_rps, path)
}

/// [`make_trace`] at `capacity_rps` requests/s of the workload.
pub fn make_trace_at(load: &Load, env: &Env, capacity_rps: f64, path: &Path) -> Result<f64, Error> {
    let rate = loadgen_rate(load, capacity_rps);
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
    Ok(load.load * capacity_rps)
}

/// A workload's capacity: requests/s of the pool, and where the figure comes from.
#[derive(Debug, Clone)]
pub struct Capacity {
    pub rps: f64,
    pub source: String,
}

/// How the pool is shaped, as saved calibrations record it.
fn pool_shape(env: &Env, pool: &Pool) -> String {
    let mut counts: std::collections::BTreeMap<&str, usize> = std::collections::BTreeMap::new();
    for p in &pool.pods {
        *counts.entry(p.preset).or_default() += 1;
    }
    let presets: Vec<String> = counts.iter().map(|(k, n)| format!("{n} x {k}")).collect();
    format!(
        "{}, max_num_seqs {}, kv_cache_tokens {}, time_scale {}",
        presets.join(" + "),
        env.max_num_seqs,
        env.kv_cache_tokens,
        env.time_scale
    )
}

/// The capacity `w` is loaded against: sharegpt's calibration for the ShareGPT-shaped
/// workloads; for the prefix-cache workloads their own, read from
/// `<out>/calibrate/<workload>.json` when it was measured with the same workload flags and pool
/// (and `calibrate` was not asked for), else measured now ([`calibrate_chat`]) and saved.
pub fn workload_capacity(w: Workload, env: &Env, pool: &Pool) -> Result<Capacity, Error> {
    if !w.uses_prefix_cache() {
        return Ok(Capacity {
            rps: env.capacity_rps,
            source: "sharegpt calibration".into(),
        });
    }
    let dir = env.out.join("calibrate");
    let path = dir.join(format!("{}.json", w.loadgen_name()));
    let args = workload_args(w, env);
    let shape = pool_shape(env, pool);
    let saved = std::fs::read_to_string(&path)
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .filter(|v| v["workload_args"] == json!(args) && v["pool"] == json!(shape))
        .and_then(|v| v["capacity_rps"].as_f64());
    if let (Some(rps), false) = (saved, env.recalibrate) {
        return Ok(Capacity {
            rps,
            source: path.display().to_string(),
        });
    }
    eprintln!(
        "[bench] calibrating the pool for the {} workload",
        w.loadgen_name()
    );
    let mut cal = calibrate_chat(w, env, pool)?;
    cal["pool"] = json!(shape);
    let rps = cal["capacity_rps"]
        .as_f64()
        .filter(|c| c.is_finite() && *c > 0.0)
        .ok_or_else(|| {
            format!(
                "{} calibration gave no usable capacity: {cal}",
                w.loadgen_name()
            )
        })?;
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let text = serde_json::to_string_pretty(&cal).map_err(|e| e.to_string())?;
    std::fs::write(&path, text).map_err(|e| format!("writing {}: {e}", path.display()))?;
    eprintln!("[bench] {} calibration: {cal}", w.loadgen_name());
    Ok(Capacity {
        rps,
        source: path.display().to_string(),
    })
}

/// Closed-loop clients per probed pod for the multi-turn calibration: each spends most of a
/// session thinking, so many are needed to keep the pod's seats full.
const TURN_CAL_WORKERS_PER_SEAT: usize = 12;

/// Measures a prefix-cache workload's capacity as `calibrate.rs` measures ShareGPT's: the first
/// pod of each preset is overloaded directly (no router) with this workload's trace, its
/// output-token rate counted by its own `vllm:generation_tokens_total` over the last 70 % of
/// `cal_secs`, and the pool's rate (per preset × pods of it) divided by the mean `max_tokens`.
/// Shared-prefix is sent open loop at `cal_rate` req/s per pod (each pod sees every group, as
/// under any cache-blind spread); multi-turn closed loop with [`TURN_CAL_WORKERS_PER_SEAT`] ×
/// `max_num_seqs` sessions at a time per pod (every turn of a session on one pod: its history
/// cached as well as that pod's cache allows).
pub fn calibrate_chat(w: Workload, env: &Env, pool: &Pool) -> Result<Value, Error> {
    let dir = env.work.join(format!("calibrate-{}", w.loadgen_name()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let cold = cold_caches(pool, env, &format!("calibrate-{}", w.loadgen_name()))?;
    let probes = crate::calibrate::probes(pool);
    let trace = dir.join("overload.jsonl");
    let mut args = vec![
        "--dry-run".to_string(),
        "--seed".into(),
        env.seed.to_string(),
        "--rate".into(),
        env.cal_rate.to_string(),
        "--duration".into(),
        format!("{}s", env.cal_secs),
        "--trace-out".into(),
        trace.display().to_string(),
    ];
    args.extend(workload_args(w, env));
    run_quiet(&env.loadgen, &args)?;
    let entries = read_trace_file(&trace)?;
    let answers: Vec<f64> = entries
        .iter()
        .flat_map(|e| e.all_max_tokens())
        .map(f64::from)
        .collect();
    if answers.is_empty() {
        return Err(format!("{}: empty calibration trace", trace.display()));
    }
    let mean_out = answers.iter().sum::<f64>() / answers.len() as f64;
    let workers = (TURN_CAL_WORKERS_PER_SEAT * env.max_num_seqs as usize).to_string();
    let mut children = Vec::new();
    for (_, i) in &probes {
        let mut cmd = Command::new(&env.loadgen);
        let c = ai_lb_e2e::process::die_with_parent(&mut cmd);
        c.arg("--url")
            .arg(format!("http://{}", pool.pods[*i].addr))
            .arg("--trace-in")
            .arg(&trace)
            .arg("--timeout")
            .arg(format!("{}s", env.cal_secs));
        if w == Workload::MultiTurn {
            c.args(["--closed-loop", &workers]);
        }
        let child = c
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("starting loadgen: {e}"))?;
        children.push(child);
    }
    let (per_preset, pool_tokens, dt) =
        crate::calibrate::measure_overload(pool, &probes, children, env.cal_secs, mean_out)?;
    Ok(json!({
        "workload": w.loadgen_name(),
        "workload_args": workload_args(w, env),
        "method": if w == Workload::MultiTurn {
            format!("one pod per preset, directly, closed loop of {workers} sessions")
        } else {
            format!("one pod per preset, directly, open loop at {} req/s", env.cal_rate)
        },
        "caches_made_cold_by": cold,
        "overload_secs": env.cal_secs,
        "measured_window_s": dt,
        "mean_output_tokens": mean_out,
        "per_preset": per_preset,
        "pool_tokens_per_s": pool_tokens,
        "capacity_rps": pool_tokens / mean_out,
    }))
}

fn read_trace_file(path: &Path) -> Result<Vec<ai_lb_loadgen::workload::TraceEntry>, Error> {
    let f = File::open(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    ai_lb_loadgen::workload::read_trace(BufReader::new(f))
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// The model every fake pod serves (the loadgen's and the pod's default).
const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

/// Empties every pod's prefix cache so that each policy starts from the same cold state (the
/// pods are shared by the policies of a scenario): `POST /reset_prefix_cache` (vLLM's endpoint)
/// where a pod answers it, else one request whose unique prompt fills the pod's whole KV cache,
/// which evicts every cached block (LRU) and leaves only blocks no workload request can hit.
/// Pods must be idle (call after [`Pool::wait_idle`]). Returns how it was done.
pub fn cold_caches(pool: &Pool, env: &Env, tag: &str) -> Result<String, Error> {
    let block = u64::from(floor::BLOCK_TOKENS);
    let capacity = env.kv_cache_tokens / block * block;
    // Chat template: role token + content + generation prompt; plus one generated token.
    let content_tokens = capacity.saturating_sub(block).saturating_sub(2).max(1) as u32;
    let results: Vec<Result<&'static str, Error>> = std::thread::scope(|scope| {
        let handles: Vec<_> = pool
            .pods
            .iter()
            .enumerate()
            .map(|(i, pod)| {
                let header = format!("[cache flush {tag} pod {i}] ");
                scope.spawn(move || -> Result<&'static str, Error> {
                    let mut c = ai_lb_e2e::envoy::HttpClient::new(pod.addr);
                    let r = c.post_json("/reset_prefix_cache", &[("connection", "close")], "")?;
                    if r.status == 200 {
                        return Ok("reset");
                    }
                    let seed = ai_lb_loadgen::text::mix(env.seed, i as u64);
                    let mut body = String::from("{\"model\":");
                    body.push_str(&serde_json::to_string(MODEL).map_err(|e| e.to_string())?);
                    body.push_str(",\"messages\":[{\"role\":\"user\",\"content\":");
                    ai_lb_loadgen::text::push_json_str(
                        &mut body,
                        &ai_lb_loadgen::text::text(&header, seed, content_tokens),
                    );
                    body.push_str("}],\"max_tokens\":1,\"stream\":false}");
                    let mut c = ai_lb_e2e::envoy::HttpClient::new(pod.addr);
                    let r =
                        c.post_json("/v1/chat/completions", &[("connection", "close")], &body)?;
                    if r.status == 200 {
                        Ok("evict")
                    } else {
                        Err(format!(
                            "making {}'s prefix cache cold: the flush request got {} {}",
                            pod.name,
                            r.status,
                            r.text()
                        ))
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("cache flush thread panicked".into()))
            })
            .collect()
    });
    let how = results.into_iter().collect::<Result<Vec<_>, _>>()?;
    let reset = how.iter().filter(|h| **h == "reset").count();
    Ok(if reset == how.len() {
        "POST /reset_prefix_cache on every pod".into()
    } else {
        format!(
            "{reset} pods reset by POST /reset_prefix_cache, {} by one request of {content_tokens} unique prompt tokens filling the KV cache (LRU evicts every cached block)",
            how.len() - reset
        )
    })
}

/// Every pod's prefix-cache counters now (None for a pod without them or not answering).
pub fn cache_counters(pool: &Pool) -> Vec<(String, Option<(f64, f64)>)> {
    pool.pods
        .iter()
        .map(|p| {
            let c = ai_lb_e2e::envoy::http_get(p.addr, "/metrics")
                .ok()
                .and_then(|r| analysis::cache_counters(&r.text()));
            (p.name.clone(), c)
        })
        .collect()
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
    /// Per tag (`short`, `long`) for the HOL workload; `first_turns` / `later_turns` for
    /// multi-turn.
    pub by_tag: std::collections::BTreeMap<String, Summary>,
    /// Fault runs: share of requests sent to the faulty pod before/after the fault.
    pub fault: Option<Value>,
    /// Whether the ai-lb sidecars listed every pod before the run started.
    pub ailb_ready: Option<bool>,
    /// ai-lb only: the filter's pool-wide counters (`wasmcustom.ailb.*` except per-endpoint
    /// ones) at the end of the run, summed over the sidecars: fallbacks, fail-opens, cuts of a
    /// model server that stopped answering, breaker openings, ...
    pub filter_counters: Option<std::collections::BTreeMap<String, u64>>,
    /// Prefix-cache use over the run from the pods' own counters, or "n/a" when they have none.
    pub prefix_cache: CacheReport,
    /// How the pods' prefix caches were emptied before the run.
    pub caches_made_cold_by: Option<String>,
    /// The no-queue TTFT floor over this policy's answered and timed-out requests, ms.
    pub floor_ttft_ms: Option<Pcts>,
    /// Multi-turn: how the sessions ended.
    pub sessions: Option<Sessions>,
    /// CPU seconds spent during the run (from the first request to the last answer) by the
    /// client sidecar Envoys (summed), the collector agents (summed; they run for every
    /// policy), and for `epp` the endpoint picker: what each policy costs the cluster.
    pub cpu_s: Value,
    /// `epp`: the picker's own report (CPU per pick, its counters).
    pub epp: Option<topology::EppUsage>,
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
    // Every workload, not only the prefix-cache ones, so that each policy starts from the same
    // pod state: a cache the previous policy left full makes each new block evict one (a
    // `BlockRemoved` event on top of each `BlockStored`, through the agents to every sidecar).
    // Measured, it was not what made the same policy's p99 TTFT differ between two runs of
    // one trace (bench-results/misleading-frontend/README.md, "The bench's policy order").
    let caches_made_cold_by = Some(cold_caches(
        pool,
        env,
        &format!("{} {}", load.name, policy.name()),
    )?);
    let mut sidecars = Vec::new();
    for _ in 0..env.sidecars {
        sidecars.push(topology::start_sidecar(
            policy,
            &pool.addrs(),
            &pool.agent_addrs(),
            1,
        )?);
    }
    let ailb_ready = policy.is_ailb().then(|| {
        sidecars
            .iter()
            .all(|s| topology::wait_ailb_ready(s, &pool.addrs(), Duration::from_secs(15)))
    });
    let traces = split_trace(trace, env.sidecars, dir)?;
    let urls: Vec<SocketAddr> = sidecars.iter().map(|s| s.listener).collect();
    let counters_before = cache_counters(pool);
    let cpu_of = |pids: &[u32]| {
        pids.iter()
            .filter_map(|p| topology::cpu_secs(*p))
            .sum::<f64>()
    };
    let sidecar_pids: Vec<u32> = sidecars.iter().map(|s| s.pid()).collect();
    let agent_pids: Vec<u32> = pool
        .pods
        .iter()
        .filter_map(|p| p.agent.as_ref().map(|a| a.pid()))
        .collect();
    let cpu_before = (cpu_of(&sidecar_pids), cpu_of(&agent_pids));
    let started = Instant::now();
    // A noisy pool is noisy from the first request.
    let rates = if load.fault == Some(Fault::Noisy) {
        let r = noise_rates()?;
        eprintln!("[bench] fault-noisy: background {}, bursts {}", r.0, r.1);
        r
    } else {
        (NOISE_RATE, NOISE_BURST_RATE)
    };
    let noise = (load.fault == Some(Fault::Noisy)).then(|| {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let faulted = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let pods = pool.pods.iter().map(|p| (p.addr, p.name.clone())).collect();
        let h = start_noise(rates, pods, stop.clone(), faulted.clone());
        (stop, faulted, h)
    });
    let (mut children, rec_paths) = spawn_loadgens(env, &urls, &traces, dir, policy.name())?;
    let fault_at = Duration::from_secs_f64(env.duration_s / 2.0);
    // What reached the pods (retries hide failed attempts from the clients).
    let probe = load.fault.map(|_| {
        let admins = sidecars.iter().map(|s| s.admin).collect();
        crate::attempts::Probe::start(pool.addrs(), 0, admins, started)
    });
    let mut fault_done = false;
    let mut cut_watch = None;
    let mut flap = None;
    if let Some(f) = load.fault {
        std::thread::sleep(fault_at.saturating_sub(started.elapsed()));
        match f {
            Fault::Slowdown5x => pool.control(0, r#"{"slowdown":5}"#)?,
            Fault::Slowdown5xSilent => pool.control(0, r#"{"slowdown":5,"throttle":false}"#)?,
            Fault::Errors50 => pool.control(0, r#"{"error_rate":0.5}"#)?,
            Fault::SlowMildSilent => pool.control(0, r#"{"slowdown":2.5,"throttle":false}"#)?,
            Fault::FrontendSlow => {
                pool.control(0, &format!(r#"{{"frontend_ms":{}}}"#, frontend_ms()?))?
            }
            Fault::Sigstop => pool.pods[0].proc.sigstop()?,
            Fault::Flap => {
                pool.control(0, r#"{"error_rate":1.0}"#)?;
                let pod = &pool.pods[0];
                flap = Some(start_flap(pod.addr, pod.name.clone()));
            }
            Fault::Noisy => {
                if let Some((_, faulted, _)) = &noise {
                    faulted.store(true, std::sync::atomic::Ordering::Relaxed);
                }
                pool.control(0, r#"{"error_rate":0.5}"#)?;
            }
            Fault::Oom => {
                let text = ai_lb_e2e::envoy::http_get(pool.addrs()[0], "/metrics")?.text();
                let running = topology::gauge(&text, "vllm:num_requests_running");
                let json = oom_fault(running);
                eprintln!("[bench] fault-oom: pod 0 runs {running}: {json}");
                pool.control(0, &json)?;
            }
        }
        fault_done = true;
        // When each sidecar's routing cut the pod (a slowed pod is penalised, not cut).
        if policy.is_ailb()
            && matches!(
                f,
                Fault::Errors50 | Fault::Sigstop | Fault::Flap | Fault::Noisy | Fault::Oom
            )
        {
            cut_watch = Some(crate::attempts::CutWatch::start(
                urls.clone(),
                pool.addrs()[0].to_string(),
                started,
                Duration::from_secs(10),
            ));
        }
    }
    // Sessions that start late run their turns after the trace's span.
    let tail = match load.workload {
        Workload::MultiTurn => f64::from(TURNS.1) * (env.timeout_s + THINK_MAX_S),
        _ => env.timeout_s,
    };
    let waited = wait_all(
        &mut children,
        Duration::from_secs_f64(env.duration_s + tail + 30.0),
    );
    let attempts =
        probe.map(|p| p.finish(0, fault_at.as_secs_f64() * 1000.0, env.duration_s * 1000.0));
    if let Some((stop, _, h)) = noise {
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let _ = h.join();
        for i in 1..pool.pods.len() {
            pool.control(i, r#"{"reset":true}"#)?;
        }
    }
    if fault_done {
        match load.fault {
            Some(Fault::Sigstop) => pool.pods[0].proc.sigcont()?,
            Some(_) => pool.control(0, r#"{"reset":true}"#)?,
            None => {}
        }
    }
    let cut_ms = cut_watch.map(crate::attempts::CutWatch::finish);
    if let Some(h) = flap {
        let _ = h.join();
    }
    let filter_counters = policy.is_ailb().then(|| filter_counters(&sidecars));
    let cpu_s = json!({
        "wall_s": started.elapsed().as_secs_f64(),
        "sidecars": cpu_of(&sidecar_pids) - cpu_before.0,
        "agents": cpu_of(&agent_pids) - cpu_before.1,
    });
    drop(sidecars);
    let epp = (policy == Policy::Epp).then(topology::finish_epp).flatten();
    waited?;
    // Per sidecar (each replays its own sub-trace), then merged in id order.
    let per_sidecar = rec_paths
        .iter()
        .map(|p| read_records(std::slice::from_ref(p)))
        .collect::<Result<Vec<_>, _>>()?;
    let mut records: Vec<Record> = per_sidecar.iter().flatten().cloned().collect();
    records.sort_by_key(|r| r.id);
    pool.wait_idle(Duration::from_secs_f64(env.timeout_s + 30.0))?;
    let prefix_cache = analysis::cache_use(&counters_before, &cache_counters(pool));
    let sessions = ai_lb_loadgen::stats::sessions(&records);
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
    if load.workload == Workload::MultiTurn {
        for (name, first) in [("first_turns", true), ("later_turns", false)] {
            let sub: Vec<&Record> = records
                .iter()
                .filter(|r| (r.turn.unwrap_or(1) == 1) == first)
                .collect();
            by_tag.insert(name.to_string(), analysis::summarize(&sub, timeout_ms));
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
            prefix_cache,
            caches_made_cold_by,
            floor_ttft_ms: None,
            sessions,
            cpu_s,
            epp,
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
    run_load_into(load, env, pool, cmd, &env.out.join(&load.name))
}

/// [`run_load`], writing `summary.json` and `table.md` into `out` (a repeat's own folder:
/// [`crate::repeats`]).
pub fn run_load_into(
    load: &Load,
    env: &Env,
    pool: &mut Pool,
    cmd: &str,
    out: &Path,
) -> Result<Value, Error> {
    let dir = env.work.join(&load.name);
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let trace = dir.join("trace.jsonl");
    let capacity = workload_capacity(load.workload, env, pool)?;
    let rate = make_trace_at(load, env, capacity.rps, &trace)?;
    let models = floor::pool_models(
        &pool.pods.iter().map(|p| p.preset).collect::<Vec<_>>(),
        env.time_scale,
    )?;
    let mut results = Vec::new();
    let mut floors = std::collections::BTreeMap::new();
    for &policy in &env.policies {
        let (records, mut r) = run_policy(policy, load, env, pool, &trace, &dir)?;
        let merged = dir.join(format!("{}.jsonl", policy.name()));
        let mut f = File::create(&merged).map_err(|e| e.to_string())?;
        for rec in &records {
            let line = serde_json::to_string(rec).map_err(|e| e.to_string())?;
            writeln!(f, "{line}").map_err(|e| e.to_string())?;
        }
        let refs: Vec<&Record> = records.iter().collect();
        let fl = floor::floors(&refs, &models, floor::BLOCK_TOKENS);
        let measured = records
            .iter()
            .filter(|r| {
                matches!(
                    r.outcome,
                    ai_lb_loadgen::stats::Outcome::Ok | ai_lb_loadgen::stats::Outcome::Timeout
                )
            })
            .map(|r| &r.id);
        r.floor_ttft_ms = Some(floor::distribution(&fl, measured));
        // A request's floor depends on the trace only, so the policies agree on it.
        floors.extend(fl);
        results.push(r);
    }
    // For the plots: each request's floor, ms.
    let mut f = File::create(dir.join("floor.jsonl")).map_err(|e| e.to_string())?;
    for (id, ms) in &floors {
        writeln!(f, "{{\"id\":{id},\"floor_ms\":{ms}}}").map_err(|e| e.to_string())?;
    }
    let floor = Scenario {
        capacity,
        floor: floor::distribution(&floors, floors.keys()),
        models,
    };
    let summary = summarize_policies(load, env, rate, &floor, &results, cmd);
    write_outputs(
        out,
        &summary,
        &table(load, &results, rate, &floor, env, cmd),
    )?;
    Ok(summary)
}

/// What a scenario's table states besides the policies' results.
#[derive(Debug, Clone)]
pub struct Scenario {
    pub capacity: Capacity,
    /// The no-queue floor over every request any policy sent.
    pub floor: Pcts,
    pub models: Vec<floor::PresetModel>,
}

fn summarize_policies(
    load: &Load,
    env: &Env,
    rate: f64,
    sc: &Scenario,
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
        "capacity_rps": sc.capacity.rps,
        "capacity_source": sc.capacity.source,
        "session_rate_per_s": (load.workload == Workload::MultiTurn).then(|| loadgen_rate(load, sc.capacity.rps)),
        "workload_args": workload_args(load.workload, env),
        "floor_ttft_ms": sc.floor,
        "floor_model": {
            "presets": sc.models,
            "block_tokens": floor::BLOCK_TOKENS,
            "what": "TTFT alone on the fastest preset of the pool, prefix cached as well as possible (docs/benchmark-workloads.md)",
        },
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

/// The no-queue floor's row (TTFT columns only).
fn floor_row(f: &Pcts) -> String {
    format!(
        "| no-queue floor | {} | {} | {} | | | | | | | |\n",
        f2(f.p50),
        f2(f.p90),
        f2(f.p99)
    )
}

/// Hit rate, hit and queried tokens of one policy, or n/a.
fn cache_cells(c: &CacheReport) -> String {
    match c {
        CacheReport::Measured(u) => {
            format!("{} | {:.0} | {:.0}", pct(u.hit_rate), u.hits, u.queries)
        }
        CacheReport::NotAvailable(s) => format!("{s} | {s} | {s}"),
    }
}

/// The markdown table of one scenario (all requests; short requests for HOL; first and later
/// turns for multi-turn), with the no-queue floor and each policy's prefix-cache hit rate.
pub fn table(
    load: &Load,
    results: &[PolicyResult],
    rate: f64,
    sc: &Scenario,
    env: &Env,
    cmd: &str,
) -> String {
    let mut t = format!(
        "### {} ({:.1} req/s = {:.0}% of {:.1} req/s capacity, {} s, seed {}, timeout {} s)\n\n`{cmd}`\n\n",
        load.name,
        rate,
        load.load * 100.0,
        sc.capacity.rps,
        env.duration_s,
        env.seed,
        env.timeout_s
    );
    if load.workload.uses_prefix_cache() {
        t.push_str(&format!(
            "Capacity of this workload: {} (docs/benchmark-workloads.md).",
            sc.capacity.source
        ));
        if load.workload == Workload::MultiTurn {
            t.push_str(&format!(
                " Sessions start at {:.2}/s (mean {:.1} turns each).",
                loadgen_rate(load, sc.capacity.rps),
                mean_turns()
            ));
        }
        t.push_str("\n\n");
    }
    let mut sets: Vec<(&str, Vec<(&str, &Summary)>)> = vec![(
        "all requests",
        results.iter().map(|r| (r.policy, &r.all)).collect(),
    )];
    let sub = |tag: &str| -> Vec<(&str, &Summary)> {
        results
            .iter()
            .filter_map(|r| r.by_tag.get(tag).map(|s| (r.policy, s)))
            .collect()
    };
    if load.workload == Workload::Hol {
        sets.push(("short requests only", sub("short")));
    }
    if load.workload == Workload::MultiTurn {
        sets.push(("first turns only", sub("first_turns")));
        sets.push(("later turns only (history resent)", sub("later_turns")));
    }
    for (i, (label, rows)) in sets.into_iter().enumerate() {
        t.push_str(&format!(
            "{label}: TTFT / e2e in ms (timeouts counted at the timeout)\n\n\
             | policy | TTFT p50 | p90 | p99 | e2e p50 | p90 | p99 | timeouts | errors | out tok/s | lag p99 |\n\
             |---|---|---|---|---|---|---|---|---|---|---|\n"
        ));
        if i == 0 {
            t.push_str(&floor_row(&sc.floor));
        }
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
        if let (Some(a), Some(e)) = (get("ai_lb"), get("epp")) {
            t.push_str(&ratio_rows(a, e, "ai_lb / epp"));
        }
        if let (Some(m), Some(a)) = (get("ai_lb_learned"), get("ai_lb")) {
            t.push_str(&ratio_rows(m, a, "ai_lb_learned / ai_lb"));
        }
        if let (Some(m), Some(l)) = (get("ai_lb_learned"), get("least_request")) {
            t.push_str(&ratio_rows(m, l, "ai_lb_learned / least_request"));
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
    t.push_str(
        "\nprefix cache (pods' `vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total` over each policy's run, in tokens; n/a: the pods export no such counters)",
    );
    if let Some(how) = results
        .iter()
        .find_map(|r| r.caches_made_cold_by.as_deref())
    {
        t.push_str(&format!("; caches made cold before each policy: {how}"));
    }
    t.push_str(":\n\n| policy | hit rate | hit tokens | queried tokens |\n|---|---|---|---|\n");
    for r in results {
        t.push_str(&format!(
            "| {} | {} |\n",
            r.policy,
            cache_cells(&r.prefix_cache)
        ));
    }
    t.push_str(
        "\nCPU seconds during each run (first request to last answer): client sidecar Envoys summed, agents summed, the endpoint picker (epp only):\n\n| policy | wall s | sidecars | agents | picker | picker µs per pick |\n|---|---|---|---|---|---|\n",
    );
    for r in results {
        let e = r.epp.as_ref();
        t.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} |\n",
            r.policy,
            f1(r.cpu_s["wall_s"].as_f64()),
            f2(r.cpu_s["sidecars"].as_f64()),
            f2(r.cpu_s["agents"].as_f64()),
            e.map_or("–".to_string(), |e| f2(e.epp_cpu_s)),
            e.map_or("–".to_string(), |e| f1(e.epp_cpu_us_per_pick)),
        ));
    }
    t.push_str(&format!(
        "\nno-queue floor: TTFT alone on the fastest pod ({}), the prefix cached as well as possible; over all requests sent: p50 {} / p90 {} / p99 {} ms\n",
        sc.models
            .iter()
            .map(|m| m.preset.as_str())
            .collect::<Vec<_>>()
            .join(" or "),
        f2(sc.floor.p50),
        f2(sc.floor.p90),
        f2(sc.floor.p99)
    ));
    for r in results {
        if let Some(x) = &r.sessions {
            t.push_str(&format!(
                "\n{}: {} sessions, {} completed, {} ended early ({} turns not sent)",
                r.policy, x.sessions, x.completed, x.ended_early, x.turns_not_sent
            ));
        }
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
            if let Some(n) = a["breaker_openings_before_fault"].as_u64() {
                t.push_str(&format!(
                    "; breaker openings before the fault (any pod, all sidecars): {n}"
                ));
            }
            if let Some(ps) = a["breaker_open_pod_seconds_before_fault"].as_f64() {
                t.push_str(&format!(
                    ", pods held open before it: {ps:.1} pod-seconds (summed over sidecars)"
                ));
            }
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
        assert_eq!(parse_load("fault-noisy").unwrap().fault, Some(Fault::Noisy));
        assert_eq!(
            parse_load("misleading-slow").unwrap().fault,
            Some(Fault::SlowMildSilent)
        );
        assert_eq!(parse_load("fault-oom").unwrap().fault, Some(Fault::Oom));
        assert_eq!(
            parse_load("misleading-frontend").unwrap().fault,
            Some(Fault::FrontendSlow)
        );
        // The fault grows pod 0 at OOM_GROWTH_BYTES_PER_S at the load it has.
        let f: serde_json::Value = serde_json::from_str(&oom_fault(20.0)).unwrap();
        let g = &f["memory_growth"];
        let rate = g["bytes_per_s_per_seq"].as_f64().unwrap()
            * (20.0 - g["sustained_seqs"].as_f64().unwrap());
        assert!((rate - OOM_GROWTH_BYTES_PER_S).abs() < 1.0, "{rate}");
        let e = parse_load("sharegpt-poisson-x").unwrap_err();
        assert!(e.contains("\"x\""), "{e}");
        assert!(parse_load("nonsense").unwrap_err().contains("nonsense"));
    }

    #[test]
    fn prefix_cache_scenarios_parse() {
        let l = parse_load("prefix-bursty-60").unwrap();
        assert_eq!(
            (l.workload, l.arrival),
            (Workload::SharedPrefix, Arrival::Bursty)
        );
        assert!((l.load - 0.6).abs() < 1e-12);
        let m = parse_load("multiturn-poisson-80").unwrap();
        assert_eq!(m.workload, Workload::MultiTurn);
        assert!(m.workload.uses_prefix_cache() && !Workload::Hol.uses_prefix_cache());
        assert!(parse_load("prefix-poisson-0")
            .unwrap_err()
            .contains("\"0\""));
        assert!(parse_load("prefixes-poisson-80").is_err());
    }

    fn env() -> Env {
        Env {
            loadgen: PathBuf::from("/nonexistent"),
            work: std::env::temp_dir(),
            out: std::env::temp_dir(),
            sidecars: 4,
            duration_s: 60.0,
            timeout_s: 30.0,
            seed: 42,
            capacity_rps: 50.0,
            time_scale: 1.0,
            max_num_seqs: 8,
            kv_cache_tokens: 12_500,
            cal_rate: 30.0,
            cal_secs: 20.0,
            recalibrate: false,
            hol_count: 16,
            hol_at_s: 20.0,
            policies: Policy::ALL.to_vec(),
        }
    }

    #[test]
    fn workload_flags_are_the_loadgens_and_fit_the_pods() {
        use ai_lb_loadgen::config::Cli;
        use ai_lb_loadgen::workload::Workload as W;
        use clap::Parser;
        for w in [Workload::SharedPrefix, Workload::MultiTurn] {
            let mut args = vec!["ai-lb-loadgen".to_string()];
            args.extend(workload_args(w, &env()));
            let cli = Cli::try_parse_from(&args).unwrap();
            let (system, question_max, answer) = match cli.workload() {
                W::SharedPrefix(p) => {
                    assert_eq!(
                        (p.groups, p.system_tokens),
                        (PREFIX_GROUPS, PREFIX_SYSTEM_TOKENS)
                    );
                    assert_eq!(p.users_per_group, PREFIX_USERS);
                    (
                        p.system_tokens,
                        p.question.max,
                        p.answer.max.min(p.answer.mean as u32),
                    )
                }
                W::MultiTurn(m) => {
                    assert_eq!((m.turns_min, m.turns_max), TURNS);
                    assert_eq!(m.think.max_us, (THINK_MAX_S * 1e6) as u64);
                    // The longest conversation: system, every question at its max, answers.
                    let longest = m.system_tokens
                        + TURNS.1 * (m.question.max + 2)
                        + (TURNS.1 - 1) * (m.answer.mean as u32 + 1)
                        + 2;
                    (0, longest, m.answer.mean as u32)
                }
                other => panic!("{other:?}"),
            };
            // A request always fits one pod's KV cache.
            assert!(u64::from(system + question_max + answer + 3) < env().kv_cache_tokens);
        }
        // The shared prefix is most of the prompt; the prompt about 7x the answer (llm-d's
        // 6000 + 1200 : 1000); the prefixes of all groups about 3 pods' KV (llm-d's ratio).
        let prompt = f64::from(PREFIX_SYSTEM_TOKENS + PREFIX_QUESTION_TOKENS);
        assert!((f64::from(PREFIX_SYSTEM_TOKENS) / prompt - 6000.0 / 7200.0).abs() < 0.01);
        assert!((prompt / f64::from(PREFIX_ANSWER_TOKENS) - 7.2).abs() < 0.01);
        let all = f64::from(PREFIX_GROUPS * PREFIX_SYSTEM_TOKENS);
        assert!((all / 12_500.0 - 150.0 * 6000.0 / 307_328.0).abs() < 0.1);
    }

    #[test]
    fn multi_turn_rates_are_sessions_per_second() {
        let m = parse_load("multiturn-poisson-80").unwrap();
        assert!((loadgen_rate(&m, 100.0) - 80.0 / mean_turns()).abs() < 1e-12);
        let p = parse_load("prefix-poisson-80").unwrap();
        assert!((loadgen_rate(&p, 100.0) - 80.0).abs() < 1e-12);
    }

    fn result(policy: &'static str, cache: CacheReport) -> PolicyResult {
        PolicyResult {
            policy,
            all: Summary::default(),
            by_tag: Default::default(),
            fault: None,
            ailb_ready: None,
            filter_counters: None,
            prefix_cache: cache,
            caches_made_cold_by: Some("POST /reset_prefix_cache on every pod".into()),
            floor_ttft_ms: None,
            sessions: Some(Sessions {
                sessions: 3,
                completed: 2,
                ended_early: 1,
                turns_not_sent: 2,
            }),
            cpu_s: json!({"wall_s": 60.0, "sidecars": 12.5, "agents": 3.25}),
            epp: None,
        }
    }

    #[test]
    fn table_states_the_floor_and_hit_rates_or_not_available() {
        let load = parse_load("multiturn-poisson-80").unwrap();
        let measured = analysis::cache_use(
            &[("a".into(), Some((0.0, 0.0)))],
            &[("a".into(), Some((250.0, 1000.0)))],
        );
        let results = [
            result(
                "round_robin",
                CacheReport::NotAvailable(analysis::NOT_AVAILABLE),
            ),
            result("ai_lb", measured),
        ];
        let sc = Scenario {
            capacity: Capacity {
                rps: 40.0,
                source: "calibrate/multi-turn.json".into(),
            },
            floor: Pcts::of(vec![10.0, 20.0, 30.0]),
            models: floor::pool_models(&["h100-8b"], 1.0).unwrap(),
        };
        let t = table(&load, &results, 32.0, &sc, &env(), "cmd");
        assert!(
            t.contains("| no-queue floor | 20.00 | 30.00 | 30.00 |"),
            "{t}"
        );
        assert!(t.contains("| round_robin | n/a | n/a | n/a |"), "{t}");
        assert!(t.contains("| ai_lb | 25.00 % | 250 | 1000 |"), "{t}");
        assert!(
            t.contains("first turns only") && t.contains("later turns only"),
            "{t}"
        );
        assert!(t.contains("Sessions start at 8.00/s"), "{t}");
        assert!(
            t.contains("ai_lb: 3 sessions, 2 completed, 1 ended early"),
            "{t}"
        );
        assert!(
            !t.contains("| round_robin | 0"),
            "n/a is never written as 0"
        );
        let v = serde_json::to_value(&results[0]).unwrap();
        assert_eq!(v["prefix_cache"], "n/a");
        assert_eq!(
            serde_json::to_value(&results[1]).unwrap()["prefix_cache"]["hit_rate"],
            0.25
        );
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
