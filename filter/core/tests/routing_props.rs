//! Properties of scoring, breakers and picking, driven by explicit `now_ms` and seeded RNGs.

use ai_lb_filter_core::breaker::{Breaker, BreakerState, Outcome, TripReason};
use ai_lb_filter_core::config::{BreakerConfig, Cutoffs, FilterConfig, PickStrategy, Weights};
use ai_lb_filter_core::picker::{Decision, FallbackReason, RequestSize, Router};
use ai_lb_filter_core::{score, PodSignals, PoolState};
use ai_lb_proto::{
    GpuStats, InferenceStats, LatencyQuantiles, ModelInfo, PeerState, PeerStatus, PodIdentity,
    PodSnapshot, PoolEvent,
};
use proptest::prelude::*;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

#[derive(Clone, Copy, Debug)]
struct Pod {
    gpu: Option<f64>,
    waiting: u32,
    age_ms: u64,
}

fn pod(gpu: f64) -> Pod {
    Pod {
        gpu: Some(gpu),
        waiting: 0,
        age_ms: 0,
    }
}

fn addr(i: usize) -> String {
    format!("10.0.{}.{}:8000", i / 250, i % 250 + 1)
}

fn snapshot(i: usize, p: &Pod, seq: u64, models: &[&str]) -> PodSnapshot {
    PodSnapshot {
        identity: Some(PodIdentity {
            address: addr(i),
            pod_name: format!("pod-{i}"),
            models: models
                .iter()
                .map(|m| ModelInfo {
                    name: (*m).into(),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }),
        // A busy GPU's NVML time fraction reads 1; the graded load is its SM occupancy.
        gpus: vec![GpuStats {
            utilization: p.gpu.map(|_| 1.0),
            sm_occupancy: p.gpu,
            ..Default::default()
        }],
        inference: Some(InferenceStats {
            waiting: p.gpu.map(|_| p.waiting),
            ttft: Some(LatencyQuantiles {
                p99_ms: p.gpu.map(|_| 0.0),
                samples: u64::from(p.gpu.is_some()),
                ..Default::default()
            }),
            kv_cache_usage: p.gpu.map(|_| 0.0),
            ..Default::default()
        }),
        sequence: seq,
        agent_instance: format!("agent-{i}"),
        age_ms: p.age_ms,
        ..Default::default()
    }
}

fn event(pods: &[Pod], seq: u64) -> PoolEvent {
    PoolEvent {
        full: true,
        peers: pods
            .iter()
            .enumerate()
            .map(|(i, p)| PeerState {
                peer: format!("agent-{i}:9090"),
                status: PeerStatus::Live as i32,
                snapshot: Some(snapshot(i, p, seq, &["llm"])),
                reason: String::new(),
            })
            .collect(),
        ..Default::default()
    }
}

/// The inference stats of peer `i`'s snapshot in `ev`.
fn inference(ev: &mut PoolEvent, i: usize) -> &mut InferenceStats {
    ev.peers[i]
        .snapshot
        .as_mut()
        .unwrap()
        .inference
        .as_mut()
        .unwrap()
}

/// A request of `weight` seats and no KV estimate.
fn weighted(weight: f64) -> RequestSize {
    RequestSize {
        weight,
        kv_tokens: 0.0,
        output_tokens: 0.0,
    }
}

fn merge(base: &mut serde_json::Value, extra: serde_json::Value) {
    match (base, extra) {
        (serde_json::Value::Object(b), serde_json::Value::Object(e)) => {
            for (k, v) in e {
                merge(b.entry(k).or_insert(serde_json::Value::Null), v);
            }
        }
        (b, e) => *b = e,
    }
}

/// The test pool config with `extra` (a JSON object) merged over it.
fn config(extra: &str) -> FilterConfig {
    let mut base = serde_json::json!({
        "pools": [{"name": "p", "cluster": "c"}], "minPods": 1, "floorWeight": 0.0,
        "cutoffs": {"gpuHardLimit": 0.9},
        "breaker": {"consecutiveFailures": 2, "baseCooldownMs": 1000, "maxCooldownMs": 8000, "halfOpenProbes": 2}
    });
    if !extra.is_empty() {
        merge(&mut base, serde_json::from_str(extra).unwrap());
    }
    FilterConfig::from_json(base.to_string().as_bytes()).unwrap()
}

fn router(pods: &[Pod], extra: &str) -> Router {
    let mut r = Router::new(config(extra));
    r.apply_pool_event(0, &event(pods, 1), 1000);
    r
}

fn chosen(r: &Router, d: &Decision) -> Option<String> {
    match d {
        Decision::Steer { ranked, .. } | Decision::FailOpen { ranked } => ranked
            .first()
            .and_then(|id| r.address(0, ranked, id))
            .map(str::to_string),
        Decision::Fallback(_) => None,
    }
}

fn counts(r: &mut Router, n: usize, picks: usize, seed: u64, now: u64) -> Vec<usize> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut c = vec![0usize; n];
    for _ in 0..picks {
        let d = r.decide(0, None, now, &mut rng);
        if let Some(a) = chosen(r, &d) {
            let i = (0..n).position(|i| addr(i) == a).unwrap();
            c[i] += 1;
        }
    }
    c
}

#[test]
fn pick_share_follows_score_ratio_for_20_and_60_percent_gpu() {
    let mut r = router(&[pod(0.2), pod(0.6)], "");
    // Other terms are perfect: score = 0.35·(1-gpu) + 0.65.
    let (s0, s1) = (0.35 * 0.8 + 0.65, 0.35 * 0.4 + 0.65);
    let c = counts(&mut r, 2, 100_000, 7, 1000);
    let share = c[0] as f64 / 100_000.0;
    let want = s0 / (s0 + s1);
    assert!((share - want).abs() < 0.005, "share {share}, want {want}");
}

#[test]
fn ranked_list_has_chosen_first_then_best_fallbacks() {
    let mut r = router(
        &[pod(0.1), pod(0.5), pod(0.3), pod(0.95)],
        r#"{"fallbackEndpoints":2}"#,
    );
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let mut buf = String::new();
    for _ in 0..200 {
        let d = r.decide(0, None, 1000, &mut rng);
        let Decision::Steer {
            ranked,
            chosen_score,
        } = d
        else {
            panic!("{d:?}")
        };
        assert_eq!(ranked.len(), 3);
        assert!(chosen_score > 0.0 && chosen_score <= 1.0);
        assert!(r.write_ranked(0, &ranked, &mut buf));
        assert!(!buf.contains(&addr(3)), "cut pod listed: {buf}");
        let parts: Vec<&str> = buf.split(',').collect();
        // The fallbacks are the best two pods other than the chosen one.
        let best: Vec<String> = [0, 2, 1]
            .iter()
            .map(|i| addr(*i))
            .filter(|a| a != parts[0])
            .take(2)
            .collect();
        assert_eq!(
            &parts[1..],
            &best.iter().map(String::as_str).collect::<Vec<_>>()[..]
        );
    }
}

#[test]
fn cold_start_pod_gets_pool_mean() {
    let pods = [
        pod(0.1),
        pod(0.5),
        Pod {
            gpu: None,
            waiting: 0,
            age_ms: 0,
        },
    ];
    let r = router(&pods, "");
    let st = r.pod_status(0, 1000);
    let (a, b, cold) = (st[0].score, st[1].score, &st[2]);
    assert!(cold.cold);
    assert!(
        (cold.score - (a + b) / 2.0).abs() < 1e-12,
        "{} vs mean of {a},{b}",
        cold.score
    );
}

#[test]
fn pod_addresses_list_the_status_rows_pods_in_order() {
    let r = router(&[pod(0.1), pod(0.5), pod(0.9)], "");
    let rows: Vec<String> = r
        .pod_status(0, 1000)
        .iter()
        .map(|s| s.address.to_string())
        .collect();
    let addrs: Vec<&str> = r.pod_addresses(0).collect();
    assert_eq!(addrs.len(), 3);
    assert_eq!(addrs, rows);
    assert_eq!(r.pod_addresses(7).count(), 0, "an unknown pool has no pods");
}

#[test]
fn ema_smooths_successive_snapshots() {
    let mut r = Router::new(config(r#"{"emaAlpha":0.25}"#));
    r.apply_pool_event(0, &event(&[pod(0.0)], 1), 1000);
    r.apply_pool_event(0, &event(&[pod(0.8)], 2), 1100);
    let w = Weights::default();
    let raw1 = 1.0;
    let raw2 = w.gpu * 0.2 + (1.0 - w.gpu);
    let want = 0.25 * raw2 + 0.75 * raw1;
    let got = r.pod_status(0, 1100)[0].score;
    assert!((got - want).abs() < 1e-12, "{got} vs {want}");
    // A heartbeat (no new snapshot) does not move the average.
    r.apply_pool_event(0, &PoolEvent::default(), 1200);
    assert!((r.pod_status(0, 1200)[0].score - want).abs() < 1e-12);
}

#[test]
fn fail_open_spreads_evenly_when_every_pod_is_cut() {
    let mut r = router(&[pod(0.95), pod(0.99), pod(0.97)], "");
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    assert!(matches!(
        r.decide(0, None, 1000, &mut rng),
        Decision::FailOpen { .. }
    ));
    let c = counts(&mut r, 3, 30_000, 11, 1000);
    for n in &c {
        assert!((9_500..=10_500).contains(n), "{c:?}");
    }
    assert_eq!(r.counters().fail_open, 30_001);
}

#[test]
fn fail_open_skips_a_pod_cut_for_its_health_while_pods_cut_for_load_remain() {
    let mut r = router(&[pod(0.99), pod(0.99), pod(0.99)], "");
    let err = Outcome {
        status: Some(503),
        ..Default::default()
    };
    r.on_outcome(0, &addr(0), None, &err, 1000);
    r.on_outcome(0, &addr(0), None, &err, 1000);
    // Every pod over the GPU hard limit, pod 0's breaker open as well: the hot pods serve.
    let c = counts(&mut r, 3, 3_000, 12, 1100);
    assert_eq!(c[0], 0, "{c:?}");
    assert!(c[1] > 1_000 && c[2] > 1_000, "{c:?}");
    assert_eq!(r.counters().fail_open, 3_000);
    // Only pods cut for their health left: fail open among them rather than refuse.
    let mut r = router(&[pod(0.1), pod(0.1)], "");
    for i in 0..2 {
        r.on_outcome(0, &addr(i), None, &err, 1000);
        r.on_outcome(0, &addr(i), None, &err, 1000);
    }
    let c = counts(&mut r, 2, 1_000, 13, 1100);
    assert_eq!(c.iter().sum::<usize>(), 1_000, "{c:?}");
}

#[test]
fn fallback_reasons() {
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let mut r = Router::new(config(""));
    assert_eq!(
        r.decide(0, None, 0, &mut rng),
        Decision::Fallback(FallbackReason::NoAgentData)
    );

    let mut r = Router::new(config(r#"{"minPods":3}"#));
    r.apply_pool_event(0, &event(&[pod(0.1), pod(0.2)], 1), 1000);
    assert_eq!(
        r.decide(0, None, 1000, &mut rng),
        Decision::Fallback(FallbackReason::TooFewPods)
    );
    assert_eq!(
        r.decide(0, Some("other"), 1000, &mut rng),
        Decision::Fallback(FallbackReason::NoModel)
    );
    // Staleness: default 2000 ms after the snapshot was current.
    assert_eq!(
        r.decide(0, None, 3001, &mut rng),
        Decision::Fallback(FallbackReason::AllStale)
    );
    assert_eq!(r.counters().fallback_all_stale, 1);
    assert_eq!(r.counters().fallback_too_few_pods, 1);
}

#[test]
fn staleness_uses_snapshot_age_at_receive_and_a_live_stream_confirms() {
    let mut r = router(
        &[
            Pod {
                age_ms: 1500,
                ..pod(0.1)
            },
            pod(0.1),
        ],
        "",
    );
    let st = r.pod_status(0, 1000);
    assert_eq!(st[0].metrics_age_ms, Some(1500));
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    // At 1501 pod 0 is 2001 ms old: cut, only pod 1 is picked.
    let c = counts(&mut r, 2, 100, 5, 1501);
    assert_eq!(c, vec![0, 100]);
    // A heartbeat on the live stream confirms both as current.
    r.apply_pool_event(0, &PoolEvent::default(), 1600);
    assert!(matches!(
        r.decide(0, None, 1600, &mut rng),
        Decision::Steer { .. }
    ));
    assert_eq!(r.pod_status(0, 1600)[0].cut, None);
}

#[test]
fn model_filter_only_picks_pods_serving_the_model() {
    let mut r = Router::new(config(""));
    let pods = [pod(0.1), pod(0.1)];
    let mut ev = event(&pods, 1);
    ev.peers[1].snapshot = Some(snapshot(1, &pods[1], 1, &["vision"]));
    if let Some(id) = ev.peers[0]
        .snapshot
        .as_mut()
        .and_then(|s| s.identity.as_mut())
    {
        id.models[0].adapters = vec!["sql-lora".into()];
    }
    r.apply_pool_event(0, &ev, 1000);
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    for _ in 0..100 {
        let d = r.decide(0, Some("vision"), 1000, &mut rng);
        assert_eq!(chosen(&r, &d).unwrap(), addr(1));
        let d = r.decide(0, Some("sql-lora"), 1000, &mut rng);
        assert_eq!(chosen(&r, &d).unwrap(), addr(0));
    }
}

#[test]
fn open_breaker_excludes_pod_then_half_open_admits_probe_budget() {
    let mut r = router(&[pod(0.1), pod(0.1)], "");
    let bad = addr(0);
    let err = Outcome {
        status: Some(503),
        ..Default::default()
    };
    assert!(r.on_outcome(0, &bad, None, &err, 1000).is_empty());
    let ev = r.on_outcome(0, &bad, None, &err, 1000);
    assert_eq!(ev.len(), 1);
    assert_eq!(ev[0].to, BreakerState::Open);
    assert_eq!(counts(&mut r, 2, 500, 1, 1500), vec![0, 500]);
    // Cooldown 1000 ms: half-open at 2000, one probe, then none until it reports.
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let mut probes = 0;
    // Keep the snapshot fresh with a heartbeat; it also reports open → half-open.
    let ev = r.apply_pool_event(0, &PoolEvent::default(), 2000);
    assert_eq!(ev.len(), 1);
    assert_eq!(ev[0].to, BreakerState::HalfOpen);
    for _ in 0..500 {
        let d = r.decide(0, None, 2000, &mut rng);
        if chosen(&r, &d).as_deref() == Some(bad.as_str()) {
            probes += 1;
        }
    }
    assert_eq!(probes, 1, "the first probe goes alone");
    assert!(r.take_breaker_events().is_empty(), "already returned");
    let ok = Outcome {
        status: Some(200),
        ..Default::default()
    };
    assert!(r.on_outcome(0, &bad, None, &ok, 2001).is_empty());
    // It succeeded: the rest of the budget (one more) may go.
    let probes = (0..500)
        .filter(|_| {
            let d = r.decide(0, None, 2001, &mut rng);
            chosen(&r, &d).as_deref() == Some(bad.as_str())
        })
        .count();
    assert_eq!(probes, 1);
    let ev = r.on_outcome(0, &bad, None, &ok, 2002);
    assert_eq!(ev[0].to, BreakerState::Closed);
    assert_eq!(r.counters().breaker_closed, 1);
}

#[test]
fn per_model_breaker_opens_only_for_the_failing_model() {
    let mut r = Router::new(config(""));
    let pods = [pod(0.1), pod(0.1)];
    let mut ev = event(&pods, 1);
    ev.peers[0].snapshot = Some(snapshot(0, &pods[0], 1, &["llm", "vision"]));
    ev.peers[1].snapshot = Some(snapshot(1, &pods[1], 1, &["llm", "vision"]));
    r.apply_pool_event(0, &ev, 1000);
    let err = Outcome {
        status: Some(500),
        ..Default::default()
    };
    r.on_outcome(0, &addr(0), Some("vision"), &err, 1000);
    let t = r.on_outcome(0, &addr(0), Some("vision"), &err, 1000);
    assert_eq!(t[0].model.as_deref(), Some("vision"));
    assert_eq!(
        r.breaker(0, &addr(0), None).unwrap().state(),
        BreakerState::Closed
    );
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let (mut vision0, mut llm0) = (0, 0);
    for _ in 0..400 {
        let d = r.decide(0, Some("vision"), 1000, &mut rng);
        vision0 += usize::from(chosen(&r, &d).unwrap() == addr(0));
        let d = r.decide(0, Some("llm"), 1000, &mut rng);
        llm0 += usize::from(chosen(&r, &d).unwrap() == addr(0));
    }
    assert_eq!(vision0, 0);
    assert!(llm0 > 150, "{llm0}");
}

/// Sets the `model-server` source status of peer `i` in `ev`.
fn model_server(ev: &mut PoolEvent, i: usize, failing: bool, answered_before: bool) {
    use ai_lb_proto::{SourceState, SourceStatus};
    ev.peers[i].snapshot.as_mut().unwrap().sources = vec![
        SourceStatus {
            name: "nvml".into(),
            state: SourceState::Fresh as i32,
            last_success_age_ms: Some(1),
            ..Default::default()
        },
        SourceStatus {
            name: "model-server".into(),
            state: if failing {
                SourceState::Failing
            } else {
                SourceState::Fresh
            } as i32,
            reason: if failing {
                "no answer".into()
            } else {
                String::new()
            },
            last_success_age_ms: answered_before.then_some(160),
            ..Default::default()
        },
    ];
}

#[test]
fn a_pod_whose_model_server_stops_answering_is_cut_until_it_answers_again() {
    // Frozen vLLM, live GPU: the GPU reads idle, so the pod scores best of the three.
    let pods = [pod(0.0), pod(0.5), pod(0.5)];
    let mut r = router(&pods, "");
    let mut ev = event(&pods, 2);
    model_server(&mut ev, 0, true, true);
    r.apply_pool_event(0, &ev, 1100);
    assert_eq!(r.counters().model_server_down, 1);
    let c = counts(&mut r, 3, 600, 5, 1100);
    assert_eq!(c[0], 0, "{c:?}");
    let status = r.pod_status(0, 1100);
    let frozen = status.iter().find(|s| s.address == addr(0)).unwrap();
    assert_eq!(frozen.cut.map(|c| c.as_str()), Some("model_server_down"));
    // Still down on the next snapshot: counted once per outage.
    let mut ev = event(&pods, 3);
    model_server(&mut ev, 0, true, true);
    r.apply_pool_event(0, &ev, 1150);
    assert_eq!(r.counters().model_server_down, 1);
    // It answers again: back in rotation at once.
    let mut ev = event(&pods, 4);
    model_server(&mut ev, 0, false, true);
    r.apply_pool_event(0, &ev, 1200);
    assert!(counts(&mut r, 3, 600, 5, 1200)[0] > 200);
    // Never answered (a misconfigured agent): missing metrics, not a cut.
    let mut ev = event(&pods, 5);
    model_server(&mut ev, 0, true, false);
    r.apply_pool_event(0, &ev, 1300);
    assert!(counts(&mut r, 3, 600, 5, 1300)[0] > 0);
    assert_eq!(r.counters().model_server_down, 1);
    // `cutoffs.cutModelServerDown: false` leaves the pod in.
    let mut off = router(&pods, r#"{"cutoffs": {"cutModelServerDown": false}}"#);
    let mut ev = event(&pods, 2);
    model_server(&mut ev, 0, true, true);
    off.apply_pool_event(0, &ev, 1100);
    assert!(counts(&mut off, 3, 600, 5, 1100)[0] > 0);
}

#[test]
fn every_model_server_down_still_serves_evenly() {
    // A pool-wide outage cuts every pod; the picker must not stop routing.
    let pods = [pod(0.1), pod(0.1)];
    let mut r = router(&pods, "");
    let mut ev = event(&pods, 2);
    model_server(&mut ev, 0, true, true);
    model_server(&mut ev, 1, true, true);
    r.apply_pool_event(0, &ev, 1100);
    let c = counts(&mut r, 2, 400, 9, 1100);
    assert!(c[0] > 100 && c[1] > 100, "{c:?}");
}

#[test]
fn hardware_fault_trips_breaker_and_cuts() {
    let mut r = router(&[pod(0.1), pod(0.1)], "");
    let mut ev = event(&[pod(0.1), pod(0.1)], 1);
    ev.peers[0].snapshot.as_mut().unwrap().gpus[0].xid_errors = Some(1);
    r.apply_pool_event(0, &ev, 1100);
    let mut ev = event(&[pod(0.1), pod(0.1)], 2);
    ev.peers[0].snapshot.as_mut().unwrap().gpus[0].xid_errors = Some(2);
    let events = r.apply_pool_event(0, &ev, 1200);
    assert_eq!(events.len(), 1);
    assert_eq!(r.counters().hardware_faults, 1);
    assert_eq!(counts(&mut r, 2, 200, 4, 1200), vec![0, 200]);
    // A shared (closed) breaker from another VM does not undo the local fault trip...
    r.set_breaker(0, &addr(0), None, Breaker::default());
    assert_eq!(
        r.breaker(0, &addr(0), None).unwrap().state(),
        BreakerState::Open
    );
    // ...and the next snapshot without a new fault lifts the cut; the breaker still holds
    // the pod out for its cooldown (1000 ms), then admits probes.
    let mut ev = event(&[pod(0.1), pod(0.1)], 3);
    ev.peers[0].snapshot.as_mut().unwrap().gpus[0].xid_errors = Some(2);
    r.apply_pool_event(0, &ev, 1300);
    assert_eq!(counts(&mut r, 2, 200, 4, 1300), vec![0, 200]);
    r.apply_pool_event(0, &PoolEvent::default(), 2200);
    assert_eq!(
        r.breaker(0, &addr(0), None).unwrap().state(),
        BreakerState::HalfOpen
    );
    assert_eq!(
        counts(&mut r, 2, 200, 4, 2200)[0],
        1,
        "the first probe goes alone"
    );
}

/// Event `seq` where pod 0's agent reports `error_rate` over `requests` requests in 10 s.
fn failing_event(seq: u64, error_rate: f64, requests: f64) -> PoolEvent {
    let mut ev = event(&[pod(0.1), pod(0.1)], seq);
    let inf = inference(&mut ev, 0);
    inf.error_rate = Some(error_rate);
    inf.request_rate = Some(requests / 10.0);
    inf.window_ms = 10_000;
    ev
}

#[test]
fn agent_error_rate_opens_the_breaker_and_keeps_it_open_while_reported() {
    let mut r = router(&[pod(0.1), pod(0.1)], "");
    // 50 % of 8 requests: below `failureRateMinRequests` (10), no trip.
    assert!(r
        .apply_pool_event(0, &failing_event(2, 0.5, 8.0), 1100)
        .is_empty());
    // 20 % of 40: below `agentErrorRate` (0.25), no trip.
    assert!(r
        .apply_pool_event(0, &failing_event(3, 0.2, 40.0), 1200)
        .is_empty());
    assert!(r.take_signal_trips().is_empty());
    // 30 % of 12: the breaker opens on the agent's count, no outcome of this sidecar needed.
    let ev = r.apply_pool_event(0, &failing_event(4, 0.3, 12.0), 1300);
    assert_eq!(ev.len(), 1);
    assert_eq!(
        (ev[0].to, ev[0].reason),
        (BreakerState::Open, Some(TripReason::AgentErrorRate))
    );
    assert_eq!(counts(&mut r, 2, 200, 4, 1300), vec![0, 200]);
    // Still reported failing later: the cooldown (1000 ms) restarts instead of half-opening,
    // and the glue is told once per pod, not once per snapshot.
    r.apply_pool_event(0, &failing_event(5, 0.6, 14.0), 2000);
    r.apply_pool_event(0, &failing_event(6, 0.6, 14.0), 2200);
    let trips = r.take_signal_trips();
    assert_eq!(trips.len(), 1, "{trips:?}");
    assert_eq!(
        (trips[0].pod.as_str(), trips[0].reason),
        (addr(0).as_str(), TripReason::AgentErrorRate)
    );
    r.apply_pool_event(0, &PoolEvent::default(), 2500);
    assert_eq!(
        r.breaker(0, &addr(0), None).unwrap().state(),
        BreakerState::Open
    );
    // Another VM's closed view of the shared breaker does not reopen the pod early.
    r.set_breaker(0, &addr(0), None, Breaker::default());
    assert_eq!(counts(&mut r, 2, 200, 4, 2500), vec![0, 200]);
    // The agent's window drained (no error rate): half-open after the last cooldown.
    r.apply_pool_event(0, &event(&[pod(0.1), pod(0.1)], 7), 2600);
    r.apply_pool_event(0, &PoolEvent::default(), 3200);
    assert_eq!(
        r.breaker(0, &addr(0), None).unwrap().state(),
        BreakerState::HalfOpen
    );
    assert_eq!(
        counts(&mut r, 2, 200, 4, 3200)[0],
        1,
        "the first probe goes alone"
    );
    // On probation one failed probe, as the agent counts it, is evidence enough: it opens
    // again, with the cooldown doubled (opens in a row).
    let ev = r.apply_pool_event(0, &failing_event(8, 1.0, 1.0), 3300);
    assert_eq!(
        (ev[0].to, ev[0].reason),
        (BreakerState::Open, Some(TripReason::AgentErrorRate))
    );
    assert_eq!(r.breaker(0, &addr(0), None).unwrap().open_until_ms(), 5300);
}

#[test]
fn a_pod_its_agent_still_reports_failing_is_not_probed_and_its_cooldown_doubles() {
    let mut r = router(&[pod(0.1), pod(0.1)], "");
    r.apply_pool_event(0, &failing_event(2, 0.5, 12.0), 1000);
    assert_eq!(r.breaker(0, &addr(0), None).unwrap().open_until_ms(), 2000);
    // No new snapshot: at the end of the cooldown the latest one still shows the failures,
    // so no probe goes out and the next cooldown is doubled (1000 -> 2000 ms).
    let _ = r.tick(2000);
    let b = *r.breaker(0, &addr(0), None).unwrap();
    assert_eq!((b.state(), b.open_until_ms()), (BreakerState::Open, 4000));
    assert_eq!(counts(&mut r, 2, 200, 4, 2500), vec![0, 200]);
    // Once the agent's window no longer shows failures, the pod is probed.
    r.apply_pool_event(0, &event(&[pod(0.1), pod(0.1)], 3), 3000);
    let _ = r.tick(4000);
    assert_eq!(
        r.breaker(0, &addr(0), None).unwrap().state(),
        BreakerState::HalfOpen
    );
}

#[test]
fn agent_error_rate_spares_a_pool_that_fails_as_a_whole_and_can_be_switched_off() {
    // Both pods at 40 %: a pool-wide problem (e.g. clients aborting), nobody is cut.
    let mut r = router(&[pod(0.1), pod(0.1)], "");
    let mut ev = failing_event(2, 0.4, 50.0);
    let inf = inference(&mut ev, 1);
    inf.error_rate = Some(0.4);
    inf.request_rate = Some(5.0);
    inf.window_ms = 10_000;
    assert!(r.apply_pool_event(0, &ev, 1100).is_empty());
    assert!(r.take_signal_trips().is_empty());
    assert_eq!(r.counters().agent_errors_pool_wide, 2);
    assert!(counts(&mut r, 2, 200, 4, 1100).iter().all(|&c| c > 0));
    // Switched off: even one pod failing every request is left to the passive breaker.
    let mut r = router(
        &[pod(0.1), pod(0.1)],
        r#"{"breaker": {"agentErrorRate": 0}}"#,
    );
    assert!(r
        .apply_pool_event(0, &failing_event(2, 1.0, 100.0), 1100)
        .is_empty());
    assert!(r.take_signal_trips().is_empty());
    assert!(counts(&mut r, 2, 200, 4, 1100)[0] > 0);
}

#[test]
fn inflight_since_snapshot_lowers_share_until_next_snapshot() {
    let mut r = router(
        &[pod(0.2), pod(0.2)],
        r#"{"cutoffs":{"maxQueue":4},"pickStrategy":"proportional"}"#,
    );
    for _ in 0..4 {
        r.on_request_start(0, &addr(0), RequestSize::UNIT, 1000);
    }
    // Pod 0 weight halves: 1/(1+4/4).
    let c = counts(&mut r, 2, 30_000, 8, 1000);
    let share = c[0] as f64 / 30_000.0;
    assert!((share - 1.0 / 3.0).abs() < 0.01, "{share}");
    r.apply_pool_event(0, &event(&[pod(0.2), pod(0.2)], 2), 1100);
    let c = counts(&mut r, 2, 30_000, 8, 1100);
    assert!((c[0] as f64 / 30_000.0 - 0.5).abs() < 0.01);
}

/// Picks `picks` requests with `decide`, starting each one (never ending it), and counts them.
fn start_many(r: &mut Router, n: usize, picks: usize, seed: u64, now: u64) -> Vec<usize> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut c = vec![0usize; n];
    for _ in 0..picks {
        let d = r.decide(0, None, now, &mut rng);
        let a = chosen(r, &d).unwrap();
        r.on_request_start(0, &a, RequestSize::UNIT, now);
        c[(0..n).position(|i| addr(i) == a).unwrap()] += 1;
    }
    c
}

#[test]
fn two_choices_is_the_default_and_idle_shares_follow_the_score_ratio() {
    assert_eq!(config("").pick_strategy, PickStrategy::TwoChoices);
    // Equal occupancy everywhere (nothing in flight): the first draw wins, so the shares are
    // exactly score-proportional (the e2e 20 % / 60 % GPU test relies on this).
    let mut r = router(&[pod(0.2), pod(0.6), pod(0.4)], "");
    let s: Vec<f64> = [0.2, 0.6, 0.4]
        .iter()
        .map(|g| 0.35 * (1.0 - g) + 0.65)
        .collect();
    let total: f64 = s.iter().sum();
    let c = counts(&mut r, 3, 100_000, 11, 1000);
    for i in 0..3 {
        let share = c[i] as f64 / 100_000.0;
        assert!((share - s[i] / total).abs() < 0.005, "pod {i}: {share}");
    }
}

#[test]
fn two_choices_spreads_this_sidecars_requests_by_occupancy() {
    // Four equal pods, requests started and never ended: the lower-occupancy candidate wins,
    // so after 400 starts every pod holds close to 100 (one draw would leave a spread of
    // about ±3 sigma = ±26 around 100).
    let mut r = router(&[pod(0.2); 4], r#"{"cutoffs":{"maxQueue":8}}"#);
    let c = start_many(&mut r, 4, 400, 3, 1000);
    let (lo, hi) = (c.iter().min().unwrap(), c.iter().max().unwrap());
    assert!(hi - lo <= 6, "{c:?}");
    // A pod whose snapshot reports 20 waiting gets far fewer of the next requests: the
    // snapshot is the starting point, this sidecar's own starts move it.
    let mut busy = [pod(0.2); 4];
    busy[0].waiting = 20;
    let mut r = router(&busy, r#"{"cutoffs":{"maxQueue":64}}"#);
    let c = start_many(&mut r, 4, 40, 5, 1000);
    assert_eq!(c[0], 0, "{c:?}");
    // Then occupancy (20 + its starts for pod 0) evens out across the four.
    let more = start_many(&mut r, 4, 400, 6, 1000);
    let occ: Vec<usize> = (0..4)
        .map(|i| c[i] + more[i] + if i == 0 { 20 } else { 0 })
        .collect();
    let (lo, hi) = (occ.iter().min().unwrap(), occ.iter().max().unwrap());
    assert!(hi - lo <= 6, "{occ:?}");
}

#[test]
fn two_choices_prefers_a_free_seat_over_a_queue() {
    // Capacity 8 (queueCapacity unknown: maxQueue). Pod 0 reports 8 running (full), pod 1 has
    // 7 running and a much lower score (GPU 0.85): a request would queue on pod 0, so pod 1
    // wins every comparison it is drawn into.
    let mut full = pod(0.1);
    full.waiting = 0;
    let mut r = Router::new(config(r#"{"cutoffs":{"maxQueue":8}}"#));
    let mut ev = event(&[full, pod(0.85)], 1);
    for (i, running) in [(0, 8), (1, 7)] {
        let inf = inference(&mut ev, i);
        inf.running = Some(running);
    }
    r.apply_pool_event(0, &ev, 1000);
    let c = counts(&mut r, 2, 40_000, 9, 1000);
    // Pod 0 only wins when pod 1 is not drawn at all: first draw and three redraws for a
    // distinct second candidate all land on pod 0 (p0^4); score-proportional would give pod 1
    // only s1 / (s0 + s1) = 42 %.
    let (s0, s1) = (0.35 * 0.9 + 0.65, 0.35 * 0.15 + 0.65);
    let p0: f64 = s0 / (s0 + s1);
    let want = 1.0 - p0.powi(4);
    let share = c[1] as f64 / 40_000.0;
    assert!((share - want).abs() < 0.01, "{share} want {want}");
}

#[test]
fn two_choices_rebases_on_each_snapshot_so_lost_ends_do_not_accumulate() {
    let mut r = router(&[pod(0.2); 4], "");
    // 30 requests to pod 0 whose ends this sidecar never saw (e.g. a VM that missed them).
    for _ in 0..30 {
        r.on_request_start(0, &addr(0), RequestSize::UNIT, 1000);
    }
    assert_eq!(start_many(&mut r, 4, 30, 1, 1000)[0], 0);
    // The next snapshot says pod 0 is idle: its 30 were sent in the last 15-30 s and may be
    // waiting where no metric shows them (in front of its engine), so they still count.
    r.apply_pool_event(0, &event(&[pod(0.2); 4], 2), 1100);
    let c = counts(&mut r, 4, 40_000, 2, 1100);
    assert!(c[0] < 2_000, "{c:?}");
    // A snapshot 30 s on still says idle: sent that long ago, they are forgotten (ends this
    // sidecar never saw do not hold a pod's load up for ever).
    r.apply_pool_event(0, &event(&[pod(0.2); 4], 3), 31_100);
    let c = counts(&mut r, 4, 40_000, 2, 31_100);
    assert!(c[0] > 8_000, "{c:?}");
    // Ends after a snapshot move the estimate down (never below zero).
    for _ in 0..10 {
        r.on_request_end(0, &addr(1), RequestSize::UNIT, 1000);
    }
    let c = counts(&mut r, 4, 40_000, 3, 31_100);
    assert!(c.iter().all(|n| *n > 8_000), "{c:?}");
}

#[test]
fn two_choices_never_picks_a_cut_pod_even_when_it_is_idle() {
    let mut r = router(&[pod(0.2), pod(0.97), pod(0.3)], "");
    for _ in 0..50 {
        r.on_request_start(0, &addr(0), RequestSize::UNIT, 1000);
        r.on_request_start(0, &addr(2), RequestSize::UNIT, 1000);
    }
    let c = counts(&mut r, 3, 20_000, 4, 1000);
    assert_eq!(c[1], 0, "{c:?}");
}

#[test]
fn a_pod_with_requests_waiting_counts_as_full() {
    // Pod 0 reports 1 running and 2 waiting (e.g. its KV cache is full of long prompts): by
    // count it has room (3 of 8), but a new request would queue there, so pod 1 (6 running,
    // none waiting) wins every comparison it is in.
    let mut r = Router::new(config(r#"{"cutoffs":{"maxQueue":8}}"#));
    let mut ev = event(&[pod(0.2), pod(0.2)], 1);
    set_queues(&mut ev, &[(0, 1, 2), (1, 6, 0)]);
    r.apply_pool_event(0, &ev, 1000);
    let c = counts(&mut r, 2, 20_000, 12, 1000);
    // Pod 0 wins only when pod 1 is never drawn (p0^4, p0 a little over 1/2 as pod 0's queue
    // term is lower).
    assert!(c[1] as f64 / 20_000.0 > 0.9, "{c:?}");
}

#[test]
fn waiting_this_sidecar_saw_drain_no_longer_counts() {
    // Pod 0's snapshot caught this sidecar's own request waiting (1 running, 1 waiting); the
    // request then ended. Pod 0 (2 of 8 seats by the snapshot, 1 now) must win over pod 1 (6
    // running) again without waiting for the next snapshot; before the end it loses.
    let mut r = Router::new(config(r#"{"cutoffs":{"maxQueue":8}}"#));
    r.on_request_start(0, &addr(0), RequestSize::UNIT, 1000);
    let mut ev = event(&[pod(0.2), pod(0.2)], 1);
    set_queues(&mut ev, &[(0, 1, 1), (1, 6, 0)]);
    r.apply_pool_event(0, &ev, 1000);
    let before = counts(&mut r, 2, 20_000, 13, 1000);
    assert!(before[1] as f64 / 20_000.0 > 0.9, "{before:?}");
    r.on_request_end(0, &addr(0), RequestSize::UNIT, 1000);
    let after = counts(&mut r, 2, 20_000, 13, 1000);
    // Pod 1 now wins only when pod 0 is never drawn.
    assert!(after[0] as f64 / 20_000.0 > 0.9, "{after:?}");
    // A new snapshot that still shows one waiting counts again.
    let mut ev = event(&[pod(0.2), pod(0.2)], 2);
    set_queues(&mut ev, &[(0, 1, 1), (1, 6, 0)]);
    r.apply_pool_event(0, &ev, 1050);
    let again = counts(&mut r, 2, 20_000, 13, 1050);
    assert!(again[1] as f64 / 20_000.0 > 0.9, "{again:?}");
}

#[test]
fn request_weight_follows_body_size_against_the_running_mean() {
    let mut r = router(&[pod(0.2); 4], "");
    assert_eq!(r.request_size(None, None).weight, 1.0);
    for _ in 0..500 {
        r.request_size(Some(1000), None);
    }
    let w = r.request_size(Some(16_000), None).weight;
    assert!((w - 16.0).abs() < 1.0, "{w}");
    assert_eq!(r.request_size(Some(10), None).weight, 0.25);
    assert_eq!(r.request_size(Some(10_000_000), None).weight, 16.0);
    // A heavy request spreads the next ones: after one weight-16 start on pod 0, the next
    // 12 equal starts from this sidecar avoid it.
    let mut r = router(&[pod(0.2); 4], r#"{"cutoffs":{"maxQueue":8}}"#);
    r.on_request_start(0, &addr(0), weighted(16.0), 1000);
    let c = start_many(&mut r, 4, 12, 3, 1000);
    assert_eq!(c[0], 0, "{c:?}");
    // Its end takes the same weight back out.
    r.on_request_end(0, &addr(0), weighted(16.0), 1000);
    let c = counts(&mut r, 4, 40_000, 4, 1000);
    assert!(c[0] > 10_000, "{c:?}");
}

#[test]
fn a_long_prompt_keeps_its_weight_across_snapshots() {
    // Eight pods with 6 of 8 seats taken. This sidecar sends one long prompt (16 KB among
    // ~1 KB bodies), then the next snapshot counts it as one running request like any other:
    // the pod must still look full to this sidecar, so its next requests go elsewhere.
    let busy = |seq| {
        let mut ev = event(&[pod(0.5); 8], seq);
        for i in 0..8 {
            let inf = inference(&mut ev, i);
            inf.running = Some(6);
            inf.queue_capacity = Some(8);
        }
        ev
    };
    let mut r = Router::new(config(""));
    r.apply_pool_event(0, &busy(1), 1000);
    for _ in 0..500 {
        r.request_size(Some(1_100), None);
    }
    let w = r.request_size(Some(16_000), None).weight;
    assert!(w > 10.0, "{w}");
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    let d = r.decide(0, None, 1000, &mut rng);
    let long = chosen(&r, &d).unwrap();
    r.on_request_start(0, &long, weighted(w), 1000);
    let mut ev = busy(2);
    let i = (0..8).position(|i| addr(i) == long).unwrap();
    // The snapshot now shows the long request: 7 running there.
    inference(&mut ev, i).running = Some(7);
    r.apply_pool_event(0, &ev, 1100);
    let c = start_many(&mut r, 8, 14, 22, 1100);
    assert_eq!(c[i], 0, "{c:?}");
}

/// Sets running and waiting of each `(peer, running, waiting)` in `ev`.
fn set_queues(ev: &mut PoolEvent, queues: &[(usize, u32, u32)]) {
    for &(i, running, waiting) in queues {
        let inf = inference(ev, i);
        inf.running = Some(running);
        inf.waiting = Some(waiting);
    }
}

/// Eight equal pods reporting a KV cache of `cap` tokens with the given uses, 4 of 8 seats
/// taken, sequence `seq`.
fn kv_event(uses: &[f64], cap: u64, seq: u64) -> PoolEvent {
    let mut ev = event(&vec![pod(0.5); uses.len()], seq);
    for (i, u) in uses.iter().enumerate() {
        let inf = inference(&mut ev, i);
        inf.running = Some(4);
        inf.queue_capacity = Some(8);
        inf.kv_cache_usage = Some(*u);
        inf.kv_capacity_tokens = Some(cap);
    }
    ev
}

#[test]
fn a_long_answer_goes_to_the_pod_that_decodes_faster() {
    // Four equal pods: two decode at 8 ms a token (an older GPU), two at 4.8 ms.
    let pods = [pod(0.2); 4];
    let ev = |seq: u64, fast_ms: f64, samples: u64| {
        let mut ev = event(&pods, seq);
        for (i, ms) in [8.0, 8.0, fast_ms, fast_ms].into_iter().enumerate() {
            decoding(&mut ev, i, ms, samples);
        }
        ev
    };
    let long = sized(2_100.0, 2_000.0);
    let short = RequestSize {
        output_tokens: 100.0,
        ..long
    };
    let fast_share = |r: &mut Router, size: RequestSize, seed: u64, now: u64| {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut fast = 0;
        for _ in 0..40_000 {
            let d = r.decide_for(0, None, size, now, &mut rng);
            let a = chosen(r, &d).unwrap();
            if a == addr(2) || a == addr(3) {
                fast += 1;
            }
        }
        fast as f64 / 40_000.0
    };
    let mut r = Router::new(config(""));
    r.apply_pool_event(0, &ev(1, 4.8, 100), 1000);
    // Four candidates, the fastest wins. All slow: the first (1/2), a distinct second (1/3),
    // two more draws (1/4): 1/24.
    let f = fast_share(&mut r, long, 1, 1000);
    assert!((f - 23.0 / 24.0).abs() < 0.01, "{f}");
    // A short answer: shares follow the score (equal), the first draw wins among idle pods.
    let f = fast_share(&mut r, short, 2, 1000);
    assert!((f - 0.5).abs() < 0.01, "{f}");
    // Just under the 512-token default: short.
    let f = fast_share(
        &mut r,
        RequestSize {
            output_tokens: 511.0,
            ..long
        },
        3,
        1000,
    );
    assert!((f - 0.5).abs() < 0.01, "{f}");
    // Under 10 % apart is noise: the load decides (idle: the first draw).
    let mut close = Router::new(config(""));
    close.apply_pool_event(0, &ev(1, 7.5, 100), 1000);
    let f = fast_share(&mut close, long, 4, 1000);
    assert!((f - 0.5).abs() < 0.01, "{f}");
    // Smoothed: one reading that says the fast pods slowed to 8 ms moves them only part way
    // (0.3 × 8 + 0.7 × 4.8 = 5.76 ms, still over 10 % faster).
    r.apply_pool_event(0, &ev(2, 8.0, 100), 1100);
    let f = fast_share(&mut r, long, 5, 1100);
    assert!((f - 23.0 / 24.0).abs() < 0.01, "{f}");
    // Readings older than 5 s do not count (a pod that went idle reports none).
    r.apply_pool_event(0, &ev(3, 4.8, 100), 2000);
    r.apply_pool_event(0, &ev(4, 4.8, 7), 7001);
    let f = fast_share(&mut r, long, 6, 7001);
    assert!((f - 0.5).abs() < 0.01, "{f}");
    // vLLM's first bucket ends at 10 ms: both medians read 5 ms, the means (histogram sum
    // over count) tell 4.8 from 8.
    let mut bucketed = Router::new(config(""));
    let mut e = event(&pods, 1);
    for (i, mean) in [8.0, 8.0, 4.8, 4.8].into_iter().enumerate() {
        inference(&mut e, i).inter_token_recent = Some(LatencyQuantiles {
            p50_ms: Some(5.0),
            p99_ms: Some(9.9),
            samples: 100,
            mean_ms: Some(mean),
        });
    }
    bucketed.apply_pool_event(0, &e, 1000);
    let f = fast_share(&mut bucketed, long, 9, 1000);
    assert!((f - 23.0 / 24.0).abs() < 0.01, "{f}");
    // Off.
    let mut off = Router::new(config(r#"{"longOutputTokens": 0}"#));
    off.apply_pool_event(0, &ev(1, 4.8, 100), 1000);
    let f = fast_share(&mut off, long, 7, 1000);
    assert!((f - 0.5).abs() < 0.01, "{f}");
    // The wait counts in the finish, in service rounds of mean answers. Seats full and one
    // waiting on the fast pods (a quarter of a round): a long answer still finishes sooner
    // there, (0.25 × 2000 + 2000) × 4.8 ms, than on a pod decoding at 8 ms with free seats
    // (2000 × 8). Twenty waiting (2.6 rounds): it goes to a slow pod unless all four draws
    // are fast (under 1/24: they score lower too).
    let queued = |waiting: u32| {
        let mut r = Router::new(config(""));
        let mut e = ev(1, 4.8, 100);
        for i in 0..4 {
            inference(&mut e, i).queue_capacity = Some(8);
        }
        set_queues(
            &mut e,
            &[(0, 2, 0), (1, 2, 0), (2, 8, waiting), (3, 8, waiting)],
        );
        r.apply_pool_event(0, &e, 1000);
        r
    };
    let f = fast_share(&mut queued(1), long, 8, 1000);
    assert!(f > 0.9, "{f}");
    let f = fast_share(&mut queued(20), long, 10, 1000);
    assert!(f < 1.0 / 24.0 + 0.01, "{f}");
}

/// Eight pods of 8 seats: six decode at 8 ms a token (the pool's median) running
/// `slow_running`, two (pods 6 and 7) at 4.8 ms running and with waiting `fast`.
fn fast_minority(seq: u64, fast: (u32, u32), slow_running: u32) -> PoolEvent {
    let mut ev = event(&[pod(0.2); 8], seq);
    for i in 0..8 {
        let is_fast = i >= 6;
        decoding(&mut ev, i, if is_fast { 4.8 } else { 8.0 }, 100);
        let inf = inference(&mut ev, i);
        inf.queue_capacity = Some(8);
        inf.running = Some(if is_fast { fast.0 } else { slow_running });
        inf.waiting = Some(if is_fast { fast.1 } else { 0 });
    }
    ev
}

/// Share of `counts_for` picks that went to pods 6 and 7 (the fast pods of [`fast_minority`]).
fn fast_share(c: Vec<usize>) -> f64 {
    (c[6] + c[7]) as f64 / c.iter().sum::<usize>() as f64
}

#[test]
fn a_fast_minoritys_queue_counts_at_its_own_speed_once_for_a_long_answer() {
    // Six pods decode at 8 ms a token (the pool's median) with free seats, two at 4.8 ms
    // (0.6 of it) with 8 of 8 seats taken. A 2 000-token answer takes 16 s on a slow pod;
    // on a fast one 9.6 s plus its wait: with 4 waiting, (4 + 1) / 8 of a round of mean
    // answers (2 000 tokens) at 4.8 ms, 6 s, so 15.6 s: under 10 % sooner, and the slow
    // pod's free seat wins. Timing the wait at the fast pod's speed twice (0.6 × 0.625
    // rounds) made it 13.2 s, and a busy fast pod took every long answer it was drawn for.
    let queued = |waiting: u32| {
        let mut r = Router::new(config(""));
        r.apply_pool_event(0, &fast_minority(1, (8, waiting), 2), 1000);
        r
    };
    let long = sized(2_100.0, 2_000.0);
    // Only when both first draws and the two extra ones are fast pods (about 1/450).
    let f = fast_share(counts_for(&mut queued(4), 8, long, 4_000, 41));
    assert!(f < 0.01, "{f}");
    // One waiting: (1 + 1) / 8 of a round, 2.4 s, so 12 s, 25 % sooner: the fast pods take
    // it whenever one is drawn (1 − 6/8 · 5/7 · 6/8 · 6/8 ≈ 0.7).
    let f = fast_share(counts_for(&mut queued(1), 8, long, 4_000, 42));
    assert!(f > 0.6, "{f}");
}

#[test]
fn a_fast_pod_keeps_seats_for_short_requests_past_the_long_answer_seat_share() {
    // Six pods decode at 8 ms a token (the pool's median) with 2 of 8 seats taken, two at
    // 4.8 ms with 4 of 8 taken. A 600-token answer (long: `longOutputTokens` 512) finishes on
    // a fast pod in 2.9 s, on a slow one in 4.8 s: by finish time alone it goes to a fast pod
    // whenever one is drawn. With `longOutputSeatShare` 0.5 it may join long answers on at
    // most 0.5 × 600 / 512 of a pod's seats (4.7 of 8); a fast pod whose 4 running requests
    // are all this sidecar's long answers would have 5 with it: past its share, the long
    // answer is compared there as any request (load at the pod's speed: 4/8 × 0.6 = 0.3
    // against 2/8 = 0.25 on a slow pod), and the slow pod takes it.
    let long = sized(700.0, 600.0);
    let short = sized(300.0, 100.0);
    let reading = |seq: u64| fast_minority(seq, (4, 0), 2);
    // `inflight`: the size of this sidecar's 4 requests in flight on each fast pod, sent
    // before the second reading (which shows them running).
    let router = |extra: &str, inflight: RequestSize| {
        let mut r = Router::new(config(extra));
        r.apply_pool_event(0, &reading(1), 900);
        for i in 6..8 {
            for _ in 0..4 {
                r.on_request_start(0, &addr(i), inflight, 900);
            }
        }
        r.apply_pool_event(0, &reading(2), 1000);
        let fast = &r.pod_status(0, 1000)[6];
        assert_eq!((fast.inflight, fast.load), (4, 0.5));
        r
    };
    let share = r#"{"longOutputSeatShare": 0.5}"#;
    // Past the share: only when every candidate drawn is a fast pod. Each time a fast pod
    // would have taken it by finish time, it is counted.
    let mut r = router(share, long);
    let f = fast_share(counts_for(&mut r, 8, long, 4_000, 51));
    assert!(f < 0.05, "{f}");
    let full = r.counters().long_output_share_full;
    assert!((2_000..4_000).contains(&full), "{full}");
    // The same occupancy in short requests: the fast pods take it whenever one is drawn
    // (about 0.7, as in the test above).
    let f = fast_share(counts_for(&mut router(share, short), 8, long, 4_000, 52));
    assert!(f > 0.6, "{f}");
    // No limit (1): by finish time alone.
    let mut r = router(r#"{"longOutputSeatShare": 1}"#, long);
    let f = fast_share(counts_for(&mut r, 8, long, 4_000, 53));
    assert!(f > 0.6, "{f}");
    assert_eq!(r.counters().long_output_share_full, 0);
    // An answer twice `longOutputTokens` may hold twice the share, all the seats here: the
    // longest answers, which set the p99 of end-to-end latency, keep the fast pods.
    let longest = sized(1_124.0, 1_024.0);
    let f = fast_share(counts_for(&mut router(share, long), 8, longest, 4_000, 55));
    assert!(f > 0.6, "{f}");
    // A short answer is not a long one: the share does not apply to it, and it goes by load
    // as always (the slow pods' 0.25 against the fast pods' 0.3).
    let f = fast_share(counts_for(&mut router(share, long), 8, short, 4_000, 54));
    assert!(f < 0.05, "{f}");
}

#[test]
fn a_long_answer_avoids_a_slowed_pod_even_when_the_others_would_wait_for_kv_cache() {
    // Pod 0 decodes 5x slower than the rest (judged slow) with its KV cache empty; pods 1-3
    // decode at speed with 900 of 10 000 KV tokens free, so a 2 100-token request would wait
    // there for running requests to end. Its finish there is unknown (how long that wait is
    // is not estimated); at a fifth of the speed a long answer takes five times as long, past
    // the client's timeout for the longest ones.
    let pods = [pod(0.2); 4];
    let mut ev = event(&pods, 1);
    for (i, (ms, kv_use)) in [(25.0, 0.1), (5.0, 0.91), (5.0, 0.91), (5.0, 0.91)]
        .into_iter()
        .enumerate()
    {
        decoding(&mut ev, i, ms, 100);
        let inf = inference(&mut ev, i);
        inf.running = Some(2);
        inf.queue_capacity = Some(8);
        inf.kv_cache_usage = Some(kv_use);
        inf.kv_capacity_tokens = Some(10_000);
    }
    let long = sized(2_100.0, 2_000.0);
    let mut r = Router::new(config(""));
    r.apply_pool_event(0, &ev, 1000);
    assert!(r.pod_status(0, 1000)[0].slow_decode);
    let c = counts_for(&mut r, 4, long, 4_000, 31);
    // Only when every draw lands on it (the second candidate is drawn distinct, three
    // tries): its weight is a fifth of the others'.
    assert!(c[0] < 40, "{c:?}");
    // A short answer is compared by its wait as before: the slowed pod, free, takes it
    // whenever it is one of the two candidates.
    let short = RequestSize {
        output_tokens: 100.0,
        ..long
    };
    let c = counts_for(&mut r, 4, short, 4_000, 32);
    assert!(c[0] > 400, "{c:?}");
    // Switched off (`longOutputTokens: 0`), a long answer is compared as any request is.
    let mut off = Router::new(config(r#"{"longOutputTokens": 0}"#));
    off.apply_pool_event(0, &ev, 1000);
    let c = counts_for(&mut off, 4, long, 4_000, 33);
    assert!(c[0] > 400, "{c:?}");

    // The same pod also over the GPU hard limit: not drawn, but the overflow candidate when
    // the drawn ones would queue, as they would here. A long answer still does not go there.
    let mut hot = ev.clone();
    hot.peers[0].snapshot.as_mut().unwrap().gpus[0].sm_occupancy = Some(0.97);
    let mut r = Router::new(config(""));
    r.apply_pool_event(0, &hot, 1000);
    let c = counts_for(&mut r, 4, long, 4_000, 34);
    assert_eq!(c[0], 0, "{c:?}");
    // A short answer overflows onto it (it would start at once there).
    let c = counts_for(&mut r, 4, short, 4_000, 35);
    assert!(c[0] > 400, "{c:?}");
}

/// Like `counts`, for requests of `size` (not started).
fn counts_for(r: &mut Router, n: usize, size: RequestSize, picks: usize, seed: u64) -> Vec<usize> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut c = vec![0usize; n];
    for _ in 0..picks {
        let d = r.decide_for(0, None, size, 1000, &mut rng);
        let a = chosen(r, &d).unwrap();
        c[(0..n).position(|i| addr(i) == a).unwrap()] += 1;
    }
    c
}

/// Default-weight score of a `kv_event` pod with KV use `u` (GPU 0.5, nothing waiting, p99 0).
fn kv_pod_score(u: f64) -> f64 {
    0.35 * 0.5 + 0.25 + 0.25 + 0.15 * (1.0 - u)
}

fn kv(tokens: f64) -> RequestSize {
    sized(tokens, 0.0)
}

/// A request of one seat holding `kv_tokens` (prompt + `output_tokens` reserved).
fn sized(kv_tokens: f64, output_tokens: f64) -> RequestSize {
    RequestSize {
        weight: 1.0,
        kv_tokens,
        output_tokens,
    }
}

#[test]
fn request_size_estimates_kv_tokens_from_body_and_max_tokens() {
    let mut r = router(&[pod(0.2)], "");
    assert_eq!(r.request_size(None, None), RequestSize::UNIT);
    assert_eq!(r.request_size(None, Some(100)).kv_tokens, 100.0);
    // 16 001 bytes: ceil(/4) = 4001 prompt tokens, plus the output reservation.
    assert_eq!(r.request_size(Some(16_001), Some(1000)).kv_tokens, 5001.0);
    // A absurd max_tokens is bounded, so in-flight sums stay finite.
    assert_eq!(r.request_size(None, Some(u64::MAX)).kv_tokens, 1e9);
}

#[test]
fn a_prompt_that_does_not_fit_a_kv_cache_goes_where_it_fits() {
    // Pods 0-3 have 8 750 of 12 500 KV tokens in use (long prompts running), pods 4-7 2 500:
    // a 5 000-token request fits only pods 4-7. Same seats everywhere, same scores.
    let uses = [0.7, 0.7, 0.7, 0.7, 0.2, 0.2, 0.2, 0.2];
    let mut r = Router::new(config(""));
    r.apply_pool_event(0, &kv_event(&uses, 12_500, 1), 1000);
    let c = counts_for(&mut r, 8, kv(5000.0), 20_000, 31);
    let misfits: usize = c[..4].iter().sum();
    // Only when all six candidates (two, then four more) land on pods 0-3: 0.5^6 = 1.6 %.
    assert!((misfits as f64 / 20_000.0) < 0.025, "{c:?}");
    // A short request fits everywhere; it still prefers the emptier KV caches (the fuller
    // resource is the load), so pods 0-3 get it only when both candidates are among them:
    // first draw there, then a distinct second one there too (KV use is also the score's
    // memory term, so their scores are lower).
    let c = counts_for(&mut r, 8, kv(300.0), 40_000, 32);
    let share: f64 = c[..4].iter().sum::<usize>() as f64 / 40_000.0;
    let (full, empty) = (kv_pod_score(0.7), kv_pod_score(0.2));
    let want = 4.0 * full / (4.0 * full + 4.0 * empty) * (3.0 * full / (3.0 * full + 4.0 * empty));
    assert!((share - want).abs() < 0.015, "{share} want {want} {c:?}");
}

#[test]
fn kv_estimate_counts_this_sidecars_requests_until_a_snapshot_shows_them() {
    // Two empty pods of 12 500 KV tokens; this sidecar sends two 5 000-token prompts to pod
    // 0 (say its only candidate earlier). A third no longer fits pod 0: it goes to pod 1.
    let mut r = Router::new(config(""));
    r.apply_pool_event(0, &kv_event(&[0.0, 0.0], 12_500, 1), 1000);
    r.on_request_start(0, &addr(0), kv(5000.0), 1000);
    r.on_request_start(0, &addr(0), kv(5000.0), 1000);
    // Pod 0 only when every one of the 8 draws lands on it (0.5^8 = 0.4 %).
    let c = counts_for(&mut r, 2, kv(5000.0), 2_000, 41);
    assert!(c[0] <= 20, "{c:?}");
    // The next snapshot shows them (8 000 held after prefill): the estimate re-bases on it
    // and still does not fit a third.
    r.apply_pool_event(0, &kv_event(&[0.64, 0.0], 12_500, 2), 1100);
    let c = counts_for(&mut r, 2, kv(5000.0), 2_000, 42);
    assert!(c[0] <= 20, "{c:?}");
    // A started request counts one seat on a pod that reports its KV cache, whatever its
    // body weight (its size is in the KV estimate instead): 4 running + 1 of 8 seats.
    r.on_request_start(0, &addr(1), weighted(16.0), 1000);
    let st = r.pod_status(0, 1100);
    assert!((st[1].load - 5.0 / 8.0).abs() < 1e-9, "{}", st[1].load);
    assert!((st[0].kv.unwrap() - 0.64).abs() < 1e-9);
    // Both end and a snapshot shows pod 0 empty again: it fits.
    r.on_request_end(0, &addr(0), kv(5000.0), 1000);
    r.on_request_end(0, &addr(0), kv(5000.0), 1000);
    r.apply_pool_event(0, &kv_event(&[0.0, 0.3], 12_500, 3), 1200);
    let c = counts_for(&mut r, 2, kv(5000.0), 2_000, 43);
    assert!(c[0] > 1_000, "{c:?}");
    let v = ai_lb_filter_core::status::scoreboard(&r, 1200);
    assert_eq!(v["pools"][0]["pods"][0]["kv"], 0.0);
}

#[test]
fn requests_sent_after_the_engine_reading_stay_counted_when_its_snapshot_arrives() {
    // Two empty pods of 12 500 KV tokens. This sidecar sends two 5 000-token prompts to pod 0
    // at t = 1050 and 1060. At 1100 a snapshot arrives whose model-server reading was taken at
    // 1020, before either: it still shows pod 0 empty. Re-based at its arrival, the estimate
    // forgot both and a third long prompt went to pod 0 half the time; re-based at the
    // reading's time, both stay counted and the third goes to pod 1.
    for via_source in [false, true] {
        let mut r = Router::new(config(""));
        r.apply_pool_event(0, &kv_event(&[0.0, 0.0], 12_500, 1), 1000);
        r.on_request_start(0, &addr(0), kv(5000.0), 1050);
        r.on_request_start(0, &addr(0), kv(5000.0), 1060);
        let mut ev = kv_event(&[0.0, 0.0], 12_500, 2);
        for i in 0..2 {
            if via_source {
                // The GPU was read 10 ms before sending, the model server 80 ms before.
                let snap = ev.peers[i].snapshot.as_mut().unwrap();
                snap.age_ms = 10;
                model_server(&mut ev, i, false, true);
                ev.peers[i].snapshot.as_mut().unwrap().sources[1].last_success_age_ms = Some(80);
            } else {
                ev.peers[i].snapshot.as_mut().unwrap().age_ms = 80;
            }
        }
        r.apply_pool_event(0, &ev, 1100);
        let st = r.pod_status(0, 1100);
        assert!((st[0].kv.unwrap() - 0.8).abs() < 1e-9, "{:?}", st[0].kv);
        // The fuller resource: KV (10 000 of 12 500) over seats (4 running + the 2, of 8).
        assert!((st[0].load - 0.8).abs() < 1e-9, "{}", st[0].load);
        let c = counts_for(&mut r, 2, kv(5000.0), 2_000, 44);
        assert!(c[0] <= 20, "{via_source}: {c:?}");
        // One ends: it leaves the estimate (7 500 of KV left counted), the other stays.
        r.on_request_end(0, &addr(0), kv(5000.0), 1050);
        let st = r.pod_status(0, 1100);
        assert!((st[0].kv.unwrap() - 0.4).abs() < 1e-9, "{:?}", st[0].kv);
        // A snapshot whose reading (taken at 1150) shows the one left: nothing on top now.
        let mut ev = kv_event(&[0.32, 0.0], 12_500, 3);
        set_queues(&mut ev, &[(0, 5, 0), (1, 4, 0)]);
        ev.peers[0].snapshot.as_mut().unwrap().age_ms = 50;
        r.apply_pool_event(0, &ev, 1200);
        let st = r.pod_status(0, 1200);
        assert!((st[0].kv.unwrap() - 0.32).abs() < 1e-9, "{:?}", st[0].kv);
        assert!((st[0].load - 5.0 / 8.0).abs() < 1e-9, "{}", st[0].load);
    }
}

#[test]
fn an_answer_this_sidecar_started_counts_at_its_reservation_until_it_ends() {
    // This sidecar sent a 4 000-token prompt with max_tokens 1 000 to pod 0. The next reading
    // shows it prefilled (4 000 tokens held): the 1 000 it will grow into stay counted on top,
    // so a second such request (5 000) no longer fits pod 0's 12 500 (4 000 + 1 000 + 5 000
    // + the reading's other 3 000), as the model server's own admission would find.
    let long = sized(5_000.0, 1_000.0);
    let mut r = Router::new(config(""));
    r.apply_pool_event(0, &kv_event(&[0.0, 0.0], 12_500, 1), 1000);
    r.on_request_start(0, &addr(0), long, 1000);
    r.apply_pool_event(0, &kv_event(&[0.56, 0.0], 12_500, 2), 1100);
    let st = r.pod_status(0, 1100);
    assert!((st[0].kv.unwrap() - 0.64).abs() < 1e-9, "{:?}", st[0].kv);
    let c = counts_for(&mut r, 2, long, 2_000, 45);
    assert!(c[0] <= 20, "{c:?}");
    // It ends: the reservation it added on top leaves the estimate; what the reading showed
    // it holding stays until the next reading (it may not have held it: a request still
    // waiting for KV cache holds none).
    r.on_request_end(0, &addr(0), long, 1000);
    let st = r.pod_status(0, 1100);
    assert!((st[0].kv.unwrap() - 0.56).abs() < 1e-9, "{:?}", st[0].kv);
    r.apply_pool_event(0, &kv_event(&[0.24, 0.0], 12_500, 3), 1200);
    let st = r.pod_status(0, 1200);
    assert!((st[0].kv.unwrap() - 0.24).abs() < 1e-9, "{:?}", st[0].kv);
}

#[test]
fn a_request_that_ends_without_the_reading_showing_it_does_not_empty_the_pod() {
    // This sidecar sent a 6 000-token prompt to pod 0 (10 000 tokens, 5 000 held by another
    // client's request): it does not fit and waits there, holding no KV cache, and the next
    // reading (taken after it was sent) shows the pod as before. The client gives up and the
    // request ends. The pod must still look as full as its reading says: taking the whole
    // request out of the estimate left it looking 6 000 tokens emptier, and the next long
    // prompt went to the same pod (seen in the e2e test filter_kv_fit, two in a row stuck).
    let long = sized(6_000.0, 10.0);
    let mut r = Router::new(config(""));
    let mut ev = kv_event(&[0.5, 0.2], 10_000, 1);
    inference(&mut ev, 1).kv_capacity_tokens = Some(40_000);
    r.apply_pool_event(0, &ev, 1000);
    r.on_request_start(0, &addr(0), long, 1000);
    let mut ev = kv_event(&[0.5, 0.2], 10_000, 2);
    inference(&mut ev, 1).kv_capacity_tokens = Some(40_000);
    r.apply_pool_event(0, &ev, 1100);
    r.on_request_end(0, &addr(0), long, 1000);
    let st = r.pod_status(0, 1100);
    assert!((st[0].kv.unwrap() - 0.5).abs() < 1e-9, "{:?}", st[0].kv);
    let c = counts_for(&mut r, 2, long, 2_000, 46);
    assert!(c[0] <= 20, "{c:?}");
}

#[test]
fn a_long_prompt_does_not_queue_behind_a_head_that_waits_for_kv() {
    // Pod 0 runs 5 of 8 seats and 1 waits: its head waits for KV cache (say a long prompt),
    // though 6 000 of 12 500 tokens are free by the reading. Pod 1 runs all 8 seats with 3
    // waiting, KV cache 30 % used. A short request waits fewer service rounds on pod 0 (2 /
    // 5 against 4 / 8) and takes it; a 5 000-token prompt fits pod 0's free KV by the reading
    // but the head takes what frees first: it would wait for KV cache itself, and goes to
    // pod 1. (Counted as a queue for seats it went to pod 0, the fewest running.)
    let mut r = Router::new(config(""));
    for _ in 0..200 {
        // The sidecar's traffic: ~1 100-byte bodies, 200 output tokens (mean KV ~475).
        r.request_size(Some(1_100), Some(200));
    }
    let long = r.request_size(Some(16_000), Some(1_000));
    assert!(long.kv_tokens >= 5_000.0);
    let mut ev = kv_event(&[0.52, 0.3], 12_500, 1);
    set_queues(&mut ev, &[(0, 5, 1), (1, 8, 3)]);
    r.apply_pool_event(0, &ev, 1000);
    let short = sized(475.0, 200.0);
    let c = counts_for(&mut r, 2, short, 20_000, 65);
    assert!((c[1] as f64 / 20_000.0) < 0.1, "short: {c:?}");
    let c = counts_for(&mut r, 2, long, 20_000, 66);
    assert!((c[0] as f64 / 20_000.0) < 0.01, "long: {c:?}");
}

#[test]
fn a_big_request_spreads_over_the_pods_it_fits_instead_of_herding_onto_the_emptiest() {
    // Four pods with free seats and KV cache 0-30 % used: a 5 000-token prompt fits all four.
    // Every sidecar sees the same snapshot; taking the less loaded of its draws (two, four
    // for a long answer) sent each sidecar's long prompt to pod 0. A big request keeps its
    // first draw when it would start at once on both, so pod 0 gets about its score share.
    let uses = [0.0, 0.1, 0.2, 0.3];
    let mut r = Router::new(config(""));
    for _ in 0..200 {
        r.request_size(Some(1_100), Some(200));
    }
    // One request running on each: the KV cache is the fuller resource, so the load differs.
    let mut ev = kv_event(&uses, 12_500, 1);
    set_queues(&mut ev, &[(0, 1, 0), (1, 1, 0), (2, 1, 0), (3, 1, 0)]);
    r.apply_pool_event(0, &ev, 1000);
    let total: f64 = uses.iter().map(|u| kv_pod_score(*u)).sum();
    let p0 = kv_pod_score(0.0) / total;
    for output in [100.0, 1_000.0] {
        let size = sized(5_000.0, output);
        let c = counts_for(&mut r, 4, size, 20_000, 67);
        let share = c[0] as f64 / 20_000.0;
        assert!(
            (share - p0).abs() < 0.02,
            "output {output}: {share} want {p0} {c:?}"
        );
    }
    // A request of ordinary size still takes the less loaded of its two draws.
    let c = counts_for(&mut r, 4, kv(475.0), 20_000, 68);
    let share = c[0] as f64 / 20_000.0;
    assert!(share > p0 + 0.1, "{share} vs {p0} {c:?}");
}

#[test]
fn waiting_behind_a_kv_blocked_head_is_worse_than_waiting_for_a_seat() {
    // Pod 0: 2 of 8 seats running and 3 waiting: seats are free, so its queue's head waits for
    // KV cache (a long prompt) and new requests wait behind it for seconds. Pod 1: all 8
    // seats running and 4 waiting: queued too, and fuller by count, but a seat frees as soon
    // as any request ends. A short request goes to pod 1 whenever both are candidates.
    let mut ev = kv_event(&[0.3, 0.3], 12_500, 1);
    set_queues(&mut ev, &[(0, 2, 3), (1, 8, 4)]);
    let mut r = Router::new(config(""));
    r.apply_pool_event(0, &ev, 1000);
    let c = counts_for(&mut r, 2, kv(300.0), 20_000, 61);
    // Pod 0 only when every one of the 8 draws lands on it.
    assert!((c[0] as f64 / 20_000.0) < 0.01, "{c:?}");
    // Without a reported queue capacity the head cannot be judged: both merely queue, and
    // with seats far from maxQueue (64) the equal KV use decides, a tie: the first draw
    // wins, about half each.
    for i in 0..2 {
        inference(&mut ev, i).queue_capacity = None;
    }
    let mut r = Router::new(config(""));
    r.apply_pool_event(0, &ev, 1000);
    let c = counts_for(&mut r, 2, kv(300.0), 20_000, 62);
    assert!((c[0] as f64 / 20_000.0) > 0.4, "{c:?}");
}

#[test]
fn a_long_queue_for_seats_is_worse_than_a_short_one_behind_a_kv_blocked_head() {
    // The HOL incident seen from the other side: the fast pods hold long prompts, so their
    // queues' heads wait for KV cache, while a slower pod with free KV has all 8 seats running
    // short requests and 30 waiting. Pod 0: 6 running and 1 waiting behind a head that waits
    // for KV (2 service rounds of 6 requests: about a third of a round); pod 1: 8 running, 30
    // waiting (31 / 8, about 4 rounds). Ranking every KV-blocked queue below every seat queue
    // sent all short traffic to pod 1 until its queue was seconds long.
    let mut ev = kv_event(&[0.8, 0.3], 12_500, 1);
    set_queues(&mut ev, &[(0, 6, 1), (1, 8, 30)]);
    let mut r = Router::new(config(""));
    r.apply_pool_event(0, &ev, 1000);
    let c = counts_for(&mut r, 2, kv(300.0), 20_000, 63);
    // Pod 1 only when all four draws of the two-choice land on it (scores 0.70 and 0.66:
    // 0.485^4, about 5.5 %); ranked the old way it took every request.
    assert!((c[1] as f64 / 20_000.0) < 0.08, "{c:?}");
    // The same pod 0 with two running and five waiting (3 rounds) loses to pod 1 with 8
    // running and 12 waiting (13 / 8, under 2 rounds).
    let mut ev = kv_event(&[0.8, 0.3], 12_500, 2);
    set_queues(&mut ev, &[(0, 2, 5), (1, 8, 12)]);
    r.apply_pool_event(0, &ev, 1100);
    let c = counts_for(&mut r, 2, kv(300.0), 20_000, 64);
    assert!((c[0] as f64 / 20_000.0) < 0.01, "{c:?}");
}

#[test]
fn a_pod_over_the_gpu_limit_takes_requests_only_when_the_other_would_queue_too() {
    // Pod 0 is over the GPU hard limit (cut, score 0 on the scoreboard) with 2 of 8 seats
    // taken; pods 1 and 2 are cool. While they have free seats, pod 0 gets nothing.
    let ev = |cool_running: u32, cool_waiting: u32, seq: u64| {
        let mut ev = event(&[pod(0.97), pod(0.5), pod(0.5)], seq);
        for (i, running, waiting) in [
            (0, 2, 0),
            (1, cool_running, cool_waiting),
            (2, cool_running, cool_waiting),
        ] {
            let inf = inference(&mut ev, i);
            inf.running = Some(running);
            inf.waiting = Some(waiting);
            inf.queue_capacity = Some(8);
        }
        ev
    };
    let mut r = Router::new(config(""));
    r.apply_pool_event(0, &ev(4, 0, 1), 1000);
    assert_eq!(counts(&mut r, 3, 10_000, 71, 1000)[0], 0);
    assert_eq!(r.counters().overflow_over_gpu_limit, 0);
    assert_eq!(r.pod_status(0, 1000)[0].score, 0.0);
    // Both cool pods full with requests waiting: a request would queue anywhere, and pod 0
    // is the least loaded, so it takes every request it is a candidate for (counted).
    r.apply_pool_event(0, &ev(8, 3, 2), 1100);
    let c = counts(&mut r, 3, 10_000, 72, 1100);
    assert!(c[0] > 5_000, "{c:?}");
    assert_eq!(r.counters().overflow_over_gpu_limit, c[0] as u64);
    assert_eq!(r.pod_status(0, 1100)[0].score, 0.0);
    // With its breaker open it gets nothing, queue or not.
    let mut r = Router::new(config(""));
    r.apply_pool_event(0, &ev(8, 3, 1), 1000);
    let err = Outcome {
        status: Some(503),
        ..Default::default()
    };
    for t in 0..2 {
        let _ = r.on_outcome(0, &addr(0), None, &err, 1000 + t);
    }
    assert_eq!(counts(&mut r, 3, 10_000, 73, 1010)[0], 0);
    // Under `proportional` the cut is a plain cut.
    let mut r = Router::new(config(r#"{"pickStrategy":"proportional"}"#));
    r.apply_pool_event(0, &ev(8, 3, 1), 1000);
    assert_eq!(counts(&mut r, 3, 10_000, 74, 1000)[0], 0);
}

#[test]
fn without_kv_capacity_no_request_is_judged_by_kv() {
    // Same uses as above but no capacity reported: a 5 000-token request is not steered
    // away from the fuller pods by KV (only seats and score count).
    let mut ev = kv_event(&[0.7, 0.7, 0.2, 0.2], 12_500, 1);
    for i in 0..4 {
        inference(&mut ev, i).kv_capacity_tokens = None;
    }
    let mut r = Router::new(config(""));
    r.apply_pool_event(0, &ev, 1000);
    let c = counts_for(&mut r, 4, kv(5000.0), 20_000, 51);
    // Score-proportional: both candidates have free seats and equal seat loads.
    let share = (c[0] + c[1]) as f64 / 20_000.0;
    let want = kv_pod_score(0.7) / (kv_pod_score(0.7) + kv_pod_score(0.2));
    assert!((share - want).abs() < 0.015, "{share} want {want} {c:?}");
    assert_eq!(r.pod_status(0, 1000)[0].kv, None);
}

#[test]
fn a_pod_failing_half_its_requests_is_cut_by_the_failure_rate() {
    // consecutiveFailures 2 in the test config: alternate failure / success never trips it.
    // Half of 20 outcomes failed: the failure-rate trip opens the breaker, and the pod is cut.
    let mut r = router(
        &[pod(0.2), pod(0.2)],
        r#"{"breaker":{"consecutiveFailures":2}}"#,
    );
    let err = Outcome {
        status: Some(500),
        ..Default::default()
    };
    let ok = Outcome {
        status: Some(200),
        ..Default::default()
    };
    let mut opened = Vec::new();
    for i in 0..20u64 {
        let o = if i % 2 == 0 { &err } else { &ok };
        opened.extend(r.on_outcome(0, &addr(0), None, o, 1000 + i * 10));
    }
    assert_eq!(opened.len(), 1, "{opened:?}");
    assert_eq!(opened[0].to, BreakerState::Open);
    assert_eq!(opened[0].reason, Some(TripReason::FailureRate));
    assert_eq!(counts(&mut r, 2, 1_000, 81, 1300)[0], 0);
    // 20 % failures, never two in a row, do not: a fresh router, 40 outcomes.
    let mut r = router(
        &[pod(0.2), pod(0.2)],
        r#"{"breaker":{"consecutiveFailures":2}}"#,
    );
    for i in 0..40u64 {
        let o = if i % 10 < 3 && i % 10 != 1 { &err } else { &ok };
        assert!(r.on_outcome(0, &addr(0), None, o, 1000 + i * 10).is_empty());
    }
}

#[test]
fn a_pod_whose_request_just_failed_counts_as_queued_for_a_second() {
    // A pod that fails fast has nothing in flight and would look the freest. After one 500
    // it loses every comparison against a pod with a free seat for 1 s, then competes again.
    let mut r = router(&[pod(0.2), pod(0.2)], "");
    let err = Outcome {
        status: Some(500),
        ..Default::default()
    };
    assert!(r.on_outcome(0, &addr(0), None, &err, 1000).is_empty());
    let c = counts(&mut r, 2, 4_000, 91, 1500);
    // Only when both draws land on pod 0 (three redraws): (1/2)^4.
    assert!(c[0] < 400, "{c:?}");
    assert!(r.pod_status(0, 1500)[0].queued);
    let c = counts(&mut r, 2, 4_000, 92, 2100);
    assert!(c[0] > 1_600, "{c:?}");
}

#[test]
fn pick_strategy_errors_name_the_field() {
    let e = FilterConfig::from_json(
        br#"{"pools":[{"name":"p","cluster":"c"}],"pickStrategy":"fastest"}"#,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("pickStrategy") && e.contains("fastest"), "{e}");
}

#[test]
fn shared_state_round_trip_drives_a_worker_router() {
    let mut sub = router(&[pod(0.1), pod(0.7)], "");
    let bytes = sub.pool_state(0).unwrap().encode();
    let mut worker = Router::new(config(""));
    worker.set_pool_state_bytes(0, &bytes, 1000).unwrap();
    assert_eq!(worker.pool_state(0), sub.pool_state(0));
    let a = counts(&mut sub, 2, 1000, 5, 1000);
    let b = counts(&mut worker, 2, 1000, 5, 1000);
    assert_eq!(a, b);
    assert!(worker.set_pool_state_bytes(0, b"\x0a\xff", 1000).is_err());
    assert_eq!(worker.counters().pool_decode_errors, 1);
}

/// Events usually list the same pods in the same order, and the pod table then stays as it
/// is; a peer that leaves ahead of them (shifting every index), or pods that trade places,
/// must still leave each pod with its own reading and its own in-flight count.
#[test]
fn pods_keep_their_readings_and_counts_when_peers_leave_or_move() {
    // A connecting peer (no snapshot) first, then the two pods.
    let connecting = PeerState {
        peer: "agent-new:9090".into(),
        status: PeerStatus::Connecting as i32,
        snapshot: None,
        reason: "dialing".into(),
    };
    let mut ev = event(&[pod(0.1), pod(0.8)], 1);
    ev.peers.insert(0, connecting);
    let mut r = Router::new(config(""));
    r.apply_pool_event(0, &ev, 1000);
    r.on_request_start(0, &addr(0), RequestSize::UNIT, 1000);
    for _ in 0..3 {
        r.on_request_start(0, &addr(1), RequestSize::UNIT, 1000);
    }
    // (address, in flight, raw score x 1000), by address.
    let seen = |r: &Router, now| {
        let mut v: Vec<_> = r
            .pod_status(0, now)
            .iter()
            .map(|s| {
                (
                    s.address.to_string(),
                    s.inflight,
                    (s.raw * 1000.0).round() as i64,
                )
            })
            .collect();
        v.sort();
        v
    };
    let s = seen(&r, 1000);
    assert!(s[0].2 > s[1].2, "{s:?}");

    // A full event without the connecting peer: it is forgotten and every pod's peer index
    // moves down by one. The readings are swapped.
    let ev = event(&[pod(0.8), pod(0.1)], 2);
    r.apply_pool_event(0, &ev, 1100);
    let s = seen(&r, 1100);
    assert_eq!((s[0].1, s[1].1), (1, 3), "{s:?}");
    assert!(s[0].2 < s[1].2, "{s:?}");

    // The two agents now report each other's address (the pod table's order changes): each
    // pod follows the reading for its address, and keeps its count.
    let mut ev = event(&[pod(0.1), pod(0.8)], 3);
    for (i, p) in ev.peers.iter_mut().enumerate() {
        let snap = p.snapshot.as_mut().unwrap();
        snap.identity.as_mut().unwrap().address = addr(1 - i);
    }
    r.apply_pool_event(0, &ev, 1200);
    let s = seen(&r, 1200);
    assert_eq!((s[0].1, s[1].1), (1, 3), "{s:?}");
    assert!(s[0].2 < s[1].2, "{s:?}");
}

#[test]
fn status_json_lists_pods() {
    let r = router(&[pod(0.1), pod(0.99)], "");
    let v = ai_lb_filter_core::status::scoreboard(&r, 1000);
    assert_eq!(v["pools"][0]["pods"][1]["cut"], "gpu_hard_limit");
    assert_eq!(v["pools"][0]["pods"][0]["breaker"], "closed");
}

fn arb_pod() -> impl Strategy<Value = Pod> {
    (
        prop::option::weighted(0.9, 0.0f64..1.0),
        0u32..80,
        0u64..3000,
    )
        .prop_map(|(gpu, waiting, age_ms)| Pod {
            gpu,
            waiting,
            age_ms,
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn scores_stay_in_unit_interval(
        gpu in prop::option::of(prop::num::f64::ANY),
        mem in prop::option::of(prop::num::f64::ANY),
        p99 in prop::option::of(prop::num::f64::ANY),
        waiting in prop::option::of(any::<u32>()),
        age in any::<u64>(), now in any::<u64>(),
        wg in 0.0f64..5.0, wq in 0.0f64..5.0,
    ) {
        let snap = PodSnapshot {
            identity: Some(PodIdentity { address: "10.1.1.1:80".into(), ..Default::default() }),
            gpus: vec![GpuStats { utilization: gpu.map(|_| 1.0), sm_occupancy: gpu, ..Default::default() }],
            inference: Some(InferenceStats {
                waiting, kv_cache_usage: mem,
                e2e: Some(LatencyQuantiles { p99_ms: p99, samples: 1, ..Default::default() }),
                ..Default::default()
            }),
            age_ms: age,
            ..Default::default()
        };
        let (s, _) = PodSignals::from_proto(&snap, now);
        let s = s.unwrap();
        let sum = wg + wq + 0.1;
        let w = Weights { gpu: wg / sum, queue: wq / sum, p99: 0.05 / sum, memory: 0.05 / sum };
        let sc = score(&s, &w, &Cutoffs::default(), now);
        prop_assert!((0.0..=1.0).contains(&sc.value), "{sc:?}");
        prop_assert!((0.0..=1.0).contains(&sc.raw), "{sc:?}");
        prop_assert!(sc.cut.is_none() || sc.value == 0.0);
    }

    #[test]
    fn cut_or_open_breaker_pods_are_never_steered_to(
        pods in prop::collection::vec(arb_pod(), 1..12),
        failing in prop::collection::vec(any::<bool>(), 12),
        seed in any::<u64>(), now_off in 0u64..2500,
    ) {
        let mut r = router(&pods, "");
        let err = Outcome { connect_failure: true, ..Default::default() };
        for (i, f) in failing.iter().enumerate().take(pods.len()) {
            if *f {
                r.on_outcome(0, &addr(i), None, &err, 1000);
                r.on_outcome(0, &addr(i), None, &err, 1000);
            }
        }
        let now = 1000 + now_off.min(999); // breakers stay open (cooldown 1000 ms)
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut buf = String::new();
        for _ in 0..50 {
            let overflows = r.counters().overflow_over_gpu_limit;
            let d = r.decide(0, None, now, &mut rng);
            let overflowed = r.counters().overflow_over_gpu_limit - overflows;
            if let Decision::Steer { ranked, chosen_score } = d {
                prop_assert!((0.0..=1.0).contains(&chosen_score));
                r.write_ranked(0, &ranked, &mut buf);
                for (k, a) in buf.split(',').enumerate() {
                    let i = (0..pods.len()).position(|i| addr(i) == a).unwrap();
                    let p = pods[i];
                    let gpu_cut = p.gpu.is_some_and(|g| g > 0.9);
                    prop_assert!(!failing[i], "open breaker pod {i} steered to");
                    // A GPU-cut pod only as the chosen pod of a counted overflow (the
                    // drawn pods would have queued), never as a fallback.
                    prop_assert!(!gpu_cut || (k == 0 && overflowed == 1), "gpu-cut pod {i}");
                    prop_assert!(k > 0 || gpu_cut || overflowed == 0, "overflow not to a gpu-cut pod");
                    prop_assert!(p.gpu.is_none() || p.waiting < 64, "queue-cut pod {i}");
                    prop_assert!(p.age_ms + (now - 1000) <= 2000, "stale pod {i}");
                }
            }
        }
    }

    #[test]
    fn cold_start_pod_gets_mean_of_scored_uncut_pods(pods in prop::collection::vec(arb_pod(), 1..10)) {
        let mut all = pods.clone();
        all.push(Pod { gpu: None, waiting: 0, age_ms: 0 });
        let r = router(&all, "");
        let st = r.pod_status(0, 1000);
        let scored: Vec<f64> = st.iter().filter(|s| !s.cold && s.cut.is_none()).map(|s| s.score).collect();
        let cold = st.last().unwrap();
        prop_assert!(cold.cold);
        if !scored.is_empty() && cold.cut.is_none() {
            let mean = scored.iter().sum::<f64>() / scored.len() as f64;
            prop_assert!((cold.score - mean).abs() < 1e-9, "{} vs {}", cold.score, mean);
            let best = scored.iter().cloned().fold(0.0, f64::max);
            prop_assert!(cold.score <= best);
        }
    }

    #[test]
    fn ema_stays_between_the_raw_scores_it_averaged(gpus in prop::collection::vec(0.0f64..0.9, 1..20), alpha in 0.01f64..=1.0) {
        let mut r = Router::new(config(&format!(r#"{{"emaAlpha":{alpha}}}"#)));
        let mut want: Option<f64> = None;
        for (k, g) in gpus.iter().enumerate() {
            r.apply_pool_event(0, &event(&[pod(*g)], k as u64 + 1), 1000 + k as u64);
            let raw = 0.35 * (1.0 - g) + 0.65;
            want = Some(want.map_or(raw, |e| alpha * raw + (1.0 - alpha) * e));
        }
        let got = r.pod_status(0, 1000 + gpus.len() as u64)[0].score;
        prop_assert!((got - want.unwrap()).abs() < 1e-9);
        prop_assert!((0.0..=1.0).contains(&got));
    }

    #[test]
    fn four_xx_never_opens_a_breaker(statuses in prop::collection::vec(400u16..500, 1..200)) {
        let cfg = BreakerConfig { consecutive_failures: 1, ..BreakerConfig::default() };
        let mut b = Breaker::default();
        for (t, s) in statuses.iter().enumerate() {
            let o = Outcome { status: Some(*s), ..Default::default() };
            prop_assert!(b.record(o.failure(&cfg), t as u64, &cfg).is_none());
        }
        prop_assert_eq!(b.state(), BreakerState::Closed);
    }

    #[test]
    fn cooldown_doubles_and_caps(reopens in 1u32..12) {
        let cfg = BreakerConfig { consecutive_failures: 1, base_cooldown_ms: 100, max_cooldown_ms: 1600, half_open_probes: 1, ttft_slo_ms: None, ..BreakerConfig::default() };
        let mut b = Breaker::default();
        let fail = Outcome { timeout: true, ..Default::default() };
        let mut now = 0u64;
        b.record(fail.failure(&cfg), now, &cfg);
        for k in 1..=reopens {
            let want = (100u64 << (k - 1)).min(1600);
            prop_assert_eq!(b.open_until_ms() - now, want);
            now = b.open_until_ms();
            prop_assert!(b.poll(now - 1, &cfg).is_none() || k == 0);
            prop_assert_eq!(b.poll(now, &cfg).map(|t| t.to), Some(BreakerState::HalfOpen));
            b.on_request(now);
            b.record(fail.failure(&cfg), now, &cfg);
        }
    }

    #[test]
    fn pool_state_encoding_round_trips(pods in prop::collection::vec(arb_pod(), 0..20), now in 0u64..1_000_000) {
        let mut st = PoolState::new();
        let mut c = ai_lb_filter_core::Counters::default();
        st.apply_event(&event(&pods, 3), now, &mut c);
        prop_assert_eq!(PoolState::decode(&st.encode()).unwrap(), st);
    }
}

/// `event` with GPU 0 of peer `i` reporting NVML throttle reasons `mask`.
fn throttled(mut ev: PoolEvent, i: usize, mask: u64) -> PoolEvent {
    ev.peers[i].snapshot.as_mut().unwrap().gpus[0].throttle_reasons = Some(mask);
    ev
}

#[test]
fn a_gpu_slowed_by_hardware_gets_a_quarter_of_its_share_at_once_and_all_back_when_it_ends() {
    let pods = [pod(0.2), pod(0.2), pod(0.2)];
    let mut r = Router::new(config(""));
    r.apply_pool_event(0, &throttled(event(&pods, 1), 0, 0x8), 1000);
    // First snapshot that shows it: weight 0.25 against 1 and 1.
    let c = counts(&mut r, 3, 100_000, 5, 1000);
    let share = c[0] as f64 / 100_000.0;
    assert!((share - 0.25 / 2.25).abs() < 0.005, "slowed share {share}");
    let status = r.pod_status(0, 1000);
    assert!(status[0].slowdown && !status[1].slowdown);

    // The power cap (0x4) is routine under load: no penalty.
    r.apply_pool_event(0, &throttled(event(&pods, 2), 0, 0x4), 1100);
    let c = counts(&mut r, 3, 100_000, 6, 1100);
    let share = c[0] as f64 / 100_000.0;
    assert!(
        (share - 1.0 / 3.0).abs() < 0.005,
        "power-capped share {share}"
    );

    // Thermal slowdown (0x40) counts; `slowdownFactor: 1` switches the signal off.
    r.apply_pool_event(0, &throttled(event(&pods, 3), 0, 0x40), 1200);
    let c = counts(&mut r, 3, 100_000, 7, 1200);
    assert!((c[0] as f64 / 100_000.0 - 0.25 / 2.25).abs() < 0.005);
    let mut off = Router::new(config(r#"{"cutoffs": {"slowdownFactor": 1}}"#));
    off.apply_pool_event(0, &throttled(event(&pods, 1), 0, 0x40), 1000);
    let c = counts(&mut off, 3, 100_000, 8, 1000);
    assert!((c[0] as f64 / 100_000.0 - 1.0 / 3.0).abs() < 0.005);
}

/// `ev` with peer `i` reporting a recent median inter-token latency of `ms` over `samples`
/// tokens.
fn decoding(ev: &mut PoolEvent, i: usize, ms: f64, samples: u64) {
    inference(ev, i).inter_token_recent = Some(LatencyQuantiles {
        p50_ms: Some(ms),
        p99_ms: Some(ms * 2.0),
        samples,
        mean_ms: None,
    });
}

#[test]
fn a_pod_decoding_three_times_slower_than_the_pool_median_is_drawn_as_if_its_gpu_said_so() {
    let pods = [pod(0.2), pod(0.2), pod(0.2), pod(0.2)];
    let share0 = |r: &mut Router, seed: u64, now: u64| {
        counts(r, 4, 100_000, seed, now)[0] as f64 / 100_000.0
    };
    let slowed = |seq: u64, itl0: f64| {
        let mut ev = event(&pods, seq);
        for (i, itl) in [itl0, 20.0, 24.0, 30.0].into_iter().enumerate() {
            decoding(&mut ev, i, itl, 100);
        }
        ev
    };
    let mut r = Router::new(config(""));
    // Median 27 ms: 80 ms is under 3x (81), no penalty.
    r.apply_pool_event(0, &slowed(1, 80.0), 1000);
    assert!((share0(&mut r, 1, 1000) - 0.25).abs() < 0.005);
    assert_eq!(r.counters().slow_decode, 0);
    // Median (24 + 30) / 2 = 27 ms: 100 ms is 3.7x. Weight 0.25 against 1, 1 and 1.
    r.apply_pool_event(0, &slowed(2, 100.0), 1100);
    assert!((share0(&mut r, 2, 1100) - 0.25 / 3.25).abs() < 0.005);
    let status = r.pod_status(0, 1100);
    assert!(status[0].slow_decode && !status[0].slowdown && !status[1].slow_decode);
    // Counted once per episode, not per snapshot.
    r.apply_pool_event(0, &slowed(3, 110.0), 1200);
    assert_eq!(r.counters().slow_decode, 1);
    // Back to speed: all its share back at once.
    r.apply_pool_event(0, &slowed(4, 22.0), 1300);
    assert!((share0(&mut r, 3, 1300) - 0.25).abs() < 0.005);
    assert!(!r.pod_status(0, 1300)[0].slow_decode);
    r.apply_pool_event(0, &slowed(5, 100.0), 1400);
    assert_eq!(r.counters().slow_decode, 2);

    // Too few tokens in the window to judge the pod (a slow pod running one request): the
    // last judgement holds, slow here, until a reading says otherwise.
    let mut ev = slowed(6, 22.0);
    decoding(&mut ev, 0, 22.0, 7);
    r.apply_pool_event(0, &ev, 1500);
    assert!((share0(&mut r, 4, 1500) - 0.25 / 3.25).abs() < 0.005);
    assert_eq!(r.counters().slow_decode, 2);
    r.apply_pool_event(0, &slowed(7, 22.0), 1600);
    assert!((share0(&mut r, 9, 1600) - 0.25).abs() < 0.005);
    let mut ev = slowed(8, 100.0);
    decoding(&mut ev, 0, 100.0, 7);
    r.apply_pool_event(0, &ev, 1700);
    assert!((share0(&mut r, 10, 1700) - 0.25).abs() < 0.005);
    // ... and for 30 s at most: a pod that no longer gets enough traffic to show its speed is
    // not penalised for ever.
    r.apply_pool_event(0, &slowed(9, 100.0), 1800);
    let quiet = |seq: u64| {
        let mut ev = slowed(seq, 22.0);
        decoding(&mut ev, 0, 22.0, 7);
        ev
    };
    r.apply_pool_event(0, &quiet(10), 31_800);
    assert!(r.pod_status(0, 31_800)[0].slow_decode);
    r.apply_pool_event(0, &quiet(11), 31_801);
    assert!(!r.pod_status(0, 31_801)[0].slow_decode);
    assert!((share0(&mut r, 11, 31_801) - 0.25).abs() < 0.005);

    // A pool that drops below three pods reporting it (fast pods between requests, too few
    // tokens in their windows) cannot judge anyone: the flagged pod's judgement holds, as
    // without a reading of its own, and for 30 s at most.
    r.apply_pool_event(0, &slowed(12, 100.0), 31_900);
    assert!(r.pod_status(0, 31_900)[0].slow_decode);
    let short = |seq: u64| {
        let mut ev = slowed(seq, 100.0);
        decoding(&mut ev, 2, 24.0, 7);
        decoding(&mut ev, 3, 30.0, 7);
        ev
    };
    r.apply_pool_event(0, &short(13), 32_000);
    assert!(r.pod_status(0, 32_000)[0].slow_decode);
    assert!((share0(&mut r, 14, 32_000) - 0.25 / 3.25).abs() < 0.005);
    r.apply_pool_event(0, &short(14), 61_900);
    assert!(r.pod_status(0, 61_900)[0].slow_decode);
    r.apply_pool_event(0, &short(15), 61_901);
    assert!(!r.pod_status(0, 61_901)[0].slow_decode);
    assert_eq!(r.counters().slow_decode, 4);

    // Two pods reporting it are not enough to say which is the odd one.
    let mut ev = event(&pods, 1);
    decoding(&mut ev, 0, 100.0, 100);
    decoding(&mut ev, 1, 20.0, 100);
    let mut few = Router::new(config(""));
    few.apply_pool_event(0, &ev, 1000);
    assert!((share0(&mut few, 5, 1000) - 0.25).abs() < 0.005);

    // `slowItlRatio: 0` switches it off; a higher ratio asks for a slower pod.
    let mut off = Router::new(config(r#"{"cutoffs": {"slowItlRatio": 0}}"#));
    off.apply_pool_event(0, &slowed(1, 100.0), 1000);
    assert!((share0(&mut off, 6, 1000) - 0.25).abs() < 0.005);
    let mut five = Router::new(config(r#"{"cutoffs": {"slowItlRatio": 5}}"#));
    five.apply_pool_event(0, &slowed(1, 100.0), 1000);
    assert!((share0(&mut five, 7, 1000) - 0.25).abs() < 0.005);
    five.apply_pool_event(0, &slowed(2, 140.0), 1100);
    // Its speed relative to the pool, 27 / 140, is below slowdownFactor: that is its weight.
    let w = 27.0 / 140.0;
    assert!((share0(&mut five, 8, 1100) - w / (w + 3.0)).abs() < 0.005);
    // A pod 10x slower gets a tenth of its weight, whatever the ratio that flagged it.
    r.apply_pool_event(0, &slowed(16, 270.0), 62_000);
    assert!((share0(&mut r, 12, 62_000) - 0.1 / 3.1).abs() < 0.005);
    // The flagged pod itself dropping under 8 tokens takes the pool under three readings;
    // its judgement holds anyway (it is why the pool is short).
    let mut ev = slowed(17, 270.0);
    decoding(&mut ev, 0, 270.0, 7);
    decoding(&mut ev, 3, 30.0, 7);
    r.apply_pool_event(0, &ev, 62_100);
    assert!(r.pod_status(0, 62_100)[0].slow_decode);
    assert!((share0(&mut r, 13, 62_100) - 0.1 / 3.1).abs() < 0.005);
}

/// `ev` with peer `i`'s GPU named `name`.
fn gpu_named(ev: &mut PoolEvent, i: usize, name: &str) {
    ev.peers[i].snapshot.as_mut().unwrap().gpus[0].name = name.into();
}

#[test]
fn a_slower_gpu_generation_is_judged_against_its_own_kind_not_as_a_slow_pod() {
    // Two H100s, four A100s, two L40S (the three-kind pool): the L40S decode 3.5x slower than
    // the pool's median (the A100s) under load, as they do at 2.4x at equal batch and more
    // with longer batches. They are not slow pods: they decode like each other.
    let pods = [pod(0.2); 8];
    let kinds = [
        "H100", "H100", "A100", "A100", "A100", "A100", "L40S", "L40S",
    ];
    let pool = |seq: u64, itls: [f64; 8]| {
        let mut ev = event(&pods, seq);
        for (i, (itl, kind)) in itls.into_iter().zip(kinds).enumerate() {
            decoding(&mut ev, i, itl, 100);
            gpu_named(&mut ev, i, kind);
        }
        ev
    };
    let l40s_share = |r: &mut Router, seed: u64, now: u64| {
        let c = counts(r, 8, 100_000, seed, now);
        (c[6] + c[7]) as f64 / 100_000.0
    };
    let mut r = Router::new(config(""));
    r.apply_pool_event(
        0,
        &pool(1, [6.0, 6.0, 10.0, 10.0, 10.0, 10.0, 35.0, 36.0]),
        1000,
    );
    assert_eq!(r.counters().slow_decode, 0);
    let status = r.pod_status(0, 1000);
    assert!(status.iter().all(|s| !s.slow_decode));
    assert!((l40s_share(&mut r, 1, 1000) - 0.25).abs() < 0.005);

    // Without GPU names (every pod of one unknown kind) they are judged against the pool,
    // as before kinds were known: 35 ms is 3.5x the median of 10 ms.
    let mut unnamed = pool(1, [6.0, 6.0, 10.0, 10.0, 10.0, 10.0, 35.0, 36.0]);
    for i in 0..8 {
        gpu_named(&mut unnamed, i, "");
    }
    let mut blind = Router::new(config(""));
    blind.apply_pool_event(0, &unnamed, 1000);
    assert_eq!(blind.counters().slow_decode, 2);
    assert!(l40s_share(&mut blind, 2, 1000) < 0.1);

    // One L40S slowed 3x against the other: judged slow, at its speed against its kind
    // (36 / 108 = 1/3, held to slowdownFactor 0.25), not against the pool (10 / 108).
    r.apply_pool_event(
        0,
        &pool(2, [6.0, 6.0, 10.0, 10.0, 10.0, 10.0, 36.0, 108.0]),
        1100,
    );
    let status = r.pod_status(0, 1100);
    assert!(status[7].slow_decode && !status[6].slow_decode);
    assert_eq!(r.counters().slow_decode, 1);
    let c = counts(&mut r, 8, 100_000, 3, 1100);
    let want = 0.25 / 7.25;
    let share = c[7] as f64 / 100_000.0;
    assert!(
        (share - want).abs() < 0.005,
        "slowed L40S share {share}, want {want}"
    );
    // 2.9x its sibling is not slow, though 10x the pool's median.
    r.apply_pool_event(
        0,
        &pool(3, [6.0, 6.0, 10.0, 10.0, 10.0, 10.0, 36.0, 104.0]),
        1200,
    );
    assert!(!r.pod_status(0, 1200)[7].slow_decode);

    // A faster kind stays judged against the pool: an H100 at 3x its sibling (18 ms) is under
    // 3x the pool's median of 10 ms and not slow; at 31 ms it is.
    r.apply_pool_event(
        0,
        &pool(4, [18.0, 6.0, 10.0, 10.0, 10.0, 10.0, 35.0, 36.0]),
        1300,
    );
    assert!(!r.pod_status(0, 1300)[0].slow_decode);
    r.apply_pool_event(
        0,
        &pool(5, [31.0, 6.0, 10.0, 10.0, 10.0, 10.0, 35.0, 36.0]),
        1400,
    );
    assert!(r.pod_status(0, 1400)[0].slow_decode);

    // A kind no other pod shares is judged against the pool alone.
    let mut lone = pool(1, [6.0, 6.0, 10.0, 10.0, 10.0, 10.0, 10.0, 35.0]);
    gpu_named(&mut lone, 6, "A100");
    let mut r = Router::new(config(""));
    r.apply_pool_event(0, &lone, 1000);
    let status = r.pod_status(0, 1000);
    assert!(status[7].slow_decode && !status[6].slow_decode);
}

#[test]
fn a_slowed_pod_loses_to_a_busier_pod_unless_it_is_that_many_times_less_busy() {
    // Four equal pods, capacity 16. Pod 0 is slowed, once by its GPU (weight 0.25, so 4x) and
    // once by decoding 5x slower than the pool (0.2, 5x); it runs 2 requests, the others 4.
    // Per request in flight it is 4-5x as busy: it loses every comparison, and is picked only
    // when no other pod is drawn at all (first draw and three redraws, p0^4).
    let slow = |what: &str, mut ev: PoolEvent| {
        if what == "gpu" {
            return throttled(ev, 0, 0x8);
        }
        for (i, ms) in [100.0, 20.0, 20.0, 20.0].into_iter().enumerate() {
            decoding(&mut ev, i, ms, 100);
        }
        ev
    };
    for (what, w) in [("gpu", 0.25_f64), ("decode", 0.2)] {
        let mut r = Router::new(config(r#"{"cutoffs":{"maxQueue":16}}"#));
        let mut ev = slow(what, event(&[pod(0.2); 4], 1));
        set_queues(&mut ev, &[(0, 2, 0), (1, 4, 0), (2, 4, 0), (3, 4, 0)]);
        r.apply_pool_event(0, &ev, 1000);
        assert!(r.pod_status(0, 1000)[0].score < r.pod_status(0, 1000)[1].score * 0.3);
        let c = counts(&mut r, 4, 40_000, 21, 1000);
        let p0 = w / (w + 3.0);
        let share = c[0] as f64 / 40_000.0;
        assert!(
            share < p0.powi(4) + 0.002,
            "{what}: slowed pod's share {share}"
        );

        // Idle, it is the one that can start a request soonest, slowed or not: it wins when
        // drawn (about twice its weight's share), so a slowed pod still serves.
        let mut ev = slow(what, event(&[pod(0.2); 4], 2));
        set_queues(&mut ev, &[(0, 0, 0), (1, 4, 0), (2, 4, 0), (3, 4, 0)]);
        r.apply_pool_event(0, &ev, 1100);
        let c = counts(&mut r, 4, 40_000, 22, 1100);
        let share = c[0] as f64 / 40_000.0;
        assert!(share > 1.5 * p0, "{what}: idle slowed pod's share {share}");
    }
}

#[test]
fn a_slowed_pods_free_seat_counts_at_its_speed() {
    // Eight seats. Pod 0's GPU is slowed (a quarter of the speed) and runs 3: at its speed its
    // seats hold 2, so it is full, and waits 2 full-speed rounds ((3 - 2 + 1) / max(3/4, 1)).
    // Pods 1-3 run 8 with 1 waiting: queued, a quarter of a round ((9 - 8 + 1) / 8). Pod 0
    // loses every comparison (before, its free seat won each one it was drawn into, about
    // 14 % of the picks).
    let share0 = |waiting: u32, seed: u64| {
        let mut r = Router::new(config(r#"{"cutoffs":{"maxQueue":8}}"#));
        let mut ev = throttled(event(&[pod(0.2); 4], 1), 0, 0x8);
        set_queues(
            &mut ev,
            &[(0, 3, 0), (1, 8, waiting), (2, 8, waiting), (3, 8, waiting)],
        );
        r.apply_pool_event(0, &ev, 1000);
        counts(&mut r, 4, 40_000, seed, 1000)[0] as f64 / 40_000.0
    };
    let p0: f64 = 0.25 / 3.25;
    let share = share0(1, 31);
    assert!(share < p0.powi(4) + 0.002, "slowed pod's share {share}");
    // Behind deep queues (24 waiting: 3.1 rounds) its 2 rounds are the shorter wait: it wins
    // when drawn, so a slowed pod still takes load off a saturated pool.
    let share = share0(24, 32);
    assert!(
        share > 1.5 * p0,
        "slowed pod's share behind deep queues {share}"
    );
}

#[test]
fn a_slower_generations_free_seat_is_a_free_seat() {
    // Eight seats. Pod 0 decodes 2.5x slower than the others (an L40S beside A100s), under
    // `slowItlRatio`: not judged slow. It runs 4; pods 1-3 run 8 with 1 waiting. A short
    // request starts at once on pod 0 and queues on the others, so pod 0 wins every
    // comparison it is drawn into (1/4 + 3/4 x 1/3 of the picks at equal weights; its empty
    // queue weighs it a little more). Counted full at 8 / 2.5 seats, as before, it lost
    // every one (a share of 0.004).
    let share0 = |itl0: f64, seed: u64| {
        let mut r = Router::new(config(r#"{"cutoffs":{"maxQueue":8}}"#));
        let mut ev = event(&[pod(0.2); 4], 1);
        set_queues(&mut ev, &[(0, 4, 0), (1, 8, 1), (2, 8, 1), (3, 8, 1)]);
        for (i, itl) in [itl0, 10.0, 10.0, 10.0].into_iter().enumerate() {
            decoding(&mut ev, i, itl, 100);
        }
        r.apply_pool_event(0, &ev, 1000);
        assert_eq!(r.pod_status(0, 1000)[0].slow_decode, itl0 >= 30.0);
        counts(&mut r, 4, 40_000, seed, 1000)[0] as f64 / 40_000.0
    };
    let share = share0(25.0, 41);
    assert!(
        (0.49..0.56).contains(&share),
        "slower generation's share {share}"
    );
    // Judged slow (3.5x; drawn at slowdownFactor 0.25, so 4x slower), its seats count at
    // its speed: 4 requests fill its 8 / 4 and it waits (4 - 2 + 1) / 1 = 3 rounds against a
    // quarter: it loses when drawn.
    let share = share0(35.0, 42);
    assert!(share < 0.01, "slowed pod's share {share}");
}

/// A router whose sidecar has seen ~1 100-byte bodies with 200 output tokens (mean KV ~475
/// tokens, so 5 000 tokens is big), with `extra` merged into the test config.
fn trained(extra: &str) -> Router {
    let mut r = Router::new(config(extra));
    for _ in 0..200 {
        r.request_size(Some(1_100), Some(200));
    }
    r
}

const HOLD: &str = r#"{"bigRequestHold": {}}"#;

#[test]
fn big_request_hold_is_off_unless_configured_and_validated() {
    assert_eq!(config("").big_request_hold, None);
    let h = config(HOLD).big_request_hold.unwrap();
    assert_eq!(
        (h.kv_headroom, h.max_hold_ms, h.max_held, h.min_kv_share),
        (0.2, 10_000, 256, 0.25)
    );
    for (field, value, msg) in [
        ("kvHeadroom", "1.5", "bigRequestHold.kvHeadroom"),
        ("kvHeadroom", "-0.1", "bigRequestHold.kvHeadroom"),
        ("maxHoldMs", "0", "bigRequestHold.maxHoldMs"),
        ("maxHoldMs", "600001", "bigRequestHold.maxHoldMs"),
        ("maxHeld", "0", "bigRequestHold.maxHeld"),
        ("minKvShare", "1.01", "bigRequestHold.minKvShare"),
        ("minKvShare", "-0.5", "bigRequestHold.minKvShare"),
    ] {
        let json = format!(
            r#"{{"pools":[{{"name":"p","cluster":"c"}}],"bigRequestHold":{{"{field}":{value}}}}}"#
        );
        let e = FilterConfig::from_json(json.as_bytes())
            .unwrap_err()
            .to_string();
        assert!(e.contains(msg) && e.contains(value), "{e}");
    }
    let e = FilterConfig::from_json(
        br#"{"pools":[{"name":"p","cluster":"c"}],"bigRequestHold":{"kvHedroom":0.1}}"#,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("kvHedroom"), "{e}");
}

#[test]
fn a_big_request_is_held_only_while_no_pod_has_room_with_the_headroom() {
    // Four pods of 12 500 KV tokens at 50 % use: a 5 000-token prompt fits each (11 250 ≤
    // 12 500) but leaves less than the default 20 % (2 500) free: held. Short ones never are.
    let big = sized(5_000.0, 1_000.0);
    let mut r = trained(HOLD);
    r.apply_pool_event(0, &kv_event(&[0.5; 4], 12_500, 1), 1000);
    assert!(r.should_hold(0, None, big, 1000));
    assert!(!r.should_hold(0, None, sized(475.0, 200.0), 1000));
    // Off: never held.
    let mut off = trained("");
    off.apply_pool_event(0, &kv_event(&[0.5; 4], 12_500, 1), 1000);
    assert!(!off.should_hold(0, None, big, 1000));
    // One pod at 30 % (3 750 + 5 000 ≤ 10 000): released, and routed there.
    r.apply_pool_event(0, &kv_event(&[0.5, 0.5, 0.3, 0.5], 12_500, 2), 1100);
    assert!(!r.should_hold(0, None, big, 1100));
    let c = counts_for(&mut r, 4, big, 2_000, 71);
    assert_eq!(c[2], 2_000, "{c:?}");
    // This sidecar's own start there takes the room again: held.
    r.on_request_start(0, &addr(2), big, 1100);
    assert!(r.should_hold(0, None, big, 1100));
    // KV room but every seat taken (or requests waiting): it would not start at once, held.
    let mut r = trained(HOLD);
    for (seq, running, waiting, held) in [(3, 8, 0, true), (4, 6, 1, true), (5, 6, 0, false)] {
        let mut ev = kv_event(&[0.5, 0.5, 0.0, 0.5], 12_500, seq);
        set_queues(&mut ev, &[(2, running, waiting)]);
        let now = 1100 + 50 * seq;
        r.apply_pool_event(0, &ev, now);
        assert_eq!(
            r.should_hold(0, None, big, now),
            held,
            "{running} running, {waiting} waiting"
        );
    }
    // Four times the mean (1 900 tokens here) but under a quarter of the largest cache
    // (`minKvShare`, default 0.25 of 12 500): a long-tail request of ordinary traffic,
    // never held; with `minKvShare: 0` it is.
    let tail = sized(2_000.0, 1_000.0);
    let mut r = trained(HOLD);
    r.apply_pool_event(0, &kv_event(&[0.95; 4], 12_500, 1), 1000);
    assert!(r.should_hold(0, None, big, 1000));
    assert!(!r.should_hold(0, None, tail, 1000));
    let mut r = trained(r#"{"bigRequestHold": {"minKvShare": 0}}"#);
    r.apply_pool_event(0, &kv_event(&[0.95; 4], 12_500, 1), 1000);
    assert!(r.should_hold(0, None, tail, 1000));
    // The share is of the largest cache: beside a pod of 40 000 tokens (3 000 < 10 000) it
    // is not held either.
    let mut r = trained(HOLD);
    let mut ev = kv_event(&[0.95; 4], 12_500, 1);
    inference(&mut ev, 3).kv_capacity_tokens = Some(40_000);
    r.apply_pool_event(0, &ev, 1000);
    assert!(!r.should_hold(0, None, tail, 1000));
    // A request larger than the cache less the headroom needs only to fit: 11 000 tokens
    // on an empty pod.
    let mut r = trained(HOLD);
    r.apply_pool_event(0, &kv_event(&[0.0, 0.5, 0.5, 0.5], 12_500, 3), 1200);
    assert!(!r.should_hold(0, None, sized(11_000.0, 1_000.0), 1200));
}

#[test]
fn a_big_request_is_never_held_on_a_guess() {
    let big = sized(5_000.0, 1_000.0);
    // A pod that does not report its KV cache might have room.
    let mut r = trained(HOLD);
    let mut ev = kv_event(&[0.5; 4], 12_500, 1);
    inference(&mut ev, 3).kv_capacity_tokens = None;
    r.apply_pool_event(0, &ev, 1000);
    assert!(!r.should_hold(0, None, big, 1000));
    // Before the sidecar has seen a sized request nothing is big.
    let mut fresh = Router::new(config(HOLD));
    fresh.apply_pool_event(0, &kv_event(&[0.9; 4], 12_500, 1), 1000);
    assert!(!fresh.should_hold(0, None, big, 1000));
    // A pool in fallback (every snapshot stale) is routed as Envoy would.
    let mut r = trained(HOLD);
    r.apply_pool_event(0, &kv_event(&[0.9; 4], 12_500, 1), 1000);
    assert!(r.should_hold(0, None, big, 1000));
    assert!(!r.should_hold(0, None, big, 600_000));
    // No pool: nothing to hold for.
    assert!(!r.should_hold(7, None, big, 1000));
}

proptest! {
    /// Issue 32: on GPUs without GPM (A100 and older) NVML's time fraction is the only GPU
    /// reading, and it saturates near 1 on any busy GPU. By default (`gpuSignal: auto`) it must
    /// change nothing: every decision equals the one made with no GPU reading at all, whatever
    /// the time fractions say (idle, busy, saturated, one pod at 1.0, garbage).
    #[test]
    fn without_gpm_the_time_fraction_changes_no_decision(
        utils in proptest::collection::vec(prop_oneof![Just(1.0f64), Just(0.0), 0.0f64..=1.0, Just(f64::NAN), Just(7.0)], 4),
        waiting in proptest::collection::vec(0u32..12, 4),
        running in proptest::collection::vec(0u32..9, 4),
        kv in proptest::collection::vec(0.0f64..1.0, 4),
        seed in 0u64..1000,
    ) {
        let mk = |with_util: bool| {
            let mut ev = event(&[pod(0.5); 4], 1);
            for i in 0..4 {
                let snap = ev.peers[i].snapshot.as_mut().unwrap();
                snap.gpus[0].sm_occupancy = None;
                snap.gpus[0].utilization = with_util.then_some(utils[i]);
                let inf = inference(&mut ev, i);
                inf.waiting = Some(waiting[i]);
                inf.running = Some(running[i]);
                inf.queue_capacity = Some(8);
                inf.kv_cache_usage = Some(kv[i]);
                inf.kv_capacity_tokens = Some(12_500);
            }
            let mut r = Router::new(config(""));
            r.apply_pool_event(0, &ev, 1000);
            r
        };
        let (mut with, mut without) = (mk(true), mk(false));
        let size = RequestSize { weight: 1.0, kv_tokens: 600.0, output_tokens: 200.0 };
        for k in 0..20u64 {
            let mut r1 = ChaCha8Rng::seed_from_u64(seed * 100 + k);
            let mut r2 = ChaCha8Rng::seed_from_u64(seed * 100 + k);
            let a = with.decide_for(0, None, size, 1000 + k, &mut r1);
            let b = without.decide_for(0, None, size, 1000 + k, &mut r2);
            prop_assert_eq!(chosen(&with, &a), chosen(&without, &b));
            if let (Some(pa), Some(pb)) = (chosen(&with, &a), chosen(&without, &b)) {
                with.on_request_start(0, &pa, size, 1000 + k);
                without.on_request_start(0, &pb, size, 1000 + k);
            }
        }
        prop_assert_eq!(with.counters().fail_open, without.counters().fail_open);
    }
}
