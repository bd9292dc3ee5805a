//! istio/ holds templates: every `sha256` that checks the filter's module holds
//! [`TEMPLATE_MARKER`], which is not 64 hex digits, so the API server refuses a WasmPlugin
//! carrying it (the CRD's pattern is `(^$|^[a-f0-9]{64}$)`) and istio-agent refuses the module
//! of an EnvoyFilter carrying it (checksum mismatch), instead of either passing for a digest.
//! Rendering copies the YAML files of the template directory to an output directory, with
//! each marker replaced by the checksum of what this build produced: for an `oci://` URL the
//! image's manifest digest (what istio-agent compares for images), for `https://`, `http://`
//! or `file://` the sha256 of the `.wasm` itself. The output is a complete kustomization
//! (`kubectl apply -k <out>`), checked before it is written: it parses, and every `sha256`
//! field in it is 64 hex digits, not all zero.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_yaml::Value;

use crate::image::{clear_dir, Image};
use crate::Error;

/// The `sha256` value of the templates in istio/.
pub const TEMPLATE_MARKER: &str = "NOT-RENDERED: run istio/render.sh (docs/install-istio.md)";
/// Comment lines starting with this (after indentation) speak of the template only (its marker,
/// how to render it); the render drops them, so the rendered files do not describe themselves
/// as templates.
pub const TEMPLATE_ONLY_COMMENT: &str = "# (template)";
/// The file that marks a directory as rendered output (so a second render may replace it).
pub const RENDER_STAMP: &str = ".ai-lb-rendered";
const SCHEMES: [&str; 4] = ["oci://", "https://", "http://", "file://"];
const ZERO_DIGEST: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// One module reference written by the render.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModuleRef {
    /// The rendered file's name.
    pub file: String,
    pub url: String,
    /// The hex checksum written into its `sha256`.
    pub sha256: String,
}

#[derive(Debug, Clone)]
pub struct Rendered {
    /// The names of the files written, sorted.
    pub files: Vec<String>,
    pub modules: Vec<ModuleRef>,
}

/// Renders every `*.yaml`/`*.yml` file directly in `from` into `out` (replaced if a render
/// wrote it before; refused if it holds anything else). `url`, if given, replaces the module
/// URL next to each marker.
pub fn render(
    from: &Path,
    out: &Path,
    image: &Image,
    url: Option<&str>,
) -> Result<Rendered, Error> {
    if let Some(u) = url {
        check_url(u).map_err(|reason| Error::Template {
            path: PathBuf::from("--url"),
            reason,
        })?;
    }
    if let (Ok(a), Ok(b)) = (from.canonicalize(), out.canonicalize()) {
        if a == b {
            return Err(Error::Refuse {
                path: out.to_path_buf(),
                reason: "it is the template directory itself; render into another one".into(),
            });
        }
    }
    let names = yaml_files(from)?;
    if names.is_empty() {
        return Err(Error::Template {
            path: from.to_path_buf(),
            reason: "no .yaml or .yml file to render".into(),
        });
    }
    let mut outputs = Vec::new();
    let mut modules = Vec::new();
    for name in &names {
        let src = from.join(name);
        let text = std::fs::read_to_string(&src).map_err(|e| Error::io("reading", &src, e))?;
        let (body, found) = render_text(&src, &text, image, url)?;
        let mut header = format!(
            "# Rendered by `ai-lb-wasm-oci render` (tools/wasm-oci) from {}:\n\
             # edit that and render again (docs/install-istio.md).\n",
            src.display()
        );
        if !found.is_empty() {
            header.push_str(&format!(
                "# This build's module checksums:\n\
                 #   image manifest digest (oci:// URLs): {}\n\
                 #   sha256 of the .wasm (https:// URLs): {}\n",
                image.manifest_digest, image.module_sha256
            ));
        }
        let rendered = header + &body;
        check_rendered(&out.join(name), &rendered)?;
        modules.extend(found.into_iter().map(|(url, sha256)| ModuleRef {
            file: name.clone(),
            url,
            sha256,
        }));
        outputs.push((name.clone(), rendered));
    }
    if modules.is_empty() {
        return Err(Error::Template {
            path: from.to_path_buf(),
            reason: format!(
                "no `sha256: \"{TEMPLATE_MARKER}\"` in any file: not a template directory \
                 (or already rendered)"
            ),
        });
    }
    clear_dir(
        out,
        RENDER_STAMP,
        "a directory `ai-lb-wasm-oci render` wrote",
    )?;
    for (name, text) in &outputs {
        let p = out.join(name);
        std::fs::write(&p, text).map_err(|e| Error::io("writing", &p, e))?;
    }
    let stamp = out.join(RENDER_STAMP);
    let note = format!(
        "rendered from {} for manifest {} (module sha256 {})\n",
        from.display(),
        image.manifest_digest,
        image.module_sha256
    );
    std::fs::write(&stamp, note).map_err(|e| Error::io("writing", &stamp, e))?;
    Ok(Rendered {
        files: names,
        modules,
    })
}

/// The YAML files directly in `dir` (not hidden), sorted by name.
fn yaml_files(dir: &Path) -> Result<Vec<String>, Error> {
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io("reading", dir, e))?;
    let mut names = Vec::new();
    for e in entries {
        let e = e.map_err(|e| Error::io("reading", dir, e))?;
        let name = e.file_name().to_string_lossy().into_owned();
        let is_file = e.file_type().map(|t| t.is_file()).unwrap_or(false);
        if is_file && !name.starts_with('.') && (name.ends_with(".yaml") || name.ends_with(".yml"))
        {
            names.push(name);
        }
    }
    names.sort();
    Ok(names)
}

/// Replaces the markers of one file's text and drops its [`TEMPLATE_ONLY_COMMENT`] lines.
/// Each YAML document holding a marker must hold exactly one module URL (an uncommented
/// `url:` or `uri:` with an oci/https/http/file scheme): the marker gets that URL's checksum.
/// Returns the text and (url, checksum) pairs.
pub fn render_text(
    path: &Path,
    text: &str,
    image: &Image,
    url: Option<&str>,
) -> Result<(String, Vec<(String, String)>), Error> {
    let err = |doc: usize, reason: String| Error::Template {
        path: path.to_path_buf(),
        reason: format!("document {doc}: {reason}"),
    };
    let mut lines: Vec<String> = text.split_inclusive('\n').map(str::to_string).collect();
    let mut found = Vec::new();
    // Document boundaries: lines that are `---` (with optional trailing text after a space).
    let mut starts = vec![0];
    for (i, l) in lines.iter().enumerate() {
        let t = l.trim_end();
        if t == "---" || t.starts_with("--- ") {
            starts.push(i + 1);
        }
    }
    starts.push(lines.len());
    for (doc, w) in starts.windows(2).enumerate() {
        let (a, b) = (w[0], w[1]);
        let markers: Vec<usize> = (a..b)
            .filter(|&i| {
                let t = lines[i].trim_start();
                !t.starts_with('#')
                    && t.starts_with("sha256:")
                    && lines[i].contains(TEMPLATE_MARKER)
            })
            .collect();
        if markers.is_empty() {
            continue;
        }
        let urls: Vec<(usize, std::ops::Range<usize>)> = (a..b)
            .filter_map(|i| module_url(&lines[i]).map(|r| (i, r)))
            .collect();
        let [(line, range)] = urls.as_slice() else {
            return Err(err(
                doc + 1,
                format!(
                    "a sha256 template marker but {} module URLs (uncommented url:/uri: with \
                     oci://, https://, http:// or file://); expected exactly one",
                    urls.len()
                ),
            ));
        };
        if markers.len() != 1 {
            return Err(err(
                doc + 1,
                format!(
                    "{} sha256 template markers for one module URL",
                    markers.len()
                ),
            ));
        }
        if let Some(u) = url {
            lines[*line].replace_range(range.clone(), u);
        }
        let module_url =
            url.map_or_else(|| lines[*line][range.clone()].to_string(), str::to_string);
        let sum = checksum_for(&module_url, image).map_err(|r| err(doc + 1, r))?;
        lines[markers[0]] = lines[markers[0]].replace(TEMPLATE_MARKER, &sum);
        found.push((module_url, sum));
    }
    let kept: String = lines
        .iter()
        .filter(|l| !l.trim_start().starts_with(TEMPLATE_ONLY_COMMENT))
        .map(String::as_str)
        .collect();
    Ok((kept, found))
}

/// The byte range of the module URL on an uncommented `url:`/`uri:` line, if it has one.
fn module_url(line: &str) -> Option<std::ops::Range<usize>> {
    let t = line.trim_start();
    let rest = t.strip_prefix("url:").or_else(|| t.strip_prefix("uri:"))?;
    let value = rest.trim_start();
    let (quote, value) = match value.chars().next() {
        Some(q @ ('"' | '\'')) => (Some(q), &value[1..]),
        _ => (None, value),
    };
    let end = match quote {
        Some(q) => value.find(q)?,
        None => value.find(char::is_whitespace).unwrap_or(value.len()),
    };
    let url = &value[..end];
    if !SCHEMES.iter().any(|s| url.starts_with(s)) {
        return None;
    }
    let start = line.len() - value.len();
    Some(start..start + end)
}

/// The checksum Istio compares for `url`.
fn checksum_for(url: &str, image: &Image) -> Result<String, String> {
    if let Some(reference) = url.strip_prefix("oci://") {
        if let Some((_, pinned)) = reference.split_once("@sha256:") {
            if pinned != image.manifest_sha256() {
                return Err(format!(
                    "{url} pins digest sha256:{pinned}, but this build's image is {}",
                    image.manifest_digest
                ));
            }
        }
        Ok(image.manifest_sha256().to_string())
    } else {
        Ok(image.module_sha256.clone())
    }
}

fn check_url(u: &str) -> Result<(), String> {
    let scheme = SCHEMES.iter().find(|s| u.starts_with(*s)).ok_or_else(|| {
        format!("{u:?}: the module URL must start with oci://, https://, http:// or file://")
    })?;
    if u.len() == scheme.len() || u.chars().any(|c| c.is_whitespace() || "\"'#".contains(c)) {
        return Err(format!("{u:?} is not a usable module URL"));
    }
    Ok(())
}

/// Decides whether a rendered file may be applied: it parses as YAML, holds no marker and
/// no all-zero digest, and every `sha256` field in it is 64 lowercase hex digits.
pub fn check_rendered(path: &Path, text: &str) -> Result<(), Error> {
    let err = |reason: String| Error::Template {
        path: path.to_path_buf(),
        reason,
    };
    if text.contains(TEMPLATE_MARKER) {
        return Err(err(
            "a sha256 template marker was left (one outside a `sha256:` field, or in a comment)"
                .into(),
        ));
    }
    if text.contains(ZERO_DIGEST) {
        return Err(err("holds an all-zero digest placeholder".into()));
    }
    for (i, de) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let v = Value::deserialize(de).map_err(|e| err(format!("document {}: {e}", i + 1)))?;
        let mut bad = Vec::new();
        walk_sha256(&v, &mut bad);
        if let Some(b) = bad.first() {
            return Err(err(format!(
                "document {}: sha256 {b:?} is not 64 lowercase hex digits",
                i + 1
            )));
        }
    }
    Ok(())
}

fn walk_sha256(v: &Value, bad: &mut Vec<String>) {
    match v {
        Value::Mapping(m) => {
            for (k, val) in m {
                if k.as_str() == Some("sha256") {
                    let ok = val.as_str().is_some_and(|s| {
                        s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
                    });
                    if !ok {
                        bad.push(format!("{val:?}"));
                    }
                }
                walk_sha256(val, bad);
            }
        }
        Value::Sequence(s) => s.iter().for_each(|x| walk_sha256(x, bad)),
        Value::Tagged(t) => walk_sha256(&t.value, bad),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::image::Variant;
    use crate::module::{test_module, ModuleInfo};

    fn image() -> Image {
        let m = test_module(&["proxy_abi_version_0_2_1"]);
        let info = ModuleInfo {
            abi_versions: vec!["proxy_abi_version_0_2_1".into()],
        };
        Image::build(&m, &info, "0.1.0", Variant::Oci).unwrap()
    }

    fn template(url: &str) -> String {
        format!(
            "kind: WasmPlugin\nspec:\n  url: {url}\n  # url: https://example.com/x.wasm\n  \
             # (template) the marker below is no digest\n  \
             sha256: \"{TEMPLATE_MARKER}\"\n---\nkind: Service\nmetadata:\n  name: s\n"
        )
    }

    #[test]
    fn oci_urls_get_the_manifest_digest_and_https_urls_the_module_sha256() {
        let img = image();
        let p = Path::new("t.yaml");
        let (out, found) = render_text(p, &template("oci://r/x:1"), &img, None).unwrap();
        assert_eq!(
            found,
            vec![("oci://r/x:1".into(), img.manifest_sha256().into())]
        );
        assert!(out.contains(&format!("sha256: \"{}\"", img.manifest_sha256())));
        assert!(!out.contains("(template)"), "{out}");
        assert!(
            out.contains("  # url: https://example.com/x.wasm\n"),
            "{out}"
        );
        check_rendered(p, &out).unwrap();

        let (out, found) =
            render_text(p, &template("oci://r/x:1"), &img, Some("https://h/f.wasm")).unwrap();
        assert_eq!(
            found,
            vec![("https://h/f.wasm".into(), img.module_sha256.clone())]
        );
        assert!(out.contains("  url: https://h/f.wasm\n"), "{out}");
        // The commented alternative is left as it was.
        assert!(out.contains("  # url: https://example.com/x.wasm\n"));
        check_rendered(p, &out).unwrap();

        let quoted = template("\"oci://r/x:1\"");
        let (out, _) = render_text(p, &quoted, &img, Some("oci://q/y:2")).unwrap();
        assert!(out.contains("  url: \"oci://q/y:2\"\n"), "{out}");
    }

    #[test]
    fn a_pinned_digest_must_be_this_builds() {
        let img = image();
        let p = Path::new("t.yaml");
        let good = format!("oci://r/x@{}", img.manifest_digest);
        render_text(p, &template(&good), &img, None).unwrap();
        let bad = format!("oci://r/x@sha256:{}", "a".repeat(64));
        let e = render_text(p, &template(&bad), &img, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("pins digest"), "{e}");
        assert!(e.starts_with("t.yaml: document 1"), "{e}");
    }

    #[test]
    fn a_marker_without_exactly_one_module_url_is_an_error_naming_the_file() {
        let img = image();
        let p = Path::new("istio/x.yaml");
        let none = format!("spec:\n  # url: oci://r/x:1\n  sha256: \"{TEMPLATE_MARKER}\"\n");
        let e = render_text(p, &none, &img, None).unwrap_err().to_string();
        assert!(e.contains("istio/x.yaml: document 1"), "{e}");
        assert!(e.contains("0 module URLs"), "{e}");
        let two = format!(
            "a: 1\n---\nspec:\n  url: oci://r/x:1\n  uri: https://h/y.wasm\n  \
             sha256: \"{TEMPLATE_MARKER}\"\n"
        );
        let e = render_text(p, &two, &img, None).unwrap_err().to_string();
        assert!(e.contains("document 2"), "{e}");
        assert!(e.contains("2 module URLs"), "{e}");
    }

    #[test]
    fn check_rendered_refuses_placeholders_and_malformed_digests() {
        let p = Path::new("out/x.yaml");
        for (text, want) in [
            (format!("sha256: \"{ZERO_DIGEST}\"\n"), "all-zero"),
            (format!("a:\n  sha256: \"{TEMPLATE_MARKER}\"\n"), "marker"),
            ("a:\n  - sha256: abc\n".to_string(), "not 64 lowercase hex"),
            (
                format!("sha256: \"{}\"\n", "A".repeat(64)),
                "not 64 lowercase hex",
            ),
            ("a: [\n".to_string(), "document 1"),
        ] {
            let e = check_rendered(p, &text).unwrap_err().to_string();
            assert!(e.starts_with("out/x.yaml: "), "{e}");
            assert!(e.contains(want), "{want}: {e}");
        }
        check_rendered(p, &format!("sha256: {}\n", "ab".repeat(32))).unwrap();
    }

    #[test]
    fn bad_override_urls_are_refused() {
        let img = image();
        let d = tempfile::tempdir().unwrap();
        for u in ["ghcr.io/x:1", "oci://", "oci://a b", "https://x/\"y"] {
            let e = render(d.path(), &d.path().join("out"), &img, Some(u))
                .unwrap_err()
                .to_string();
            assert!(e.starts_with("--url: "), "{e}");
        }
    }

    #[test]
    fn render_writes_a_directory_and_refuses_foreign_or_unmarked_ones() {
        let img = image();
        let d = tempfile::tempdir().unwrap();
        let from = d.path().join("tpl");
        std::fs::create_dir(&from).unwrap();
        std::fs::write(from.join("a.yaml"), template("oci://r/x:1")).unwrap();
        std::fs::write(from.join("kustomization.yaml"), "resources:\n- a.yaml\n").unwrap();
        std::fs::write(from.join("notes.txt"), "not copied").unwrap();
        let out = d.path().join("out");
        let r = render(&from, &out, &img, None).unwrap();
        assert_eq!(r.files, vec!["a.yaml", "kustomization.yaml"]);
        assert_eq!(r.modules.len(), 1);
        assert!(out.join(RENDER_STAMP).is_file());
        assert!(!out.join("notes.txt").exists());
        // A second render replaces the first.
        render(&from, &out, &img, None).unwrap();

        // Rendering into the templates, or into a directory it did not write, is refused.
        let e = render(&from, &from, &img, None).unwrap_err().to_string();
        assert!(e.contains("template directory itself"), "{e}");
        let foreign = d.path().join("foreign");
        std::fs::create_dir(&foreign).unwrap();
        std::fs::write(foreign.join("keep.yaml"), "a: 1\n").unwrap();
        let e = render(&from, &foreign, &img, None).unwrap_err().to_string();
        assert!(e.contains("refusing to write"), "{e}");
        assert!(foreign.join("keep.yaml").exists());

        // A directory with no marker (say, rendered output) is not a template.
        let e = render(&out, &d.path().join("again"), &img, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a template directory"), "{e}");
        let e = render(&d.path().join("missing"), &d.path().join("o2"), &img, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing"), "{e}");
    }
}
