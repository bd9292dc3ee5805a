//! Decides whether the metrics plane being down can hurt traffic: with every agent killed, the
//! filter's pod metrics go stale, it steers nothing, counts the fallback, and every request
//! still succeeds through Envoy's fallback policy (least_request).

mod filter_common;

use std::time::Duration;

use ai_lb_e2e::envoy::HttpClient;
use filter_common::*;
use serde_json::json;

#[test]
fn with_all_agents_killed_every_request_still_succeeds() {
    let mut pool = ai_lb_e2e::envoy::PodPool::start(3, 0.01).unwrap();
    let envoy = envoy_for(&pool, config(json!({})));
    wait_scoreboard(&envoy, "every pod fresh", 30, |sb| all_fresh(sb, &pool));
    let served = count_served(&envoy, 100, &[]);
    assert_eq!(served.values().sum::<usize>(), 100);
    envoy
        .poll(Duration::from_secs(5), "steered requests counted", || {
            (envoy.stat("wasmcustom.ailb.steered").ok()? > 0).then_some(())
        })
        .unwrap();

    pool.kill_agents();
    // Through the staleness transition and after it: every request answers 200.
    let mut client = HttpClient::new(envoy.listener);
    let fallback = || {
        ["all_stale", "no_agent_data", "too_few_pods"]
            .iter()
            .map(|r| {
                envoy
                    .stat(&format!("wasmcustom.ailb.fallback.{r}"))
                    .unwrap_or(0)
            })
            .sum::<u64>()
    };
    let mut n = 0;
    envoy
        .poll(Duration::from_secs(20), "fallback counted", || {
            for _ in 0..20 {
                let r = client.get("/v1/models", &[]).unwrap();
                assert_eq!(
                    r.status,
                    200,
                    "request {n} after the agents died: {}",
                    r.text()
                );
                n += 1;
            }
            (fallback() > 0).then_some(())
        })
        .unwrap();
    let served = count_served(&envoy, 300, &[]);
    assert_eq!(served.values().sum::<usize>(), 300);
    assert!(
        served.len() >= 2,
        "the fallback policy should spread: {served:?}"
    );
    // Envoy flushes its log file every few seconds: poll for the rate-limited line.
    envoy
        .poll(Duration::from_secs(15), "the fallback logged", || {
            envoy.log().contains("not steered").then_some(())
        })
        .unwrap();
    assert!(
        !envoy.wasm_failed(),
        "wasm trapped:\n{}",
        envoy.log_tail(40)
    );
}
