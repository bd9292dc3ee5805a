//! Metrics-plane latency benchmark (run by hand: `cargo bench -p ai-lb-agent --bench
//! metrics_plane`): (1) sample → `Watch` client latency on loopback, one agent sampling every
//! 10 ms with a change on every sample; (2) `WatchPool` over 64 in-process peer agents each
//! changing at 10 Hz: updates lost (a peer sequence published but never seen by the pool
//! client) and sample → pool client latency, run twice: once as the filter subscribes by
//! default (`min_interval_ms: 0`, i.e. the agent's default `--watch-min-interval` 50 ms, which
//! by design may hold an update up to 50 ms) and once asking `min_interval_ms: 1`. Prints
//! p50/p99/max; no pass/fail.

use ai_lb_agent::config::AgentConfig;
use ai_lb_agent::grpc::{start, RunningAgent, StartArgs};
use ai_lb_agent::sampler::{new_agent_instance, SystemClock};
use ai_lb_agent::sources::{Reading, Source, SourceError};
use ai_lb_proto::v1::metrics_service_client::MetricsServiceClient;
use ai_lb_proto::v1::{watch_event, InferenceStats, WatchPoolRequest, WatchRequest};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;

/// When each (serving address, counter) reading was produced.
type Stamps = Arc<Mutex<HashMap<(String, u32), Instant>>>;

/// A source whose every sample is a meaningful change and carries its own counter.
struct Counting {
    address: String,
    n: u32,
    stamps: Stamps,
}

#[async_trait::async_trait]
impl Source for Counting {
    fn name(&self) -> &'static str {
        "sim"
    }
    async fn sample(&mut self, _now: Instant) -> Result<Reading, SourceError> {
        self.n += 1;
        if let Ok(mut m) = self.stamps.lock() {
            m.insert((self.address.clone(), self.n), Instant::now());
        }
        Ok(Reading {
            // The queue flips so every sample is a meaningful change; the counter rides in a
            // field the change detector ignores.
            inference: Some(InferenceStats {
                waiting: Some(if self.n % 2 == 0 { 0 } else { 50 }),
                request_rate: Some(f64::from(self.n)),
                ..Default::default()
            }),
            ..Default::default()
        })
    }
}

async fn agent(
    i: usize,
    interval: Duration,
    peers: Vec<String>,
    stamps: &Stamps,
    listener: TcpListener,
    watch_min_interval: Duration,
) -> RunningAgent {
    let address = format!("10.1.{}.{}:8000", i / 250, i % 250 + 1);
    let mut cfg = AgentConfig::for_tests(address.parse().expect("valid address"));
    cfg.sample_interval = interval;
    cfg.watch_min_interval = watch_min_interval;
    cfg.heartbeat = Duration::from_secs(1);
    cfg.peer_stale_after = Duration::from_secs(3);
    cfg.peers_refresh = Duration::from_millis(200);
    cfg.peers = peers;
    start(
        &cfg,
        StartArgs {
            sources: vec![Box::new(Counting {
                address,
                n: 0,
                stamps: stamps.clone(),
            })],
            absent: vec![],
            grpc_listener: listener,
            http_listener: TcpListener::bind("127.0.0.1:0").await.expect("bind"),
            clock: Arc::new(SystemClock),
            agent_instance: new_agent_instance(),
            resolver: None,
        },
    )
    .expect("agent starts")
}

/// The 1-minute load average, printed next to each figure (the bench machine is shared).
fn load1() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "?".into())
}

fn report(name: &str, mut v: Vec<Duration>) {
    if v.is_empty() {
        println!("{name}: no samples");
        return;
    }
    v.sort();
    let q = |p: f64| v[((v.len() - 1) as f64 * p).round() as usize];
    println!(
        "{name}: n={} p50={:?} p99={:?} max={:?} (load1 {})",
        v.len(),
        q(0.5),
        q(0.99),
        v[v.len() - 1],
        load1()
    );
}

async fn watch_latency() {
    let stamps: Stamps = Arc::default();
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let a = agent(
        0,
        Duration::from_millis(10),
        vec![],
        &stamps,
        l,
        Duration::ZERO,
    )
    .await;
    let mut c = MetricsServiceClient::connect(format!("http://{}", a.grpc_addr))
        .await
        .expect("connect");
    let mut s = c
        .watch(WatchRequest {
            min_interval_ms: 1,
            heartbeat_ms: 0,
        })
        .await
        .expect("watch")
        .into_inner();
    let mut lat = Vec::new();
    let end = Instant::now() + Duration::from_secs(10);
    while Instant::now() < end {
        let Ok(Some(ev)) = s.message().await else {
            break;
        };
        let now = Instant::now();
        if let Some(watch_event::Event::Snapshot(snap)) = ev.event {
            let key = (
                snap.identity.map(|i| i.address).unwrap_or_default(),
                snap.inference.and_then(|i| i.request_rate).unwrap_or(0.0) as u32,
            );
            if let Some(t) = stamps.lock().ok().and_then(|m| m.get(&key).copied()) {
                lat.push(now - t);
            }
        }
    }
    report(
        "sample -> Watch client (100 Hz changes, min interval 1 ms)",
        lat,
    );
    a.shutdown(Duration::from_secs(5)).await;
}

/// The agents' default `--watch-min-interval` (what a filter asking `min_interval_ms: 0` gets).
const AGENT_DEFAULT_MIN_INTERVAL: Duration = Duration::from_millis(50);

async fn pool_64(min_interval_ms: u32) {
    const N: usize = 64;
    let stamps: Stamps = Arc::default();
    let mut peers = Vec::new();
    let mut addrs = Vec::new();
    for i in 1..=N {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        addrs.push(l.local_addr().expect("addr").to_string());
        peers.push(
            agent(
                i,
                Duration::from_millis(100),
                vec![],
                &stamps,
                l,
                AGENT_DEFAULT_MIN_INTERVAL,
            )
            .await,
        );
    }
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let hub_agent = agent(
        0,
        Duration::from_millis(100),
        addrs,
        &stamps,
        l,
        AGENT_DEFAULT_MIN_INTERVAL,
    )
    .await;
    let mut c = MetricsServiceClient::connect(format!("http://{}", hub_agent.grpc_addr))
        .await
        .expect("connect");
    let mut s = c
        .watch_pool(WatchPoolRequest {
            min_interval_ms,
            heartbeat_ms: 0,
        })
        .await
        .expect("watch pool")
        .into_inner();
    // Warm up until every peer is LIVE.
    let mut live = BTreeSet::new();
    let warm_end = Instant::now() + Duration::from_secs(30);
    while live.len() < N + 1 && Instant::now() < warm_end {
        let Ok(Some(ev)) = s.message().await else {
            break;
        };
        for p in ev.peers {
            if p.status == 1 {
                live.insert(p.peer);
            }
        }
    }
    println!("pool warm: {} of {} LIVE", live.len(), N + 1);
    let mut seen: BTreeMap<String, BTreeSet<u32>> = BTreeMap::new();
    let mut lat = Vec::new();
    let t0 = Instant::now();
    let end = t0 + Duration::from_secs(10);
    while Instant::now() < end {
        let Ok(Some(ev)) = s.message().await else {
            break;
        };
        let now = Instant::now();
        for p in ev.peers {
            let Some(snap) = p.snapshot else { continue };
            let key = (
                snap.identity.map(|i| i.address).unwrap_or_default(),
                snap.inference.and_then(|i| i.request_rate).unwrap_or(0.0) as u32,
            );
            if let Some(t) = stamps.lock().ok().and_then(|m| m.get(&key).copied()) {
                if t >= t0 && seen.entry(key.0.clone()).or_default().insert(key.1) {
                    lat.push(now - t);
                }
            }
        }
    }
    // Lost = counters sampled after t0 and at least 1 s before the end, never seen.
    let cutoff = end - Duration::from_secs(1);
    let mut published = 0usize;
    let mut lost = 0usize;
    if let Ok(m) = stamps.lock() {
        for ((addr, n), t) in m.iter() {
            if *t >= t0 && *t < cutoff && !addr.starts_with("10.1.0.1:") {
                published += 1;
                if !seen.get(addr).is_some_and(|s| s.contains(n)) {
                    lost += 1;
                }
            }
        }
    }
    println!(
        "WatchPool 64 peers @10 Hz, min_interval_ms {min_interval_ms} (0 = agent default 50 ms): \
         {published} peer updates published, {lost} never seen"
    );
    report(
        &format!(
            "sample -> WatchPool client (64 peers, 10 Hz each, min_interval_ms {min_interval_ms})"
        ),
        lat,
    );
    hub_agent.shutdown(Duration::from_secs(5)).await;
    for p in peers {
        p.shutdown(Duration::from_secs(5)).await;
    }
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` passes nothing else useful.
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        watch_latency().await;
        pool_64(0).await;
        pool_64(1).await;
    });
}
