//! Measures the filter's memory with large pools: a real Envoy (`--concurrency 1`) runs the
//! filter against an in-process `ai_lb.v1.MetricsService` that serves `WatchPool` with N
//! synthetic pods (realistic snapshots: one GPU, inference stats, a model) and updates every pod
//! at 10 Hz. It samples the filter gauge `ailb.vm_memory_bytes` (wasm linear memory of the VM
//! that wrote it last) and Envoy's RSS (`/proc/<pid>/status`), against a baseline Envoy with the
//! same N cluster members whose agent serves an empty pool; at the largest N it samples for the
//! soak time to show growth or its absence.
//!
//! Run by hand, in release (a debug build of this driver cannot generate 1024-pod events at
//! 10 Hz; it then delivers fewer and its pods answer late), with the wasm filter built
//! (`cargo build -p ai-lb-filter-wasm --target wasm32-wasip1 --release`):
//! `cargo run --release -p ai-lb-e2e --example vm_memory -- [--pods 64,256,1024] [--secs 20]
//! [--soak-secs 120] [--every-secs 5]`
//!
//! Every pod address is its own 127.0.0.1 listener answering 200 at once, so Envoy's
//! `override_host` has N real cluster members and requests (about 50/s) really reach the pod
//! the filter picked.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ai_lb_e2e::envoy::{Envoy, EnvoyOptions, HttpClient};
use ai_lb_proto::v1::metrics_service_server::{MetricsService, MetricsServiceServer};
use ai_lb_proto::v1::{
    Engine, GpuStats, InferenceStats, LatencyQuantiles, ModelInfo, PeerState, PeerStatus,
    PodIdentity, PodSnapshot, PoolEvent, SnapshotRequest, SourceState, SourceStatus, WatchEvent,
    WatchPoolRequest, WatchRequest,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tonic::codegen::tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

const MODEL: &str = "llama-3-8b-instruct";
const UPDATE_EVERY: Duration = Duration::from_millis(100);
const CONFIG: &str = r#"{"pools":[{"name":"default","cluster":"inference","agentCluster":"ai_lb_agents"}],"minPods":1,"cutoffs":{"stalenessMs":5000}}"#;
const VM_GAUGE: &str = "wasmcustom.ailb.vm_memory_bytes";

type Error = String;

struct Args {
    pods: Vec<usize>,
    secs: u64,
    soak_secs: u64,
    every_secs: u64,
}

fn parse_args() -> Result<Args, Error> {
    let mut a = Args {
        pods: vec![64, 256, 1024],
        secs: 20,
        soak_secs: 120,
        every_secs: 5,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let val = it
            .next()
            .ok_or_else(|| format!("flag {flag} needs a value"))?;
        let bad = |why: &str| format!("{flag} {val:?}: {why}");
        let num = |v: &str| {
            v.trim()
                .parse::<u64>()
                .map_err(|_| bad("not a whole number"))
        };
        match flag.as_str() {
            "--pods" => {
                a.pods = val
                    .split(',')
                    .map(|v| num(v).map(|n| n as usize))
                    .collect::<Result<_, _>>()?;
                if a.pods.is_empty() || a.pods.iter().any(|&n| n == 0 || n > 4096) {
                    return Err(bad("each count must be 1..=4096"));
                }
            }
            "--secs" => a.secs = num(&val)?.max(5),
            "--soak-secs" => a.soak_secs = num(&val)?,
            "--every-secs" => a.every_secs = num(&val)?.max(1),
            _ => return Err(format!("unknown flag {flag:?}")),
        }
    }
    Ok(a)
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A cheap deterministic 0..1 value for pod `i` at update `t`.
fn wobble(i: usize, t: u64, salt: u64) -> f64 {
    let mut x = (i as u64)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(t.wrapping_mul(0xBF58_476D_1CE4_E5B9))
        .wrapping_add(salt);
    x ^= x >> 31;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^= x >> 29;
    (x % 10_000) as f64 / 10_000.0
}

/// The snapshot pod `i` (serving at `addr`) reports at update `t`.
fn snapshot(i: usize, addr: SocketAddr, t: u64) -> PodSnapshot {
    let util = 0.2 + 0.5 * wobble(i, t, 1);
    let q = |p50: f64| LatencyQuantiles {
        p50_ms: Some(p50),
        p99_ms: Some(p50 * 3.0),
        samples: 40,
        mean_ms: Some(p50 * 1.2),
    };
    let fresh = |name: &str| SourceStatus {
        name: name.into(),
        state: SourceState::Fresh as i32,
        reason: String::new(),
        last_success_age_ms: Some(50),
        consecutive_failures: 0,
    };
    PodSnapshot {
        identity: Some(PodIdentity {
            pod_name: format!("vllm-{i:04}"),
            namespace: "inference".into(),
            address: addr.to_string(),
            engine: Engine::Vllm as i32,
            models: vec![ModelInfo {
                name: MODEL.into(),
                version: "v1".into(),
                adapters: Vec::new(),
            }],
        }),
        gpus: vec![GpuStats {
            index: 0,
            uuid: format!("GPU-{i:08x}-5b2c-4e3a-9d1f-000000000000"),
            name: "NVIDIA H100 80GB HBM3".into(),
            utilization: Some(util),
            memory_used_bytes: Some(72_000_000_000),
            memory_total_bytes: Some(80_000_000_000),
            temperature_celsius: Some(55.0 + 15.0 * util),
            power_watts: Some(300.0 + 300.0 * util),
            power_limit_watts: Some(700.0),
            throttle_reasons: Some(0),
            throttle_reason_names: Vec::new(),
            ecc_uncorrected_errors: Some(0),
            xid_errors: Some(0),
            last_xid: None,
            sm_occupancy: Some(util * 0.5),
            sm_utilization: Some(util),
            tensor_activity: Some(util * 0.3),
            dram_activity: Some(util * 0.7),
            activity_source: ai_lb_proto::GpuActivitySource::Gpm as i32,
            memory_growth_bytes_per_s: None,
            pre_oom: None,
        }],
        inference: Some(InferenceStats {
            waiting: Some((wobble(i, t, 2) * 4.0) as u32),
            running: Some(4 + (wobble(i, t, 3) * 28.0) as u32),
            queue_capacity: Some(256),
            kv_cache_usage: Some(0.1 + 0.5 * wobble(i, t, 4)),
            ttft: Some(q(80.0 + 100.0 * util)),
            e2e: Some(q(900.0 + 1000.0 * util)),
            inter_token: Some(q(12.0 + 10.0 * util)),
            request_rate: Some(4.0),
            error_rate: Some(0.0),
            window_ms: 10_000,
            kv_capacity_tokens: Some(400_000),
            rate_window_ms: 5_000,
            inter_token_recent: Some(q(12.0 + 12.0 * util)),
            recent_window_ms: 150,
            prefix_cache_hit_rate: Some(0.5),
            finished_total: Some(40_000.0),
            errors_total: Some(12.0),
        }),
        sources: vec![fresh("nvml"), fresh("model-server")],
        sample_time_unix_ms: unix_ms(),
        sequence: t + 1,
        agent_instance: format!("agent-{i:04}"),
        age_ms: 20,
        prefix_cache: None,
    }
}

/// `WatchPool` with `pods` synthetic pods, every one updated at 10 Hz (the first event is full).
#[derive(Clone)]
struct Agent {
    pods: Arc<Vec<SocketAddr>>,
    events: Arc<AtomicU64>,
}

type Stream<T> = std::pin::Pin<Box<ReceiverStream<Result<T, Status>>>>;

#[tonic::async_trait]
impl MetricsService for Agent {
    async fn snapshot(&self, _: Request<SnapshotRequest>) -> Result<Response<PodSnapshot>, Status> {
        Err(Status::unimplemented(
            "the pool agent only serves WatchPool",
        ))
    }

    type WatchStream = Stream<WatchEvent>;

    async fn watch(&self, _: Request<WatchRequest>) -> Result<Response<Self::WatchStream>, Status> {
        Err(Status::unimplemented(
            "the pool agent only serves WatchPool",
        ))
    }

    type WatchPoolStream = Stream<PoolEvent>;

    async fn watch_pool(
        &self,
        _: Request<WatchPoolRequest>,
    ) -> Result<Response<Self::WatchPoolStream>, Status> {
        let (tx, rx) = mpsc::channel(2);
        let me = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(UPDATE_EVERY);
            for t in 0u64.. {
                tick.tick().await;
                let peers = me
                    .pods
                    .iter()
                    .enumerate()
                    .map(|(i, &addr)| PeerState {
                        peer: format!("agent-{i:04}.inference:9100"),
                        status: PeerStatus::Live as i32,
                        snapshot: Some(snapshot(i, addr, t)),
                        reason: String::new(),
                    })
                    .collect();
                let ev = PoolEvent {
                    full: t == 0,
                    peers,
                    time_unix_ms: unix_ms(),
                    agent_instance: "vm-memory-agent".into(),
                };
                if tx.send(Ok(ev)).await.is_err() {
                    return;
                }
                me.events.fetch_add(1, Ordering::Relaxed);
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// Answers every HTTP/1.1 request on `listener` with a tiny 200 (keep-alive).
async fn serve_pod(listener: tokio::net::TcpListener) {
    while let Ok((mut s, _)) = listener.accept().await {
        tokio::spawn(async move {
            let mut buf = Vec::with_capacity(4096);
            let mut chunk = [0u8; 4096];
            loop {
                let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                    continue;
                };
                let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                let len = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse::<usize>().ok())
                    .unwrap_or(0);
                while buf.len() < end + 4 + len {
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                buf.drain(..end + 4 + len);
                let body = r#"{"choices":[{"text":"ok"}],"usage":{"prompt_tokens":8,"completion_tokens":1}}"#;
                let resp = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
                if s.write_all(resp.as_bytes()).await.is_err() {
                    return;
                }
            }
        });
    }
}

/// N pod listeners on `pods_rt` and the agent on `agent_rt` (separate threads, so building
/// 10 Hz pool events never delays the pods' answers); returns the pod and agent addresses.
fn start_backends(
    pods_rt: &tokio::runtime::Runtime,
    agent_rt: &tokio::runtime::Runtime,
    n: usize,
    serve_pods: bool,
    events: Arc<AtomicU64>,
) -> Result<(Vec<SocketAddr>, SocketAddr), Error> {
    let pods = pods_rt.block_on(async {
        let mut pods = Vec::with_capacity(n);
        for _ in 0..n {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .map_err(|e| format!("bind pod listener: {e}"))?;
            pods.push(l.local_addr().map_err(|e| e.to_string())?);
            tokio::spawn(serve_pod(l));
        }
        Ok::<_, Error>(pods)
    })?;
    agent_rt.block_on(async {
        let agent = Agent {
            pods: Arc::new(if serve_pods { pods.clone() } else { Vec::new() }),
            events,
        };
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| format!("bind agent listener: {e}"))?;
        let addr = l.local_addr().map_err(|e| e.to_string())?;
        let incoming = tonic::transport::server::TcpIncoming::from(l).with_nodelay(Some(true));
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(MetricsServiceServer::new(agent))
                .serve_with_incoming(incoming),
        );
        Ok((pods, addr))
    })
}

/// The pid of the Envoy whose scratch dir is `dir` (its config path is on its command line).
fn envoy_pid(envoy: &Envoy) -> Result<u32, Error> {
    let needle = envoy.dir.to_string_lossy().into_owned();
    let procs = std::fs::read_dir("/proc").map_err(|e| format!("/proc: {e}"))?;
    for p in procs.flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(cmd) = std::fs::read(p.path().join("cmdline")) else {
            continue;
        };
        let cmd = String::from_utf8_lossy(&cmd);
        if cmd.contains("envoy") && cmd.contains(&needle) {
            return Ok(pid);
        }
    }
    Err(format!("no process has {needle} on its command line"))
}

/// `VmRSS` of `pid` in KiB.
fn rss_kib(pid: u32) -> Result<u64, Error> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .map_err(|e| format!("/proc/{pid}/status: {e}"))?;
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or_else(|| format!("/proc/{pid}/status has no VmRSS"))
}

#[derive(Debug, Clone, Copy)]
struct Sample {
    at_s: f64,
    vm_bytes: u64,
    rss_kib: u64,
    /// Upstream connections Envoy opened so far (one per pod host used, with keep-alive).
    upstream_cx: u64,
}

#[derive(Debug)]
struct Run {
    samples: Vec<Sample>,
    pods_seen: usize,
    picks: u64,
    ok: u64,
    failed: u64,
    events: u64,
}

/// One Envoy with `n` cluster members; the agent serves them (or an empty pool when
/// `serve_pods` is false) for `secs`, sampled every `every`.
fn run(n: usize, serve_pods: bool, secs: u64, every: u64) -> Result<Run, Error> {
    let runtime = || {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .map_err(|e| format!("runtime: {e}"))
    };
    let (pods_rt, agent_rt) = (runtime()?, runtime()?);
    let events = Arc::new(AtomicU64::new(0));
    let (pods, agent) = start_backends(&pods_rt, &agent_rt, n, serve_pods, events.clone())?;
    let mut opts = EnvoyOptions::new(CONFIG);
    opts.inference = pods;
    opts.agents = vec![agent];
    opts.concurrency = 1;
    let envoy = Envoy::start(&opts)?;
    let pid = envoy_pid(&envoy)?;

    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let load = {
        let (stop, ok, failed, listener) =
            (stop.clone(), ok.clone(), failed.clone(), envoy.listener);
        thread::spawn(move || {
            let mut c = HttpClient::new(listener).with_timeout(Duration::from_secs(5));
            let body = format!(
                r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"hello"}}],"max_tokens":16}}"#
            );
            while !stop.load(Ordering::Relaxed) {
                match c.post_json("/v1/chat/completions", &[], &body) {
                    Ok(r) if r.status == 200 => ok.fetch_add(1, Ordering::Relaxed),
                    _ => failed.fetch_add(1, Ordering::Relaxed),
                };
                // Pacing (about 50 requests/s), not synchronisation.
                thread::sleep(Duration::from_millis(20));
            }
        })
    };

    let start = Instant::now();
    let mut samples = Vec::new();
    let mut last: BTreeMap<String, u64>;
    let deadline = start + Duration::from_secs(secs);
    let mut next = start + Duration::from_secs(every);
    loop {
        let now = Instant::now();
        if now < next {
            // Pacing the sampler, not synchronisation.
            thread::sleep(next - now);
        }
        last = envoy.stats()?;
        samples.push(Sample {
            at_s: start.elapsed().as_secs_f64(),
            vm_bytes: last.get(VM_GAUGE).copied().unwrap_or(0),
            rss_kib: rss_kib(pid)?,
            upstream_cx: last
                .get("cluster.inference.upstream_cx_total")
                .copied()
                .unwrap_or(0),
        });
        if next >= deadline {
            break;
        }
        next += Duration::from_secs(every);
    }
    stop.store(true, Ordering::Relaxed);
    let _ = load.join();
    if envoy.wasm_failed() {
        return Err(format!("the wasm VM failed:\n{}", envoy.log_tail(30)));
    }
    let pods_seen = last
        .keys()
        .filter(|k| k.starts_with("wasmcustom.ailb.endpoint.") && k.ends_with(".score"))
        .count();
    let picks = last
        .iter()
        .filter(|(k, _)| k.starts_with("wasmcustom.ailb.endpoint.") && k.ends_with(".picks"))
        .map(|(_, v)| v)
        .sum();
    let r = Run {
        samples,
        pods_seen,
        picks,
        ok: ok.load(Ordering::Relaxed),
        failed: failed.load(Ordering::Relaxed),
        events: events.load(Ordering::Relaxed),
    };
    drop(envoy);
    agent_rt.shutdown_timeout(Duration::from_secs(2));
    pods_rt.shutdown_timeout(Duration::from_secs(2));
    Ok(r)
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn signed_mib_kib(kib: i64) -> String {
    format!("{:+.1}", kib as f64 / 1024.0)
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("vm_memory: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = measure(&args) {
        eprintln!("vm_memory: {e}");
        std::process::exit(1);
    }
}

fn measure(args: &Args) -> Result<(), Error> {
    let largest = args.pods.iter().copied().max().unwrap_or(0);
    let mut rows = Vec::new();
    let mut soak = None;
    for &n in &args.pods {
        let secs = if n == largest && args.soak_secs > args.secs {
            args.soak_secs
        } else {
            args.secs
        };
        eprintln!(
            "N={n}: baseline (empty pool, {n} cluster members), {} s",
            args.secs
        );
        let base = run(n, false, args.secs, args.every_secs)?;
        eprintln!("N={n}: {n} pods at 10 Hz, {secs} s");
        let full = run(n, true, secs, args.every_secs)?;
        let (Some(b), Some(f)) = (base.samples.last(), full.samples.last()) else {
            return Err("no samples".into());
        };
        eprintln!(
            "N={n}: pods seen {}, picks {}, requests ok {} failed {}, events sent {}",
            full.pods_seen, full.picks, full.ok, full.failed, full.events
        );
        rows.push((n, *b, *f, full.pods_seen, full.picks, full.ok, full.failed));
        if n == largest {
            soak = Some(full);
        }
    }
    println!("| pods | VM linear memory, empty pool | VM linear memory, N pods | Envoy RSS, empty pool | Envoy RSS, N pods | RSS delta | upstream connections, empty pool / N pods | pods seen | requests ok/failed (picked by score) |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---|");
    for (n, b, f, seen, picks, ok, failed) in &rows {
        println!(
            "| {n} | {:.2} MiB | {:.2} MiB | {:.1} MiB | {:.1} MiB | {} MiB | {} / {} | {seen} | {ok}/{failed} ({picks}) |",
            mib(b.vm_bytes),
            mib(f.vm_bytes),
            b.rss_kib as f64 / 1024.0,
            f.rss_kib as f64 / 1024.0,
            signed_mib_kib(f.rss_kib as i64 - b.rss_kib as i64),
            b.upstream_cx,
            f.upstream_cx,
        );
    }
    if let Some(s) = soak {
        println!();
        println!("| t (s) | VM linear memory | Envoy RSS | upstream connections opened |");
        println!("|---:|---:|---:|---:|");
        for x in &s.samples {
            println!(
                "| {:.0} | {:.2} MiB | {:.1} MiB | {} |",
                x.at_s,
                mib(x.vm_bytes),
                x.rss_kib as f64 / 1024.0,
                x.upstream_cx
            );
        }
        // Growth over the second half: each VM's linear memory only grows, so the largest value
        // of each half bounds the largest VM; RSS from the middle sample to the last.
        let half = s.samples.len() / 2;
        let max_of = |xs: &[Sample]| xs.iter().map(|x| x.vm_bytes).max().unwrap_or(0);
        let (first, second) = s.samples.split_at(half);
        println!();
        println!(
            "largest VM linear memory: first half {:.2} MiB, second half {:.2} MiB",
            mib(max_of(first)),
            mib(max_of(second))
        );
        if let (Some(a), Some(z)) = (s.samples.get(half), s.samples.last()) {
            let max = s.samples.iter().map(|x| x.vm_bytes).max().unwrap_or(0);
            let secs = z.at_s.max(1.0);
            println!();
            println!(
                "largest VM linear memory seen {:.2} MiB ({max} bytes); pool events delivered {:.1}/s",
                mib(max),
                s.events as f64 / secs
            );
            println!(
                "RSS growth {:.0} s -> {:.0} s: {} MiB (upstream connections {} -> {})",
                a.at_s,
                z.at_s,
                signed_mib_kib(z.rss_kib as i64 - a.rss_kib as i64),
                a.upstream_cx,
                z.upstream_cx
            );
        }
    }
    Ok(())
}
