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
//!   also the Envoy process's CPU time (user + system, `/proc/<pid>/stat`) per answered
//!   request over that loop. On a shared 2-core machine a closed loop's maximum depends on
//!   how much CPU the load generator and the other processes leave Envoy; CPU per request
//!   does not so much;
//! - at 50 % load: an open loop at half of the filter's own measured maximum (the lower of the
//!   two), `secs` each, the same trace for both, and straight to the sink for the floor of
//!   the loop itself: CPU per request (the steadiest measure of what the filter costs per
//!   request) and the latency the filter adds at a load its Envoy keeps up with;
//! - the same at half of plain Envoy's maximum, where the filter's Envoy is near
//!   its own maximum when the filter halves it (kept for comparison with earlier reports);
//! - with no traffic at all: each Envoy's own CPU per second (the filter's ticks and agent
//!   stream), which every sidecar pays however few requests it carries.
//!
//! `--overhead-chunks N --overhead-chunk-gap-ms G` makes the sink stream N chunks G ms apart,
//! each its own write, so every chunk is a response-body callback of the filter, as with a
//! model server streaming tokens (the default answers 2 chunks in one write).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{json, Value};

use crate::analysis::{self, Summary};
use ai_lb_loadgen::stats::{Outcome, Record};

use crate::calibrate::{fixed_trace, ok_rps, replay};
use crate::scenario::Env;
use crate::topology::{self, Error, PodShape, Policy, Pool};

/// `AI_LB_BENCH_OVERHEAD_PIN=1`: the harness and every process it starts (load generator,
/// sink, agent, fake pod) run on CPU 0 and each Envoy under test (all its threads) on CPU 1,
/// so an Envoy does not share its core with the load that measures it (Linux, `taskset`).
/// Unset or 0: no pinning (the default; the report's figures).
pub(crate) fn pin_requested() -> Result<bool, Error> {
    parse_pin(std::env::var("AI_LB_BENCH_OVERHEAD_PIN").ok().as_deref())
}

fn parse_pin(v: Option<&str>) -> Result<bool, Error> {
    match v {
        None | Some("") | Some("0") => Ok(false),
        Some("1") => Ok(true),
        Some(other) => Err(format!(
            "AI_LB_BENCH_OVERHEAD_PIN={other:?}: expected 0 or 1"
        )),
    }
}

/// Moves every thread of process `pid` to CPU `cpu` (`taskset -a -cp`).
pub(crate) fn pin(pid: u32, cpu: u32) -> Result<(), Error> {
    let st = Command::new("taskset")
        .args(["-a", "-cp", &cpu.to_string(), &pid.to_string()])
        .stdout(Stdio::null())
        .status()
        .map_err(|e| format!("AI_LB_BENCH_OVERHEAD_PIN=1 needs taskset: {e}"))?;
    if st.success() {
        Ok(())
    } else {
        Err(format!("taskset -a -cp {cpu} {pid}: {st}"))
    }
}

/// CPU seconds (user + system) process `pid` has used so far, from `/proc/<pid>/stat`
/// (fields 14 and 15, in clock ticks of 1/100 s: Linux's USER_HZ). None off Linux or when
/// the process is gone.
fn cpu_secs(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces: count after it.
    let rest = stat.get(stat.rfind(')')? + 1..)?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok());
    // `rest` starts at field 3 (state): utime is field 14, stime field 15.
    Some((ticks(11)? + ticks(12)?) as f64 / 100.0)
}

/// One measured replay: the loadgen's summary and records, the Envoy process's CPU seconds over
/// it, the picker's (for `epp`), and their CPU microseconds per answered request together.
pub(crate) struct Measured {
    pub summary: Summary,
    pub records: Vec<Record>,
    pub cpu_s: Option<f64>,
    /// The endpoint picker's CPU seconds over the replay (`epp` only).
    pub picker_cpu_s: Option<f64>,
    /// (Envoy + picker) CPU per answered request, µs.
    pub cpu_us_per_ok: Option<f64>,
}

/// Replays `trace` against `url` (args passed to the loadgen), reading Envoy `pid`'s CPU time
/// before and after.
fn measured_replay(
    env: &Env,
    url: &str,
    trace: &Path,
    out: &Path,
    args: &[&str],
    pid: u32,
) -> Result<Measured, Error> {
    measured_replay_with(env, url, trace, out, args, pid, None)
}

/// [`measured_replay`], also reading the CPU time of the picker process `picker` (the `epp`
/// side's ext_proc server) and counting it in the CPU per request.
pub(crate) fn measured_replay_with(
    env: &Env,
    url: &str,
    trace: &Path,
    out: &Path,
    args: &[&str],
    pid: u32,
    picker: Option<u32>,
) -> Result<Measured, Error> {
    let before = cpu_secs(pid);
    let picker_before = picker.and_then(cpu_secs);
    let (summary, records) = replay(env, url, trace, &out.to_path_buf(), args)?;
    let cpu_s = cpu_secs(pid).zip(before).map(|(a, b)| a - b);
    let picker_cpu_s = picker
        .and_then(cpu_secs)
        .zip(picker_before)
        .map(|(a, b)| a - b);
    let total = match (cpu_s, picker, picker_cpu_s) {
        (Some(c), None, _) => Some(c),
        (Some(c), Some(_), Some(p)) => Some(c + p),
        _ => None,
    };
    let ok = records.iter().filter(|r| r.outcome == Outcome::Ok).count();
    let cpu_us_per_ok = total.filter(|_| ok > 0).map(|c| c * 1e6 / ok as f64);
    Ok(Measured {
        summary,
        records,
        cpu_s,
        picker_cpu_s,
        cpu_us_per_ok,
    })
}

/// Median of `v` (None when empty).
pub(crate) fn median(mut v: Vec<f64>) -> Option<f64> {
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

/// One Envoy of the overhead run: plain least_request, or ai-lb in one of its builds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Plain,
    /// The shipped proxy-wasm filter.
    Wasm,
    /// The experimental native dynamic module (filter/native, envoy-config/envoy-native.yaml)
    /// with the same plugin config.
    Native,
    /// A second build of the wasm filter (`$AI_LB_WASM_B`) and/or a second plugin config
    /// (`$AI_LB_BENCH_FILTER_CONFIG_B`): to compare a change against the build or config before
    /// it in one run, where round-to-round noise hits both alike.
    WasmB,
    /// The same for the native module (`$AI_LB_NATIVE_B`, `$AI_LB_BENCH_FILTER_CONFIG_B`).
    NativeB,
    /// A proxy-wasm filter that does nothing (tests/bench/empty-wasm) in front of plain
    /// least_request: the floor of any proxy-wasm filter, not an ai-lb build.
    EmptyWasm,
    /// An Envoy dynamic module that does nothing (tests/bench/empty-native) where the native
    /// module goes (envoy-native.yaml, the same override_host cluster): the floor of any
    /// dynamic module in that template, not an ai-lb build.
    EmptyNative,
    /// The llm-d endpoint picker baseline: Envoy with ext_proc asking its own `ai-lb-epp`
    /// (envoy-config/envoy-epp.yaml); its CPU counts the picker's. Not in `overhead`, whose
    /// sink is a single pod.
    Epp,
}

impl Side {
    /// Its key in the summary.
    pub fn key(self) -> &'static str {
        match self {
            Side::Plain => "least_request",
            Side::Wasm => "ai_lb",
            Side::Native => "ai_lb_native",
            Side::WasmB => "ai_lb_b",
            Side::NativeB => "ai_lb_native_b",
            Side::EmptyWasm => "empty_wasm",
            Side::EmptyNative => "empty_native",
            Side::Epp => "epp",
        }
    }

    /// The filters of `--overhead-filter` (`wasm`, `wasm-b`, `native`, `native-b`, `empty-wasm`,
    /// `empty-native`, `epp`, comma-separated); errors name the flag and the value.
    pub fn parse_builds(s: &str) -> Result<Vec<Side>, Error> {
        let mut out = Vec::new();
        for part in s.split(',').map(str::trim) {
            let side = match part {
                "wasm" => Side::Wasm,
                "native" => Side::Native,
                "wasm-b" => Side::WasmB,
                "native-b" => Side::NativeB,
                "empty-wasm" => Side::EmptyWasm,
                "empty-native" => Side::EmptyNative,
                "epp" => Side::Epp,
                other => {
                    return Err(format!(
                        "--overhead-filter: value {other:?}: expected `wasm`, `wasm-b`, `native`, `native-b`, `empty-wasm`, `empty-native` or `epp`, comma-separated (e.g. `wasm,native`)"
                    ))
                }
            };
            if out.contains(&side) {
                return Err(format!("--overhead-filter: value {s:?}: `{part}` twice"));
            }
            out.push(side);
        }
        Ok(out)
    }
}

/// What every open-loop phase of [`overhead`] shares.
struct Ctx<'a> {
    env: &'a Env,
    dir: &'a Path,
    secs: f64,
    rounds: usize,
    sink: std::net::SocketAddr,
    /// Plain first, then the builds.
    sides: &'a [Side],
    url: &'a dyn Fn(Side) -> String,
    pid: &'a dyn Fn(Side) -> u32,
}

/// Round `round`'s order: the sides rotated by the round, so each runs first in turn and slow
/// drift of a shared machine hits all alike.
pub(crate) fn order(sides: &[Side], round: usize) -> Vec<Side> {
    let mut v = sides.to_vec();
    if !v.is_empty() {
        let k = round % v.len();
        v.rotate_left(k);
    }
    v
}

/// Per side: one value per round.
type PerSide = std::collections::BTreeMap<&'static str, Vec<f64>>;

fn push(m: &mut PerSide, side: Side, x: f64) {
    m.entry(side.key()).or_default().push(x);
}

fn last(m: &PerSide, side: Side) -> Option<f64> {
    m.get(side.key()).and_then(|v| v.last().copied())
}

fn medians(m: &PerSide) -> Value {
    Value::Object(
        m.iter()
            .map(|(k, v)| ((*k).to_string(), json!(median(v.clone()))))
            .collect(),
    )
}

/// One open loop at `rate` for `secs`, `rounds` times: the trace straight to the sink (the
/// loop's own floor), then each Envoy (order rotated each round), with its CPU per answered
/// request and e2e latency. Medians over rounds; "added" = build − plain within a round.
fn open_loop_phase(c: &Ctx, name: &str, rate: f64) -> Result<Value, Error> {
    let trace = c.dir.join(format!("{name}.jsonl"));
    fixed_trace(c.env, rate, c.secs, &trace)?;
    let (mut cpu, mut p50, mut p99) = (PerSide::new(), PerSide::new(), PerSide::new());
    let (mut cpu_ratio, mut added_p99) = (PerSide::new(), PerSide::new());
    let mut p99_direct = Vec::new();
    let mut rounds: Vec<Value> = Vec::new();
    for round in 0..c.rounds {
        let mut row = serde_json::Map::new();
        let (direct, _) = replay(
            c.env,
            &format!("http://{}", c.sink),
            &trace,
            &c.dir.join(format!("direct.{name}.{round}.jsonl")),
            &[],
        )?;
        p99_direct.push(direct.e2e_ms.p99.unwrap_or(f64::NAN));
        row.insert("direct_to_sink".into(), lat(&direct));
        for side in order(c.sides, round) {
            let m = measured_replay(
                c.env,
                &(c.url)(side),
                &trace,
                &c.dir.join(format!("{}.{name}.{round}.jsonl", side.key())),
                &[],
                (c.pid)(side),
            )?;
            let mut v = lat(&m.summary);
            v["envoy_cpu_s"] = json!(m.cpu_s);
            v["envoy_cpu_us_per_request"] = json!(m.cpu_us_per_ok);
            row.insert(side.key().into(), v);
            push(&mut cpu, side, m.cpu_us_per_ok.unwrap_or(f64::NAN));
            push(&mut p50, side, m.summary.e2e_ms.p50.unwrap_or(f64::NAN));
            push(&mut p99, side, m.summary.e2e_ms.p99.unwrap_or(f64::NAN));
        }
        for &b in c.sides.iter().filter(|s| **s != Side::Plain) {
            if let (Some(a), Some(p)) = (last(&cpu, b), last(&cpu, Side::Plain)) {
                push(&mut cpu_ratio, b, p / a);
            }
            if let (Some(a), Some(p)) = (last(&p99, b), last(&p99, Side::Plain)) {
                push(&mut added_p99, b, a - p);
            }
        }
        rounds.push(Value::Object(row));
    }
    let us = |v: Option<f64>| v.map(|ms| (ms * 1000.0).round());
    let plain = |m: &PerSide| median(m.get(Side::Plain.key()).cloned().unwrap_or_default());
    let mut vs = serde_json::Map::new();
    for &b in c.sides.iter().filter(|s| **s != Side::Plain) {
        let get = |m: &PerSide| m.get(b.key()).cloned().unwrap_or_default();
        vs.insert(
            b.key().into(),
            json!({
                "added_p99_us_median_of_rounds": us(median(get(&added_p99))),
                "added_p99_us_per_round": get(&added_p99).iter().map(|d| us(Some(*d))).collect::<Vec<_>>(),
                "added_p50_us": us(median(get(&p50)).zip(plain(&p50)).map(|(a, b)| a - b)),
                "added_us_median": median(get(&cpu)).zip(plain(&cpu)).map(|(a, b)| a - b),
                "ratio_of_medians": analysis::ratio(plain(&cpu), median(get(&cpu))),
                "ratio_per_round": get(&cpu_ratio),
            }),
        );
    }
    let mut p99m = medians(&p99);
    p99m["direct_to_sink"] = json!(median(p99_direct));
    Ok(json!({
        "rate_rps": rate,
        "p99_ms_median": p99m,
        "p50_ms_median": medians(&p50),
        "cpu_us_median": medians(&cpu),
        "vs_least_request": vs,
        "rounds": rounds,
    }))
}

/// What the sink answers: `chunks` content chunks, all in one write (`gap_ms` 0, the default
/// run) or streamed one by one `gap_ms` apart, as a model server streams tokens (each chunk
/// then reaches the filter as its own response-body callback).
#[derive(Debug, Clone, Copy)]
pub struct Answer {
    pub chunks: u32,
    pub gap_ms: u64,
}

/// What an overhead run measures against: an idle fake pod whose metrics the agents read,
/// `pods` sinks each announced as a pod by its own agent (peered, so any agent covers the
/// pool), and one Envoy (1 worker) per side in front of all the sinks: plain least_request
/// first, then `builds`; the `epp` side with a picker of its own that scrapes the sinks.
pub(crate) struct Rig {
    _metrics_pod: Pool,
    _sink_procs: Vec<ai_lb_e2e::process::Proc>,
    pub sinks: Vec<std::net::SocketAddr>,
    agents: Vec<ai_lb_e2e::process::Proc>,
    /// Plain first, then the builds.
    pub sides: Vec<Side>,
    envoys: Vec<(Side, ai_lb_e2e::envoy::Envoy)>,
    epp: Option<ai_lb_e2e::epp::Epp>,
    /// Per ai-lb build: whether its status page listed every sink before the measurement.
    pub ready: serde_json::Map<String, Value>,
}

impl Rig {
    /// Starts the rig; with `pinned`, each Envoy (and the picker) on CPU 1.
    pub fn start(
        pods: usize,
        answer: Answer,
        openai: bool,
        builds: &[Side],
        pinned: bool,
    ) -> Result<Rig, Error> {
        let shape = PodShape {
            kinds: vec![("h100-8b", 1)],
            kv_events: false,
            time_scale: 1.0,
            max_num_seqs: 256,
            kv_cache_tokens: 400_000,
            sample_interval_ms: 100,
            gpu_sample_interval_ms: None,
        };
        let metrics_pod = Pool::start(&shape, false)?;
        let mut sink_procs = Vec::new();
        let mut sinks = Vec::new();
        for _ in 0..pods.max(1) {
            let (p, a) = topology::spawn_sink_shaped(answer.chunks, answer.gap_ms, openai)?;
            sink_procs.push(p);
            sinks.push(a);
        }
        let grpc: Vec<std::net::SocketAddr> = sinks
            .iter()
            .map(|_| {
                ai_lb_e2e::envoy::free_port()
                    .map(|p| std::net::SocketAddr::from(([127, 0, 0, 1], p)))
            })
            .collect::<Result<_, _>>()?;
        let mut agents = Vec::new();
        for (i, sink) in sinks.iter().enumerate() {
            let peers: Vec<std::net::SocketAddr> = grpc
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .map(|(_, a)| *a)
                .collect();
            let name = if pods <= 1 {
                "sink".to_string()
            } else {
                format!("sink-{i}")
            };
            agents.push(topology::spawn_agent(
                &name,
                grpc[i],
                metrics_pod.pods[0].addr,
                *sink,
                &peers,
                256,
                100,
                None,
                &[],
            )?);
        }
        let mut sides = vec![Side::Plain];
        sides.extend(builds.iter().copied().filter(|b| *b != Side::Plain));
        let mut envoys = Vec::new();
        let mut epp = None;
        for &side in &sides {
            let e = match side {
                Side::Plain => topology::start_sidecar(Policy::LeastRequest, &sinks, &grpc, 1)?,
                Side::Wasm => topology::start_sidecar(Policy::AiLb, &sinks, &grpc, 1)?,
                Side::Native => topology::start_native_sidecar(&sinks, &grpc, 1)?,
                Side::WasmB => {
                    let (build, config) = topology::b_side("AI_LB_WASM_B", "wasm-b")?;
                    let wasm = match build {
                        Some(b) => b,
                        None => ai_lb_e2e::envoy::wasm_path()?,
                    };
                    topology::start_sidecar_with_wasm(&wasm, &config, &sinks, &grpc, 1)?
                }
                Side::NativeB => {
                    let (build, config) = topology::b_side("AI_LB_NATIVE_B", "native-b")?;
                    topology::start_native_sidecar_with(
                        build.as_deref(),
                        &config,
                        &sinks,
                        &grpc,
                        1,
                    )?
                }
                Side::EmptyWasm => topology::start_empty_wasm_sidecar(&sinks, 1)?,
                Side::EmptyNative => topology::start_native_sidecar_with(
                    Some(&topology::empty_native_path()?),
                    &topology::ailb_filter_config()?,
                    &sinks,
                    &grpc,
                    1,
                )?,
                Side::Epp => {
                    let (picker, e) = topology::start_epp_pair(&sinks, 1)?;
                    if pinned {
                        pin(picker.proc.pid(), 1)?;
                    }
                    epp = Some(picker);
                    e
                }
            };
            if pinned {
                pin(e.pid(), 1)?;
            }
            envoys.push((side, e));
        }
        let mut ready = serde_json::Map::new();
        for (side, e) in &envoys {
            if !matches!(
                side,
                Side::Plain | Side::EmptyWasm | Side::EmptyNative | Side::Epp
            ) {
                let ok = topology::wait_ailb_ready(e, &sinks, Duration::from_secs(15));
                ready.insert(side.key().into(), json!(ok));
            }
        }
        Ok(Rig {
            _metrics_pod: metrics_pod,
            _sink_procs: sink_procs,
            sinks,
            agents,
            sides,
            envoys,
            epp,
            ready,
        })
    }

    pub fn envoy(&self, side: Side) -> Option<&ai_lb_e2e::envoy::Envoy> {
        self.envoys.iter().find(|(s, _)| *s == side).map(|(_, e)| e)
    }

    /// The side's listener URL (empty if it does not run).
    pub fn url(&self, side: Side) -> String {
        self.envoy(side)
            .map_or(String::new(), |e| format!("http://{}", e.listener))
    }

    /// The side's Envoy process (0 if it does not run).
    pub fn pid(&self, side: Side) -> u32 {
        self.envoy(side).map_or(0, |e| e.pid())
    }

    /// The picker process of the `epp` side.
    pub fn picker_pid(&self, side: Side) -> Option<u32> {
        (side == Side::Epp)
            .then(|| self.epp.as_ref().map(|e| e.proc.pid()))
            .flatten()
    }

    /// The agents' processes: the pods' side of ai-lb, not in any Envoy's CPU.
    pub fn agent_pids(&self) -> Vec<u32> {
        self.agents.iter().map(|a| a.pid()).collect()
    }

    /// The picker's own counters (`/stats` totals), for `epp`.
    pub fn picker_stats(&self) -> Option<Value> {
        self.epp.as_ref().and_then(|e| e.stats().ok())
    }
}

/// Runs the overhead scenario for plain Envoy and each of `builds` (side by side, same run);
/// returns its summary (written by the caller).
pub fn overhead(
    env: &Env,
    secs: f64,
    rounds: usize,
    workers: usize,
    answer: Answer,
    builds: &[Side],
) -> Result<Value, Error> {
    let dir = env.work.join("overhead");
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let pinned = pin_requested()?;
    if pinned {
        // Before anything starts: children inherit the harness's CPU.
        pin(std::process::id(), 0)?;
    }
    if builds.contains(&Side::Epp) {
        return Err(
            "--overhead-filter epp: the overhead scenario has one pod; run overhead-epp".into(),
        );
    }
    let rig = Rig::start(1, answer, false, builds, pinned)?;
    let (sides, sink, ready) = (rig.sides.clone(), rig.sinks[0], rig.ready.clone());
    let envoy_of = |side: Side| rig.envoy(side);
    let pid = |side: Side| envoy_of(side).map_or(0, |e| e.pid());
    let url =
        |side: Side| envoy_of(side).map_or(String::new(), |e| format!("http://{}", e.listener));
    // With no traffic: what each Envoy spends on its own (the filter's ticks, its agent stream,
    // stats), in CPU ms per second. Every sidecar pays it, and at low request rates it is a
    // large part of the CPU per request below.
    let idle = {
        let before: Vec<Option<f64>> = sides.iter().map(|s| cpu_secs(pid(*s))).collect();
        let t0 = std::time::Instant::now();
        std::thread::sleep(Duration::from_secs_f64(secs));
        let el = t0.elapsed().as_secs_f64();
        let mut v = serde_json::Map::new();
        for (s, b) in sides.iter().zip(before) {
            let ms = cpu_secs(pid(*s)).zip(b).map(|(a, b)| (a - b) * 1e3 / el);
            v.insert(format!("{}_cpu_ms_per_s", s.key()), json!(ms));
        }
        v.insert("secs".into(), json!(el));
        v.insert("what".into(), json!("Envoy process CPU (user + system) with no traffic, ms per second, over one period of secs_per_measurement after the filter was ready"));
        Value::Object(v)
    };
    // Enough entries that no closed loop runs out (the loop stops at the trace's span).
    let closed_trace = dir.join("closed.jsonl");
    fixed_trace(env, 20_000.0, secs, &closed_trace)?;
    let workers_arg = workers.to_string();
    let closed_args = ["--closed-loop", workers_arg.as_str(), "--threads", "2"];
    let mut max_rounds: Vec<Value> = Vec::new();
    let (mut rps, mut cpu) = (PerSide::new(), PerSide::new());
    let (mut rps_ratio, mut cpu_ratio) = (PerSide::new(), PerSide::new());
    for round in 0..rounds {
        let mut row = serde_json::Map::new();
        for side in order(&sides, round) {
            let m = measured_replay(
                env,
                &url(side),
                &closed_trace,
                &dir.join(format!("{}.closed.{round}.jsonl", side.key())),
                &closed_args,
                pid(side),
            )?;
            let (s, cpu_us) = (&m.summary, m.cpu_us_per_ok);
            let r = ok_rps(&m.records);
            row.insert(
                side.key().into(),
                json!({"ok_rps": r, "errors": s.errors, "timeouts": s.timeouts, "e2e_ms": s.e2e_ms,
                       "envoy_cpu_s": m.cpu_s, "envoy_cpu_us_per_request": cpu_us}),
            );
            push(&mut rps, side, r);
            push(&mut cpu, side, cpu_us.unwrap_or(f64::NAN));
        }
        for &b in sides.iter().filter(|s| **s != Side::Plain) {
            if let (Some(a), Some(p)) = (last(&rps, b), last(&rps, Side::Plain)) {
                push(&mut rps_ratio, b, a / p);
            }
            if let (Some(a), Some(p)) = (last(&cpu, b), last(&cpu, Side::Plain)) {
                push(&mut cpu_ratio, b, p / a);
            }
        }
        max_rounds.push(Value::Object(row));
    }
    let get = |m: &PerSide, s: Side| m.get(s.key()).cloned().unwrap_or_default();
    let plain_max = median(get(&rps, Side::Plain)).ok_or("no throughput measured")?;
    // The lowest maximum among the builds sets the first open-loop rate below.
    let builds_max = sides
        .iter()
        .filter(|s| **s != Side::Plain)
        .filter_map(|s| median(get(&rps, *s)))
        .fold(plain_max, f64::min);
    let (mut max_vs, mut cpu_vs) = (serde_json::Map::new(), serde_json::Map::new());
    for &b in sides.iter().filter(|s| **s != Side::Plain) {
        max_vs.insert(
            b.key().into(),
            json!({"ratio_of_medians": analysis::ratio(median(get(&rps, b)), Some(plain_max)),
                   "ratio_per_round": get(&rps_ratio, b)}),
        );
        cpu_vs.insert(
            b.key().into(),
            json!({"ratio_of_medians": analysis::ratio(median(get(&cpu, Side::Plain)), median(get(&cpu, b))),
                   "ratio_per_round": get(&cpu_ratio, b)}),
        );
    }
    // CPU per request and latency at a rate every Envoy keeps up with (half of the lowest
    // maximum, so the slowest build's Envoy runs at 50 % load): a closed loop's CPU per
    // request falls as throughput rises (more requests per wake-up), so at saturation it also
    // depends on how much CPU the machine leaves each Envoy; and at half of plain Envoy's
    // maximum a filter's Envoy is near its own, where it queues.
    let ctx = Ctx {
        env,
        dir: &dir,
        secs,
        rounds,
        sink,
        sides: &sides,
        url: &url,
        pid: &pid,
    };
    let mut filter_half = open_loop_phase(&ctx, "filter-half", (builds_max / 2.0).max(1.0))?;
    filter_half["what"] = json!("open loop at half of the lowest maximum among the builds (or plain's, if lower): Envoy process CPU per answered request, microseconds (ratio = plain / build), and e2e latency");
    let half = open_loop_phase(&ctx, "half", (plain_max / 2.0).max(1.0))?;
    let what = if answer.gap_ms == 0 {
        format!(
            "loadgen example sink answering {} tokens at once (SSE)",
            answer.chunks
        )
    } else {
        format!(
            "loadgen example sink streaming {} tokens {} ms apart, each its own write (SSE)",
            answer.chunks, answer.gap_ms
        )
    };
    Ok(json!({
        "upstream": format!("{what}; 16-token prompts; one Envoy, 1 worker, per configuration; ai-lb with envoy-config/filter-config.json and an agent announcing the sink (metrics from an idle fake pod)"),
        "sides": sides.iter().map(|s| s.key()).collect::<Vec<_>>(),
        "answer_chunks": answer.chunks,
        "answer_gap_ms": answer.gap_ms,
        "ailb_ready": ready,
        "secs_per_measurement": secs,
        "rounds": rounds,
        "closed_loop_workers": workers,
        "pinned": pinned,
        "empty_wasm_steps": sides.contains(&Side::EmptyWasm).then(topology::empty_wasm_steps),
        "wasm_b": sides.contains(&Side::WasmB).then(|| std::env::var("AI_LB_WASM_B").unwrap_or_default()),
        "native_b": sides.contains(&Side::NativeB).then(|| std::env::var("AI_LB_NATIVE_B").unwrap_or_default()),
        "filter_config_b": (sides.contains(&Side::WasmB) || sides.contains(&Side::NativeB)).then(|| std::env::var("AI_LB_BENCH_FILTER_CONFIG_B").unwrap_or_default()),
        "max_rps": {
            "median": medians(&rps),
            "vs_least_request": max_vs,
            "rounds": max_rounds,
        },
        "cpu_per_request": {
            "what": "Envoy process CPU (user + system) per answered request over each closed loop, microseconds; ratio = plain / build, the req/s each would reach on a core of its own",
            "median": medians(&cpu),
            "vs_least_request": cpu_vs,
        },
        "filter_half_load": filter_half,
        "half_load": half,
        "idle": idle,
    }))
}

/// Writes `summary.json` and a short `table.md` for the overhead scenario under `out`.
pub fn write(out: &Path, v: &Value) -> Result<(), Error> {
    let dir = out.join("overhead");
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let text = serde_json::to_string_pretty(v).map_err(|e| e.to_string())?;
    std::fs::write(dir.join("summary.json"), text).map_err(|e| e.to_string())?;
    std::fs::write(dir.join("table.md"), table(v)).map_err(|e| e.to_string())
}

/// The overhead table: one column per Envoy, then each build against plain.
fn table(v: &Value) -> String {
    let f = |x: &Value| x.as_f64().map_or("–".to_string(), |v| format!("{v:.2}"));
    // A difference in µs with its sign; a per-round list with 2 decimals (ratios) or none.
    let signed = |x: &Value| x.as_f64().map_or("–".to_string(), |v| format!("{v:+.0}"));
    let list = |x: &Value, decimals: usize| {
        let items: Vec<String> = x
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|e| e.as_f64().map_or("–".into(), |v| format!("{v:.decimals$}")))
                    .collect()
            })
            .unwrap_or_default();
        items.join(", ")
    };
    let sides: Vec<&str> = v["sides"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let builds: Vec<&str> = sides
        .iter()
        .copied()
        .filter(|s| *s != "least_request")
        .collect();
    let row = |what: String, get: &dyn Fn(&str) -> String, cmp: &dyn Fn(&str) -> String| {
        let cols: Vec<String> = sides.iter().map(|s| get(s)).collect();
        let vs: Vec<String> = builds.iter().map(|b| format!("{b}: {}", cmp(b))).collect();
        format!("| {what} | {} | {} |\n", cols.join(" | "), vs.join("; "))
    };
    let mut t = format!(
        "### overhead (1 Envoy worker, fast upstream, {} rounds of {} s, medians{})\n\n`{}`\n\n\
         | measure | {} | against least_request |\n|---|{}---|\n",
        v["rounds"],
        v["secs_per_measurement"],
        if v["pinned"] == json!(true) {
            "; each Envoy on CPU 1, everything else on CPU 0"
        } else {
            ""
        },
        v["command"].as_str().unwrap_or(""),
        sides.join(" | "),
        "---|".repeat(sides.len()),
    );
    let (m, c) = (&v["max_rps"], &v["cpu_per_request"]);
    t += &row(
        format!(
            "max req/s (closed loop, {} clients)",
            v["closed_loop_workers"]
        ),
        &|s| f(&m["median"][s]),
        &|b| {
            let x = &m["vs_least_request"][b];
            format!(
                "{} (per round {})",
                f(&x["ratio_of_medians"]),
                x["ratio_per_round"]
            )
        },
    );
    t += &row(
        "Envoy CPU per request over that loop, µs".into(),
        &|s| f(&c["median"][s]),
        &|b| {
            let x = &c["vs_least_request"][b];
            format!(
                "{} req/s per CPU (per round {})",
                f(&x["ratio_of_medians"]),
                list(&x["ratio_per_round"], 2)
            )
        },
    );
    for (ph, label) in [
        (&v["filter_half_load"], "half of the lowest build max"),
        (&v["half_load"], "half of plain's max"),
    ] {
        let rate = f(&ph["rate_rps"]);
        t += &row(
            format!("Envoy CPU per request at {rate} req/s ({label}), µs"),
            &|s| f(&ph["cpu_us_median"][s]),
            &|b| {
                let x = &ph["vs_least_request"][b];
                format!(
                    "{} ({} µs; per round {})",
                    f(&x["ratio_of_medians"]),
                    signed(&x["added_us_median"]),
                    list(&x["ratio_per_round"], 2)
                )
            },
        );
        t += &row(
            "e2e p50 at that rate, ms".into(),
            &|s| f(&ph["p50_ms_median"][s]),
            &|b| format!("{} µs", signed(&ph["vs_least_request"][b]["added_p50_us"])),
        );
        t += &row(
            "e2e p99 at that rate, ms".into(),
            &|s| f(&ph["p99_ms_median"][s]),
            &|b| {
                let x = &ph["vs_least_request"][b];
                format!(
                    "{} µs (per round {})",
                    signed(&x["added_p99_us_median_of_rounds"]),
                    list(&x["added_p99_us_per_round"], 0)
                )
            },
        );
    }
    t += &row(
        "Envoy CPU with no traffic, ms/s".into(),
        &|s| f(&v["idle"][format!("{s}_cpu_ms_per_s")]),
        &|_| "–".to_string(),
    );
    t += &format!(
        "\nStraight to the sink (no Envoy), p99: {} ms at half of the lowest build max, {} ms at half of plain's.\n",
        f(&v["filter_half_load"]["p99_ms_median"]["direct_to_sink"]),
        f(&v["half_load"]["p99_ms_median"]["direct_to_sink"]),
    );
    t
}

#[cfg(test)]
mod tests {
    use super::{cpu_secs, median, order, parse_pin, table, Side};

    #[test]
    fn cpu_secs_reads_this_process_and_grows_with_work() {
        let pid = std::process::id();
        let start = cpu_secs(pid).expect("/proc/<pid>/stat of this process");
        // Spin until the kernel has charged 50 ms more (a tick is 10 ms); a parse of the wrong
        // fields would stay put or be None and time out here.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        let mut x = 0u64;
        loop {
            for i in 0..1_000_000u64 {
                x = x.wrapping_mul(31).wrapping_add(i);
            }
            let now = cpu_secs(pid).expect("still readable");
            if now - start >= 0.05 {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "CPU time never grew ({x})"
            );
        }
        assert_eq!(cpu_secs(u32::MAX), None, "no such process");
    }

    #[test]
    fn builds_parse_and_errors_name_the_flag_and_value() {
        assert_eq!(Side::parse_builds("wasm").unwrap(), [Side::Wasm]);
        assert_eq!(
            Side::parse_builds("wasm,native").unwrap(),
            [Side::Wasm, Side::Native]
        );
        assert_eq!(
            Side::parse_builds("empty-wasm, wasm,wasm-b").unwrap(),
            [Side::EmptyWasm, Side::Wasm, Side::WasmB]
        );
        let e = Side::parse_builds("wasm,v8").unwrap_err();
        assert!(
            e.contains("--overhead-filter") && e.contains("\"v8\""),
            "{e}"
        );
        assert!(Side::parse_builds("native,native").is_err());
        assert_eq!(
            Side::parse_builds("native,wasm,epp").unwrap(),
            [Side::Native, Side::Wasm, Side::Epp]
        );
    }

    #[test]
    fn every_side_runs_first_in_turn() {
        let s = [Side::Plain, Side::Wasm, Side::Native];
        assert_eq!(order(&s, 0), s);
        assert_eq!(order(&s, 1), [Side::Wasm, Side::Native, Side::Plain]);
        assert_eq!(order(&s, 3), s);
    }

    #[test]
    fn the_table_has_a_column_per_side_and_a_comparison_per_build() {
        let v = serde_json::json!({
            "sides": ["least_request", "ai_lb", "ai_lb_native"], "rounds": 1,
            "secs_per_measurement": 2.0, "command": "x", "closed_loop_workers": 4,
            "max_rps": {"median": {"least_request": 100.0, "ai_lb": 50.0, "ai_lb_native": 90.0},
                        "vs_least_request": {"ai_lb": {"ratio_of_medians": 0.5}, "ai_lb_native": {"ratio_of_medians": 0.9}}},
        });
        let t = table(&v);
        assert!(
            t.contains("| measure | least_request | ai_lb | ai_lb_native |"),
            "{t}"
        );
        assert!(t.contains("| 100.00 | 50.00 | 90.00 | ai_lb: 0.50"), "{t}");
        assert!(t.contains("ai_lb_native: 0.90"), "{t}");
    }

    #[test]
    fn pinning_is_off_unless_asked_and_bad_values_name_the_variable() {
        assert_eq!(parse_pin(None), Ok(false));
        assert_eq!(parse_pin(Some("0")), Ok(false));
        assert_eq!(parse_pin(Some("1")), Ok(true));
        let e = parse_pin(Some("yes")).unwrap_err();
        assert!(
            e.contains("AI_LB_BENCH_OVERHEAD_PIN") && e.contains("yes"),
            "{e}"
        );
    }

    #[test]
    fn median_of_odd_even_and_empty() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(vec![f64::NAN]), None);
        assert_eq!(median(vec![]), None);
    }
}
