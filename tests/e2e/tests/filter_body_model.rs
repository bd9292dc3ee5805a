//! Decides whether the model can come from the JSON body: with `modelHeader` configured but
//! absent, the filter pauses in the headers phase, reads the body's `model` at end of stream,
//! steers, and lets the request continue (no hang); a model no pod serves is not steered.

mod filter_common;

use std::time::{Duration, Instant};

use ai_lb_e2e::envoy::HttpClient;
use filter_common::*;
use serde_json::json;

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

#[test]
fn the_body_model_is_used_for_picking_without_hanging_the_request() {
    let pool = ai_lb_e2e::envoy::PodPool::start(2, 0.01).unwrap();
    let envoy = envoy_for(&pool, config(json!({"modelHeader": "x-ai-lb-model"})));
    wait_scoreboard(&envoy, "every pod fresh", 30, |sb| all_fresh(sb, &pool));
    let mut client = HttpClient::new(envoy.listener);
    let body =
        |model: &str| json!({"model": model, "prompt": "hello", "max_tokens": 4}).to_string();

    let t0 = Instant::now();
    let r = client
        .post_json("/v1/completions", &[("x-ai-lb-debug", "1")], &body(MODEL))
        .unwrap();
    assert!(t0.elapsed() < Duration::from_secs(10), "the request hung");
    assert_eq!(r.status, 200, "{}", r.text());
    let debug = r.header("x-ai-lb-debug").unwrap_or_default().to_string();
    let served = pool
        .pod_addrs
        .iter()
        .map(|a| a.to_string())
        .find(|a| debug.starts_with(&format!("pod={a};")));
    assert!(
        served.is_some(),
        "not steered by the body's model: {debug:?}"
    );

    // An unserved model in the body is not steered (so the body really was read); the pod
    // then answers 404 for it.
    let r = client
        .post_json(
            "/v1/completions",
            &[("x-ai-lb-debug", "1")],
            &body("other-model"),
        )
        .unwrap();
    assert_eq!(r.status, 404, "{}", r.text());
    assert_eq!(r.header("x-ai-lb-debug"), Some("pod=none; fallback"));

    // The header wins over the body, and a model nobody serves is not steered.
    let r = client
        .post_json(
            "/v1/completions",
            &[("x-ai-lb-debug", "1"), ("x-ai-lb-model", "no-such-model")],
            &body(MODEL),
        )
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-ai-lb-debug"), Some("pod=none; fallback"));
    envoy
        .poll(Duration::from_secs(5), "fallback.no_model counted", || {
            (envoy.stat("wasmcustom.ailb.fallback.no_model").ok()? > 0).then_some(())
        })
        .unwrap();
    assert!(
        !envoy.wasm_failed(),
        "wasm trapped:\n{}",
        envoy.log_tail(40)
    );
}
