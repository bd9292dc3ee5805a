//! Decides whether the experimental native module (filter/native, an Envoy dynamic module)
//! routes like the wasm filter in a real Envoy: it reads the agents' metrics over its own gRPC
//! stream, keeps a pod above the GPU hard limit out of 300 requests whose model it reads from
//! the JSON body, does not steer a model no pod serves, serves the status page, falls back to
//! least_request when no agent answers (counted), and makes Envoy refuse a config it cannot
//! honour. Needs `cargo build -p ai-lb-filter-native` (scripts/test.sh builds it).

mod filter_common;

use std::time::Duration;

use ai_lb_e2e::envoy::{self, Envoy, EnvoyOptions, HttpClient, PodPool};
use filter_common::*;
use serde_json::json;

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";
const STEERED: &str = "dynamicmodulescustom.ailb.native.steered";
const FALLBACK: &str = "dynamicmodulescustom.ailb.native.fallback";

fn native_opts(pool: &PodPool, filter: &str, agents: &[std::net::SocketAddr]) -> EnvoyOptions {
    let mut opts = EnvoyOptions::new(envoy::native_filter_config(filter, agents).unwrap());
    opts.template = Some(envoy::native_template().unwrap());
    opts.inference = pool.pod_addrs.clone();
    opts.agents = agents.to_vec();
    opts
}

fn body(model: &str) -> String {
    json!({"model": model, "prompt": "hello there", "max_tokens": 4}).to_string()
}

fn stat(envoy: &Envoy, name: &str) -> u64 {
    envoy.stat(name).unwrap_or(0)
}

#[test]
fn the_native_module_keeps_a_hot_pod_out_and_reads_the_model_from_the_body() {
    let pool = PodPool::start(3, 0.01).unwrap();
    for i in 1..3 {
        pool.control(i, r#"{"gpu_utilization":0.3}"#).unwrap();
    }
    pool.control(0, r#"{"gpu_utilization":0.97}"#).unwrap();
    let filter = config(json!({"modelHeader": "x-ai-lb-model"}));
    let envoy = Envoy::start(&native_opts(&pool, &filter, &pool.agent_addrs)).unwrap();
    let hot = pool.pod_addrs[0].to_string();
    wait_scoreboard(&envoy, "every pod fresh and the hot pod cut", 30, |sb| {
        all_fresh(sb, &pool) && row(sb, &hot).is_some_and(|r| r["cut"] == "gpu_hard_limit")
    });

    let mut client = HttpClient::new(envoy.listener);
    let mut served = std::collections::BTreeMap::new();
    let n = 300;
    for i in 0..n {
        // A client-sent routing header naming the hot pod is dropped first.
        let r = client
            .post_json(
                "/v1/completions",
                &[("x-gateway-destination-endpoint", hot.as_str())],
                &body(MODEL),
            )
            .unwrap();
        assert_eq!(r.status, 200, "request {i}: {}", r.text());
        *served
            .entry(r.header("x-fake-pod").unwrap_or("none").to_string())
            .or_insert(0usize) += 1;
    }
    assert_eq!(
        served.get("pod0"),
        None,
        "the 97% GPU pod served: {served:?}"
    );
    assert_eq!(served.len(), 2, "both cool pods should serve: {served:?}");
    envoy
        .poll(
            Duration::from_secs(5),
            "every request counted as steered",
            || (stat(&envoy, STEERED) >= n as u64).then_some(()),
        )
        .unwrap_or_else(|e| panic!("{e}: steered {}", stat(&envoy, STEERED)));

    // A model no pod serves, read from the body, is not steered (so the body was read): the
    // pod least_request picks answers 404, and the fallback is counted.
    let before = stat(&envoy, FALLBACK);
    let r = client
        .post_json("/v1/completions", &[], &body("other-model"))
        .unwrap();
    assert_eq!(r.status, 404, "{}", r.text());
    envoy
        .poll(Duration::from_secs(5), "fallback counted", || {
            (stat(&envoy, FALLBACK) > before).then_some(())
        })
        .unwrap();
    assert!(
        !envoy.log_tail(200).contains("panicked"),
        "a hook panicked:\n{}",
        envoy.log_tail(40)
    );
}

#[test]
fn with_no_agent_answering_every_request_still_succeeds_by_least_request_and_is_counted() {
    let pool = PodPool::start(2, 0.01).unwrap();
    // An address nothing listens on: the feed keeps reconnecting, the filter steers nothing.
    let nobody = std::net::SocketAddr::from(([127, 0, 0, 1], envoy::free_port().unwrap()));
    let filter = config(json!({}));
    let envoy = Envoy::start(&native_opts(&pool, &filter, &[nobody])).unwrap();
    let served = count_served(&envoy, 50, &[]);
    assert_eq!(served.values().sum::<usize>(), 50);
    envoy
        .poll(
            Duration::from_secs(5),
            "fallbacks and stream errors counted",
            || {
                (stat(&envoy, FALLBACK) >= 50
                    && stat(&envoy, "dynamicmodulescustom.ailb.native.stream_errors") > 0)
                    .then_some(())
            },
        )
        .unwrap_or_else(|e| panic!("{e}: fallback {}", stat(&envoy, FALLBACK)));
    assert_eq!(stat(&envoy, STEERED), 0);
}

#[test]
fn envoy_refuses_a_native_config_the_module_cannot_honour() {
    let pool = PodPool::start(1, 0.01).unwrap();
    for (filter, field) in [
        (
            config(json!({"bigRequestHold": {}})),
            "filter.bigRequestHold",
        ),
        (config(json!({"minPods": 0})), "minPods"),
    ] {
        let opts = native_opts(&pool, &filter, &pool.agent_addrs);
        let out = envoy::run_until_exit(&opts, Duration::from_secs(30)).unwrap();
        assert!(!out.status.success(), "Envoy accepted a bad config");
        assert!(
            out.log.contains(field),
            "the log does not name `{field}`:\n{}",
            out.log
        );
    }
}
