//! Degrade before OOM (`preOom`, issue 30 part 2): while a pod's agent reports a pre-OOM
//! countdown its share falls, from `cutBeforeMs` before the projected OOM it gets no new
//! request, the state clears when the agent stops reporting it (the share coming back over
//! `recoverMs`), a stale snapshot is cut as
//! stale (not acted on as pre-OOM), and with the section off nothing changes.
//!
//! Four idle pods of equal score under `proportional` draws, so a pod's share is its weight's
//! share of the total.

use ai_lb_filter_core::config::FilterConfig;
use ai_lb_filter_core::picker::{Decision, RequestSize, Router};
use ai_lb_filter_core::status::scoreboard;
use ai_lb_proto::{
    GpuStats, InferenceStats, PeerState, PeerStatus, PodIdentity, PodSnapshot, PoolEvent, PreOom,
};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

const PODS: usize = 4;

fn addr(i: usize) -> String {
    format!("10.0.0.{}:8000", i + 1)
}

/// Pod 0 reports `pre_oom` (countdown left, projected ms) when Some; every snapshot `age` ms
/// old at send time.
fn event(seq: u64, pre_oom: Option<(u64, Option<u64>)>, age: u64) -> PoolEvent {
    PoolEvent {
        full: true,
        peers: (0..PODS)
            .map(|i| PeerState {
                peer: format!("agent-{i}:9090"),
                status: PeerStatus::Live as i32,
                snapshot: Some(PodSnapshot {
                    identity: Some(PodIdentity {
                        address: addr(i),
                        pod_name: format!("pod-{i}"),
                        ..Default::default()
                    }),
                    gpus: vec![GpuStats {
                        utilization: Some(0.5),
                        sm_occupancy: Some(0.3),
                        memory_used_bytes: Some(75_000_000_000),
                        memory_total_bytes: Some(80_000_000_000),
                        memory_growth_bytes_per_s: Some(1e9),
                        pre_oom: pre_oom.filter(|_| i == 0).map(|(left, projected)| PreOom {
                            countdown_ms: left,
                            countdown_total_ms: 15_000,
                            projected_oom_in_ms: projected,
                        }),
                        ..Default::default()
                    }],
                    inference: Some(InferenceStats {
                        waiting: Some(0),
                        running: Some(1),
                        queue_capacity: Some(8),
                        kv_cache_usage: Some(0.1),
                        ..Default::default()
                    }),
                    sequence: seq,
                    agent_instance: format!("agent-{i}"),
                    age_ms: age,
                    ..Default::default()
                }),
                reason: String::new(),
            })
            .collect(),
        ..Default::default()
    }
}

fn router(extra: &str) -> Router {
    let cfg = FilterConfig::from_json(
        format!(
            r#"{{"pools":[{{"name":"p","cluster":"c"}}],"minPods":1,"pickStrategy":"proportional",
            "emaAlpha":1{extra}}}"#
        )
        .as_bytes(),
    )
    .unwrap();
    let mut r = Router::new(cfg);
    r.apply_pool_event(0, &event(1, None, 0), 1_000);
    r
}

/// Pod 0's share of `n` requests decided at `now` (each ended at once).
fn share_of_pod0(r: &mut Router, now: u64, n: u32) -> f64 {
    let mut rng = ChaCha8Rng::seed_from_u64(now);
    let mut hits = 0u32;
    for _ in 0..n {
        let chosen = match r.decide_for(0, None, RequestSize::UNIT, now, &mut rng) {
            Decision::Steer { ranked, .. } => r
                .address(0, &ranked, ranked.first().unwrap())
                .unwrap()
                .to_string(),
            d => panic!("{d:?}"),
        };
        if chosen == addr(0) {
            hits += 1;
        }
        r.on_request_start(0, &chosen, RequestSize::UNIT, now);
        r.on_request_end(0, &chosen, RequestSize::UNIT, now);
    }
    f64::from(hits) / f64::from(n)
}

fn cut_of_pod0(r: &Router, now: u64) -> Option<String> {
    let page = scoreboard(r, now);
    let pods = page["pools"][0]["pods"].as_array().unwrap();
    let p0 = pods.iter().find(|p| p["address"] == addr(0)).unwrap();
    p0["cut"].as_str().map(str::to_string)
}

#[test]
fn the_share_falls_during_the_countdown_and_the_pod_is_cut_5s_before_the_oom() {
    let mut r = router("");
    let even = share_of_pod0(&mut r, 1_500, 4000);
    assert!((even - 0.25).abs() < 0.03, "{even}");
    // The countdown starts at 2 s: 15 s left, no projection (a rate falling to 0 would give
    // none). Weight 1 at the start: (15 − 5) / (15 − 5).
    r.apply_pool_event(0, &event(2, Some((15_000, None)), 0), 2_000);
    let s = share_of_pod0(&mut r, 2_000, 4000);
    assert!((s - 0.25).abs() < 0.03, "{s}");
    // 5 s later (a fresh snapshot, the same countdown): 10 s to OOM, weight (10 − 5) / 10 =
    // 0.5: share 0.5 / 3.5.
    r.apply_pool_event(0, &event(3, Some((10_000, None)), 0), 7_000);
    let s = share_of_pod0(&mut r, 7_000, 4000);
    assert!((s - 0.5 / 3.5).abs() < 0.03, "{s}");
    assert_eq!(cut_of_pod0(&r, 7_000), None);
    // The countdown runs on the filter's clock between snapshots: at 12 s, 5 s to OOM: cut.
    // (A fresh snapshot saying the same keeps the pod's metrics from going stale.)
    r.apply_pool_event(0, &event(4, Some((5_500, None)), 0), 11_500);
    let s = share_of_pod0(&mut r, 11_999, 1000);
    assert!(s > 0.0 && s < 0.06, "{s}: minShare 0.1 just before the cut");
    let s = share_of_pod0(&mut r, 12_000, 1000);
    assert_eq!(s, 0.0);
    assert_eq!(cut_of_pod0(&r, 12_000).as_deref(), Some("pre_oom"));
    assert_eq!(r.counters().pre_oom_degraded, 1);
    assert_eq!(r.counters().pre_oom_cut, 1);
}

#[test]
fn an_earlier_projection_cuts_sooner_and_the_snapshot_age_counts() {
    let mut r = router("");
    // Projected OOM 7 s after the sample, sampled 1.5 s before it arrived: 5.5 s left on
    // arrival, cut 0.5 s later.
    r.apply_pool_event(0, &event(2, Some((15_000, Some(7_000))), 1_500), 2_000);
    assert!(share_of_pod0(&mut r, 2_000, 1000) > 0.0);
    assert_eq!(share_of_pod0(&mut r, 2_500, 1000), 0.0);
    assert_eq!(cut_of_pod0(&r, 2_500).as_deref(), Some("pre_oom"));
}

#[test]
fn the_state_clears_when_the_agent_stops_reporting_it() {
    let mut r = router("");
    r.apply_pool_event(0, &event(2, Some((4_000, None)), 0), 2_000);
    assert_eq!(share_of_pod0(&mut r, 2_000, 1000), 0.0);
    // The growth fell: the agent reports no state; the cut ends and the share comes back
    // over recoverMs (10 s) from minShare (0.1).
    r.apply_pool_event(0, &event(3, None, 0), 3_000);
    let s = share_of_pod0(&mut r, 3_000, 4000);
    assert!((s - 0.1 / 3.1).abs() < 0.02, "{s}");
    assert_eq!(cut_of_pod0(&r, 3_000), None);
    r.apply_pool_event(0, &event(4, None, 0), 8_000);
    let s = share_of_pod0(&mut r, 8_000, 4000);
    assert!((s - 0.55 / 3.55).abs() < 0.03, "{s}");
    r.apply_pool_event(0, &event(5, None, 0), 13_000);
    let s = share_of_pod0(&mut r, 13_000, 4000);
    assert!((s - 0.25).abs() < 0.03, "{s}");
    // A second episode counts again.
    r.apply_pool_event(0, &event(6, Some((1_000, None)), 0), 14_000);
    assert_eq!(share_of_pod0(&mut r, 14_000, 100), 0.0);
    assert_eq!(r.counters().pre_oom_cut, 2);
    assert_eq!(r.counters().pre_oom_degraded, 2);
}

#[test]
fn with_recover_ms_0_the_pod_is_back_whole_at_once() {
    let mut r = router(r#","preOom":{"recoverMs":0}"#);
    r.apply_pool_event(0, &event(2, Some((4_000, None)), 0), 2_000);
    assert_eq!(share_of_pod0(&mut r, 2_000, 1000), 0.0);
    r.apply_pool_event(0, &event(3, None, 0), 3_000);
    let s = share_of_pod0(&mut r, 3_000, 4000);
    assert!((s - 0.25).abs() < 0.03, "{s}");
}

#[test]
fn a_stale_snapshot_is_cut_as_stale() {
    let mut r = router("");
    r.apply_pool_event(0, &event(2, Some((6_000, None)), 0), 2_000);
    // No snapshot for 4 s (stalenessMs 3000): every pod stale; pod 0's cut says so, not
    // pre_oom.
    r.tick(6_000);
    assert_eq!(cut_of_pod0(&r, 6_000).as_deref(), Some("stale"));
    assert_eq!(r.counters().pre_oom_cut, 0);
}

#[test]
fn with_the_section_off_the_state_is_ignored() {
    let mut r = router(r#","preOom":{"enabled":false}"#);
    r.apply_pool_event(0, &event(2, Some((1_000, Some(500))), 0), 2_000);
    let s = share_of_pod0(&mut r, 2_000, 4000);
    assert!((s - 0.25).abs() < 0.03, "{s}");
    assert_eq!(r.counters().pre_oom_degraded, 0);
}

#[test]
fn nonsense_states_are_refused_and_counted() {
    let mut r = router("");
    let before = r.counters().signal_issues;
    // A countdown longer than its length: dropped, counted as a signal issue, pod untouched.
    let mut e = event(2, Some((20_000, None)), 0);
    if let Some(s) = e.peers[0].snapshot.as_mut() {
        s.gpus[0].pre_oom.as_mut().unwrap().countdown_ms = 20_000;
    }
    r.apply_pool_event(0, &e, 2_000);
    let s = share_of_pod0(&mut r, 2_000, 4000);
    assert!((s - 0.25).abs() < 0.03, "{s}");
    assert!(r.counters().signal_issues > before);
    // Bad config is refused, naming the field.
    let e = FilterConfig::from_json(
        br#"{"pools":[{"name":"p","cluster":"c"}],"preOom":{"minShare":2}}"#,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("preOom.minShare"), "{e}");
    assert!(FilterConfig::from_json(
        br#"{"pools":[{"name":"p","cluster":"c"}],"preOom":{"cutBefore":2}}"#
    )
    .is_err());
}
