//! Learned weights (`learnedWeights`, issue 30 part 1): a per-pool linear model trained by SGD
//! on request outcomes. Each of the documents' safeguards has a test here: learning rate, L2,
//! clip, update interval, cold start at 30 samples, EMA 0.3, floor 0.01, cut-offs and breakers
//! outside the model, NaN / all-zero / diverging fall back to the static score (counted), and
//! the same seed and inputs give the same weights. With the section absent nothing changes.

use ai_lb_filter_core::breaker::{BreakerState, Outcome};
use ai_lb_filter_core::config::FilterConfig;
use ai_lb_filter_core::learned::{
    self, Fallback, Features, LearnedModel, LearnedWeights, RawLearnedWeights, DIM,
};
use ai_lb_filter_core::picker::{Decision, Router};
use ai_lb_filter_core::status::scoreboard;
use ai_lb_proto::{
    GpuStats, InferenceStats, LatencyQuantiles, PeerState, PeerStatus, PodIdentity, PodSnapshot,
    PoolEvent,
};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

fn cfg(json: &str) -> LearnedWeights {
    let raw: RawLearnedWeights = serde_json::from_str(json).unwrap();
    LearnedWeights::from_raw(&raw).unwrap()
}

fn near(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-12
}

fn sigmoid(z: f64) -> f64 {
    1.0 / (1.0 + (-z).exp())
}

/// Features `x` (7 of them) on a pod whose static score is `static_raw`.
fn feat(x: [f64; 7], static_raw: f64) -> Features {
    Features {
        x,
        offset: learned::offset_of(static_raw),
    }
}

const GOOD: Features = Features {
    x: [0.5; 7],
    offset: 0.0,
};
const BAD: Features = Features {
    x: [-0.5; 7],
    offset: 0.0,
};

#[test]
fn the_defaults_are_the_documents_figures() {
    let d = cfg("{}");
    assert_eq!(d, LearnedWeights::default());
    assert_eq!(d.learning_rate, 0.01);
    assert_eq!(d.l2, 0.001);
    assert_eq!(d.clip, 5.0);
    assert_eq!(d.update_interval_ms, 15_000);
    assert_eq!(d.cold_start_samples, 30);
    assert_eq!(d.ema_alpha, 0.3);
    assert_eq!(d.floor, 0.01);
}

#[test]
fn an_untrained_model_is_the_static_formula() {
    let m = LearnedModel::new(cfg("{}"), 0);
    // Initial weights are 0 within a seeded ±0.01.
    assert!(
        m.weights().iter().all(|w| w.abs() <= 0.01),
        "{:?}",
        m.weights()
    );
    for s in [0.05, 0.3, 0.5, 0.9] {
        let f = feat([0.5, -0.5, 0.2, 0.0, 0.5, 0.1, -1.0], s);
        let p = m.predict(&f).unwrap();
        // At most 0.01 · Σ|x| (2.8) off in logit: within 0.007 of the static score.
        assert!((p - s).abs() < 0.007, "static {s}, untrained {p}");
    }
}

#[test]
fn one_sgd_step_is_the_log_loss_gradient_with_l2_then_the_ema() {
    let c = cfg(r#"{"updateIntervalMs":1000}"#);
    let mut m = LearnedModel::new(c, 0);
    let w0 = m.weights();
    let f = feat([0.5, -0.25, 0.1, 0.0, 0.5, 0.3, -0.7], 0.6);
    // The first update, with nothing pending, starts the clock.
    assert!(m.due(0));
    assert_eq!(m.update(0, &[]).trained, 0);
    assert_eq!(m.next_update_ms(), Some(1_000));
    m.push(f, 0.2);
    assert!(!m.due(500));
    assert_eq!(m.update(999, &[]).trained, 0, "not due before the interval");
    assert_eq!(m.weights(), w0);
    let r = m.update(1_000, &[f]);
    assert_eq!(r.trained, 1);
    // The static score is the offset; the bias is trained with the weights.
    let z: f64 =
        f.offset + w0.iter().zip(f.x.iter()).map(|(w, x)| w * x).sum::<f64>() + w0[DIM - 1];
    let err = sigmoid(z) - 0.2;
    assert!(near(r.mse.unwrap(), err * err));
    for (i, w) in w0.iter().enumerate() {
        let xi = f.x.get(i).copied().unwrap_or(1.0);
        let t = w - 0.01 * (err * xi + 0.001 * w);
        let t = if i == learned::TTFT { t.max(0.0) } else { t };
        assert!(near(m.trained()[i], t), "weight {i}");
        // The weights that score: EMA 0.3 of the trained ones over the previous.
        assert!(near(m.weights()[i], 0.3 * t + 0.7 * w), "ema {i}");
    }
    assert_eq!(m.updates(), 1);
    assert_eq!(m.fallback(), None);
}

/// The bias learns how far the static scale sits from the outcomes' but does not score: a
/// shift common to every pod would only squeeze the static ratios the picker shares by.
#[test]
fn the_bias_is_trained_but_does_not_score() {
    let mut m = LearnedModel::new(
        cfg(r#"{"updateIntervalMs":1000,"learningRate":0.5,"emaAlpha":1}"#),
        0,
    );
    let (lo, hi) = (feat([0.0; 7], 0.2), feat([0.0; 7], 0.4));
    // Outcomes far better than the static scale says, for every pod alike.
    for _ in 0..2_000 {
        m.push(lo, 0.95);
        m.push(hi, 0.95);
    }
    m.update(1_000, &[lo, hi]);
    let bias = m.weights()[DIM - 1];
    assert!(bias > 1.0, "the bias moved: {:?}", m.weights());
    assert!(m.health(&lo) > 0.7, "health includes it");
    let (a, b) = (m.predict(&lo).unwrap(), m.predict(&hi).unwrap());
    assert!((a - 0.2).abs() < 0.01 && (b - 0.4).abs() < 0.01, "{a} {b}");
}

#[test]
fn updates_come_every_interval_and_the_interval_goes_down_to_one_second() {
    let mut m = LearnedModel::new(cfg("{}"), 0);
    assert_eq!(m.next_update_ms(), None);
    m.update(10_000, &[]);
    assert_eq!(m.next_update_ms(), Some(25_000), "15 s by default");
    m.push(GOOD, 1.0);
    assert_eq!(m.update(24_999, &[]).trained, 0);
    assert_eq!(m.update(25_000, &[]).trained, 1);
    m.push(GOOD, 1.0);
    assert_eq!(m.update(39_999, &[]).trained, 0);
    assert_eq!(m.update(40_000, &[]).trained, 1);
    let mut fast = LearnedModel::new(cfg(r#"{"updateIntervalMs":1000}"#), 0);
    fast.update(0, &[]);
    assert_eq!(fast.next_update_ms(), Some(1_000));
}

#[test]
fn l2_decays_the_weights_of_features_a_sample_does_not_have() {
    let mut m = LearnedModel::new(cfg(r#"{"updateIntervalMs":1000}"#), 3);
    let w0 = m.trained();
    for _ in 0..100 {
        m.push(feat([0.0; 7], 0.5), 0.5);
    }
    m.update(1_000, &[]);
    for (i, w) in w0.iter().enumerate().take(DIM - 1) {
        let want = w * (1.0 - 0.01 * 0.001_f64).powi(100);
        assert!((m.trained()[i] - want).abs() < 1e-12, "{i}");
    }
}

#[test]
fn weights_are_clipped() {
    let mut m = LearnedModel::new(
        cfg(r#"{"updateIntervalMs":1000,"learningRate":1,"clip":1.5}"#),
        0,
    );
    for _ in 0..1_000 {
        m.push(GOOD, 1.0);
        m.push(BAD, 0.0);
    }
    m.update(1_000, &[GOOD]);
    for w in m.trained() {
        assert!(w.abs() <= 1.5, "{:?}", m.trained());
    }
    assert!(m.trained()[..DIM - 1].iter().all(|w| *w == 1.5));
    // The default clip is 5.
    let mut m = LearnedModel::new(cfg(r#"{"updateIntervalMs":1000,"learningRate":1}"#), 0);
    for _ in 0..5_000 {
        m.push(GOOD, 1.0);
        m.push(BAD, 0.0);
    }
    m.update(1_000, &[GOOD]);
    assert!(m.trained().iter().all(|w| w.abs() <= 5.0));
}

#[test]
fn the_same_seed_and_inputs_give_the_same_weights() {
    let run = |seed: u64| {
        let c = LearnedWeights {
            seed,
            update_interval_ms: 1_000,
            ..LearnedWeights::default()
        };
        let mut m = LearnedModel::new(c, 0);
        for k in 0..5u64 {
            for i in 0..50u32 {
                let v = f64::from(i % 7) / 7.0 - 0.5;
                m.push(
                    feat([v, -v, 0.1, 0.2, v / 2.0, 0.0, -v.abs()], 0.5 + v / 2.0),
                    f64::from(i % 3) / 2.0,
                );
            }
            m.update(1_000 * (k + 1), &[GOOD]);
        }
        m.weights()
    };
    assert_eq!(run(7), run(7));
    assert_ne!(run(7), run(8));
    // Pools differ by salt, so two pools do not start alike.
    let c = LearnedWeights::default();
    assert_ne!(
        LearnedModel::new(c, 0).weights(),
        LearnedModel::new(c, 1).weights()
    );
}

#[test]
fn the_floor_keeps_a_bad_pod_above_zero() {
    let mut m = LearnedModel::new(
        cfg(r#"{"updateIntervalMs":1000,"learningRate":1,"emaAlpha":1}"#),
        0,
    );
    for _ in 0..2_000 {
        m.push(GOOD, 1.0);
        m.push(BAD, 0.0);
    }
    m.update(1_000, &[GOOD, BAD]);
    assert_eq!(m.fallback(), None);
    assert_eq!(m.predict(&BAD), Some(0.01), "floored at 0.01");
    assert!(m.predict(&GOOD).unwrap() > 0.99);
}

#[test]
fn a_weight_that_is_not_finite_falls_back_and_restarts_from_the_initial_weights() {
    let mut m = LearnedModel::new(cfg(r#"{"updateIntervalMs":1000}"#), 0);
    let w0 = m.weights();
    m.push(feat([f64::NAN, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], 0.5), 1.0);
    let r = m.update(1_000, &[GOOD]);
    assert_eq!(r.fallback, Some(Fallback::NotFinite));
    assert_eq!(m.predict(&GOOD), None, "the static score applies");
    assert_eq!(m.weights(), w0);
    // The next sound update lifts it.
    m.push(GOOD, 0.9);
    assert_eq!(m.update(2_000, &[GOOD]).fallback, None);
    assert!(m.predict(&GOOD).is_some());
}

#[test]
fn an_all_zero_output_falls_back() {
    let mut m = LearnedModel::new(
        cfg(
            r#"{"updateIntervalMs":1000,"learningRate":1,"l2":0,"clip":20,"emaAlpha":1,"maxPendingSamples":65536}"#,
        ),
        0,
    );
    // Every request of every pod fails, and every pod reads the same (good terms, seen at the
    // pool's TTFT): the corrections sink until no pod scores.
    let good = feat([0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.0], 0.5);
    for _ in 0..60_000 {
        m.push(good, 0.0);
    }
    let r = m.update(1_000, &[good]);
    assert_eq!(r.fallback, Some(Fallback::AllZero), "{:?}", m.weights());
    assert_eq!(m.predict(&good), None);
}

#[test]
fn a_loss_diverging_three_updates_in_a_row_falls_back() {
    let mut m = LearnedModel::new(cfg(r#"{"updateIntervalMs":1000}"#), 0);
    // The static formula scores the pod 0.95; every request of it fails.
    let good = feat([0.5; 7], 0.95);
    for k in 1..=3u64 {
        for _ in 0..10 {
            m.push(good, 0.0);
        }
        let r = m.update(1_000 * k, &[good]);
        assert!(r.mse.unwrap() > learned::DIVERGE_MSE);
        let want = (k == 3).then_some(Fallback::Diverging);
        assert_eq!(r.fallback, want, "update {k}");
    }
    assert_eq!(m.predict(&good), None);
    // One update no worse than a constant guess lifts it.
    for _ in 0..10 {
        m.push(good, 0.9);
    }
    assert_eq!(m.update(4_000, &[good]).fallback, None);
}

#[test]
fn the_target_is_the_outcome_against_the_slos_and_a_failure_is_zero() {
    let m = LearnedModel::new(cfg(r#"{"ttftSloMs":2000,"e2eSloMs":30000}"#), 0);
    assert_eq!(m.target(true, Some(10), Some(10)), Some(0.0));
    assert_eq!(m.target(false, Some(500), Some(15_000)), Some(0.625));
    assert_eq!(m.target(false, None, Some(15_000)), Some(0.5));
    assert_eq!(m.target(false, Some(4_000), Some(90_000)), Some(0.0));
    assert_eq!(m.target(false, None, None), None);
}

#[test]
fn the_pending_ring_is_bounded() {
    let mut m = LearnedModel::new(cfg(r#"{"maxPendingSamples":16}"#), 0);
    let kept: Vec<bool> = (0..20).map(|_| m.push(GOOD, 1.0)).collect();
    assert_eq!(kept.iter().filter(|k| !**k).count(), 4);
    assert_eq!(m.pending(), 16);
}

#[test]
fn features_are_the_static_terms_error_rate_speed_and_observed_ttft() {
    let t = ai_lb_filter_core::score::Terms {
        gpu: Some(0.8),
        queue: Some(1.0),
        p99: None,
        memory: Some(0.25),
    };
    let f = learned::features(&t, Some(0.1), Some(2.0), Some(4.0), 0.75);
    let want = [0.3, 0.5, 0.0, -0.25, 0.4, 0.0, -(4.0_f64.ln())];
    for (a, b) in f.x.iter().zip(want) {
        assert!((a - b).abs() < 1e-12, "{f:?}");
    }
    assert!((f.offset - 3.0_f64.ln()).abs() < 1e-12, "logit of 0.75");
    // Faster than the median counts as the median; NaN counts as missing; an observed TTFT
    // at or under the median is 0, and one 100 times it is held at -3.
    let f = learned::features(&t, Some(f64::NAN), Some(0.5), Some(0.5), 0.5);
    assert_eq!(f.x[4], 0.0);
    assert_eq!(f.x[5], 0.5);
    assert_eq!(f.x[6], 0.0);
    assert_eq!(f.offset, 0.0);
    let f = learned::features(&t, None, None, Some(100.0), f64::NAN);
    assert_eq!(f.x[6], learned::TTFT_FEATURE_MIN);
    assert_eq!(f.offset, 0.0, "a score that is not finite is no offset");
    assert!(learned::features(&t, None, None, None, 0.0).offset < -6.0);
}

#[test]
fn weight_gauges_are_offset_milli_units() {
    assert_eq!(learned::gauge_value(0.0), 1_000_000);
    assert_eq!(learned::gauge_value(-5.0), 995_000);
    assert_eq!(learned::gauge_value(1.2345), 1_001_235);
    assert_eq!(learned::gauge_value(f64::NAN), 1_000_000);
}

#[test]
fn config_errors_name_the_field_and_value() {
    let bad = [
        (r#"{"learningRate":0}"#, "learnedWeights.learningRate"),
        (r#"{"learningRate":1.5}"#, "learnedWeights.learningRate"),
        (r#"{"l2":1}"#, "learnedWeights.l2"),
        (r#"{"clip":0}"#, "learnedWeights.clip"),
        (r#"{"clip":101}"#, "learnedWeights.clip"),
        (
            r#"{"updateIntervalMs":999}"#,
            "learnedWeights.updateIntervalMs",
        ),
        (r#"{"emaAlpha":0}"#, "learnedWeights.emaAlpha"),
        (r#"{"floor":0.6}"#, "learnedWeights.floor"),
        (r#"{"ttftSloMs":0}"#, "learnedWeights.ttftSloMs"),
        (r#"{"e2eSloMs":0}"#, "learnedWeights.e2eSloMs"),
        (
            r#"{"maxPendingSamples":8}"#,
            "learnedWeights.maxPendingSamples",
        ),
    ];
    for (section, path) in bad {
        let json =
            format!(r#"{{"pools":[{{"name":"p","cluster":"c"}}],"learnedWeights":{section}}}"#);
        let e = FilterConfig::from_json(json.as_bytes()).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains(path), "{section}: {msg}");
    }
    let json = r#"{"pools":[{"name":"p","cluster":"c"}],"learnedWeights":{"learningrate":0.1}}"#;
    assert!(
        FilterConfig::from_json(json.as_bytes()).is_err(),
        "unknown field"
    );
    // Absent: off. `{}`: on with the defaults.
    let off = FilterConfig::from_json(br#"{"pools":[{"name":"p","cluster":"c"}]}"#).unwrap();
    assert_eq!(off.learned_weights, None);
    let on =
        FilterConfig::from_json(br#"{"pools":[{"name":"p","cluster":"c"}],"learnedWeights":{}}"#)
            .unwrap();
    assert_eq!(on.learned_weights, Some(LearnedWeights::default()));
}

// ----- in the router -----

fn addr(i: usize) -> String {
    format!("10.0.0.{}:8000", i + 1)
}

/// One pod's readings: SM occupancy, TTFT p99 (ms), agent error rate.
#[derive(Clone, Copy)]
struct Pod {
    gpu: f64,
    p99: f64,
    err: f64,
}

fn event(seq: u64, pods: &[Pod]) -> PoolEvent {
    PoolEvent {
        full: true,
        peers: pods
            .iter()
            .enumerate()
            .map(|(i, p)| PeerState {
                peer: format!("agent-{i}:9090"),
                status: PeerStatus::Live as i32,
                snapshot: Some(PodSnapshot {
                    identity: Some(PodIdentity {
                        address: addr(i),
                        pod_name: format!("pod-{i}"),
                        ..Default::default()
                    }),
                    gpus: vec![GpuStats {
                        utilization: Some(1.0),
                        sm_occupancy: Some(p.gpu),
                        ..Default::default()
                    }],
                    inference: Some(InferenceStats {
                        waiting: Some(0),
                        running: Some(1),
                        queue_capacity: Some(8),
                        kv_cache_usage: Some(0.2),
                        error_rate: Some(p.err),
                        request_rate: Some(10.0),
                        window_ms: 10_000,
                        ttft: Some(LatencyQuantiles {
                            p99_ms: Some(p.p99),
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

fn router(learned: Option<&str>, pods: &[Pod]) -> Router {
    let section = learned.map_or(String::new(), |l| format!(r#","learnedWeights":{l}"#));
    let cfg = FilterConfig::from_json(
        format!(
            r#"{{"pools":[{{"name":"p","cluster":"c"}}],"minPods":1,"emaAlpha":1,
            "floorWeight":0,"pickStrategy":"proportional",
            "breaker":{{"consecutiveFailures":3,"baseCooldownMs":60000}}{section}}}"#
        )
        .as_bytes(),
    )
    .unwrap();
    let mut r = Router::new(cfg);
    r.apply_pool_event(0, &event(1, pods), 1_000);
    r.tick(1_000);
    r
}

fn ok(ttft: u64, total: u64) -> Outcome {
    Outcome {
        status: Some(200),
        ttft_ms: Some(ttft),
        total_ms: Some(total),
        ..Default::default()
    }
}

fn row(r: &Router, i: usize, now: u64) -> (f64, Option<f64>, u32) {
    let s = r.pod_status(0, now);
    let p = s.iter().find(|p| p.address == addr(i)).unwrap();
    (p.raw, p.learned, p.learned_samples)
}

fn shares(r: &mut Router, n: usize, now: u64) -> Vec<usize> {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let mut c = vec![0; n];
    for _ in 0..10_000 {
        if let Decision::Steer { ranked, .. } = r.decide(0, None, now, &mut rng) {
            let a = r.address(0, &ranked, ranked.first().unwrap()).unwrap();
            c[(0..n).position(|i| addr(i) == a).unwrap()] += 1;
        }
    }
    c
}

const SAME: Pod = Pod {
    gpu: 0.3,
    p99: 500.0,
    err: 0.0,
};

#[test]
fn a_pod_keeps_its_static_score_until_30_samples() {
    let mut r = router(
        Some(r#"{"updateIntervalMs":1000,"learningRate":0.5}"#),
        &[SAME, SAME],
    );
    let (static_raw, _, _) = row(&r, 0, 1_000);
    // Pod 1's slow outcomes train the model, so its score for pod 0 moves off the static one.
    for _ in 0..200 {
        r.on_outcome(0, &addr(1), None, &ok(1_900, 29_000), 1_000);
    }
    r.apply_pool_event(0, &event(2, &[SAME, SAME]), 2_000);
    r.tick(2_000);
    let (_, learned, n) = row(&r, 0, 2_000);
    assert_eq!(n, 0);
    assert!(
        (learned.unwrap() - static_raw).abs() > 1e-3,
        "distinguishable: {learned:?} against {static_raw}"
    );
    for k in 0..30u64 {
        r.on_outcome(0, &addr(0), None, &ok(100, 1_000), 2_000);
        // A new snapshot re-scores the pool (the model's next update is not due yet).
        r.apply_pool_event(0, &event(3 + k, &[SAME, SAME]), 2_001 + k);
        r.tick(2_001 + k);
        let (raw, l, n) = row(&r, 0, 2_001 + k);
        assert_eq!(n as u64, k + 1);
        if k + 1 < 30 {
            assert_eq!(raw, static_raw, "cold at {n} samples");
        } else {
            assert_eq!(Some(raw), l, "learned at {n} samples");
            assert_ne!(raw, static_raw);
        }
    }
    assert_eq!(r.counters().learned_samples, 230);
}

#[test]
fn the_model_learns_to_avoid_a_pod_whose_latency_rises_with_no_gpu_signal() {
    // Pod 1 reads an idle GPU but its TTFT p99 is 3.5 s; pod 0 is busier and fast. The static
    // formula prefers pod 1 (GPU weighs 0.35, p99 0.25); its outcomes are slow.
    let pods = [
        Pod {
            gpu: 0.6,
            p99: 200.0,
            err: 0.0,
        },
        Pod {
            gpu: 0.05,
            p99: 3_500.0,
            err: 0.0,
        },
    ];
    let mut stat = router(None, &pods);
    let s = shares(&mut stat, 2, 1_000);
    assert!(s[1] > s[0], "static prefers the slow pod: {s:?}");
    let mut r = router(Some(r#"{"updateIntervalMs":1000,"seed":1}"#), &pods);
    let mut now = 1_000;
    for k in 0..60u64 {
        for _ in 0..100 {
            r.on_outcome(0, &addr(0), None, &ok(150, 3_000), now);
            r.on_outcome(0, &addr(1), None, &ok(1_900, 20_000), now);
        }
        now += 1_000;
        r.apply_pool_event(0, &event(2 + k, &pods), now);
        r.tick(now);
    }
    assert!(r.counters().learned_updates >= 59, "{:?}", r.counters());
    let m = r.learned_model(0).unwrap();
    assert_eq!(m.fallback(), None);
    let w = m.weights();
    assert!(w[2] > w[0], "p99 outweighs the GPU now: {w:?}");
    let s = shares(&mut r, 2, now);
    assert!(
        s[0] > 2 * s[1],
        "learned moves traffic off the slow pod: {s:?}"
    );
    // The status page shows the weights by name.
    let j = scoreboard(&r, now);
    let l = &j["pools"][0]["learned"];
    assert_eq!(l["weights"]["p99"].as_f64(), Some(w[2]));
    assert!(l["fallback"].is_null());
    assert_eq!(
        j["counters"]["learned.updates"],
        r.counters().learned_updates
    );
}

#[test]
fn cut_offs_and_breakers_stay_outside_the_model() {
    let mut pods = [SAME, SAME];
    let mut r = router(
        Some(r#"{"updateIntervalMs":1000,"coldStartSamples":0}"#),
        &pods,
    );
    // Pod 1 fails over half its requests at its agent: its breaker opens (agentErrorRate),
    // however the model scores it.
    pods[1].err = 0.6;
    r.apply_pool_event(0, &event(2, &pods), 2_000);
    r.tick(2_000);
    let (_, learned, _) = row(&r, 1, 2_000);
    assert!(learned.unwrap() > 0.1, "the model still scores it");
    let st = r.pod_status(0, 2_000);
    assert_eq!(st[1].breaker, BreakerState::Open);
    assert_eq!(shares(&mut r, 2, 2_000)[1], 0);
    // Pod 0: three failed requests in a row open its breaker too; the model does not help it.
    let mut r = router(
        Some(r#"{"updateIntervalMs":1000,"coldStartSamples":0}"#),
        &[SAME, SAME],
    );
    for _ in 0..3 {
        let fail = Outcome {
            status: Some(503),
            ..Default::default()
        };
        r.on_outcome(0, &addr(0), None, &fail, 1_500);
    }
    assert_eq!(r.pod_status(0, 1_500)[0].breaker, BreakerState::Open);
    assert!(row(&r, 0, 1_500).1.unwrap() > 0.1);
    assert_eq!(shares(&mut r, 2, 1_500)[0], 0);
}

#[test]
fn a_degenerate_model_falls_back_to_the_static_score_and_is_counted() {
    let mut r = router(
        Some(r#"{"updateIntervalMs":1000,"coldStartSamples":0}"#),
        &[SAME, SAME],
    );
    let static_raw = router(None, &[SAME, SAME]).pod_status(0, 1_000)[0].raw;
    assert!(
        static_raw > 0.6,
        "the static formula rates both pods well: {static_raw}"
    );
    let mut now = 1_000;
    // Every request takes far past both SLOs (target 0) from pods the static formula rates
    // well: at the default learning rate the loss stays over 0.25, three updates in a row.
    for k in 0..3u64 {
        for i in 0..2 {
            for _ in 0..10 {
                r.on_outcome(0, &addr(i), None, &ok(100_000, 100_000), now);
            }
        }
        now += 1_000;
        r.apply_pool_event(0, &event(2 + k, &[SAME, SAME]), now);
        r.tick(now);
    }
    assert_eq!(
        r.learned_model(0).unwrap().fallback(),
        Some(Fallback::Diverging)
    );
    assert_eq!(r.counters().learned_fallback_diverging, 1);
    // The pods are scored by the static formula meanwhile.
    r.apply_pool_event(0, &event(100, &[SAME, SAME]), now + 1);
    r.tick(now + 1);
    let (raw, learned, _) = row(&r, 0, now + 1);
    assert_eq!(learned, None);
    assert_eq!(raw, static_raw);
    let j = scoreboard(&r, now + 1);
    assert_eq!(j["pools"][0]["learned"]["fallback"], "diverging");
}

#[test]
fn absent_the_section_changes_nothing() {
    let pods = [
        SAME,
        Pod {
            gpu: 0.8,
            p99: 100.0,
            err: 0.0,
        },
    ];
    let mut r = router(None, &pods);
    for _ in 0..100 {
        r.on_outcome(0, &addr(0), None, &ok(100, 1_000), 1_000);
    }
    assert!(r.learned_model(0).is_none());
    assert_eq!(row(&r, 0, 1_000).1, None);
    assert_eq!(r.counters().learned_samples, 0);
    let j = scoreboard(&r, 1_000);
    assert!(j["pools"][0]["learned"].is_null());
}

/// A request trains the model on the pod's features as its pick saw them, not as they are
/// when it ends: a pod that was idle at the pick and busy by the end teaches "idle → this
/// outcome", exactly as a pod that stayed idle does.
#[test]
fn an_outcome_trains_on_the_features_its_pick_saw() {
    const IDLE: Pod = Pod {
        gpu: 0.1,
        p99: 200.0,
        err: 0.0,
    };
    const BUSY: Pod = Pod {
        gpu: 0.9,
        p99: 1_800.0,
        err: 0.0,
    };
    let cfg = r#"{"updateIntervalMs":1000,"coldStartSamples":0}"#;
    // Picked while idle; busy (a new snapshot) when its outcome arrives.
    let mut moved = router(Some(cfg), &[IDLE, IDLE]);
    let picked = moved
        .learned_features(0, &addr(0))
        .expect("features at the pick");
    moved.apply_pool_event(0, &event(2, &[BUSY, IDLE]), 1_100);
    moved.tick(1_100);
    assert_ne!(
        moved.learned_features(0, &addr(0)),
        Some(picked),
        "the pod's features moved"
    );
    // The same outcome on a pod that stayed idle, and on the busy pod without the pick's.
    let mut stayed = router(Some(cfg), &[IDLE, IDLE]);
    let mut latest = router(Some(cfg), &[IDLE, IDLE]);
    latest.apply_pool_event(0, &event(2, &[BUSY, IDLE]), 1_100);
    latest.tick(1_100);
    for _ in 0..20 {
        moved.on_outcome_picked(0, &addr(0), None, &ok(1_500, 9_000), 1_200, Some(picked));
        stayed.on_outcome(0, &addr(0), None, &ok(1_500, 9_000), 1_200);
        latest.on_outcome(0, &addr(0), None, &ok(1_500, 9_000), 1_200);
    }
    for r in [&mut moved, &mut stayed, &mut latest] {
        r.tick(2_100);
    }
    let w = |r: &Router| r.learned_model(0).unwrap().weights();
    assert_eq!(w(&moved), w(&stayed), "trained on the pick's features");
    assert_ne!(w(&moved), w(&latest), "not on the features at the outcome");
}

/// A pod whose answers come late for a reason none of its metrics shows (its API server's CPU
/// starved, say) reads like the others to the static formula; only this sidecar's observed
/// TTFT tells it apart, and the model learns to weigh that.
#[test]
fn the_model_learns_from_the_observed_ttft_what_no_metric_shows() {
    let pods = [SAME; 4];
    let cfg = r#"{"updateIntervalMs":1000,"learningRate":0.05,"ttftSloMs":1000,"e2eSloMs":10000,"seed":3}"#;
    let mut stat = router(None, &pods);
    let s = shares(&mut stat, 4, 1_000);
    assert!(
        s.iter().all(|n| (2_000..3_000).contains(n)),
        "static shares evenly: {s:?}"
    );
    let mut r = router(Some(cfg), &pods);
    let mut now = 1_000;
    for k in 0..30u64 {
        for _ in 0..20 {
            r.on_outcome(0, &addr(0), None, &ok(1_500, 4_000), now);
            for i in 1..4 {
                r.on_outcome(0, &addr(i), None, &ok(150, 2_500), now);
            }
        }
        now += 1_000;
        r.apply_pool_event(0, &event(2 + k, &pods), now);
        r.tick(now);
    }
    let m = r.learned_model(0).unwrap();
    assert_eq!(m.fallback(), None);
    let w = m.weights();
    assert!(w[6] > 0.5, "the ttft weight grew: {w:?}");
    let st = r.pod_status(0, now);
    assert!(
        st[0].learned.unwrap() < 0.5 * st[1].learned.unwrap(),
        "{:?} {:?}",
        st[0].learned,
        st[1].learned
    );
    let s = shares(&mut r, 4, now);
    assert!(
        s[0] * 2 < s[1],
        "learned moves traffic off the slow pod: {s:?}"
    );
    // A pod the pool stopped hearing from is not judged on old outcomes for ever: 30 s on,
    // its observed TTFT no longer counts.
    let quiet = now + 31_000;
    r.apply_pool_event(0, &event(100, &pods), quiet);
    r.tick(quiet);
    assert_eq!(r.learned_features(0, &addr(0)).unwrap().x[6], 0.0);
}

/// A pod seen slower never scores higher for it: the `ttft` weight stays at 0 or above
/// however the outcomes fall.
#[test]
fn the_ttft_weight_never_goes_negative() {
    let mut m = LearnedModel::new(
        cfg(r#"{"updateIntervalMs":1000,"learningRate":1,"emaAlpha":1}"#),
        0,
    );
    // Pods seen slow end well, pods seen fast end badly: unbounded, the weight would sink.
    let slow_seen = feat([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -2.0], 0.5);
    let fast_seen = feat([0.0; 7], 0.5);
    for _ in 0..500 {
        m.push(slow_seen, 1.0);
        m.push(fast_seen, 0.0);
    }
    m.update(1_000, &[slow_seen, fast_seen]);
    assert_eq!(m.fallback(), None);
    assert_eq!(m.weights()[learned::TTFT], 0.0, "{:?}", m.weights());
    assert!(m.predict(&slow_seen).unwrap() <= m.predict(&fast_seen).unwrap() + 1e-12);
}
