//! Decides whether envoy-config/docker-compose.yml is a coherent stack without running it (fast,
//! no Docker): the services exist, each has a pinned image or a build whose Dockerfile target
//! exists, every image the stack runs has a health check (in the Dockerfile or the compose file),
//! dependencies and shared network namespaces point at real services, the fixed addresses agree
//! between pods, agents, both Envoys' endpoints and Prometheus' targets, and each Envoy's config
//! rendered exactly as its container renders it passes `envoy --mode validate`. The stack itself
//! is brought up, checked and faulted by `scripts/compose.sh check` (tests/compose/check.py).

mod deploy_support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use deploy_support::*;
use serde_yaml::Value;

fn compose() -> Value {
    load_yaml("envoy-config/docker-compose.yml")
}

fn compose_dir() -> PathBuf {
    repo_root().join("envoy-config")
}

fn services(c: &Value) -> Vec<(String, Value)> {
    c["services"]
        .as_mapping()
        .unwrap_or_else(|| panic!("docker-compose.yml: no services"))
        .iter()
        .map(|(k, v)| (k.as_str().unwrap_or_default().to_string(), v.clone()))
        .collect()
}

fn service(c: &Value, name: &str) -> Value {
    c["services"][name].clone()
}

const PODS: [&str; 4] = ["pod-0", "pod-1", "pod-2", "pod-3"];
const SERVERS: [&str; 4] = ["server-0", "server-1", "server-2", "server-3"];
const AGENTS: [&str; 4] = ["agent-0", "agent-1", "agent-2", "agent-3"];
const ENVOYS: [&str; 2] = ["envoy-wasm", "envoy-native"];

/// One stage of the repository's Dockerfile: its instructions, continuation lines joined.
#[derive(Debug, Default, Clone)]
struct Stage {
    from: String,
    lines: Vec<String>,
}

fn dockerfile_stages() -> BTreeMap<String, Stage> {
    let text = std::fs::read_to_string(repo_root().join("Dockerfile"))
        .unwrap_or_else(|e| panic!("Dockerfile: {e}"));
    let mut joined = Vec::new();
    let mut cur = String::new();
    for line in text.lines() {
        let t = line.trim();
        if t.starts_with('#') || t.is_empty() {
            continue;
        }
        if let Some(body) = t.strip_suffix('\\') {
            cur.push_str(body);
            cur.push(' ');
        } else {
            cur.push_str(t);
            joined.push(std::mem::take(&mut cur));
        }
    }
    let mut stages = BTreeMap::new();
    let mut name: Option<String> = None;
    for l in joined {
        let words: Vec<&str> = l.split_whitespace().collect();
        if words.first() == Some(&"FROM") {
            let n = match words.as_slice() {
                [_, from, as_kw, n] if as_kw.eq_ignore_ascii_case("as") => {
                    stages.insert(
                        n.to_string(),
                        Stage {
                            from: from.to_string(),
                            lines: vec![],
                        },
                    );
                    n.to_string()
                }
                _ => panic!("Dockerfile: every stage is named (FROM image AS name): {l}"),
            };
            name = Some(n);
        } else if let Some(stage) = name.as_ref().and_then(|n| stages.get_mut(n)) {
            stage.lines.push(l);
        }
    }
    stages
}

/// The instructions a stage runs with: its parents' (a stage built `FROM` another stage) first.
fn chain_lines(stages: &BTreeMap<String, Stage>, name: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = Some(name.to_string());
    let mut seen = BTreeSet::new();
    while let Some(n) = cur.take() {
        let Some(st) = stages.get(&n) else { break };
        assert!(
            seen.insert(n.clone()),
            "Dockerfile: stage {n} is its own parent"
        );
        out.splice(0..0, st.lines.iter().cloned());
        cur = stages.contains_key(&st.from).then(|| st.from.clone());
    }
    out
}

/// The image a stage finally starts from (following stages built on stages).
fn root_image(stages: &BTreeMap<String, Stage>, name: &str) -> String {
    let mut from = stages[name].from.clone();
    while let Some(parent) = stages.get(&from) {
        from = parent.from.clone();
    }
    from
}

fn build_target(svc: &Value) -> Option<String> {
    svc["build"]["target"].as_str().map(String::from)
}

/// The Dockerfile stage behind a service: its own build target, or the target of the service
/// that builds the image it names.
fn stage_of(c: &Value, name: &str) -> Option<String> {
    let svc = service(c, name);
    if let Some(t) = build_target(&svc) {
        return Some(t);
    }
    let image = svc["image"].as_str()?;
    services(c)
        .into_iter()
        .find(|(_, s)| s["image"].as_str() == Some(image) && s["build"].is_mapping())
        .and_then(|(_, s)| build_target(&s))
}

#[test]
fn required_services_exist_with_pinned_image_or_a_dockerfile_target() {
    let c = compose();
    let names: BTreeSet<String> = services(&c).into_iter().map(|(n, _)| n).collect();
    for want in PODS
        .iter()
        .chain(&SERVERS)
        .chain(&AGENTS)
        .chain(&ENVOYS)
        .chain(&["loadgen-wasm", "loadgen-native", "prometheus", "grafana"])
    {
        assert!(
            names.contains(*want),
            "docker-compose.yml lacks service {want}"
        );
    }
    let stages = dockerfile_stages();
    for (name, svc) in services(&c) {
        if svc["build"].is_mapping() {
            assert_eq!(
                svc["build"]["dockerfile"].as_str(),
                Some("Dockerfile"),
                "{name}: one Dockerfile at the repository root"
            );
            let t = build_target(&svc).unwrap_or_else(|| panic!("{name}: build without target"));
            assert!(
                stages.contains_key(&t),
                "{name}: Dockerfile has no stage {t}"
            );
            for arg in ["RUST_IMAGE", "RUNTIME_IMAGE", "ENVOY_IMAGE"] {
                assert!(
                    svc["build"]["args"][arg].is_string(),
                    "{name}: build arg {arg} (local bases on machines without a registry)"
                );
            }
        } else {
            let image = svc["image"]
                .as_str()
                .unwrap_or_else(|| panic!("service {name}: no image or build"));
            assert!(
                image.contains(':'),
                "service {name}: pin the image tag ({image})"
            );
            assert!(
                stage_of(&c, &name).is_some() || name == "grafana",
                "service {name}: image {image} is built by no service"
            );
        }
    }
    // The Envoy stages start from the 1.40 image (public default, local base by argument).
    let text = std::fs::read_to_string(repo_root().join("Dockerfile")).unwrap_or_default();
    assert!(
        text.contains("ARG ENVOY_IMAGE=envoyproxy/envoy:v1.40"),
        "Envoy must default to the official 1.40 image"
    );
    for e in ENVOYS {
        assert_eq!(root_image(&stages, e), "${ENVOY_IMAGE}", "{e}");
    }
}

#[test]
fn images_run_as_non_root_with_health_checks_and_dependencies_are_valid() {
    let c = compose();
    let stages = dockerfile_stages();
    let names: BTreeSet<String> = services(&c).into_iter().map(|(n, _)| n).collect();
    for stage in stages.keys() {
        if stage == "build" {
            continue;
        }
        let lines = chain_lines(&stages, stage);
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with("USER ") && !l.contains(" root") && !l.contains(" 0:")),
            "Dockerfile stage {stage}: set a non-root USER"
        );
        if stage != "loadgen" {
            assert!(
                lines.iter().any(|l| l.starts_with("HEALTHCHECK ")),
                "Dockerfile stage {stage}: no HEALTHCHECK"
            );
        }
    }
    let healthy = |name: &str| -> bool {
        let svc = service(&c, name);
        if svc["healthcheck"]["disable"].as_bool() == Some(true) {
            return false;
        }
        svc["healthcheck"]["test"].is_sequence()
            || stage_of(&c, name).is_some_and(|st| {
                chain_lines(&stages, &st)
                    .iter()
                    .any(|l| l.starts_with("HEALTHCHECK "))
            })
    };
    let deps_of = |name: &str| -> Vec<String> {
        match &service(&c, name)["depends_on"] {
            Value::Mapping(m) => m
                .keys()
                .filter_map(|k| k.as_str().map(String::from))
                .collect(),
            Value::Sequence(s) => s
                .iter()
                .filter_map(|k| k.as_str().map(String::from))
                .collect(),
            _ => vec![],
        }
    };
    for (name, svc) in services(&c) {
        let deps = deps_of(&name);
        for d in &deps {
            assert!(names.contains(d), "service {name} depends on unknown {d}");
            let cond = svc["depends_on"][d.as_str()]["condition"].as_str();
            if cond == Some("service_healthy") {
                assert!(
                    healthy(d),
                    "service {name} waits for {d} to be healthy, but {d} has no health check"
                );
            }
        }
        if let Some(nm) = svc["network_mode"].as_str() {
            let target = nm
                .strip_prefix("service:")
                .unwrap_or_else(|| panic!("{name}: network_mode {nm}"));
            assert!(
                names.contains(target),
                "service {name}: network_mode names unknown {target}"
            );
            // Directly or through another dependency: the namespace must exist first.
            let mut seen = BTreeSet::new();
            let mut todo = deps.clone();
            while let Some(d) = todo.pop() {
                if seen.insert(d.clone()) {
                    todo.extend(deps_of(&d));
                }
            }
            assert!(
                seen.contains(target),
                "service {name} shares {target}'s network: depend on it"
            );
        }
        for vol in svc["volumes"].as_sequence().into_iter().flatten() {
            let host = match vol {
                Value::String(short) => short.split(':').next().unwrap_or_default().to_string(),
                long => long["source"]
                    .as_str()
                    .unwrap_or_else(|| panic!("service {name}: volume without source"))
                    .to_string(),
            };
            let p = compose_dir().join(host);
            assert!(
                p.exists(),
                "service {name}: volume source {} does not exist",
                p.display()
            );
        }
    }
}

/// The stage's `ENV K=V ...` values.
fn stage_env(stage: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for l in &chain_lines(&dockerfile_stages(), stage) {
        if let Some(rest) = l.strip_prefix("ENV ") {
            for kv in rest.split_whitespace() {
                if let Some((k, v)) = kv.split_once('=') {
                    out.insert(k.to_string(), v.to_string());
                }
            }
        }
    }
    out
}

fn env(svc: &Value, key: &str) -> String {
    svc["environment"][key]
        .as_str()
        .map(str::to_string)
        .unwrap_or_else(|| panic!("missing environment {key}"))
}

fn arg_after(svc: &Value, flag: &str) -> String {
    let cmd: Vec<&str> = svc["command"]
        .as_sequence()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    cmd.iter()
        .position(|a| *a == flag)
        .and_then(|i| cmd.get(i + 1))
        .map(|s| s.to_string())
        .unwrap_or_else(|| panic!("command lacks {flag}"))
}

/// `socket_address: {address: A, port_value: P}` entries of a YAML flow list, as `A:P`.
fn endpoints(flow: &str) -> BTreeSet<String> {
    let v = yaml(flow);
    v.as_sequence()
        .into_iter()
        .flatten()
        .map(|e| {
            let sa = at(e, "endpoint.address.socket_address");
            format!(
                "{}:{}",
                sa["address"].as_str().unwrap_or("?"),
                sa["port_value"].as_u64().unwrap_or(0)
            )
        })
        .collect()
}

#[test]
fn addresses_agree_between_pods_agents_envoys_and_prometheus() {
    let c = compose();
    let mut serving = BTreeSet::new();
    let mut agent_grpc = BTreeSet::new();
    for ((pod, server), agent) in PODS.iter().zip(SERVERS).zip(AGENTS) {
        let p = service(&c, pod);
        let srv = service(&c, server);
        let a = service(&c, agent);
        let ip = p["networks"]["ailb"]["ipv4_address"]
            .as_str()
            .unwrap_or_else(|| panic!("{pod}: no fixed data address"));
        let tip = p["networks"]["ailb-telemetry"]["ipv4_address"]
            .as_str()
            .unwrap_or_else(|| panic!("{pod}: no fixed telemetry address"));
        for (who, svc) in [(server, &srv), (agent, &a)] {
            assert_eq!(
                svc["network_mode"].as_str(),
                Some(format!("service:{pod}").as_str()),
                "{who} lives in {pod}'s network namespace"
            );
        }
        let listen_port = arg_after(&srv, "--listen")
            .rsplit(':')
            .next()
            .unwrap_or_default()
            .to_string();
        let addr = env(&a, "AI_LB_AGENT_SERVING_ADDRESS");
        assert_eq!(
            addr,
            format!("{ip}:{listen_port}"),
            "{agent} must report {pod}'s serving address"
        );
        serving.insert(addr);
        let grpc_port = env(&a, "AI_LB_AGENT_GRPC_LISTEN")
            .rsplit(':')
            .next()
            .unwrap_or_default()
            .to_string();
        agent_grpc.insert(format!("{tip}:{grpc_port}"));
        assert!(
            p["networks"]["ailb-telemetry"]["aliases"]
                .as_sequence()
                .is_some_and(|al| al.iter().any(|x| x.as_str() == Some("ai-lb-pods"))),
            "{pod} needs the ai-lb-pods alias on the telemetry network (peer discovery)"
        );
        assert_eq!(
            env(&a, "AI_LB_AGENT_PEERS_DNS"),
            format!("ai-lb-pods:{grpc_port}")
        );
        assert_eq!(env(&a, "AI_LB_AGENT_GPU_SOURCE"), "sim");
    }
    let presets: BTreeSet<String> = SERVERS
        .iter()
        .map(|p| arg_after(&service(&c, p), "--preset"))
        .collect();
    assert!(presets.len() >= 2, "use a mix of presets, got {presets:?}");

    for e in ENVOYS {
        let envoy = service(&c, e);
        assert_eq!(
            endpoints(&env(&envoy, "INFERENCE_ENDPOINTS")),
            serving,
            "{e}'s inference endpoints"
        );
        assert_eq!(
            endpoints(&env(&envoy, "AGENT_ENDPOINTS")),
            agent_grpc,
            "{e}'s agent endpoints (telemetry network)"
        );
    }

    // Prometheus scrapes both Envoys' prometheus stats and every agent's /metrics.
    let prom = load_yaml("envoy-config/compose/prometheus.yml");
    let jobs = prom["scrape_configs"]
        .as_sequence()
        .cloned()
        .unwrap_or_default();
    let job = |name: &str| {
        jobs.iter()
            .find(|j| j["job_name"].as_str() == Some(name))
            .cloned()
            .unwrap_or_else(|| panic!("prometheus.yml: no job {name}"))
    };
    let targets = |j: &Value| -> BTreeSet<String> {
        j["static_configs"]
            .as_sequence()
            .into_iter()
            .flatten()
            .flat_map(|sc| sc["targets"].as_sequence().cloned().unwrap_or_default())
            .filter_map(|t| t.as_str().map(String::from))
            .collect()
    };
    let ej = job("envoy");
    assert_eq!(ej["metrics_path"].as_str(), Some("/stats/prometheus"));
    let want: BTreeSet<String> = ENVOYS
        .iter()
        .map(|e| format!("{e}:{}", stage_env(e)["ADMIN_PORT"]))
        .collect();
    assert_eq!(targets(&ej), want);
    let aj = job("ai-lb-agent");
    let want: BTreeSet<String> = PODS
        .iter()
        .zip(AGENTS)
        .map(|(pod, agent)| {
            let port = env(&service(&c, agent), "AI_LB_AGENT_HTTP_LISTEN")
                .rsplit(':')
                .next()
                .unwrap_or_default()
                .to_string();
            format!("{pod}:{port}")
        })
        .collect();
    assert_eq!(
        targets(&aj),
        want,
        "agents are reached at their pod's name (shared netns)"
    );
    assert!(
        service(&c, "prometheus")["networks"]["ailb-telemetry"].is_mapping(),
        "Prometheus scrapes over the telemetry network"
    );
}

#[test]
fn grafana_is_provisioned_with_the_dashboard_and_datasource() {
    let c = compose();
    let g = service(&c, "grafana");
    let vols: Vec<&str> = g["volumes"]
        .as_sequence()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    let dash_mount = vols
        .iter()
        .find(|v| v.starts_with("./grafana:"))
        .and_then(|v| v.split(':').nth(1))
        .unwrap_or_else(|| panic!("grafana does not mount envoy-config/grafana"));
    let provider = load_yaml("envoy-config/compose/grafana/provisioning/dashboards/ai-lb.yml");
    assert_eq!(
        at(&provider, "providers.0.options.path").as_str(),
        Some(dash_mount)
    );
    let ds = load_yaml("envoy-config/compose/grafana/provisioning/datasources/prometheus.yml");
    let uid = at(&ds, "datasources.0.uid")
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert_eq!(at(&ds, "datasources.0.type").as_str(), Some("prometheus"));
    let text =
        std::fs::read_to_string(repo_root().join("envoy-config/grafana/ai-lb-dashboard.json"))
            .unwrap_or_else(|e| panic!("dashboard: {e}"));
    let dash: serde_json::Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("dashboard JSON: {e}"));
    for p in dash["panels"].as_array().into_iter().flatten() {
        if p["type"] == "row" {
            continue;
        }
        assert_eq!(
            p["datasource"]["uid"].as_str(),
            Some(uid.as_str()),
            "panel {:?} uses a datasource uid Grafana is not provisioned with",
            p["title"]
        );
    }
}

/// Runs render-envoy.sh as the `envoy` container (a stage name) does (RENDER_ONLY=1), with the
/// stage's ENV and the compose environment, the module path replaced by `module`.
fn render_compose_envoy(
    envoy_service: &str,
    module: &Path,
    out_dir: &Path,
    drop_var: Option<&str>,
) -> (bool, String, PathBuf) {
    let c = compose();
    let svc = service(&c, envoy_service);
    let template = if envoy_service == "envoy-native" {
        "envoy-native.yaml"
    } else {
        "envoy.yaml"
    };
    let out = out_dir.join(format!("{envoy_service}.yaml"));
    let mut cmd = Command::new("sh");
    cmd.arg(compose_dir().join("compose/render-envoy.sh"))
        .arg(compose_dir().join(template))
        .arg(&out)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("RENDER_ONLY", "1");
    let mut vars = stage_env(envoy_service);
    for (k, v) in svc["environment"].as_mapping().into_iter().flatten() {
        let (Some(k), Some(v)) = (k.as_str(), v.as_str()) else {
            panic!("{envoy_service} environment: {k:?}={v:?} must be strings");
        };
        vars.insert(k.to_string(), v.to_string());
    }
    for (k, v) in vars {
        if Some(k.as_str()) == drop_var {
            continue;
        }
        let v = match k.as_str() {
            "WASM_PATH" | "NATIVE_MODULE_PATH" => module.display().to_string(),
            "FILTER_CONFIG_FILE" => compose_dir()
                .join(if envoy_service == "envoy-native" {
                    "compose/filter-config-native.json"
                } else {
                    "compose/filter-config.json"
                })
                .display()
                .to_string(),
            _ => v,
        };
        cmd.env(k, v);
    }
    let o = cmd
        .output()
        .unwrap_or_else(|e| panic!("run render-envoy.sh: {e}"));
    let mut text = String::from_utf8_lossy(&o.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&o.stderr));
    (o.status.success(), text, out)
}

#[test]
fn rendered_compose_envoy_configs_pass_envoy_validate() {
    let Some(envoy) = envoy_or_skip("rendered_compose_envoy_configs_pass_envoy_validate") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let stub = dir.path().join("stub.wasm");
    std::fs::write(&stub, stub_wasm_module()).unwrap_or_else(|e| panic!("{e}"));
    // Renders `service`'s config with `module` as its container does, and validates it.
    let check = |service: &str, module: &Path, what: &str| {
        let (ok, log, out) = render_compose_envoy(service, module, dir.path(), None);
        assert!(ok, "render-envoy.sh failed for {service}:\n{log}");
        let v = envoy_validate_file(&envoy, &out);
        assert!(v.ok, "{what}:\n{}", v.output);
    };
    check("envoy-wasm", &stub, "Envoy rejects the compose config");
    // The real modules where built (required under REQUIRE_ENVOY=1); the native Envoy's config
    // loads its module at validation, so it has no stub.
    let test = "rendered_compose_envoy_configs_pass_envoy_validate, real modules";
    let wasm = ai_lb_e2e::envoy::wasm_path();
    if let Some(module) = ai_lb_e2e::require::or_skip(test, "the wasm filter", wasm) {
        check(
            "envoy-wasm",
            &module,
            "the real filter refuses the compose config",
        );
    }
    let native = ai_lb_e2e::envoy::native_module_path();
    if let Some(module) = ai_lb_e2e::require::or_skip(test, "the native module", native) {
        check(
            "envoy-native",
            &module,
            "Envoy rejects the native compose config",
        );
    }
}

#[test]
fn render_script_names_a_missing_variable() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let (ok, log, _) = render_compose_envoy(
        "envoy-wasm",
        Path::new("/nonexistent.wasm"),
        dir.path(),
        Some("AGENT_ENDPOINTS"),
    );
    assert!(!ok, "rendering without AGENT_ENDPOINTS should fail");
    assert!(
        log.contains("AGENT_ENDPOINTS"),
        "the error should name the variable:\n{log}"
    );
}

#[test]
fn the_native_envoy_config_is_the_wasm_one_less_admission() {
    let read = |f: &str| -> serde_json::Value {
        let p = compose_dir().join("compose").join(f);
        let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    };
    let mut wasm = read("filter-config.json");
    let native = read("filter-config-native.json");
    assert!(
        wasm.get("admission").is_some(),
        "the compose stack shows the limiter (wasm Envoy)"
    );
    if let Some(m) = wasm.as_object_mut() {
        m.remove("admission");
    }
    assert_eq!(
        wasm, native,
        "filter-config-native.json must be filter-config.json without `admission`"
    );
    let stages = dockerfile_stages();
    assert!(chain_lines(&stages, "envoy-native")
        .iter()
        .any(|l| l.contains("filter-config-native.json")));
}
