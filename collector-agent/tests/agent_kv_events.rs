//! The agent against the real fake pod over ZeroMQ, in process: the pod publishes vLLM KV
//! events, the agent subscribes (with the replay socket), rebuilds the pod's cached blocks and
//! puts them in every snapshot as `ai-lb-prefix` keys, exactly the keys a sidecar computes
//! from the same prompt; the model server's prefix-cache counters give the hit rate.

mod agent_support;

use agent_support::{test_config, within};
use ai_lb_agent::grpc::{start, RunningAgent, StartArgs};
use ai_lb_agent::kv_events::KvEventsConfig;
use ai_lb_agent::sampler::{new_agent_instance, SystemClock};
use ai_lb_agent::sources::model_server::{ModelServerOptions, ModelServerSource};
use ai_lb_fake_pod::config::{Cli, PodConfig};
use ai_lb_fake_pod::kv_events;
use ai_lb_fake_pod::server::{serve, AppState};
use ai_lb_prefix::{block_keys_into, model_seed, short_key, tokenize_into};
use clap::Parser;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::oneshot;

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

/// A fake pod publishing KV events (with a replay socket) until the sender is dropped:
/// its HTTP address, PUB and ROUTER endpoints.
async fn fake_pod() -> (SocketAddr, kv_events::Bound, oneshot::Sender<()>) {
    let cli = Cli::try_parse_from([
        "ai-lb-fake-pod",
        "--pod-name",
        "pod-kv-events",
        "--time-scale",
        "0.01",
        "--kv-events-endpoint",
        "tcp://127.0.0.1:0",
        "--kv-events-replay-endpoint",
        "tcp://127.0.0.1:0",
    ])
    .unwrap();
    let state = AppState::new(PodConfig::from_cli(cli, None)).unwrap();
    let ev = state.config().kv_events.clone().unwrap();
    let (sink, bound) = kv_events::spawn(&ev).await.unwrap();
    state.attach_kv_events(sink);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(serve(state, listener, async move {
        let _ = stopped.await;
    }));
    (addr, bound, stop)
}

/// An agent reading the pod's page and its KV events, as `main.rs` builds it.
async fn agent_for(pod: SocketAddr, bound: &kv_events::Bound) -> RunningAgent {
    let mut cfg = test_config(&pod.to_string(), vec![]);
    cfg.kv_events = Some(KvEventsConfig {
        endpoint: bound.endpoint.clone(),
        replay_endpoint: bound.replay_endpoint.clone(),
        topic: String::new(),
        block_tokens: 64,
        max_keys: 4096,
    });
    let mut opts = ModelServerOptions::new(&format!("http://{pod}"));
    opts.rate_window = cfg.rate_window;
    start(
        &cfg,
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

async fn complete(http: &reqwest::Client, pod: SocketAddr, prompt: &str, max_tokens: u32) {
    let r = http
        .post(format!("http://{pod}/v1/completions"))
        .json(&serde_json::json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

/// A counter or gauge of the agent's `/metrics` (0 when absent).
async fn agent_metric(http: &reqwest::Client, agent: &RunningAgent, name: &str) -> f64 {
    let text = http
        .get(format!("http://{}/metrics", agent.http_addr))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// Waits for the next published snapshot that satisfies `f`.
async fn snapshot_where(
    agent: &RunningAgent,
    f: impl Fn(&ai_lb_proto::v1::PodSnapshot) -> bool,
) -> ai_lb_proto::v1::PodSnapshot {
    let mut changes = agent.hub.subscribe();
    loop {
        if let Some(p) = agent.hub.latest() {
            if f(&p.snapshot) {
                return p.snapshot.clone();
            }
        }
        changes.changed().await.unwrap();
    }
}

#[tokio::test]
async fn the_agents_summary_lists_the_prompts_keys_as_a_sidecar_computes_them() {
    let (pod, bound, _stop) = fake_pod().await;
    let agent = agent_for(pod, &bound).await;
    let http = reqwest::Client::new();
    // ZeroMQ's subscription reaches the publisher asynchronously: send short prompts (one
    // pod block, no 64-token key block) until the agent has received a batch. What it missed
    // before comes back through the replay socket.
    within(20, "a first KV-event batch at the agent", async {
        for i in 0.. {
            complete(&http, pod, &format!("probe {i:04} ").repeat(8), 1).await;
            if agent_metric(&http, &agent, "ai_lb_agent_kv_event_batches_total").await > 0.0 {
                return;
            }
        }
    })
    .await;
    // A 300-token prompt: 18 full pod blocks of 16, so 4 whole key blocks of 64.
    let prompt = "0123456789abcdef".repeat(75);
    let mut ids = Vec::new();
    tokenize_into(&prompt, &mut ids);
    assert_eq!(ids.len(), 300);
    let mut keys = Vec::new();
    block_keys_into(model_seed(MODEL), &ids, 64, usize::MAX, &mut keys);
    let mut want: Vec<u32> = keys.iter().map(|k| short_key(*k)).collect();
    want.sort_unstable();
    assert_eq!(want.len(), 4);
    complete(&http, pod, &prompt, 4).await;
    let snap = within(20, "the prompt's keys in a snapshot", async {
        snapshot_where(&agent, |s| {
            s.prefix_cache.as_ref().is_some_and(|p| p.keys == want)
        })
        .await
    })
    .await;
    let pc = snap.prefix_cache.unwrap();
    assert_eq!(pc.block_tokens, 64);
    assert_eq!(pc.model, MODEL, "seeded by the model /v1/models names");
    assert!(!pc.truncated);
    assert!(agent_metric(&http, &agent, "ai_lb_agent_kv_blocks_tracked").await >= 18.0);
    assert_eq!(
        agent_metric(&http, &agent, "ai_lb_agent_prefix_summary_keys").await,
        4.0
    );
    assert_eq!(
        agent_metric(&http, &agent, "ai_lb_agent_kv_event_decode_errors_total").await,
        0.0
    );
    // The same prompt again hits 288 of its 300 tokens: the hit rate appears.
    complete(&http, pod, &prompt, 4).await;
    let snap = within(20, "a prefix-cache hit rate", async {
        snapshot_where(&agent, |s| {
            s.inference
                .as_ref()
                .and_then(|i| i.prefix_cache_hit_rate)
                .is_some_and(|r| r > 0.0)
        })
        .await
    })
    .await;
    let rate = snap.inference.unwrap().prefix_cache_hit_rate.unwrap();
    assert!(rate > 0.0 && rate <= 1.0, "{rate}");
    agent.shutdown(Duration::from_secs(5)).await;
}

/// Batches 1..=3 never reach the agent (dropped on the way); the replay socket gives them
/// back and the view stays whole.
#[tokio::test]
async fn a_sequence_gap_is_filled_from_the_replay_socket() {
    use ai_lb_agent::kv_events::{handle, KvFeed, Sequencer};
    use ai_lb_fake_pod::kv_cache::KvEvent;
    use ai_lb_fake_pod::kv_events::{encode_batch, frames, EventsConfig, WireFormat};
    use std::sync::atomic::Ordering;
    let (mut sink, bound) = kv_events::spawn(&EventsConfig {
        endpoint: "tcp://127.0.0.1:0".into(),
        replay_endpoint: Some("tcp://127.0.0.1:0".into()),
        topic: String::new(),
        format: WireFormat::Array,
    })
    .await
    .unwrap();
    // A chain of 5 one-block batches: block i+1's parent is block i.
    let batch = |i: u64| {
        vec![KvEvent::BlockStored {
            block_hashes: vec![i + 1],
            parent_block_hash: (i > 0).then_some(i),
            token_ids: vec![i as u32; 16],
            block_size: 16,
        }]
    };
    for i in 0..5 {
        sink.send(batch(i));
    }
    within(10, "the publisher's replay buffer", async {
        while sink.stats().batches_published.load(Ordering::Relaxed) < 5 {
            tokio::task::yield_now().await;
        }
    })
    .await;
    let feed = KvFeed::new(KvEventsConfig {
        endpoint: bound.endpoint.clone(),
        replay_endpoint: bound.replay_endpoint.clone(),
        topic: String::new(),
        block_tokens: 16,
        max_keys: 100,
    });
    let msg = |i: u64| frames("", i, encode_batch(1.0, &batch(i), 0, WireFormat::Array));
    let mut seq = Sequencer::default();
    handle(&feed, &mut seq, msg(0)).await;
    handle(&feed, &mut seq, msg(4)).await;
    assert_eq!(feed.stats.gaps_replayed.load(Ordering::Relaxed), 1);
    assert_eq!(feed.stats.gaps_lost.load(Ordering::Relaxed), 0);
    assert_eq!(feed.stats.replayed_batches.load(Ordering::Relaxed), 3);
    let summary = feed
        .summary(Some(MODEL), std::time::Instant::now())
        .unwrap();
    assert_eq!(
        summary.keys.len(),
        5,
        "the whole chain, block 1..=3 from the replay"
    );
    // Without the replay socket the same gap clears the view.
    let feed = KvFeed::new(KvEventsConfig {
        endpoint: bound.endpoint,
        replay_endpoint: None,
        topic: String::new(),
        block_tokens: 16,
        max_keys: 100,
    });
    let mut seq = Sequencer::default();
    handle(&feed, &mut seq, msg(0)).await;
    handle(&feed, &mut seq, msg(4)).await;
    assert_eq!(feed.stats.gaps_lost.load(Ordering::Relaxed), 1);
    assert!(feed
        .summary(Some(MODEL), std::time::Instant::now())
        .unwrap()
        .keys
        .is_empty());
}
