//! Capacity-aware picking in pools that mix GPU generations (issue 27, part 5): a pod that
//! decodes faster than its pool turns its requests over sooner, so at the same load it counts
//! as less loaded and its queue as shorter; the fast pods of a mixed pool get more than an even
//! share, as least_request gives them (it sees their requests end sooner).

use ai_lb_filter_core::config::FilterConfig;
use ai_lb_filter_core::picker::{Decision, RequestSize, Router};
use ai_lb_proto::{
    GpuStats, InferenceStats, LatencyQuantiles, PeerState, PeerStatus, PodIdentity, PodSnapshot,
    PoolEvent,
};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

fn addr(i: usize) -> String {
    format!("10.0.1.{}:8000", i + 1)
}

/// Eight pods, each running `running` of 8 seats with nothing waiting; `itl_ms[i]` is pod i's
/// mean inter-token latency over the agent's recent window.
fn event(itl_ms: &[f64], running: &[u32], seq: u64) -> PoolEvent {
    PoolEvent {
        full: true,
        peers: itl_ms
            .iter()
            .zip(running)
            .enumerate()
            .map(|(i, (itl, run))| PeerState {
                peer: format!("agent-{i}:9090"),
                status: PeerStatus::Live as i32,
                snapshot: Some(PodSnapshot {
                    identity: Some(PodIdentity {
                        address: addr(i),
                        ..Default::default()
                    }),
                    // No GPM on any: scores are equal, only load and speed tell them apart.
                    gpus: vec![GpuStats {
                        utilization: Some(1.0),
                        ..Default::default()
                    }],
                    inference: Some(InferenceStats {
                        waiting: Some(0),
                        running: Some(*run),
                        queue_capacity: Some(8),
                        kv_cache_usage: Some(0.2),
                        kv_capacity_tokens: Some(12_500),
                        inter_token_recent: Some(LatencyQuantiles {
                            p50_ms: Some(*itl),
                            mean_ms: Some(*itl),
                            samples: 100,
                            ..Default::default()
                        }),
                        ..Default::default()
                    }),
                    sequence: seq,
                    agent_instance: format!("agent-{i}"),
                    ..Default::default()
                }),
                reason: String::new(),
            })
            .collect(),
        ..Default::default()
    }
}

fn router(itl_ms: &[f64], running: &[u32]) -> Router {
    let cfg = FilterConfig::from_json(
        br#"{"pools":[{"name":"p","cluster":"c"}],"minPods":1,"floorWeight":0.05}"#,
    )
    .unwrap();
    let mut r = Router::new(cfg);
    r.apply_pool_event(0, &event(itl_ms, running, 1), 1000);
    r
}

/// Share of `n` picks (each counted in flight, none ending) that go to pods 0 and 1.
fn fast_share(r: &mut Router, n: usize, seed: u64) -> f64 {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let size = RequestSize {
        weight: 1.0,
        kv_tokens: 400.0,
        output_tokens: 200.0,
    };
    let mut fast = 0;
    for k in 0..n {
        let now = 1000 + k as u64;
        let d = r.decide_for(0, None, size, now, &mut rng);
        let Decision::Steer { ranked, .. } = d else {
            panic!("{d:?}")
        };
        let a = r
            .address(0, &ranked, ranked.first().unwrap())
            .unwrap()
            .to_string();
        if a == addr(0) || a == addr(1) {
            fast += 1;
        }
        r.on_request_start(0, &a, size, now);
    }
    fast as f64 / n as f64
}

#[test]
fn faster_pods_of_a_mixed_pool_take_more_than_an_even_share() {
    // Two H100-like pods (5 ms a token) among six A100-like ones (8 ms), all half busy.
    let mixed = [5.0, 5.0, 8.0, 8.0, 8.0, 8.0, 8.0, 8.0];
    let running = [4; 8];
    let same = [8.0; 8];
    let (mut with_speeds, mut all_alike) = (0.0, 0.0);
    for seed in 0..10 {
        with_speeds += fast_share(&mut router(&mixed, &running), 24, seed);
        all_alike += fast_share(&mut router(&same, &running), 24, seed);
    }
    let (with_speeds, all_alike) = (with_speeds / 10.0, all_alike / 10.0);
    // Evenly: 2 of 8 = 25 %. At 1.6x the speed, noticeably more; all alike, about even.
    assert!(with_speeds >= 0.32, "fast pods' share {with_speeds}");
    assert!(
        (0.18..=0.32).contains(&all_alike),
        "even pool's share {all_alike}"
    );
}

/// Requests a pod holds before its engine (an API server starved of CPU) are in no metric it
/// reports; this VM's own requests in flight there still count, so a reading that misses them
/// does not make the pod look empty.
#[test]
fn own_requests_in_flight_count_when_the_pods_reading_misses_them() {
    let itl = [8.0; 8];
    let mut r = router(&itl, &[0; 8]);
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let size = RequestSize {
        weight: 1.0,
        kv_tokens: 400.0,
        output_tokens: 200.0,
    };
    // Six requests sent to pod 0 (none ends), before its next reading.
    for k in 0..6 {
        r.on_request_start(0, &addr(0), size, 1_000 + k);
    }
    // The next reading shows none of them: they wait in front of the engine.
    r.apply_pool_event(0, &event(&itl, &[0; 8], 2), 1_100);
    let st = r.pod_status(0, 1_100);
    let pod0 = st.iter().find(|p| p.address == addr(0)).unwrap();
    assert_eq!(pod0.inflight, 6);
    assert!(
        pod0.load >= 6.0 / 8.0 - 1e-9,
        "pod 0 counts its 6 of 8 seats taken, not the reading's 0: load {}",
        pod0.load
    );
    // So a new request goes to an idle pod, not to it.
    let mut on_pod0 = 0;
    for k in 0..20 {
        let Decision::Steer { ranked, .. } = r.decide_for(0, None, size, 1_200 + k, &mut rng)
        else {
            panic!("no steer")
        };
        on_pod0 += usize::from(r.address(0, &ranked, ranked.first().unwrap()).unwrap() == addr(0));
    }
    assert_eq!(on_pod0, 0, "picks of pod 0 with seven idle pods beside it");
}
