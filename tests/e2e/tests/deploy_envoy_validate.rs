//! Decides whether the Envoy configuration that istio/ patches into the sidecars is accepted by
//! the real Envoy 1.40 (`envoy --mode validate`): the EnvoyFilter's cluster LB policy merged into
//! an Istio-shaped outbound cluster, the wasm filter definition (EXTENSION_CONFIG) inserted before
//! the router, the ECDS filter reference (HTTP_FILTER), and the guard WasmPlugin as Istio
//! renders it; for the native path (istio/native/), the same patches with the agents' loopback
//! tunnel, and the built native module loading the manifest's config by name from
//! ENVOY_DYNAMIC_MODULES_SEARCH_PATH, as in the sidecar. Envoy absent: each test fails under REQUIRE_ENVOY=1 (scripts/test.sh), else says
//! SKIPPED and passes.

mod deploy_support;

use deploy_support::*;
use serde_yaml::{Mapping, Value};

/// Istio's MERGE for CLUSTER patches, as far as these patches need it: maps merge recursively,
/// anything else is replaced (the patched fields are not set by istiod, so list append vs
/// replace makes no difference here).
fn merge(base: &mut Value, patch: &Value) {
    match (base, patch) {
        (Value::Mapping(b), Value::Mapping(p)) => {
            for (k, v) in p {
                match b.get_mut(k) {
                    Some(slot) => merge(slot, v),
                    None => {
                        b.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        (b, p) => *b = p.clone(),
    }
}

/// An outbound cluster shaped like the one istiod generates for the inference Service with
/// destinationrule.yaml applied (EDS swapped for STATIC so that no xDS server is needed).
fn istio_shaped_cluster(name: &str) -> Value {
    yaml(&format!(
        r#"
name: "{name}"
type: STATIC
connect_timeout: 2s
lb_policy: LEAST_REQUEST
least_request_lb_config: {{choice_count: 2}}
common_lb_config:
  healthy_panic_threshold: {{value: 0}}
circuit_breakers:
  thresholds:
  - {{max_connections: 10000, max_pending_requests: 10000, max_requests: 100000, max_retries: 1000}}
outlier_detection:
  consecutive_5xx: 5
  consecutive_gateway_failure: 3
  interval: 10s
  base_ejection_time: 30s
  max_ejection_percent: 50
typed_extension_protocol_options:
  envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
    "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
    common_http_protocol_options: {{idle_timeout: 3600s}}
    explicit_http_config: {{http_protocol_options: {{}}}}
load_assignment:
  cluster_name: "{name}"
  endpoints:
  - lb_endpoints:
    - endpoint: {{address: {{socket_address: {{address: 10.0.0.1, port_value: 8000}}}}}}
    - endpoint: {{address: {{socket_address: {{address: 10.0.0.2, port_value: 8000}}}}}}
"#
    ))
}

const INFERENCE_CLUSTER: &str = "outbound|8000||vllm-llama-8b.ai-inference.svc.cluster.local";

/// A bootstrap with one HTTP listener (filters + router) routing to `clusters[0]`.
fn bootstrap(http_filters: Vec<Value>, clusters: Vec<Value>) -> Value {
    let target = clusters
        .first()
        .and_then(|c| c["name"].as_str())
        .unwrap_or("none")
        .to_string();
    let mut filters = http_filters;
    filters.push(yaml(
        r#"
name: envoy.filters.http.router
typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}
"#,
    ));
    let mut b = yaml(&format!(
        r#"
static_resources:
  listeners:
  - name: outbound_0.0.0.0_8000
    address: {{socket_address: {{address: 127.0.0.1, port_value: 0}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: outbound_0.0.0.0_8000
          route_config:
            virtual_hosts:
            - name: inference
              domains: ["*"]
              routes: [{{match: {{prefix: /}}, route: {{cluster: "{target}"}}}}]
          http_filters: []
"#
    ));
    let hcm = &mut b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        ["typed_config"];
    hcm["http_filters"] = Value::Sequence(filters);
    b["static_resources"]["clusters"] = Value::Sequence(clusters);
    b
}

fn cluster_patch() -> Value {
    let ef = istio_named("EnvoyFilter", "ai-lb-route");
    let patches = ef["spec"]["configPatches"]
        .as_sequence()
        .cloned()
        .unwrap_or_default();
    let p = patches
        .into_iter()
        .find(|p| p["applyTo"].as_str() == Some("CLUSTER"))
        .unwrap_or_else(|| panic!("envoyfilter.yaml: no CLUSTER patch"));
    assert_eq!(p["patch"]["operation"].as_str(), Some("MERGE"));
    p["patch"]["value"].clone()
}

/// The EXTENSION_CONFIG's wasm filter as a static HTTP filter, its remote code replaced by a
/// local module file.
fn wasm_filter_with_local_code(ext: &Value, module: &std::path::Path) -> Value {
    let mut f = Mapping::new();
    f.insert("name".into(), ext["name"].clone());
    let mut typed = ext["typed_config"].clone();
    typed["config"]["vm_config"]["code"] =
        yaml(&format!("local: {{filename: \"{}\"}}", module.display()));
    f.insert("typed_config".into(), typed);
    Value::Mapping(f)
}

fn stub_module_file(dir: &tempfile::TempDir) -> std::path::PathBuf {
    let p = dir.path().join("stub.wasm");
    std::fs::write(&p, stub_wasm_module()).unwrap_or_else(|e| panic!("write stub: {e}"));
    p
}

#[test]
fn cluster_patch_merged_into_istio_cluster_is_valid() {
    let Some(envoy) = envoy_or_skip("cluster_patch_merged_into_istio_cluster_is_valid") else {
        return;
    };
    let mut cluster = istio_shaped_cluster(INFERENCE_CLUSTER);
    merge(&mut cluster, &cluster_patch());
    // The merged cluster must really carry the policy (not, e.g., a misspelt key).
    let policy = at(
        &cluster,
        "load_balancing_policy.policies.0.typed_extension_config",
    );
    assert_eq!(
        policy["name"].as_str(),
        Some("envoy.load_balancing_policies.override_host")
    );
    let v = envoy_validate(&envoy, &bootstrap(vec![], vec![cluster]));
    assert!(v.ok, "Envoy rejected the patched cluster:\n{}", v.output);
}

/// Pins the reason destinationrule.yaml must not use localityLbSetting.distribute: Envoy 1.40
/// refuses load_balancing_policy next to common_lb_config.locality_weighted_lb_config.
#[test]
fn cluster_patch_conflicts_with_locality_weighted_lb() {
    let Some(envoy) = envoy_or_skip("cluster_patch_conflicts_with_locality_weighted_lb") else {
        return;
    };
    let mut cluster = istio_shaped_cluster(INFERENCE_CLUSTER);
    cluster["common_lb_config"]["locality_weighted_lb_config"] = yaml("{}");
    merge(&mut cluster, &cluster_patch());
    let v = envoy_validate(&envoy, &bootstrap(vec![], vec![cluster]));
    assert!(
        !v.ok,
        "expected Envoy to refuse; it accepted:\n{}",
        v.output
    );
    assert!(
        v.output.contains("cannot be combined"),
        "refused for another reason:\n{}",
        v.output
    );
    let dr = std::fs::read_to_string(repo_root().join("istio/destinationrule.yaml"))
        .unwrap_or_else(|e| panic!("destinationrule.yaml: {e}"));
    let active: String = dr
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .collect::<Vec<_>>()
        .join("\n");
    assert!(
        !active.contains("distribute"),
        "destinationrule.yaml sets localityLbSetting.distribute, which breaks the override_host patch"
    );
}

#[test]
fn route_wasm_filter_before_router_is_valid() {
    let Some(envoy) = envoy_or_skip("route_wasm_filter_before_router_is_valid") else {
        return;
    };
    let ext = route_extension_config();
    let cfg = &ext["typed_config"]["config"];
    assert_eq!(
        cfg["allow_on_headers_stop_iteration"].as_bool(),
        Some(true),
        "body-based routing needs allow_on_headers_stop_iteration: true (requests hang without)"
    );
    assert_eq!(cfg["failure_policy"].as_str(), Some("FAIL_OPEN"));
    let remote = at(cfg, "vm_config.code.remote");
    assert!(
        remote["http_uri"]["uri"].as_str().is_some(),
        "remote code needs http_uri.uri"
    );
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let stub = stub_module_file(&dir);
    let mut cluster = istio_shaped_cluster(INFERENCE_CLUSTER);
    merge(&mut cluster, &cluster_patch());
    let b = bootstrap(
        vec![wasm_filter_with_local_code(&ext, &stub)],
        vec![cluster],
    );
    let v = envoy_validate(&envoy, &b);
    assert!(v.ok, "Envoy rejected the wasm filter config:\n{}", v.output);
}

/// The HTTP_FILTER patch references the EXTENSION_CONFIG by name over ECDS; Envoy must accept
/// its config_discovery block (default config, type URLs) in a listener.
#[test]
fn route_http_filter_insert_is_valid_ecds_reference() {
    let Some(envoy) = envoy_or_skip("route_http_filter_insert_is_valid_ecds_reference") else {
        return;
    };
    let ef = istio_named("EnvoyFilter", "ai-lb-route");
    let patches = ef["spec"]["configPatches"]
        .as_sequence()
        .cloned()
        .unwrap_or_default();
    let insert = patches
        .iter()
        .find(|p| p["applyTo"].as_str() == Some("HTTP_FILTER"))
        .unwrap_or_else(|| panic!("envoyfilter.yaml: no HTTP_FILTER patch"));
    assert_eq!(insert["patch"]["operation"].as_str(), Some("INSERT_BEFORE"));
    assert_eq!(
        at(insert, "match.listener.filterChain.filter.subFilter.name").as_str(),
        Some("envoy.filters.http.router"),
        "the filter must be inserted relative to the router"
    );
    let value = insert["patch"]["value"].clone();
    assert_eq!(
        value["name"],
        route_extension_config()["name"],
        "HTTP_FILTER must reference the EXTENSION_CONFIG by its name"
    );
    let b = with_ads(bootstrap(
        vec![value],
        vec![istio_shaped_cluster(INFERENCE_CLUSTER)],
    ));
    let v = envoy_validate(&envoy, &b);
    assert!(
        v.ok,
        "Envoy rejected the ECDS filter reference:\n{}",
        v.output
    );
}

/// `b` as a sidecar's bootstrap with an ADS server (istiod's place, never contacted by
/// `--mode validate`), so that ECDS references (`config_discovery` with `ads`) are accepted.
fn with_ads(mut b: Value) -> Value {
    b["node"] = yaml("{id: sidecar~10.0.0.9~client-0.ai-inference~ai-inference.svc.cluster.local, cluster: client.ai-inference}");
    b["dynamic_resources"] = yaml(
        r#"
ads_config:
  api_type: GRPC
  transport_api_version: V3
  grpc_services: [{envoy_grpc: {cluster_name: xds-grpc}}]
"#,
    );
    if let Some(clusters) = b["static_resources"]["clusters"].as_sequence_mut() {
        clusters.push(yaml(
            r#"
name: xds-grpc
type: STATIC
typed_extension_protocol_options:
  envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
    "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
    explicit_http_config: {http2_protocol_options: {}}
load_assignment:
  cluster_name: xds-grpc
  endpoints: [{lb_endpoints: [{endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: 15010}}}}]}]
"#,
        ));
    }
    b
}

/// The guard WasmPlugin as Istio renders it into the inbound chain: pluginConfig as a JSON
/// StringValue, FAIL_OPEN, no allow_on_headers_stop_iteration.
#[test]
fn guard_wasmplugin_renders_to_a_valid_filter() {
    let Some(envoy) = envoy_or_skip("guard_wasmplugin_renders_to_a_valid_filter") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let stub = stub_module_file(&dir);
    let guard = istio_named("WasmPlugin", "ai-lb-guard");
    let filter = guard_filter(&guard, &stub);
    let v = envoy_validate(
        &envoy,
        &bootstrap(
            vec![filter],
            vec![
                istio_shaped_cluster("inbound|8000||"),
                guard_agent_cluster(),
            ],
        ),
    );
    assert!(
        v.ok,
        "Envoy rejected the guard filter or its agent cluster:\n{}",
        v.output
    );
}

/// The cluster to the pod's own agent that istio/guard-agent-cluster.yaml adds to the guard's
/// sidecars (the guard's agentCluster).
fn guard_agent_cluster() -> Value {
    let ef = istio_named("EnvoyFilter", "ai-lb-guard-agent");
    config_patch(&ef, "CLUSTER")["patch"]["value"].clone()
}

fn guard_filter(guard: &Value, module: &std::path::Path) -> Value {
    let failure = match guard["spec"]["failStrategy"].as_str() {
        Some("FAIL_CLOSE") => "FAIL_CLOSED",
        _ => "FAIL_OPEN",
    };
    let mut f = yaml(&format!(
        r#"
name: ai-inference.ai-lb-guard
typed_config:
  "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
  config:
    name: ai-inference.ai-lb-guard
    root_id: ai_lb
    failure_policy: {failure}
    configuration:
      "@type": type.googleapis.com/google.protobuf.StringValue
      value: ""
    vm_config:
      runtime: envoy.wasm.runtime.v8
      code: {{local: {{filename: "{}"}}}}
"#,
        module.display()
    ));
    f["typed_config"]["config"]["configuration"]["value"] =
        Value::String(plugin_config_json(guard));
    f
}

/// With the real filter built, Envoy also runs its `on_configure` on every shipped config:
/// a config the filter refuses makes validation fail. Skipped when the module is not built
/// (a failure under REQUIRE_ENVOY=1).
#[test]
fn real_module_accepts_istio_configs() {
    let Some(envoy) = envoy_or_skip("real_module_accepts_istio_configs") else {
        return;
    };
    let Some(module) = ai_lb_e2e::require::or_skip(
        "real_module_accepts_istio_configs",
        "the wasm filter",
        ai_lb_e2e::envoy::wasm_path(),
    ) else {
        return;
    };
    let ext = route_extension_config();
    let mut cluster = istio_shaped_cluster(INFERENCE_CLUSTER);
    merge(&mut cluster, &cluster_patch());
    let agents = istio_shaped_cluster("outbound|9090||ai-lb-agents.ai-inference.svc.cluster.local");
    let b = bootstrap(
        vec![wasm_filter_with_local_code(&ext, &module)],
        vec![cluster.clone(), agents.clone()],
    );
    let v = envoy_validate(&envoy, &b);
    assert!(
        v.ok,
        "the filter refused envoyfilter.yaml's config:\n{}",
        v.output
    );

    let guard = istio_named("WasmPlugin", "ai-lb-guard");
    let b = bootstrap(
        vec![guard_filter(&guard, &module)],
        vec![cluster, agents, guard_agent_cluster()],
    );
    let v = envoy_validate(&envoy, &b);
    assert!(
        v.ok,
        "the filter refused guard-wasmplugin.yaml's config:\n{}",
        v.output
    );
}

/// The client sidecars' bootstrap override (istio/stats-bootstrap.yaml) carries the same
/// stats_tags as envoy-config/envoy.yaml, and Envoy accepts them (regexes compile).
#[test]
fn stats_bootstrap_override_matches_envoy_yaml_and_is_valid() {
    let cm = istio_named("ConfigMap", "ai-lb-stats-bootstrap");
    let json = cm["data"]["custom_bootstrap.json"]
        .as_str()
        .unwrap_or_else(|| panic!("stats-bootstrap.yaml: no custom_bootstrap.json"));
    let over: Value =
        serde_json::from_str(json).unwrap_or_else(|e| panic!("custom_bootstrap.json: {e}"));
    let tags = over["stats_config"]["stats_tags"].clone();
    assert!(
        tags.as_sequence().is_some_and(|t| !t.is_empty()),
        "no stats_tags"
    );

    // envoy.yaml is a template; its stats_config block has no placeholders.
    let text = std::fs::read_to_string(repo_root().join("envoy-config/envoy.yaml"))
        .unwrap_or_else(|e| panic!("envoy.yaml: {e}"));
    let block: String = text
        .lines()
        .skip_while(|l| !l.starts_with("stats_config:"))
        .take_while(|l| l.starts_with("stats_config:") || l.starts_with(' ') || l.is_empty())
        .collect::<Vec<_>>()
        .join("\n");
    let local = yaml(&block);
    assert_eq!(
        tags, local["stats_config"]["stats_tags"],
        "stats-bootstrap.yaml and envoy-config/envoy.yaml must tag the filter's metrics alike (the dashboard relies on it)"
    );

    let Some(envoy) = envoy_or_skip("stats_bootstrap_override_matches_envoy_yaml_and_is_valid")
    else {
        return;
    };
    let mut b = bootstrap(vec![], vec![istio_shaped_cluster(INFERENCE_CLUSTER)]);
    b["stats_config"] = over["stats_config"].clone();
    let v = envoy_validate(&envoy, &b);
    assert!(v.ok, "Envoy rejects the stats tags:\n{}", v.output);
}

// ---------------------------------------------------------------------------------------------
// The native path: istio/native/envoyfilter.yaml and stats-bootstrap.yaml
// ---------------------------------------------------------------------------------------------

const AGENTS_CLUSTER: &str = "outbound|9090||ai-lb-agents.ai-inference.svc.cluster.local";

/// The agents' outbound cluster as istiod builds it for a port with appProtocol grpc (HTTP/2).
fn istio_shaped_agents_cluster() -> Value {
    let mut c = istio_shaped_cluster(AGENTS_CLUSTER);
    c["typed_extension_protocol_options"]
        ["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]["explicit_http_config"] =
        yaml("{http2_protocol_options: {}}");
    c
}

/// A patch `applyTo` of the native router's EnvoyFilter, its operation checked.
fn native_patch(apply_to: &str, operation: &str) -> Value {
    let p = config_patch(&native_named("EnvoyFilter", "ai-lb-route"), apply_to);
    assert_eq!(
        p["patch"]["operation"].as_str(),
        Some(operation),
        "{apply_to}"
    );
    p["patch"]["value"].clone()
}

/// A sidecar's outbound side with the native router patched in: `http_filter` before the
/// router, the inference cluster with the native CLUSTER patch merged, the agents' cluster, and
/// the LISTENER patch's loopback tunnel as a second listener.
fn native_bootstrap(http_filter: Value) -> Value {
    let mut inference = istio_shaped_cluster(INFERENCE_CLUSTER);
    merge(&mut inference, &native_patch("CLUSTER", "MERGE"));
    let mut b = bootstrap(
        vec![http_filter],
        vec![inference, istio_shaped_agents_cluster()],
    );
    if let Some(listeners) = b["static_resources"]["listeners"].as_sequence_mut() {
        listeners.push(native_patch("LISTENER", "ADD"));
    }
    b
}

/// The native router's patches as Envoy sees them in a sidecar: the override_host cluster, the
/// agents' loopback tunnel (a listener whose tcp_proxy names the agents' cluster) and the ECDS
/// reference to the module's filter (its default config and allowed types).
#[test]
fn native_router_patches_are_valid_envoy_config() {
    let Some(envoy) = envoy_or_skip("native_router_patches_are_valid_envoy_config") else {
        return;
    };
    let insert = native_patch("HTTP_FILTER", "INSERT_BEFORE");
    let v = envoy_validate(&envoy, &with_ads(native_bootstrap(insert)));
    assert!(
        v.ok,
        "Envoy rejected the native router's patches:\n{}",
        v.output
    );
}

/// The EXTENSION_CONFIG's filter, loaded as the sidecar would load it: by name, from the
/// directory ENVOY_DYNAMIC_MODULES_SEARCH_PATH names, holding the module built here. Envoy runs
/// the module's program init (its Envoy-version check, which must find this Envoy supported)
/// and its config parse on the manifest's JSON; a config the module refuses fails validation,
/// which the second half shows with a field the module refuses.
#[test]
fn native_module_loads_the_istio_config_by_name() {
    let test = "native_module_loads_the_istio_config_by_name";
    let Some(envoy) = envoy_or_skip(test) else {
        return;
    };
    let Some(module) = ai_lb_e2e::require::or_skip(
        test,
        "the native module",
        ai_lb_e2e::envoy::native_module_path(),
    ) else {
        return;
    };
    let ext = native_extension_config();
    let name = at(&ext, "typed_config.dynamic_module_config.name")
        .as_str()
        .unwrap_or_else(|| panic!("istio/native/envoyfilter.yaml: no dynamic_module_config.name"));
    // The search directory holds lib<name>.so, as the pod's module volume does.
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let module = module
        .canonicalize()
        .unwrap_or_else(|e| panic!("{}: {e}", module.display()));
    std::os::unix::fs::symlink(&module, dir.path().join(format!("lib{name}.so")))
        .unwrap_or_else(|e| panic!("symlink: {e}"));
    let search = [("ENVOY_DYNAMIC_MODULES_SEARCH_PATH", dir.path())];

    let static_filter = |typed_config: Value| {
        let mut f = Mapping::new();
        f.insert("name".into(), ext["name"].clone());
        f.insert("typed_config".into(), typed_config);
        Value::Mapping(f)
    };
    let b = native_bootstrap(static_filter(ext["typed_config"].clone()));
    let v = envoy_validate_with(&envoy, &b, "info", &search);
    assert!(
        v.ok,
        "Envoy (or the module) refused istio/native/envoyfilter.yaml's filter:\n{}",
        v.output
    );
    let ((major, minor), version) = envoy_version(&envoy);
    for want in [
        format!("ai-lb native: built for Envoy {major}.{minor}"),
        format!("loaded into Envoy {version}: supported"),
        "Dynamic module ABI version v0.2.0 matched".to_string(),
    ] {
        assert!(v.output.contains(&want), "no {want:?} in:\n{}", v.output);
    }

    // Control: the same load with a value the module refuses (an unknown steering mode) fails
    // validation, so the module's parser did run on the manifest's config above.
    let mut config = native_module_config();
    config["steering"] = serde_json::json!("lb");
    let mut typed = ext["typed_config"].clone();
    typed["filter_config"]["value"] = Value::String(config.to_string());
    let v = envoy_validate_with(
        &envoy,
        &native_bootstrap(static_filter(typed)),
        "info",
        &search,
    );
    assert!(
        !v.ok && v.output.contains("`steering`") && v.output.contains("\"lb\""),
        "expected the module to refuse steering \"lb\":\n{}",
        v.output
    );
}

/// The native client sidecars' bootstrap override (istio/native/stats-bootstrap.yaml) tags the
/// module's stats as envoy-config/envoy-native.yaml does, and Envoy accepts it.
#[test]
fn native_stats_bootstrap_matches_envoy_native_yaml_and_is_valid() {
    let cm = native_named("ConfigMap", "ai-lb-stats-bootstrap");
    let json = cm["data"]["custom_bootstrap.json"]
        .as_str()
        .unwrap_or_else(|| panic!("istio/native/stats-bootstrap.yaml: no custom_bootstrap.json"));
    let over: Value =
        serde_json::from_str(json).unwrap_or_else(|e| panic!("custom_bootstrap.json: {e}"));
    // envoy-native.yaml is a template; its stats_config block has no placeholders.
    let text = std::fs::read_to_string(repo_root().join("envoy-config/envoy-native.yaml"))
        .unwrap_or_else(|e| panic!("envoy-native.yaml: {e}"));
    let block: String = text
        .lines()
        .skip_while(|l| !l.starts_with("stats_config:"))
        .take_while(|l| l.starts_with("stats_config:") || l.starts_with(' ') || l.is_empty())
        .collect::<Vec<_>>()
        .join("\n");
    let local = yaml(&block);
    assert!(
        local["stats_config"]["stats_tags"].is_sequence(),
        "envoy-native.yaml has no stats_config.stats_tags"
    );
    assert_eq!(
        over["stats_config"]["stats_tags"], local["stats_config"]["stats_tags"],
        "istio/native/stats-bootstrap.yaml and envoy-config/envoy-native.yaml must tag the module's stats alike"
    );
    let Some(envoy) =
        envoy_or_skip("native_stats_bootstrap_matches_envoy_native_yaml_and_is_valid")
    else {
        return;
    };
    let mut b = bootstrap(vec![], vec![istio_shaped_cluster(INFERENCE_CLUSTER)]);
    b["stats_config"] = over["stats_config"].clone();
    let v = envoy_validate(&envoy, &b);
    assert!(v.ok, "Envoy rejects the native stats tags:\n{}", v.output);
}
