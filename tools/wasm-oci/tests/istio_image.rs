//! Decides whether the image `ai-lb-wasm-oci` writes is the one Istio pulls, and whether the
//! rendered manifests check the module against what this build produced.
//!
//! The layout is opened here without the tool's code (serde_json and sha2 only): index.json →
//! manifest → config and layers, every blob's sha256 and size recomputed, the wasm layer
//! compared byte for byte with the built filter. Runs on the real filter when it is built
//! (`cargo build -p ai-lb-filter-wasm --target wasm32-wasip1 --release`, as scripts/test.sh
//! does before the tests; or `AI_LB_WASM`), and always on a small stand-in module.
//! `cargo test -p ai-lb-wasm-oci --test istio_image -- --nocapture` shows the digests.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use sha2::{Digest, Sha256};

const WASM_CONFIG: &str = "application/vnd.module.wasm.config.v1+json";
const WASM_LAYER: &str = "application/vnd.module.wasm.content.layer.v1+wasm";
const MARKER: &str = ai_lb_wasm_oci::render::TEMPLATE_MARKER;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// The built filter: `$AI_LB_WASM` (which must exist), else the release build in
/// `$CARGO_TARGET_DIR` or the repository's target/ (the end-to-end harness's lookup). Not
/// built: a failure under `REQUIRE_ENVOY=1` (scripts/test.sh), else a skip of the real
/// filter's checks.
fn real_module() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("AI_LB_WASM") {
        let p = PathBuf::from(p);
        assert!(p.is_file(), "AI_LB_WASM={} does not exist", p.display());
        return Some(p);
    }
    ai_lb_e2e::require::or_skip(
        "the real filter's image",
        "the wasm filter",
        ai_lb_e2e::envoy::wasm_path(),
    )
}

/// A stand-in proxy-wasm module, written to `dir`.
fn stand_in(dir: &Path) -> PathBuf {
    let p = dir.join("stand-in.wasm");
    let m = ai_lb_wasm_oci::module::test_module(&["proxy_abi_version_0_2_1", "proxy_on_tick"]);
    std::fs::write(&p, m).unwrap();
    p
}

fn tool(args: &[&str]) -> (String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_ai-lb-wasm-oci"))
        .args(args)
        .current_dir(repo_root())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "ai-lb-wasm-oci {args:?} failed:\n{stdout}\n{stderr}"
    );
    (stdout, stderr)
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn sha256_hex(b: &[u8]) -> String {
    Sha256::digest(b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

/// What an independent reader finds in a layout.
#[derive(Debug)]
struct Opened {
    manifest_digest: String,
    manifest: Value,
    tag: String,
    /// Every blob, by hex digest, each checked against its file name.
    blobs: BTreeMap<String, Vec<u8>>,
}

impl Opened {
    /// The blob a descriptor points at, its size and digest checked.
    fn blob(&self, descriptor: &Value) -> &[u8] {
        let digest = descriptor["digest"].as_str().expect("descriptor digest");
        let hex = digest
            .strip_prefix("sha256:")
            .unwrap_or_else(|| panic!("{digest}: not a sha256 digest"));
        let b = self
            .blobs
            .get(hex)
            .unwrap_or_else(|| panic!("{digest}: no such blob in the layout"));
        assert_eq!(
            descriptor["size"].as_u64(),
            Some(b.len() as u64),
            "{digest}: size"
        );
        b
    }
}

fn open_layout(dir: &Path) -> Opened {
    let layout: Value =
        serde_json::from_slice(&std::fs::read(dir.join("oci-layout")).unwrap()).unwrap();
    assert_eq!(layout["imageLayoutVersion"], "1.0.0");
    let mut blobs = BTreeMap::new();
    for e in std::fs::read_dir(dir.join("blobs/sha256")).unwrap() {
        let e = e.unwrap();
        let name = e.file_name().into_string().unwrap();
        let bytes = std::fs::read(e.path()).unwrap();
        assert_eq!(sha256_hex(&bytes), name, "blob file name is not its sha256");
        blobs.insert(name, bytes);
    }
    let index: Value =
        serde_json::from_slice(&std::fs::read(dir.join("index.json")).unwrap()).unwrap();
    assert_eq!(index["schemaVersion"], 2);
    assert_eq!(
        index["mediaType"],
        "application/vnd.oci.image.index.v1+json"
    );
    let manifests = index["manifests"].as_array().unwrap();
    assert_eq!(manifests.len(), 1, "one image in the layout");
    let d = &manifests[0];
    assert_eq!(d["mediaType"], "application/vnd.oci.image.manifest.v1+json");
    let tag = d["annotations"]["org.opencontainers.image.ref.name"]
        .as_str()
        .expect("a tagged manifest")
        .to_string();
    let mut opened = Opened {
        manifest_digest: d["digest"].as_str().unwrap().to_string(),
        manifest: Value::Null,
        tag,
        blobs,
    };
    let manifest: Value = serde_json::from_slice(opened.blob(d)).unwrap();
    assert_eq!(manifest["schemaVersion"], 2);
    assert_eq!(
        manifest["mediaType"],
        "application/vnd.oci.image.manifest.v1+json"
    );
    opened.manifest = manifest;
    opened
}

/// The checks of the "oci" variant, as Istio's `extractOCIArtifactImage` reads it: two
/// layers, one of them the raw module. Returns the manifest digest.
fn check_oci_variant(layout: &Path, module: &Path) -> String {
    let o = open_layout(layout);
    let m = &o.manifest;
    assert_eq!(m["config"]["mediaType"], WASM_CONFIG, "config media type");
    let config = o.blob(&m["config"]);
    let rc: Value = serde_json::from_slice(config).unwrap();
    assert_eq!(rc["type"], "envoy_proxy");
    assert!(
        rc["abiVersions"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v == "proxy_abi_version_0_2_1"),
        "runtime config {rc}"
    );
    let layers = m["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 2, "Istio wants exactly two layers: {m}");
    let types: Vec<&str> = layers
        .iter()
        .map(|l| l["mediaType"].as_str().unwrap())
        .collect();
    assert_eq!(types, [WASM_CONFIG, WASM_LAYER]);
    assert_eq!(o.blob(&layers[0]), config);
    let wasm = std::fs::read(module).unwrap();
    assert!(
        o.blob(&layers[1]) == wasm.as_slice(),
        "the wasm layer is not the bytes of {}",
        module.display()
    );
    // Nothing in the layout but what the manifest references (and the manifest).
    let mut referenced = vec![o.manifest_digest.clone()];
    referenced.extend(
        std::iter::once(&m["config"])
            .chain(layers)
            .map(|d| d["digest"].as_str().unwrap().to_string()),
    );
    for hex in o.blobs.keys() {
        assert!(
            referenced.contains(&format!("sha256:{hex}")),
            "unreferenced blob {hex}"
        );
    }
    assert_eq!(o.tag, env!("CARGO_PKG_VERSION"));
    o.manifest_digest
}

/// Extracts `archive` with the system's tar and compares it, file by file, with `layout`.
fn check_archive_is_the_layout(archive: &Path, layout: &Path, scratch: &Path) {
    let x = scratch.join("extracted");
    std::fs::create_dir_all(&x).unwrap();
    let st = Command::new("tar")
        .args(["-xf", s(archive), "-C", s(&x)])
        .status()
        .expect("tar");
    assert!(st.success(), "tar -xf {}", archive.display());
    for rel in ["oci-layout", "index.json"] {
        assert_eq!(
            std::fs::read(x.join(rel)).unwrap(),
            std::fs::read(layout.join(rel)).unwrap(),
            "{rel}"
        );
    }
    let names = |d: &Path| -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(d.join("blobs/sha256"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        v.sort();
        v
    };
    assert_eq!(names(&x), names(layout));
    for n in names(layout) {
        let rel = format!("blobs/sha256/{n}");
        assert!(
            std::fs::read(x.join(&rel)).unwrap() == std::fs::read(layout.join(&rel)).unwrap(),
            "{rel}"
        );
    }
}

fn image_of(module: &Path, what: &str) {
    let d = tempfile::tempdir().unwrap();
    let (layout, archive) = (d.path().join("layout"), d.path().join("image.tar"));
    let (stdout, _) = tool(&[
        "layout",
        "--wasm",
        s(module),
        "--layout",
        s(&layout),
        "--archive",
        s(&archive),
    ]);
    let digest = check_oci_variant(&layout, module);
    assert_eq!(stdout.trim(), digest, "the digest printed is the layout's");
    check_archive_is_the_layout(&archive, &layout, d.path());

    // Deterministic: another run, elsewhere, writes the same bytes.
    let (layout2, archive2) = (d.path().join("again"), d.path().join("again.tar"));
    let (stdout2, _) = tool(&[
        "layout",
        "--wasm",
        s(module),
        "--layout",
        s(&layout2),
        "--archive",
        s(&archive2),
    ]);
    assert_eq!(stdout2, stdout);
    assert!(std::fs::read(&archive).unwrap() == std::fs::read(&archive2).unwrap());
    println!(
        "{what} {}: Istio wasm image (oci variant) manifest digest {digest}",
        module.display()
    );
}

#[test]
fn the_layout_holds_the_built_filter_as_istio_reads_it() {
    let d = tempfile::tempdir().unwrap();
    image_of(&stand_in(d.path()), "stand-in module");
    if let Some(real) = real_module() {
        image_of(&real, "filter");
    }
}

#[test]
fn the_compat_variant_layer_unpacks_to_plugin_wasm() {
    let d = tempfile::tempdir().unwrap();
    let module = real_module().unwrap_or_else(|| stand_in(d.path()));
    let layout = d.path().join("layout");
    tool(&[
        "layout",
        "--variant",
        "compat",
        "--wasm",
        s(&module),
        "--layout",
        s(&layout),
    ]);
    let o = open_layout(&layout);
    let m = &o.manifest;
    assert_eq!(
        m["config"]["mediaType"],
        "application/vnd.oci.image.config.v1+json"
    );
    let layers = m["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 1);
    assert_eq!(
        layers[0]["mediaType"],
        "application/vnd.oci.image.layer.v1.tar+gzip"
    );
    let layer = d.path().join("layer.tar.gz");
    std::fs::write(&layer, o.blob(&layers[0])).unwrap();
    let x = d.path().join("x");
    std::fs::create_dir(&x).unwrap();
    let st = Command::new("tar")
        .args(["-xzf", s(&layer), "-C", s(&x)])
        .status()
        .expect("tar");
    assert!(st.success());
    assert!(std::fs::read(x.join("plugin.wasm")).unwrap() == std::fs::read(&module).unwrap());
    let config: Value = serde_json::from_slice(o.blob(&m["config"])).unwrap();
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!("gzip -dc '{}' | sha256sum", s(&layer)))
        .output()
        .unwrap();
    let diff_id = format!(
        "sha256:{}",
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .next()
            .unwrap()
    );
    assert_eq!(config["rootfs"]["diff_ids"][0], diff_id.as_str());
}

/// Every `sha256` field (WasmPlugin `spec.sha256`, ECDS `remote.sha256`) of a YAML tree,
/// with the module URL next to it (`url` or `http_uri.uri` in the same mapping or the
/// mapping holding it).
fn module_checksums(v: &serde_yaml::Value, out: &mut Vec<(String, String)>) {
    use serde_yaml::Value as Y;
    match v {
        Y::Mapping(m) => {
            if let Some(sum) = m.get("sha256") {
                let url = m
                    .get("url")
                    .or_else(|| m.get("http_uri").and_then(|h| h.get("uri")))
                    .and_then(Y::as_str)
                    .unwrap_or("?");
                out.push((url.to_string(), sum.as_str().unwrap_or("?").to_string()));
            }
            m.values().for_each(|x| module_checksums(x, out));
        }
        Y::Sequence(s) => s.iter().for_each(|x| module_checksums(x, out)),
        _ => {}
    }
}

fn yaml_docs(text: &str) -> Vec<serde_yaml::Value> {
    use serde::Deserialize;
    serde_yaml::Deserializer::from_str(text)
        .map(|de| serde_yaml::Value::deserialize(de).unwrap())
        .filter(|v| !v.is_null())
        .collect()
}

fn yaml_names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".yaml") || n.ends_with(".yml"))
        .collect();
    v.sort();
    v
}

/// Renders istio/ into a temp dir and returns (manifest digest, module sha256, out dir).
fn render(module: &Path, d: &Path, url: Option<&str>) -> (String, String, PathBuf) {
    let out = d.join("istio");
    let layout = d.join("layout");
    let mut args = vec![
        "render",
        "--wasm",
        s(module),
        "--layout",
        s(&layout),
        "--out",
        s(&out),
    ];
    if let Some(u) = url {
        args.extend(["--url", u]);
    }
    let (stdout, _) = tool(&args);
    let digest = check_oci_variant(&layout, module);
    assert!(stdout.contains(&digest), "{stdout}");
    let module_sha = sha256_hex(&std::fs::read(module).unwrap());
    (digest, module_sha, out)
}

#[test]
fn rendered_manifests_carry_this_builds_digest_and_no_placeholder() {
    let d = tempfile::tempdir().unwrap();
    let module = real_module().unwrap_or_else(|| stand_in(d.path()));
    let (digest, module_sha, out) = render(&module, d.path(), None);
    let istio = repo_root().join("istio");
    assert_eq!(
        yaml_names(&out),
        yaml_names(&istio),
        "every template is rendered"
    );
    let mut checked = Vec::new();
    for name in yaml_names(&out) {
        let text = std::fs::read_to_string(out.join(&name)).unwrap();
        assert!(!text.contains(MARKER), "{name}: template marker left");
        assert!(
            !text.contains(ai_lb_wasm_oci::render::TEMPLATE_ONLY_COMMENT),
            "{name}: a template-only comment left"
        );
        assert!(!text.contains(&"0".repeat(64)), "{name}: all-zero digest");
        let mut sums = Vec::new();
        for doc in yaml_docs(&text) {
            module_checksums(&doc, &mut sums);
        }
        for (url, sum) in sums {
            let want = if url.starts_with("oci://") {
                digest.trim_start_matches("sha256:")
            } else {
                module_sha.as_str()
            };
            assert_eq!(sum, want, "{name}: sha256 for {url}");
            checked.push(name.clone());
        }
    }
    // The router (EnvoyFilter), the guard and the alternative router (WasmPlugins).
    for f in [
        "envoyfilter.yaml",
        "guard-wasmplugin.yaml",
        "wasmplugin.yaml",
    ] {
        assert!(
            checked.iter().any(|c| c == f),
            "{f}: no module checksum checked"
        );
    }
    // The rendered kustomization is complete: every resource it lists was rendered.
    let k: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(out.join("kustomization.yaml")).unwrap())
            .unwrap();
    for r in k["resources"].as_sequence().unwrap() {
        let r = r.as_str().unwrap();
        assert!(
            out.join(r).is_file(),
            "kustomization lists {r}, not rendered"
        );
    }
    println!("rendered istio/ with manifest digest {digest} (module sha256 {module_sha})");

    // What `kubectl apply -k` would send, where kubectl is installed: the digest, twice
    // (router and guard), and no marker.
    match Command::new("kubectl")
        .args(["kustomize", s(&out)])
        .output()
    {
        Ok(o) => {
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
            let built = String::from_utf8_lossy(&o.stdout);
            let hex = digest.trim_start_matches("sha256:");
            assert_eq!(built.matches(hex).count(), 2, "{built}");
            assert!(!built.contains(MARKER));
        }
        Err(_) => eprintln!("SKIPPED kubectl kustomize of the rendered output: no kubectl"),
    }
}

#[test]
fn an_https_url_gets_the_module_sha256() {
    let d = tempfile::tempdir().unwrap();
    let module = stand_in(d.path());
    let url = "https://example.com/releases/ai_lb_filter_wasm.wasm";
    let (_, module_sha, out) = render(&module, d.path(), Some(url));
    let mut sums = Vec::new();
    for name in yaml_names(&out) {
        for doc in yaml_docs(&std::fs::read_to_string(out.join(&name)).unwrap()) {
            module_checksums(&doc, &mut sums);
        }
    }
    assert_eq!(sums.len(), 3, "{sums:?}");
    for (u, sum) in sums {
        assert_eq!(u, url);
        assert_eq!(sum, module_sha);
    }
}

/// The shipped templates: every module checksum is the marker (refused by the WasmPlugin
/// CRD's pattern, and by istio-agent's checksum check), never a digest-shaped placeholder.
#[test]
fn the_templates_hold_the_marker_and_no_digest() {
    let istio = repo_root().join("istio");
    let mut n = 0;
    for name in yaml_names(&istio) {
        let text = std::fs::read_to_string(istio.join(&name)).unwrap();
        assert!(!text.contains(&"0".repeat(64)), "{name}: all-zero digest");
        let mut sums = Vec::new();
        for doc in yaml_docs(&text) {
            module_checksums(&doc, &mut sums);
        }
        for (url, sum) in sums {
            assert_eq!(sum, MARKER, "istio/{name}: sha256 for {url}");
            n += 1;
        }
    }
    assert_eq!(n, 3, "envoyfilter, guard-wasmplugin and wasmplugin");
}
