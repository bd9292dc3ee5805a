//! Decides whether bodies larger than Envoy's buffer limit (1 MiB by default) pass through
//! both data paths when the filter reads the body (the model is not in a header, prefix
//! affinity, admission costing): the filter holds back at most `maxBodyReadBytes`, reads the
//! fields complete in that prefix and lets the rest stream, so Envoy never answers 413.
//! Bodies of 1, 5 and 20 MiB (a multimodal chat request with a base64 image), with the model
//! in the body before the image, with the model header, and with admission on (wasm filter).

mod filter_common;

use ai_lb_e2e::envoy::{self, Envoy, EnvoyOptions, HttpClient, PodPool};
use filter_common::*;
use serde_json::json;

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";
const SIZES_MIB: [usize; 3] = [1, 5, 20];

/// A chat request of about `mib` MiB: the model and `max_tokens` first, then one message
/// carrying a base64 image that makes up the size.
fn big_body(mib: usize) -> String {
    let image = "A".repeat(mib << 20);
    json!({
        "model": MODEL,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is in this picture?"},
            {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{image}")}}
        ]}]
    })
    .to_string()
}

/// Sends every size with the model in the body, then with the model header; each must be
/// answered 200 by a pod the filter chose (the debug header names it).
fn send_all(envoy: &Envoy, pool: &PodPool, stat_prefix: &str) {
    let mut client = HttpClient::new(envoy.listener);
    for mib in SIZES_MIB {
        let body = big_body(mib);
        for headers in [
            vec![("x-ai-lb-debug", "1")],
            vec![("x-ai-lb-debug", "1"), ("x-ai-lb-model", MODEL)],
        ] {
            let r = client
                .post_json("/v1/chat/completions", &headers, &body)
                .unwrap_or_else(|e| panic!("{mib} MiB, headers {headers:?}: {e}"));
            assert_eq!(
                r.status,
                200,
                "{mib} MiB, headers {headers:?}: {}",
                &r.text()[..r.text().len().min(300)]
            );
            let debug = r.header("x-ai-lb-debug").unwrap_or_default().to_string();
            assert!(
                pool.pod_addrs
                    .iter()
                    .any(|a| debug.starts_with(&format!("pod={a};"))),
                "{mib} MiB, headers {headers:?}: not steered: {debug:?}"
            );
        }
    }
    // Every body without the header was over the read limit: each is counted once.
    let truncated = envoy
        .stat(&format!("{stat_prefix}ailb.body_truncated"))
        .unwrap_or(0);
    assert_eq!(truncated, SIZES_MIB.len() as u64, "ailb.body_truncated");
}

#[test]
fn large_bodies_pass_the_wasm_filter_with_and_without_admission() {
    let pool = PodPool::start(2, 0.01).unwrap();
    for admission in [false, true] {
        let mut extra = json!({"modelHeader": "x-ai-lb-model"});
        if admission {
            extra["admission"] = json!({
                "tenants": {"default": {"tokensPerSecond": 100_000_000u64, "burst": 100_000_000u64}}
            });
        }
        let envoy = envoy_for(&pool, config(extra));
        wait_scoreboard(&envoy, "every pod fresh", 30, |sb| all_fresh(sb, &pool));
        send_all(&envoy, &pool, "wasmcustom.");
        assert!(
            !envoy.log_tail(400).contains("panicked"),
            "{}",
            envoy.log_tail(40)
        );
    }
}

#[test]
fn large_bodies_pass_the_native_module() {
    let pool = PodPool::start(2, 0.01).unwrap();
    let filter = config(json!({"modelHeader": "x-ai-lb-model"}));
    let mut opts =
        EnvoyOptions::new(envoy::native_filter_config(&filter, &pool.agent_addrs).unwrap());
    opts.template = Some(envoy::native_template().unwrap());
    opts.inference = pool.pod_addrs.clone();
    opts.agents = pool.agent_addrs.clone();
    let envoy = Envoy::start(&opts).unwrap();
    wait_scoreboard(&envoy, "every pod fresh", 30, |sb| all_fresh(sb, &pool));
    send_all(&envoy, &pool, "dynamicmodulescustom.");
}
