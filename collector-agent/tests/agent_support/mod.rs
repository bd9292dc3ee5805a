//! Shared helpers for the agent's integration tests: a fake `Source` whose readings the test
//! sets, and an in-process agent on 127.0.0.1:0.
#![allow(dead_code)]

pub mod raw_h2;

use ai_lb_agent::config::AgentConfig;
use ai_lb_agent::grpc::{start, RunningAgent, StartArgs};
use ai_lb_agent::pool::Resolve;
use ai_lb_agent::sampler::{new_agent_instance, SystemClock};
use ai_lb_agent::sources::{Reading, Rejected, Source, SourceError};
use ai_lb_proto::v1::metrics_service_client::MetricsServiceClient;
use ai_lb_proto::v1::{GpuStats, InferenceStats};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tonic::transport::Channel;

/// What the fake source reports next.
#[derive(Debug, Clone, Default)]
pub struct KnobState {
    pub util: f64,
    pub waiting: u32,
    pub fail: Option<String>,
    pub reject_field: Option<String>,
}

#[derive(Debug, Clone, Default)]
pub struct Knob(pub Arc<Mutex<KnobState>>);

impl Knob {
    pub fn set(&self, f: impl FnOnce(&mut KnobState)) {
        f(&mut self.0.lock().unwrap());
    }
}

pub struct FakeSource(pub Knob);

#[async_trait::async_trait]
impl Source for FakeSource {
    fn name(&self) -> &'static str {
        "sim"
    }
    async fn sample(&mut self, _now: Instant) -> Result<Reading, SourceError> {
        let k = self.0 .0.lock().unwrap().clone();
        if let Some(detail) = k.fail {
            return Err(SourceError::Other {
                source_name: "sim",
                detail,
            });
        }
        Ok(Reading {
            gpus: Some(vec![GpuStats {
                index: 0,
                uuid: "GPU-fake-0".into(),
                utilization: Some(k.util),
                memory_used_bytes: Some(1 << 30),
                memory_total_bytes: Some(80 << 30),
                ..Default::default()
            }]),
            inference: Some(InferenceStats {
                waiting: Some(k.waiting),
                running: Some(1),
                kv_cache_usage: Some(0.25),
                ..Default::default()
            }),
            rejected: k
                .reject_field
                .map(|field| {
                    vec![Rejected {
                        field,
                        value: "NaN".into(),
                        reason: "not a number".into(),
                    }]
                })
                .unwrap_or_default(),
            ..Default::default()
        })
    }
}

/// A fast config for tests: 20 ms samples and pushes, 200 ms heartbeats, 1 s staleness.
pub fn test_config(serving: &str, peers: Vec<String>) -> AgentConfig {
    let mut cfg = AgentConfig::for_tests(serving.parse().unwrap());
    cfg.pod_name = format!("pod-{serving}");
    cfg.namespace = "test".into();
    cfg.sample_interval = Duration::from_millis(20);
    cfg.watch_min_interval = Duration::from_millis(20);
    cfg.heartbeat = Duration::from_millis(200);
    cfg.peers = peers;
    cfg.peers_refresh = Duration::from_millis(100);
    cfg.peer_stale_after = Duration::from_millis(1000);
    cfg
}

pub async fn start_on(cfg: &AgentConfig, knob: &Knob, grpc_listener: TcpListener) -> RunningAgent {
    start_with(cfg, knob, grpc_listener, None).await
}

pub async fn start_with(
    cfg: &AgentConfig,
    knob: &Knob,
    grpc_listener: TcpListener,
    resolver: Option<Arc<dyn Resolve>>,
) -> RunningAgent {
    let http_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    start(
        cfg,
        StartArgs {
            sources: vec![Box::new(FakeSource(knob.clone()))],
            absent: vec!["model-server"],
            grpc_listener,
            http_listener,
            clock: Arc::new(SystemClock),
            agent_instance: new_agent_instance(),
            resolver,
        },
    )
    .unwrap()
}

pub async fn start_agent(knob: &Knob) -> RunningAgent {
    let cfg = test_config("10.0.0.1:8000", vec![]);
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    start_on(&cfg, knob, l).await
}

/// Binds `addr` again, retrying every 20 ms until `deadline` (the old socket may still be
/// closing; there is no event saying when it is gone).
pub async fn rebind(addr: SocketAddr, deadline: Duration) -> TcpListener {
    let end = Instant::now() + deadline;
    loop {
        match TcpListener::bind(addr).await {
            Ok(l) => return l,
            Err(e) if Instant::now() < end => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("cannot rebind {addr}: {e}"),
        }
    }
}

pub async fn client(addr: SocketAddr) -> MetricsServiceClient<Channel> {
    MetricsServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap()
}

/// Awaits `fut` or fails the test with `what` after `secs`.
pub async fn within<T>(secs: u64, what: &str, fut: impl std::future::Future<Output = T>) -> T {
    match tokio::time::timeout(Duration::from_secs(secs), fut).await {
        Ok(v) => v,
        Err(_) => panic!("timed out after {secs}s waiting for {what}"),
    }
}

/// Polls `cond` every 10 ms until it holds, or fails the test with `what` after `secs`: for a
/// state the test can only ask about (a unary RPC), where there is no event to await.
pub async fn eventually<F, Fut>(secs: u64, what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    within(secs, what, async {
        while !cond().await {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
}

/// A resolver whose answer the test sets.
#[derive(Debug, Clone, Default)]
pub struct FakeDns(pub Arc<Mutex<Vec<SocketAddr>>>);

impl FakeDns {
    pub fn answer(&self, addrs: &[SocketAddr]) {
        *self.0.lock().unwrap() = addrs.to_vec();
    }
}

impl Resolve for FakeDns {
    fn resolve(
        &self,
        _name: &str,
    ) -> futures::future::BoxFuture<'static, std::io::Result<Vec<SocketAddr>>> {
        let v = self.0.lock().unwrap().clone();
        Box::pin(async move { Ok(v) })
    }
}
