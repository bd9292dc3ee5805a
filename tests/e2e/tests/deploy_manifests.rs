//! Decides whether the Istio manifests in istio/ (the wasm install) and istio/native/ (the
//! native module's overlay on it) are structurally sound before they meet a cluster: every YAML
//! document parses, each object has the apiVersion/kind and required fields of its kind, and
//! the names that must agree across files (Service ↔ cluster names in the filter config,
//! routing header ↔ override_host source, retries ↔ fallback endpoints, probes ↔ ports; for
//! the native path also module name ↔ the file the init container writes, search path ↔ the
//! sidecar's mount, agents address ↔ the loopback listener) do agree. No cluster, no network.

mod deploy_support;

use std::collections::BTreeSet;

use deploy_support::*;
use serde_yaml::Value;

fn s<'a>(v: &'a Value, path: &str) -> &'a str {
    at(v, path)
        .as_str()
        .unwrap_or_else(|| panic!("missing string {path} in {}", describe(v)))
}

fn describe(v: &Value) -> String {
    format!(
        "{} {}",
        v["kind"].as_str().unwrap_or("?"),
        v["metadata"]["name"].as_str().unwrap_or("?")
    )
}

fn seq<'a>(v: &'a Value, path: &str) -> &'a Vec<Value> {
    at(v, path)
        .as_sequence()
        .unwrap_or_else(|| panic!("missing list {path} in {}", describe(v)))
}

#[test]
fn every_yaml_document_in_istio_and_envoy_config_parses() {
    let root = repo_root();
    let mut files = files_with_ext(&root.join("istio"), &[".yaml", ".yml"]);
    files.extend(files_with_ext(
        &root.join("envoy-config"),
        &[".yaml", ".yml"],
    ));
    assert!(
        files.len() >= 10,
        "expected the istio/ and envoy-config/ YAML files, found {files:?}"
    );
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        // envoy-config/envoy.yaml is a template: its ${NAME}s (in flow mappings) are not YAML
        // until rendered. Parse it with each placeholder as a plain scalar here; the rendered
        // file is validated by Envoy in deploy_compose.rs.
        let text = if text.contains("${") {
            placeholders_as_scalars(&text)
        } else {
            text
        };
        let docs = parse_all(&text).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        assert!(!docs.is_empty(), "{}: no YAML document", f.display());
    }
}

fn placeholders_as_scalars(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("${") {
        out.push_str(&rest[..i]);
        let after = &rest[i + 2..];
        let end = after.find('}').unwrap_or(after.len());
        out.push_str("TEMPLATE_");
        out.push_str(&after[..end]);
        rest = after.get(end + 1..).unwrap_or("");
    }
    out.push_str(rest);
    out
}

fn parse_all(text: &str) -> Result<Vec<Value>, String> {
    use serde::Deserialize;
    let mut docs = Vec::new();
    for de in serde_yaml::Deserializer::from_str(text) {
        let v = Value::deserialize(de).map_err(|e| e.to_string())?;
        if !v.is_null() {
            docs.push(v);
        }
    }
    Ok(docs)
}

/// Expected apiVersion per kind; an object of any other kind fails (add its check here).
fn expected_api_version(kind: &str) -> Option<&'static str> {
    Some(match kind {
        "Namespace" | "Service" | "ConfigMap" => "v1",
        "Deployment" => "apps/v1",
        "DestinationRule" | "VirtualService" => "networking.istio.io/v1",
        "EnvoyFilter" => "networking.istio.io/v1alpha3",
        "WasmPlugin" => "extensions.istio.io/v1alpha1",
        "PeerAuthentication" => "security.istio.io/v1",
        "Kustomization" => "kustomize.config.k8s.io/v1beta1",
        _ => return None,
    })
}

#[test]
fn each_object_has_its_kinds_api_version_and_required_fields() {
    let objects = istio_objects();
    let mut kinds = BTreeSet::new();
    for (file, obj) in &objects {
        let kind = obj["kind"]
            .as_str()
            .unwrap_or_else(|| panic!("{}: object without kind", file.display()));
        kinds.insert(kind.to_string());
        let want = expected_api_version(kind)
            .unwrap_or_else(|| panic!("{}: unexpected kind {kind}", file.display()));
        assert_eq!(
            obj["apiVersion"].as_str(),
            Some(want),
            "{}: {kind}",
            file.display()
        );
        if kind != "Kustomization" {
            assert!(
                obj["metadata"]["name"].as_str().is_some(),
                "{}: {kind} without name",
                file.display()
            );
        }
        if !matches!(kind, "Namespace" | "Kustomization") {
            assert_eq!(
                obj["metadata"]["namespace"].as_str(),
                Some("ai-inference"),
                "{}: {} must be in ai-inference (the filter configs name it)",
                file.display(),
                describe(obj)
            );
        }
        match kind {
            "Deployment" => check_deployment(obj),
            "Service" => check_service(obj),
            "DestinationRule" => check_destination_rule(obj),
            "VirtualService" => check_virtual_service(obj),
            "EnvoyFilter" => check_envoy_filter(obj),
            "WasmPlugin" => check_wasm_plugin(obj),
            "ConfigMap" => check_config_map(obj),
            "PeerAuthentication" => check_peer_authentication(obj),
            _ => {}
        }
    }
    for k in [
        "Namespace",
        "Deployment",
        "Service",
        "DestinationRule",
        "VirtualService",
        "EnvoyFilter",
        "WasmPlugin",
        "PeerAuthentication",
        "Kustomization",
    ] {
        assert!(kinds.contains(k), "istio/ has no {k}");
    }
}

fn check_deployment(d: &Value) {
    let selector = at(d, "spec.selector.matchLabels")
        .as_mapping()
        .unwrap_or_else(|| panic!("{}: no selector", describe(d)));
    let labels = &d["spec"]["template"]["metadata"]["labels"];
    for (k, v) in selector {
        assert_eq!(
            labels.get(k),
            Some(v),
            "{}: selector {k:?} not in pod labels",
            describe(d)
        );
    }
    let containers = seq(d, "spec.template.spec.containers");
    assert!(!containers.is_empty());
    for c in containers {
        let name = s(c, "name");
        assert!(
            c["image"].as_str().is_some(),
            "container {name} has no image"
        );
        assert!(
            c["resources"]["requests"].is_mapping(),
            "container {name} has no resource requests"
        );
        assert_eq!(
            c["securityContext"]["runAsNonRoot"].as_bool(),
            Some(true),
            "container {name} must run as non-root"
        );
        assert_eq!(
            c["securityContext"]["allowPrivilegeEscalation"].as_bool(),
            Some(false)
        );
        assert!(
            c["livenessProbe"].is_mapping(),
            "container {name} has no liveness probe"
        );
        assert!(
            c["readinessProbe"].is_mapping(),
            "container {name} has no readiness probe"
        );
        // Every $(VAR) in args must be defined in env (Kubernetes leaves unknown ones as text).
        let env: BTreeSet<&str> = c["env"]
            .as_sequence()
            .map(|e| e.iter().filter_map(|x| x["name"].as_str()).collect())
            .unwrap_or_default();
        for arg in c["args"]
            .as_sequence()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
        {
            let mut rest = arg;
            while let Some(i) = rest.find("$(") {
                let after = &rest[i + 2..];
                let end = after.find(')').unwrap_or(after.len());
                let var = &after[..end];
                assert!(
                    env.contains(var),
                    "container {name}: arg {arg:?} uses $({var}) not in env"
                );
                rest = &after[end..];
            }
        }
        // Probes name ports the container declares.
        let ports: BTreeSet<&str> = c["ports"]
            .as_sequence()
            .map(|p| p.iter().filter_map(|x| x["name"].as_str()).collect())
            .unwrap_or_default();
        for probe in ["livenessProbe", "readinessProbe", "startupProbe"] {
            if let Some(port) = c[probe]["httpGet"]["port"].as_str() {
                assert!(
                    ports.contains(port),
                    "container {name}: {probe} uses undeclared port {port}"
                );
            }
        }
    }
}

/// The agent's ports are STRICT mTLS on the pods that run the agent: the selector matches the
/// inference Deployment's pod labels and every port the agent container exposes is listed.
fn check_peer_authentication(pa: &Value) {
    let selector = at(pa, "spec.selector.matchLabels")
        .as_mapping()
        .unwrap_or_else(|| panic!("{}: no selector (port-level mTLS needs one)", describe(pa)));
    let agent_pods: Vec<Value> = istio_kind("Deployment")
        .into_iter()
        .filter(|d| {
            seq(d, "spec.template.spec.containers")
                .iter()
                .any(|c| c["name"].as_str() == Some("ai-lb-agent"))
        })
        .collect();
    assert!(!agent_pods.is_empty(), "no Deployment runs the ai-lb-agent");
    for d in &agent_pods {
        let labels = &d["spec"]["template"]["metadata"]["labels"];
        for (k, v) in selector {
            assert_eq!(
                labels.get(k),
                Some(v),
                "{}: selector {k:?} does not select {}",
                describe(pa),
                describe(d)
            );
        }
        let agent = seq(d, "spec.template.spec.containers")
            .iter()
            .find(|c| c["name"].as_str() == Some("ai-lb-agent"))
            .cloned()
            .unwrap_or(Value::Null);
        for port in seq(&agent, "ports") {
            let n = port["containerPort"].as_u64().unwrap_or(0);
            // Keys are strings: Kubernetes' JSON has no integer keys (kubectl refuses them).
            let mode = pa["spec"]["portLevelMtls"]
                .get(Value::String(n.to_string()))
                .and_then(|m| m["mode"].as_str());
            assert_eq!(
                mode,
                Some("STRICT"),
                "{}: the agent's port {n} ({}) is not STRICT mTLS",
                describe(pa),
                port["name"].as_str().unwrap_or("?")
            );
        }
    }
}

fn check_config_map(cm: &Value) {
    let data = cm["data"]
        .as_mapping()
        .unwrap_or_else(|| panic!("{}: no data", describe(cm)));
    for (k, v) in data {
        let (Some(k), Some(v)) = (k.as_str(), v.as_str()) else {
            panic!("{}: data entries must be strings", describe(cm));
        };
        if k.ends_with(".json") {
            serde_json::from_str::<serde_json::Value>(v)
                .unwrap_or_else(|e| panic!("{} {k}: invalid JSON: {e}", describe(cm)));
        }
    }
}

fn check_service(svc: &Value) {
    let ports = seq(svc, "spec.ports");
    assert!(!ports.is_empty(), "{}: no ports", describe(svc));
    for p in ports {
        assert!(
            p["port"].as_u64().is_some(),
            "{}: port without number",
            describe(svc)
        );
        assert!(
            p["name"].as_str().is_some(),
            "{}: unnamed port",
            describe(svc)
        );
    }
    assert!(
        svc["spec"]["selector"].is_mapping(),
        "{}: no selector",
        describe(svc)
    );
}

fn check_destination_rule(dr: &Value) {
    assert!(
        dr["spec"]["host"].as_str().is_some(),
        "{}: no host",
        describe(dr)
    );
    assert!(
        dr["spec"]["trafficPolicy"]["connectionPool"].is_mapping(),
        "{}: no connectionPool",
        describe(dr)
    );
    assert!(
        dr["spec"]["trafficPolicy"]["outlierDetection"].is_mapping(),
        "{}: no outlierDetection",
        describe(dr)
    );
}

fn check_virtual_service(vs: &Value) {
    assert!(!seq(vs, "spec.hosts").is_empty());
    for route in seq(vs, "spec.http") {
        assert!(!seq(route, "route").is_empty());
        let r = &route["retries"];
        assert!(
            r["attempts"].as_u64().is_some(),
            "{}: retries.attempts",
            describe(vs)
        );
        assert!(
            r["perTryTimeout"].as_str().is_some(),
            "{}: retries.perTryTimeout",
            describe(vs)
        );
        let on: BTreeSet<&str> = s(r, "retryOn").split(',').map(str::trim).collect();
        for want in ["5xx", "reset", "connect-failure", "retriable-status-codes"] {
            assert!(on.contains(want), "{}: retryOn lacks {want}", describe(vs));
        }
    }
}

fn check_envoy_filter(ef: &Value) {
    for p in seq(ef, "spec.configPatches") {
        let apply = s(p, "applyTo");
        assert!(
            [
                "CLUSTER",
                "EXTENSION_CONFIG",
                "HTTP_FILTER",
                "LISTENER",
                "NETWORK_FILTER",
                "ROUTE_CONFIGURATION",
                "VIRTUAL_HOST",
                "HTTP_ROUTE",
                "BOOTSTRAP"
            ]
            .contains(&apply),
            "{}: applyTo {apply}",
            describe(ef)
        );
        let op = s(p, "patch.operation");
        assert!(
            [
                "MERGE",
                "ADD",
                "REMOVE",
                "INSERT_BEFORE",
                "INSERT_AFTER",
                "INSERT_FIRST",
                "REPLACE"
            ]
            .contains(&op),
            "{}: operation {op}",
            describe(ef)
        );
        if let Some(ctx) = p["match"]["context"].as_str() {
            assert!(["ANY", "SIDECAR_INBOUND", "SIDECAR_OUTBOUND", "GATEWAY"].contains(&ctx));
        }
        assert!(
            p["patch"]["value"].is_mapping(),
            "{}: patch without value",
            describe(ef)
        );
    }
}

fn check_wasm_plugin(wp: &Value) {
    let name = describe(wp);
    let url = s(wp, "spec.url");
    assert!(
        url.starts_with("oci://") || url.starts_with("https://"),
        "{name}: url {url}"
    );
    // A template: the render step (istio/render.sh) writes the digest.
    assert_eq!(
        s(wp, "spec.sha256"),
        TEMPLATE_MARKER,
        "{name}: sha256 (see module_checksums_are_render_markers)"
    );
    assert!(
        ["FAIL_OPEN", "FAIL_CLOSE"].contains(&s(wp, "spec.failStrategy")),
        "{name}: failStrategy"
    );
    assert!(
        ["AUTHN", "AUTHZ", "STATS", "UNSPECIFIED_PHASE"].contains(&s(wp, "spec.phase")),
        "{name}: phase"
    );
    assert_eq!(s(wp, "spec.type"), "HTTP", "{name}: type");
    assert!(
        wp["spec"]["selector"]["matchLabels"].is_mapping()
            || wp["spec"]["targetRefs"].is_sequence(),
        "{name}: needs selector or targetRefs"
    );
    assert!(
        wp["spec"]["pluginConfig"].is_mapping(),
        "{name}: pluginConfig"
    );
}

/// `ai_lb_wasm_oci::render::TEMPLATE_MARKER` (tools/wasm-oci), the sha256 of the templates.
const TEMPLATE_MARKER: &str = "NOT-RENDERED: run istio/render.sh (docs/install-istio.md)";

/// istio/ holds templates: every module checksum (WasmPlugin `spec.sha256`, the ECDS wasm
/// `remote.sha256`) is the render step's marker, which the WasmPlugin CRD's pattern
/// `(^$|^[a-f0-9]{64}$)` refuses and istio-agent never matches, so the directory cannot be
/// applied as if it carried a real digest. No file holds an all-zero digest-shaped
/// placeholder (which the CRD would accept). The rendered output is checked by
/// tools/wasm-oci's tests (istio_image.rs).
#[test]
fn module_checksums_are_render_markers_and_no_placeholder_digest_is_shipped() {
    let zeros = "0".repeat(64);
    let mut sums = Vec::new();
    for (file, obj) in istio_objects() {
        let text = std::fs::read_to_string(&file).unwrap();
        assert!(
            !text.contains(&zeros),
            "{}: an all-zero digest placeholder",
            file.display()
        );
        match obj["kind"].as_str() {
            Some("WasmPlugin") => sums.push((describe(&obj), s(&obj, "spec.sha256").to_string())),
            Some("EnvoyFilter") => {
                for p in seq(&obj, "spec.configPatches") {
                    let remote = at(p, "patch.value.typed_config.config.vm_config.code.remote");
                    if remote.is_mapping() {
                        assert!(
                            remote["http_uri"]["uri"].as_str().is_some(),
                            "{}: remote code without http_uri.uri",
                            describe(&obj)
                        );
                        sums.push((describe(&obj), s(remote, "sha256").to_string()));
                    }
                }
            }
            _ => {}
        }
    }
    assert_eq!(
        sums.len(),
        3,
        "router EnvoyFilter, guard and router WasmPlugins: {sums:?}"
    );
    for (what, sum) in sums {
        assert_eq!(sum, TEMPLATE_MARKER, "{what}: sha256");
    }
}

#[test]
fn kustomization_lists_existing_files_and_not_both_router_installs() {
    let k = load_yaml("istio/kustomization.yaml");
    let resources: Vec<&str> = seq(&k, "resources")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    for r in &resources {
        assert!(
            repo_root().join("istio").join(r).is_file(),
            "kustomization: {r} does not exist"
        );
    }
    assert!(resources.contains(&"envoyfilter.yaml"));
    assert!(resources.contains(&"guard-wasmplugin.yaml"));
    assert!(
        !resources.contains(&"wasmplugin.yaml"),
        "wasmplugin.yaml and envoyfilter.yaml both install the router: the filter would run twice"
    );
    // Every other manifest of istio/ is installed (istio/native/ is an overlay with its own
    // kustomization, checked by native_kustomization_is_an_overlay_of_the_rendered_install).
    for f in files_in(&repo_root().join("istio"), &[".yaml"]) {
        let n = f.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        if n != "kustomization.yaml" && n != "wasmplugin.yaml" {
            assert!(
                resources.contains(&n),
                "kustomization.yaml does not list {n}"
            );
        }
    }
}

fn route_config() -> serde_json::Value {
    let json = wasm_configuration_json(&route_extension_config()["typed_config"]);
    serde_json::from_str(&json).unwrap_or_else(|e| panic!("route config JSON: {e}"))
}

/// Istio's outbound cluster name of a Service port.
fn outbound(svc: &Value, port: u64) -> String {
    format!(
        "outbound|{port}||{}.{}.svc.cluster.local",
        s(svc, "metadata.name"),
        s(svc, "metadata.namespace")
    )
}

#[test]
fn filter_config_names_the_clusters_istio_builds_for_the_services() {
    let inference = istio_named("Service", "vllm-llama-8b");
    let agents = istio_named("Service", "ai-lb-agents");
    let agent_port = &seq(&agents, "spec.ports")[0];
    assert_eq!(
        agent_port["appProtocol"].as_str(),
        Some("grpc"),
        "agents Service needs appProtocol grpc (HTTP/2)"
    );
    assert!(
        agents["spec"]["clusterIP"].as_str() != Some("None"),
        "headless Services get ORIGINAL_DST clusters"
    );
    let inference_port = seq(&inference, "spec.ports")[0]["port"]
        .as_u64()
        .unwrap_or(0);
    let agent_port_n = agent_port["port"].as_u64().unwrap_or(0);

    let route = route_config();
    let pool = &route["pools"][0];
    assert_eq!(
        pool["cluster"].as_str(),
        Some(outbound(&inference, inference_port).as_str())
    );
    assert_eq!(
        pool["agentCluster"].as_str(),
        Some(outbound(&agents, agent_port_n).as_str())
    );
    for wp in istio_kind("WasmPlugin") {
        let p = &wp["spec"]["pluginConfig"]["pools"][0];
        // The guard watches its own pod's agent (guard_watches_its_own_pods_agent); a router
        // watches the pool through any agent of the Service.
        if wp["spec"]["pluginConfig"]["mode"].as_str() == Some("guard") {
            continue;
        }
        assert_eq!(
            p["agentCluster"],
            serde_yaml::to_value(outbound(&agents, agent_port_n)).unwrap_or_default(),
            "{}",
            describe(&wp)
        );
    }

    // The CLUSTER patch matches the same Service and port.
    let ef = istio_named("EnvoyFilter", "ai-lb-route");
    let cp = seq(&ef, "spec.configPatches")
        .iter()
        .find(|p| p["applyTo"].as_str() == Some("CLUSTER"))
        .cloned()
        .unwrap_or_default();
    assert_eq!(
        s(&cp, "match.cluster.service"),
        format!(
            "{}.ai-inference.svc.cluster.local",
            s(&inference, "metadata.name")
        )
    );
    assert_eq!(
        at(&cp, "match.cluster.portNumber").as_u64(),
        Some(inference_port)
    );
    // ... and the HTTP_FILTER goes on that port's outbound listener.
    let hf = seq(&ef, "spec.configPatches")
        .iter()
        .find(|p| p["applyTo"].as_str() == Some("HTTP_FILTER"))
        .cloned()
        .unwrap_or_default();
    assert_eq!(
        at(&hf, "match.listener.portNumber").as_u64(),
        Some(inference_port)
    );
    assert_eq!(s(&hf, "match.context"), "SIDECAR_OUTBOUND");

    // override_host reads the header the filter writes.
    let source = at(
        &cp,
        "patch.value.load_balancing_policy.policies.0.typed_extension_config.typed_config.override_host_sources.0.header",
    );
    assert_eq!(source.as_str(), route["routingHeader"].as_str());
    let fallback = at(
        &cp,
        "patch.value.load_balancing_policy.policies.0.typed_extension_config.typed_config.fallback_policy.policies.0.typed_extension_config.name",
    );
    assert_eq!(
        fallback.as_str(),
        Some("envoy.load_balancing_policies.least_request")
    );
}

#[test]
fn retries_match_the_fallback_endpoint_list() {
    let route = route_config();
    let fallback = route["fallbackEndpoints"].as_u64().unwrap_or(0);
    assert!(
        fallback >= 1,
        "the router should name fallback endpoints for retries"
    );
    let vs = istio_named("VirtualService", "vllm-llama-8b");
    let inference = istio_named("Service", "vllm-llama-8b");
    let host = format!(
        "{}.ai-inference.svc.cluster.local",
        s(&inference, "metadata.name")
    );
    assert_eq!(seq(&vs, "spec.hosts")[0].as_str(), Some(host.as_str()));
    let http = &seq(&vs, "spec.http")[0];
    assert_eq!(
        http["retries"]["attempts"].as_u64(),
        Some(fallback),
        "each retry should go to the next ranked endpoint: attempts == fallbackEndpoints"
    );
    let dr = istio_named("DestinationRule", "vllm-llama-8b");
    assert_eq!(s(&dr, "spec.host"), host);
}

#[test]
fn inference_pod_runs_the_agent_sidecar_wired_to_its_services() {
    let d = istio_named("Deployment", "vllm-llama-8b");
    let containers = seq(&d, "spec.template.spec.containers");
    let vllm = containers
        .iter()
        .find(|c| c["name"].as_str() == Some("vllm"))
        .cloned()
        .unwrap_or_default();
    let agent = containers
        .iter()
        .find(|c| c["name"].as_str() == Some("ai-lb-agent"))
        .cloned()
        .unwrap_or_default();
    assert!(
        vllm["resources"]["limits"]["nvidia.com/gpu"]
            .as_str()
            .is_some(),
        "the model server needs nvidia.com/gpu"
    );
    assert!(
        agent["resources"]["limits"]["nvidia.com/gpu"].is_null(),
        "the agent must not take a second GPU"
    );
    assert_eq!(s(&agent, "livenessProbe.httpGet.path"), "/healthz");
    assert_eq!(s(&agent, "readinessProbe.httpGet.path"), "/readyz");

    let args: Vec<&str> = seq(&agent, "args")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let flag = |f: &str| {
        args.iter()
            .find_map(|a| a.strip_prefix(&format!("--{f}=")))
            .unwrap_or_else(|| panic!("agent has no --{f}"))
    };
    let vllm_port = seq(&vllm, "ports")[0]["containerPort"]
        .as_u64()
        .unwrap_or(0);
    assert_eq!(flag("serving-address"), format!("$(POD_IP):{vllm_port}"));
    let grpc_port = flag("grpc-listen")
        .rsplit(':')
        .next()
        .and_then(|p| p.parse::<u64>().ok());
    let http_port = flag("http-listen")
        .rsplit(':')
        .next()
        .and_then(|p| p.parse::<u64>().ok());
    let agent_ports = seq(&agent, "ports");
    let port_of = |name: &str| {
        agent_ports
            .iter()
            .find(|p| p["name"].as_str() == Some(name))
            .and_then(|p| p["containerPort"].as_u64())
    };
    assert_eq!(grpc_port, port_of("grpc-agent"));
    assert_eq!(http_port, port_of(s(&agent, "readinessProbe.httpGet.port")));
    let peers = istio_named("Service", "ai-lb-agents-peers");
    assert_eq!(
        peers["spec"]["clusterIP"].as_str(),
        Some("None"),
        "peer discovery needs a headless Service"
    );
    assert_eq!(
        flag("peers-dns"),
        format!(
            "ai-lb-agents-peers.ai-inference.svc.cluster.local:{}",
            grpc_port.unwrap_or(0)
        )
    );
    // The Services select the pods.
    let labels = &d["spec"]["template"]["metadata"]["labels"];
    for svc in istio_kind("Service") {
        for (k, v) in svc["spec"]["selector"].as_mapping().into_iter().flatten() {
            assert_eq!(
                labels.get(k),
                Some(v),
                "{} selects {k:?}={v:?}, not on the pods",
                describe(&svc)
            );
        }
    }
    // The guard selects the inference pods, and only them.
    let guard = istio_named("WasmPlugin", "ai-lb-guard");
    for (k, v) in guard["spec"]["selector"]["matchLabels"]
        .as_mapping()
        .into_iter()
        .flatten()
    {
        assert_eq!(
            labels.get(k),
            Some(v),
            "guard selector {k:?} not on the inference pods"
        );
    }
    let m = &seq(&guard, "spec.match")[0];
    assert_eq!(m["mode"].as_str(), Some("SERVER"));
    assert_eq!(
        m["ports"][0]["number"].as_u64(),
        Some(vllm_port),
        "guard only on the model server's port"
    );
}

/// envoy-config/envoy-epp.yaml (the llm-d endpoint-picker baseline), rendered as the e2e
/// harness and the benchmark render it, passes `envoy --mode validate`.
#[test]
fn rendered_epp_template_passes_envoy_validate() {
    let epp = "127.0.0.1:9002".parse().unwrap();
    let pods = [
        "127.0.0.1:8001".parse().unwrap(),
        "127.0.0.1:8002".parse().unwrap(),
    ];
    let opts = ai_lb_e2e::epp::envoy_options(epp, &pods).unwrap();
    if let Err(e) = ai_lb_e2e::envoy::validate(&opts) {
        panic!("envoy-config/envoy-epp.yaml: {e}");
    }
}

// ---------------------------------------------------------------------------------------------
// The native path: istio/native/
// ---------------------------------------------------------------------------------------------

/// Each object of the overlay is well formed for its kind and patches an object of the wasm
/// install with the same kind and name (kustomize applies them as patches).
#[test]
fn native_objects_are_well_formed_patches_of_install_objects() {
    let base: Vec<(String, String)> = istio_objects()
        .iter()
        .map(|(_, v)| {
            (
                v["kind"].as_str().unwrap_or("").to_string(),
                v["metadata"]["name"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect();
    let objects = native_objects();
    assert!(objects.len() >= 3, "istio/native/: {objects:?}");
    for (file, obj) in &objects {
        let kind = obj["kind"]
            .as_str()
            .unwrap_or_else(|| panic!("{}: object without kind", file.display()));
        let want = expected_api_version(kind)
            .unwrap_or_else(|| panic!("{}: unexpected kind {kind}", file.display()));
        assert_eq!(obj["apiVersion"].as_str(), Some(want), "{}", file.display());
        if kind == "Kustomization" {
            continue;
        }
        assert_eq!(
            obj["metadata"]["namespace"].as_str(),
            Some("ai-inference"),
            "{}: {}",
            file.display(),
            describe(obj)
        );
        let id = (kind.to_string(), s(obj, "metadata.name").to_string());
        assert!(
            base.contains(&id),
            "{}: {} patches nothing in istio/ (kustomize would refuse it)",
            file.display(),
            describe(obj)
        );
        match kind {
            "EnvoyFilter" => check_envoy_filter(obj),
            "ConfigMap" => check_config_map(obj),
            _ => {}
        }
    }
}

/// istio/native/kustomization.yaml is an overlay of the RENDERED wasm install (the templates
/// carry no module digest) at istio/render.sh's default output, patches it with every other
/// object file of the directory, and does not list the client patch (which patches the
/// operator's own Deployments).
#[test]
fn native_kustomization_is_an_overlay_of_the_rendered_install() {
    let k = load_yaml("istio/native/kustomization.yaml");
    let resources: Vec<&str> = seq(&k, "resources")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(
        resources,
        ["../../target/istio"],
        "the base is the rendered install"
    );
    let render = std::fs::read_to_string(repo_root().join("istio/render.sh"))
        .unwrap_or_else(|e| panic!("istio/render.sh: {e}"));
    assert!(
        render.contains("target/istio"),
        "istio/render.sh no longer renders into target/istio"
    );
    let patches: Vec<&str> = seq(&k, "patches").iter().map(|p| s(p, "path")).collect();
    for f in files_in(&repo_root().join("istio/native"), &[".yaml", ".yml"]) {
        let n = f.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        match n {
            "kustomization.yaml" => {}
            "client-patch.yaml" => assert!(
                !patches.contains(&n),
                "client-patch.yaml patches client Deployments, not this overlay"
            ),
            _ => assert!(patches.contains(&n), "kustomization does not apply {n}"),
        }
    }
    for p in &patches {
        assert!(
            repo_root().join("istio/native").join(p).is_file(),
            "kustomization: patch {p} does not exist"
        );
    }
}

/// The native router replaces the wasm router's EnvoyFilter (same name and workloads) and keeps
/// its cluster side and its place in the chain: the same override_host CLUSTER patch, the
/// filter inserted before the router of the same outbound listener, through ECDS with the same
/// fail-open default; nothing of the wasm filter is left in it.
#[test]
fn native_router_replaces_the_wasm_router_in_place() {
    let wasm = istio_named("EnvoyFilter", "ai-lb-route");
    let native = native_named("EnvoyFilter", "ai-lb-route");
    assert_eq!(
        native["spec"]["workloadSelector"],
        wasm["spec"]["workloadSelector"]
    );
    assert_eq!(
        config_patch(&native, "CLUSTER"),
        config_patch(&wasm, "CLUSTER"),
        "the native module steers through the same override_host policy (steering: header)"
    );
    let (nf, wf) = (
        config_patch(&native, "HTTP_FILTER"),
        config_patch(&wasm, "HTTP_FILTER"),
    );
    assert_eq!(nf["match"], wf["match"], "placed like the wasm filter");
    assert_eq!(s(&nf, "patch.operation"), "INSERT_BEFORE");
    let ext = native_extension_config();
    assert_eq!(
        nf["patch"]["value"]["name"], ext["name"],
        "ECDS reference by name"
    );
    let discovery = &nf["patch"]["value"]["config_discovery"];
    for key in [
        "default_config",
        "apply_default_config_without_warming",
        "config_source",
    ] {
        assert_eq!(
            discovery[key], wf["patch"]["value"]["config_discovery"][key],
            "config_discovery.{key}: fail open as the wasm router does"
        );
    }
    let types: Vec<&str> = seq(discovery, "type_urls")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let module_type = s(&ext, "typed_config.@type");
    assert_eq!(
        module_type,
        "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter"
    );
    assert!(types.contains(&module_type), "type_urls: {types:?}");
    assert!(
        types.contains(&"type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC"),
        "the RBAC default must be an allowed type: {types:?}"
    );
    let text = serde_yaml::to_string(&native).unwrap_or_default();
    assert!(
        !text.to_lowercase().contains("wasm"),
        "istio/native/envoyfilter.yaml still holds wasm configuration"
    );
    assert_eq!(
        at(&ext, "typed_config.dynamic_module_config.do_not_close").as_bool(),
        Some(true),
        "the module runs a feed thread: it must never be unloaded"
    );
}

/// The module's config names Istio's cluster of the inference Service (as the wasm router's
/// does), reads the routing header override_host reads, names as many fallback endpoints as the
/// VirtualService retries, and reaches the agents at the loopback listener, which tunnels to
/// Istio's cluster of the agents' Service.
#[test]
fn native_module_config_names_the_istio_clusters_and_the_agents_tunnel() {
    let cfg = native_module_config();
    let filter = &cfg["filter"];
    let wasm = route_config();
    let inference = istio_named("Service", "vllm-llama-8b");
    let agents = istio_named("Service", "ai-lb-agents");
    let port = |svc: &Value| seq(svc, "spec.ports")[0]["port"].as_u64().unwrap_or(0);
    let pools = filter["pools"].as_array().cloned().unwrap_or_default();
    assert!(!pools.is_empty(), "no pools");
    for (i, pool) in pools.iter().enumerate() {
        assert_eq!(
            pool["cluster"].as_str(),
            Some(outbound(&inference, port(&inference)).as_str())
        );
        assert_eq!(
            pool["name"], wasm["pools"][i]["name"],
            "same pool names as wasm"
        );
    }
    let native = native_named("EnvoyFilter", "ai-lb-route");
    let cluster_patch = config_patch(&native, "CLUSTER");
    let header = at(
        &cluster_patch,
        "patch.value.load_balancing_policy.policies.0.typed_extension_config.typed_config.override_host_sources.0.header",
    );
    assert_eq!(header.as_str(), filter["routingHeader"].as_str());
    assert!(
        matches!(
            cfg["steering"].as_str(),
            None | Some("header") | Some("both")
        ),
        "the cluster runs override_host on the routing header: steering must write it"
    );
    let vs = istio_named("VirtualService", "vllm-llama-8b");
    assert_eq!(
        seq(&vs, "spec.http")[0]["retries"]["attempts"].as_u64(),
        filter["fallbackEndpoints"].as_u64(),
        "each retry should go to the next ranked endpoint"
    );

    let listener = config_patch(&native, "LISTENER");
    assert_eq!(s(&listener, "match.context"), "SIDECAR_OUTBOUND");
    assert_eq!(s(&listener, "patch.operation"), "ADD");
    let addr = at(&listener, "patch.value.address.socket_address");
    let loopback = format!(
        "{}:{}",
        s(addr, "address"),
        addr["port_value"].as_u64().unwrap_or(0)
    );
    assert!(
        loopback.starts_with("127.0.0.1:"),
        "the tunnel listens on loopback only: {loopback}"
    );
    let filters = seq(&listener, "patch.value.filter_chains.0.filters");
    assert_eq!(filters.len(), 1);
    assert_eq!(s(&filters[0], "name"), "envoy.filters.network.tcp_proxy");
    assert_eq!(
        s(&filters[0], "typed_config.cluster"),
        outbound(&agents, port(&agents)),
        "the tunnel goes to Istio's cluster of the agents' Service"
    );
    for pool in &pools {
        let name = pool["name"].as_str().unwrap_or("");
        assert_eq!(
            cfg["agents"][name],
            serde_json::json!([loopback]),
            "pool {name}: the agents are reached through the loopback tunnel"
        );
    }
}

/// client-patch.yaml puts the module where Envoy looks for it: the init container writes
/// lib<name>.so (name = the EnvoyFilter's dynamic_module_config.name) into the volume that
/// istio-proxy mounts at ENVOY_DYNAMIC_MODULES_SEARCH_PATH; the module image holds the file the
/// init container copies; the pod is selected by the EnvoyFilter and opts in to the native
/// stats; istio-proxy runs as a regular container, so the copy is done before Envoy starts.
#[test]
fn native_client_patch_delivers_the_module_where_envoy_looks() {
    let docs =
        load_yaml_docs(&repo_root().join(NATIVE_CLIENT_PATCH)).unwrap_or_else(|e| panic!("{e}"));
    let [patch] = docs.as_slice() else {
        panic!("{NATIVE_CLIENT_PATCH}: expected one document");
    };
    let meta = at(patch, "spec.template.metadata");
    // Annotation keys hold dots: index, do not `at`.
    let ann = |k: &str| {
        meta["annotations"][k]
            .as_str()
            .unwrap_or_else(|| panic!("{NATIVE_CLIENT_PATCH}: no annotation {k}"))
            .to_string()
    };
    let native = native_named("EnvoyFilter", "ai-lb-route");
    for (k, v) in native["spec"]["workloadSelector"]["labels"]
        .as_mapping()
        .into_iter()
        .flatten()
    {
        assert_eq!(
            meta["labels"].get(k),
            Some(v),
            "the EnvoyFilter selects {k:?}"
        );
    }
    assert_eq!(
        ann("sidecar.istio.io/nativeSidecar"),
        "false",
        "a native sidecar starts before the pod's init containers, before the module is copied"
    );

    let mounts: serde_json::Value = serde_json::from_str(&ann("sidecar.istio.io/userVolumeMount"))
        .unwrap_or_else(|e| panic!("userVolumeMount is not JSON: {e}"));
    let mounts = mounts.as_object().cloned().unwrap_or_default();
    let [(volume, mount)] = mounts.iter().collect::<Vec<_>>()[..] else {
        panic!("userVolumeMount: expected one volume, got {mounts:?}");
    };
    assert_eq!(
        mount["readOnly"],
        serde_json::json!(true),
        "istio-proxy only reads the module"
    );
    let search_path = mount["mountPath"].as_str().unwrap_or("").to_string();

    let proxy_config: Value = serde_yaml::from_str(&ann("proxy.istio.io/config"))
        .unwrap_or_else(|e| panic!("proxy.istio.io/config is not YAML: {e}"));
    assert_eq!(
        s(
            &proxy_config,
            "proxyMetadata.ENVOY_DYNAMIC_MODULES_SEARCH_PATH"
        ),
        search_path,
        "Envoy must search the directory istio-proxy mounts"
    );
    let prefixes: Vec<&str> = seq(&proxy_config, "proxyStatsMatcher.inclusionPrefixes")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(
        prefixes.contains(&"dynamicmodulescustom.ailb"),
        "{prefixes:?}"
    );
    let stats = native_named("ConfigMap", "ai-lb-stats-bootstrap");
    assert_eq!(
        ann("sidecar.istio.io/bootstrapOverride"),
        s(&stats, "metadata.name")
    );

    let spec = at(patch, "spec.template.spec");
    let volumes = seq(spec, "volumes");
    let vol = volumes
        .iter()
        .find(|v| v["name"].as_str() == Some(volume.as_str()))
        .unwrap_or_else(|| panic!("no volume {volume} in the pod spec"));
    assert!(vol["emptyDir"].is_mapping(), "{volume}: an emptyDir");
    let inits = seq(spec, "initContainers");
    let [init] = inits.as_slice() else {
        panic!("expected one init container");
    };
    let dest_dir = seq(init, "volumeMounts")
        .iter()
        .find(|m| m["name"].as_str() == Some(volume.as_str()))
        .map(|m| s(m, "mountPath").to_string())
        .unwrap_or_else(|| panic!("the init container does not mount {volume}"));
    let module = format!(
        "lib{}.so",
        s(
            &native_extension_config(),
            "typed_config.dynamic_module_config.name"
        )
    );
    let command: Vec<&str> = seq(init, "command")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let [cp, from, to] = command[..] else {
        panic!("init container command: expected cp FROM TO, got {command:?}");
    };
    assert_eq!(cp, "cp");
    assert_eq!(
        to,
        format!("{dest_dir}/{module}"),
        "Envoy looks for $ENVOY_DYNAMIC_MODULES_SEARCH_PATH/{module}"
    );
    let dockerfile = std::fs::read_to_string(repo_root().join("istio/native/module.Dockerfile"))
        .unwrap_or_else(|e| panic!("istio/native/module.Dockerfile: {e}"));
    assert!(
        dockerfile
            .lines()
            .any(|l| l.starts_with("COPY ") && l.ends_with(&format!(" {from}"))),
        "module.Dockerfile does not put the module at {from}"
    );
    assert!(
        dockerfile.contains("-p ai-lb-filter-native"),
        "module.Dockerfile must build the native module"
    );
    assert_eq!(
        init["securityContext"]["runAsNonRoot"].as_bool(),
        Some(true)
    );
    assert_eq!(
        init["securityContext"]["allowPrivilegeEscalation"].as_bool(),
        Some(false)
    );
    assert!(
        init["resources"]["requests"].is_mapping(),
        "resource requests"
    );
}

/// The guard judges its pod by that pod's own agent: its `Watch` stream carries the answering
/// agent's pod, so through the agents' Service it would read any pod's signals. Its
/// agentCluster is the cluster guard-agent-cluster.yaml adds to the same pods' sidecars, whose
/// one endpoint is 127.0.0.1 at the agent container's gRPC port.
#[test]
fn guard_watches_its_own_pods_agent() {
    let guard = istio_named("WasmPlugin", "ai-lb-guard");
    let cluster_ef = istio_named("EnvoyFilter", "ai-lb-guard-agent");
    assert_eq!(
        cluster_ef["spec"]["workloadSelector"]["labels"], guard["spec"]["selector"]["matchLabels"],
        "the cluster goes to the guard's pods"
    );
    let patch = config_patch(&cluster_ef, "CLUSTER");
    assert_eq!(s(&patch, "patch.operation"), "ADD");
    let cluster = &patch["patch"]["value"];
    let pool = &guard["spec"]["pluginConfig"]["pools"][0];
    assert_eq!(
        pool["agentCluster"], cluster["name"],
        "the guard's agentCluster is the added cluster"
    );
    let ep = at(
        cluster,
        "load_assignment.endpoints.0.lb_endpoints.0.endpoint.address.socket_address",
    );
    assert_eq!(
        s(ep, "address"),
        "127.0.0.1",
        "the pod's own agent, on loopback"
    );
    let deploy = istio_named("Deployment", "vllm-llama-8b");
    let agent = seq(&deploy, "spec.template.spec.containers")
        .iter()
        .find(|c| c["name"].as_str() == Some("ai-lb-agent"))
        .unwrap_or_else(|| panic!("no ai-lb-agent container"));
    let grpc = seq(agent, "ports")
        .iter()
        .find(|p| p["name"].as_str() == Some("grpc-agent"))
        .unwrap_or_else(|| panic!("no grpc-agent port"));
    assert_eq!(ep["port_value"], grpc["containerPort"]);
    let options = &cluster["typed_extension_protocol_options"]
        ["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"];
    assert!(
        at(options, "explicit_http_config.http2_protocol_options").is_mapping(),
        "gRPC needs HTTP/2"
    );
}
