//! The churn soak: under steady traffic, pods join and leave every few seconds, agents
//! restart, and the plugin config is reloaded every 10 s; the filter's and the agents' per-pod
//! state must stay bounded with departed pods pruned, and no request may be lost beyond those
//! in flight on a departed pod.
//!
//! How pods come and go, as in a cluster:
//! - Envoy reads its listener (the plugin config) from an LDS file and both clusters' endpoints
//!   (`inference`: the pods; `ai_lb_agents`: their agents) from EDS files
//!   (`ai_lb_e2e::xds_files`). A joining pod is added to both, a leaving one removed from both,
//!   then stopped after a drain of [`DRAIN`] (what a Kubernetes endpoint removal does before
//!   the kubelet's SIGTERM).
//! - Each pod has its own loopback IP (127.0.x.y, never reused in a run, like pod IPs) and its
//!   agent listens on that IP at one port shared by all, so the agents find each other by DNS
//!   as behind a headless Service: `--peers-dns pool.ailb.soak:<port>` re-resolved every second.
//!   The name is answered from a hosts file the soak rewrites (by rename) on every join and
//!   leave; each agent runs in a mount namespace of its own (`unshare -rm`) whose `/etc` is a
//!   directory holding that hosts file (and `nsswitch.conf: hosts: files`, `host.conf: multi
//!   on`), so the real resolver (getaddrinfo) answers it and nothing outside the soak changes.
//! - The agent learns a pod from DNS and forgets it (REMOVED, then pruned after 12 refreshes);
//!   the filter learns pods from the agent's `WatchPool` and drops a peer on REMOVED or when a
//!   full event no longer lists it.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use ai_lb_e2e::envoy::{
    free_port, http_get, native_filter_config, native_template, workspace_bin, EnvoyOptions, Error,
    AGENT_FAST_ARGS,
};
use ai_lb_e2e::process::{Proc, Spec};
use ai_lb_e2e::xds_files::{Applied, XdsEnvoy};

use super::{agent_peers, mib, rss_kib, spawn_loadgen, stat, Report, SoakCli};

const DNS_NAME: &str = "pool.ailb.soak";
/// Between a pod's removal from EDS and its SIGTERM.
const DRAIN: Duration = Duration::from_secs(3);
const STATUS_PATH: &str = "/ai-lb/status";
/// Envoy's `--drain-time-s`: how long connections of a listener replaced by a reload live on.
const DRAIN_TIME_S: u64 = 15;
/// The agents' `--peers-refresh`; a REMOVED peer is pruned after 12 of them.
const PEERS_REFRESH_S: f64 = 1.0;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DataPath {
    Wasm,
    Native,
}

impl DataPath {
    fn prefix(self) -> &'static str {
        match self {
            DataPath::Wasm => "wasmcustom.",
            DataPath::Native => "dynamicmodulescustom.",
        }
    }
}

/// One pod and its agent.
struct Member {
    name: String,
    ip: Ipv4Addr,
    pod: Proc,
    agent: Proc,
    agent_args: Vec<String>,
    serving: SocketAddr,
    grpc: SocketAddr,
    http: SocketAddr,
}

/// Everything the churn loop changes.
struct Cluster {
    etc: PathBuf,
    agent_port: u16,
    next_ip: u32,
    members: Vec<Member>,
    /// Removed from EDS and DNS, stopped at the instant given.
    leaving: Vec<(Member, Instant)>,
    pod_bin: PathBuf,
    agent_bin: PathBuf,
    time_scale: f64,
}

impl Cluster {
    fn new(work: &Path, time_scale: f64) -> Result<Cluster, Error> {
        let etc = work.join("etc");
        let _ = std::fs::remove_dir_all(&etc);
        std::fs::create_dir_all(&etc).map_err(|e| format!("creating {}: {e}", etc.display()))?;
        // What the agent's process needs of /etc once its own is replaced: the dynamic
        // linker's cache, and a resolver that reads only the hosts file (all its entries).
        if Path::new("/etc/ld.so.cache").exists() {
            std::fs::copy("/etc/ld.so.cache", etc.join("ld.so.cache"))
                .map_err(|e| format!("copying /etc/ld.so.cache: {e}"))?;
        }
        for (f, text) in [
            ("nsswitch.conf", "hosts: files\n"),
            ("host.conf", "multi on\n"),
            ("resolv.conf", ""),
            ("hosts", ""),
        ] {
            std::fs::write(etc.join(f), text).map_err(|e| format!("writing {f}: {e}"))?;
        }
        Ok(Cluster {
            etc,
            agent_port: free_port()?,
            next_ip: 0,
            members: Vec::new(),
            leaving: Vec::new(),
            pod_bin: workspace_bin("ai-lb-fake-pod")?,
            agent_bin: workspace_bin("ai-lb-agent")?,
            time_scale,
        })
    }

    /// Rewrites the hosts file (by rename) with the members' IPs.
    fn write_hosts(&self) -> Result<(), Error> {
        let text: String = self
            .members
            .iter()
            .map(|m| format!("{} {DNS_NAME}\n", m.ip))
            .collect();
        let tmp = self.etc.join(".hosts.tmp");
        std::fs::write(&tmp, text).map_err(|e| format!("writing hosts: {e}"))?;
        std::fs::rename(&tmp, self.etc.join("hosts")).map_err(|e| format!("renaming hosts: {e}"))
    }

    fn spawn_agent(&self, name: &str, args: &[String]) -> Result<Proc, Error> {
        // `unshare` execs the shell, which execs the agent: one process (one pid) throughout.
        let mut a = vec![
            "-rm".to_string(),
            "sh".into(),
            "-c".into(),
            r#"mount --bind "$0" /etc && exec "$@""#.into(),
            self.etc.display().to_string(),
            self.agent_bin.display().to_string(),
        ];
        a.extend(args.iter().cloned());
        Proc::spawn(&Spec {
            name: format!("agent-{name}"),
            program: PathBuf::from("unshare"),
            args: a,
            env: Vec::new(),
            listening: vec!["grpc".into(), "http".into()],
            deadline: Duration::from_secs(30),
        })
    }

    /// Starts a pod and its agent on the next unused loopback IP (not yet in DNS or EDS).
    fn start_member(&mut self) -> Result<Member, Error> {
        let n = self.next_ip;
        self.next_ip += 1;
        if n >= 250 * 250 {
            return Err("out of loopback IPs".into());
        }
        let ip = Ipv4Addr::new(127, 1 + (n / 250) as u8, 1 + (n % 250) as u8, 1);
        let name = format!("pod{n}");
        let pod = Proc::spawn(&Spec {
            name: name.clone(),
            program: self.pod_bin.clone(),
            args: [
                "--listen",
                &format!("{ip}:0"),
                "--pod-name",
                &name,
                "--seed",
                &(n + 1).to_string(),
                "--time-scale",
                &self.time_scale.to_string(),
            ]
            .iter()
            .map(|s| s.to_string())
            .collect(),
            env: Vec::new(),
            listening: vec!["http".into()],
            deadline: Duration::from_secs(30),
        })?;
        let serving = pod.addr("http")?;
        let mut agent_args: Vec<String> = [
            "--grpc-listen",
            &format!("{ip}:{}", self.agent_port),
            "--http-listen",
            &format!("{ip}:0"),
            "--pod-name",
            &name,
            "--serving-address",
            &serving.to_string(),
            "--gpu-source",
            "sim",
            "--sim-url",
            &format!("http://{serving}"),
            "--model-server-url",
            &format!("http://{serving}"),
            "--engine",
            "vllm",
            "--peers-dns",
            &format!("{DNS_NAME}:{}", self.agent_port),
            "--peers-refresh",
            &format!("{}ms", (PEERS_REFRESH_S * 1000.0) as u64),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        agent_args.extend(AGENT_FAST_ARGS.iter().map(|s| s.to_string()));
        let agent = self.spawn_agent(&name, &agent_args)?;
        let grpc = agent.addr("grpc")?;
        let http = agent.addr("http")?;
        Ok(Member {
            name,
            ip,
            pod,
            agent,
            agent_args,
            serving,
            grpc,
            http,
        })
    }

    fn serving(&self) -> Vec<SocketAddr> {
        self.members.iter().map(|m| m.serving).collect()
    }

    fn grpcs(&self) -> Vec<SocketAddr> {
        self.members.iter().map(|m| m.grpc).collect()
    }
}

/// Tells Envoy the current members (both clusters); each update must be accepted.
fn publish(x: &mut XdsEnvoy, c: &Cluster) -> Result<(), Error> {
    for (cluster, addrs) in [("inference", c.serving()), ("ai_lb_agents", c.grpcs())] {
        if x.set_endpoints(cluster, &addrs)? != Applied::Accepted {
            return Err(format!("Envoy rejected the EDS update of {cluster}"));
        }
    }
    Ok(())
}

/// The plugin config; `variant` alternates a field at every reload (the staleness cut).
fn plugin_config(variant: u64) -> Value {
    json!({
        "pools": [{"name": "default", "cluster": "inference", "agentCluster": "ai_lb_agents"}],
        "minPods": 1,
        "statusPath": STATUS_PATH,
        "cutoffs": {"stalenessMs": if variant % 2 == 0 { 5000 } else { 4000 }},
        "watch": {"refreshMs": 20, "minIntervalMs": 50, "heartbeatMs": 300,
                  "reconnectBaseMs": 100, "reconnectMaxMs": 1000}
    })
}

fn carried(path: DataPath, variant: u64, agents: &[SocketAddr]) -> Result<String, Error> {
    let filter = plugin_config(variant).to_string();
    match path {
        DataPath::Wasm => Ok(filter),
        // The module reaches the agents itself: each reload names the current ones.
        DataPath::Native => native_filter_config(&filter, agents),
    }
}

/// Distinct pods that have per-pod stats in Envoy (departed ones included: Envoy keeps stats).
fn endpoint_stat_pods(stats: &std::collections::BTreeMap<String, u64>, path: DataPath) -> usize {
    let mut pods = std::collections::BTreeSet::new();
    for k in stats.keys() {
        let addr = match path {
            DataPath::Wasm => k
                .strip_prefix("wasmcustom.ailb.endpoint.")
                .and_then(|r| r.rsplit_once('.').map(|(a, _)| a)),
            DataPath::Native => k
                .strip_prefix("dynamicmodulescustom.ailb.endpoint.")
                .and_then(|r| r.split_once(".ailb_endpoint.").map(|(_, a)| a)),
        };
        if let Some(a) = addr {
            pods.insert(a.to_string());
        }
    }
    pods.len()
}

/// Pods on the status page (one worker's router).
fn status_pods(x: &XdsEnvoy) -> Option<usize> {
    let r = http_get(x.envoy.listener, STATUS_PATH).ok()?;
    let v: Value = serde_json::from_slice(&r.body).ok()?;
    Some(v["pools"][0]["pods"].as_array()?.len())
}

pub fn run(cli: &SoakCli, work: &Path) -> Result<Report, Error> {
    let path = match cli.data_path.as_str() {
        "wasm" => DataPath::Wasm,
        "native" => DataPath::Native,
        other => return Err(format!("invalid --data-path {other:?}: wasm or native")),
    };
    let secs = cli.secs.unwrap_or(if cli.short { 40.0 } else { 600.0 });
    let (event_every, restart_every, reload_every) = (3.0, 12.0, 10.0);
    let (min_pods, max_pods, start_pods) = (3usize, 7usize, 5usize);
    let rate = 20.0;
    let mut rng_state = cli.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut rand = move || {
        // xorshift64: a seeded order of events.
        rng_state ^= rng_state << 13;
        rng_state ^= rng_state >> 7;
        rng_state ^= rng_state << 17;
        rng_state
    };

    let mut c = Cluster::new(work, 0.2)?;
    for _ in 0..start_pods {
        let m = c.start_member()?;
        c.members.push(m);
    }
    c.write_hosts()?;
    let mut variant = 0u64;
    let mut opts = EnvoyOptions::new(carried(path, variant, &c.grpcs())?);
    if path == DataPath::Native {
        opts.template = Some(native_template()?);
    }
    opts.inference = c.serving();
    opts.agents = c.grpcs();
    // A listener replaced by a reload keeps its connections this long, then closes them with
    // whatever is in flight: longer than any request here (a 2 s drain lost 21 requests at one
    // reload in a short run on a CPU-starved moment). Istio's default is 45 s.
    let mut x = XdsEnvoy::start(&opts, &["--drain-time-s".into(), DRAIN_TIME_S.to_string()])?;
    let prefix = path.prefix();
    let steered = format!("{prefix}ailb.steered");
    x.envoy
        .poll(Duration::from_secs(60), "the filter to steer", || {
            let r = ai_lb_e2e::envoy::HttpClient::new(x.envoy.listener)
                .post_json(
                    "/v1/completions",
                    &[("connection", "close")],
                    r#"{"prompt":"hi","max_tokens":2}"#,
                )
                .ok()?;
            (r.status == 200 && x.envoy.stat(&steered).unwrap_or(0) > 0).then_some(())
        })?;
    eprintln!(
        "[soak] churn ({path:?}): {start_pods} pods up, Envoy {}, {secs} s of churn",
        x.envoy.listener
    );

    let lg = spawn_loadgen(
        x.envoy.listener,
        &[
            "--rate".into(),
            rate.to_string(),
            "--duration".into(),
            format!("{secs}s"),
            "--workload".into(),
            "fixed".into(),
            "--prompt-tokens".into(),
            "64".into(),
            "--output-tokens".into(),
            "16".into(),
            "--timeout".into(),
            "30s".into(),
            "--seed".into(),
            cli.seed.to_string(),
        ],
        work,
        "churn",
    )?;

    let t0 = Instant::now();
    let mut series: Vec<Value> = Vec::new();
    // (t, pod) of each EDS removal, and (t_kill) of each stop.
    let mut departures: Vec<(f64, String)> = Vec::new();
    let mut kills: Vec<f64> = Vec::new();
    let (mut joins, mut leaves, mut restarts, mut reloads) = (0u32, 0u32, 0u32, 0u32);
    let mut next_event = event_every;
    let mut next_restart = restart_every;
    let mut next_reload = reload_every;
    let mut next_sample = 0.0;
    let quiesce = 20.0;
    let mut report = Report::default();
    loop {
        let t = t0.elapsed().as_secs_f64();
        if t >= secs + quiesce {
            break;
        }
        let churning = t < secs;
        // Stop the pods whose drain is over.
        let now = Instant::now();
        let mut i = 0;
        while i < c.leaving.len() {
            if c.leaving[i].1 <= now {
                let (mut m, _) = c.leaving.remove(i);
                let _ = m.agent.sigterm();
                let _ = m.pod.sigterm();
                let _ = m.agent.wait_exit(Duration::from_secs(5));
                let _ = m.pod.wait_exit(Duration::from_secs(5));
                m.agent.kill();
                m.pod.kill();
                kills.push(t0.elapsed().as_secs_f64());
            } else {
                i += 1;
            }
        }
        if churning && t >= next_event {
            next_event += event_every;
            let n = c.members.len();
            let join = if n <= min_pods {
                true
            } else if n >= max_pods {
                false
            } else {
                rand() % 2 == 0
            };
            if join {
                let m = c.start_member()?;
                c.members.push(m);
                c.write_hosts()?;
                publish(&mut x, &c)?;
                joins += 1;
            } else {
                let idx = (rand() % n as u64) as usize;
                let m = c.members.remove(idx);
                c.write_hosts()?;
                publish(&mut x, &c)?;
                departures.push((t, m.serving.to_string()));
                c.leaving.push((m, Instant::now() + DRAIN));
                leaves += 1;
            }
        }
        if churning && t >= next_restart && !c.members.is_empty() {
            next_restart += restart_every;
            let idx = (rand() % c.members.len() as u64) as usize;
            let name = c.members[idx].name.clone();
            let args = c.members[idx].agent_args.clone();
            {
                let m = &mut c.members[idx];
                m.agent.sigterm()?;
                m.agent.wait_exit(Duration::from_secs(10))?;
            }
            let agent = c.spawn_agent(&name, &args)?;
            let m = &mut c.members[idx];
            m.http = agent.addr("http")?;
            m.grpc = agent.addr("grpc")?;
            m.agent = agent;
            restarts += 1;
        }
        if churning && t >= next_reload {
            next_reload += reload_every;
            variant += 1;
            match x.set_filter_config(&carried(path, variant, &c.grpcs())?)? {
                Applied::Accepted => reloads += 1,
                Applied::Rejected => {
                    report.check(false, format!("plugin config reload {variant} rejected"))
                }
            }
        }
        if t >= next_sample {
            next_sample += 1.0;
            let stats = x.envoy.stats().unwrap_or_default();
            let mut agent_rss_max = 0u64;
            let mut entries_max = 0u64;
            let mut removed_max = 0u64;
            for m in &c.members {
                agent_rss_max = agent_rss_max.max(rss_kib(m.agent.pid()).unwrap_or(0));
                if let Some(p) = agent_peers(m.http) {
                    entries_max = entries_max.max(p.values().sum());
                    removed_max = removed_max.max(p.get("removed").copied().unwrap_or(0));
                }
            }
            series.push(json!({
                "t": (t0.elapsed().as_secs_f64() * 1000.0).round() / 1000.0,
                "pods_present": c.members.len(),
                "pods_draining": c.leaving.len(),
                "filter_pods": stats.get(&format!("{prefix}ailb.pool.default.pods")).copied(),
                "status_pods": status_pods(&x),
                "vm_memory_mib": stats.get(&format!("{prefix}ailb.vm_memory_bytes")).map(|b| mib(b / 1024)),
                "envoy_rss_mib": mib(rss_kib(x.envoy.pid()).unwrap_or(0)),
                "envoy_endpoint_stat_pods": endpoint_stat_pods(&stats, path),
                "agent_rss_mib_max": mib(agent_rss_max),
                "agent_entries_max": entries_max,
                "agent_removed_max": removed_max,
                "steered": stat(&stats, &steered),
            }));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let records = lg.finish(Duration::from_secs(120))?;
    let total_s = t0.elapsed().as_secs_f64();

    // Requests: a failure is explained when it was in flight while a departed pod was stopped.
    let mut failed = 0u64;
    let mut explained = 0u64;
    let mut examples = Vec::new();
    for r in &records {
        if matches!(r.outcome, ai_lb_loadgen::stats::Outcome::Ok) {
            continue;
        }
        failed += 1;
        let start = r.sent_us as f64 / 1e6;
        let end = start + r.e2e_ms.unwrap_or(30_000.0) / 1000.0;
        if kills.iter().any(|k| *k >= start - 0.5 && *k <= end + 0.5) {
            explained += 1;
        } else if examples.len() < 5 {
            examples.push(format!(
                "id {} at {start:.1}s: {:?} {:?} {:?}",
                r.id, r.outcome, r.status, r.error
            ));
        }
    }
    let ok = records.len() as u64 - failed;

    // Bounds over the series.
    let departed_within = |t: f64, w: f64| {
        departures
            .iter()
            // A sample follows the events of its loop turn, so a departure a moment before
            // the sample's time counts.
            .filter(|(d, _)| *d <= t + 0.05 && *d > t - w)
            .count() as u64
    };
    let mut worst_filter = 0i64;
    let mut worst_agent = 0i64;
    for row in &series {
        let t = row["t"].as_f64().unwrap_or(0.0);
        let present = row["pods_present"].as_u64().unwrap_or(0);
        // The filter drops a departed pod once its agent reports it REMOVED (a DNS refresh
        // later); the agents keep it REMOVED for 12 refreshes.
        let filter_bound = present + departed_within(t, 15.0);
        let agent_bound = present + departed_within(t, 12.0 * PEERS_REFRESH_S + 8.0);
        for key in ["filter_pods", "status_pods"] {
            if let Some(v) = row[key].as_u64() {
                worst_filter = worst_filter.max(v as i64 - filter_bound as i64);
                report.check(
                    v <= filter_bound,
                    format!("t={t}: {key} {v} > {filter_bound} (pods present + departed in the last 15 s)"),
                );
            }
        }
        if let Some(v) = row["agent_entries_max"].as_u64() {
            worst_agent = worst_agent.max(v as i64 - agent_bound as i64);
            report.check(
                v <= agent_bound,
                format!("t={t}: an agent holds {v} peers > {agent_bound} (pods present + departed in the last 20 s)"),
            );
        }
    }
    // After the quiet period: exactly the present pods, nothing REMOVED left.
    let last = series.last().cloned().unwrap_or(Value::Null);
    let present = last["pods_present"].as_u64().unwrap_or(0);
    if path == DataPath::Wasm {
        report.check(
            last["filter_pods"].as_u64() == Some(present),
            format!(
                "after {quiesce} s without churn the filter holds {} pods, {present} present",
                last["filter_pods"]
            ),
        );
    }
    report.check(
        last["status_pods"].as_u64() == Some(present),
        format!(
            "after {quiesce} s without churn the status page lists {} pods, {present} present",
            last["status_pods"]
        ),
    );
    report.check(
        last["agent_entries_max"].as_u64() == Some(present.saturating_sub(1))
            && last["agent_removed_max"].as_u64() == Some(0),
        format!(
            "after {quiesce} s without churn an agent holds {} peers ({} removed); {} expected",
            last["agent_entries_max"],
            last["agent_removed_max"],
            present.saturating_sub(1)
        ),
    );
    report.check(
        failed == explained,
        format!(
            "{} requests lost that were not in flight on a departed pod: {examples:?}",
            failed - explained
        ),
    );
    report.check(
        ok as f64 >= 0.8 * rate * secs,
        format!(
            "only {ok} requests answered of ~{} sent",
            (rate * secs) as u64
        ),
    );
    report.check(
        joins > 0 && leaves > 0 && reloads > 0 && restarts > 0,
        "no churn happened",
    );
    // Memory: bounded, and no growth once warm (the second half against the first).
    let half = secs / 2.0;
    for (key, cap, slack) in [
        ("vm_memory_mib", 128.0, 8.0),
        ("agent_rss_mib_max", 256.0, 16.0),
        ("envoy_rss_mib", 1024.0, 64.0),
    ] {
        let first = super::max_in(&series, key, 5.0, half);
        let second = super::max_in(&series, key, half, secs + quiesce + 1.0);
        if let (Some(a), Some(b)) = (first, second) {
            report.check(b <= cap, format!("{key} reached {b} MiB (bound {cap})"));
            report.check(
                b <= a + slack,
                format!("{key} grew from {a} MiB (first half) to {b} MiB (second half), more than {slack}"),
            );
        }
    }
    if !x.envoy.log().is_empty() && x.envoy.wasm_failed() {
        report.check(false, "the wasm VM trapped or panicked (see the Envoy log)");
    }

    let fmt = |v: Option<f64>| v.map_or("–".to_string(), |v| format!("{v}"));
    let first_max = |k: &str| fmt(super::max_in(&series, k, 0.0, half));
    let second_max = |k: &str| fmt(super::max_in(&series, k, half, total_s + 1.0));
    let mut body = format!(
        "Real Envoy 1.40 (`--concurrency 2`) with the {path:?} filter; listener from LDS, pods and agents \
         from EDS (files, `watched_directory`, written by rename; `--drain-time-s {DRAIN_TIME_S}`); {start_pods} pods at the start, \
         between {min_pods} and {max_pods}, each a fake pod (`--time-scale 0.2`) with its agent on a \
         loopback IP of its own. Every {event_every} s a pod joins or leaves (a leaving pod is removed \
         from EDS and DNS and stopped {} s later), every {restart_every} s an agent restarts, every \
         {reload_every} s the plugin config is reloaded through LDS; {rate} req/s of steady traffic \
         (`ai-lb-loadgen`, fixed 64-token prompts, 16-token answers) for {secs} s, then {quiesce} s \
         without churn. Agents find each other by DNS (`--peers-dns`, a hosts file in a mount \
         namespace per agent, refreshed every {PEERS_REFRESH_S} s).\n\n",
        DRAIN.as_secs()
    );
    body.push_str(&format!(
        "| events | count |\n|---|---|\n| pods joined | {joins} |\n| pods left | {leaves} |\n\
         | agent restarts | {restarts} |\n| config reloads (LDS, accepted) | {reloads} |\n\
         | requests answered 200 | {ok} |\n| requests failed | {failed} (in flight on a stopped pod: {explained}) |\n\n"
    ));
    body.push_str(
        "| per-pod state and memory | max, first half | max, second half | at the end |\n|---|---|---|---|\n",
    );
    for (label, key) in [
        ("pods present", "pods_present"),
        (
            "filter: pods in the pool state (`ailb.pool.default.pods`)",
            "filter_pods",
        ),
        (
            "filter: pods on the status page (a worker's router)",
            "status_pods",
        ),
        (
            "agent: peers held, most of any agent (`ai_lb_agent_peers`, all statuses)",
            "agent_entries_max",
        ),
        ("agent: REMOVED peers not yet pruned", "agent_removed_max"),
        ("VM memory, MiB (`ailb.vm_memory_bytes`)", "vm_memory_mib"),
        ("agent RSS, MiB (largest)", "agent_rss_mib_max"),
        ("Envoy RSS, MiB", "envoy_rss_mib"),
        (
            "Envoy: pods with per-pod stats (departed included)",
            "envoy_endpoint_stat_pods",
        ),
    ] {
        body.push_str(&format!(
            "| {label} | {} | {} | {} |\n",
            first_max(key),
            second_max(key),
            last[key]
        ));
    }
    body.push_str(&format!(
        "\nBounds checked at every 1 s sample: the filter's pods (gauge and status page) ≤ pods \
         present + pods departed in the last 15 s (worst margin: {worst_filter:+}); each agent's \
         peers ≤ present + departed in the last 20 s (worst: {worst_agent:+}); after the quiet \
         period exactly the present pods and no REMOVED peer; memory in the second half within a \
         slack of the first half's maximum; no lost request other than one in flight on a pod \
         being stopped.\n\nNot pruned, by design: Envoy keeps the per-pod stats \
         (`ailb.endpoint.<ip:port>.*`) of every pod it ever saw (proxy-wasm cannot delete a \
         stat): the last row grows with every new pod address. Plot: `churn.png`.\n"
    ));
    report.title = format!("Churn soak ({path:?})");
    report.body = body;
    report.json = json!({
        "soak": "churn",
        "data_path": format!("{path:?}").to_lowercase(),
        "secs": secs,
        "events": {"joins": joins, "leaves": leaves, "agent_restarts": restarts, "reloads": reloads},
        "requests": {"ok": ok, "failed": failed, "failed_in_flight_on_stopped_pod": explained},
        "departures": departures.iter().map(|(t, p)| json!({"t": t, "pod": p})).collect::<Vec<_>>(),
        "series": series,
    });
    // Stop everything before the report is written.
    drop(x);
    for (mut m, _) in c.leaving.drain(..) {
        m.agent.kill();
        m.pod.kill();
    }
    Ok(report)
}
