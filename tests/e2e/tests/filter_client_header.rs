//! Decides whether a client can steer: a client-supplied `x-gateway-destination-endpoint`
//! naming one pod must have no effect — the filter removes it before override_host reads it,
//! so (with no agent data) least_request spreads the requests and no upstream ever sees the
//! client's value. Runs real Envoy with three stub upstreams.

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
