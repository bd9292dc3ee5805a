//! Decides whether a failing pod is cut and readmitted:
//! - passive feedback: a fake pod answering every request with 500 stops being picked after
//!   `breaker.consecutiveFailures` picks (the route's retries hide its failures from the
//!   client), and once it recovers it is readmitted through Half-Open;
//! - the agent's error rate: a second sidecar that never sent the pod a request cuts it on
//!   what the pod's agent counted of the first sidecar's traffic, and readmits it once the
//!   agent's window no longer shows the failures;
//! - probes that are long streams: the breaker closes at the probes' first tokens, while they
//!   are still streaming.

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
        pool.control(i, r#"{"sm_occupancy":0.3}"#).unwrap();
    }
    let envoy = envoy_for(
        &pool,
        config(json!({
            "breaker": {"consecutiveFailures": FAILURES, "baseCooldownMs": 3000, "halfOpenProbes": 2,
                        "agentErrorRate": 0}
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
    // Bounded by time, not by requests: a pod that just failed counts as queued for 1 s
    // (picked only when drawn as both candidates), so its three failures take about three
    // seconds however many requests go by (300 requests took 2.5 s in a run that gave up).
    let deadline = Instant::now() + Duration::from_secs(30);
    while opened(&envoy) == 0 {
        let (status, _) = complete(&mut client);
        assert_eq!(status, 200, "a retry should have hidden pod0's 500");
        sent += 1;
        assert!(
            Instant::now() < deadline,
            "pod0's breaker never opened ({sent} requests in 30 s); log:\n{}",
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

    // The per-pod breaker gauge shows it open (2) while the cooldown lasts (3-6 s with
    // jitter), then closed (0) again below.
    let state = |e: &ai_lb_e2e::envoy::Envoy| {
        e.stat(&format!("wasmcustom.ailb.endpoint.{bad}.breaker_state"))
            .unwrap()
    };
    envoy
        .poll(Duration::from_secs(2), "pod0's breaker gauge open", || {
            (state(&envoy) == 2).then_some(())
        })
        .unwrap();

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
    // One name per stat: the core's own breaker counters (`breaker.opened` and so on, counted
    // in the worker that saw the transition) are not exported beside the shared-state ones.
    let stats = envoy.stats().unwrap();
    for dup in ["opened", "half_opened", "closed"] {
        let name = format!("wasmcustom.ailb.breaker.{dup}");
        assert!(
            !stats.contains_key(&name),
            "{name} exported beside ailb.breaker_{dup}"
        );
    }
    envoy
        .poll(
            Duration::from_secs(5),
            "pod0's breaker gauge closed",
            || (state(&envoy) == 0).then_some(()),
        )
        .unwrap();
    assert!(
        !envoy.wasm_failed(),
        "wasm trapped:\n{}",
        envoy.log_tail(40)
    );
}

#[test]
fn a_sidecar_cuts_a_pod_on_its_agents_error_rate_without_sending_it_anything() {
    let pool = ai_lb_e2e::envoy::PodPool::start(3, 0.01).unwrap();
    for i in 0..3 {
        pool.control(i, r#"{"sm_occupancy":0.3}"#).unwrap();
    }
    // Sidecar A only carries traffic: its breakers never open (never 1000 failures in a row,
    // never 1000 outcomes in a window, its own or the agent's). Sidecar B acts on the agent's
    // count from 1 request on: A's picks of pod0 are rare once it fails (a pod that just
    // failed counts as queued, about one pick in 2 s), and the agents of these tests keep a
    // 2 s window.
    let a = envoy_for(
        &pool,
        config(json!({ "breaker": {
            "consecutiveFailures": 1000, "failureRateMinRequests": 1000,
            "baseCooldownMs": 1000, "halfOpenProbes": 2
        }})),
    );
    let b = envoy_for(
        &pool,
        config(json!({ "breaker": {
            "consecutiveFailures": 1000, "failureRateMinRequests": 1,
            "baseCooldownMs": 1000, "halfOpenProbes": 2
        }})),
    );
    let bad = pool.pod_addrs[0].to_string();
    for e in [&a, &b] {
        wait_scoreboard(e, "every pod fresh", 30, |sb| all_fresh(sb, &pool));
    }
    let picks = |e: &ai_lb_e2e::envoy::Envoy| {
        e.stat(&format!("wasmcustom.ailb.endpoint.{bad}.picks"))
            .unwrap_or(0)
    };
    let opened = |e: &ai_lb_e2e::envoy::Envoy| {
        e.stat("wasmcustom.ailb.breaker_opened.agent_error_rate")
            .unwrap_or(0)
    };
    assert_eq!(picks(&b), 0, "sidecar B has carried no request yet");

    pool.control(0, r#"{"error_rate":1.0}"#).unwrap();
    let mut client_a = HttpClient::new(a.listener);
    let mut sent = 0;
    // Bounded by time, as above.
    let deadline = Instant::now() + Duration::from_secs(30);
    while opened(&b) == 0 {
        let (status, _) = complete(&mut client_a);
        assert_eq!(status, 200, "a retry should have hidden pod0's 500");
        sent += 1;
        assert!(
            Instant::now() < deadline,
            "sidecar B never opened pod0's breaker on the agent's error rate (A picked pod0 \
             {} times); B's pod0 row: {:?}; B's log:\n{}",
            picks(&a),
            row(&scoreboard(&b), &bad),
            b.log_tail(30)
        );
    }
    eprintln!("B opened pod0's breaker after A sent {sent} requests");
    assert_eq!(
        picks(&b),
        0,
        "B learnt from the agent, not from its own requests"
    );
    assert_eq!(opened(&a), 0, "A's threshold is 1000 requests");

    // While the agent still reports pod0 failing, B sends it nothing. Other clients keep
    // failing on pod0 meanwhile (here: requests straight to the pod, standing in for the
    // mesh's other sidecars). A alone would not do: once pod0 fails, A picks it about once in
    // 2 s, the agent's window is 2 s, and a window with no failure left in it lets B's
    // breaker half-open after its 1 s cooldown, so a slow run saw B's probe here.
    // B runs two workers and the breaker opened in one of them; B's
    // first request below may land on the other, which must see the breaker at once (it
    // used to learn of it only at its next refresh tick, and CI caught a pick in between).
    let mut client_b = HttpClient::new(b.listener);
    let mut direct = HttpClient::new(pool.pod_addrs[0]);
    let before = picks(&b);
    for _ in 0..10 {
        assert_eq!(complete(&mut direct).0, 500, "pod0 should be failing");
        assert_eq!(complete(&mut client_b).0, 200);
        assert_eq!(complete(&mut client_a).0, 200);
    }
    assert_eq!(
        picks(&b),
        before,
        "pod0 picked by B while its agent reported it failing"
    );

    // Recovery: once the pod answers again and the agent's 2 s window has drained, B's
    // breaker half-opens after its cooldown, the probes succeed and pod0 serves again.
    pool.control(0, r#"{"error_rate":0.0}"#).unwrap();
    b.poll(Duration::from_secs(30), "pod0 readmitted by B", || {
        let (status, pod) = complete(&mut client_b);
        assert_eq!(status, 200);
        let closed = b.stat("wasmcustom.ailb.breaker_closed").unwrap_or(0) > 0;
        (closed && pod == "pod0").then_some(())
    })
    .unwrap();
    for e in [&a, &b] {
        assert!(!e.wasm_failed(), "wasm trapped:\n{}", e.log_tail(40));
    }
}

/// A half-open pod whose probes are long streams is readmitted at their first tokens: the
/// breaker closes while the probes are still streaming, not one or more whole answers later
/// (each answer here takes seconds; in production, up to the route timeout).
#[test]
fn half_open_probes_pass_at_their_first_token_not_at_the_end_of_a_long_stream() {
    let pool = ai_lb_e2e::envoy::PodPool::start(2, 1.0).unwrap();
    for i in 0..2 {
        pool.control(i, r#"{"sm_occupancy":0.3}"#).unwrap();
    }
    let envoy = envoy_for(
        &pool,
        config(json!({
            "breaker": {"consecutiveFailures": FAILURES, "baseCooldownMs": 1000, "halfOpenProbes": 2,
                        "agentErrorRate": 0}
        })),
    );
    wait_scoreboard(&envoy, "every pod fresh", 30, |sb| all_fresh(sb, &pool));
    let stat = |name: &str| envoy.stat(name).unwrap_or(0);

    pool.control(0, r#"{"error_rate":1.0}"#).unwrap();
    let mut client = HttpClient::new(envoy.listener);
    let deadline = Instant::now() + Duration::from_secs(30);
    while stat("wasmcustom.ailb.breaker_opened.server_errors") == 0 {
        assert_eq!(complete(&mut client).0, 200, "a retry hides pod0's 500");
        assert!(Instant::now() < deadline, "pod0's breaker never opened");
    }
    pool.control(0, r#"{"error_rate":0.0}"#).unwrap();
    let recovered = Instant::now();

    // Long streams (about 4 s each at this time scale) every 250 ms until the breaker has
    // closed, then a few more seconds' worth so that the probes' ends are known.
    let mut streams = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    let closed_at = loop {
        streams.push(long_stream(envoy.listener, 600));
        // Paces the streams (the scenario's load); the breaker is polled at this pace, to the
        // deadline below.
        std::thread::sleep(Duration::from_millis(250));
        if stat("wasmcustom.ailb.breaker_closed") > 0 {
            break Instant::now();
        }
        assert!(
            Instant::now() < deadline,
            "pod0's breaker never closed; {}; log:\n{}",
            decision_stats(&envoy),
            envoy.log_tail(30)
        );
    };
    let ends: Vec<(String, Instant)> = streams.into_iter().map(|h| h.join().unwrap()).collect();
    let pod0_ends: Vec<Instant> = ends
        .iter()
        .filter(|(pod, _)| pod == "pod0")
        .map(|(_, end)| *end)
        .collect();
    assert!(
        pod0_ends.len() >= 2,
        "two probes went to pod0 before its breaker closed; pods: {:?}",
        ends.iter().map(|(p, _)| p.as_str()).collect::<Vec<_>>()
    );
    let first_end = pod0_ends.iter().min().copied().unwrap();
    eprintln!(
        "after pod0 recovered: breaker closed at {} ms, pod0's first probe stream ended at {} ms",
        (closed_at - recovered).as_millis(),
        (first_end - recovered).as_millis()
    );
    assert!(
        closed_at < first_end,
        "the breaker closed {:?} after pod0's first probe stream ended: probes were judged at \
         their end",
        closed_at - first_end
    );
    assert!(stat("wasmcustom.ailb.breaker_half_opened") >= 1);
    assert!(
        !envoy.wasm_failed(),
        "wasm trapped:\n{}",
        envoy.log_tail(40)
    );
}
