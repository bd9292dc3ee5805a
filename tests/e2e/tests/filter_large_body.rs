//! Decides whether bodies larger than Envoy's buffer limit (1 MiB by default) pass through
//! both data paths when the filter reads the body (the model is not in a header, prefix
//! affinity, admission costing): the filter holds back at most `maxBodyReadBytes`, reads the
//! fields complete in that prefix and lets the rest stream, so Envoy never answers 413.
//! Bodies of 768 KiB, 1, 5 and 20 MiB (a multimodal chat request with a base64 image), with the model
//! in the body before the image, with the model header, and with admission on (wasm filter).

mod filter_common;

use ai_lb_e2e::envoy::{self, Envoy, EnvoyOptions, HttpClient, PodPool};
use filter_common::*;
use serde_json::json;

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";
/// 768 KiB: over the read limit (512 KiB) but under admission's `maxBodyBytes` (1 MiB), so
/// admission asks for the body and gets its first bytes; then 1, 5 and 20 MiB.
const SIZES_KIB: [usize; 4] = [768, 1024, 5 << 10, 20 << 10];

/// A chat request of about `kib` KiB: the model and `max_tokens` first, then one message
/// carrying a base64 image that makes up the size.
fn big_body(kib: usize) -> String {
    let image = "A".repeat(kib << 10);
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
/// answered 200 by a pod the filter chose (the debug header names it). `costed`: admission
/// reads the body too (so the 768 KiB body is read even with the model header).
fn send_all(envoy: &Envoy, pool: &PodPool, stat_prefix: &str, costed: bool) {
    for kib in SIZES_KIB {
        let body = big_body(kib);
        for headers in [
            vec![("x-ai-lb-debug", "1")],
            vec![("x-ai-lb-debug", "1"), ("x-ai-lb-model", MODEL)],
        ] {
            // A fresh connection each: the client retries a failed request on a reused one,
            // which would hide a reset.
            let r = HttpClient::new(envoy.listener)
                .post_json("/v1/chat/completions", &headers, &body)
                .unwrap_or_else(|e| {
                    panic!(
                        "{kib} KiB, headers {headers:?}: {e}\n{}",
                        envoy.log_tail(30)
                    )
                });
            if r.status != 200 {
                eprintln!("{}", envoy.log_tail(60));
            }
            assert_eq!(
                r.status,
                200,
                "{kib} KiB, headers {headers:?}: {}",
                &r.text()[..r.text().len().min(300)]
            );
            let debug = r.header("x-ai-lb-debug").unwrap_or_default().to_string();
            assert!(
                pool.pod_addrs
                    .iter()
                    .any(|a| debug.starts_with(&format!("pod={a};"))),
                "{kib} KiB, headers {headers:?}: not steered: {debug:?}"
            );
        }
    }
    // Every body read was over the read limit, each counted once: those without the model
    // header, and with admission the 768 KiB one with it (the larger ones admission costs by
    // their declared length without reading them).
    let truncated = envoy
        .stat(&format!("{stat_prefix}ailb.body_truncated"))
        .unwrap_or(0);
    let expected = SIZES_KIB.len() as u64 + u64::from(costed);
    assert_eq!(truncated, expected, "ailb.body_truncated");
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
        send_all(&envoy, &pool, "wasmcustom.", admission);
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
    send_all(&envoy, &pool, "dynamicmodulescustom.", false);
}
