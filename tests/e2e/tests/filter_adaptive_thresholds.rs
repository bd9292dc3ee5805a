//! Decides whether adaptive breaker thresholds (`breaker.adaptiveThresholds`, issue 30 part 4b)
//! work in a real Envoy on both data paths (the wasm filter and the native module share the
//! core's thresholds): in a quiet pool each pod's `agentErrorRate` is lowered (0.25 -> 0.175,
//! shown on the status page with the pool background it came from); a pod that alone fails
//! every request keeps its lowered threshold (the others are quiet) and is cut (that its own
//! rate is left out of its background is checked in the core's tests/adaptive_thresholds.rs); once every pod fails a share of its requests the thresholds are raised above the
//! base. Agents report the pods' error rates, so the background comes from real agents.

mod filter_common;

use std::time::{Duration, Instant};

use ai_lb_e2e::envoy::{self, Envoy, HttpClient, PodPool};
use filter_common::*;
use serde_json::{json, Value};

/// One small completion on a connection of its own (its status is not checked: in the noisy
/// phase a retry may fail too).
fn send(envoy: &Envoy) {
    let _ = HttpClient::new(envoy.listener).post_json(
        "/v1/completions",
        &[("connection", "close")],
        r#"{"prompt":"hello there","max_tokens":4}"#,
    );
}

/// Pod `i`'s `thresholds` object on the status page.
fn thresholds(envoy: &Envoy, pool: &PodPool, i: usize) -> Option<Value> {
    row(&scoreboard(envoy), &pool.pod_addrs[i].to_string())
        .and_then(|r| r.get("thresholds").cloned())
        .filter(|t| !t.is_null())
}

fn agent_rate(t: &Option<Value>) -> Option<f64> {
    t.as_ref()?.get("agentErrorRate")?.as_f64()
}

/// Sends requests until `done` holds for the status page, at most `secs`.
fn drive_until(envoy: &Envoy, secs: u64, what: &str, mut done: impl FnMut(&Envoy) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !done(envoy) {
        for _ in 0..5 {
            send(envoy);
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not within {secs} s; status: {}\nlog:\n{}",
            scoreboard(envoy),
            envoy.log_tail(30)
        );
    }
}

fn thresholds_follow_the_pool_on(path: Path) {
    let pool = PodPool::start(4, 0.01).unwrap();
    for i in 0..4 {
        pool.control(i, r#"{"sm_occupancy":0.3}"#).unwrap();
    }
    // consecutiveFailures high and failureRate 1: the agents' error rate is the only trip.
    let filter = config(json!({
        "breaker": {"consecutiveFailures": 1000, "baseCooldownMs": 30000, "halfOpenProbes": 1,
                    "failureRate": 1.0, "agentErrorRate": 0.25,
                    "adaptiveThresholds": {"minRequests": 5}}
    }));
    let envoy = path.start(&pool, &filter);
    wait_scoreboard(&envoy, "every pod fresh", 30, |sb| all_fresh(sb, &pool));
    if matches!(path, Path::Wasm) {
        // The wasm filter defines its counters at 0 (the native module once first counted).
        assert!(
            envoy.stats().is_ok_and(|s| s.contains_key(&format!(
                "{}ailb.breaker_thresholds.stricter",
                path.prefix()
            ))),
            "{path:?}: the stat is defined at 0"
        );
    }

    // Quiet: no pod fails, so every pod's agentErrorRate is lowered the whole 30 %.
    drive_until(&envoy, 30, "quiet pool lowers the thresholds", |e| {
        (0..4).all(|i| {
            let t = thresholds(e, &pool, i);
            agent_rate(&t).is_some_and(|r| (r - 0.175).abs() < 1e-9)
                && t.as_ref().and_then(|t| t["errorBackground"].as_f64()) == Some(0.0)
        })
    });

    if matches!(path, Path::Wasm) {
        // The pool's gauge (wasm): the pods' median, x1000, set every 500 ms.
        let g = "ailb.pool.default.thresholds.agent_error_rate_permille";
        envoy
            .poll(Duration::from_secs(5), "the pool's threshold gauge", || {
                (path.stat(&envoy, g) == 175).then_some(())
            })
            .unwrap();
    }

    // Pod 0 alone fails every request: the others stay quiet, so its threshold stays
    // lowered, and its agent's rate cuts it.
    pool.control(0, r#"{"error_rate":1.0}"#).unwrap();
    drive_until(&envoy, 30, "pod0 cut on its agent's error rate", |e| {
        path.stat(e, "ailb.breaker_opened.agent_error_rate") >= 1
    });
    let t0 = thresholds(&envoy, &pool, 0);
    assert_eq!(
        agent_rate(&t0).map(|r| (r * 1000.0).round()),
        Some(175.0),
        "{path:?}: pod0's own failures do not raise its threshold: {t0:?}"
    );
    pool.control(0, r#"{"error_rate":0.0}"#).unwrap();

    // Every pod fails a fifth of its requests: pods 1-3 see a background of about 0.2 (over
    // the agents' windows), past errorNoisyAt · 0.25 = 0.1, so their thresholds go up.
    for i in 0..4 {
        pool.control(i, r#"{"error_rate":0.2}"#).unwrap();
    }
    drive_until(&envoy, 40, "noisy pool raises the thresholds", |e| {
        (1..4).all(|i| agent_rate(&thresholds(e, &pool, i)).is_some_and(|r| r > 0.25))
    });
    for i in 1..4 {
        let r = agent_rate(&thresholds(&envoy, &pool, i)).unwrap_or(0.0);
        assert!(
            r <= 0.325 + 1e-9,
            "{path:?}: pod{i}'s threshold {r} past base · 1.3"
        );
    }
}

#[test]
fn breaker_thresholds_follow_the_pool() {
    for path in BOTH {
        thresholds_follow_the_pool_on(path);
    }
}

/// The requests pod `addr` answered with an error, as its model server counts them (vLLM's
/// `request_success_total{finished_reason="error"}`, summed over its other labels).
fn pod_errors(addr: std::net::SocketAddr) -> f64 {
    let page = envoy::http_get(addr, "/metrics")
        .map(|r| r.text())
        .unwrap_or_default();
    page.lines()
        .filter(|l| {
            l.starts_with("vllm:request_success_total{") && l.contains(r#"finished_reason="error""#)
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// `errorEvidence`: the model server's counts reach the filter through the real agent, and a
/// pod failing every request is cut by the evidence they build. The windowed rate cannot cut it
/// here (`failureRateMinRequests` 100000: no window holds that many), nor can the worker's own
/// outcomes; with the test off (the default) the same counts and traffic leave the pod in.
fn evidence_cuts_on(path: Path) {
    for evidence in [Some(3.0), None] {
        let pool = PodPool::start(4, 0.01).unwrap();
        for i in 0..4 {
            pool.control(i, r#"{"sm_occupancy":0.3}"#).unwrap();
        }
        let mut adaptive = json!({"minRequests": 5});
        if let Some(h) = evidence {
            adaptive["errorEvidence"] = json!(h);
        }
        let filter = config(json!({
            "breaker": {"consecutiveFailures": 1000, "baseCooldownMs": 30000,
                        "failureRate": 1.0, "failureRateMinRequests": 100000,
                        "agentErrorRate": 0.25, "adaptiveThresholds": adaptive}
        }));
        let envoy = path.start(&pool, &filter);
        wait_scoreboard(&envoy, "every pod fresh", 30, |sb| all_fresh(sb, &pool));
        pool.control(0, r#"{"error_rate":1.0}"#).unwrap();
        let opened = |e: &Envoy| path.stat(e, "ailb.breaker_opened.agent_error_rate");
        let evidence_trips = |e: &Envoy| path.stat(e, "ailb.breaker_thresholds.evidence");
        // Pod0 fails 8 requests of another client (sent to it directly): its model server
        // counts them, and its agent streams the counts. The picker sends a pod that just
        // failed little traffic of its own, so the sidecar's requests alone would take long.
        let failed = || pod_errors(pool.pod_addrs[0]);
        let before = failed();
        for _ in 0..8 {
            let body = r#"{"prompt":"hello there","max_tokens":4}"#.to_string();
            let (status, _) = direct(pool.pod_addrs[0], body).join().unwrap();
            assert_eq!(status, 500, "{path:?}: pod0 fails every request");
        }
        assert_eq!(failed(), before + 8.0, "{path:?}: pod0 counts its failures");
        if evidence.is_some() {
            // 8 failures in a row are about 9 to 12 nats against the test's 3. Each worker
            // judges the counts as it next refreshes (the wasm filter's VMs on a request).
            drive_until(&envoy, 15, "pod0 cut by the evidence test", |e| {
                evidence_trips(e) >= 1
            });
            // Its reason (counted as the shared breaker takes the trip, at a worker's next
            // event).
            drive_until(&envoy, 10, "the trip counted as agent_error_rate", |e| {
                opened(e) >= 1
            });
        } else {
            // The same counts and as much traffic: nothing cuts it.
            let until = Instant::now() + Duration::from_secs(3);
            drive_until(&envoy, 10, "3 s of traffic", |_| Instant::now() >= until);
            assert_eq!(
                (opened(&envoy), evidence_trips(&envoy)),
                (0, 0),
                "{path:?}: with errorEvidence off (the default) nothing cuts pod0; status: {}",
                scoreboard(&envoy)
            );
        }
    }
}

#[test]
fn the_evidence_test_cuts_a_failing_pod_from_its_agents_counts() {
    for path in BOTH {
        evidence_cuts_on(path);
    }
}
