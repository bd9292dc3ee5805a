//! Adaptive breaker thresholds (`breaker.adaptiveThresholds`, issue 30 part 4b): each pod's
//! `failureRate`, `agentErrorRate` and `ttftSloMs` move within ±`maxAdjust` of their base with
//! the median of the *other* pods' agent error rate and TTFT p99. A noisy pool raises them, a
//! quiet one lowers them, a pod's own readings never move its own, and with the section absent
//! nothing changes.

use ai_lb_filter_core::breaker::{BreakerState, Outcome, TripReason};
use ai_lb_filter_core::config::FilterConfig;
use ai_lb_filter_core::picker::Router;
use ai_lb_filter_core::status::scoreboard;
use ai_lb_proto::{
    GpuStats, InferenceStats, LatencyQuantiles, PeerState, PeerStatus, PodIdentity, PodSnapshot,
    PoolEvent,
};

fn addr(i: usize) -> String {
    format!("10.0.0.{}:8000", i + 1)
}

/// One pool event: pod i reports error rate `pods[i].0` over 100 requests and TTFT p99
/// `pods[i].1` ms.
fn event(seq: u64, pods: &[(f64, f64)]) -> PoolEvent {
    PoolEvent {
        full: true,
        peers: pods
            .iter()
            .enumerate()
            .map(|(i, &(err, p99))| PeerState {
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
                        error_rate: Some(err),
                        request_rate: Some(10.0),
                        window_ms: 10_000,
                        ttft: Some(LatencyQuantiles {
                            p99_ms: Some(p99),
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

/// A router over `pods`, with `extra` members appended to the breaker section (ttftSloMs 1000,
/// agentErrorRate 0.25 and failureRate 0.5 by default).
fn router(extra: &str, pods: &[(f64, f64)]) -> Router {
    let cfg = FilterConfig::from_json(
        format!(
            r#"{{"pools":[{{"name":"p","cluster":"c"}}],"minPods":1,
            "breaker":{{"consecutiveFailures":3,"baseCooldownMs":1000,"ttftSloMs":1000{extra}}}}}"#
        )
        .as_bytes(),
    )
    .unwrap();
    let mut r = Router::new(cfg);
    r.apply_pool_event(0, &event(1, pods), 1_000);
    r.tick(1_000);
    r
}

const ON: &str = r#","adaptiveThresholds":{}"#;
const EVIDENCE: &str = r#","adaptiveThresholds":{"errorEvidence":3}"#;

/// Pod `i`'s (failureRate, agentErrorRate, ttftSloMs) as it is judged now.
fn thresholds(r: &Router, i: usize) -> (f64, f64, Option<u64>) {
    let c = r.breaker_config_for(0, &addr(i));
    (
        (c.failure_rate * 1e6).round() / 1e6,
        (c.agent_error_rate * 1e6).round() / 1e6,
        c.ttft_slo_ms,
    )
}

#[test]
fn a_noisy_pool_raises_the_thresholds_and_a_quiet_one_lowers_them_within_the_clamp() {
    // Every pod fails 12 % and its TTFT p99 is 1.5 s (over the 1 s SLO): background at 48 %
    // of agentErrorRate, past errorNoisyAt 0.4: both rates +30 % (agentErrorRate 0.25 ->
    // 0.325, failureRate 0.5 -> 0.65), the SLO 1000 -> 1300 ms.
    let r = router(ON, &[(0.12, 1500.0); 4]);
    for i in 0..4 {
        assert_eq!(thresholds(&r, i), (0.65, 0.325, Some(1300)));
    }
    // Half-way: a 5 % background leaves the rates at their base.
    let r = router(ON, &[(0.05, 500.0); 4]);
    assert_eq!(thresholds(&r, 0), (0.5, 0.25, Some(1000)));
    // A pool failing nearly everything moves nothing past +30 %.
    let r = router(ON, &[(0.9, 50_000.0); 4]);
    assert_eq!(thresholds(&r, 0), (0.65, 0.325, Some(1300)));
    // A quiet pool: no errors, p99 100 ms: -30 % on the rates, the SLO at 0.7 + 0.6 · 0.1.
    let r = router(ON, &[(0.0, 100.0); 4]);
    assert_eq!(thresholds(&r, 0), (0.35, 0.175, Some(760)));
    // The pool's gauges: the pods' median, rates x1000.
    let g: Vec<_> = r.pool_thresholds(0).unwrap().gauges().collect();
    assert_eq!(
        g,
        [
            ("failure_rate_permille", 350),
            ("agent_error_rate_permille", 175),
            ("ttft_slo_ms", 760)
        ]
    );
    // maxAdjust narrows the band.
    let r = router(
        r#","adaptiveThresholds":{"maxAdjust":0.1}"#,
        &[(0.0, 0.0); 4],
    );
    assert_eq!(thresholds(&r, 0), (0.45, 0.225, Some(900)));
    // The status page shows each pod's thresholds and the background they came from.
    let page = scoreboard(&r, 1_000);
    let t = &page["pools"][0]["pods"][0]["thresholds"];
    assert_eq!(
        t["agentErrorRate"].as_f64().map(|x| (x * 1e6).round()),
        Some(225_000.0)
    );
    assert_eq!(t["ttftSloMs"], 900);
    assert_eq!(t["errorBackground"], 0.0);
}

#[test]
fn a_pod_that_is_itself_the_outlier_does_not_raise_its_own_threshold() {
    // Pod 0 fails half its requests and is slow; the others are quiet. Counting its own
    // readings, the median of all four would be 0.05 (agentErrorRate left at 0.25); left out,
    // its background is the others' 0, and its thresholds are lowered.
    let r = router(
        ON,
        &[(0.5, 5000.0), (0.1, 200.0), (0.0, 100.0), (0.0, 100.0)],
    );
    let (_, agent, slo) = thresholds(&r, 0);
    assert_eq!(agent, 0.175);
    assert_eq!(
        slo,
        Some(760),
        "the others' median p99 (100 ms), not its own 5 s"
    );
    // It is cut on its own error rate at the next snapshot.
    assert_eq!(
        r.breaker(0, &addr(0), None).map(|b| b.state()),
        Some(BreakerState::Open)
    );
    // The other pods' medians are robust to it: pod 2 sees median(0.5, 0.1, 0) = 0.1.
    let (_, agent2, slo2) = thresholds(&r, 2);
    assert_eq!(agent2, 0.325);
    assert_eq!(slo2, Some(820), "median(5000, 200, 100) = 200 ms");
}

#[test]
fn a_noisy_pool_spares_a_burst_the_static_threshold_cuts_and_a_quiet_pool_cuts_sooner() {
    // Noisy pool (10 % background); pod 0 bursts to 28 %: the static 0.25 cuts it, the
    // adapted 0.325 does not (counted laxer).
    let noisy = [(0.28, 300.0), (0.1, 300.0), (0.1, 300.0), (0.1, 300.0)];
    let st = router("", &noisy);
    assert_eq!(
        st.breaker(0, &addr(0), None).map(|b| b.state()),
        Some(BreakerState::Open)
    );
    let ad = router(ON, &noisy);
    assert_eq!(
        ad.breaker(0, &addr(0), None).map(|b| b.state()),
        Some(BreakerState::Closed)
    );
    assert_eq!(ad.counters().breaker_thresholds_laxer, 1);
    assert_eq!(ad.counters().breaker_thresholds_stricter, 0);
    // Quiet pool; pod 0 starts failing 20 %: the static threshold waits, the adapted 0.175
    // cuts it (counted stricter).
    let quiet = [(0.2, 300.0), (0.0, 300.0), (0.0, 300.0), (0.0, 300.0)];
    let st = router("", &quiet);
    assert_eq!(
        st.breaker(0, &addr(0), None).map(|b| b.state()),
        Some(BreakerState::Closed)
    );
    let ad = router(ON, &quiet);
    assert_eq!(
        ad.breaker(0, &addr(0), None).map(|b| b.state()),
        Some(BreakerState::Open)
    );
    assert_eq!(ad.counters().breaker_thresholds_stricter, 1);
}

#[test]
fn the_ttft_slo_adapts_for_the_breakers_outcomes() {
    // Every pod's TTFT p99 is 1.5 s: the SLO is 1300 ms. Three answers at 1.2 s open the
    // static breaker (consecutiveFailures 3) and not the adapted one.
    let pods = [(0.0, 1500.0); 4];
    let slow = Outcome {
        status: Some(200),
        ttft_ms: Some(1200),
        ..Outcome::default()
    };
    for (extra, open) in [("", true), (ON, false)] {
        let mut r = router(extra, &pods);
        let mut opened = false;
        for t in 0..3 {
            let ev = r.on_outcome(0, &addr(0), None, &slow, 2_000 + t);
            opened |= ev
                .iter()
                .any(|e| e.to == BreakerState::Open && e.reason == Some(TripReason::SlowTtft));
        }
        assert_eq!(opened, open, "adaptive: {extra}");
        if !extra.is_empty() {
            assert_eq!(r.counters().breaker_thresholds_laxer, 3);
        }
    }
    // Past the adapted SLO it is a failure as before.
    let mut r = router(ON, &pods);
    let slower = Outcome {
        ttft_ms: Some(1301),
        ..slow
    };
    let ev: Vec<_> = (0..3)
        .flat_map(|t| r.on_outcome(0, &addr(0), None, &slower, 2_000 + t))
        .collect();
    assert!(ev.iter().any(|e| e.to == BreakerState::Open));
}

#[test]
fn a_quiet_pool_opens_on_a_failure_rate_the_static_threshold_lets_through() {
    // failureRate 0.5 -> 0.35 in a quiet pool: 4 failures in 10 (never 3 in a row) opens it.
    let pods = [(0.0, 100.0); 4];
    let ok = Outcome {
        status: Some(200),
        ttft_ms: Some(50),
        ..Outcome::default()
    };
    let bad = Outcome {
        status: Some(503),
        ..Outcome::default()
    };
    for (extra, open) in [("", false), (ON, true)] {
        let mut r = router(extra, &pods);
        let mut opened = None;
        for t in 0..10u64 {
            let o = if t % 5 < 2 { &bad } else { &ok };
            for e in r.on_outcome(0, &addr(0), None, o, 2_000 + t) {
                if e.to == BreakerState::Open {
                    opened = e.reason;
                }
            }
        }
        assert_eq!(
            opened,
            open.then_some(TripReason::FailureRate),
            "adaptive: {extra}"
        );
    }
}

#[test]
fn too_few_or_stale_readings_keep_the_static_thresholds_and_say_so() {
    // Two pods: each has one other, under minPods (2): static, counted per new snapshot.
    let mut r = router(ON, &[(0.0, 100.0); 2]);
    assert_eq!(thresholds(&r, 0), (0.5, 0.25, Some(1000)));
    let before = r.counters().breaker_thresholds_static;
    assert!(before >= 2, "{before}");
    r.apply_pool_event(0, &event(2, &[(0.0, 100.0); 2]), 1_500);
    r.tick(1_500);
    assert_eq!(r.counters().breaker_thresholds_static, before + 2);
    // minPods 1: one other pod is enough.
    let r = router(r#","adaptiveThresholds":{"minPods":1}"#, &[(0.0, 100.0); 2]);
    assert_eq!(thresholds(&r, 0), (0.35, 0.175, Some(760)));
    // Four pods whose metrics went stale (staleness 2 s): the static thresholds again.
    let mut r = router(ON, &[(0.0, 100.0); 4]);
    r.tick(10_000);
    assert_eq!(thresholds(&r, 0), (0.5, 0.25, Some(1000)));
    // Windows under minRequests do not count toward the error background.
    let r = router(
        r#","adaptiveThresholds":{"minRequests":500}"#,
        &[(0.0, 100.0); 4],
    );
    assert_eq!(thresholds(&r, 0), (0.5, 0.25, Some(760)));
}

#[test]
fn an_e2e_p99_is_no_background_for_the_ttft_slo() {
    // Agents that report only the e2e p99 (no TTFT histogram): the rates still adapt, the
    // TTFT SLO stays at its base.
    let mut ev = event(1, &[(0.0, 100.0); 4]);
    for p in ev.peers.iter_mut() {
        if let Some(inf) = p.snapshot.as_mut().and_then(|s| s.inference.as_mut()) {
            inf.e2e = inf.ttft.take();
        }
    }
    let cfg = FilterConfig::from_json(
        br#"{"pools":[{"name":"p","cluster":"c"}],"minPods":1,
            "breaker":{"ttftSloMs":1000,"adaptiveThresholds":{}}}"#,
    )
    .unwrap();
    let mut r = Router::new(cfg);
    r.apply_pool_event(0, &ev, 1_000);
    r.tick(1_000);
    assert_eq!(thresholds(&r, 0), (0.35, 0.175, Some(1000)));
}

/// [`event`] with each pod's model-server counts: pod i has finished `totals[i].0` requests,
/// `totals[i].1` of them failed, and reports a windowed error rate of `rates[i]`.
fn counted(seq: u64, rates: &[f64], totals: &[(f64, f64)]) -> PoolEvent {
    let pods: Vec<(f64, f64)> = rates.iter().map(|&e| (e, 300.0)).collect();
    let mut ev = event(seq, &pods);
    for (peer, &(f, e)) in ev.peers.iter_mut().zip(totals) {
        if let Some(inf) = peer.snapshot.as_mut().and_then(|s| s.inference.as_mut()) {
            inf.finished_total = Some(f);
            inf.errors_total = Some(e);
        }
    }
    ev
}

/// Feeds `steps` snapshots, 100 ms apart, in which every pod finishes 10 requests: pod 0 fails
/// `fail0` of them and reports a windowed rate of 0.2, the others fail 1 and report 0.08 (so
/// the adapted `agentErrorRate` is 0.295 and pod 0's window stays under it). Answers pod 0's
/// breaker state after each snapshot.
fn feed_counts(extra: &str, fail0: f64, steps: u64) -> (Router, Vec<BreakerState>) {
    let rates = [0.2, 0.08, 0.08, 0.08];
    let mut r = router(extra, &[(0.08, 300.0); 4]);
    let mut states = Vec::new();
    for k in 0..steps {
        let n = 10.0 * k as f64;
        let totals = [
            (n, fail0 * k as f64),
            (n, k as f64),
            (n, k as f64),
            (n, k as f64),
        ];
        let now = 1_100 + 100 * k;
        r.apply_pool_event(0, &counted(2 + k, &rates, &totals), now);
        r.tick(now);
        states.push(r.breaker(0, &addr(0), None).unwrap().state());
    }
    (r, states)
}

#[test]
fn the_evidence_test_cuts_a_pod_failing_half_its_requests_before_its_window_shows_it() {
    // 5 failures of 10 per snapshot against p0 = 0.197, p1 = 0.5: about +2.3 a snapshot, so
    // the third snapshot (the first only sets the counters) passes 3.
    let (mut r, states) = feed_counts(EVIDENCE, 5.0, 6);
    assert_eq!(
        states[..3],
        [
            BreakerState::Closed,
            BreakerState::Closed,
            BreakerState::Open
        ],
        "{states:?}"
    );
    assert_eq!(r.counters().breaker_thresholds_evidence, 1);
    let trips = r.take_signal_trips();
    assert!(
        trips.len() == 1
            && trips[0].pod == addr(0)
            && trips[0].reason == TripReason::AgentErrorRate,
        "{trips:?}"
    );
    // Off (the default), the windowed rate (0.2 under 0.295) never cuts it.
    let (r, states) = feed_counts(ON, 5.0, 6);
    assert!(
        states.iter().all(|s| *s == BreakerState::Closed),
        "{states:?}"
    );
    assert_eq!(r.counters().breaker_thresholds_evidence, 0);
    // Nor do static thresholds: the test belongs to the adaptive ones.
    let (_, states) = feed_counts("", 5.0, 6);
    assert!(
        states.iter().all(|s| *s == BreakerState::Closed),
        "{states:?}"
    );
}

#[test]
fn a_burst_at_twice_the_background_builds_no_evidence() {
    // 2 failures of 10 per snapshot: each snapshot takes about 1.9 off, so the sum stays at 0.
    let (r, states) = feed_counts(EVIDENCE, 2.0, 40);
    assert!(
        states.iter().all(|s| *s == BreakerState::Closed),
        "{states:?}"
    );
    assert_eq!(r.counters().breaker_thresholds_evidence, 0);
}

#[test]
fn the_evidence_starts_again_when_the_counters_go_back_or_vanish() {
    use ai_lb_filter_core::adaptive::Evidence;
    let rates = Evidence::rates(0.295, 0.25).unwrap();
    assert!((rates.0 - 0.295 * 2.0 / 3.0).abs() < 1e-12 && rates.1 == 0.5);
    let mut e = Evidence::default();
    assert_eq!(
        e.observe(Some((100.0, 10.0)), rates),
        0.0,
        "first counts set the base"
    );
    let one = e.observe(Some((110.0, 15.0)), rates);
    assert!((2.2..2.4).contains(&one), "{one}");
    // The server restarted: its counters start again, and so does the evidence.
    assert_eq!(e.observe(Some((4.0, 2.0)), rates), 0.0);
    assert!((2.2..2.4).contains(&e.observe(Some((14.0, 7.0)), rates)));
    // A snapshot without counts (the model server unread once) changes nothing; the next
    // counts bring the whole increase since.
    let two = e.observe(None, rates);
    assert!((2.2..2.4).contains(&two), "{two}");
    let four = e.observe(Some((24.0, 12.0)), rates);
    assert!((4.5..4.7).contains(&four), "{four}");
    // Failures growing faster than finished requests are nonsense: it starts again.
    assert_eq!(e.observe(Some((25.0, 20.0)), rates), 0.0);
    // No test where p0 would not be below p1 (a base agentErrorRate of 0: off).
    assert_eq!(Evidence::rates(0.2, 0.0), None);
}

#[test]
fn absent_the_section_changes_nothing() {
    let r = router("", &[(0.0, 100.0); 4]);
    assert_eq!(r.breaker_config_for(0, &addr(0)), r.config().breaker);
    assert!(r.pool_thresholds(0).is_none());
    assert!(r.config().breaker.adaptive_thresholds.is_none());
    let page = scoreboard(&r, 1_000);
    assert!(page["pools"][0]["pods"][0]["thresholds"].is_null());
    let c = r.counters();
    assert_eq!(
        (
            c.breaker_thresholds_static,
            c.breaker_thresholds_laxer,
            c.breaker_thresholds_stricter
        ),
        (0, 0, 0)
    );
}

#[test]
fn bad_values_are_refused_naming_the_field_and_value() {
    let err = |section: &str| {
        FilterConfig::from_json(
            format!(
                r#"{{"pools":[{{"name":"p","cluster":"c"}}],"breaker":{{"adaptiveThresholds":{section}}}}}"#
            )
            .as_bytes(),
        )
        .unwrap_err()
        .to_string()
    };
    for (section, field, value) in [
        (r#"{"maxAdjust":0}"#, "maxAdjust", "0"),
        (r#"{"maxAdjust":1.5}"#, "maxAdjust", "1.5"),
        (r#"{"errorNoisyAt":-0.1}"#, "errorNoisyAt", "-0.1"),
        (r#"{"latencyNoisyAt":20}"#, "latencyNoisyAt", "20"),
        (r#"{"minPods":0}"#, "minPods", "0"),
        (r#"{"minRequests":0}"#, "minRequests", "0"),
        (r#"{"errorEvidence":-1}"#, "errorEvidence", "-1"),
        (r#"{"errorEvidence":101}"#, "errorEvidence", "101"),
    ] {
        let e = err(section);
        assert!(
            e.contains(&format!("breaker.adaptiveThresholds.{field}")) && e.contains(value),
            "{section}: {e}"
        );
    }
    assert!(err(r#"{"maxAdjst":0.2}"#).contains("maxAdjst"));
}
