//! Decides whether a client can steer: a client-supplied `x-gateway-destination-endpoint`
//! naming one pod must have no effect — the filter removes it before override_host reads it,
//! so (with no agent data) least_request spreads the requests and no upstream ever sees the
//! client's value. Runs real Envoy with three stub upstreams. And whether a client can claim
//! anything through the other headers the filter reads or writes (issue 31): the priority
//! header only counts where a trusted filter sets it, the debug header stops at the filter,
//! and the response headers the filter writes are its own.

use std::collections::BTreeMap;

use ai_lb_e2e::envoy::{Envoy, EnvoyOptions, HttpClient, StubUpstream};

const CONFIG: &str = r#"{"pools":[{"name":"default","cluster":"inference","agentCluster":"ai_lb_agents"}],"minPods":1}"#;

#[test]
fn a_client_supplied_routing_header_is_dropped() {
    let pods: Vec<StubUpstream> = (0..3).map(|_| StubUpstream::start().unwrap()).collect();
    let mut opts = EnvoyOptions::new(CONFIG);
    opts.inference = pods.iter().map(|p| p.addr).collect();
    let envoy = Envoy::start(&opts).unwrap();
    let target = pods[0].addr.to_string();
    let mut client = HttpClient::new(envoy.listener);
    let mut served: BTreeMap<String, u32> = BTreeMap::new();
    let n = 300;
    for _ in 0..n {
        let r = client
            .get("/v1/models", &[("x-gateway-destination-endpoint", &target)])
            .unwrap();
        assert_eq!(r.status, 200, "body: {}", r.text());
        let pod = r.header("x-fake-pod").unwrap_or("none").to_string();
        *served.entry(pod).or_default() += 1;
    }
    let to_target = served.get(&target).copied().unwrap_or(0);
    // Steered, all 300 would hit the target; least_request over 3 pods gives it about 100.
    assert!(
        to_target < n * 2 / 3,
        "the client's header steered {to_target}/{n} requests to {target}: {served:?}"
    );
    assert!(served.len() >= 2, "only one pod served: {served:?}");
    for p in &pods {
        let seen = p.seen.lock().unwrap();
        for headers in seen.iter() {
            assert!(
                !headers
                    .iter()
                    .any(|(k, v)| k == "x-gateway-destination-endpoint" && *v == target),
                "upstream {} received the client's routing header",
                p.addr
            );
        }
    }
    assert!(
        !envoy.wasm_failed(),
        "wasm trapped:\n{}",
        envoy.log_tail(40)
    );
}

/// What upstream `pod` saw of header `name` in each request it served.
fn seen_values(pod: &StubUpstream, name: &str) -> Vec<Option<String>> {
    pod.seen
        .lock()
        .unwrap()
        .iter()
        .map(|hs| hs.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))
        .collect()
}

/// Issue 31: every header the filter reads for a decision or writes, sent by a client. The
/// routing header is dropped (only the filter writes it); the priority header is dropped and
/// ignored unless `admission.trustedHeaders` lists it (a client cannot claim `critical`), and
/// kept and read when it does; the debug header is honoured (it is configured) but goes no
/// further than the filter; the model header is read and passed on (it names the client's own
/// request's model, as the body's `model` does); the response headers the filter writes
/// (`x-ratelimit-*`, `x-ai-lb-debug`) carry the filter's values, whatever the client sent.
#[test]
fn every_header_the_filter_reads_or_writes_is_dropped_or_its_own() {
    for trusted in [false, true] {
        let pod = StubUpstream::start().unwrap();
        let mut admission = serde_json::json!({
            "tenants": {"default": {"tokensPerSecond": 1000000, "burst": 1000000}}
        });
        if trusted {
            admission["trustedHeaders"] = serde_json::json!(["x-ai-lb-priority"]);
        }
        let config = serde_json::json!({
            "pools": [{"name": "default", "cluster": "inference", "agentCluster": "ai_lb_agents"}],
            "minPods": 1,
            "modelHeader": "x-ai-lb-model",
            "debugHeader": "x-ai-lb-debug",
            "admission": admission,
        });
        let mut opts = EnvoyOptions::new(config.to_string());
        opts.inference = vec![pod.addr];
        let envoy = Envoy::start(&opts).unwrap();
        let mut client = HttpClient::new(envoy.listener);
        let fake = pod.addr.to_string();
        let n = 5;
        for _ in 0..n {
            let r = client
                .post_json(
                    "/v1/completions",
                    &[
                        ("x-gateway-destination-endpoint", fake.as_str()),
                        ("x-ai-lb-priority", "critical"),
                        ("x-ai-lb-debug", "1"),
                        ("x-ai-lb-model", "m"),
                        ("x-ratelimit-limit", "7"),
                    ],
                    r#"{"prompt":"hi","max_tokens":4}"#,
                )
                .unwrap();
            assert_eq!(r.status, 200, "{}", r.text());
            // Honoured for this caller: the filter's answer, not the client's value.
            let dbg = r.header("x-ai-lb-debug").unwrap_or_default();
            assert!(dbg.starts_with("pod="), "debug header {dbg:?}");
            assert_eq!(r.header("x-ratelimit-limit"), Some("1000000"));
        }
        let all = |name: &str| seen_values(&pod, name);
        assert_eq!(
            all("x-ai-lb-debug"),
            vec![None; n],
            "the debug header went on"
        );
        assert_eq!(all("x-ai-lb-model"), vec![Some("m".into()); n]);
        assert!(
            all("x-gateway-destination-endpoint")
                .iter()
                .all(|v| v.as_deref() != Some(fake.as_str())),
            "the client's routing header went on"
        );
        let prio = if trusted {
            Some("critical".into())
        } else {
            None
        };
        assert_eq!(all("x-ai-lb-priority"), vec![prio; n], "trusted: {trusted}");
        let class = if trusted { "critical" } else { "standard" };
        let name = format!("wasmcustom.ailb.admission.tenant.default.{class}.admitted");
        let mut last = 0;
        envoy
            .poll(std::time::Duration::from_secs(5), &name, || {
                last = envoy.stat(&name).unwrap_or(0);
                (last == n as u64).then_some(())
            })
            .unwrap_or_else(|e| panic!("{name} = {last}, want {n}: {e}"));
        assert!(
            !envoy.wasm_failed(),
            "wasm trapped:\n{}",
            envoy.log_tail(40)
        );
    }
}
