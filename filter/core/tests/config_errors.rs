//! A table of bad plugin configurations: each error must name the field path and the value.

use ai_lb_filter_core::config::{FilterConfig, Mode};

const POOL: &str = r#"{"name":"llm","cluster":"inference"}"#;

fn with(top: &str) -> String {
    format!(r#"{{"pools":[{POOL}]{top}}}"#)
}

fn pool(fields: &str) -> String {
    format!(r#"{{"pools":[{{"name":"llm","cluster":"inference"{fields}}}]}}"#)
}

#[test]
fn bad_configs_name_their_field_and_value() {
    let table: Vec<(String, &str, &str)> = vec![
        (
            pool(r#","weights":{"gpu":-0.1}"#),
            "pools[0].weights.gpu",
            "-0.1",
        ),
        (
            pool(r#","weights":{"gpu":0,"queue":0}"#),
            "pools[0].weights",
            "\"gpu\":0",
        ),
        (
            pool(r#","podWeights":{"10.0.0.1:8000":{"memory":-1}}"#),
            "pools[0].podWeights.10.0.0.1:8000.memory",
            "-1",
        ),
        (
            pool(r#","podWeights":{"pod-a":{"gpu":1}}"#),
            "pools[0].podWeights",
            "\"pod-a\"",
        ),
        (pool(r#","bogus":1"#), "pools[0].bogus", ""),
        (
            r#"{"pools":[{"name":"","cluster":"x"}]}"#.to_string(),
            "pools[0].name",
            "\"\"",
        ),
        (
            format!(r#"{{"pools":[{POOL},{POOL}]}}"#),
            "pools[1].name",
            "\"llm\"",
        ),
        (
            format!(r#"{{"pools":[{POOL},{{"name":"b","cluster":"inference"}}]}}"#),
            "pools[1].cluster",
            "\"inference\"",
        ),
        (
            with(r#","weightTemplates":{"vision":{"p99":-2}}"#),
            "weightTemplates.vision.p99",
            "-2",
        ),
        (with(r#","mode":"proxy""#), "mode", "\"proxy\""),
        (
            with(r#","cutoffs":{"gpuHardLimit":1.5}"#),
            "cutoffs.gpuHardLimit",
            "1.5",
        ),
        (
            with(r#","cutoffs":{"gpuSignal":"nvml"}"#),
            "cutoffs.gpuSignal",
            "\"nvml\"",
        ),
        (
            with(r#","cutoffs":{"gpuHardLimit":0}"#),
            "cutoffs.gpuHardLimit",
            "0",
        ),
        (
            with(r#","cutoffs":{"slowdownFactor":0}"#),
            "cutoffs.slowdownFactor",
            "0",
        ),
        (
            with(r#","cutoffs":{"slowItlRatio":1.2}"#),
            "cutoffs.slowItlRatio",
            "1.2",
        ),
        (
            with(r#","cutoffs":{"slowItlRatio":-1}"#),
            "cutoffs.slowItlRatio",
            "-1",
        ),
        (
            with(r#","longOutputTokens":10000001"#),
            "longOutputTokens",
            "10000001",
        ),
        (with(r#","longOutputTokens":-5"#), "longOutputTokens", "-5"),
        (
            with(r#","longOutputSeatShare":1.5"#),
            "longOutputSeatShare",
            "1.5",
        ),
        (
            with(r#","longOutputSeatShare":-0.1"#),
            "longOutputSeatShare",
            "-0.1",
        ),
        (
            with(r#","cutoffs":{"cutModelServerDown":"yes"}"#),
            "cutoffs.cutModelServerDown",
            "yes",
        ),
        (
            with(r#","cutoffs":{"maxQueue":0}"#),
            "cutoffs.maxQueue",
            "0",
        ),
        (
            with(r#","cutoffs":{"p99TimeoutMs":0}"#),
            "cutoffs.p99TimeoutMs",
            "0",
        ),
        (
            with(r#","cutoffs":{"stalenessMs":0}"#),
            "cutoffs.stalenessMs",
            "0",
        ),
        (
            with(r#","cutoffs":{"stalenessMs":-5}"#),
            "cutoffs.stalenessMs",
            "",
        ),
        (with(r#","cutoffs":{"extra":1}"#), "cutoffs.extra", ""),
        (
            with(r#","breaker":{"baseCooldownMs":0}"#),
            "breaker.baseCooldownMs",
            "0",
        ),
        (
            with(r#","breaker":{"baseCooldownMs":5000,"maxCooldownMs":100}"#),
            "breaker.maxCooldownMs",
            "100",
        ),
        (
            with(r#","breaker":{"halfOpenProbes":0}"#),
            "breaker.halfOpenProbes",
            "0",
        ),
        (
            with(r#","breaker":{"consecutiveFailures":0}"#),
            "breaker.consecutiveFailures",
            "0",
        ),
        (
            with(r#","breaker":{"ttftSloMs":0}"#),
            "breaker.ttftSloMs",
            "0",
        ),
        (
            with(r#","breaker":{"failureRate":0}"#),
            "breaker.failureRate",
            "0",
        ),
        (
            with(r#","breaker":{"failureRate":1.5}"#),
            "breaker.failureRate",
            "1.5",
        ),
        (
            with(r#","breaker":{"agentErrorRate":-0.1}"#),
            "breaker.agentErrorRate",
            "-0.1",
        ),
        (
            with(r#","breaker":{"failureRateWindowMs":50}"#),
            "breaker.failureRateWindowMs",
            "50",
        ),
        (
            with(r#","breaker":{"failureRateMinRequests":0}"#),
            "breaker.failureRateMinRequests",
            "0",
        ),
        (with(r#","emaAlpha":0"#), "emaAlpha", "0"),
        (with(r#","emaAlpha":1.01"#), "emaAlpha", "1.01"),
        (with(r#","minPods":0"#), "minPods", "0"),
        (with(r#","floorWeight":1"#), "floorWeight", "1"),
        (
            with(r#","routingHeader":"X-Endpoint""#),
            "routingHeader",
            "\"X-Endpoint\"",
        ),
        (
            with(r#","routingHeader":"bad header""#),
            "routingHeader",
            "\"bad header\"",
        ),
        (with(r#","modelHeader":"""#), "modelHeader", "\"\""),
        (
            with(r#","debugHeader":":path""#),
            "debugHeader",
            "\":path\"",
        ),
        (
            with(r#","fallbackEndpoints":99"#),
            "fallbackEndpoints",
            "99",
        ),
        (
            with(r#","statusPath":"status""#),
            "statusPath",
            "\"status\"",
        ),
        (with(r#","watch":{"refreshMs":0}"#), "watch.refreshMs", "0"),
        (
            with(r#","watch":{"reconnectBaseMs":500,"reconnectMaxMs":10}"#),
            "watch.reconnectMaxMs",
            "10",
        ),
        (
            with(r#","watch":{"heartbeatMs":"x"}"#),
            "watch.heartbeatMs",
            "",
        ),
        (with(r#","unknownTop":true"#), "unknownTop", ""),
        (r#"{"pools":[]}"#.to_string(), "pools", "[]"),
        (r#"{"mode":"route"}"#.to_string(), "", ""),
    ];
    for (json, path, value) in &table {
        let err = match FilterConfig::from_json(json.as_bytes()) {
            Ok(_) => panic!("accepted bad config {json}"),
            Err(e) => e,
        };
        assert_eq!(&err.path, path, "config {json}: {err}");
        assert!(
            err.value.contains(value),
            "config {json}: value {:?} lacks {value:?}",
            err.value
        );
        assert!(!err.reason.is_empty());
        let text = err.to_string();
        assert!(text.contains(path), "{text}");
    }
}

#[test]
fn full_documented_example_parses() {
    let json = r#"{"mode": "route",
       "pools": [{"name": "llm", "cluster": "inference", "agentCluster": "agents",
                  "agentAuthority": "ai-lb-agent", "modelType": "llm",
                  "weights": {"gpu":0.35,"queue":0.25,"p99":0.25,"memory":0.15},
                  "podWeights": {"10.0.0.1:8000": {"gpu": 0.5, "queue": 0.2, "p99": 0.2, "memory": 0.1}}}],
       "weightTemplates": {"llm": {"gpu":1}, "vision": {"memory":1}, "speech": {"p99":1}},
       "cutoffs": {"gpuHardLimit": 0.95, "maxQueue": 64, "p99TimeoutMs": 5000, "stalenessMs": 2000},
       "breaker": {"consecutiveFailures": 5, "baseCooldownMs": 5000, "maxCooldownMs": 60000,
                   "halfOpenProbes": 3, "ttftSloMs": null},
       "emaAlpha": 0.3, "minPods": 3, "floorWeight": 0.05,
       "routingHeader": "x-gateway-destination-endpoint", "fallbackEndpoints": 2,
       "modelHeader": null, "debugHeader": null, "statusPath": null,
       "watch": {"minIntervalMs": 0, "heartbeatMs": 0, "reconnectBaseMs": 250, "reconnectMaxMs": 10000, "refreshMs": 20},
       "admission": null}"#;
    let c = FilterConfig::from_json(json.as_bytes()).unwrap();
    assert_eq!(c.mode, Mode::Route);
    assert_eq!(c.pools[0].agent_cluster, "agents");
    assert!((c.pools[0].weights_for("10.0.0.1:8000").gpu - 0.5).abs() < 1e-12);
    assert_eq!(c.breaker.ttft_slo_ms, None);
    assert_eq!(c.pool_by_cluster("inference"), Some(0));
}

#[test]
fn guard_mode_needs_no_pools_and_validates_admission() {
    let c = FilterConfig::from_json(
        br#"{"mode":"guard","pools":[],"admission":{"guard":{"gpuUtilCutoff":0.97}}}"#,
    )
    .unwrap();
    assert_eq!(c.mode, Mode::Guard);
    assert_eq!(c.admission.unwrap().guard.gpu_util_cutoff, 0.97);
    let e = FilterConfig::from_json(br#"{"mode":"guard","pools":[],"admission":{"anything":1}}"#)
        .unwrap_err();
    assert_eq!(e.path, "admission.anything");
    assert!(e.reason.contains("unknown field"), "{e}");
}
