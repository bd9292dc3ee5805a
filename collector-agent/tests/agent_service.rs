//! The agent's gRPC and HTTP service in-process, over a fake source: Snapshot, Watch (full
//! first event, pushes on change, heartbeats), health, /metrics and /readyz, and graceful
//! shutdown ending streams with a status.

mod agent_support;

use agent_support::*;
use ai_lb_proto::v1::{
    watch_event, PodSnapshot, SnapshotRequest, SourceState, WatchEvent, WatchPoolRequest,
    WatchRequest,
};
use tonic::Streaming;

async fn next_snapshot(
    stream: &mut Streaming<WatchEvent>,
    pred: impl Fn(&PodSnapshot) -> bool,
) -> PodSnapshot {
    loop {
        let ev = stream.message().await.unwrap().expect("stream ended");
        if let Some(watch_event::Event::Snapshot(s)) = ev.event {
            if pred(&s) {
                return s;
            }
        }
    }
}

fn util(s: &PodSnapshot) -> Option<f64> {
    s.gpus.first().and_then(|g| g.utilization)
}

#[tokio::test]
async fn watch_starts_with_full_snapshot_and_pushes_changes() {
    let knob = Knob::default();
    knob.set(|k| k.util = 0.1);
    let agent = start_agent(&knob).await;
    let mut c = client(agent.grpc_addr).await;
    let mut stream = c
        .watch(WatchRequest {
            min_interval_ms: 0,
            heartbeat_ms: 0,
        })
        .await
        .unwrap()
        .into_inner();
    let first = within(5, "first event", stream.message())
        .await
        .unwrap()
        .unwrap();
    let Some(watch_event::Event::Snapshot(s)) = first.event else {
        panic!("first event is not a snapshot: {first:?}");
    };
    let id = s.identity.clone().unwrap();
    assert_eq!(id.address, "10.0.0.1:8000");
    assert_eq!(id.namespace, "test");
    assert!(!s.agent_instance.is_empty());
    assert_eq!(util(&s), Some(0.1));
    assert_eq!(s.sources[0].name, "sim");
    assert_eq!(s.sources[0].state, SourceState::Fresh as i32);
    assert_eq!(s.sources[1].name, "model-server");
    assert_eq!(s.sources[1].state, SourceState::Absent as i32);

    knob.set(|k| k.util = 0.97);
    let changed = within(
        5,
        "the pushed change",
        next_snapshot(&mut stream, |s| util(s) == Some(0.97)),
    )
    .await;
    assert!(changed.sequence > s.sequence);

    knob.set(|k| k.fail = Some("HTTP 500 from sim".into()));
    let failing = within(
        5,
        "the failing source",
        next_snapshot(&mut stream, |s| {
            s.sources[0].state == SourceState::Failing as i32
        }),
    )
    .await;
    assert!(
        failing.sources[0].reason.contains("HTTP 500"),
        "{:?}",
        failing.sources[0]
    );
    assert!(failing.sources[0].consecutive_failures >= 1);
    assert!(
        failing.gpus.is_empty(),
        "a failing source contributes no readings"
    );
    agent.shutdown(std::time::Duration::from_secs(5)).await;
}

#[tokio::test]
async fn idle_watch_sends_heartbeats_with_current_sequence() {
    let knob = Knob::default();
    let agent = start_agent(&knob).await;
    let mut c = client(agent.grpc_addr).await;
    let mut stream = c
        .watch(WatchRequest {
            min_interval_ms: 0,
            heartbeat_ms: 50,
        })
        .await
        .unwrap()
        .into_inner();
    let mut beats = 0;
    within(5, "two heartbeats", async {
        while beats < 2 {
            let ev = stream.message().await.unwrap().unwrap();
            if let Some(watch_event::Event::Heartbeat(h)) = ev.event {
                assert!(h.sequence > 0);
                assert!(h.time_unix_ms > 0);
                beats += 1;
            }
        }
    })
    .await;
    agent.shutdown(std::time::Duration::from_secs(5)).await;
}

#[tokio::test]
async fn snapshot_health_metrics_and_readiness() {
    let knob = Knob::default();
    knob.set(|k| {
        k.util = 0.5;
        k.waiting = 7;
        k.reject_field = Some("vllm:num_requests_waiting".into());
    });
    let agent = start_agent(&knob).await;
    agent.hub.first_sample().await;
    let mut c = client(agent.grpc_addr).await;
    let s = c.snapshot(SnapshotRequest {}).await.unwrap().into_inner();
    assert_eq!(s.inference.unwrap().waiting, Some(7));

    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", agent.grpc_addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    let serving = within(5, "health SERVING", async {
        loop {
            let r = health
                .check(tonic_health::pb::HealthCheckRequest {
                    service: "ai_lb.v1.MetricsService".into(),
                })
                .await
                .unwrap()
                .into_inner();
            if r.status == tonic_health::pb::health_check_response::ServingStatus::Serving as i32 {
                return r.status;
            }
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert_eq!(serving, 1);

    let base = format!("http://{}", agent.http_addr);
    let http = reqwest::Client::new();
    let ready = http.get(format!("{base}/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 200);
    let text = http
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(text.contains("ai_lb_agent_gpu_utilization_ratio{pod=\"pod-10.0.0.1:8000\",namespace=\"test\",address=\"10.0.0.1:8000\",gpu=\"0\",uuid=\"GPU-fake-0\"} 0.5"), "{text}");
    assert!(text.contains("ai_lb_agent_queue_waiting{"), "{text}");
    assert!(
        text.contains("ai_lb_agent_source_state{source=\"sim\",state=\"fresh\"} 1"),
        "{text}"
    );
    assert!(
        text.contains(
            "ai_lb_agent_rejected_values_total{source=\"sim\",field=\"vllm:num_requests_waiting\"}"
        ),
        "{text}"
    );

    knob.set(|k| k.fail = Some("down".into()));
    within(5, "readyz 503 once no source is fresh", async {
        loop {
            let r = http.get(format!("{base}/readyz")).send().await.unwrap();
            if r.status() == 503 {
                let body = r.text().await.unwrap();
                assert!(body.contains("down"), "{body}");
                return;
            }
            tokio::task::yield_now().await;
        }
    })
    .await;
    let h = http.get(format!("{base}/healthz")).send().await.unwrap();
    assert_eq!(h.status(), 200);
    agent.shutdown(std::time::Duration::from_secs(5)).await;
}

#[tokio::test]
async fn shutdown_ends_streams_with_unavailable_status() {
    let knob = Knob::default();
    let agent = start_agent(&knob).await;
    let mut c = client(agent.grpc_addr).await;
    let mut watch = c.watch(WatchRequest::default()).await.unwrap().into_inner();
    let mut pool = c
        .watch_pool(WatchPoolRequest::default())
        .await
        .unwrap()
        .into_inner();
    within(5, "first watch event", watch.message())
        .await
        .unwrap()
        .unwrap();
    let first_pool = within(5, "first pool event", pool.message())
        .await
        .unwrap()
        .unwrap();
    assert!(first_pool.full);
    assert_eq!(first_pool.peers.len(), 1, "only itself: {first_pool:?}");

    let done = tokio::spawn(agent.shutdown(std::time::Duration::from_secs(5)));
    let status = within(5, "watch status", async {
        loop {
            match watch.message().await {
                Ok(Some(_)) => continue,
                Ok(None) => panic!("watch ended without a status"),
                Err(s) => return s,
            }
        }
    })
    .await;
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert_eq!(status.message(), "agent shutting down");
    let status = within(5, "pool status", async {
        loop {
            match pool.message().await {
                Ok(Some(_)) => continue,
                Ok(None) => panic!("pool ended without a status"),
                Err(s) => return s,
            }
        }
    })
    .await;
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert_eq!(status.message(), "agent shutting down");
    within(10, "servers to stop", done).await.unwrap();
}

/// A jump (GPU 0.10 → 0.99) skips the stream's coalescing interval, while drift waits for it:
/// with a 5 s interval, the jump arrives long before the interval ends, carrying the drift
/// that was waiting (no separate event for it).
#[tokio::test]
async fn urgent_change_skips_watch_coalescing() {
    let knob = Knob::default();
    knob.set(|k| k.util = 0.10);
    let agent = start_agent(&knob).await;
    let mut c = client(agent.grpc_addr).await;
    let mut stream = c
        .watch(WatchRequest {
            min_interval_ms: 5_000,
            heartbeat_ms: 0,
        })
        .await
        .unwrap()
        .into_inner();
    let first = within(5, "first event", next_snapshot(&mut stream, |_| true)).await;
    assert_eq!(util(&first), Some(0.10));
    let t0 = std::time::Instant::now();
    knob.set(|k| k.util = 0.13);
    // The agent has sampled the drift (so it waits in the stream's coalescing interval) before
    // the jump comes.
    eventually(5, "the agent to sample the drift 0.13", || {
        let mut c = c.clone();
        async move {
            let s = c.snapshot(SnapshotRequest {}).await.unwrap().into_inner();
            util(&s) == Some(0.13)
        }
    })
    .await;
    knob.set(|k| k.util = 0.99);
    let next = within(5, "the next event", next_snapshot(&mut stream, |_| true)).await;
    assert_eq!(
        util(&next),
        Some(0.99),
        "drift 0.13 was coalesced into the jump"
    );
    assert!(
        t0.elapsed() < std::time::Duration::from_millis(4_000),
        "the jump waited for the 5 s coalescing interval: {:?}",
        t0.elapsed()
    );
    agent.shutdown(std::time::Duration::from_secs(5)).await;
}
