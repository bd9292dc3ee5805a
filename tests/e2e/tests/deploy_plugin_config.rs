//! Decides whether every filter configuration shipped in istio/ and envoy-config/ is accepted
//! by the filter's own parser (`FilterConfig::from_json`, and `AdmissionConfig::from_value` for
//! the `admission` section), in the mode its manifest intends. A config the filter refuses
//! would make Envoy NACK the update (or exit at start-up), so it is caught here instead.

mod deploy_support;

use ai_lb_filter_core::admission::AdmissionConfig;
use ai_lb_filter_core::config::{FilterConfig, Mode};
use deploy_support::*;

fn parse(origin: &str, json: &str) -> FilterConfig {
    let cfg = FilterConfig::from_json(json.as_bytes())
        .unwrap_or_else(|e| panic!("{origin}: the filter refuses its config: {e}\n{json}"));
    if let Some(adm) = &cfg.admission {
        if let Err(e) = AdmissionConfig::from_value(adm) {
            panic!("{origin}: the filter refuses its admission config: {e}");
        }
    }
    cfg
}

#[test]
fn envoyfilter_route_config_is_accepted() {
    let json = wasm_configuration_json(&route_extension_config()["typed_config"]);
    let cfg = parse("istio/envoyfilter.yaml", &json);
    assert_eq!(cfg.mode, Mode::Route);
    assert_eq!(cfg.routing_header, "x-gateway-destination-endpoint");
    assert!(cfg.fallback_endpoints >= 1);
}

#[test]
fn wasmplugin_route_config_is_accepted_and_header_only() {
    let wp = istio_named("WasmPlugin", "ai-lb-route");
    let cfg = parse("istio/wasmplugin.yaml", &plugin_config_json(&wp));
    assert_eq!(cfg.mode, Mode::Route);
    // The premise of installing it without allow_on_headers_stop_iteration: nothing in it
    // needs the request body. With a modelHeader, a request lacking that header makes the
    // router pause for the body's `model`, which hangs without the flag.
    assert!(
        cfg.model_header.is_none(),
        "wasmplugin.yaml must not set modelHeader (requests without it would wait for the body)"
    );
    let adm = cfg
        .admission
        .as_ref()
        .map(AdmissionConfig::from_value)
        .transpose()
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        adm.is_some_and(|a| !a.enabled),
        "wasmplugin.yaml must disable body-based admission (set admission.enabled: false)"
    );
    // Same pool as the EnvoyFilter variant: switching install method changes nothing else.
    let ef = parse(
        "istio/envoyfilter.yaml",
        &wasm_configuration_json(&route_extension_config()["typed_config"]),
    );
    assert_eq!(cfg.pools, ef.pools);
    assert_eq!(cfg.cutoffs, ef.cutoffs);
    assert_eq!(cfg.routing_header, ef.routing_header);
    assert_eq!(cfg.fallback_endpoints, ef.fallback_endpoints);
}

/// The native router's `filter` section (istio/native/envoyfilter.yaml) is accepted in route
/// mode and routes as the wasm router does (istio/envoyfilter.yaml): the same pools, cut-offs,
/// routing header, fallbacks, model header, admission and big-request hold (off in both), so
/// switching data path changes nothing else. The module's own parser (agents, steering) runs in deploy_envoy_validate's
/// native_module_loads_the_istio_config_by_name.
#[test]
fn native_envoyfilter_filter_config_is_accepted_and_routes_like_the_wasm_one() {
    let module = native_module_config();
    let json = serde_json::to_string(&module["filter"]).unwrap_or_default();
    let cfg = parse("istio/native/envoyfilter.yaml (filter)", &json);
    assert_eq!(cfg.mode, Mode::Route);
    let wasm = parse(
        "istio/envoyfilter.yaml",
        &wasm_configuration_json(&route_extension_config()["typed_config"]),
    );
    let names = |c: &FilterConfig| {
        c.pools
            .iter()
            .map(|p| (p.name.clone(), p.cluster.clone(), p.model_type.clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(names(&cfg), names(&wasm));
    assert_eq!(cfg.cutoffs, wasm.cutoffs);
    assert_eq!(cfg.routing_header, wasm.routing_header);
    assert_eq!(cfg.fallback_endpoints, wasm.fallback_endpoints);
    assert_eq!(cfg.model_header, wasm.model_header);
    assert_eq!(cfg.admission, wasm.admission);
    assert_eq!(cfg.big_request_hold, wasm.big_request_hold);
}

#[test]
fn guard_config_is_accepted_in_guard_mode() {
    let wp = istio_named("WasmPlugin", "ai-lb-guard");
    let cfg = parse("istio/guard-wasmplugin.yaml", &plugin_config_json(&wp));
    assert_eq!(cfg.mode, Mode::Guard);
    let adm = cfg
        .admission
        .as_ref()
        .map(AdmissionConfig::from_value)
        .transpose()
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|| panic!("guard-wasmplugin.yaml: no admission section"));
    assert!(
        adm.enabled && adm.guard.enabled,
        "the guard must be enabled"
    );
}

#[test]
fn compose_config_is_accepted_and_names_envoy_yaml_clusters() {
    let path = repo_root().join("envoy-config/compose/filter-config.json");
    let json = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let cfg = parse("envoy-config/compose/filter-config.json", &json);
    assert_eq!(cfg.mode, Mode::Route);
    assert_names_envoy_yaml_clusters("compose filter config", &cfg);
}

/// Every cluster `cfg`'s pools name (inference and agents) is defined in envoy-config/envoy.yaml.
fn assert_names_envoy_yaml_clusters(origin: &str, cfg: &FilterConfig) {
    let envoy_yaml = std::fs::read_to_string(repo_root().join("envoy-config/envoy.yaml"))
        .unwrap_or_else(|e| panic!("envoy.yaml: {e}"));
    for pool in &cfg.pools {
        for cluster in [&pool.cluster, &pool.agent_cluster] {
            assert!(
                envoy_yaml.contains(&format!("- name: {cluster}\n")),
                "{origin} names cluster {cluster:?}, which envoy-config/envoy.yaml does not define"
            );
        }
    }
}

/// The sample config next to envoy.yaml, which envoy-config/render.sh renders by default and
/// the demo and the benchmark run with, is shipped, accepted in route mode and names clusters
/// envoy.yaml defines.
#[test]
fn envoy_config_sample_filter_config_is_accepted() {
    let path = repo_root().join("envoy-config/filter-config.json");
    let json = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (the shipped sample config: envoy-config/render.sh, the demo and the \
             benchmark read it)",
            path.display()
        )
    });
    let cfg = parse("envoy-config/filter-config.json", &json);
    assert_eq!(cfg.mode, Mode::Route);
    assert_names_envoy_yaml_clusters("envoy-config/filter-config.json", &cfg);
}
