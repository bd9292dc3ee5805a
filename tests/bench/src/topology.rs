//! Decides what runs during a benchmark: a heterogeneous pool of fake GPU pods, each with its
//! collector agent (agents peered so any one's WatchPool covers the pool), and per policy a
//! set of independent client sidecars (one Envoy process each, as in a mesh, so least_request
//! sees only its own in-flight requests). Reuses the e2e harness to spawn and render.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ai_lb_e2e::envoy::{self, Envoy, EnvoyOptions};
use ai_lb_e2e::process::{Proc, Spec};

/// The agents' `--rate-window` (their default; the bench does not set it).
const AGENT_RATE_WINDOW: Duration = Duration::from_secs(5);

pub type Error = String;

/// The routing policies compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Policy {
    RoundRobin,
    LeastRequest,
    AiLb,
}

impl Policy {
    pub const ALL: [Policy; 3] = [Policy::RoundRobin, Policy::LeastRequest, Policy::AiLb];

    /// Parses a policy name as [`Policy::name`] writes it.
    pub fn parse(s: &str) -> Result<Policy, Error> {
        Policy::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                format!("invalid value '{s}' for '--policies': expected round_robin, least_request or ai_lb")
            })
    }

    pub fn name(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round_robin",
            Policy::LeastRequest => "least_request",
            Policy::AiLb => "ai_lb",
        }
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

/// How the fake pods are shaped.
#[derive(Debug, Clone)]
pub struct PodShape {
    pub h100: usize,
    pub a100: usize,
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

/// One pod and its agent.
#[derive(Debug)]
pub struct Pod {
    pub name: String,
    pub preset: &'static str,
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
    pub fn start(shape: &PodShape, agents: bool) -> Result<Pool, Error> {
        let pod_bin = release_bin("ai-lb-fake-pod")?;
        let mut pods = Vec::new();
        let presets = std::iter::repeat_n(("h100-8b", "h100"), shape.h100)
            .chain(std::iter::repeat_n(("a100-8b", "a100"), shape.a100));
        let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
        for (i, (preset, short)) in presets.enumerate() {
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
                "--seed".into(),
                (i + 1).to_string(),
                "--time-scale".into(),
                shape.time_scale.to_string(),
                "--max-num-seqs".into(),
                shape.max_num_seqs.to_string(),
                "--kv-cache-tokens".into(),
                shape.kv_cache_tokens.to_string(),
            ];
            let proc = Proc::spawn(&spec(&pod_bin, &name, args, &["http"]))?;
            let addr = proc.addr("http")?;
            pods.push(Pod {
                name,
                preset,
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
            let p = spawn_agent(
                &pod.name,
                grpc[i],
                pod.addr,
                pod.addr,
                &peers,
                shape.max_num_seqs,
                shape.sample_interval_ms,
                shape.gpu_sample_interval_ms,
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
    /// until the agents' rate windows no longer hold the previous phase: requests cut off by
    /// the client (calibration kills its generators, timeouts) count as aborts, which the
    /// agents report as errors for a rate window, and ai-lb's breakers would open on them at
    /// the start of the next run.
    pub fn wait_idle(&self, deadline: Duration) -> Result<(), Error> {
        let end = Instant::now() + deadline;
        loop {
            if self.busy()? == 0.0 {
                std::thread::sleep(AGENT_RATE_WINDOW + Duration::from_millis(500));
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
        Policy::AiLb => return Err("ai_lb uses envoy-config/envoy.yaml".into()),
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
        p => {
            let mut o = EnvoyOptions::new("{}");
            o.template = Some(plain_template(p)?);
            o
        }
    };
    start_with(opts, upstreams, agents, concurrency)
}

/// Starts an ai-lb sidecar as [`start_sidecar`] does, running the wasm build at `wasm` instead
/// of `$AI_LB_WASM` (a second build of the filter, to compare two in the same run).
pub fn start_sidecar_with_wasm(
    wasm: &Path,
    upstreams: &[SocketAddr],
    agents: &[SocketAddr],
    concurrency: u32,
) -> Result<Envoy, Error> {
    let mut opts = EnvoyOptions::new(ailb_filter_config()?);
    let t = envoy::template()?;
    if !t.contains("${WASM_PATH}") {
        return Err("envoy-config/envoy.yaml: no ${WASM_PATH} placeholder".into());
    }
    opts.template = Some(t.replace("${WASM_PATH}", &wasm.display().to_string()));
    start_with(opts, upstreams, agents, concurrency)
}

/// The second wasm build of the overhead run's `wasm-b`: `$AI_LB_WASM_B` (required).
pub fn wasm_b_path() -> Result<PathBuf, Error> {
    let p = std::env::var_os("AI_LB_WASM_B")
        .map(PathBuf::from)
        .ok_or("--overhead-filter wasm-b needs AI_LB_WASM_B (the second build's .wasm)")?;
    if p.exists() {
        Ok(p)
    } else {
        Err(format!("AI_LB_WASM_B={} does not exist", p.display()))
    }
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
    let mut config = envoy::native_filter_config(&ailb_filter_config()?, agents)?;
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
    fn plain_template_names_the_policy() {
        let t = plain_template(Policy::LeastRequest).unwrap();
        assert!(t.contains("lb_policy: LEAST_REQUEST"));
        assert!(!t.contains("${LB_POLICY}"));
        assert!(plain_template(Policy::AiLb).is_err());
    }
}
