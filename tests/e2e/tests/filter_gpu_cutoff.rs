//! Decides whether GPU load steers real traffic: three fake pods with agents behind a real
//! Envoy; one pod forced to 97% GPU (above the 95% hard limit) receives none of 1000 requests,
//! even when every request's client-supplied routing header names it. Also checks that the
//! per-pod metrics reach Prometheus with the pod as a label.

mod filter_common;

use filter_common::*;
use serde_json::json;

#[test]
fn a_pod_at_97_percent_gpu_receives_none_of_1000_requests() {
    let pool = ai_lb_e2e::envoy::PodPool::start(3, 0.01).unwrap();
    for i in 1..3 {
        pool.control(i, r#"{"sm_occupancy":0.3}"#).unwrap();
    }
    pool.control(0, r#"{"sm_occupancy":0.97}"#).unwrap();
    let envoy = envoy_for(&pool, config(json!({})));
    let hot = pool.pod_addrs[0].to_string();
    wait_scoreboard(&envoy, "every pod fresh and the hot pod cut", 30, |sb| {
        all_fresh(sb, &pool) && row(sb, &hot).is_some_and(|r| r["cut"] == "gpu_hard_limit")
    });

    // One WatchPool stream for the whole Envoy (2 workers + main thread VMs): lease election.
    envoy
        .poll(
            std::time::Duration::from_secs(5),
            "exactly one agent stream",
            || (envoy.stat("cluster.ai_lb_agents.upstream_rq_active").ok()? == 1).then_some(()),
        )
        .unwrap();

    let served = count_served(&envoy, 1000, &[("x-gateway-destination-endpoint", &hot)]);
    assert_eq!(
        served.get("pod0"),
        None,
        "the 97% GPU pod served requests: {served:?}; {}",
        decision_stats(&envoy)
    );
    assert_eq!(served.values().sum::<usize>(), 1000);
    assert!(served.len() == 2, "both cool pods should serve: {served:?}");

    // Stats: picks per pod, labelled by the pod in Prometheus.
    let cool = pool.pod_addrs[1].to_string();
    let picks = envoy
        .stat(&format!("wasmcustom.ailb.endpoint.{cool}.picks"))
        .unwrap();
    assert!(picks > 0, "no picks counted for {cool}");
    assert_eq!(
        envoy
            .stat(&format!("wasmcustom.ailb.endpoint.{hot}.picks"))
            .unwrap(),
        0
    );
    // Per-pod gauges (set by the main-thread VM on its tick): the cool pod scores above 0
    // (x1000), the hot one 0, both breakers closed (0).
    let gauge = |pod: &str, m: &str| envoy.stat(&format!("wasmcustom.ailb.endpoint.{pod}.{m}"));
    envoy
        .poll(
            std::time::Duration::from_secs(5),
            "the cool pod's score gauge",
            || (gauge(&cool, "score").ok()? > 0).then_some(()),
        )
        .unwrap();
    let stats = envoy.stats().unwrap();
    for m in ["score", "breaker_state"] {
        let name = format!("wasmcustom.ailb.endpoint.{hot}.{m}");
        assert_eq!(stats.get(&name), Some(&0), "{name}");
    }
    assert_eq!(gauge(&cool, "breaker_state").unwrap(), 0);
    let prom = envoy.prometheus().unwrap();
    let label = format!("ailb_endpoint_picks{{ailb_endpoint=\"{cool}\"}}");
    assert!(
        prom.lines().any(|l| l.starts_with(&label)),
        "no `{label}` line in /stats/prometheus:\n{}",
        prom.lines()
            .filter(|l| l.contains("ailb"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(
        !envoy.wasm_failed(),
        "wasm trapped:\n{}",
        envoy.log_tail(40)
    );
}
