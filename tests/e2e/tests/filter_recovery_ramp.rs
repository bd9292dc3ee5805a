//! Decides whether ramped recovery (`breaker.recoveryRamp`, issue 30) works in a real Envoy on
//! both data paths (the wasm filter and the native module share the core's breaker and picker):
//! a pod answering 500s is cut; once healed, its probe closes the breaker and the status page
//! shows its weight ramping (`ramp` below 1) before it returns whole; a pod that fails again
//! while it ramps is cut again on its first failure (`ailb.breaker_ramp_failures`), not after
//! `consecutiveFailures` (3 here).

mod filter_common;

use std::time::{Duration, Instant};

use ai_lb_e2e::envoy::{Envoy, HttpClient, PodPool};
use filter_common::*;
use serde_json::json;

const OPENED: &str = "ailb.breaker_opened.server_errors";
const CLOSED: &str = "ailb.breaker_closed";
const RAMP_FAILURES: &str = "ailb.breaker_ramp_failures";

/// One small completion on a connection of its own: status and serving pod.
fn fresh(envoy: &Envoy) -> (u16, String) {
    let r = HttpClient::new(envoy.listener)
        .post_json(
            "/v1/completions",
            &[("connection", "close")],
            r#"{"prompt":"hello there","max_tokens":4}"#,
        )
        .unwrap();
    (
        r.status,
        r.header("x-fake-pod").unwrap_or("none").to_string(),
    )
}

/// Sends requests until `done` holds (each answered 200: retries hide pod0's 500s), at most
/// `secs`.
fn drive_until(envoy: &Envoy, secs: u64, what: &str, mut done: impl FnMut(&Envoy) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !done(envoy) {
        let (status, _) = fresh(envoy);
        assert_eq!(status, 200, "{what}: a retry should have hidden pod0's 500");
        assert!(
            Instant::now() < deadline,
            "{what}: not within {secs} s; log:\n{}",
            envoy.log_tail(30)
        );
    }
}

fn ramp_of_pod0(envoy: &Envoy, pool: &PodPool) -> Option<f64> {
    row(&scoreboard(envoy), &pool.pod_addrs[0].to_string())
        .and_then(|r| r.get("ramp").and_then(|v| v.as_f64()))
}

fn a_healed_pod_ramps_back_and_one_failure_while_it_ramps_cuts_it_on(path: Path) {
    let pool = PodPool::start(3, 0.01).unwrap();
    for i in 0..3 {
        pool.control(i, r#"{"sm_occupancy":0.3}"#).unwrap();
    }
    let filter = config(json!({
        "breaker": {"consecutiveFailures": 3, "baseCooldownMs": 1000, "halfOpenProbes": 1,
                    "agentErrorRate": 0,
                    "recoveryRamp": {"steps": [0.2], "stepMs": 8000}}
    }));
    let envoy = path.start(&pool, &filter);
    wait_scoreboard(&envoy, "every pod fresh", 30, |sb| all_fresh(sb, &pool));

    // Cut on 500s, then healed: its probe closes the breaker, and its weight ramps.
    pool.control(0, r#"{"error_rate":1.0}"#).unwrap();
    drive_until(&envoy, 30, "pod0 cut", |e| path.stat(e, OPENED) >= 1);
    pool.control(0, r#"{"error_rate":0.0}"#).unwrap();
    drive_until(&envoy, 30, "pod0's probe closes its breaker", |e| {
        path.stat(e, CLOSED) >= 1
    });
    let ramp = ramp_of_pod0(&envoy, &pool);
    assert_eq!(ramp, Some(0.2), "{path:?}: pod0 just closed ramps at 0.2");

    // Failing again while it ramps: its first failure re-opens it (one more request may
    // have been in flight to it), where 3 in a row would be needed otherwise.
    pool.control(0, r#"{"error_rate":1.0}"#).unwrap();
    drive_until(&envoy, 30, "pod0 cut again", |e| path.stat(e, OPENED) >= 2);
    assert!(
        wait_for(&envoy, |e| path.stat(e, RAMP_FAILURES) >= 1),
        "{path:?}: the failure during the ramp is counted"
    );
    let failures = path.stat(&envoy, RAMP_FAILURES);
    assert!(
        failures <= 2,
        "{path:?}: {failures} failures while ramping before pod0 was cut again"
    );

    // Healed for good: it closes again, ramps, then gets its whole weight back.
    pool.control(0, r#"{"error_rate":0.0}"#).unwrap();
    drive_until(&envoy, 30, "pod0 closed again", |e| {
        path.stat(e, CLOSED) >= 2
    });
    envoy
        .poll(Duration::from_secs(20), "pod0's ramp over", || {
            (ramp_of_pod0(&envoy, &pool) == Some(1.0)).then_some(())
        })
        .unwrap();
}

/// `ok` within 5 s (the filter adds its counters to Envoy's on a tick).
fn wait_for(envoy: &Envoy, ok: impl Fn(&Envoy) -> bool) -> bool {
    envoy
        .poll(Duration::from_secs(5), "stat", || ok(envoy).then_some(()))
        .is_ok()
}

#[test]
fn a_healed_pod_ramps_back_and_one_failure_while_it_ramps_cuts_it() {
    for path in BOTH {
        a_healed_pod_ramps_back_and_one_failure_while_it_ramps_cuts_it_on(path);
    }
}
