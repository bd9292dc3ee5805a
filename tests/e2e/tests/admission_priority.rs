//! Decides whether priority classes shed in order under saturation in a real Envoy: with every
//! pod forced above the GPU limit, a sheddable request gets 429 at once, a standard one is held
//! (paused in the worker's queue) and gets 503 after the maximum wait, a critical one goes to a
//! pod; a held standard request is released and served as soon as a pod cools down.

mod filter_common;

use std::thread;
use std::time::{Duration, Instant};

use ai_lb_e2e::envoy::{Envoy, HttpClient, PodPool};
use filter_common::*;
use serde_json::{json, Value};

const MAX_WAIT_MS: u64 = 2_500;
const BODY: &str = r#"{"prompt":"hello there","max_tokens":4}"#;

fn stat(envoy: &Envoy, name: &str) -> u64 {
    envoy
        .stat(&format!("wasmcustom.ailb.admission.{name}"))
        .unwrap_or(0)
}

fn send(addr: std::net::SocketAddr, class: &str) -> (u16, Duration, ai_lb_e2e::envoy::Response) {
    let t = Instant::now();
    let r = HttpClient::new(addr)
        .post_json("/v1/completions", &[("x-ai-lb-priority", class)], BODY)
        .unwrap();
    (r.status, t.elapsed(), r)
}

#[test]
fn under_saturation_sheddable_is_shed_standard_waits_critical_proceeds() {
    let pool = PodPool::start(2, 0.01).unwrap();
    for i in 0..2 {
        pool.control(i, r#"{"sm_occupancy":0.97}"#).unwrap();
    }
    let envoy = envoy_for(
        &pool,
        config(json!({
            "admission": {
                // The classes come from the header, so it is trusted here (as if a filter in
                // front set it); by default a client's claim is dropped (issue 31).
                "trustedHeaders": ["x-ai-lb-priority"],
                "tenants": {"default": {"tokensPerSecond": 1000000, "burst": 1000000}},
                "saturation": {"softThreshold": 0.85, "maxWaitStandardMs": MAX_WAIT_MS, "retryAfterSeconds": 3}
            }
        })),
    );
    let hot = |sb: &Value| {
        all_fresh(sb, &pool)
            && pool
                .pod_addrs
                .iter()
                .all(|a| row(sb, &a.to_string()).is_some_and(|r| r["cut"] == "gpu_hard_limit"))
    };
    wait_scoreboard(&envoy, "both pods cut (saturated)", 30, hot);

    // Sheddable: 429 at once.
    let (status, took, r) = send(envoy.listener, "sheddable");
    assert_eq!(status, 429, "{}", r.text());
    assert_eq!(r.header("retry-after"), Some("3"));
    let e: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(e["error"]["code"], "shed_under_saturation", "{e}");
    assert!(
        took < Duration::from_millis(MAX_WAIT_MS / 2),
        "shed took {took:?}"
    );

    // Critical: served by a pod despite saturation.
    let (status, _, r) = send(envoy.listener, "critical");
    assert_eq!(status, 200, "{}", r.text());

    // Standard: held for the maximum wait, then 503.
    let (status, took, r) = send(envoy.listener, "standard");
    assert_eq!(status, 503, "{}", r.text());
    assert_eq!(r.header("retry-after"), Some("3"));
    assert!(
        took >= Duration::from_millis(MAX_WAIT_MS - 100),
        "503 after {took:?}, before the maximum wait"
    );
    let e: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(e["error"]["code"], "saturated", "{e}");
    assert_eq!(r.header("x-fake-pod"), None);
    println!("standard request held {took:?} then 503 (max wait {MAX_WAIT_MS} ms)");

    // A held standard request is released when a pod cools down.
    let held_before = stat(&envoy, "held");
    let addr = envoy.listener;
    let waiter = thread::spawn(move || send(addr, "standard"));
    envoy
        .poll(Duration::from_secs(5), "the request is held", || {
            (stat(&envoy, "held") > held_before).then_some(())
        })
        .unwrap();
    pool.control(1, r#"{"sm_occupancy":0.3}"#).unwrap();
    let (status, took, r) = waiter.join().unwrap();
    assert_eq!(status, 200, "{}", r.text());
    assert_eq!(
        r.header("x-fake-pod"),
        Some("pod1"),
        "steered to the cool pod"
    );
    assert!(
        took < Duration::from_millis(MAX_WAIT_MS),
        "released after {took:?}"
    );
    println!("held standard request released and served by the cooled pod after {took:?}");

    let counts = [
        ("shed", stat(&envoy, "shed")),
        ("held_expired", stat(&envoy, "held_expired")),
        ("held_released", stat(&envoy, "held_released")),
        (
            "critical.saturated_proceed",
            stat(&envoy, "tenant.default.critical.saturated_proceed"),
        ),
    ];
    for (name, v) in counts {
        assert_eq!(v, 1, "{name}: {}", decision_stats(&envoy));
    }
    // Shed and expired requests reserved nothing in the end.
    envoy
        .poll(Duration::from_secs(5), "all settled", || {
            (stat(&envoy, "settled") >= 4).then_some(())
        })
        .unwrap();
    assert!(
        !envoy.wasm_failed(),
        "wasm trapped:\n{}",
        envoy.log_tail(40)
    );
}
