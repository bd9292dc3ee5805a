//! Decides whether the filter feeds Envoy's GLOBAL rate limiting with token costs: Envoy runs
//! `envoy-config/envoy-ratelimit.yaml` (ai-lb wasm filter, then `envoy.filters.http.ratelimit`)
//! against a rate limit service speaking the real `ShouldRateLimit` gRPC API. At request time
//! the service receives `hits_addend` = each request's estimated cost; at stream done
//! (`apply_on_stream_done`) it receives the usage beyond that estimate. An OVER_LIMIT answer
//! turns into a 429 from Envoy.

mod filter_common;

use std::time::Duration;

use ai_lb_e2e::envoy::{Envoy, EnvoyOptions, HttpClient, PodPool};
use ai_lb_e2e::ratelimit::{Call, RateLimitServer};
use ai_lb_filter_core::admission::config::CostConfig;
use ai_lb_filter_core::admission::cost::{cost_from_body, Endpoint};
use ai_lb_filter_core::admission::UsageScanner;
use filter_common::*;
use serde_json::json;

fn template(rls: &RateLimitServer) -> String {
    let p = ai_lb_e2e::envoy::workspace_root().join("envoy-config/envoy-ratelimit.yaml");
    std::fs::read_to_string(&p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .replace("${RATELIMIT_ADDRESS}", &rls.addr.ip().to_string())
        .replace("${RATELIMIT_PORT}", &rls.addr.port().to_string())
}

fn start(pool: &PodPool, rls: &RateLimitServer) -> Envoy {
    let mut opts = EnvoyOptions::new(config(json!({
        "admission": {
            "tenants": {"default": {"tokensPerSecond": 1000000, "burst": 1000000}},
            "cost": {"defaultOutputTokens": 16}
        }
    })));
    opts.inference = pool.pod_addrs.clone();
    opts.agents = pool.agent_addrs.clone();
    opts.template = Some(template(rls));
    Envoy::start(&opts).unwrap()
}

fn hits_for(calls: &[Call], value: &str) -> Vec<u32> {
    calls
        .iter()
        .filter(|c| {
            c.domain == "ai-lb"
                && c.descriptors
                    .iter()
                    .any(|d| d == &vec![("tokens".to_string(), value.to_string())])
        })
        .map(|c| c.hits_addend)
        .collect()
}

#[test]
fn the_rate_limit_service_receives_request_costs_as_hits_addend() {
    let pool = PodPool::start(2, 0.01).unwrap();
    let rls = RateLimitServer::start(None).unwrap();
    let envoy = start(&pool, &rls);
    let mut client = HttpClient::new(envoy.listener);
    let cost_cfg = CostConfig {
        default_output_tokens: 16,
        ..CostConfig::default()
    };

    let mut costs = Vec::new();
    let mut overage = Vec::new();
    for i in 0..12u64 {
        let mut body = json!({
            // "a a a ..." is over-estimated (1 token a word; the fake pod counts chars / 4),
            // "word word ..." under-estimated.
            "prompt": if i % 2 == 0 { "word " } else { "a " }.repeat(3 + 7 * i as usize),
            "max_tokens": 4 + i * 3,
        });
        if i % 4 == 0 {
            // No max_tokens: the default output reservation (16) applies.
            body.as_object_mut().map(|o| o.remove("max_tokens"));
        }
        if i % 3 == 0 {
            body["stream"] = json!(true);
            body["stream_options"] = json!({"include_usage": true});
        }
        let text = body.to_string();
        let r = client.post_json("/v1/completions", &[], &text).unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        let cost = cost_from_body(&cost_cfg, Endpoint::Completions, text.as_bytes())
            .unwrap()
            .weighted;
        let mut s = UsageScanner::new();
        s.feed(&r.body);
        let u = s.usage().expect("usage in the response");
        let actual = u.prompt_tokens + u.completion_tokens;
        costs.push(u32::try_from(cost).unwrap());
        overage.push(u32::try_from(actual.saturating_sub(cost)).unwrap());
    }

    let got = envoy
        .poll(Duration::from_secs(10), "every stream-done call", || {
            let calls = rls.calls();
            (hits_for(&calls, "overage").len() >= costs.len()).then_some(calls)
        })
        .unwrap_or_else(|e| panic!("{e}\ncalls: {:?}", rls.calls()));
    let estimate = hits_for(&got, "estimate");
    let done = hits_for(&got, "overage");
    println!("request-time hits_addend {estimate:?}\nexpected costs          {costs:?}");
    println!("stream-done hits_addend  {done:?}\nexpected overage        {overage:?}");
    assert_eq!(estimate, costs, "request-time hits_addend != request costs");
    assert_eq!(
        done, overage,
        "stream-done hits_addend != usage beyond the estimate"
    );
    assert!(
        overage.iter().any(|o| *o > 0) && overage.contains(&0),
        "the bodies should cover both an under- and an over-estimate: {overage:?}"
    );
    assert_eq!(
        envoy
            .stat("wasmcustom.ailb.admission.hits_addend_errors")
            .unwrap_or(0),
        0
    );
    assert!(
        !envoy.wasm_failed(),
        "wasm trapped:\n{}",
        envoy.log_tail(40)
    );
}

#[test]
fn an_over_limit_answer_becomes_a_429() {
    let pool = PodPool::start(1, 0.01).unwrap();
    // A budget of 100 weighted tokens in total.
    let rls = RateLimitServer::start(Some(100)).unwrap();
    let envoy = start(&pool, &rls);
    let mut client = HttpClient::new(envoy.listener);
    let body = json!({"prompt": "hello there", "max_tokens": 40}).to_string();
    let statuses: Vec<u16> = (0..5)
        .map(|_| {
            client
                .post_json("/v1/completions", &[], &body)
                .unwrap()
                .status
        })
        .collect();
    println!("statuses against a 100-token global budget: {statuses:?}");
    assert_eq!(statuses.first(), Some(&200));
    assert!(statuses.contains(&429), "{statuses:?}");
    assert!(
        !envoy.wasm_failed(),
        "wasm trapped:\n{}",
        envoy.log_tail(40)
    );
}
