//! Decides whether a long answer goes to the pod that decodes faster, through the real agents
//! and Envoy: four fake pods (time scale 0.1), all reading the same GPU utilisation; two decode
//! 1.7x slower with no throttle reason (an older GPU generation), and every pod is kept
//! decoding by completions sent to it directly. Both kinds of pod decode under 1 ms a token, all
//! inside vLLM's first inter-token bucket (10 ms), so their medians read the same: only the
//! agents' mean (the histogram's `_sum` over its count) tells them apart. Requests reserving
//! 600 output tokens (over `longOutputTokens`, 512) go to the fast pods (all four candidates
//! slow: 1 in 24); requests reserving 8 follow the load as before and reach the slow pods too.
//! Without the preference the long ones would split about evenly.

mod filter_common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;

use ai_lb_e2e::envoy::HttpClient;
use filter_common::*;
use serde_json::json;

/// Keeps `addr` decoding (sent directly, not through Envoy) until `stop`.
fn keep_decoding(addr: SocketAddr, stop: Arc<AtomicBool>) -> thread::JoinHandle<usize> {
    thread::spawn(move || {
        let mut client = HttpClient::new(addr);
        let mut ok = 0;
        while !stop.load(Ordering::Relaxed) {
            if client
                .post_json(
                    "/v1/completions",
                    &[],
                    r#"{"prompt":"keep decoding","max_tokens":1000}"#,
                )
                .is_ok_and(|r| r.status == 200)
            {
                ok += 1;
            }
        }
        ok
    })
}

#[test]
fn long_answers_go_to_the_pods_that_decode_faster() {
    let pool = ai_lb_e2e::envoy::PodPool::start(4, 0.1).unwrap();
    for i in 0..4 {
        let slowdown = if i < 2 { 1.7 } else { 1.0 };
        pool.control(
            i,
            &format!(r#"{{"sm_occupancy":0.5,"throttle":false,"slowdown":{slowdown}}}"#),
        )
        .unwrap();
    }
    // The router reads `max_tokens` from the body when the model header is absent.
    let envoy = envoy_for(&pool, config(json!({"modelHeader": "x-ai-lb-model"})));
    let stop = Arc::new(AtomicBool::new(false));
    let background: Vec<_> = pool
        .pod_addrs
        .iter()
        .map(|a| keep_decoding(*a, stop.clone()))
        .collect();
    let addrs: Vec<String> = pool.pod_addrs.iter().map(|a| a.to_string()).collect();
    let sb = wait_scoreboard(
        &envoy,
        "every pod with a decode speed, slow ones slower",
        30,
        |sb| {
            let d: Vec<Option<f64>> = addrs
                .iter()
                .map(|a| row(sb, a).and_then(|r| r["decodeMs"].as_f64()))
                .collect();
            match d[..] {
                [Some(s0), Some(s1), Some(f0), Some(f1)] => s0.min(s1) > 1.4 * f0.max(f1),
                _ => false,
            }
        },
    );
    eprintln!(
        "decodeMs: {:?}",
        addrs
            .iter()
            .map(|a| row(&sb, a).unwrap()["decodeMs"].clone())
            .collect::<Vec<_>>()
    );

    let mut client = HttpClient::new(envoy.listener);
    let mut served = |max_tokens: u32| {
        let body = json!({"prompt": "hello", "max_tokens": max_tokens}).to_string();
        let r = client.post_json("/v1/completions", &[], &body).unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        r.header("x-fake-pod").unwrap_or("none").to_string()
    };
    let slow = |pods: &[String]| pods.iter().filter(|p| *p == "pod0" || *p == "pod1").count();
    let long: Vec<String> = (0..20).map(|_| served(600)).collect();
    let short: Vec<String> = (0..100).map(|_| served(8)).collect();
    let sb = scoreboard(&envoy);
    stop.store(true, Ordering::Relaxed);
    let answered: usize = background.into_iter().map(|t| t.join().unwrap()).sum();
    assert!(answered > 0, "the background load answered nothing");

    // Expected about 0.8 of 20 on the slow pods; 4 or fewer unless the preference is ignored
    // (then about 10).
    assert!(
        slow(&long) <= 4,
        "long answers should go to the faster pods: {long:?}\n{sb:#}"
    );
    // Short answers follow the load, counted at each pod's speed (capacity-aware picking: a
    // pod decoding 1.7x slower with the same requests in flight counts as more loaded), so
    // they lean to the faster pods too, but still reach the slower ones (about a tenth of
    // 100 measured; none would mean the slow pods were cut off).
    assert!(
        slow(&short) >= 3,
        "short answers should still reach the slower pods: {short:?}\n{sb:#}"
    );
    assert!(
        !envoy.wasm_failed(),
        "wasm trapped:\n{}",
        envoy.log_tail(40)
    );
}
