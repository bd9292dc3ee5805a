//! Decides whether `ai-lb-check-config` accepts every shipped plugin config and rejects bad
//! ones with the field path, the value and exit code 1 (2 for usage and I/O errors).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_ai-lb-check-config");

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn run(args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(BIN)
        .args(args)
        .current_dir(repo_root())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    if let Some(s) = stdin {
        child.stdin.take().unwrap().write_all(s.as_bytes()).unwrap();
    } else {
        drop(child.stdin.take());
    }
    child.wait_with_output().unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn shipped_configs() -> Vec<String> {
    let root = repo_root();
    let mut files = vec!["envoy-config/filter-config.json".to_string()];
    for dir in ["envoy-config/compose", "istio"] {
        let mut names: Vec<String> = std::fs::read_dir(root.join(dir))
            .unwrap()
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| {
                if dir == "istio" {
                    n.ends_with(".yaml")
                } else {
                    n.ends_with(".json")
                }
            })
            .collect();
        names.sort();
        files.extend(names.into_iter().map(|n| format!("{dir}/{n}")));
    }
    files
        .into_iter()
        .filter(|f| root.join(f).exists())
        .collect()
}

#[test]
fn shipped_configs_pass() {
    let files = shipped_configs();
    let args: Vec<&str> = files.iter().map(String::as_str).collect();
    let out = run(&args, None);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(0), "{t}");
    for must in [
        "OK envoy-config/filter-config.json",
        "OK envoy-config/compose/filter-config.json",
        "OK istio/wasmplugin.yaml [WasmPlugin/ai-lb-route]",
        "OK istio/guard-wasmplugin.yaml [WasmPlugin/ai-lb-guard]",
        "OK istio/envoyfilter.yaml [EnvoyFilter/ai-lb-route",
    ] {
        assert!(t.contains(must), "missing {must:?} in:\n{t}");
    }
    assert!(!t.contains("INVALID"), "{t}");
    // Issue 31: what the compose stack and Istio ship lets no client claim a tenant or read the
    // scoreboard; only the local sample (debug header and status page on) is warned about.
    let warns: Vec<&str> = t.lines().filter(|l| l.starts_with("WARN ")).collect();
    assert!(
        warns
            .iter()
            .all(|l| l.starts_with("WARN envoy-config/filter-config.json: ")),
        "{t}"
    );
    assert_eq!(warns.len(), 2, "{t}");
    assert!(
        warns[0].contains("`debugHeader`") && warns[1].contains("`statusPath`"),
        "{t}"
    );
}

/// Issue 31: a tenant key read from a plain request header is accepted (exit 0) but warned
/// about, naming the field, the value and why; listing the header as set by a trusted filter
/// (`admission.trustedHeaders`), or taking the tenant from the mTLS peer, is not.
#[test]
fn a_forgeable_tenant_key_is_warned_about_not_rejected() {
    let cfg = |admission: &str| format!(r#"{{{POOL},"admission":{admission}}}"#);
    let out = run(
        &["-"],
        Some(&cfg(
            r#"{"tenantKey": ["header:X-Tenant-Id", "peerPrincipal"]}"#,
        )),
    );
    let t = text(&out);
    assert_eq!(out.status.code(), Some(0), "{t}");
    assert!(t.contains("OK <stdin>"), "{t}");
    let warn = t
        .lines()
        .find(|l| l.starts_with("WARN <stdin>: "))
        .unwrap_or_else(|| panic!("no warning in:\n{t}"));
    for must in [
        "field `admission.tenantKey[0]`",
        r#"value "header:x-tenant-id""#,
        "any client can send `x-tenant-id`",
        "admission.trustedHeaders",
    ] {
        assert!(warn.contains(must), "missing {must:?} in {warn}");
    }
    assert_eq!(t.matches("WARN ").count(), 1, "{t}");

    let out = run(&["-"], Some(&cfg(r#"{"tenantKey": ["apiKeyHash"]}"#)));
    let t = text(&out);
    assert_eq!(out.status.code(), Some(0), "{t}");
    assert!(
        t.contains("WARN <stdin>: field `admission.tenantKey[0]`: value \"apiKeyHash\": any client can invent API keys"),
        "{t}"
    );

    for quiet in [
        r#"{"tenantKey": ["header:x-ai-lb-tenant"], "trustedHeaders": ["X-AI-LB-Tenant"]}"#,
        r#"{"tenantKey": ["peerPrincipal"]}"#,
        r#"{}"#,
        r#"{"tenantKey": ["apiKeyHash"], "trustedHeaders": ["authorization", "x-api-key"]}"#,
        // Admission off: no tenant is resolved.
        r#"{"enabled": false, "tenantKey": ["header:x-tenant-id"]}"#,
    ] {
        let out = run(&["-"], Some(&cfg(quiet)));
        let t = text(&out);
        assert_eq!(out.status.code(), Some(0), "{quiet}: {t}");
        assert!(!t.contains("WARN"), "{quiet}: {t}");
    }

    // A warning does not hide an error in another config, nor change its exit status.
    let dir = tempfile::tempdir().unwrap();
    let warned = dir.path().join("warned.json");
    std::fs::write(&warned, cfg(r#"{"tenantKey": ["header:x-tenant-id"]}"#)).unwrap();
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, cfg(r#"{"trustedHeaders": ["x a"]}"#)).unwrap();
    let out = run(&[warned.to_str().unwrap(), bad.to_str().unwrap()], None);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(1), "{t}");
    assert!(
        t.contains("WARN ") && t.contains("`admission.trustedHeaders[0]`"),
        "{t}"
    );
}

/// Issue 31: the debug header and the status page show pod addresses and scores to any
/// caller; a route config that turns them on is warned about, a guard config is not.
#[test]
fn debug_header_and_status_path_are_warned_about() {
    let out = run(
        &["-"],
        Some(&format!(
            r#"{{{POOL},"debugHeader":"x-dbg","statusPath":"/lb"}}"#
        )),
    );
    let t = text(&out);
    assert_eq!(out.status.code(), Some(0), "{t}");
    assert!(
        t.contains(
            r#"WARN <stdin>: field `debugHeader`: value "x-dbg": any client that sends `x-dbg`"#
        ),
        "{t}"
    );
    assert!(
        t.contains(
            r#"WARN <stdin>: field `statusPath`: value "/lb": any client that requests this path"#
        ),
        "{t}"
    );
    let out = run(
        &["-"],
        Some(r#"{"mode":"guard","pools":[],"admission":{"tenantKey":["header:x-t"]}}"#),
    );
    let t = text(&out);
    assert_eq!(out.status.code(), Some(0), "{t}");
    assert!(!t.contains("WARN"), "{t}");
}

const POOL: &str = r#""pools":[{"name":"llm","cluster":"inference"}]"#;

/// (name, config JSON, expected substrings of the report).
fn bad_json_configs() -> Vec<(&'static str, String, Vec<&'static str>)> {
    vec![
        (
            "unknown field",
            format!(r#"{{{POOL},"minPod":3}}"#),
            vec!["field `minPod`", "unknown field"],
        ),
        (
            "out-of-range weight",
            r#"{"pools":[{"name":"llm","cluster":"c","weights":{"gpu":-1}}]}"#.into(),
            vec!["`pools[0].weights.gpu`", "value -1", "≥ 0"],
        ),
        (
            "bad header name",
            format!(r#"{{{POOL},"routingHeader":"X-Dest"}}"#),
            vec!["`routingHeader`", "\"X-Dest\"", "lowercase"],
        ),
        (
            "duplicate pool",
            r#"{"pools":[{"name":"a","cluster":"c1"},{"name":"a","cluster":"c2"}]}"#.into(),
            vec!["`pools[1].name`", "\"a\"", "duplicate pool name"],
        ),
        (
            "bad podWeights key",
            r#"{"pools":[{"name":"a","cluster":"c","podWeights":{"pod-1":{"gpu":1}}}]}"#.into(),
            vec!["`pools[0].podWeights`", "\"pod-1\"", "IP:PORT"],
        ),
        (
            "negative staleness",
            format!(r#"{{{POOL},"cutoffs":{{"stalenessMs":-5}}}}"#),
            vec!["`cutoffs.stalenessMs`", "-5"],
        ),
        (
            "zero staleness",
            format!(r#"{{{POOL},"cutoffs":{{"stalenessMs":0}}}}"#),
            vec!["`cutoffs.stalenessMs`", "value 0", "must be > 0"],
        ),
        (
            "bad admission rate",
            format!(
                r#"{{{POOL},"admission":{{"tenants":{{"default":{{"tokensPerSecond":0,"burst":10}}}}}}}}"#
            ),
            vec!["`admission.tenants.default.tokensPerSecond`", "value 0"],
        ),
        (
            "unknown admission field",
            format!(r#"{{{POOL},"admission":{{"guard":{{"gpuUtil":0.9}}}}}}"#),
            vec!["`admission.guard", "gpuUtil"],
        ),
        (
            "malformed JSON",
            format!(r#"{{{POOL},"minPods":3"#),
            vec!["invalid JSON", "line 1"],
        ),
        (
            "emaAlpha out of range",
            format!(r#"{{{POOL},"emaAlpha":1.5}}"#),
            vec!["`emaAlpha`", "1.5", "(0, 1]"],
        ),
        (
            "no pools in route mode",
            r#"{"pools":[]}"#.into(),
            vec!["`pools`", "at least one pool"],
        ),
    ]
}

#[test]
fn bad_json_configs_are_rejected_with_path_and_value() {
    let dir = tempfile::tempdir().unwrap();
    for (name, json, expect) in bad_json_configs() {
        let path = dir.path().join("bad.json");
        std::fs::write(&path, &json).unwrap();
        let out = run(&[path.to_str().unwrap()], None);
        let t = text(&out);
        assert_eq!(out.status.code(), Some(1), "{name}: {t}");
        assert!(t.contains("INVALID"), "{name}: {t}");
        for e in expect {
            assert!(t.contains(e), "{name}: expected {e:?} in:\n{t}");
        }
        // Same verdict through stdin.
        let out = run(&["-"], Some(&json));
        assert_eq!(out.status.code(), Some(1), "{name} (stdin): {}", text(&out));
    }
}

#[test]
fn wasmplugin_with_bad_plugin_config_is_rejected_naming_the_resource() {
    let yaml = r#"
apiVersion: v1
kind: Namespace
metadata: {name: ai-inference}
---
apiVersion: extensions.istio.io/v1alpha1
kind: WasmPlugin
metadata: {name: good}
spec:
  pluginConfig:
    pools: [{name: llm, cluster: inference}]
---
apiVersion: extensions.istio.io/v1alpha1
kind: WasmPlugin
metadata: {name: bad}
spec:
  pluginConfig:
    pools: [{name: llm, cluster: inference}]
    floorWeight: 1.0
"#;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("plugins.yaml");
    std::fs::write(&path, yaml).unwrap();
    let out = run(&[path.to_str().unwrap()], None);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(1), "{t}");
    assert!(t.contains("OK ") && t.contains("[WasmPlugin/good]"), "{t}");
    assert!(t.contains("[WasmPlugin/bad]: "), "{t}");
    assert!(t.contains("`floorWeight`") && t.contains("[0, 1)"), "{t}");
    // And through stdin (YAML detected from the content).
    let out = run(&["-"], Some(yaml));
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
}

#[test]
fn envoyfilter_string_value_is_checked() {
    let yaml = r#"
apiVersion: networking.istio.io/v1alpha3
kind: EnvoyFilter
metadata: {name: ai-lb}
spec:
  configPatches:
  - applyTo: EXTENSION_CONFIG
    patch:
      operation: ADD
      value:
        name: ai-lb
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
          config:
            vm_config: {runtime: envoy.wasm.runtime.v8}
            configuration:
              "@type": type.googleapis.com/google.protobuf.StringValue
              value: |
                {"pools": [{"name": "llm", "cluster": "inference"}], "fallbackEndpoints": 99}
"#;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ef.yaml");
    std::fs::write(&path, yaml).unwrap();
    let out = run(&[path.to_str().unwrap()], None);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(1), "{t}");
    assert!(
        t.contains("[EnvoyFilter/ai-lb spec.configPatches[0]"),
        "{t}"
    );
    assert!(t.contains("`fallbackEndpoints`") && t.contains("99"), "{t}");

    let good = yaml.replace("99", "2");
    std::fs::write(&path, good).unwrap();
    let out = run(&[path.to_str().unwrap()], None);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
}

#[test]
fn wasmplugin_without_plugin_config_is_invalid() {
    let yaml = "kind: WasmPlugin\nmetadata: {name: empty}\nspec: {url: oci://x}\n";
    let out = run(&["-"], Some(yaml));
    let t = text(&out);
    assert_eq!(out.status.code(), Some(1), "{t}");
    assert!(
        t.contains("[WasmPlugin/empty]") && t.contains("spec.pluginConfig"),
        "{t}"
    );
}

#[test]
fn usage_and_io_errors_exit_2() {
    let out = run(&[], None);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let out = run(&["--bogus", "x.json"], None);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let out = run(&["does/not/exist.json"], None);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(2), "{t}");
    assert!(t.contains("does/not/exist.json"), "{t}");
    // A YAML file with no plugin config at all: nothing was checked.
    let out = run(&["istio/namespace.yaml"], None);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
}

#[test]
fn schema_flag_prints_the_committed_schema() {
    let out = run(&["--schema"], None);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let printed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let committed: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo_root().join("filter/core/plugin-config.schema.json"))
            .unwrap(),
    )
    .unwrap();
    assert_eq!(printed, committed);
}
