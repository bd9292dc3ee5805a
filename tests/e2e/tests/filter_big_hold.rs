//! Decides whether `bigRequestHold` keeps a big request in the sidecar, through the real
//! agents and Envoy, while no pod has room for it with the KV headroom to spare, lets short
//! requests through meanwhile, and routes it once a pod has room; and that a held request
//! is routed anyway after `maxHoldMs`, and forgotten when its client goes away.
//!
//! Setup (real time, time scale 1; one Envoy worker, since each worker's VM learns the mean
//! request from its own traffic): two fake pods with a 10 000-token KV cache and 8 seats,
//! GPU forced equal. The router reads bodies (`modelHeader` set, requests without it), so it
//! learns the mean request from short warm-up requests (~15 KV tokens), and a 4 000-token
//! prompt is big. Each pod runs one direct request with a 5 000-token prompt (reading: KV
//! use 0.5 and growing). A 4 000-token prompt fits the rest of either cache but would leave
//! less than the default 20 % free: it waits in the sidecar. (On the pods it would wait
//! anyway: the fake pod reserves prompt + `max_tokens`, 5 000 + the direct's answer.)

mod filter_common;

use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ai_lb_e2e::envoy::{Envoy, EnvoyOptions, HttpClient, PodPool};
use filter_common::*;
use serde_json::json;

/// Sends `body` through Envoy on a thread with client timeout `timeout`: status (0 when the
/// client gave up), serving pod, and when it ended.
fn via_envoy(envoy: &Envoy, body: String, timeout: Duration) -> JoinHandle<(u16, String, Instant)> {
    let listener = envoy.listener;
    std::thread::spawn(move || {
        let r = HttpClient::new(listener).with_timeout(timeout).post_json(
            "/v1/completions",
            &[("connection", "close")],
            &body,
        );
        match r {
            Ok(r) => (
                r.status,
                r.header("x-fake-pod").unwrap_or("none").to_string(),
                Instant::now(),
            ),
            Err(_) => (0, "gave up".to_string(), Instant::now()),
        }
    })
}

/// Two pods (10 000 KV tokens, 8 seats), Envoy with the hold configured by `hold`, fresh KV
/// readings, and a trained mean request size (warm-up requests through Envoy).
fn setup(hold: serde_json::Value) -> (PodPool, Envoy) {
    let pool = kv_pool(|_| 10_000);
    // One worker: each worker's VM learns the mean request from its own traffic, and the
    // warm-up below runs on one connection.
    let mut opts = EnvoyOptions::new(config(json!({
        "cutoffs": {"stalenessMs": 5000, "maxQueue": 8},
        "modelHeader": "x-ai-lb-model",
        "bigRequestHold": hold,
    })));
    opts.inference = pool.pod_addrs.clone();
    opts.agents = pool.agent_addrs.clone();
    opts.concurrency = 1;
    let envoy = Envoy::start(&opts).unwrap();
    let addrs: Vec<String> = pool.pod_addrs.iter().map(|a| a.to_string()).collect();
    wait_scoreboard(&envoy, "every pod fresh with a KV reading", 30, |sb| {
        all_fresh(sb, &pool)
            && addrs
                .iter()
                .all(|a| row(sb, a).is_some_and(|r| r["kv"].is_number()))
    });
    short_requests(&envoy, 30);
    (pool, envoy)
}

/// Starts a direct 5 000-token prompt answering `tokens` on each pod and waits until the
/// scoreboard shows both at KV use ≥ 0.5.
fn fill(pool: &PodPool, envoy: &Envoy, tokens: u32) -> Vec<JoinHandle<(u16, Instant)>> {
    let bg: Vec<_> = pool
        .pod_addrs
        .iter()
        .map(|a| direct(*a, body(5000, tokens)))
        .collect();
    let addrs: Vec<String> = pool.pod_addrs.iter().map(|a| a.to_string()).collect();
    wait_scoreboard(envoy, "both pods half full of KV", 20, |sb| {
        addrs.iter().all(|a| {
            row(sb, a)
                .and_then(|r| r["kv"].as_f64())
                .is_some_and(|kv| kv >= 0.5)
        })
    });
    bg
}

/// Waits until one request is held; on failure shows what the filter saw.
fn held(envoy: &Envoy) {
    let ok = envoy.poll(Duration::from_secs(5), "one request held", || {
        (envoy.stat("wasmcustom.ailb.big_hold.held").ok()? == 1).then_some(())
    });
    if let Err(e) = ok {
        panic!("{e}\n{}\n{:#}", decision_stats(envoy), scoreboard(envoy));
    }
}

#[test]
fn a_big_request_waits_in_the_sidecar_until_a_pod_has_room_and_short_ones_pass() {
    let (pool, envoy) = setup(json!({"maxHoldMs": 30000}));
    // ~1 000 output tokens at ~5 ms: each direct request runs about 5 s.
    let bg = fill(&pool, &envoy, 1000);
    let big = via_envoy(&envoy, body(4000, 10), Duration::from_secs(40));
    held(&envoy);
    wait_stat(&envoy, "wasmcustom.ailb.big_hold.depth", |v| v == 1);
    // Short requests are not held, and both pods have seats and KV cache for them.
    short_requests(&envoy, 10);
    assert!(
        bg.iter().all(|h| !h.is_finished()),
        "the direct requests ended before the checks; the run is inconclusive"
    );
    assert!(!big.is_finished(), "the big request was not held");
    let ends: Vec<Instant> = bg
        .into_iter()
        .map(|h| {
            let (s, t) = h.join().unwrap();
            assert_eq!(s, 200);
            t
        })
        .collect();
    let (status, pod, done) = big.join().unwrap();
    assert_eq!(
        status,
        200,
        "big request: {pod}\n{}",
        decision_stats(&envoy)
    );
    let first_free = ends.iter().min().copied().unwrap();
    assert!(
        done > first_free,
        "the big request ended before any pod had room for it"
    );
    wait_stat(&envoy, "wasmcustom.ailb.big_hold.released", |v| v == 1);
    wait_stat(&envoy, "wasmcustom.ailb.big_hold.depth", |v| v == 0);
    assert_eq!(
        envoy.stat("wasmcustom.ailb.big_hold.expired").unwrap(),
        0,
        "{}",
        decision_stats(&envoy)
    );
    assert!(
        !envoy.wasm_failed(),
        "wasm trapped:\n{}",
        envoy.log_tail(40)
    );
}

#[test]
fn a_held_request_goes_after_max_hold_ms_and_is_forgotten_when_its_client_leaves() {
    let (pool, envoy) = setup(json!({"maxHoldMs": 1500}));
    // ~3 000 output tokens: the pods stay full for the whole test.
    let bg = fill(&pool, &envoy, 3000);
    // Gives up after 500 ms, while held.
    let left = via_envoy(&envoy, body(4000, 10), Duration::from_millis(500));
    assert_eq!(left.join().unwrap().0, 0, "answered while it should wait");
    wait_stat(&envoy, "wasmcustom.ailb.big_hold.left", |v| v == 1);
    wait_stat(&envoy, "wasmcustom.ailb.big_hold.depth", |v| v == 0);
    // Waits 1.5 s in the sidecar, then goes to a pod as if the hold were off (where it waits
    // for KV cache: the client gives up at 4 s).
    let sent = Instant::now();
    let expired = via_envoy(&envoy, body(4000, 10), Duration::from_secs(4));
    wait_stat(&envoy, "wasmcustom.ailb.big_hold.expired", |v| v == 1);
    assert!(sent.elapsed() >= Duration::from_millis(1500));
    let _ = expired.join();
    assert_eq!(
        envoy.stat("wasmcustom.ailb.big_hold.released").unwrap(),
        0,
        "{}",
        decision_stats(&envoy)
    );
    // Routed: the filter's pick counters saw it (warm-up 30 + this one).
    let picks: u64 = pool
        .pod_addrs
        .iter()
        .map(|a| {
            envoy
                .stat(&format!("wasmcustom.ailb.endpoint.{a}.picks"))
                .unwrap()
        })
        .sum();
    assert_eq!(picks, 31, "{}", decision_stats(&envoy));
    assert!(bg.iter().all(|h| !h.is_finished()), "inconclusive");
    assert!(
        !envoy.wasm_failed(),
        "wasm trapped:\n{}",
        envoy.log_tail(40)
    );
    drop(envoy);
    drop(pool);
    for h in bg {
        let _ = h.join();
    }
}
