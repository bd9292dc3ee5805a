//! Decides whether a frozen model server is cut while its GPU still reads idle: three fake pods
//! with agents behind a real Envoy; the pod with the coolest GPU freezes its API server (every
//! request and `/metrics` held, `/sim/gpu` still answering, as a wedged vLLM on a live GPU).
//! Its agent reports the model-server source failing, the filter cuts the pod, counts it, and
//! sends it nothing until it answers again.

mod filter_common;

use std::time::{Duration, Instant};

use filter_common::*;
use serde_json::json;

#[test]
fn a_frozen_model_server_is_cut_and_back_in_rotation_once_it_answers() {
    let pool = ai_lb_e2e::envoy::PodPool::start(3, 0.01).unwrap();
    // The frozen pod's GPU reads idle throughout: the best score, if nothing else is known.
    pool.control(0, r#"{"sm_occupancy":0.0}"#).unwrap();
    for i in 1..3 {
        pool.control(i, r#"{"sm_occupancy":0.5}"#).unwrap();
    }
    let envoy = envoy_for(&pool, config(json!({})));
    let frozen = pool.pod_addrs[0].to_string();
    wait_scoreboard(&envoy, "every pod fresh", 30, |sb| all_fresh(sb, &pool));
    let before = count_served(&envoy, 60, &[]);
    assert!(
        before.get("pod0").copied().unwrap_or(0) > 20,
        "the idle pod should lead before the freeze: {before:?}"
    );
    assert_eq!(envoy.stat("wasmcustom.ailb.model_server_down").unwrap(), 0);

    pool.control(0, r#"{"freeze":true}"#).unwrap();
    let frozen_at = Instant::now();
    let sb = wait_scoreboard(&envoy, "the frozen pod cut", 20, |sb| {
        row(sb, &frozen).is_some_and(|r| r["cut"] == "model_server_down")
    });
    let cut_after = frozen_at.elapsed();
    // Only its model server failed: the pod still has fresh metrics (its GPU), not stale ones.
    assert!(
        row(&sb, &frozen).unwrap()["metricsAgeMs"]
            .as_u64()
            .is_some_and(|a| a < 1000),
        "{sb:#}"
    );
    let during = count_served(&envoy, 200, &[]);
    assert_eq!(
        during.get("pod0"),
        None,
        "the frozen pod was sent requests: {during:?}; {}",
        decision_stats(&envoy)
    );
    assert_eq!(during.values().sum::<usize>(), 200);
    let counted = wait_stat(&envoy, "wasmcustom.ailb.model_server_down", |v| v >= 1);
    assert_eq!(counted, 1, "one outage, counted once");
    eprintln!("cut {} ms after the freeze", cut_after.as_millis());

    pool.control(0, r#"{"freeze":false}"#).unwrap();
    wait_scoreboard(&envoy, "the pod back in rotation", 20, |sb| {
        row(sb, &frozen).is_some_and(|r| r["cut"].is_null())
    });
    envoy
        .poll(
            Duration::from_secs(10),
            "the thawed pod serves again",
            || {
                let after = count_served(&envoy, 30, &[]);
                (after.get("pod0").copied().unwrap_or(0) > 5).then_some(())
            },
        )
        .unwrap();
    assert_eq!(
        envoy.stat("wasmcustom.ailb.model_server_down").unwrap(),
        1,
        "one outage, counted once"
    );
    assert!(
        !envoy.wasm_failed(),
        "wasm trapped:\n{}",
        envoy.log_tail(40)
    );
}
