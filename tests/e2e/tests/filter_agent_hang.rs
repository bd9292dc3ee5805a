//! Decides whether hung agents (SIGSTOP: connections accepted, nothing answered) can hurt
//! traffic: the filter notices the silent stream, reconnects with backoff, stops steering once
//! the metrics are stale, every request still succeeds, and steering resumes after SIGCONT.

mod filter_common;

use std::time::Duration;

use ai_lb_e2e::envoy::HttpClient;
use filter_common::*;
use serde_json::json;

#[test]
fn hung_agents_cost_no_request_and_steering_resumes_after_they_recover() {
    let mut pool = ai_lb_e2e::envoy::PodPool::start(3, 0.01).unwrap();
    let envoy = envoy_for(&pool, config(json!({"cutoffs": {"stalenessMs": 1500}})));
    wait_scoreboard(&envoy, "every pod fresh", 30, |sb| all_fresh(sb, &pool));
    // Counters of events that have not happened exist and read 0 (a dashboard shows 0, not
    // "no data"), from the filter's first export on.
    // (`stat` reads an absent stat as 0: look the names up in the full list instead.)
    let stats = envoy
        .poll(
            Duration::from_secs(5),
            "the core's counters exported",
            || {
                let st = envoy.stats().ok()?;
                st.contains_key("wasmcustom.ailb.steered").then_some(st)
            },
        )
        .unwrap();
    for zero in [
        "wasmcustom.ailb.fail_open",
        "wasmcustom.ailb.fallback.no_model",
        "wasmcustom.ailb.fallback.all_stale",
        "wasmcustom.ailb.stream.failures",
        "wasmcustom.ailb.stream.decode_errors",
    ] {
        assert_eq!(stats.get(zero), Some(&0), "{zero} should exist and read 0");
    }

    pool.signal_agents("STOP").unwrap();
    let result = (|| {
        let mut client = HttpClient::new(envoy.listener);
        let fallbacks = || {
            ["all_stale", "no_agent_data", "too_few_pods"]
                .iter()
                .map(|r| {
                    envoy
                        .stat(&format!("wasmcustom.ailb.fallback.{r}"))
                        .unwrap_or(0)
                })
                .sum::<u64>()
        };
        envoy.poll(
            Duration::from_secs(20),
            "fallback while agents hang",
            || {
                for _ in 0..10 {
                    let r = client.get("/v1/models", &[]).ok()?;
                    assert_eq!(r.status, 200, "{}", r.text());
                }
                (fallbacks() > 0).then_some(())
            },
        )?;
        envoy.poll(Duration::from_secs(15), "the silent stream logged", || {
            envoy.log().contains("silent; reconnecting").then_some(())
        })
    })();
    pool.signal_agents("CONT").unwrap();
    result.unwrap();

    // Recovery: a fresh stream, fresh metrics, steering again.
    wait_scoreboard(&envoy, "every pod fresh again", 30, |sb| {
        all_fresh(sb, &pool)
    });
    let before = envoy.stat("wasmcustom.ailb.steered").unwrap();
    let served = count_served(&envoy, 100, &[]);
    assert_eq!(served.values().sum::<usize>(), 100);
    envoy
        .poll(Duration::from_secs(5), "steering resumed", || {
            (envoy.stat("wasmcustom.ailb.steered").ok()? >= before + 90).then_some(())
        })
        .unwrap();
    assert!(envoy.stat("wasmcustom.ailb.stream.opens").unwrap() >= 2);
    assert!(
        !envoy.wasm_failed(),
        "wasm trapped:\n{}",
        envoy.log_tail(40)
    );
}
