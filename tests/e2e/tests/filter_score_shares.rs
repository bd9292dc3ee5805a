//! Decides whether traffic follows the scores: two fake pods at 20% and 60% GPU, otherwise
//! equal (GPU-only weights), receive shares of 2000 requests within ±5 points of their score
//! ratio as the filter's scoreboard reports it.

mod filter_common;

use filter_common::*;
use serde_json::json;

#[test]
fn two_pods_get_shares_within_5_points_of_their_score_ratio() {
    let pool = ai_lb_e2e::envoy::PodPool::start(2, 0.01).unwrap();
    pool.control(0, r#"{"gpu_utilization":0.2}"#).unwrap();
    pool.control(1, r#"{"gpu_utilization":0.6}"#).unwrap();
    let envoy = envoy_for(&pool, config(json!({})));
    let (a, b) = (pool.pod_addrs[0].to_string(), pool.pod_addrs[1].to_string());
    let score = |sb: &serde_json::Value, addr: &str| {
        row(sb, addr)
            .and_then(|r| r["score"].as_f64())
            .unwrap_or(0.0)
    };
    let sb = wait_scoreboard(
        &envoy,
        "both pods fresh with their forced GPU load",
        30,
        |sb| {
            all_fresh(sb, &pool)
                && (score(sb, &a) - 0.8).abs() < 0.02
                && (score(sb, &b) - 0.4).abs() < 0.02
        },
    );
    let (sa, sb_) = (score(&sb, &a), score(&sb, &b));
    let expected = sa / (sa + sb_);

    let n = 2000;
    let served = count_served(&envoy, n, &[]);
    let got = *served.get("pod0").unwrap_or(&0) as f64 / n as f64;
    eprintln!(
        "scores {sa:.3}/{sb_:.3}: expected share {expected:.3}, got {got:.3} ({served:?}); {}",
        decision_stats(&envoy)
    );
    assert!(
        (got - expected).abs() <= 0.05,
        "pod0 share {got:.3} is not within 0.05 of its score share {expected:.3} ({served:?})"
    );
    assert!(
        !envoy.wasm_failed(),
        "wasm trapped:\n{}",
        envoy.log_tail(40)
    );
}
