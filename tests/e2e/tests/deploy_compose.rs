//! Decides whether envoy-config/docker-compose.yml is a runnable stack without running it (no
//! compose tool or Docker here): the services exist, each has an image or a build whose
//! Dockerfile exists, healthchecks, dependencies and shared network namespaces point at real
//! services, the fixed addresses agree between pods, agents, Envoy's endpoints and Prometheus'
//! targets, and Envoy's config rendered exactly as the container renders it passes
//! `envoy --mode validate`.

mod deploy_support;

use std::collections::BTreeSet;
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

const PODS: [&str; 3] = ["pod-0", "pod-1", "pod-2"];
const AGENTS: [&str; 3] = ["agent-0", "agent-1", "agent-2"];

#[test]
fn required_services_exist_with_image_or_existing_dockerfile() {
    let c = compose();
    let names: BTreeSet<String> = services(&c).into_iter().map(|(n, _)| n).collect();
    for want in PODS
        .iter()
        .chain(&AGENTS)
        .chain(&["envoy", "loadgen", "prometheus", "grafana"])
    {
        assert!(
            names.contains(*want),
            "docker-compose.yml lacks service {want}"
        );
    }
    for (name, svc) in services(&c) {
        let build = &svc["build"];
        if build.is_mapping() {
            let ctx = compose_dir().join(build["context"].as_str().unwrap_or("."));
            let dockerfile = ctx.join(build["dockerfile"].as_str().unwrap_or("Dockerfile"));
            assert!(
                dockerfile.is_file(),
                "service {name}: Dockerfile {} does not exist",
                dockerfile.display()
            );
        } else {
            let image = svc["image"]
                .as_str()
                .unwrap_or_else(|| panic!("service {name}: no image or build"));
            assert!(
                image.contains(':'),
                "service {name}: pin the image tag ({image})"
            );
        }
    }
    assert!(
        service(&c, "envoy")["image"]
            .as_str()
            .is_some_and(|i| i.starts_with("envoyproxy/envoy:v1.40")),
        "Envoy must be the official 1.40 image"
    );
}

#[test]
fn services_have_healthchecks_and_valid_dependencies() {
    let c = compose();
    let names: BTreeSet<String> = services(&c).into_iter().map(|(n, _)| n).collect();
    for (name, svc) in services(&c) {
        let one_shot = svc["restart"].as_str() == Some("no");
        if !one_shot {
            let test = &svc["healthcheck"]["test"];
            assert!(
                test.as_sequence().is_some_and(|t| !t.is_empty()),
                "service {name}: no healthcheck"
            );
        }
        let deps: Vec<String> = match &svc["depends_on"] {
            Value::Mapping(m) => m
                .keys()
                .filter_map(|k| k.as_str().map(String::from))
                .collect(),
            Value::Sequence(s) => s
                .iter()
                .filter_map(|k| k.as_str().map(String::from))
                .collect(),
            _ => vec![],
        };
        for d in &deps {
            assert!(names.contains(d), "service {name} depends on unknown {d}");
            let cond = svc["depends_on"][d.as_str()]["condition"].as_str();
            if cond == Some("service_healthy") {
                assert!(
                    service(&c, d)["healthcheck"].is_mapping(),
                    "service {name} waits for {d} to be healthy, but {d} has no healthcheck"
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
            assert!(
                deps.iter().any(|d| d == target),
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
            if host.contains("/target/") {
                // Build output (the wasm module), produced by cargo build: must not be
                // silently replaced by an empty directory when missing.
                assert_eq!(
                    vol["bind"]["create_host_path"].as_bool(),
                    Some(false),
                    "service {name}: mount {host} with bind.create_host_path: false"
                );
                continue;
            }
            let p = compose_dir().join(host);
            assert!(
                p.exists(),
                "service {name}: volume source {} does not exist",
                p.display()
            );
        }
    }
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
fn addresses_agree_between_pods_agents_envoy_and_prometheus() {
    let c = compose();
    let mut serving = BTreeSet::new();
    let mut agent_grpc = BTreeSet::new();
    for (pod, agent) in PODS.iter().zip(AGENTS) {
        let p = service(&c, pod);
        let a = service(&c, agent);
        let ip = p["networks"]["ailb"]["ipv4_address"]
            .as_str()
            .unwrap_or_else(|| panic!("{pod}: no fixed address"));
        let listen_port = arg_after(&p, "--listen")
            .rsplit(':')
            .next()
            .unwrap_or_default()
            .to_string();
        assert_eq!(
            a["network_mode"].as_str(),
            Some(format!("service:{pod}").as_str())
        );
        let addr = env(&a, "AI_LB_AGENT_SERVING_ADDRESS");
        assert_eq!(
            addr,
            format!("{ip}:{listen_port}"),
            "{agent} must report {pod}'s address"
        );
        serving.insert(addr);
        let grpc_port = env(&a, "AI_LB_AGENT_GRPC_LISTEN")
            .rsplit(':')
            .next()
            .unwrap_or_default()
            .to_string();
        agent_grpc.insert(format!("{ip}:{grpc_port}"));
        assert!(
            p["networks"]["ailb"]["aliases"]
                .as_sequence()
                .is_some_and(|al| al.iter().any(|x| x.as_str() == Some("ai-lb-pods"))),
            "{pod} needs the ai-lb-pods alias (peer discovery)"
        );
        assert_eq!(
            env(&a, "AI_LB_AGENT_PEERS_DNS"),
            format!("ai-lb-pods:{grpc_port}")
        );
        assert_eq!(env(&a, "AI_LB_AGENT_GPU_SOURCE"), "sim");
    }
    let presets: BTreeSet<String> = PODS
        .iter()
        .map(|p| arg_after(&service(&c, p), "--preset"))
        .collect();
    assert!(presets.len() >= 2, "use a mix of presets, got {presets:?}");

    let envoy = service(&c, "envoy");
    assert_eq!(
        endpoints(&env(&envoy, "INFERENCE_ENDPOINTS")),
        serving,
        "Envoy's inference endpoints"
    );
    assert_eq!(
        endpoints(&env(&envoy, "AGENT_ENDPOINTS")),
        agent_grpc,
        "Envoy's agent endpoints"
    );

    // Prometheus scrapes Envoy's prometheus stats and every agent's /metrics.
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
    let admin_port = env(&envoy, "ADMIN_PORT");
    assert_eq!(
        targets(&ej),
        BTreeSet::from([format!("envoy:{admin_port}")])
    );
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

/// Runs render-envoy.sh as the envoy container does (RENDER_ONLY=1), with the compose
/// environment, the module path replaced by `module`.
fn render_compose_envoy(
    module: &Path,
    out_dir: &Path,
    drop_var: Option<&str>,
) -> (bool, String, PathBuf) {
    let c = compose();
    let envoy = service(&c, "envoy");
    let out = out_dir.join("envoy.yaml");
    let mut cmd = Command::new("sh");
    cmd.arg(compose_dir().join("compose/render-envoy.sh"))
        .arg(compose_dir().join("envoy.yaml"))
        .arg(&out)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("RENDER_ONLY", "1");
    for (k, v) in envoy["environment"].as_mapping().into_iter().flatten() {
        let (Some(k), Some(v)) = (k.as_str(), v.as_str()) else {
            panic!("envoy environment: {k:?}={v:?} must be strings");
        };
        if Some(k) == drop_var {
            continue;
        }
        let v = match k {
            "WASM_PATH" => module.display().to_string(),
            "FILTER_CONFIG_FILE" => compose_dir()
                .join("compose/filter-config.json")
                .display()
                .to_string(),
            _ => v.to_string(),
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
fn rendered_compose_envoy_config_passes_envoy_validate() {
    let Some(envoy) = envoy_or_skip("rendered_compose_envoy_config_passes_envoy_validate") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let stub = dir.path().join("stub.wasm");
    std::fs::write(&stub, stub_wasm_module()).unwrap_or_else(|e| panic!("{e}"));
    let (ok, log, out) = render_compose_envoy(&stub, dir.path(), None);
    assert!(ok, "render-envoy.sh failed:\n{log}");
    let v = envoy_validate_file(&envoy, &out);
    assert!(v.ok, "Envoy rejects the compose config:\n{}", v.output);

    if let Some(module) = real_wasm_module() {
        let (ok, log, out) = render_compose_envoy(&module, dir.path(), None);
        assert!(ok, "render-envoy.sh failed:\n{log}");
        let v = envoy_validate_file(&envoy, &out);
        assert!(
            v.ok,
            "the real filter refuses the compose config:\n{}",
            v.output
        );
    } else {
        eprintln!("(real filter module not built: checked with the stub module only)");
    }
}

#[test]
fn render_script_names_a_missing_variable() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let (ok, log, _) = render_compose_envoy(
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
