//! The many-pods soak: a pool of 1,000 pods (and 100 to compare) read by 8 sidecars.
//!
//! Design (what fits 2 cores): a real agent+fake-pod pair costs ~20 MiB of RSS and a share of
//! a core (the agent scrapes its pod every 50 ms and reads its GPU every 20 ms), so 1,000 pairs
//! do not fit; the agent has no mode carrying many pods. What stays real is the path the
//! filter depends on: ONE real `ai-lb-agent` (the hub, beside one real fake pod) watches every
//! other pod as a peer over real gRPC `Watch` streams (`--peers`, one per pod) and streams the
//! whole pool to the 8 real Envoys with the real wasm filter over `WatchPool`; each sidecar
//! steers real HTTP requests to the pods' own ports. Only the pods are simulated
//! ([`super::sim_peers`]): each a `MetricsService` on a port of its own, its snapshot shaped
//! like the hub's own (same fields, its own address and moving load), changing every second.
//!
//! Measured per pool size: the pool state's size (the hub's full `WatchPool` event, and the
//! state the subscriber VM publishes to the workers), its decode and the pick timed natively
//! on the same bytes (the closest honest stand-in for the VM: V8 runs the same code, slower),
//! the Envoys' CPU while the pool only changes (no traffic) and per request under traffic,
//! their RSS and the VMs' linear memory, the hub agent's CPU and RSS, and the requests'
//! latency through the sidecars.

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use ai_lb_filter_core::config::FilterConfig;
use ai_lb_filter_core::picker::Router;
use ai_lb_proto::v1::metrics_service_client::MetricsServiceClient;
use ai_lb_proto::v1::{PeerStatus, SnapshotRequest, WatchPoolRequest};
use prost::Message;
use rand::rngs::SmallRng;
use rand::SeedableRng;
use serde_json::{json, Value};

use ai_lb_e2e::envoy::{free_port, Envoy, EnvoyOptions, Error, AGENT_FAST_ARGS};
use ai_lb_e2e::process::{Proc, Spec};
use ai_lb_loadgen::stats::Outcome;

use super::sim_peers::{Ports, SimPods};
use super::{cpu_secs, mib, quantile, rss_kib, spawn_loadgen, Report, SoakCli};

const PLUGIN: &str = r#"{"pools":[{"name":"default","cluster":"inference","agentCluster":"ai_lb_agents"}],"minPods":1}"#;

fn median_us(mut v: Vec<f64>) -> f64 {
    quantile(&mut v, 0.5).unwrap_or(0.0)
}

/// The hub's full `WatchPool` event once it lists `n` live pods: its encoded bytes.
fn full_event(
    rt: &tokio::runtime::Runtime,
    hub: SocketAddr,
    n: usize,
    limit: Duration,
) -> Result<Vec<u8>, Error> {
    let end = Instant::now() + limit;
    let mut last = 0;
    loop {
        let got = rt.block_on(async {
            let mut c = MetricsServiceClient::connect(format!("http://{hub}"))
                .await
                .map_err(|e| e.to_string())?
                .max_decoding_message_size(64 << 20);
            let mut s = c
                .watch_pool(WatchPoolRequest::default())
                .await
                .map_err(|e| e.to_string())?
                .into_inner();
            let ev = s
                .message()
                .await
                .map_err(|e| e.to_string())?
                .ok_or("no event")?;
            Ok::<_, String>(ev)
        });
        if let Ok(ev) = got {
            last = ev
                .peers
                .iter()
                .filter(|p| p.status == PeerStatus::Live as i32)
                .count();
            if ev.full && last >= n {
                return Ok(ev.encode_to_vec());
            }
        }
        if Instant::now() > end {
            return Err(format!(
                "the hub lists {last} live pods of {n} after {limit:?}"
            ));
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Decode and pick on the event's bytes, natively: (subscriber applies the event, state
/// bytes, worker installs the state, one pick), times in µs.
fn microbench(event: &[u8]) -> Result<Value, Error> {
    let cfg = || FilterConfig::from_json(PLUGIN.as_bytes()).map_err(|e| e.to_string());
    let mut sub = Router::new(cfg()?);
    let mut apply = Vec::new();
    for i in 0..30u64 {
        let t = Instant::now();
        sub.apply_pool_event_bytes(0, event, 1000 + i)
            .map_err(|e| e.to_string())?;
        apply.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let mut encode = Vec::new();
    let mut states = Vec::new();
    for _ in 0..30 {
        let t = Instant::now();
        let s = sub.pool_state(0).map(|p| p.encode()).unwrap_or_default();
        encode.push(t.elapsed().as_secs_f64() * 1e6);
        states.push(s);
        sub.apply_pool_event_bytes(0, event, 2000)
            .map_err(|e| e.to_string())?;
    }
    let mut worker = Router::new(cfg()?);
    let mut install = Vec::new();
    for s in &states {
        let t = Instant::now();
        worker
            .set_pool_state_bytes(0, s, 2000)
            .map_err(|e| e.to_string())?;
        install.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let mut rng = SmallRng::seed_from_u64(1);
    let picks = 20_000;
    let t = Instant::now();
    let mut steered = 0;
    for _ in 0..picks {
        if matches!(
            worker.decide(0, None, 2000, &mut rng),
            ai_lb_filter_core::Decision::Steer { .. }
        ) {
            steered += 1;
        }
    }
    let pick_us = t.elapsed().as_secs_f64() * 1e6 / picks as f64;
    Ok(json!({
        "build": if cfg!(debug_assertions) { "debug (not representative)" } else { "release" },
        "state_bytes": states.first().map_or(0, Vec::len),
        "apply_event_us": median_us(apply),
        "encode_state_us": median_us(encode),
        "install_state_us": median_us(install),
        "pick_us": pick_us,
        "picks_steered": steered,
        "picks": picks,
    }))
}

fn sum_cpu(pids: &[u32]) -> f64 {
    pids.iter().filter_map(|p| cpu_secs(*p)).sum()
}

fn one(
    n: usize,
    sidecars: usize,
    short: bool,
    seed: u64,
    work: &Path,
    report: &mut Report,
) -> Result<Value, Error> {
    eprintln!("[soak] pods: {n} pods, {sidecars} sidecars");
    let ports = Ports::bind(n - 1)?;
    let pod0 = Proc::spawn(&Spec::workspace(
        "ai-lb-fake-pod",
        "hub-pod",
        &[
            "--listen",
            "127.0.0.1:0",
            "--pod-name",
            "pod0",
            "--time-scale",
            "0.01",
        ]
        .map(String::from),
        &["http"],
    )?)?;
    let serving0 = pod0.addr("http")?;
    let hub_addr = SocketAddr::from(([127, 0, 0, 1], free_port()?));
    let peers: Vec<String> = ports.grpc_addrs().iter().map(|a| a.to_string()).collect();
    let mut args: Vec<String> = [
        "--grpc-listen",
        &hub_addr.to_string(),
        "--http-listen",
        "127.0.0.1:0",
        "--pod-name",
        "pod0",
        "--serving-address",
        &serving0.to_string(),
        "--gpu-source",
        "sim",
        "--sim-url",
        &format!("http://{serving0}"),
        "--model-server-url",
        &format!("http://{serving0}"),
        "--engine",
        "vllm",
        "--peers",
        &peers.join(","),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(AGENT_FAST_ARGS.iter().map(|s| s.to_string()));
    let hub = Proc::spawn(&Spec::workspace(
        "ai-lb-agent",
        "hub-agent",
        &args,
        &["grpc", "http"],
    )?)?;
    // The hub's own snapshot is the shape of every simulated pod's.
    let client_rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let template =
        ai_lb_e2e::wait::until(Duration::from_secs(30), "the hub's first snapshot", || {
            client_rt.block_on(async {
                let mut c = MetricsServiceClient::connect(format!("http://{hub_addr}"))
                    .await
                    .ok()?;
                let s = c.snapshot(SnapshotRequest {}).await.ok()?.into_inner();
                (s.inference.is_some() && !s.gpus.is_empty()).then_some(s)
            })
        })?;
    let sims = SimPods::start(ports, template, Duration::from_secs(1))?;
    let event = full_event(&client_rt, hub_addr, n, Duration::from_secs(120))?;
    let micro = microbench(&event)?;
    eprintln!("[soak] pods: {n}: event {} B, {micro}", event.len());

    let mut inference = vec![serving0];
    inference.extend(sims.serving.iter().copied());
    let mut envoys = Vec::new();
    for _ in 0..sidecars {
        let mut o = EnvoyOptions::new(PLUGIN);
        o.inference = inference.clone();
        o.agents = vec![hub_addr];
        o.concurrency = 1;
        o.ready_timeout = Duration::from_secs(60);
        envoys.push(Envoy::start(&o)?);
    }
    let gauge = "wasmcustom.ailb.pool.default.pods";
    for e in &envoys {
        e.poll(
            Duration::from_secs(120),
            "every pod in the sidecar's pool state",
            || (e.stat(gauge).unwrap_or(0) >= n as u64).then_some(()),
        )?;
    }
    let pids: Vec<u32> = envoys.iter().map(Envoy::pid).collect();
    let idle_s = if short { 5.0 } else { 30.0 };
    let (c0, h0, t) = (
        sum_cpu(&pids),
        cpu_secs(hub.pid()).unwrap_or(0.0),
        Instant::now(),
    );
    std::thread::sleep(Duration::from_secs_f64(idle_s));
    let dt = t.elapsed().as_secs_f64();
    let idle_cpu = (sum_cpu(&pids) - c0) / dt;
    let hub_cpu = (cpu_secs(hub.pid()).unwrap_or(0.0) - h0) / dt;

    // Traffic: each sidecar its own loadgen.
    let rate = 10.0;
    let load_s = if short { 6.0 } else { 30.0 };
    let steered0: u64 = envoys
        .iter()
        .map(|e| e.stat("wasmcustom.ailb.steered").unwrap_or(0))
        .sum();
    let c1 = sum_cpu(&pids);
    let t1 = Instant::now();
    let mut lgs = Vec::new();
    for (i, e) in envoys.iter().enumerate() {
        lgs.push(spawn_loadgen(
            e.listener,
            &[
                "--rate",
                &rate.to_string(),
                "--duration",
                &format!("{load_s}s"),
                "--workload",
                "fixed",
                "--prompt-tokens",
                "16",
                "--output-tokens",
                "1",
                "--timeout",
                "30s",
                "--seed",
                &(seed + i as u64).to_string(),
            ]
            .map(String::from),
            work,
            &format!("pods{n}-sidecar{i}"),
        )?);
    }
    let mut records = Vec::new();
    for l in lgs {
        records.extend(l.finish(Duration::from_secs(180))?);
    }
    let load_dt = t1.elapsed().as_secs_f64();
    let load_cpu = (sum_cpu(&pids) - c1) / load_dt;
    let steered: u64 = envoys
        .iter()
        .map(|e| e.stat("wasmcustom.ailb.steered").unwrap_or(0))
        .sum::<u64>()
        - steered0;
    let ok = records
        .iter()
        .filter(|r| matches!(r.outcome, Outcome::Ok))
        .count() as u64;
    let mut e2e: Vec<f64> = records.iter().filter_map(|r| r.e2e_ms).collect();
    let rss: Vec<u64> = pids.iter().filter_map(|p| rss_kib(*p)).collect();
    let vm: Vec<u64> = envoys
        .iter()
        .filter_map(|e| e.stat("wasmcustom.ailb.vm_memory_bytes").ok())
        .collect();
    let held: Vec<u64> = envoys.iter().map(|e| e.stat(gauge).unwrap_or(0)).collect();
    report.check(
        held.iter().all(|&h| h == n as u64),
        format!("{n} pods: the sidecars hold {held:?} pods"),
    );
    report.check(
        ok == records.len() as u64 && ok > 0,
        format!(
            "{n} pods: {} of {} requests failed",
            records.len() as u64 - ok,
            records.len()
        ),
    );
    report.check(
        steered as f64 >= 0.95 * ok as f64,
        format!("{n} pods: only {steered} of {ok} requests steered by score"),
    );
    report.check(
        envoys.iter().all(|e| !e.wasm_failed()),
        format!("{n} pods: a wasm VM trapped or panicked"),
    );
    let r = json!({
        "pods": n,
        "sidecars": sidecars,
        "watchpool_full_event_bytes": event.len(),
        "micro": micro,
        "envoy_cpu_idle_cores_total": idle_cpu,
        "envoy_cpu_idle_cores_per_sidecar": idle_cpu / sidecars as f64,
        "envoy_cpu_under_load_cores_total": load_cpu,
        "envoy_cpu_ms_per_request": if ok > 0 { (load_cpu - idle_cpu).max(0.0) * load_dt * 1000.0 / ok as f64 } else { 0.0 },
        "hub_agent_cpu_cores": hub_cpu,
        "hub_agent_rss_mib": mib(rss_kib(hub.pid()).unwrap_or(0)),
        "envoy_rss_mib_max": mib(rss.iter().copied().max().unwrap_or(0)),
        "vm_memory_mib_max": mib(vm.iter().copied().max().unwrap_or(0) / 1024),
        "requests": records.len(), "ok": ok, "steered": steered,
        "e2e_ms_p50": quantile(&mut e2e, 0.5), "e2e_ms_p99": quantile(&mut e2e, 0.99),
    });
    drop(envoys);
    drop(sims);
    drop(hub);
    drop(pod0);
    Ok(r)
}

pub fn run(cli: &SoakCli, work: &Path) -> Result<Report, Error> {
    let mut report = Report::default();
    let mut rows = Vec::new();
    for &n in &cli.pods {
        let n = if cli.short { n.min(200) } else { n };
        rows.push(one(
            n,
            if cli.short {
                cli.sidecars.min(4)
            } else {
                cli.sidecars
            },
            cli.short,
            cli.seed,
            work,
            &mut report,
        )?);
    }
    let mut body = String::from(
        "One real `ai-lb-agent` (the hub, beside a real fake pod) watches every other pod over gRPC \
         `Watch` (`--peers`) and streams the pool to each sidecar (a real Envoy 1.40, `--concurrency 1`, \
         the wasm filter) over `WatchPool`; the other pods are simulated in one process (each its own \
         gRPC port with the `Watch` contract and snapshots shaped like the hub's, load changing every \
         second, and its own HTTP port answering at once). 1,000 real agent+pod pairs do not fit this \
         2-core VM (~20 MiB and a share of a core each). Decode and pick are timed natively on the \
         hub's real `WatchPool` bytes (the VM runs the same code under V8); the Envoys' CPU is \
         measured from /proc.\n\n",
    );
    body.push_str("| pods | full WatchPool event | published state | apply event (µs, native) | install state in a worker (µs, native) | pick (µs, native) | Envoy CPU, pool changes only (cores, all sidecars) | Envoy CPU per request (ms) | Envoy RSS (MiB, max) | VM memory (MiB, max) | hub agent CPU (cores) / RSS (MiB) | e2e p50 / p99 (ms) |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for r in &rows {
        let m = &r["micro"];
        let f = |v: &Value| v.as_f64().map_or("–".into(), |x| format!("{x:.1}"));
        let f3 = |v: &Value| v.as_f64().map_or("–".into(), |x| format!("{x:.3}"));
        body.push_str(&format!(
            "| {} | {} KiB | {} KiB | {} | {} | {} | {} | {} | {} | {} | {} / {} | {} / {} |\n",
            r["pods"],
            r["watchpool_full_event_bytes"].as_u64().unwrap_or(0) / 1024,
            m["state_bytes"].as_u64().unwrap_or(0) / 1024,
            f(&m["apply_event_us"]),
            f(&m["install_state_us"]),
            f3(&m["pick_us"]),
            f3(&r["envoy_cpu_idle_cores_total"]),
            f3(&r["envoy_cpu_ms_per_request"]),
            f(&r["envoy_rss_mib_max"]),
            f(&r["vm_memory_mib_max"]),
            f3(&r["hub_agent_cpu_cores"]),
            f(&r["hub_agent_rss_mib"]),
            f(&r["e2e_ms_p50"]),
            f(&r["e2e_ms_p99"]),
        ));
    }
    body.push_str(&format!(
        "\nNative timings: {} build of the driver, medians of 30 (pick: mean of 20,000).\n",
        if cfg!(debug_assertions) {
            "a debug (NOT representative)"
        } else {
            "a release"
        }
    ));
    body.push_str(
        "\nChecked: every sidecar holds every pod (`ailb.pool.default.pods`), every request answered \
         200, at least 95 % steered by score, no VM trap.\n",
    );
    report.title = "Many pods soak".into();
    report.body = body;
    report.json = json!({"soak": "pods", "rows": rows});
    Ok(report)
}
