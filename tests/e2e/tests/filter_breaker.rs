//! Decides whether passive feedback cuts a failing pod and readmits it: a fake pod answering
//! every request with 500 stops being picked after `breaker.consecutiveFailures` picks (the
//! route's retries hide its failures from the client), and once it recovers it is readmitted
//! through Half-Open.

mod filter_common;

use std::time::{Duration, Instant};

use ai_lb_e2e::envoy::HttpClient;
use filter_common::*;
use serde_json::json;

const FAILURES: u64 = 3;

#[test]
fn a_pod_returning_500s_is_cut_then_readmitted_through_half_open() {
    let pool = ai_lb_e2e::envoy::PodPool::start(3, 0.01).unwrap();
    for i in 0..3 {
        pool.control(i, r#"{"gpu_utilization":0.3}"#).unwrap();
    }
    let envoy = envoy_for(
        &pool,
        config(json!({
            "breaker": {"consecutiveFailures": FAILURES, "baseCooldownMs": 3000, "halfOpenProbes": 2}
        })),
    );
    let bad = pool.pod_addrs[0].to_string();
    wait_scoreboard(&envoy, "every pod fresh", 30, |sb| all_fresh(sb, &pool));
    let picks = |e: &ai_lb_e2e::envoy::Envoy| {
        e.stat(&format!("wasmcustom.ailb.endpoint.{bad}.picks"))
            .unwrap()
    };
    let opened = |e: &ai_lb_e2e::envoy::Envoy| {
        e.stat("wasmcustom.ailb.breaker_opened.server_errors")
            .unwrap()
    };

    pool.control(0, r#"{"error_rate":1.0}"#).unwrap();
    let before = picks(&envoy);
    let mut client = HttpClient::new(envoy.listener);
    let mut sent = 0;
    while opened(&envoy) == 0 {
        let (status, _) = complete(&mut client);
        assert_eq!(status, 200, "a retry should have hidden pod0's 500");
        sent += 1;
        assert!(
            sent < 300,
            "pod0's breaker never opened; log:\n{}",
            envoy.log_tail(30)
        );
    }
    let picked_while_failing = picks(&envoy) - before;
    eprintln!("breaker opened after {sent} requests; pod0 picked {picked_while_failing} times while failing");
    assert!(
        picked_while_failing <= FAILURES,
        "pod0 was picked {picked_while_failing} times before its breaker opened (limit {FAILURES})"
    );
    // While Open (3 s cooldown) pod0 gets nothing.
    let open_picks = picks(&envoy);
    let t0 = Instant::now();
    for _ in 0..30 {
        let (status, pod) = complete(&mut client);
        assert_eq!(status, 200);
        assert_ne!(pod, "pod0");
    }
    if t0.elapsed() < Duration::from_millis(2500) {
        assert_eq!(
            picks(&envoy),
            open_picks,
            "pod0 picked while its breaker was open"
        );
    }

    // Recovery: after the cooldown, Half-Open probes succeed and pod0 serves again.
    pool.control(0, r#"{"error_rate":0.0}"#).unwrap();
    let served_again = envoy.poll(Duration::from_secs(30), "pod0 readmitted", || {
        let (status, pod) = complete(&mut client);
        assert_eq!(status, 200);
        let closed = envoy.stat("wasmcustom.ailb.breaker_closed").unwrap_or(0) > 0;
        (closed && pod == "pod0").then_some(())
    });
    served_again.unwrap();
    assert!(envoy.stat("wasmcustom.ailb.breaker_half_opened").unwrap() >= 1);
    assert!(
        !envoy.wasm_failed(),
        "wasm trapped:\n{}",
        envoy.log_tail(40)
    );
}
