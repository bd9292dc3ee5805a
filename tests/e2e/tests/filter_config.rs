//! Decides whether Envoy accepts the shipped config template and refuses a bad plugin config:
//! the template renders and passes `envoy --mode validate` with the real filter loaded, and a
//! config with an out-of-range field makes Envoy exit 1 with a log line naming the field.
//! Needs Envoy (`ENVOY_BIN` or `.venv/bin/envoy`) and the release wasm (see `envoy::wasm_path`).

use std::net::SocketAddr;
use std::time::Duration;

use ai_lb_e2e::envoy::{self, EnvoyOptions};

const GOOD: &str = r#"{"pools":[{"name":"default","cluster":"inference","agentCluster":"ai_lb_agents"}],"minPods":1}"#;

fn addrs(ports: &[u16]) -> Vec<SocketAddr> {
    ports
        .iter()
        .map(|p| SocketAddr::from(([127, 0, 0, 1], *p)))
        .collect()
}

#[test]
fn the_template_with_the_shipped_filter_config_passes_envoy_validate() {
    let shipped =
        std::fs::read_to_string(envoy::workspace_root().join("envoy-config/filter-config.json"))
            .expect("envoy-config/filter-config.json");
    let mut opts = EnvoyOptions::new(shipped);
    opts.inference = addrs(&[18001, 18002]);
    opts.agents = addrs(&[19001]);
    envoy::validate(&opts).unwrap();
}

#[test]
fn an_out_of_range_field_makes_envoy_exit_1_naming_the_field() {
    let bad =
        r#"{"pools":[{"name":"default","cluster":"inference"}],"cutoffs":{"gpuHardLimit":7}}"#;
    let mut opts = EnvoyOptions::new(bad);
    opts.inference = addrs(&[18001]);
    let out = envoy::run_until_exit(&opts, Duration::from_secs(50)).unwrap();
    assert_eq!(out.status.code(), Some(1), "envoy log:\n{}", out.log);
    let line = out
        .log
        .lines()
        .find(|l| l.contains("cutoffs.gpuHardLimit"))
        .unwrap_or_else(|| panic!("no log line names cutoffs.gpuHardLimit; log:\n{}", out.log));
    assert!(line.contains('7'), "the line should give the value: {line}");
}

#[test]
fn an_unknown_field_makes_envoy_exit_1_naming_it() {
    let bad = GOOD.replace("\"minPods\":1", "\"minPod\":1");
    let mut opts = EnvoyOptions::new(bad);
    opts.inference = addrs(&[18001]);
    let out = envoy::run_until_exit(&opts, Duration::from_secs(50)).unwrap();
    assert_eq!(out.status.code(), Some(1), "envoy log:\n{}", out.log);
    assert!(
        out.log
            .lines()
            .any(|l| l.contains("minPod") && l.contains("unknown field")),
        "no log line names the unknown field minPod; log:\n{}",
        out.log
    );
}
