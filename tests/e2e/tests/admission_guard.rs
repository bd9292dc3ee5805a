//! Decides whether the inbound guard protects a hot pod in a real Envoy: a guard Envoy
//! (`mode: "guard"`) in front of one fake pod, watching only that pod's agent, answers 503 with
//! `retry-after` and `x-ai-lb-guard: rejected` once the pod is forced to 97% GPU with a queue,
//! before the model server sees the request; the client-side ai-lb Envoy (whose pool is the
//! guard plus a cool pod) retries the other pod and the client sees only 200s; when the pod
//! cools down the guard admits again; once its agent hangs, stale signals admit (counted).
//! Runs against both data paths' guard (the proxy-wasm filter and the native module: the same
//! core, the same stat names); the client Envoy is the wasm filter without agents in both.

mod filter_common;

use std::time::Duration;

use ai_lb_e2e::envoy::{template, Envoy, EnvoyOptions, HttpClient, PodPool};
use filter_common::*;
use serde_json::{json, Value};

const BODY: &str = r#"{"prompt":"hello there","max_tokens":4}"#;

fn guard_config() -> String {
    json!({
        "mode": "guard",
        "pools": [{"name": "local", "cluster": "inference", "agentCluster": "ai_lb_agents"}],
        "watch": {"refreshMs": 20, "minIntervalMs": 50, "heartbeatMs": 300, "reconnectBaseMs": 100, "reconnectMaxMs": 1000},
        "admission": {"guard": {"gpuUtilCutoff": 0.9, "retryAfterSeconds": 2, "maxStalenessMs": 3000}}
    })
    .to_string()
}

/// envoy.yaml with retries that skip the hosts already tried (test-local: the shipped file
/// retries through the filter's ranked list instead).
fn client_template() -> String {
    let t = template().unwrap();
    let anchor = "                    num_retries: 2\n";
    assert!(t.contains(anchor), "envoy.yaml retry policy changed");
    t.replace(
        anchor,
        "                    num_retries: 2\n\
         \x20                   retry_host_predicate:\n\
         \x20                   - name: envoy.retry_host_predicates.previous_hosts\n\
         \x20                     typed_config: {\"@type\": type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate}\n\
         \x20                   host_selection_retry_max_attempts: 5\n",
    )
}

#[test]
fn a_hot_pod_is_guarded_and_the_client_retries_elsewhere() {
    for path in BOTH {
        eprintln!("== {path:?}");
        a_hot_pod_is_guarded_and_the_client_retries_elsewhere_on(path);
    }
}

fn a_hot_pod_is_guarded_and_the_client_retries_elsewhere_on(path: Path) {
    let guard_stat = |envoy: &Envoy, name: &str| path.stat(envoy, &format!("ailb.guard.{name}"));
    let mut pool = PodPool::start(2, 0.01).unwrap();
    pool.control(1, r#"{"sm_occupancy":0.3}"#).unwrap();
    pool.control(0, r#"{"sm_occupancy":0.97,"queue":8}"#)
        .unwrap();

    // The guard of pod0: its only upstream is pod0, its only agent pod0's.
    let gopts = path.opts_for(
        &guard_config(),
        &[pool.pod_addrs[0]],
        &[pool.agent_addrs[0]],
    );
    let guard = Envoy::start(&gopts).unwrap();

    // Directly at the guard: 503 with the marker once the local signals arrive.
    let mut direct = HttpClient::new(guard.listener);
    let r = guard
        .poll(
            Duration::from_secs(15),
            "the guard rejects the hot pod",
            || {
                let r = direct.post_json("/v1/completions", &[], BODY).ok()?;
                (r.status == 503).then_some(r)
            },
        )
        .unwrap_or_else(|e| panic!("{e}\n{}", guard.log_tail(30)));
    assert_eq!(
        r.header("x-ai-lb-guard"),
        Some("rejected"),
        "{:?}",
        r.headers
    );
    assert_eq!(r.header("x-ai-lb-guard-reason"), Some("gpu_saturated"));
    assert_eq!(r.header("retry-after"), Some("2"));
    assert_eq!(
        r.header("x-fake-pod"),
        None,
        "the pod must not have answered"
    );
    let e: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(e["error"]["code"], "overloaded", "{e}");
    let rejected_direct = guard_stat(&guard, "rejected.gpu_saturated");
    assert!(rejected_direct >= 1);

    // The client sidecar: its pool is the guard (pod0) and pod1; no agents, so Envoy's
    // fallback balances and the retry policy handles the guard's 503.
    let mut copts = EnvoyOptions::new(config(json!({})));
    copts.inference = vec![guard.listener, pool.pod_addrs[1]];
    copts.template = Some(client_template());
    let client_envoy = Envoy::start(&copts).unwrap();
    let mut client = HttpClient::new(client_envoy.listener);
    let n = 60;
    for i in 0..n {
        let r = client.post_json("/v1/completions", &[], BODY).unwrap();
        assert_eq!(r.status, 200, "request {i}: {}", r.text());
        assert_eq!(r.header("x-fake-pod"), Some("pod1"), "request {i}");
    }
    let rejected_via_client = guard_stat(&guard, "rejected.gpu_saturated") - rejected_direct;
    let retries = client_envoy
        .stat("cluster.inference.upstream_rq_retry")
        .unwrap_or(0);
    println!(
        "guard: {rejected_via_client} of {n} client requests rejected by the hot pod's guard, \
         {retries} retried elsewhere by the client Envoy; all {n} answered 200 by pod1"
    );
    assert!(
        rejected_via_client > 0,
        "no client request reached the guard"
    );
    assert!(retries >= rejected_via_client);

    // Cooled down: the guard admits again.
    pool.control(0, r#"{"sm_occupancy":0.2,"queue":0}"#)
        .unwrap();
    let r = guard
        .poll(Duration::from_secs(15), "the guard admits again", || {
            let r = direct.post_json("/v1/completions", &[], BODY).ok()?;
            (r.status == 200).then_some(r)
        })
        .unwrap();
    assert_eq!(r.header("x-fake-pod"), Some("pod0"));
    assert!(guard_stat(&guard, "admitted") >= 1);

    // Hot again, then its agent hangs: once the signals are stale the guard admits (fail-open),
    // counted.
    pool.control(0, r#"{"sm_occupancy":0.97,"queue":8}"#)
        .unwrap();
    guard
        .poll(Duration::from_secs(15), "the guard rejects again", || {
            let r = direct.post_json("/v1/completions", &[], BODY).ok()?;
            (r.status == 503).then_some(())
        })
        .unwrap();
    let agent0 = pool.agents[0].as_mut().unwrap();
    agent0.signal("STOP").unwrap();
    let stale = guard.poll(Duration::from_secs(15), "stale signals admit", || {
        let r = direct.post_json("/v1/completions", &[], BODY).ok()?;
        (r.status == 200).then_some(())
    });
    agent0.signal("CONT").unwrap();
    stale.unwrap();
    assert!(guard_stat(&guard, "fail_open.stale") >= 1);
    assert!(
        path.stat(&guard, "ailb.stream.opens") >= 1,
        "the guard's Watch stream to its agent is counted"
    );
    for e in [&guard, &client_envoy] {
        assert!(!e.wasm_failed(), "wasm trapped:\n{}", e.log_tail(40));
    }
}
