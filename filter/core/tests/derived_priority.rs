//! Decides whether priority derived from the request (`admission.derivedPriority`) and the
//! latency-aware quota (`admission.latencyAwareQuota`) compute the issue's formulas: the score
//! at known points, the tier boundaries 0.7 and 0.92, the log scale of the prompt, the
//! temperature clamp and its default for a body without one, the quota's clamp to 64..=2048 and
//! its scale against τ, and that each bad value is refused naming its field and value.

use ai_lb_filter_core::admission::derived::{DerivedPriority, ScoreInputs, Tier};
use ai_lb_filter_core::admission::quota::{LatencyQuota, QuotaEffect};
use ai_lb_filter_core::admission::AdmissionConfig;
use serde_json::json;

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

fn x(prompt_units: u64, output_tokens: u64, temperature: Option<f64>) -> ScoreInputs {
    ScoreInputs {
        prompt_units,
        output_tokens,
        temperature,
    }
}

#[test]
fn off_unless_present_and_the_issues_figures_are_the_defaults() {
    let off = AdmissionConfig::from_value(&json!({})).unwrap();
    assert_eq!(off.derived_priority, None);
    assert_eq!(off.latency_quota, None);
    let on = AdmissionConfig::from_value(&json!({"derivedPriority": {}, "latencyAwareQuota": {}}))
        .unwrap();
    let d = on.derived_priority.unwrap();
    assert_eq!(d, DerivedPriority::default());
    assert_eq!(
        (d.weight_complexity, d.weight_output, d.weight_temperature),
        (0.4, 0.35, 0.25)
    );
    assert_eq!((d.ultra.min_score, d.ultra.max_held_ms), (0.92, 150));
    assert_eq!((d.high.min_score, d.high.max_held_ms), (0.7, 600));
    assert_eq!(d.temperature_floor, 0.1);
    let q = on.latency_quota.unwrap();
    assert_eq!(
        (q.exponent, q.min_tokens, q.max_tokens, q.slo_ms),
        (0.8, 64, 2048, 2000.0)
    );
    // Written back and read again: the same config.
    assert_eq!(AdmissionConfig::from_value(&on.to_value()).unwrap(), on);
}

#[test]
fn complexity_is_the_prompt_on_a_log_scale() {
    let d = DerivedPriority::default(); // 16 ..= 16384: ten doublings
    assert_eq!(d.complexity(0), 0.0);
    assert_eq!(d.complexity(16), 0.0);
    assert!(close(d.complexity(32), 0.1));
    assert!(close(d.complexity(512), 0.5));
    assert!(close(d.complexity(16_384), 1.0));
    assert_eq!(d.complexity(10_000_000), 1.0);
}

#[test]
fn output_and_temperature_terms_and_their_defaults() {
    let d = DerivedPriority::default();
    assert!(close(d.output(2_048), 0.5));
    assert_eq!(d.output(0), 0.0);
    assert_eq!(d.output(100_000), 1.0);
    // 1 - clamp(t, 0.1, 1).
    assert!(close(d.coolness(Some(0.0)), 0.9));
    assert!(close(d.coolness(Some(-3.0)), 0.9));
    assert!(close(d.coolness(Some(0.5)), 0.5));
    assert_eq!(d.coolness(Some(1.7)), 0.0);
    // No temperature (or a nonsense one) is the API default 1.0: term 0.
    assert_eq!(d.coolness(None), 0.0);
    assert_eq!(d.coolness(Some(f64::NAN)), 0.0);
}

#[test]
fn the_score_at_known_points() {
    let d = DerivedPriority::default();
    // Everything at its top: 0.4 + 0.35 + 0.25 * 0.9.
    assert!(close(d.score(&x(16_384, 4_096, Some(0.0))), 0.975));
    assert!(close(
        d.score(&x(512, 2_048, Some(0.5))),
        0.2 + 0.175 + 0.125
    ));
    // A short chat turn at the default temperature.
    assert!(close(d.score(&x(16, 256, None)), 0.35 * 256.0 / 4096.0));
    assert_eq!(d.score(&x(0, 0, None)), 0.0);
    // Weights are relative: doubled weights give the same score.
    let doubled = AdmissionConfig::from_value(&json!({"derivedPriority": {
        "weights": {"complexity": 0.8, "outputLength": 0.7, "temperature": 0.5}}}))
    .unwrap()
    .derived_priority
    .unwrap();
    assert!(close(doubled.score(&x(512, 2_048, Some(0.5))), 0.5));
    let halved = AdmissionConfig::from_value(&json!({"derivedPriority": {
        "weights": {"complexity": 0.2, "outputLength": 0.175, "temperature": 0.125}}}))
    .unwrap()
    .derived_priority
    .unwrap();
    assert!(close(halved.score(&x(512, 2_048, Some(0.5))), 0.5));
}

#[test]
fn tier_boundaries_are_inclusive_at_0_7_and_0_92() {
    let d = DerivedPriority::default();
    assert_eq!(d.tier(0.92), Tier::Ultra);
    assert_eq!(d.tier(0.919_999), Tier::High);
    assert_eq!(d.tier(0.7), Tier::High);
    assert_eq!(d.tier(0.699_999), Tier::Standard);
    assert_eq!(d.tier(1.0), Tier::Ultra);
    assert_eq!(d.tier(0.0), Tier::Standard);
    // Through the formula: a long, long-output, cold request is Ultra; the same at the
    // default temperature is High (0.75); a short one is Standard.
    assert_eq!(d.tier(d.score(&x(16_384, 4_096, Some(0.0)))), Tier::Ultra);
    assert_eq!(d.tier(d.score(&x(16_384, 4_096, None))), Tier::High);
    assert_eq!(d.tier(d.score(&x(64, 128, Some(0.0)))), Tier::Standard);
    // A High threshold at or above Ultra's leaves no High tier.
    let no_high = AdmissionConfig::from_value(&json!({"derivedPriority": {
        "high": {"minScore": 0.95}}}))
    .unwrap()
    .derived_priority
    .unwrap();
    assert_eq!(no_high.tier(0.93), Tier::Ultra);
    assert_eq!(no_high.tier(0.91), Tier::Standard);
}

#[test]
fn the_quota_scales_against_tau_and_clamps_to_64_and_2048() {
    let q = LatencyQuota::default();
    // Predicted = TTFT + output × inter-token latency.
    assert_eq!(
        LatencyQuota::predict_ms(Some(200.0), Some(20.0), 90),
        Some(2_000.0)
    );
    assert_eq!(LatencyQuota::predict_ms(Some(150.0), None, 0), Some(150.0));
    assert_eq!(LatencyQuota::predict_ms(None, Some(20.0), 90), None);
    assert_eq!(LatencyQuota::predict_ms(Some(200.0), None, 90), None);
    assert_eq!(
        LatencyQuota::predict_ms(Some(f64::NAN), Some(20.0), 9),
        None
    );
    assert_eq!(LatencyQuota::predict_ms(Some(0.0), None, 0), None);
    // On the SLO: scale 1.
    assert!(close(q.scale(2_000.0).unwrap(), 1.0));
    assert_eq!(q.quota(500, 1.0), (500, QuotaEffect::Unchanged));
    // Twice the SLO: 0.5^0.8.
    let slow = q.scale(4_000.0).unwrap();
    assert!(close(slow, 0.5f64.powf(0.8)));
    assert_eq!(q.quota(500, slow), (287, QuotaEffect::ScaledDown));
    // Half the SLO: 2^0.8.
    let fast = q.scale(1_000.0).unwrap();
    assert_eq!(q.quota(500, fast), (871, QuotaEffect::ScaledUp));
    // The clamp.
    assert_eq!(q.quota(10, 1.0), (64, QuotaEffect::ClampedMin));
    assert_eq!(q.quota(0, 1.0), (64, QuotaEffect::ClampedMin));
    assert_eq!(q.quota(5_000, 1.0), (2_048, QuotaEffect::ClampedMax));
    assert_eq!(q.quota(2_000, fast), (2_048, QuotaEffect::ClampedMax));
    assert_eq!(q.quota(u64::MAX, 1.0), (2_048, QuotaEffect::ClampedMax));
    assert_eq!(q.scale(0.0), None);
    assert_eq!(q.scale(f64::INFINITY), None);
}

#[test]
fn bad_values_are_refused_naming_field_and_value() {
    for (cfg, path, value) in [
        (
            json!({"derivedPriority": {"weights": {"complexity": 1.5}}}),
            "admission.derivedPriority.weights.complexity",
            "1.5",
        ),
        (
            json!({"derivedPriority": {"weights": {"temperature": -0.1}}}),
            "admission.derivedPriority.weights.temperature",
            "-0.1",
        ),
        (
            json!({"derivedPriority": {"promptTokensMin": 0}}),
            "admission.derivedPriority.promptTokensMin",
            "0",
        ),
        (
            json!({"derivedPriority": {"promptTokensMax": 100}}),
            "admission.derivedPriority.promptTokensMax",
            "100",
        ),
        (
            json!({"derivedPriority": {"outputTokensFull": 0}}),
            "admission.derivedPriority.outputTokensFull",
            "0",
        ),
        (
            json!({"derivedPriority": {"temperatureFloor": 1.0}}),
            "admission.derivedPriority.temperatureFloor",
            "1",
        ),
        (
            json!({"derivedPriority": {"ultra": {"minScore": 0.0}}}),
            "admission.derivedPriority.ultra.minScore",
            "0",
        ),
        (
            json!({"derivedPriority": {"high": {"minScore": 1.2}}}),
            "admission.derivedPriority.high.minScore",
            "1.2",
        ),
        (
            json!({"derivedPriority": {"high": {"maxHeldMs": 60001}}}),
            "admission.derivedPriority.high.maxHeldMs",
            "60001",
        ),
        (
            json!({"latencyAwareQuota": {"sloMs": 0}}),
            "admission.latencyAwareQuota.sloMs",
            "0",
        ),
        (
            json!({"latencyAwareQuota": {"exponent": 0.0}}),
            "admission.latencyAwareQuota.exponent",
            "0",
        ),
        (
            json!({"latencyAwareQuota": {"minTokens": 0}}),
            "admission.latencyAwareQuota.minTokens",
            "0",
        ),
        (
            json!({"latencyAwareQuota": {"maxTokens": 100}}),
            "admission.latencyAwareQuota.maxTokens",
            "100",
        ),
    ] {
        let e = AdmissionConfig::from_value(&cfg).unwrap_err();
        assert_eq!(e.path, path, "{cfg}: {e}");
        assert_eq!(e.value, value, "{cfg}: {e}");
        assert!(e.to_string().contains(path), "{e}");
    }
    let e = AdmissionConfig::from_value(&json!({"derivedPriority": {
        "weights": {"complexity": 0.0, "outputLength": 0.0, "temperature": 0.0}}}))
    .unwrap_err();
    assert_eq!(e.path, "admission.derivedPriority.weights");
    assert!(e.reason.contains("above 0"), "{e}");
    let e = AdmissionConfig::from_value(&json!({"latencyAwareQuota": {"tau": 5}})).unwrap_err();
    assert!(e.path.starts_with("admission.latencyAwareQuota"), "{e}");
}
