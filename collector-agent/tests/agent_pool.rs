//! WatchPool over three in-process agents that list each other (and themselves): the pool view
//! is self + two peers; stopping one marks it STALE with its last snapshot and a growing age;
//! restarting it on the same address brings it back LIVE with a new agent instance.

mod agent_support;

use agent_support::*;
use ai_lb_proto::v1::{PeerState, PeerStatus, PoolEvent, WatchPoolRequest};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tonic::Streaming;

/// Folds pool events into the receiver's view: `full` replaces, otherwise merges.
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
}

async fn until(stream: &mut Streaming<PoolEvent>, view: &mut View, pred: impl Fn(&View) -> bool) {
    while !pred(view) {
        let ev = stream.message().await.unwrap().expect("pool stream ended");
        view.apply(ev);
    }
}

async fn first_full(addr: std::net::SocketAddr) -> PoolEvent {
    let mut c = client(addr).await;
    let mut s = c
        .watch_pool(WatchPoolRequest::default())
        .await
        .unwrap()
        .into_inner();
    let ev = s.message().await.unwrap().unwrap();
    assert!(ev.full, "first pool event must be full: {ev:?}");
    ev
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_marks_killed_peer_stale_and_restarted_peer_live() {
    let listeners = [
        TcpListener::bind("127.0.0.1:0").await.unwrap(),
        TcpListener::bind("127.0.0.1:0").await.unwrap(),
        TcpListener::bind("127.0.0.1:0").await.unwrap(),
    ];
    let addrs: Vec<_> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    let peers: Vec<String> = addrs.iter().map(|a| a.to_string()).collect();
    let knobs = [Knob::default(), Knob::default(), Knob::default()];
    let cfgs: Vec<_> = (0..3)
        .map(|i| test_config(&format!("10.0.0.{}:8000", i + 1), peers.clone()))
        .collect();
    let mut agents = Vec::new();
    for (i, l) in listeners.into_iter().enumerate() {
        agents.push(Some(start_on(&cfgs[i], &knobs[i], l).await));
    }
    let (a, b, c) = (&peers[0], &peers[1], &peers[2]);

    let mut client_a = client(addrs[0]).await;
    let mut stream = client_a
        .watch_pool(WatchPoolRequest {
            min_interval_ms: 0,
            heartbeat_ms: 100,
        })
        .await
        .unwrap()
        .into_inner();
    let mut view = View::default();
    within(
        10,
        "all three LIVE",
        until(&mut stream, &mut view, |v| {
            [a, b, c]
                .iter()
                .all(|p| v.status(p) == Some(PeerStatus::Live))
        }),
    )
    .await;
    assert_eq!(
        view.0.len(),
        3,
        "self is listed once, not as its own peer: {:?}",
        view.0.keys()
    );
    assert_eq!(
        view.0[b]
            .snapshot
            .as_ref()
            .unwrap()
            .identity
            .as_ref()
            .unwrap()
            .address,
        "10.0.0.2:8000"
    );
    let b_instance = view.0[b].snapshot.as_ref().unwrap().agent_instance.clone();

    // Peer changes reach the pool stream.
    knobs[2].set(|k| k.util = 0.88);
    within(
        10,
        "C's change via A's pool",
        until(&mut stream, &mut view, |v| {
            v.0[c]
                .snapshot
                .as_ref()
                .and_then(|s| s.gpus.first()?.utilization)
                == Some(0.88)
        }),
    )
    .await;

    // Stop B: it becomes STALE, keeping its last snapshot, and its age grows.
    if let Some(agent_b) = agents[1].take() {
        agent_b.shutdown(Duration::from_secs(5)).await;
    }
    within(
        10,
        "B STALE",
        until(&mut stream, &mut view, |v| {
            v.status(b) == Some(PeerStatus::Stale)
        }),
    )
    .await;
    let stale = &view.0[b];
    assert!(!stale.reason.is_empty());
    let age0 = stale
        .snapshot
        .as_ref()
        .expect("STALE keeps the last snapshot")
        .age_ms;
    within(10, "B's age to grow", async {
        loop {
            let ev = first_full(addrs[0]).await;
            let p = ev
                .peers
                .iter()
                .find(|p| &p.peer == b)
                .expect("B still listed");
            assert_eq!(p.status, PeerStatus::Stale as i32);
            if p.snapshot.as_ref().unwrap().age_ms > age0 + 100 {
                return;
            }
        }
    })
    .await;

    // Restart B on the same address: LIVE again, as a new agent instance.
    let l = rebind(addrs[1], Duration::from_secs(5)).await;
    agents[1] = Some(start_on(&cfgs[1], &knobs[1], l).await);
    within(
        15,
        "B LIVE again",
        until(&mut stream, &mut view, |v| {
            v.status(b) == Some(PeerStatus::Live)
                && v.0[b]
                    .snapshot
                    .as_ref()
                    .is_some_and(|s| s.agent_instance != b_instance)
        }),
    )
    .await;

    for agent in agents.into_iter().flatten() {
        agent.shutdown(Duration::from_secs(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_discovery_adds_new_peers_and_removes_vanished_ones() {
    let lb = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let lc = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let la = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (b_addr, c_addr, a_addr) = (
        lb.local_addr().unwrap(),
        lc.local_addr().unwrap(),
        la.local_addr().unwrap(),
    );
    let knob = Knob::default();
    let b = start_on(&test_config("10.0.0.2:8000", vec![]), &knob, lb).await;
    let c = start_on(&test_config("10.0.0.3:8000", vec![]), &knob, lc).await;
    let dns = FakeDns::default();
    // The answer includes the agent itself, as a headless Service's does.
    dns.answer(&[a_addr, b_addr]);
    let mut cfg = test_config("10.0.0.1:8000", vec![]);
    cfg.peers_dns = Some("pods.test:9090".into());
    let a = start_with(&cfg, &knob, la, Some(Arc::new(dns.clone()))).await;

    let mut ca = client(a.grpc_addr).await;
    let mut stream = ca
        .watch_pool(WatchPoolRequest::default())
        .await
        .unwrap()
        .into_inner();
    let mut view = View::default();
    let (bs, cs) = (b_addr.to_string(), c_addr.to_string());
    within(
        10,
        "B LIVE from DNS",
        until(&mut stream, &mut view, |v| {
            v.status(&bs) == Some(PeerStatus::Live)
        }),
    )
    .await;
    assert_eq!(view.0.len(), 2, "self + B: {:?}", view.0.keys());

    dns.answer(&[a_addr, b_addr, c_addr]);
    within(
        10,
        "C appears LIVE without a restart",
        until(&mut stream, &mut view, |v| {
            v.status(&cs) == Some(PeerStatus::Live)
        }),
    )
    .await;

    dns.answer(&[a_addr, c_addr]);
    within(
        10,
        "B REMOVED",
        until(&mut stream, &mut view, |v| {
            v.status(&bs) == Some(PeerStatus::Removed)
        }),
    )
    .await;
    assert_eq!(view.status(&cs), Some(PeerStatus::Live));
    for agent in [a, b, c] {
        agent.shutdown(Duration::from_secs(5)).await;
    }
}

/// A peer's jump reaches a `WatchPool` client through both coalescing stages (the peer's
/// `Watch` and the pool stream, each at 5 s here) without waiting for either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn urgent_peer_change_skips_both_coalescing_stages() {
    let la = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let lb = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (a_addr, b_addr) = (la.local_addr().unwrap(), lb.local_addr().unwrap());
    let (ka, kb) = (Knob::default(), Knob::default());
    ka.set(|k| k.util = 0.10);
    let cfg_a = test_config("10.0.0.1:8000", vec![]);
    let mut cfg_b = test_config("10.0.0.2:8000", vec![a_addr.to_string()]);
    cfg_b.watch_min_interval = Duration::from_secs(5);
    let agent_a = start_on(&cfg_a, &ka, la).await;
    let agent_b = start_on(&cfg_b, &kb, lb).await;
    let a = a_addr.to_string();
    let mut c = client(b_addr).await;
    let mut stream = c
        .watch_pool(WatchPoolRequest {
            min_interval_ms: 5_000,
            heartbeat_ms: 0,
        })
        .await
        .unwrap()
        .into_inner();
    let mut view = View::default();
    let util = |v: &View| {
        v.0.get(&a)
            .and_then(|p| p.snapshot.as_ref())
            .and_then(|s| s.gpus.first())
            .and_then(|g| g.utilization)
    };
    // Seeing A here means both stages have pushed (A to B, B to this stream): each is now
    // inside its 5 s coalescing interval, which the jump must skip.
    within(
        10,
        "peer A live",
        until(&mut stream, &mut view, |v| util(v) == Some(0.10)),
    )
    .await;
    let t0 = std::time::Instant::now();
    ka.set(|k| k.util = 0.99);
    within(
        10,
        "the jump",
        until(&mut stream, &mut view, |v| util(v) == Some(0.99)),
    )
    .await;
    assert!(
        t0.elapsed() < Duration::from_millis(4_000),
        "the jump waited for a 5 s coalescing interval: {:?}",
        t0.elapsed()
    );
    agent_b.shutdown(Duration::from_secs(5)).await;
    agent_a.shutdown(Duration::from_secs(5)).await;
}
