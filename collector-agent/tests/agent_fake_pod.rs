//! The agent against the real fake pod, in process: the model-server source reads the fake
//! pod's vLLM page, and the KV-cache capacity the pod states (`vllm:cache_config_info`) arrives
//! in a `Watch` snapshot over gRPC. The metric names on both sides are checked against each
//! other here, not against a fixture; `--kv-capacity-tokens` wins over the page.

mod agent_support;

use agent_support::{client, test_config, within};
use ai_lb_agent::config::AgentConfig;
use ai_lb_agent::grpc::{start, RunningAgent, StartArgs};
use ai_lb_agent::sampler::{new_agent_instance, SystemClock};
use ai_lb_agent::sources::model_server::{ModelServerOptions, ModelServerSource};
use ai_lb_fake_pod::config::{Cli, PodConfig};
use ai_lb_fake_pod::server::{serve, AppState};
use ai_lb_proto::v1::{watch_event, InferenceStats, WatchRequest};
use clap::Parser;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::oneshot;

/// A fake pod serving on 127.0.0.1:0 until the returned sender is dropped.
async fn fake_pod(args: &[&str]) -> (SocketAddr, oneshot::Sender<()>) {
    let cli = Cli::try_parse_from(
        [
            "ai-lb-fake-pod",
            "--pod-name",
            "pod-kv",
            "--time-scale",
            "0.01",
        ]
        .iter()
        .chain(args),
    )
    .unwrap();
    let state = AppState::new(PodConfig::from_cli(cli, None)).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(serve(state, listener, async move {
        let _ = stopped.await;
    }));
    (addr, stop)
}

/// An agent whose only source is the model server at `pod`, as `main.rs` builds it.
async fn agent_for(pod: SocketAddr, cfg: &AgentConfig) -> RunningAgent {
    let mut opts = ModelServerOptions::new(&format!("http://{pod}"));
    opts.window = cfg.window;
    opts.queue_capacity = cfg.queue_capacity;
    opts.kv_capacity_tokens = cfg.kv_capacity_tokens;
    start(
        cfg,
        StartArgs {
            sources: vec![Box::new(ModelServerSource::new(opts).unwrap())],
            absent: vec!["nvml"],
            grpc_listener: TcpListener::bind("127.0.0.1:0").await.unwrap(),
            http_listener: TcpListener::bind("127.0.0.1:0").await.unwrap(),
            clock: Arc::new(SystemClock),
            agent_instance: new_agent_instance(),
            resolver: None,
        },
    )
    .unwrap()
}

/// The first `Watch` snapshot that carries inference stats.
async fn first_inference(agent: &RunningAgent) -> InferenceStats {
    let mut c = client(agent.grpc_addr).await;
    let mut stream = c
        .watch(WatchRequest {
            min_interval_ms: 0,
            heartbeat_ms: 0,
        })
        .await
        .unwrap()
        .into_inner();
    within(10, "a snapshot with inference stats", async {
        loop {
            let ev = stream.message().await.unwrap().expect("stream ended");
            if let Some(watch_event::Event::Snapshot(s)) = ev.event {
                if let Some(inf) = s.inference {
                    return inf;
                }
            }
        }
    })
    .await
}

#[tokio::test]
async fn kv_capacity_from_the_fake_pod_page_reaches_watch() {
    // 1000 tokens are 62 whole blocks of 16 on the page: 992 tokens.
    let (pod, _stop) = fake_pod(&["--kv-cache-tokens", "1000"]).await;
    let cfg = test_config(&pod.to_string(), vec![]);
    let agent = agent_for(pod, &cfg).await;
    let inf = first_inference(&agent).await;
    assert_eq!(inf.kv_capacity_tokens, Some(1000 / 16 * 16));
    assert_eq!(inf.kv_cache_usage, Some(0.0));
    agent.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test]
async fn configured_kv_capacity_wins_over_the_fake_pod_page() {
    let (pod, _stop) = fake_pod(&[]).await;
    let mut cfg = test_config(&pod.to_string(), vec![]);
    cfg.kv_capacity_tokens = Some(123_456);
    let agent = agent_for(pod, &cfg).await;
    let inf = first_inference(&agent).await;
    assert_eq!(
        inf.kv_capacity_tokens,
        Some(123_456),
        "the operator's figure, not the page's 400 000"
    );
    agent.shutdown(Duration::from_secs(5)).await;
}
