//! Decides what runs during a benchmark: a heterogeneous pool of fake GPU pods, each with its
//! collector agent (agents peered so any one's WatchPool covers the pool), and per policy a
//! set of independent client sidecars (one Envoy process each, as in a mesh, so least_request
//! sees only its own in-flight requests). Reuses the e2e harness to spawn and render.
//!
//! The `epp` policy (the llm-d endpoint-picker baseline, docs/epp-baseline.md) is ONE
//! `ai-lb-epp` process for the pool plus, per sidecar, an Envoy rendered from
//! envoy-config/envoy-epp.yaml whose ext_proc filter asks it. The picker of a run is started
//! with the run's first sidecar, shared by the others, and stopped (its CPU time measured and
//! reported, see [`EppUsage`]) once every sidecar of the run has exited; the next run starts a
//! fresh one, with an empty prefix index.

use std::collections::BTreeMap;
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde::Serialize;

use ai_lb_e2e::envoy::{self, Envoy, EnvoyOptions};
use ai_lb_e2e::process::{Proc, Spec};

/// The agents' `--rate-window` and `--window` (their defaults; the bench sets neither): the
/// longer is how long a reading of the previous run stays in what they report.
const AGENT_WINDOW: Duration = Duration::from_secs(10);

pub type Error = String;

/// The routing policies compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Policy {
    RoundRobin,
    LeastRequest,
    AiLb,
    /// The llm-d endpoint picker's default scheduling (`ai-lb-epp`) behind Envoy's ext_proc.
    Epp,
    /// ai-lb with ramped recovery on (`breaker.recoveryRamp: {}` added to its config): to set
    /// against `ai_lb` in one run (`fault-flap`).
    AiLbRamp,
    /// ai-lb with adaptive breaker thresholds on (`breaker.adaptiveThresholds: {}` added):
    /// to set against `ai_lb` in one run (`fault-noisy`).
    AiLbAdaptive,
    /// ai-lb with learned weights on (`learnedWeights` added; [`with_learned_weights`]): to set
    /// against `ai_lb` in one run (`misleading-slow`).
    AiLbLearned,
    /// ai-lb with degrade-before-OOM off (`preOom: {"enabled": false}` added): to set against
    /// `ai_lb` (where it is on by default) in one run (`fault-oom`).
    AiLbNoPreoom,
    /// ai-lb probing half-open pods with its own request (`breaker.syntheticProbe`,
    /// [`with_synthetic_probe`]) instead of clients' requests: to set against `ai_lb` in one run
    /// (`fault-flap`, `fault-errors`).
    AiLbProbe,
}

impl Policy {
    /// The policies compared by default (the report's tables and ratios).
    pub const ALL: [Policy; 3] = [Policy::RoundRobin, Policy::LeastRequest, Policy::AiLb];
    /// Every policy `--policies` may name: the default three and the llm-d baseline.
    pub const SELECTABLE: [Policy; 9] = [
        Policy::RoundRobin,
        Policy::LeastRequest,
        Policy::AiLb,
        Policy::Epp,
        Policy::AiLbRamp,
        Policy::AiLbAdaptive,
        Policy::AiLbLearned,
        Policy::AiLbNoPreoom,
        Policy::AiLbProbe,
    ];

    /// Parses a policy name as [`Policy::name`] writes it.
    pub fn parse(s: &str) -> Result<Policy, Error> {
        Policy::SELECTABLE
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                format!("invalid value '{s}' for '--policies': expected round_robin, least_request, ai_lb, epp, ai_lb_ramp, ai_lb_adaptive, ai_lb_learned, ai_lb_no_preoom or ai_lb_probe")
            })
    }

    pub fn name(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round_robin",
            Policy::LeastRequest => "least_request",
            Policy::AiLb => "ai_lb",
            Policy::Epp => "epp",
            Policy::AiLbRamp => "ai_lb_ramp",
            Policy::AiLbAdaptive => "ai_lb_adaptive",
            Policy::AiLbLearned => "ai_lb_learned",
            Policy::AiLbNoPreoom => "ai_lb_no_preoom",
            Policy::AiLbProbe => "ai_lb_probe",
        }
    }

    /// Whether the sidecar runs the ai-lb filter (its readiness, counters and cut watch apply).
    pub fn is_ailb(self) -> bool {
        matches!(
            self,
            Policy::AiLb
                | Policy::AiLbRamp
                | Policy::AiLbAdaptive
                | Policy::AiLbLearned
                | Policy::AiLbNoPreoom
                | Policy::AiLbProbe
        )
    }
}

/// A release binary of this workspace under `$CARGO_TARGET_DIR` (or `<repo>/target`).
pub fn release_bin(name: &str) -> Result<PathBuf, Error> {
    for d in ai_lb_e2e::process::target_dirs() {
        let p = d.join("release").join(name);
        if p.is_file() {
            return Ok(p);
        }
    }
    Err(format!(
        "release binary {name} is not built: run `cargo build --release --bins` (scripts/bench.sh does)"
    ))
}

fn spec(bin: &Path, name: &str, args: Vec<String>, listening: &[&str]) -> Spec {
    Spec {
        name: name.to_string(),
        program: bin.to_path_buf(),
        args,
        env: Vec::new(),
        listening: listening.iter().map(|s| s.to_string()).collect(),
        deadline: Duration::from_secs(30),
    }
}

/// The fake pod's presets a benchmark pool can mix, fastest decode first, with the short names
/// `--pool` accepts.
pub const PRESETS: [(&str, &str); 3] = [
    ("h100-8b", "h100"),
    ("a100-8b", "a100"),
    ("l40s-8b", "l40s"),
];

/// Parses `--pool`: comma-separated `KIND:COUNT`, KIND a preset (`h100-8b`) or its short name
/// (`h100`), e.g. `h100:4,a100:4` or `h100:2,a100:4,l40s:2`. Pods start in the order given.
pub fn parse_pool(spec: &str) -> Result<Vec<(&'static str, usize)>, Error> {
    let bad = |why: &str| format!("invalid value '{spec}' for '--pool': {why}");
    let mut kinds: Vec<(&'static str, usize)> = Vec::new();
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (kind, count) = part
            .split_once(':')
            .ok_or_else(|| bad(&format!("`{part}` is not KIND:COUNT")))?;
        let preset = PRESETS
            .iter()
            .find(|(full, short)| *full == kind.trim() || *short == kind.trim())
            .map(|(full, _)| *full)
            .ok_or_else(|| {
                bad(&format!(
                    "unknown kind `{kind}` (known: h100, a100, l40s or their presets h100-8b, a100-8b, l40s-8b)"
                ))
            })?;
        let n: usize = count
            .trim()
            .parse()
            .map_err(|_| bad(&format!("count `{count}` is not a number")))?;
        if kinds.iter().any(|(k, _)| *k == preset) {
            return Err(bad(&format!("`{preset}` is listed twice")));
        }
        if n > 0 {
            kinds.push((preset, n));
        }
    }
    if kinds.is_empty() {
        return Err(bad("no pods"));
    }
    Ok(kinds)
}

/// The short name of a preset (`h100` for `h100-8b`).
pub fn short_name(preset: &str) -> &str {
    PRESETS
        .iter()
        .find(|(full, _)| *full == preset)
        .map_or(preset, |(_, short)| short)
}

/// Extra flags for every fake pod, from `AI_LB_BENCH_POD_ARGS` (split on whitespace), for A/B
/// runs against a pod model the suite does not use by default (for example
/// `--gpu-util-model graded`, the utilisation of the 2026-12-04 report).
fn extra_pod_args() -> Vec<String> {
    std::env::var("AI_LB_BENCH_POD_ARGS")
        .map(|v| v.split_whitespace().map(str::to_string).collect())
        .unwrap_or_default()
}

/// How the fake pods are shaped.
#[derive(Debug, Clone)]
pub struct PodShape {
    /// (preset, pods of it), in start order (see [`parse_pool`]).
    pub kinds: Vec<(&'static str, usize)>,
    /// Pods publish vLLM's KV-cache events and agents read them, so snapshots carry each pod's
    /// prefix-cache contents (what ai-lb's `prefixAffinity` uses).
    pub kv_events: bool,
    pub time_scale: f64,
    pub max_num_seqs: u32,
    pub kv_cache_tokens: u64,
    /// The agents' `--sample-interval` (and `--watch-min-interval` when shorter than the
    /// agent's 50 ms default): how often fresh readings can reach the filters.
    pub sample_interval_ms: u64,
    /// The agents' `--gpu-sample-interval` (how often the GPU source is read; the model-server
    /// scrape stays at `sample_interval_ms`). None: the flag is not passed (the agent's
    /// default, min(20 ms, sample interval)).
    pub gpu_sample_interval_ms: Option<u64>,
}

impl PodShape {
    /// Pods of `preset` in the pool.
    pub fn count(&self, preset: &str) -> usize {
        self.kinds
            .iter()
            .filter(|(k, _)| *k == preset)
            .map(|(_, n)| n)
            .sum()
    }

    /// `4 h100 + 4 a100`.
    pub fn describe(&self) -> String {
        self.kinds
            .iter()
            .map(|(k, n)| format!("{n} {}", short_name(k)))
            .collect::<Vec<_>>()
            .join(" + ")
    }
}

/// One pod and its agent.
#[derive(Debug)]
pub struct Pod {
    pub name: String,
    pub preset: &'static str,
    /// Its KV-event PUB endpoint (`tcp://127.0.0.1:PORT`), when it publishes.
    pub kv_events: Option<String>,
    pub proc: Proc,
    pub addr: SocketAddr,
    pub agent: Option<Proc>,
    pub agent_grpc: Option<SocketAddr>,
}

/// The pool.
#[derive(Debug)]
pub struct Pool {
    pub pods: Vec<Pod>,
}

impl Pool {
    /// Starts the pods; with `agents`, one agent per pod, all peered.
    ///
    /// The agents' gRPC ports and the KV-event endpoints are drawn free before their processes
    /// bind them, and another process may take one in between (seen in a benchmark run:
    /// "--grpc-listen ...: cannot bind: Address already in use"); then the whole pool starts
    /// again on new ports, up to three times.
    pub fn start(shape: &PodShape, agents: bool) -> Result<Pool, Error> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            match Self::start_once(shape, agents) {
                Err(e) if attempt < 3 && e.contains("Address already in use") => {
                    eprintln!(
                        "[bench] a port drawn free was taken before it was bound; again: {e}"
                    );
                }
                other => return other,
            }
        }
    }

    fn start_once(shape: &PodShape, agents: bool) -> Result<Pool, Error> {
        let pod_bin = release_bin("ai-lb-fake-pod")?;
        let mut pods = Vec::new();
        let presets = shape
            .kinds
            .iter()
            .flat_map(|(k, n)| std::iter::repeat_n((*k, short_name(k)), *n));
        let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
        for (preset, short) in presets {
            let k = counts.entry(short).or_default();
            let name = format!("{short}-{k}");
            *k += 1;
            let args: Vec<String> = vec![
                "--listen".into(),
                "127.0.0.1:0".into(),
                "--preset".into(),
                preset.into(),
                "--pod-name".into(),
                name.clone(),
                // One seed for every pod: a pod's answer text is seeded by (seed, prompt,
                // max_tokens), so multi-turn conversations replay identically whatever pod
                // served each turn (only pod 0's error draws use it, and its seed stays 1).
                "--seed".into(),
                "1".into(),
                "--time-scale".into(),
                shape.time_scale.to_string(),
                "--max-num-seqs".into(),
                shape.max_num_seqs.to_string(),
                "--kv-cache-tokens".into(),
                shape.kv_cache_tokens.to_string(),
            ];
            let kv_events = if shape.kv_events {
                Some(format!("tcp://127.0.0.1:{}", envoy::free_port()?))
            } else {
                None
            };
            let mut args = args;
            if let Some(e) = &kv_events {
                args.extend(["--kv-events-endpoint".to_string(), e.clone()]);
            }
            args.extend(extra_pod_args());
            let proc = Proc::spawn(&spec(&pod_bin, &name, args, &["http"]))?;
            let addr = proc.addr("http")?;
            pods.push(Pod {
                name,
                preset,
                kv_events,
                proc,
                addr,
                agent: None,
                agent_grpc: None,
            });
        }
        let mut pool = Pool { pods };
        if agents {
            pool.start_agents(shape)?;
        }
        Ok(pool)
    }

    fn start_agents(&mut self, shape: &PodShape) -> Result<(), Error> {
        let grpc: Vec<SocketAddr> = (0..self.pods.len())
            .map(|_| envoy::free_port().map(|p| SocketAddr::from(([127, 0, 0, 1], p))))
            .collect::<Result<_, _>>()?;
        for (i, pod) in self.pods.iter_mut().enumerate() {
            let peers: Vec<SocketAddr> = grpc
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .map(|(_, a)| *a)
                .collect();
            let extra: Vec<String> = pod
                .kv_events
                .iter()
                .flat_map(|e| ["--kv-events-endpoint".to_string(), e.clone()])
                .collect();
            let p = spawn_agent(
                &pod.name,
                grpc[i],
                pod.addr,
                pod.addr,
                &peers,
                shape.max_num_seqs,
                shape.sample_interval_ms,
                shape.gpu_sample_interval_ms,
                &extra,
            )?;
            pod.agent_grpc = Some(p.addr("grpc")?);
            pod.agent = Some(p);
        }
        Ok(())
    }

    pub fn addrs(&self) -> Vec<SocketAddr> {
        self.pods.iter().map(|p| p.addr).collect()
    }

    pub fn agent_addrs(&self) -> Vec<SocketAddr> {
        self.pods.iter().filter_map(|p| p.agent_grpc).collect()
    }

    /// `POST /control` on pod `i` (fault injection).
    pub fn control(&self, i: usize, json: &str) -> Result<(), Error> {
        let pod = self.pods.get(i).ok_or_else(|| format!("no pod {i}"))?;
        control(pod.addr, &pod.name, json)
    }

    /// Running + waiting requests summed over the pool (from each pod's `/metrics`).
    pub fn busy(&self) -> Result<f64, Error> {
        let mut total = 0.0;
        for p in &self.pods {
            let text = envoy::http_get(p.addr, "/metrics")?.text();
            total += gauge(&text, "vllm:num_requests_running")
                + gauge(&text, "vllm:num_requests_waiting");
        }
        Ok(total)
    }

    /// `vllm:generation_tokens_total` of pod `i`.
    pub fn generated_tokens(&self, i: usize) -> Result<f64, Error> {
        let pod = self.pods.get(i).ok_or_else(|| format!("no pod {i}"))?;
        let text = envoy::http_get(pod.addr, "/metrics")?.text();
        Ok(gauge(&text, "vllm:generation_tokens_total"))
    }

    /// Waits until no pod runs or queues anything (after a run's stragglers were cut off), then
    /// until the agents' windows no longer hold the previous phase: requests cut off by the
    /// client (calibration kills its generators, timeouts) count as aborts, which the agents
    /// report as errors for a rate window, and ai-lb's breakers would open on them at the
    /// start of the next run; and the previous run's tail would sit in the latency quantiles
    /// the next run's first picks read.
    pub fn wait_idle(&self, deadline: Duration) -> Result<(), Error> {
        let end = Instant::now() + deadline;
        loop {
            if self.busy()? == 0.0 {
                std::thread::sleep(AGENT_WINDOW + Duration::from_millis(500));
                return Ok(());
            }
            if Instant::now() > end {
                return Err(format!("pool still busy after {deadline:?}"));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// `POST /control` on the fake pod `name` at `addr` (fault injection); needs no [`Pool`], so a
/// thread can drive it while the pool is borrowed elsewhere.
pub fn control(addr: SocketAddr, name: &str, json: &str) -> Result<(), Error> {
    let r = envoy::HttpClient::new(addr).post_json("/control", &[("connection", "close")], json)?;
    if r.status == 200 {
        Ok(())
    } else {
        Err(format!(
            "POST /control {json} on {name}: {} {}",
            r.status,
            r.text()
        ))
    }
}

/// Starts an agent on `grpc` that reads metrics and simulated GPU state from the fake pod at
/// `metrics_from` and announces `serving` as the pod's serving address. `gpu_sample_interval_ms`
/// None leaves `--gpu-sample-interval` at the agent's default.
#[allow(clippy::too_many_arguments)]
pub fn spawn_agent(
    name: &str,
    grpc: SocketAddr,
    metrics_from: SocketAddr,
    serving: SocketAddr,
    peers: &[SocketAddr],
    max_num_seqs: u32,
    sample_interval_ms: u64,
    gpu_sample_interval_ms: Option<u64>,
    extra: &[String],
) -> Result<Proc, Error> {
    let agent_bin = release_bin("ai-lb-agent")?;
    let url = format!("http://{metrics_from}");
    let mut args: Vec<String> = vec![
        "--grpc-listen".into(),
        grpc.to_string(),
        "--http-listen".into(),
        "127.0.0.1:0".into(),
        "--pod-name".into(),
        name.to_string(),
        "--serving-address".into(),
        serving.to_string(),
        "--gpu-source".into(),
        "sim".into(),
        "--sim-url".into(),
        url.clone(),
        "--model-server-url".into(),
        url,
        "--engine".into(),
        "vllm".into(),
        "--queue-capacity".into(),
        max_num_seqs.to_string(),
        // Agent defaults except a faster sample, as a latency-sensitive deployment would run
        // it (stated in BENCHMARKS.md).
        "--sample-interval".into(),
        format!("{sample_interval_ms}ms"),
    ];
    if let Some(g) = gpu_sample_interval_ms {
        args.push("--gpu-sample-interval".into());
        args.push(format!("{g}ms"));
    }
    // Pushes may follow the faster of the two samples (when it is given here).
    let fastest = gpu_sample_interval_ms.map_or(sample_interval_ms, |g| g.min(sample_interval_ms));
    if fastest < 50 {
        args.push("--watch-min-interval".into());
        args.push(format!("{fastest}ms"));
    }
    args.extend(extra.iter().cloned());
    if !peers.is_empty() {
        args.push("--peers".into());
        args.push(
            peers
                .iter()
                .map(|a| a.to_string())
                .collect::<Vec<_>>()
                .join(","),
        );
    }
    Proc::spawn(&spec(
        &agent_bin,
        &format!("agent-{name}"),
        args,
        &["grpc", "http"],
    ))
}

/// The loadgen example `sink` (answers at once, no model) on a free port, for the overhead
/// run's upstream; waits until it accepts connections.
pub fn spawn_sink(chunks: u32, gap_ms: u64) -> Result<(Proc, SocketAddr), Error> {
    spawn_sink_shaped(chunks, gap_ms, false)
}

/// [`spawn_sink`], with `openai` chunks: whole `chat.completion.chunk` objects as vLLM writes
/// them (id, model, logprobs, finish_reason) instead of the minimal ones. Either way the sink
/// answers `GET /metrics` with an idle vLLM page, so the endpoint picker can scrape it.
pub fn spawn_sink_shaped(
    chunks: u32,
    gap_ms: u64,
    openai: bool,
) -> Result<(Proc, SocketAddr), Error> {
    let bin = {
        let mut found = None;
        for d in ai_lb_e2e::process::target_dirs() {
            let p = d.join("release/examples/sink");
            if p.is_file() {
                found = Some(p);
                break;
            }
        }
        found.ok_or("the sink example is not built: run `cargo build --release -p ai-lb-loadgen --example sink` (scripts/bench.sh does)")?
    };
    let port = envoy::free_port()?;
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let p = Proc::spawn(&spec(
        &bin,
        "sink",
        vec![
            port.to_string(),
            "1".into(),
            chunks.to_string(),
            gap_ms.to_string(),
            if openai { "openai" } else { "short" }.into(),
        ],
        &[],
    ))?;
    let end = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(addr).is_err() {
        if Instant::now() > end {
            return Err(p.failure("sink did not accept connections within 20 s"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok((p, addr))
}

/// Sum of the samples of a Prometheus metric (any labels) in `text`.
pub fn gauge(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The baseline template with its load balancer filled in.
pub fn plain_template(policy: Policy) -> Result<String, Error> {
    let p = ai_lb_e2e::process::workspace_root().join("tests/bench/envoy-plain.yaml");
    let t = std::fs::read_to_string(&p).map_err(|e| format!("reading {}: {e}", p.display()))?;
    let lb = match policy {
        Policy::RoundRobin => "ROUND_ROBIN",
        Policy::LeastRequest => "LEAST_REQUEST",
        Policy::AiLb
        | Policy::AiLbRamp
        | Policy::AiLbAdaptive
        | Policy::AiLbLearned
        | Policy::AiLbNoPreoom
        | Policy::AiLbProbe => return Err("ai_lb uses envoy-config/envoy.yaml".into()),
        Policy::Epp => return Err("epp uses envoy-config/envoy-epp.yaml".into()),
    };
    Ok(t.replace("${LB_POLICY}", lb))
}

/// The filter config the benchmark uses for ai-lb: `envoy-config/filter-config.json` as is
/// (default weights), or the file named by `AI_LB_BENCH_FILTER_CONFIG` (to compare settings;
/// the report's tables use the shipped file).
pub fn ailb_filter_config() -> Result<String, Error> {
    let p = match std::env::var_os("AI_LB_BENCH_FILTER_CONFIG") {
        Some(p) => PathBuf::from(p),
        None => ai_lb_e2e::process::workspace_root().join("envoy-config/filter-config.json"),
    };
    std::fs::read_to_string(&p).map_err(|e| format!("reading {}: {e}", p.display()))
}

/// `config` with `breaker.recoveryRamp` on at its defaults (kept as it is where it names one).
pub fn with_recovery_ramp(config: &str) -> Result<String, Error> {
    with_breaker_section(config, "recoveryRamp", serde_json::json!({}))
}

/// `config` with `breaker.adaptiveThresholds` on: the JSON object in `AI_LB_BENCH_ADAPTIVE`
/// (e.g. `{"maxAdjust":0.15}`, to compare settings in one run), else at its defaults (kept as
/// it is where the config names one).
pub fn with_adaptive_thresholds(config: &str) -> Result<String, Error> {
    let section = match std::env::var("AI_LB_BENCH_ADAPTIVE") {
        Ok(v) => serde_json::from_str::<serde_json::Value>(&v)
            .ok()
            .filter(serde_json::Value::is_object)
            .ok_or_else(|| format!("AI_LB_BENCH_ADAPTIVE={v:?}: not a JSON object"))?,
        Err(_) => serde_json::json!({}),
    };
    with_breaker_section(config, "adaptiveThresholds", section)
}

/// The `learnedWeights` section `ai_lb_learned` runs with when `AI_LB_BENCH_LEARNED` names
/// none: the issue's defaults but for an update every second (a run lasts a minute or two, not
/// the hours the 15 s default is meant for), a learning rate of 0.05 (0.01 moves a weight by
/// about 0.0025 a sample: a few hundred samples per worker in a run would barely move it), and
/// SLOs at the bench pool's scale (TTFT p99 about 1 s, e2e p99 several seconds).
pub const BENCH_LEARNED: &str =
    r#"{"updateIntervalMs":1000,"learningRate":0.05,"ttftSloMs":1000,"e2eSloMs":10000,"seed":42}"#;

/// `config` with `learnedWeights` set: `AI_LB_BENCH_LEARNED` (a JSON object) or
/// [`BENCH_LEARNED`].
pub fn with_learned_weights(config: &str) -> Result<String, Error> {
    let raw = std::env::var("AI_LB_BENCH_LEARNED").unwrap_or_else(|_| BENCH_LEARNED.to_string());
    let section = serde_json::from_str::<serde_json::Value>(&raw)
        .ok()
        .filter(serde_json::Value::is_object)
        .ok_or_else(|| format!("AI_LB_BENCH_LEARNED={raw:?}: not a JSON object"))?;
    with_top_section(config, "learnedWeights", section)
}

/// `config` with `preOom: {"enabled": false}` (degrade before OOM off; it is on by default).
pub fn without_pre_oom(config: &str) -> Result<String, Error> {
    with_top_section(config, "preOom", serde_json::json!({"enabled": false}))
}

/// `config` with its top-level `section` set to `value`.
fn with_top_section(
    config: &str,
    section: &str,
    value: serde_json::Value,
) -> Result<String, Error> {
    let mut v: serde_json::Value =
        serde_json::from_str(config).map_err(|e| format!("the ai-lb filter config: {e}"))?;
    let Some(top) = v.as_object_mut() else {
        return Err("the ai-lb filter config is not a JSON object".into());
    };
    top.insert(section.into(), value);
    Ok(v.to_string())
}

/// `config` with `breaker.<section>` present (`value` unless it names one).
/// `config` with `breaker.syntheticProbe` on: a one-token completion of the fake pods' model,
/// the defaults otherwise (probes 250 ms apart, 2 s timeout).
pub fn with_synthetic_probe(config: &str) -> Result<String, Error> {
    let body = serde_json::json!({
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "prompt": "ping",
        "max_tokens": 1
    });
    with_breaker_section(
        config,
        "syntheticProbe",
        serde_json::json!({"body": body.to_string()}),
    )
}

fn with_breaker_section(
    config: &str,
    section: &str,
    value: serde_json::Value,
) -> Result<String, Error> {
    let mut v: serde_json::Value =
        serde_json::from_str(config).map_err(|e| format!("the ai-lb filter config: {e}"))?;
    let Some(top) = v.as_object_mut() else {
        return Err("the ai-lb filter config is not a JSON object".into());
    };
    let breaker = top
        .entry("breaker")
        .or_insert_with(|| serde_json::json!({}));
    match breaker.as_object_mut() {
        Some(b) => {
            b.entry(section).or_insert(value);
        }
        None => return Err("the ai-lb filter config's `breaker` is not an object".into()),
    }
    Ok(v.to_string())
}

/// Starts Envoy with `opts` in front of `upstreams`, its agents and worker count filled in.
fn start_with(
    mut opts: EnvoyOptions,
    upstreams: &[SocketAddr],
    agents: &[SocketAddr],
    concurrency: u32,
) -> Result<Envoy, Error> {
    opts.inference = upstreams.to_vec();
    opts.agents = agents.to_vec();
    opts.concurrency = concurrency;
    Envoy::start(&opts)
}

/// Starts one sidecar for `policy` in front of `upstreams`.
pub fn start_sidecar(
    policy: Policy,
    upstreams: &[SocketAddr],
    agents: &[SocketAddr],
    concurrency: u32,
) -> Result<Envoy, Error> {
    let opts = match policy {
        Policy::AiLb => EnvoyOptions::new(ailb_filter_config()?),
        Policy::AiLbRamp => EnvoyOptions::new(with_recovery_ramp(&ailb_filter_config()?)?),
        Policy::AiLbAdaptive => {
            EnvoyOptions::new(with_adaptive_thresholds(&ailb_filter_config()?)?)
        }
        Policy::AiLbLearned => EnvoyOptions::new(with_learned_weights(&ailb_filter_config()?)?),
        Policy::AiLbNoPreoom => EnvoyOptions::new(without_pre_oom(&ailb_filter_config()?)?),
        Policy::AiLbProbe => EnvoyOptions::new(with_synthetic_probe(&ailb_filter_config()?)?),
        Policy::Epp => return start_epp_sidecar(upstreams, concurrency),
        p => {
            let mut o = EnvoyOptions::new("{}");
            o.template = Some(plain_template(p)?);
            o
        }
    };
    start_with(opts, upstreams, agents, concurrency)
}

/// CPU seconds (user + system) process `pid` has used so far, from `/proc/<pid>/stat`
/// (fields 14 and 15, in clock ticks of 1/100 s: Linux's USER_HZ). None off Linux or when the
/// process is gone.
pub fn cpu_secs(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces: count after it.
    let rest = stat.get(stat.rfind(')')? + 1..)?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok());
    // `rest` starts at field 3 (state): utime is field 14, stime field 15.
    Some((ticks(11)? + ticks(12)?) as f64 / 100.0)
}

/// Whether process `pid` still runs (not gone, not a zombie).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rfind(')')
            .and_then(|i| s.get(i + 1..))
            .is_some_and(|r| !r.trim_start().starts_with('Z'))
    })
}

/// What one `epp` run cost and did: the picker's CPU time from when it had read every pod
/// (started with the run's first sidecar) until it was stopped (once all of them exited), the
/// sidecar Envoys' CPU time from when each had started (its last reading, taken at most
/// [`EPP_WATCH_EVERY`] before it exited, or when [`finish_epp`] ran), and the picker's own
/// counters at the end.
#[derive(Debug, Clone, Serialize)]
pub struct EppUsage {
    pub pods: Vec<String>,
    pub sidecars: usize,
    pub wall_s: f64,
    pub epp_cpu_s: Option<f64>,
    pub sidecars_cpu_s: f64,
    /// Requests the picker scheduled, and its CPU per scheduled request.
    pub picks: u64,
    pub epp_cpu_us_per_pick: Option<f64>,
    pub prefix_hits: u64,
    /// The picker's totals as its `/stats` page gave them (scrape errors, 503s, ...).
    pub counters: serde_json::Value,
}

/// How often the sidecars of an `epp` run are checked (and their CPU read).
pub const EPP_WATCH_EVERY: Duration = Duration::from_millis(250);

/// The picker of the current `epp` run.
struct EppRun {
    epp: ai_lb_e2e::epp::Epp,
    pods: Vec<SocketAddr>,
    started: Instant,
    cpu_at_start: Option<f64>,
    /// Sidecar pid → its CPU reading when it joined (after Envoy's start-up) and its last one.
    sidecars: BTreeMap<u32, (f64, f64)>,
}

fn epp_run() -> &'static Mutex<Option<EppRun>> {
    static RUN: Mutex<Option<EppRun>> = Mutex::new(None);
    &RUN
}

fn finished_runs() -> &'static Mutex<Vec<EppUsage>> {
    static DONE: Mutex<Vec<EppUsage>> = Mutex::new(Vec::new());
    &DONE
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Extra `ai-lb-epp` flags for the bench: `$AI_LB_BENCH_EPP_ARGS` (whitespace-separated, e.g.
/// `--prefix-weight 0` to compare settings), plus `--seed 1` unless it sets one.
pub fn epp_args() -> Vec<String> {
    let mut a: Vec<String> = std::env::var("AI_LB_BENCH_EPP_ARGS")
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_string)
        .collect();
    if !a.iter().any(|x| x == "--seed" || x.starts_with("--seed=")) {
        a.extend(["--seed".to_string(), "1".to_string()]);
    }
    a
}

/// Where finished `epp` runs are appended as JSON lines: `$AI_LB_BENCH_EPP_USAGE`, else
/// `<temp dir>/ai-lb-bench/epp-usage.jsonl`.
pub fn epp_usage_log() -> PathBuf {
    std::env::var_os("AI_LB_BENCH_EPP_USAGE")
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("ai-lb-bench/epp-usage.jsonl"))
}

/// Stops `run`'s picker and says what it cost (stderr, the usage log, [`take_epp_usage`]).
fn finish(mut run: EppRun) -> EppUsage {
    let stats = run.epp.stats().unwrap_or(serde_json::Value::Null);
    let cpu = cpu_secs(run.epp.proc.pid())
        .zip(run.cpu_at_start)
        .map(|(a, b)| a - b);
    run.epp.proc.kill();
    let counters = stats["totals"].clone();
    let picks = counters["picks"].as_u64().unwrap_or(0);
    let usage = EppUsage {
        pods: run.pods.iter().map(ToString::to_string).collect(),
        sidecars: run.sidecars.len(),
        wall_s: run.started.elapsed().as_secs_f64(),
        epp_cpu_s: cpu,
        sidecars_cpu_s: run
            .sidecars
            .values()
            .map(|(first, last)| last - first)
            .sum(),
        picks,
        epp_cpu_us_per_pick: cpu.filter(|_| picks > 0).map(|c| c * 1e6 / picks as f64),
        prefix_hits: counters["prefix_hits"].as_u64().unwrap_or(0),
        counters,
    };
    let line = serde_json::to_string(&usage).unwrap_or_default();
    eprintln!("[bench] epp run finished: {line}");
    let log = epp_usage_log();
    let written = log
        .parent()
        .map_or(Ok(()), std::fs::create_dir_all)
        .and_then(|_| {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&log)
        })
        .and_then(|mut f| writeln!(f, "{line}"));
    if let Err(e) = written {
        eprintln!("[bench] cannot append to {}: {e}", log.display());
    }
    lock(finished_runs()).push(usage.clone());
    usage
}

/// One look at the current run: read its sidecars' CPU; finish it once they have all exited.
fn watch_once() {
    let mut g = lock(epp_run());
    let Some(run) = g.as_mut() else { return };
    let mut any_alive = false;
    for (pid, (_, last)) in run.sidecars.iter_mut() {
        if alive(*pid) {
            any_alive = true;
            if let Some(c) = cpu_secs(*pid) {
                *last = c;
            }
        }
    }
    if !run.sidecars.is_empty() && !any_alive {
        if let Some(run) = g.take() {
            drop(g);
            finish(run);
        }
    }
}

/// Starts (once) the thread that watches `epp` runs.
fn start_watcher() {
    static STARTED: OnceLock<()> = OnceLock::new();
    STARTED.get_or_init(|| {
        std::thread::spawn(|| loop {
            std::thread::sleep(EPP_WATCH_EVERY);
            watch_once();
        });
    });
}

/// Finishes the current `epp` run now if all its sidecars have exited (call after dropping
/// them to get its [`EppUsage`] without waiting for the watcher).
pub fn finish_epp() -> Option<EppUsage> {
    let mut g = lock(epp_run());
    let done = g
        .as_ref()
        .is_some_and(|r| !r.sidecars.is_empty() && r.sidecars.keys().all(|p| !alive(*p)));
    if !done {
        return None;
    }
    let run = g.take()?;
    drop(g);
    Some(finish(run))
}

/// The usage of every `epp` run finished so far, oldest first (emptied).
pub fn take_epp_usage() -> Vec<EppUsage> {
    std::mem::take(&mut *lock(finished_runs()))
}

/// The picker for an `epp` sidecar in front of `upstreams`: the current run's if it is for the
/// same pods and still has a sidecar running (or none yet), else a fresh one (the previous run
/// finished first).
fn epp_for(upstreams: &[SocketAddr]) -> Result<SocketAddr, Error> {
    start_watcher();
    let mut g = lock(epp_run());
    if let Some(run) = g.as_ref() {
        let current = run.pods == upstreams
            && (run.sidecars.is_empty() || run.sidecars.keys().any(|p| alive(*p)));
        if current {
            return Ok(run.epp.grpc);
        }
        if let Some(old) = g.take() {
            finish(old);
        }
    }
    let args = epp_args();
    let arg_refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let epp = ai_lb_e2e::epp::spawn_with(&release_bin(ai_lb_e2e::epp::BIN)?, upstreams, &arg_refs)?;
    epp.wait_scraped(Duration::from_secs(15))?;
    let grpc = epp.grpc;
    *g = Some(EppRun {
        cpu_at_start: cpu_secs(epp.proc.pid()),
        epp,
        pods: upstreams.to_vec(),
        started: Instant::now(),
        sidecars: BTreeMap::new(),
    });
    Ok(grpc)
}

/// Starts one `epp` sidecar: Envoy from envoy-config/envoy-epp.yaml in front of `upstreams`,
/// asking the run's picker (started with the first sidecar).
fn start_epp_sidecar(upstreams: &[SocketAddr], concurrency: u32) -> Result<Envoy, Error> {
    let epp = epp_for(upstreams)?;
    let opts = ai_lb_e2e::epp::envoy_options(epp, upstreams)?;
    let envoy = start_with(opts, upstreams, &[], concurrency)?;
    if let Some(run) = lock(epp_run()).as_mut() {
        let c = cpu_secs(envoy.pid()).unwrap_or(0.0);
        run.sidecars.insert(envoy.pid(), (c, c));
    }
    Ok(envoy)
}

/// A picker of its own (`ai-lb-epp` with [`epp_args`], every pod scraped once) and one Envoy
/// from envoy-config/envoy-epp.yaml asking it, in front of `upstreams`: for a measurement that
/// reads the picker's CPU itself (the `epp` policy's runs share a picker and report its CPU
/// when they end, see [`EppUsage`]).
pub fn start_epp_pair(
    upstreams: &[SocketAddr],
    concurrency: u32,
) -> Result<(ai_lb_e2e::epp::Epp, Envoy), Error> {
    let args = epp_args();
    let arg_refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let epp = ai_lb_e2e::epp::spawn_with(&release_bin(ai_lb_e2e::epp::BIN)?, upstreams, &arg_refs)?;
    epp.wait_scraped(Duration::from_secs(15))?;
    let opts = ai_lb_e2e::epp::envoy_options(epp.grpc, upstreams)?;
    let envoy = start_with(opts, upstreams, &[], concurrency)?;
    Ok((epp, envoy))
}

/// Starts an ai-lb sidecar as [`start_sidecar`] does, running the wasm build at `wasm` instead
/// of `$AI_LB_WASM` with the plugin config `config` (a second build or config of the filter,
/// to compare two in the same run).
pub fn start_sidecar_with_wasm(
    wasm: &Path,
    config: &str,
    upstreams: &[SocketAddr],
    agents: &[SocketAddr],
    concurrency: u32,
) -> Result<Envoy, Error> {
    let mut opts = EnvoyOptions::new(config);
    let t = envoy::template()?;
    if !t.contains("${WASM_PATH}") {
        return Err("envoy-config/envoy.yaml: no ${WASM_PATH} placeholder".into());
    }
    opts.template = Some(t.replace("${WASM_PATH}", &wasm.display().to_string()));
    start_with(opts, upstreams, agents, concurrency)
}

/// The B side of an overhead run (`wasm-b`, `native-b`): the build named by `var`
/// (`AI_LB_WASM_B`, `AI_LB_NATIVE_B`; None: the shipped one) and the plugin config of
/// `$AI_LB_BENCH_FILTER_CONFIG_B` (else the A side's). One of the two must be set, or B would
/// be A.
pub fn b_side(var: &str, flag: &str) -> Result<(Option<PathBuf>, String), Error> {
    let build = std::env::var_os(var).map(PathBuf::from);
    if let Some(p) = build.as_ref().filter(|p| !p.exists()) {
        return Err(format!("{var}={} does not exist", p.display()));
    }
    let config = match std::env::var_os("AI_LB_BENCH_FILTER_CONFIG_B") {
        Some(p) => {
            let p = PathBuf::from(p);
            std::fs::read_to_string(&p).map_err(|e| {
                format!("AI_LB_BENCH_FILTER_CONFIG_B: reading {}: {e}", p.display())
            })?
        }
        None if build.is_none() => {
            return Err(format!(
                "--overhead-filter {flag} needs {var} (the second build) or AI_LB_BENCH_FILTER_CONFIG_B (the second plugin config)"
            ))
        }
        None => ailb_filter_config()?,
    };
    Ok((build, config))
}

/// The empty proxy-wasm filter (`tests/bench/empty-wasm`): `$AI_LB_EMPTY_WASM`, else
/// `<target>/wasm32-wasip1/release/ai_lb_bench_empty_wasm.wasm`.
pub fn empty_wasm_path() -> Result<PathBuf, Error> {
    envoy::built(
        "AI_LB_EMPTY_WASM",
        &["wasm32-wasip1/release/ai_lb_bench_empty_wasm.wasm"],
        "cargo build -p ai-lb-bench-empty-wasm --target wasm32-wasip1 --release",
    )
}

/// The empty dynamic module (`tests/bench/empty-native`): `$AI_LB_EMPTY_NATIVE`, else
/// `<target>/release/libai_lb_bench_empty_native.so`.
pub fn empty_native_path() -> Result<PathBuf, Error> {
    envoy::built(
        "AI_LB_EMPTY_NATIVE",
        &["release/libai_lb_bench_empty_native.so"],
        "cargo build --release -p ai-lb-bench-empty-native",
    )
}

/// Plain least_request's template with the empty proxy-wasm filter at `wasm` put before the
/// router, configured as the ai-lb filter is (same flags, V8): what any proxy-wasm filter costs.
/// `steps` is its plugin configuration (the pieces of ai-lb's work it does; blank = none).
pub fn empty_wasm_template(wasm: &Path, steps: &str) -> Result<String, Error> {
    let t = plain_template(Policy::LeastRequest)?;
    let router = "          - name: envoy.filters.http.router\n";
    if t.matches(router).count() != 1 {
        return Err("tests/bench/envoy-plain.yaml: expected one router filter line".into());
    }
    let filter = format!(
        "          - name: envoy.filters.http.wasm\n\
         \x20           typed_config:\n\
         \x20             \"@type\": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm\n\
         \x20             config:\n\
         \x20               name: empty\n\
         \x20               root_id: empty\n\
         \x20               allow_on_headers_stop_iteration: true\n\
         \x20               failure_policy: FAIL_OPEN\n\
         \x20               configuration:\n\
         \x20                 \"@type\": type.googleapis.com/google.protobuf.StringValue\n\
         \x20                 value: {}\n\
         \x20               vm_config:\n\
         \x20                 vm_id: empty\n\
         \x20                 runtime: envoy.wasm.runtime.v8\n\
         \x20                 code:\n\
         \x20                   local: {{filename: \"{}\"}}\n",
        serde_json::to_string(steps).map_err(|e| e.to_string())?,
        wasm.display()
    );
    Ok(t.replace(router, &format!("{filter}{router}")))
}

/// The empty filter's steps for a benchmark: `$AI_LB_BENCH_EMPTY_WASM_STEPS` (blank = none).
pub fn empty_wasm_steps() -> String {
    std::env::var("AI_LB_BENCH_EMPTY_WASM_STEPS").unwrap_or_default()
}

/// Starts plain least_request's sidecar with the empty proxy-wasm filter in front of the router
/// (doing [`empty_wasm_steps`]).
pub fn start_empty_wasm_sidecar(
    upstreams: &[SocketAddr],
    concurrency: u32,
) -> Result<Envoy, Error> {
    let mut opts = EnvoyOptions::new("{}");
    opts.template = Some(empty_wasm_template(
        &empty_wasm_path()?,
        &empty_wasm_steps(),
    )?);
    start_with(opts, upstreams, &[], concurrency)
}

/// Starts one ai-lb sidecar running the experimental native module (filter/native) with the
/// same plugin config as [`start_sidecar`], its agents given as addresses.
pub fn start_native_sidecar(
    upstreams: &[SocketAddr],
    agents: &[SocketAddr],
    concurrency: u32,
) -> Result<Envoy, Error> {
    start_native_sidecar_with(None, &ailb_filter_config()?, upstreams, agents, concurrency)
}

/// [`start_native_sidecar`] with the module at `module` (None: `$AI_LB_NATIVE` or the build)
/// and the plugin config `plugin`.
pub fn start_native_sidecar_with(
    module: Option<&Path>,
    plugin: &str,
    upstreams: &[SocketAddr],
    agents: &[SocketAddr],
    concurrency: u32,
) -> Result<Envoy, Error> {
    let mut config = envoy::native_filter_config(plugin, agents)?;
    // How the module steers (its `steering`), to compare: `overrideHost` also puts the cluster
    // on least_request, since override_host would then only add its own cost.
    let steering = std::env::var("AI_LB_BENCH_NATIVE_STEERING").unwrap_or_default();
    let template = match steering.as_str() {
        "" | "header" => envoy::native_template()?,
        "both" => envoy::native_template()?,
        "overrideHost" => envoy::native_template_least_request()?,
        other => {
            return Err(format!(
                "AI_LB_BENCH_NATIVE_STEERING={other:?}: expected header, overrideHost or both"
            ))
        }
    };
    if !steering.is_empty() {
        config = envoy::native_with_steering(&config, &steering)?;
    }
    let template = match module {
        Some(m) if template.contains("${NATIVE_MODULE_PATH}") => {
            template.replace("${NATIVE_MODULE_PATH}", &m.display().to_string())
        }
        Some(_) => {
            return Err(
                "envoy-config/envoy-native.yaml: no ${NATIVE_MODULE_PATH} placeholder".into(),
            )
        }
        None => template,
    };
    let mut opts = EnvoyOptions::new(config);
    opts.template = Some(template);
    start_with(opts, upstreams, agents, concurrency)
}

/// Waits until an ai-lb sidecar's status page lists every pod (the filter has pool data), up to
/// `deadline`. Returns whether it did.
pub fn wait_ailb_ready(sidecar: &Envoy, pods: &[SocketAddr], deadline: Duration) -> bool {
    let end = Instant::now() + deadline;
    while Instant::now() < end {
        if let Ok(r) = envoy::http_get(sidecar.listener, "/ai-lb/status") {
            let text = r.text();
            if r.status == 200 && pods.iter().all(|a| text.contains(&a.to_string())) {
                return true;
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pools_parse_by_short_or_preset_name_in_order() {
        assert_eq!(
            parse_pool("h100:2, a100-8b:4,l40s:2").unwrap(),
            vec![("h100-8b", 2), ("a100-8b", 4), ("l40s-8b", 2)]
        );
        assert_eq!(parse_pool("a100:3,h100:0").unwrap(), vec![("a100-8b", 3)]);
        for (bad, says) in [
            ("h100", "not KIND:COUNT"),
            ("v100:2", "unknown kind `v100`"),
            ("h100:x", "count `x`"),
            ("h100:1,h100-8b:2", "listed twice"),
            ("h100:0", "no pods"),
        ] {
            let e = parse_pool(bad).unwrap_err();
            assert!(
                e.contains("--pool") && e.contains(bad) && e.contains(says),
                "{e}"
            );
        }
        let shape = PodShape {
            kinds: parse_pool("h100:2,a100:6").unwrap(),
            kv_events: true,
            time_scale: 1.0,
            max_num_seqs: 8,
            kv_cache_tokens: 12_500,
            sample_interval_ms: 50,
            gpu_sample_interval_ms: None,
        };
        assert_eq!(shape.count("a100-8b"), 6);
        assert_eq!(shape.count("l40s-8b"), 0);
        assert_eq!(shape.describe(), "2 h100 + 6 a100");
    }

    #[test]
    fn gauge_sums_labelled_samples_and_ignores_prefix_matches() {
        let text = "# HELP x\nvllm:num_requests_running{model_name=\"m\"} 3\n\
                    vllm:num_requests_running_other 9\nvllm:num_requests_running 2\n";
        assert_eq!(gauge(text, "vllm:num_requests_running"), 5.0);
        assert_eq!(gauge(text, "absent"), 0.0);
    }

    #[test]
    fn empty_wasm_template_is_plain_least_request_with_the_filter_before_the_router() {
        let t = empty_wasm_template(Path::new("/x/empty.wasm"), "clock,read-path").unwrap();
        assert!(t.contains("lb_policy: LEAST_REQUEST"));
        let wasm = t
            .find("name: envoy.filters.http.wasm")
            .expect("wasm filter");
        let router = t.find("name: envoy.filters.http.router").expect("router");
        assert!(wasm < router, "the wasm filter must run before the router");
        assert!(t.contains("local: {filename: \"/x/empty.wasm\"}"), "{t}");
        assert!(t.contains("runtime: envoy.wasm.runtime.v8"));
        assert!(t.contains("value: \"clock,read-path\""), "{t}");
    }

    #[test]
    fn epp_is_selectable_but_not_in_the_default_list() {
        assert_eq!(Policy::parse("epp"), Ok(Policy::Epp));
        assert_eq!(Policy::Epp.name(), "epp");
        assert!(!Policy::ALL.contains(&Policy::Epp));
        for p in Policy::SELECTABLE {
            assert_eq!(Policy::parse(p.name()), Ok(p));
        }
        let e = Policy::parse("llm-d").unwrap_err();
        assert!(e.contains("'llm-d'") && e.contains("epp"), "{e}");
        assert!(plain_template(Policy::Epp).is_err());
    }

    #[test]
    fn the_adaptive_variant_adds_its_section_and_keeps_one_the_config_names() {
        // AI_LB_BENCH_ADAPTIVE is not set in tests: the defaults (`{}`).
        let c = with_adaptive_thresholds(r#"{"breaker":{"consecutiveFailures":5}}"#).unwrap();
        let v: serde_json::Value = serde_json::from_str(&c).unwrap();
        assert_eq!(v["breaker"]["adaptiveThresholds"], serde_json::json!({}));
        assert_eq!(v["breaker"]["consecutiveFailures"], 5);
        let c = with_adaptive_thresholds(r#"{"breaker":{"adaptiveThresholds":{"maxAdjust":0.1}}}"#)
            .unwrap();
        let v: serde_json::Value = serde_json::from_str(&c).unwrap();
        assert_eq!(v["breaker"]["adaptiveThresholds"]["maxAdjust"], 0.1);
        assert!(with_adaptive_thresholds(r#"{"breaker":3}"#).is_err());
    }

    #[test]
    fn cpu_of_this_process_is_read_and_a_gone_pid_is_not_alive() {
        let me = std::process::id();
        assert!(cpu_secs(me).is_some_and(|c| c >= 0.0));
        assert!(alive(me));
        assert!(!alive(u32::MAX));
        assert_eq!(cpu_secs(u32::MAX), None);
    }

    #[test]
    fn epp_args_default_to_a_fixed_seed() {
        // Unset in tests: only the seed.
        if std::env::var_os("AI_LB_BENCH_EPP_ARGS").is_none() {
            assert_eq!(epp_args(), vec!["--seed".to_string(), "1".to_string()]);
        }
    }

    /// The `epp` policy's lifecycle: one picker shared by a run's sidecars, finished with its
    /// CPU and picks once they exit, a fresh picker for the next run. Needs `cargo build
    /// --bins`, `cargo build --release -p ai-lb-epp` and Envoy; run with
    /// `cargo test -p ai-lb-bench -- --ignored epp_runs`.
    #[test]
    #[ignore]
    fn epp_runs_share_one_picker_and_report_its_cpu() {
        let pods: Vec<_> = (0..2)
            .map(|_| ai_lb_e2e::process::spawn_fake_pod(&["--time-scale", "0.01"]).unwrap())
            .collect();
        let addrs: Vec<SocketAddr> = pods.iter().map(|p| p.http_addr).collect();
        let body = r#"{"model":"meta-llama/Llama-3.1-8B-Instruct","prompt":"hi","max_tokens":2}"#;
        for run in 0..2 {
            let sidecars: Vec<Envoy> = (0..2)
                .map(|_| start_sidecar(Policy::Epp, &addrs, &[], 1).unwrap())
                .collect();
            for s in &sidecars {
                let r = envoy::HttpClient::new(s.listener)
                    .post_json("/v1/completions", &[], body)
                    .unwrap();
                assert_eq!(r.status, 200, "{}", r.text());
                assert_eq!(r.header("x-went-into-resp-headers"), Some("true"));
            }
            drop(sidecars);
            let u = finish_epp().expect("the run is over once its sidecars exited");
            assert_eq!((u.sidecars, u.picks), (2, 2), "run {run}: {u:?}");
            // Read (10 ms ticks: a run this short may round to 0).
            assert!(u.epp_cpu_s.is_some_and(|c| c >= 0.0), "{u:?}");
            assert_eq!(u.counters["stream_errors"], 0, "{u:?}");
        }
        assert_eq!(take_epp_usage().len(), 2);
    }

    #[test]
    fn plain_template_names_the_policy() {
        let t = plain_template(Policy::LeastRequest).unwrap();
        assert!(t.contains("lb_policy: LEAST_REQUEST"));
        assert!(!t.contains("${LB_POLICY}"));
        assert!(plain_template(Policy::AiLb).is_err());
    }
}
