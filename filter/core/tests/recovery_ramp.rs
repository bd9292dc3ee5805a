//! Ramped recovery (`breaker.recoveryRamp`, issue 30): after a pod's breaker closes, its share of
//! requests comes back in steps (0.1, 0.3, 0.5 of its weight, then all of it), each step
//! moving on time, and one failure during the ramp re-opens it; without the ramp the pod gets
//! its whole share at once and needs `consecutiveFailures` failures to open again.
//!
//! Four idle pods of equal score, `proportional` draws (each pod's share is its weight's share
//! of the total, so a step's expected share is exact) and `twoChoices` (the default: a ramping
//! pod is drawn less, so it competes less).

use ai_lb_filter_core::breaker::{Breaker, BreakerState, Outcome, TripReason};
use ai_lb_filter_core::config::FilterConfig;
use ai_lb_filter_core::picker::{Decision, RequestSize, Router};
use ai_lb_proto::{
    GpuStats, InferenceStats, PeerState, PeerStatus, PodIdentity, PodSnapshot, PoolEvent,
};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

const PODS: usize = 4;
/// When pod 0's breaker closed.
const CLOSED_AT: u64 = 10_000;

fn addr(i: usize) -> String {
    format!("10.0.0.{}:8000", i + 1)
}

fn event(seq: u64) -> PoolEvent {
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
                    ..Default::default()
                }),
                reason: String::new(),
            })
            .collect(),
        ..Default::default()
    }
}

/// Four pods under `strategy`, with `extra` members appended to the breaker section.
fn router_with(strategy: &str, extra: &str) -> Router {
    let cfg = FilterConfig::from_json(
        format!(
            r#"{{"pools":[{{"name":"p","cluster":"c"}}],"minPods":1,"pickStrategy":"{strategy}",
            "breaker":{{"consecutiveFailures":3,"baseCooldownMs":1000,"halfOpenProbes":1{extra}}}}}"#
        )
        .as_bytes(),
    )
    .unwrap();
    let mut r = Router::new(cfg);
    r.apply_pool_event(0, &event(1), CLOSED_AT - 5_000);
    r
}

fn router(extra: &str) -> Router {
    router_with("twoChoices", extra)
}

/// Pod 0's breaker: opened at 1 s, half-open after its cooldown, its one probe passed at
/// `CLOSED_AT`; installed as the shared breaker of every worker would be.
fn close_pod0(r: &mut Router) {
    let cfg = r.config().breaker;
    let mut b = Breaker::default();
    b.trip(TripReason::ServerErrors, 1_000, &cfg);
    b.poll(CLOSED_AT - 1, &cfg);
    assert_eq!(b.state(), BreakerState::HalfOpen);
    b.on_request(CLOSED_AT - 1);
    b.record(None, CLOSED_AT, &cfg);
    assert_eq!(b.state(), BreakerState::Closed);
    r.set_breaker(0, &addr(0), None, b);
}

/// Pod 0's share of `n` requests decided at `now` (each ended at once, so load stays even).
fn share_of_pod0(r: &mut Router, now: u64, n: u32, seed: u64) -> f64 {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    // Fresh metrics at `now`.
    r.apply_pool_event(0, &event(now), now);
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

/// A step's expected share of pod 0 under `proportional`: its weight `f` against 3 pods at 1.
fn expected(f: f64) -> f64 {
    f / (f + 3.0)
}

#[test]
fn proportional_shares_follow_each_step_then_return_whole() {
    let mut r = router(r#","recoveryRamp":{}"#);
    let mut r2 = router_with("proportional", r#","recoveryRamp":{}"#);
    close_pod0(&mut r2);
    for (i, (at, f)) in [
        (CLOSED_AT + 100, 0.1),
        (CLOSED_AT + 5_100, 0.3),
        (CLOSED_AT + 10_100, 0.5),
        (CLOSED_AT + 15_100, 1.0),
    ]
    .into_iter()
    .enumerate()
    {
        let got = share_of_pod0(&mut r2, at, 8_000, i as u64);
        let want = expected(f);
        assert!(
            (got - want).abs() < 0.02,
            "at +{} ms: share {got:.3}, expected {want:.3} (step {f})",
            at - CLOSED_AT
        );
    }
    // The default strategy draws the ramping pod less as well.
    close_pod0(&mut r);
    let ramping = share_of_pod0(&mut r, CLOSED_AT + 100, 8_000, 9);
    let whole = share_of_pod0(&mut r, CLOSED_AT + 20_000, 8_000, 10);
    assert!(
        ramping < whole * 0.5,
        "twoChoices: {ramping:.3} while ramping against {whole:.3} after"
    );
}

#[test]
fn without_the_ramp_the_whole_share_returns_at_once() {
    let mut r = router_with("proportional", "");
    close_pod0(&mut r);
    let got = share_of_pod0(&mut r, CLOSED_AT + 100, 8_000, 3);
    assert!((got - expected(1.0)).abs() < 0.02, "{got:.3}");
    // One failure does not re-open it.
    let failed = Outcome {
        status: Some(500),
        ..Default::default()
    };
    r.on_outcome(0, &addr(0), None, &failed, CLOSED_AT + 200);
    assert_eq!(
        r.breaker(0, &addr(0), None).unwrap().state(),
        BreakerState::Closed
    );
    assert_eq!(r.counters().breaker_ramp_failures, 0);
}

#[test]
fn one_failure_during_the_ramp_reopens_the_pod_and_is_counted() {
    let mut r = router(r#","recoveryRamp":{"steps":[0.2],"stepMs":2000}"#);
    close_pod0(&mut r);
    let failed = Outcome {
        status: Some(500),
        ..Default::default()
    };
    let events = r.on_outcome(0, &addr(0), None, &failed, CLOSED_AT + 1_500);
    assert!(
        events.iter().any(|e| e.to == BreakerState::Open),
        "{events:?}"
    );
    assert_eq!(r.counters().breaker_ramp_failures, 1);
    // Its traffic stops: no request goes to an open pod.
    let share = share_of_pod0(&mut r, CLOSED_AT + 1_600, 2_000, 4);
    assert_eq!(share, 0.0);
    // After the ramp (one step of 2 s) a failure counts as any other.
    let mut r = router(r#","recoveryRamp":{"steps":[0.2],"stepMs":2000}"#);
    close_pod0(&mut r);
    r.on_outcome(0, &addr(0), None, &failed, CLOSED_AT + 2_000);
    assert_eq!(
        r.breaker(0, &addr(0), None).unwrap().state(),
        BreakerState::Closed
    );
    assert_eq!(r.counters().breaker_ramp_failures, 0);
}

#[test]
fn the_step_moves_on_time_with_no_new_snapshot_and_the_status_page_shows_it() {
    let mut r = router(r#","recoveryRamp":{"steps":[0.1,0.3],"stepMs":500}"#);
    close_pod0(&mut r);
    share_of_pod0(&mut r, CLOSED_AT + 100, 10, 5);
    let ramp_at = |r: &mut Router, now: u64| {
        r.tick(now);
        let rows = r.pod_status(0, now);
        assert!(rows
            .iter()
            .filter(|s| s.address != addr(0))
            .all(|s| s.ramp == 1.0));
        rows.iter().find(|s| s.address == addr(0)).unwrap().ramp
    };
    assert_eq!(ramp_at(&mut r, CLOSED_AT + 100), 0.1);
    // No snapshot since +100 ms: the refresh is due at the step's end all the same.
    assert_eq!(ramp_at(&mut r, CLOSED_AT + 600), 0.3);
    assert_eq!(ramp_at(&mut r, CLOSED_AT + 1_050), 1.0);
}
