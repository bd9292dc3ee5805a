//! The metrics plane with real processes (fake pods + agents on loopback): a change forced in a
//! pod reaches a `Watch` client; `WatchPool` marks a SIGKILLed (or frozen) peer STALE with a
//! growing age and a restarted one LIVE; SIGTERM ends streams with a gRPC status and exit 0; a
//! bad flag exits 2 naming the flag.
//!
//! Needs `cargo build --bins` first (the harness says so when a binary is missing).

use ai_lb_e2e::envoy::HttpClient;
use ai_lb_e2e::process::{binary, spawn_agent, spawn_agent_for, spawn_fake_pod, Agent, FakePod};
use ai_lb_proto::v1::metrics_service_client::MetricsServiceClient;
use ai_lb_proto::v1::{
    watch_event, PeerState, PeerStatus, PodSnapshot, PoolEvent, SourceState, WatchEvent,
    WatchPoolRequest, WatchRequest,
};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;
use tonic::transport::Channel;
use tonic::Streaming;

/// Fast agent settings so the tests finish quickly on a loaded machine.
const FAST: &[&str] = &[
    "--sample-interval",
    "50ms",
    "--watch-min-interval",
    "50ms",
    "--heartbeat",
    "200ms",
];

async fn client(addr: SocketAddr) -> MetricsServiceClient<Channel> {
    MetricsServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap_or_else(|e| panic!("connect to agent {addr}: {e}"))
}

async fn within<T>(secs: u64, what: &str, fut: impl std::future::Future<Output = T>) -> T {
    match tokio::time::timeout(Duration::from_secs(secs), fut).await {
        Ok(v) => v,
        Err(_) => panic!("timed out after {secs}s waiting for {what}"),
    }
}

fn control(pod: &FakePod, body: &str) {
    let r = HttpClient::new(pod.http_addr)
        .post_json("/control", &[], body)
        .unwrap_or_else(|e| panic!("POST /control {body}: {e}"));
    assert_eq!(r.status, 200, "POST /control {body}: {}", r.text());
}

async fn next_snapshot(
    stream: &mut Streaming<WatchEvent>,
    pred: impl Fn(&PodSnapshot) -> bool,
) -> PodSnapshot {
    loop {
        let ev = stream.message().await.unwrap().expect("watch ended");
        if let Some(watch_event::Event::Snapshot(s)) = ev.event {
            if pred(&s) {
                return s;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forced_pod_change_reaches_watch_client() {
    let pod = spawn_fake_pod(&[]).unwrap();
    let agent = spawn_agent_for(&pod, FAST).unwrap();
    let mut c = client(agent.grpc_addr).await;
    let mut stream = c.watch(WatchRequest::default()).await.unwrap().into_inner();
    let first = within(10, "first event", stream.message())
        .await
        .unwrap()
        .unwrap();
    let Some(watch_event::Event::Snapshot(s)) = first.event else {
        panic!("first event is not a snapshot: {first:?}");
    };
    assert_eq!(
        s.identity.as_ref().unwrap().address,
        pod.http_addr.to_string()
    );
    within(10, "both sources FRESH", async {
        let mut s = s.clone();
        loop {
            let fresh = |n: &str| {
                s.sources
                    .iter()
                    .any(|x| x.name == n && x.state == SourceState::Fresh as i32)
            };
            if fresh("sim") && fresh("model-server") {
                return;
            }
            s = next_snapshot(&mut stream, |_| true).await;
        }
    })
    .await;

    control(&pod, r#"{"gpu_utilization":0.97}"#);
    within(
        10,
        "forced GPU utilisation",
        next_snapshot(&mut stream, |s| {
            s.gpus
                .first()
                .and_then(|g| g.utilization)
                .is_some_and(|u| (u - 0.97).abs() < 0.005)
        }),
    )
    .await;
    control(&pod, r#"{"queue":50}"#);
    within(
        10,
        "forced queue",
        next_snapshot(&mut stream, |s| {
            s.inference
                .as_ref()
                .and_then(|i| i.waiting)
                .is_some_and(|w| w >= 50)
        }),
    )
    .await;
}

/// Folds pool events: `full` replaces the view, others merge.
#[derive(Default)]
struct View(BTreeMap<String, PeerState>);

impl View {
    fn apply(&mut self, ev: PoolEvent) {
        if ev.full {
            self.0.clear();
        }
        for p in ev.peers {
            self.0.insert(p.peer.clone(), p);
        }
    }
    fn status(&self, peer: &str) -> Option<PeerStatus> {
        self.0
            .get(peer)
            .and_then(|p| PeerStatus::try_from(p.status).ok())
    }
    fn instance(&self, peer: &str) -> Option<String> {
        Some(self.0.get(peer)?.snapshot.as_ref()?.agent_instance.clone())
    }
}

async fn until(stream: &mut Streaming<PoolEvent>, view: &mut View, pred: impl Fn(&View) -> bool) {
    while !pred(view) {
        let ev = stream.message().await.unwrap().expect("pool stream ended");
        view.apply(ev);
    }
}

async fn stale_age(agent: SocketAddr, peer: &str) -> Option<u64> {
    let mut c = client(agent).await;
    let mut s = c
        .watch_pool(WatchPoolRequest::default())
        .await
        .ok()?
        .into_inner();
    let ev = s.message().await.ok()??;
    assert!(ev.full);
    let p = ev.peers.into_iter().find(|p| p.peer == peer)?;
    (p.status == PeerStatus::Stale as i32).then(|| p.snapshot.map(|s| s.age_ms))?
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_marks_killed_peer_stale_and_restarted_peer_live() {
    let pods: Vec<FakePod> = (0..3).map(|_| spawn_fake_pod(&[]).unwrap()).collect();
    let b = spawn_agent_for(&pods[1], FAST).unwrap();
    let mut c_agent = spawn_agent_for(&pods[2], FAST).unwrap();
    let (b_addr, c_addr) = (b.grpc_addr.to_string(), c_agent.grpc_addr.to_string());
    let peers = format!("{b_addr},{c_addr}");
    let mut args: Vec<&str> = FAST.to_vec();
    args.extend_from_slice(&[
        "--peers",
        &peers,
        "--peer-stale-after",
        "1s",
        "--peers-refresh",
        "200ms",
    ]);
    let a = spawn_agent_for(&pods[0], &args).unwrap();
    let mut ca = client(a.grpc_addr).await;
    let mut stream = ca
        .watch_pool(WatchPoolRequest::default())
        .await
        .unwrap()
        .into_inner();
    let mut view = View::default();
    within(
        15,
        "B and C LIVE",
        until(&mut stream, &mut view, |v| {
            v.status(&b_addr) == Some(PeerStatus::Live)
                && v.status(&c_addr) == Some(PeerStatus::Live)
        }),
    )
    .await;
    assert_eq!(view.0.len(), 3, "self + 2 peers: {:?}", view.0.keys());
    let b_instance = view.instance(&b_addr).unwrap();

    // SIGKILL B: STALE with its last snapshot, and its age grows.
    let mut b = b;
    b.proc.kill();
    within(
        10,
        "B STALE",
        until(&mut stream, &mut view, |v| {
            v.status(&b_addr) == Some(PeerStatus::Stale)
        }),
    )
    .await;
    let age0 = view.0[&b_addr]
        .snapshot
        .as_ref()
        .expect("STALE keeps the last snapshot")
        .age_ms;
    within(10, "B's age to grow", async {
        while stale_age(a.grpc_addr, &b_addr).await.unwrap_or(0) <= age0 + 200 {}
    })
    .await;

    // Restart B on the same address: LIVE again as a new instance.
    let b2: Agent = {
        let mut args: Vec<&str> = FAST.to_vec();
        args.extend_from_slice(&["--grpc-listen", &b_addr]);
        spawn_agent_for(&pods[1], &args).unwrap()
    };
    assert_eq!(b2.grpc_addr.to_string(), b_addr);
    within(
        15,
        "B LIVE again",
        until(&mut stream, &mut view, |v| {
            v.status(&b_addr) == Some(PeerStatus::Live)
                && v.instance(&b_addr).is_some_and(|i| i != b_instance)
        }),
    )
    .await;

    // Freeze C (SIGSTOP): no events → STALE after --peer-stale-after; SIGCONT → LIVE.
    c_agent.proc.sigstop().unwrap();
    within(
        10,
        "frozen C STALE",
        until(&mut stream, &mut view, |v| {
            v.status(&c_addr) == Some(PeerStatus::Stale)
        }),
    )
    .await;
    c_agent.proc.sigcont().unwrap();
    within(
        15,
        "resumed C LIVE",
        until(&mut stream, &mut view, |v| {
            v.status(&c_addr) == Some(PeerStatus::Live)
        }),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_ends_streams_with_status_and_exits_zero() {
    let pod = spawn_fake_pod(&[]).unwrap();
    let mut agent = spawn_agent_for(&pod, FAST).unwrap();
    let mut c = client(agent.grpc_addr).await;
    let mut watch = c.watch(WatchRequest::default()).await.unwrap().into_inner();
    let mut pool = c
        .watch_pool(WatchPoolRequest::default())
        .await
        .unwrap()
        .into_inner();
    within(10, "first watch event", watch.message())
        .await
        .unwrap()
        .unwrap();
    within(10, "first pool event", pool.message())
        .await
        .unwrap()
        .unwrap();
    agent.proc.sigterm().unwrap();
    for (name, status) in [
        (
            "watch",
            within(10, "watch status", async {
                loop {
                    match watch.message().await {
                        Ok(Some(_)) => continue,
                        Ok(None) => panic!("watch ended without a status"),
                        Err(s) => return s,
                    }
                }
            })
            .await,
        ),
        (
            "pool",
            within(10, "pool status", async {
                loop {
                    match pool.message().await {
                        Ok(Some(_)) => continue,
                        Ok(None) => panic!("pool ended without a status"),
                        Err(s) => return s,
                    }
                }
            })
            .await,
        ),
    ] {
        assert_eq!(
            status.code(),
            tonic::Code::Unavailable,
            "{name}: {status:?}"
        );
        assert_eq!(status.message(), "agent shutting down", "{name}");
    }
    let st = agent.proc.wait_exit(Duration::from_secs(10)).unwrap();
    assert_eq!(st.code(), Some(0), "{}", agent.proc.failure("exit status"));
}

#[test]
fn bad_flag_exits_2_naming_flag_and_value() {
    let bin = binary("ai-lb-agent").unwrap();
    let out = std::process::Command::new(bin)
        .args([
            "--serving-address",
            "10.0.0.1:8000",
            "--gpu-source",
            "none",
            "--sample-interval",
            "abc",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(
            r#"invalid value "abc" for --sample-interval: expected a duration like 100ms or 2s"#
        ),
        "{err}"
    );
    // spawn_agent reports such an early exit with the log.
    let e = spawn_agent(&["--serving-address", "nope", "--gpu-source", "none"]).unwrap_err();
    assert!(e.contains("--serving-address"), "{e}");
}
