//! The three overhead figures, each from one run whose baseline (plain Envoy, least_request, the
//! same cluster) is measured in that run, the sides in alternating rounds (the order rotated
//! every round, as in `overhead`), every Envoy with 1 worker, running side by side throughout:
//!
//! - `overhead-stream`: streamed LLM answers. `pods` sinks stream `chunks` OpenAI
//!   `chat.completion.chunk` events each (`gap_ms` apart, each its own write, so each is a
//!   response-body callback of the filter), the last with `usage`, then `data: [DONE]`; requests
//!   are 2 KB chat bodies (`stream: true`). Plain Envoy's maximum for this traffic is measured
//!   first (closed loop), then every side runs an open loop at half of it: Envoy CPU per answered
//!   request, and the efficiency plain / filter per round.
//! - `overhead-epp`: the same pods and traffic, with the llm-d endpoint picker (`ai-lb-epp`
//!   behind ext_proc) as a side: every side's maximum first, then an open loop at half of the
//!   lowest; the latency each adds over plain Envoy (TTFT and e2e, p50 and p99, per round) and
//!   CPU per request, the picker's process counted for `epp`.
//! - `overhead-rps`: the trivial upstream of `overhead` (2 tokens in one write, 16-token
//!   prompts), closed loop only, enough rounds for a spread of req/s and of the ratio to plain.
//!
//! CPU is each process's user + system time (`/proc/<pid>/stat`) over the replay; on a shared
//! 2-core machine it is the steady measure, while a maximum depends on what the load generator
//! and the sinks leave Envoy.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Serialize;
use serde_json::{json, Value};

use crate::calibrate::{fixed_trace, fixed_trace_sized, ok_rps};
use crate::overhead::{measured_replay_with, median, order, pin, pin_requested, Answer, Rig, Side};
use crate::scenario::Env;
use crate::topology::{cpu_secs, Error};

/// One of the three figures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Figure {
    Stream,
    Epp,
    Rps,
}

impl Figure {
    pub const ALL: [Figure; 3] = [Figure::Stream, Figure::Epp, Figure::Rps];

    /// Its scenario name.
    pub fn scenario(self) -> &'static str {
        match self {
            Figure::Stream => "overhead-stream",
            Figure::Epp => "overhead-epp",
            Figure::Rps => "overhead-rps",
        }
    }

    pub fn parse(s: &str) -> Option<Figure> {
        Figure::ALL.into_iter().find(|f| f.scenario() == s)
    }

    /// Its folder under `<out>/overhead/`.
    pub fn dir(self) -> &'static str {
        match self {
            Figure::Stream => "stream",
            Figure::Epp => "epp",
            Figure::Rps => "rps",
        }
    }

    /// The sides besides plain Envoy when `--overhead-filter` is not given.
    pub fn default_builds(self) -> Vec<Side> {
        match self {
            Figure::Stream | Figure::Rps => vec![Side::Native, Side::Wasm],
            Figure::Epp => vec![Side::Native, Side::Wasm, Side::Epp],
        }
    }
}

/// How a figure is run.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Seconds of each measurement (one side, one round).
    pub secs: f64,
    /// Measured rounds: the open loop (stream, epp) or the closed loop (rps).
    pub rounds: usize,
    /// Closed-loop rounds that find the open loop's rate (stream, epp).
    pub max_rounds: usize,
    /// Closed-loop clients.
    pub workers: usize,
    /// Sinks, each a pod with its own agent (stream, epp; rps has one).
    pub pods: usize,
    pub chunks: u32,
    pub gap_ms: u64,
    pub prompt_tokens: u32,
    pub output_tokens: u32,
    /// The sides besides plain Envoy.
    pub builds: Vec<Side>,
}

impl Settings {
    /// The figure's defaults (a few seconds and one round each in smoke mode).
    pub fn defaults(f: Figure, smoke: bool) -> Settings {
        let streamed = f != Figure::Rps;
        // Short measurements, many rounds: the two sides of a pair run seconds apart, so the
        // load of a shared machine changes less between them.
        let mut s = Settings {
            secs: 5.0,
            rounds: match f {
                Figure::Stream => 14,
                Figure::Epp => 10,
                Figure::Rps => 12,
            },
            max_rounds: match f {
                Figure::Stream => 3,
                _ => 2,
            },
            // A streamed answer lasts about chunks × gap: the closed loop needs many clients to
            // keep Envoy busy.
            workers: if streamed { 256 } else { 16 },
            pods: if streamed { 4 } else { 1 },
            chunks: if streamed { 64 } else { 2 },
            gap_ms: if streamed { 2 } else { 0 },
            // 470 tokens of 4 characters: a 2 KB chat body (the loadgen's fixed workload).
            prompt_tokens: if streamed { 470 } else { 16 },
            output_tokens: if streamed { 64 } else { 2 },
            builds: f.default_builds(),
        };
        if smoke {
            s.secs = 2.0;
            s.rounds = 1;
            s.max_rounds = 1;
            s.workers = if streamed { 32 } else { 4 };
            s.pods = s.pods.min(2);
        }
        s
    }
}

/// One side in one round.
#[derive(Debug, Clone, Serialize)]
struct Point {
    requests: usize,
    ok: usize,
    errors: usize,
    timeouts: usize,
    ok_rps: f64,
    envoy_cpu_s: Option<f64>,
    picker_cpu_s: Option<f64>,
    /// (Envoy + picker) CPU per answered request, µs.
    cpu_us_per_request: Option<f64>,
    envoy_cpu_us_per_request: Option<f64>,
    picker_cpu_us_per_request: Option<f64>,
    ttft_p50_ms: Option<f64>,
    ttft_p99_ms: Option<f64>,
    e2e_p50_ms: Option<f64>,
    e2e_p99_ms: Option<f64>,
}

/// Per round: side key → its point.
type Rounds = Vec<BTreeMap<&'static str, Point>>;

/// Replays `trace` against each of `sides`, `rounds` times, the order rotated each round.
#[allow(clippy::too_many_arguments)]
fn phase(
    env: &Env,
    rig: &Rig,
    dir: &Path,
    name: &str,
    trace: &Path,
    args: &[&str],
    rounds: usize,
    sides: &[Side],
) -> Result<Rounds, Error> {
    let mut out = Vec::new();
    for round in 0..rounds {
        let mut row = BTreeMap::new();
        for side in order(sides, round) {
            let m = measured_replay_with(
                env,
                &rig.url(side),
                trace,
                &dir.join(format!("{}.{name}.{round}.jsonl", side.key())),
                args,
                rig.pid(side),
                rig.picker_pid(side),
            )?;
            let per = |c: Option<f64>| {
                c.filter(|_| m.summary.ok > 0)
                    .map(|c| c * 1e6 / m.summary.ok as f64)
            };
            let p = Point {
                requests: m.summary.requests,
                ok: m.summary.ok,
                errors: m.summary.errors,
                timeouts: m.summary.timeouts,
                ok_rps: ok_rps(&m.records),
                envoy_cpu_s: m.cpu_s,
                picker_cpu_s: m.picker_cpu_s,
                cpu_us_per_request: m.cpu_us_per_ok,
                envoy_cpu_us_per_request: per(m.cpu_s),
                picker_cpu_us_per_request: per(m.picker_cpu_s),
                ttft_p50_ms: m.summary.ttft_ms.p50,
                ttft_p99_ms: m.summary.ttft_ms.p99,
                e2e_p50_ms: m.summary.e2e_ms.p50,
                e2e_p99_ms: m.summary.e2e_ms.p99,
            };
            eprintln!(
                "[bench] {name} round {round} {}: {} ok, {:.0} req/s, {} µs CPU/request",
                side.key(),
                p.ok,
                p.ok_rps,
                p.cpu_us_per_request
                    .map_or("–".into(), |c| format!("{c:.1}"))
            );
            row.insert(side.key(), p);
        }
        out.push(row);
    }
    Ok(out)
}

/// Median, quartiles (linear interpolation) and range of a set of values, with the values.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Spread {
    pub n: usize,
    pub median: f64,
    pub q1: f64,
    pub q3: f64,
    pub min: f64,
    pub max: f64,
    pub values: Vec<f64>,
}

/// The spread of the finite values of `v` (None when there are none).
pub fn spread(v: &[f64]) -> Option<Spread> {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    let q = |p: f64| -> Option<f64> {
        let pos = p * (n.checked_sub(1)? as f64);
        let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
        let (a, b) = (*s.get(lo)?, *s.get(hi)?);
        Some(a + (b - a) * (pos - lo as f64))
    };
    Some(Spread {
        n,
        median: q(0.5)?,
        q1: q(0.25)?,
        q3: q(0.75)?,
        min: *s.first()?,
        max: *s.last()?,
        values: v.to_vec(),
    })
}

/// `f` of `side`'s point in every round where it has a value.
fn series(rounds: &Rounds, side: Side, f: impl Fn(&Point) -> Option<f64>) -> Vec<f64> {
    rounds
        .iter()
        .filter_map(|r| r.get(side.key()).and_then(&f))
        .collect()
}

/// Per round, `f(a's point, b's point)` where both have values.
fn paired(
    rounds: &Rounds,
    a: Side,
    b: Side,
    f: impl Fn(&Point, &Point) -> Option<f64>,
) -> Vec<f64> {
    rounds
        .iter()
        .filter_map(|r| f(r.get(a.key())?, r.get(b.key())?))
        .collect()
}

/// The median over rounds of `f` for every side.
fn medians(rounds: &Rounds, sides: &[Side], f: impl Fn(&Point) -> Option<f64>) -> Value {
    Value::Object(
        sides
            .iter()
            .map(|s| (s.key().to_string(), json!(median(series(rounds, *s, &f)))))
            .collect(),
    )
}

fn div(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b != 0.0 => Some(a / b),
        _ => None,
    }
}

/// Whether `x` meets a target: `at_least` (x ≥ target) or at most.
fn meets(x: Option<f64>, target: f64, at_least: bool) -> Value {
    x.map_or(Value::Null, |x| {
        json!(if at_least { x >= target } else { x <= target })
    })
}

/// The goal and floor of one figure's measure and whether its value meets them.
fn verdict(value: Option<f64>, goal: f64, floor: f64, at_least: bool) -> Value {
    json!({
        "value": value,
        "goal": goal,
        "floor": floor,
        "direction": if at_least { "at least" } else { "at most" },
        "goal_met": meets(value, goal, at_least),
        "floor_met": meets(value, floor, at_least),
    })
}

/// The machine's load average now (`/proc/loadavg`: 1, 5 and 15 minutes).
fn loadavg() -> Option<String> {
    let t = std::fs::read_to_string("/proc/loadavg").ok()?;
    Some(t.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
}

/// UTC now as `date -u` writes it (ISO 8601), for the report.
fn now_utc() -> Option<String> {
    let o = Command::new("date")
        .args(["-u", "+%Y-%m-%dT%H:%M:%SZ"])
        .output()
        .ok()?;
    o.status
        .success()
        .then(|| String::from_utf8_lossy(&o.stdout).trim().to_string())
}

/// The traffic a figure's sides carry, for its summary.
fn traffic(s: &Settings, streamed: bool) -> Value {
    json!({
        "pods": s.pods,
        "answer": if streamed {
            format!("{} OpenAI chat.completion.chunk SSE events per answer, {} ms apart, each its own write; the last with usage, then data: [DONE]", s.chunks, s.gap_ms)
        } else {
            format!("{} short SSE chunks, usage and [DONE] in one write", s.chunks)
        },
        "prompt_tokens": s.prompt_tokens,
        "request_body": format!("OpenAI chat: model, one user message of {} characters, max_tokens {}, stream true, stream_options.include_usage", 4 * s.prompt_tokens, s.output_tokens),
        "chunks": s.chunks,
        "gap_ms": s.gap_ms,
        "max_tokens": s.output_tokens,
    })
}

/// Runs figure `f`; returns its summary (written by [`write`]).
pub fn run(env: &Env, f: Figure, s: &Settings) -> Result<Value, Error> {
    let dir = env.work.join(f.scenario());
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let pinned = pin_requested()?;
    if pinned {
        pin(std::process::id(), 0)?;
    }
    let (load_before, started) = (loadavg(), now_utc());
    let streamed = f != Figure::Rps;
    let answer = Answer {
        chunks: s.chunks,
        gap_ms: s.gap_ms,
    };
    let rig = Rig::start(s.pods, answer, streamed, &s.builds, pinned)?;
    // The agents' CPU over the whole run: they sample the pods and push to every filter
    // whatever the traffic, so it is stated apart (ms per second), not per request.
    let agent_pids = rig.agent_pids();
    let agents_cpu = || -> Option<f64> { agent_pids.iter().map(|p| cpu_secs(*p)).sum() };
    let (agents_before, t0) = (agents_cpu(), std::time::Instant::now());
    let sides = rig.sides.clone();
    let workers = s.workers.to_string();
    let closed_args = ["--closed-loop", workers.as_str(), "--threads", "2"];
    // Enough entries that no closed loop runs out (it stops at the trace's span).
    let closed = dir.join("closed.jsonl");
    fixed_trace_sized(
        env,
        20_000.0,
        s.secs,
        s.prompt_tokens,
        s.output_tokens,
        &closed,
    )?;
    let mut v = match f {
        Figure::Stream => {
            let max = phase(
                env,
                &rig,
                &dir,
                "max",
                &closed,
                &closed_args,
                s.max_rounds,
                &[Side::Plain],
            )?;
            let plain_max = median(series(&max, Side::Plain, |p| Some(p.ok_rps)))
                .ok_or("no maximum measured")?;
            let rate = (plain_max / 2.0).max(1.0);
            let open = dir.join("open.jsonl");
            fixed_trace_sized(env, rate, s.secs, s.prompt_tokens, s.output_tokens, &open)?;
            let rounds = phase(env, &rig, &dir, "half", &open, &[], s.rounds, &sides)?;
            stream_summary(&max, plain_max, rate, &rounds, &sides)
        }
        Figure::Epp => {
            let max = phase(
                env,
                &rig,
                &dir,
                "max",
                &closed,
                &closed_args,
                s.max_rounds,
                &sides,
            )?;
            let lowest = sides
                .iter()
                .filter_map(|side| median(series(&max, *side, |p| Some(p.ok_rps))))
                .fold(f64::INFINITY, f64::min);
            if !lowest.is_finite() {
                return Err("no maximum measured".into());
            }
            let rate = (lowest / 2.0).max(1.0);
            let open = dir.join("open.jsonl");
            fixed_trace_sized(env, rate, s.secs, s.prompt_tokens, s.output_tokens, &open)?;
            let rounds = phase(env, &rig, &dir, "half", &open, &[], s.rounds, &sides)?;
            // And at a tenth of it, where no side queues for the machine's CPU: what the
            // picker's round trips add by themselves.
            let low_rate = (lowest / 10.0).max(1.0);
            let low_trace = dir.join("open-low.jsonl");
            fixed_trace_sized(
                env,
                low_rate,
                s.secs,
                s.prompt_tokens,
                s.output_tokens,
                &low_trace,
            )?;
            let low = phase(env, &rig, &dir, "tenth", &low_trace, &[], s.rounds, &sides)?;
            let mut v = epp_summary(&max, rate, &rounds, &sides);
            let mut l = epp_summary(&max, low_rate, &low, &sides);
            if let Some(o) = l.as_object_mut() {
                o.remove("max_rounds");
                o.remove("max_rps_median");
            }
            l["what"] = json!("the same at a tenth of the lowest maximum, where no side queues for the machine's CPU; CPU per request there is mostly each process's idle work (the picker's scrapes, the filter's ticks) spread over few requests, so the CPU verdict is the half-load one");
            v["low_rate"] = l;
            v["picker_totals"] = rig
                .picker_stats()
                .map_or(Value::Null, |t| t["totals"].clone());
            v
        }
        Figure::Rps => {
            // The trivial answer's trace: 16-token prompts, 2 tokens (as `overhead`).
            let trivial = dir.join("closed-trivial.jsonl");
            fixed_trace(env, 20_000.0, s.secs, &trivial)?;
            let rounds = phase(
                env,
                &rig,
                &dir,
                "closed",
                &trivial,
                &closed_args,
                s.rounds,
                &sides,
            )?;
            rps_summary(&rounds, &sides)
        }
    };
    let el = t0.elapsed().as_secs_f64();
    v["agents_cpu_ms_per_s"] = json!(agents_cpu()
        .zip(agents_before)
        .map(|(a, b)| (a - b) * 1e3 / el));
    if sides.contains(&Side::WasmB) || sides.contains(&Side::NativeB) {
        let var = |k: &str| std::env::var(k).ok();
        v["b_sides"] = json!({
            "AI_LB_WASM_B": var("AI_LB_WASM_B"),
            "AI_LB_NATIVE_B": var("AI_LB_NATIVE_B"),
            "AI_LB_BENCH_FILTER_CONFIG_B": var("AI_LB_BENCH_FILTER_CONFIG_B"),
        });
    }
    v["filter_config"] = json!(std::env::var("AI_LB_BENCH_FILTER_CONFIG").ok());
    v["figure"] = json!(f.scenario());
    v["sides"] = json!(sides.iter().map(|s| s.key()).collect::<Vec<_>>());
    v["traffic"] = traffic(s, streamed);
    v["secs_per_measurement"] = json!(s.secs);
    v["closed_loop_workers"] = json!(s.workers);
    v["pinned"] = json!(pinned);
    v["ailb_ready"] = Value::Object(rig.ready.clone());
    v["started_utc"] = json!(started);
    v["loadavg_before"] = json!(load_before);
    v["loadavg_after"] = json!(loadavg());
    v["envoy"] = json!("one Envoy 1.40 per side, 1 worker, side by side for the whole run; plain = least_request over the same sinks; ai-lb with envoy-config/filter-config.json (or $AI_LB_BENCH_FILTER_CONFIG) and agents announcing the sinks (metrics from an idle fake pod); epp = envoy-config/envoy-epp.yaml asking its own ai-lb-epp, which scrapes the sinks' idle vLLM /metrics");
    Ok(v)
}

/// The CPU-per-request efficiency (plain / build) per round, per build.
fn efficiency(rounds: &Rounds, sides: &[Side]) -> serde_json::Map<String, Value> {
    let mut m = serde_json::Map::new();
    for &b in sides.iter().filter(|s| **s != Side::Plain) {
        let per = paired(rounds, Side::Plain, b, |p, q| {
            div(p.cpu_us_per_request, q.cpu_us_per_request)
        });
        let cpu = |s: Side| median(series(rounds, s, |p| p.cpu_us_per_request));
        m.insert(
            b.key().into(),
            json!({
                "per_round": spread(&per),
                "ratio_of_medians": div(cpu(Side::Plain), cpu(b)),
                "added_us_median": cpu(b).zip(cpu(Side::Plain)).map(|(a, p)| a - p),
            }),
        );
    }
    m
}

fn latency_medians(rounds: &Rounds, sides: &[Side]) -> Value {
    json!({
        "ttft_p50_ms": medians(rounds, sides, |p| p.ttft_p50_ms),
        "ttft_p99_ms": medians(rounds, sides, |p| p.ttft_p99_ms),
        "e2e_p50_ms": medians(rounds, sides, |p| p.e2e_p50_ms),
        "e2e_p99_ms": medians(rounds, sides, |p| p.e2e_p99_ms),
    })
}

fn stream_summary(
    max: &Rounds,
    plain_max: f64,
    rate: f64,
    rounds: &Rounds,
    sides: &[Side],
) -> Value {
    let eff = efficiency(rounds, sides);
    let mut verdicts = serde_json::Map::new();
    for (side, goal, floor) in [(Side::Native, 0.97, 0.95), (Side::Wasm, 0.9, 0.85)] {
        if sides.contains(&side) {
            let x = eff[side.key()]["per_round"]["median"].as_f64();
            verdicts.insert(side.key().into(), verdict(x, goal, floor, true));
        }
    }
    json!({
        "what": "Envoy CPU (user + system) per answered request at a fixed open-loop rate of half of plain Envoy's closed-loop maximum for this traffic; efficiency = plain CPU per request / filter CPU per request, per round (same round, same trace), median and range over rounds",
        "plain_max_rps": {"median": plain_max, "per_round": series(max, Side::Plain, |p| Some(p.ok_rps))},
        "rate_rps": rate,
        "cpu_us_per_request_median": medians(rounds, sides, |p| p.cpu_us_per_request),
        "efficiency": eff,
        "latency": latency_medians(rounds, sides),
        "ok_median": medians(rounds, sides, |p| Some(p.ok as f64)),
        "failed_total": sides.iter().map(|s| (s.key().to_string(), json!(series(rounds, *s, |p| Some((p.errors + p.timeouts) as f64)).iter().sum::<f64>()))).collect::<serde_json::Map<_, _>>(),
        "verdicts": verdicts,
        "max_rounds": max,
        "rounds": rounds,
    })
}

/// The latency measures of the epp figure: (name, field).
type Measure = (&'static str, fn(&Point) -> Option<f64>);
const LATENCY: [Measure; 4] = [
    ("ttft_p50", |p| p.ttft_p50_ms),
    ("ttft_p99", |p| p.ttft_p99_ms),
    ("e2e_p50", |p| p.e2e_p50_ms),
    ("e2e_p99", |p| p.e2e_p99_ms),
];

fn epp_summary(max: &Rounds, rate: f64, rounds: &Rounds, sides: &[Side]) -> Value {
    // Added latency over plain, µs, per side and measure, per round.
    let mut added = serde_json::Map::new();
    for &b in sides.iter().filter(|s| **s != Side::Plain) {
        let mut m = serde_json::Map::new();
        for (name, f) in LATENCY {
            let per = paired(rounds, b, Side::Plain, |q, p| {
                Some((f(q)? - f(p)?) * 1000.0)
            });
            m.insert(name.into(), json!(spread(&per)));
        }
        added.insert(b.key().into(), Value::Object(m));
    }
    let mut vs_epp = serde_json::Map::new();
    let mut verdicts = serde_json::Map::new();
    if sides.contains(&Side::Epp) {
        for &b in sides.iter().filter(|s| {
            !matches!(
                s,
                Side::Plain | Side::Epp | Side::EmptyWasm | Side::EmptyNative
            )
        }) {
            let mut m = serde_json::Map::new();
            // The worst of the TTFT ratios (the latency the pick adds before the first token)
            // and, apart, of the e2e ones (the response path's: ext_proc echoes every chunk).
            // None: no measure yet; Some(None): one was undefined.
            let (mut worst_ttft, mut worst_e2e): (Option<Option<f64>>, Option<Option<f64>>) =
                (None, None);
            for (name, f) in LATENCY {
                let med = |s: Side| added[s.key()][name]["median"].as_f64();
                // Undefined where epp added nothing measurable; ai-lb faster than plain is 0.
                let r = match (med(b), med(Side::Epp)) {
                    (Some(a), Some(e)) if e > 0.0 => Some(a.max(0.0) / e),
                    _ => None,
                };
                let per: Vec<f64> = rounds
                    .iter()
                    .filter_map(|r| {
                        let (q, e) = (r.get(b.key())?, r.get(Side::Epp.key())?);
                        let p = r.get(Side::Plain.key())?;
                        div(Some(f(q)? - f(p)?), Some(f(e)? - f(p)?))
                    })
                    .collect();
                m.insert(
                    format!("added_{name}_ratio"),
                    json!({"ratio_of_median_added": r, "per_round": per}),
                );
                // An undefined ratio makes the worst unknown.
                let worst = if name.starts_with("ttft") {
                    &mut worst_ttft
                } else {
                    &mut worst_e2e
                };
                *worst = match (*worst, r) {
                    (Some(Some(w)), Some(x)) => Some(Some(w.max(x))),
                    (None, x) => Some(x),
                    _ => Some(None),
                };
            }
            let cpu_per = paired(rounds, b, Side::Epp, |q, e| {
                div(q.cpu_us_per_request, e.cpu_us_per_request)
            });
            let cpu = spread(&cpu_per);
            m.insert("cpu_ratio".into(), json!(cpu));
            // What each adds to plain Envoy's own CPU per request, ai-lb's over epp's.
            let added_cpu: Vec<f64> = rounds
                .iter()
                .filter_map(|r| {
                    let (q, e) = (r.get(b.key())?, r.get(Side::Epp.key())?);
                    let p = r.get(Side::Plain.key())?.cpu_us_per_request?;
                    div(
                        Some(q.cpu_us_per_request? - p),
                        Some(e.cpu_us_per_request? - p),
                    )
                })
                .collect();
            m.insert("added_cpu_ratio".into(), json!(spread(&added_cpu)));
            verdicts.insert(
                b.key().into(),
                json!({
                    "added_ttft_ratio_worst_of_p50_p99": verdict(worst_ttft.flatten(), 0.1, 0.3, false),
                    "added_e2e_ratio_worst_of_p50_p99": verdict(worst_e2e.flatten(), 0.1, 0.3, false),
                    "cpu_ratio": verdict(cpu.map(|c| c.median), 0.3, 0.5, false),
                }),
            );
            vs_epp.insert(b.key().into(), Value::Object(m));
        }
    }
    json!({
        "what": "open loop at half of the lowest closed-loop maximum among the sides: the latency each side adds over plain Envoy (median over rounds of side minus plain in the same round, µs), ai-lb's added latency / epp's, and CPU per answered request with the picker's process counted for epp (ai-lb Envoy / (epp Envoy + picker), per round)",
        "max_rps_median": medians(max, sides, |p| Some(p.ok_rps)),
        "rate_rps": rate,
        "cpu_us_per_request_median": medians(rounds, sides, |p| p.cpu_us_per_request),
        "envoy_cpu_us_per_request_median": medians(rounds, sides, |p| p.envoy_cpu_us_per_request),
        "picker_cpu_us_per_request_median": medians(rounds, &[Side::Epp], |p| p.picker_cpu_us_per_request),
        "latency": latency_medians(rounds, sides),
        "added_us": added,
        "vs_epp": vs_epp,
        "plain_cpu_over_epp": spread(&paired(rounds, Side::Plain, Side::Epp, |p, e| div(p.cpu_us_per_request, e.cpu_us_per_request))),
        "efficiency_vs_plain": efficiency(rounds, sides),
        "failed_total": sides.iter().map(|s| (s.key().to_string(), json!(series(rounds, *s, |p| Some((p.errors + p.timeouts) as f64)).iter().sum::<f64>()))).collect::<serde_json::Map<_, _>>(),
        "verdicts": verdicts,
        "max_rounds": max,
        "rounds": rounds,
    })
}

fn rps_summary(rounds: &Rounds, sides: &[Side]) -> Value {
    let mut per_side = serde_json::Map::new();
    for &s in sides {
        per_side.insert(
            s.key().into(),
            json!({
                "ok_rps": spread(&series(rounds, s, |p| Some(p.ok_rps))),
                "cpu_us_per_request": spread(&series(rounds, s, |p| p.cpu_us_per_request)),
            }),
        );
    }
    let mut vs = serde_json::Map::new();
    let mut verdicts = serde_json::Map::new();
    for &b in sides.iter().filter(|s| **s != Side::Plain) {
        let r = paired(rounds, b, Side::Plain, |q, p| {
            div(Some(q.ok_rps), Some(p.ok_rps))
        });
        let r = spread(&r);
        let goal = match b {
            Side::Native => Some(0.9),
            Side::Wasm => Some(0.7),
            _ => None,
        };
        if let Some(g) = goal {
            verdicts.insert(
                b.key().into(),
                json!({"value": r.as_ref().map(|r| r.median), "goal": g, "direction": "at least",
                       "goal_met": meets(r.as_ref().map(|r| r.median), g, true)}),
            );
        }
        vs.insert(
            b.key().into(),
            json!({
                "rps_ratio": r,
                "cpu_efficiency": spread(&paired(rounds, Side::Plain, b, |p, q| div(p.cpu_us_per_request, q.cpu_us_per_request))),
            }),
        );
    }
    json!({
        "what": "closed loop of trivial requests (16-token prompts, 2 tokens in one write, one pod): answered req/s per side per round, and each build's req/s / plain's in the same round; spread over rounds (median, quartiles, range)",
        "per_side": per_side,
        "vs_least_request": vs,
        "verdicts": verdicts,
        "rounds": rounds,
    })
}

/// Writes figure `f`'s `summary.json` and `table.md` under `<out>/overhead/<dir>/`, then
/// `<out>/overhead/figures.md` from every figure's summary there.
pub fn write(out: &Path, f: Figure, v: &Value) -> Result<(), Error> {
    let dir = out.join("overhead").join(f.dir());
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let text = serde_json::to_string_pretty(v).map_err(|e| e.to_string())?;
    std::fs::write(dir.join("summary.json"), text).map_err(|e| e.to_string())?;
    std::fs::write(dir.join("table.md"), table(f, v)).map_err(|e| e.to_string())?;
    let mut md = String::from(
        "# Overhead: the three figures\n\nWritten by `ai-lb-bench` from `overhead/{stream,epp,rps}/summary.json` (each figure one run, its baseline measured in that run; plot: `figures.png`, by `tests/bench/plot.py`).\n\n",
    );
    for g in Figure::ALL {
        let p = out.join("overhead").join(g.dir()).join("summary.json");
        if let Some(s) = std::fs::read_to_string(&p)
            .ok()
            .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        {
            md += &table(g, &s);
            md += "\n";
        }
    }
    std::fs::write(out.join("overhead/figures.md"), md).map_err(|e| e.to_string())
}

fn num(x: &Value, decimals: usize) -> String {
    x.as_f64()
        .map_or("–".to_string(), |v| format!("{v:.decimals$}"))
}

/// `median (min–max)` of a [`Spread`] as JSON.
fn spread_text(x: &Value, decimals: usize) -> String {
    if x.is_null() {
        return "–".into();
    }
    format!(
        "{} ({}–{})",
        num(&x["median"], decimals),
        num(&x["min"], decimals),
        num(&x["max"], decimals)
    )
}

fn met(v: &Value) -> &'static str {
    match (v["goal_met"].as_bool(), v["floor_met"].as_bool()) {
        (Some(true), _) => "goal met",
        (Some(false), Some(true)) => "floor met, goal missed",
        (Some(false), Some(false)) => "**floor missed**",
        (Some(false), None) => "**goal missed**",
        _ => "–",
    }
}

fn header(v: &Value) -> String {
    format!(
        "`{}` ({}; {} s per measurement; load average {} before, {} after{})\n\n",
        v["command"].as_str().unwrap_or(""),
        v["started_utc"].as_str().unwrap_or("?"),
        v["secs_per_measurement"],
        v["loadavg_before"].as_str().unwrap_or("?"),
        v["loadavg_after"].as_str().unwrap_or("?"),
        if v["pinned"] == json!(true) {
            "; each Envoy and the picker on CPU 1"
        } else {
            ""
        },
    )
}

fn sides_of(v: &Value) -> Vec<String> {
    v["sides"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

/// The epp figure's tables for one open-loop phase: per side, then each ai-lb build against
/// epp (with the CPU columns when `cpu`).
fn epp_phase_table(v: &Value, sides: &[String], builds: &[&String], cpu: bool) -> String {
    let mut t = String::from("| side | added TTFT p50 / p99 µs | added e2e p50 / p99 µs |");
    t += if cpu {
        " CPU per request µs (Envoy + picker) |\n|---|---|---|---|\n"
    } else {
        "\n|---|---|---|\n"
    };
    for s in sides {
        let a = &v["added_us"][s.as_str()];
        t += &format!(
            "| {s} | {} / {} | {} / {} |",
            num(&a["ttft_p50"]["median"], 0),
            num(&a["ttft_p99"]["median"], 0),
            num(&a["e2e_p50"]["median"], 0),
            num(&a["e2e_p99"]["median"], 0),
        );
        if cpu {
            t += &format!(
                " {} ({} + {}) |",
                num(&v["cpu_us_per_request_median"][s.as_str()], 1),
                num(&v["envoy_cpu_us_per_request_median"][s.as_str()], 1),
                num(&v["picker_cpu_us_per_request_median"][s.as_str()], 1),
            );
        }
        t += "\n";
    }
    t += "\n| ai-lb build | added TTFT / epp's: p50, p99 | goal ≤ 0.1, floor ≤ 0.3 | added e2e / epp's: p50, p99 | goal ≤ 0.1, floor ≤ 0.3 |";
    t += if cpu {
        " CPU / epp's (Envoy + picker), median (min–max) | goal ≤ 0.3, floor ≤ 0.5 | added CPU / epp's added |\n|---|---|---|---|---|---|---|---|\n"
    } else {
        "\n|---|---|---|---|---|\n"
    };
    for b in builds {
        let x = &v["vs_epp"][b.as_str()];
        if x.is_null() {
            continue;
        }
        let r = |m: &str| num(&x[format!("added_{m}_ratio")]["ratio_of_median_added"], 3);
        let vd = &v["verdicts"][b.as_str()];
        t += &format!(
            "| {b} | {}, {} | {} | {}, {} | {} |",
            r("ttft_p50"),
            r("ttft_p99"),
            met(&vd["added_ttft_ratio_worst_of_p50_p99"]),
            r("e2e_p50"),
            r("e2e_p99"),
            met(&vd["added_e2e_ratio_worst_of_p50_p99"]),
        );
        if cpu {
            t += &format!(
                " {} | {} | {} |",
                spread_text(&x["cpu_ratio"], 3),
                met(&vd["cpu_ratio"]),
                spread_text(&x["added_cpu_ratio"], 3),
            );
        }
        t += "\n";
    }
    t
}

/// One figure's markdown section.
fn table(f: Figure, v: &Value) -> String {
    let sides = sides_of(v);
    let builds: Vec<&String> = sides.iter().filter(|s| *s != "least_request").collect();
    let mut t = String::new();
    match f {
        Figure::Stream => {
            t += &format!(
                "## 1. Streamed LLM answers: CPU per request\n\n{}{}, {} pods; plain Envoy's closed-loop maximum {} req/s (per round {}); open loop at **{} req/s**, {} rounds.\n\n",
                header(v),
                v["traffic"]["answer"].as_str().unwrap_or(""),
                v["traffic"]["pods"],
                num(&v["plain_max_rps"]["median"], 0),
                v["plain_max_rps"]["per_round"].as_array().map(|a| a.iter().map(|x| num(x, 0)).collect::<Vec<_>>().join(", ")).unwrap_or_default(),
                num(&v["rate_rps"], 0),
                v["rounds"].as_array().map_or(0, Vec::len),
            );
            t += "| side | Envoy CPU per request, µs (median) | efficiency plain / side, median (min–max) over rounds | goal / floor | verdict | e2e p50 / p99 ms | failed |\n|---|---|---|---|---|---|---|\n";
            for s in &sides {
                let e = &v["efficiency"][s.as_str()];
                let vd = &v["verdicts"][s.as_str()];
                t += &format!(
                    "| {s} | {} | {} | {} | {} | {} / {} | {} |\n",
                    num(&v["cpu_us_per_request_median"][s.as_str()], 1),
                    if s == "least_request" {
                        "1 (baseline)".into()
                    } else {
                        spread_text(&e["per_round"], 3)
                    },
                    if vd.is_null() {
                        "–".into()
                    } else {
                        format!("≥ {} / ≥ {}", vd["goal"], vd["floor"])
                    },
                    met(vd),
                    num(&v["latency"]["e2e_p50_ms"][s.as_str()], 1),
                    num(&v["latency"]["e2e_p99_ms"][s.as_str()], 1),
                    num(&v["failed_total"][s.as_str()], 0),
                );
            }
        }
        Figure::Epp => {
            t += &format!(
                "## 2. Against the ext_proc endpoint picker (epp)\n\n{}{}, {} pods; closed-loop maxima (median) {}; open loop at **{} req/s** (half of the lowest), {} rounds.\n\n",
                header(v),
                v["traffic"]["answer"].as_str().unwrap_or(""),
                v["traffic"]["pods"],
                sides.iter().map(|s| format!("{s} {}", num(&v["max_rps_median"][s.as_str()], 0))).collect::<Vec<_>>().join(", "),
                num(&v["rate_rps"], 0),
                v["rounds"].as_array().map_or(0, Vec::len),
            );
            t += &epp_phase_table(v, &sides, &builds, true);
            t += &format!(
                "\nPlain Envoy's CPU per request / epp's (the least any filter's ratio can be here): {}. ai-lb's agents (one per pod, in no Envoy's CPU above; the picker's scrapes are in its CPU): {} ms CPU per second, all {} together, over the run.\n",
                spread_text(&v["plain_cpu_over_epp"], 3),
                num(&v["agents_cpu_ms_per_s"], 1),
                v["traffic"]["pods"],
            );
            t += &format!(
                "\nAt {} req/s (a tenth of the lowest maximum), {} rounds: latency only (CPU per request there is mostly idle work spread over few requests).\n\n",
                num(&v["low_rate"]["rate_rps"], 0),
                v["low_rate"]["rounds"].as_array().map_or(0, Vec::len),
            );
            t += &epp_phase_table(&v["low_rate"], &sides, &builds, false);
        }
        Figure::Rps => {
            t += &format!(
                "## 3. Trivial upstream: req/s\n\n{}closed loop, {} clients, {} rounds.\n\n",
                header(v),
                v["closed_loop_workers"],
                v["rounds"].as_array().map_or(0, Vec::len),
            );
            t += "| side | req/s median (IQR; min–max) | / plain, median (IQR; min–max) | goal | verdict | CPU per request µs, median |\n|---|---|---|---|---|---|\n";
            for s in &sides {
                let r = &v["per_side"][s.as_str()]["ok_rps"];
                let x = &v["vs_least_request"][s.as_str()]["rps_ratio"];
                let vd = &v["verdicts"][s.as_str()];
                let iqr = |x: &Value, d: usize| {
                    if x.is_null() {
                        "–".to_string()
                    } else {
                        format!(
                            "{} ({}–{}; {}–{})",
                            num(&x["median"], d),
                            num(&x["q1"], d),
                            num(&x["q3"], d),
                            num(&x["min"], d),
                            num(&x["max"], d)
                        )
                    }
                };
                t += &format!(
                    "| {s} | {} | {} | {} | {} | {} |\n",
                    iqr(r, 0),
                    if s == "least_request" {
                        "1 (baseline)".into()
                    } else {
                        iqr(x, 3)
                    },
                    if vd.is_null() {
                        "–".into()
                    } else {
                        format!("≥ {}", vd["goal"])
                    },
                    met(vd),
                    num(
                        &v["per_side"][s.as_str()]["cpu_us_per_request"]["median"],
                        1
                    ),
                );
            }
        }
    }
    t
}

/// Smoke check: every side of every round answered something.
pub fn check(v: &Value) -> Result<(), Error> {
    let mut all: Vec<&Value> = Vec::new();
    for k in ["rounds", "max_rounds"] {
        all.extend(v[k].as_array().into_iter().flatten());
    }
    all.extend(v["low_rate"]["rounds"].as_array().into_iter().flatten());
    if all.is_empty() {
        return Err(format!("smoke: {} measured nothing", v["figure"]));
    }
    for r in all {
        for (side, p) in r.as_object().into_iter().flatten() {
            if p["ok"].as_u64().unwrap_or(0) == 0 {
                return Err(format!(
                    "smoke: {}/{side} answered nothing: {p}",
                    v["figure"]
                ));
            }
        }
    }
    Ok(())
}

/// Where a figure's records are (for the plots): `<work>/<scenario>/`.
pub fn work_dir(work: &Path, f: Figure) -> PathBuf {
    work.join(f.scenario())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_has_quartiles_by_interpolation_and_keeps_the_values() {
        let s = spread(&[5.0, 1.0, 3.0, 2.0, 4.0]).unwrap();
        assert_eq!(
            (s.n, s.median, s.q1, s.q3, s.min, s.max),
            (5, 3.0, 2.0, 4.0, 1.0, 5.0)
        );
        assert_eq!(s.values, vec![5.0, 1.0, 3.0, 2.0, 4.0]);
        let s = spread(&[1.0, 2.0]).unwrap();
        assert_eq!((s.median, s.q1, s.q3), (1.5, 1.25, 1.75));
        assert_eq!(spread(&[f64::NAN]), None);
        assert_eq!(spread(&[]), None);
    }

    #[test]
    fn figures_parse_by_scenario_name() {
        for f in Figure::ALL {
            assert_eq!(Figure::parse(f.scenario()), Some(f));
        }
        assert_eq!(Figure::parse("overhead"), None);
        assert!(Figure::Epp.default_builds().contains(&Side::Epp));
    }

    #[test]
    fn verdicts_read_the_direction() {
        let v = verdict(Some(0.96), 0.97, 0.95, true);
        assert_eq!(
            (v["goal_met"].as_bool(), v["floor_met"].as_bool()),
            (Some(false), Some(true))
        );
        assert_eq!(met(&v), "floor met, goal missed");
        let v = verdict(Some(0.2), 0.1, 0.3, false);
        assert_eq!(met(&v), "floor met, goal missed");
        assert_eq!(met(&verdict(Some(0.05), 0.1, 0.3, false)), "goal met");
        assert_eq!(met(&verdict(None, 0.1, 0.3, false)), "–");
    }

    fn point(cpu: f64, ttft: f64, rps: f64) -> Point {
        Point {
            requests: 10,
            ok: 10,
            errors: 0,
            timeouts: 0,
            ok_rps: rps,
            envoy_cpu_s: None,
            picker_cpu_s: None,
            cpu_us_per_request: Some(cpu),
            envoy_cpu_us_per_request: Some(cpu),
            picker_cpu_us_per_request: None,
            ttft_p50_ms: Some(ttft),
            ttft_p99_ms: Some(ttft * 2.0),
            e2e_p50_ms: Some(ttft * 10.0),
            e2e_p99_ms: Some(ttft * 20.0),
        }
    }

    #[test]
    fn the_epp_figure_divides_added_latency_and_cpu_in_the_same_round() {
        let sides = [Side::Plain, Side::Native, Side::Epp];
        let rounds: Rounds = (0..3)
            .map(|_| {
                BTreeMap::from([
                    ("least_request", point(100.0, 1.0, 100.0)),
                    ("ai_lb_native", point(105.0, 1.05, 100.0)),
                    ("epp", point(300.0, 2.0, 100.0)),
                ])
            })
            .collect();
        let v = epp_summary(&rounds, 50.0, &rounds, &sides);
        let r = v["vs_epp"]["ai_lb_native"]["added_ttft_p50_ratio"]["ratio_of_median_added"]
            .as_f64()
            .unwrap();
        assert!((r - 0.05).abs() < 1e-9, "{r}");
        let c = v["vs_epp"]["ai_lb_native"]["cpu_ratio"]["median"]
            .as_f64()
            .unwrap();
        assert!((c - 0.35).abs() < 1e-9, "{c}");
        assert_eq!(
            v["verdicts"]["ai_lb_native"]["cpu_ratio"]["floor_met"],
            true
        );
        assert_eq!(
            v["verdicts"]["ai_lb_native"]["cpu_ratio"]["goal_met"],
            false
        );
        let t = table(
            Figure::Epp,
            &json!({"sides": ["least_request", "ai_lb_native", "epp"]}),
        );
        assert!(t.contains("| epp |"), "{t}");
    }

    #[test]
    fn a_latency_ratio_is_undefined_where_epp_added_nothing() {
        let sides = [Side::Plain, Side::Native, Side::Epp];
        let rounds: Rounds = vec![BTreeMap::from([
            ("least_request", point(100.0, 2.0, 100.0)),
            ("ai_lb_native", point(105.0, 1.0, 100.0)),
            ("epp", point(300.0, 1.5, 100.0)),
        ])];
        let v = epp_summary(&rounds, 50.0, &rounds, &sides);
        let x = &v["vs_epp"]["ai_lb_native"]["added_ttft_p50_ratio"]["ratio_of_median_added"];
        assert!(x.is_null(), "{x}");
        let vd = &v["verdicts"]["ai_lb_native"]["added_ttft_ratio_worst_of_p50_p99"];
        assert_eq!(met(vd), "–", "{vd}");
    }

    #[test]
    fn the_rps_figure_states_a_spread_of_per_round_ratios() {
        let sides = [Side::Plain, Side::Wasm];
        let rounds: Rounds = [(100.0, 70.0), (110.0, 66.0), (90.0, 72.0)]
            .iter()
            .map(|(p, w)| {
                BTreeMap::from([
                    ("least_request", point(10.0, 1.0, *p)),
                    ("ai_lb", point(14.0, 1.0, *w)),
                ])
            })
            .collect();
        let v = rps_summary(&rounds, &sides);
        let r = &v["vs_least_request"]["ai_lb"]["rps_ratio"];
        assert_eq!(r["n"], 3);
        assert!((r["median"].as_f64().unwrap() - 0.7).abs() < 1e-9, "{r}");
        assert!((r["min"].as_f64().unwrap() - 0.6).abs() < 1e-9, "{r}");
        assert!((r["max"].as_f64().unwrap() - 0.8).abs() < 1e-9, "{r}");
        assert_eq!(v["verdicts"]["ai_lb"]["goal_met"], true);
    }
}
