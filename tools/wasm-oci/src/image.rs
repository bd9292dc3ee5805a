//! The wasm image in the format Istio's wasm fetcher reads (istio/istio pkg/wasm/imagefetcher.go,
//! after the solo-io/wasm image spec), as an OCI image layout (image-spec `image-layout.md`).
//!
//! *oci* variant (the default), as `wasme` pushed it and as `extractOCIArtifactImage` reads it:
//! an OCI image manifest whose `config` is the runtime config JSON
//! (`application/vnd.module.wasm.config.v1+json`) and with exactly **two** layers, that same
//! runtime config and the raw `.wasm` (`application/vnd.module.wasm.content.layer.v1+wasm`,
//! not compressed, not in a tar). Istio refuses any other layer count ("number of layers must
//! be 2"), so a one-layer artifact (`oras push file.wasm:<that type>`) does not load.
//!
//! *compat* variant (`extractOCIStandardImage`): an ordinary OCI image, one
//! `application/vnd.oci.image.layer.v1.tar+gzip` layer holding `plugin.wasm` and
//! `runtime-config.json`, for registries that refuse custom media types.
//!
//! Either way the image's identity is its manifest digest, which is what Istio compares with
//! the `sha256` of a WasmPlugin (or an ECDS `remote.sha256`) for an `oci://` URL. Nothing here
//! depends on time or on the machine, so one `.wasm` always gives one digest.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::archive;
use crate::module::ModuleInfo;
use crate::Error;

pub const OCI_LAYOUT_FILE: &str = "oci-layout";
pub const INDEX_FILE: &str = "index.json";
pub const INDEX_MEDIA_TYPE: &str = "application/vnd.oci.image.index.v1+json";
pub const MANIFEST_MEDIA_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
/// The runtime config of the *oci* variant: the manifest's config and its first layer.
pub const WASM_CONFIG_MEDIA_TYPE: &str = "application/vnd.module.wasm.config.v1+json";
/// The raw module of the *oci* variant.
pub const WASM_LAYER_MEDIA_TYPE: &str = "application/vnd.module.wasm.content.layer.v1+wasm";
pub const IMAGE_CONFIG_MEDIA_TYPE: &str = "application/vnd.oci.image.config.v1+json";
pub const TAR_GZIP_LAYER_MEDIA_TYPE: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
/// The index annotation that names a manifest's tag (`skopeo`/`oras` `<layout>:<tag>`).
pub const REF_NAME: &str = "org.opencontainers.image.ref.name";
pub const TITLE: &str = "org.opencontainers.image.title";
/// Where the compat spec (and Istio's fetcher) expects the module, and the runtime config.
pub const PLUGIN_FILE: &str = "plugin.wasm";
pub const RUNTIME_CONFIG_FILE: &str = "runtime-config.json";
/// The filter's root context id (`root_id` in istio/envoyfilter.yaml), for the runtime config.
pub const ROOT_ID: &str = "ai_lb";

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Variant {
    /// Custom wasm media types, raw module layer (the spec's "oci" variant).
    Oci,
    /// A standard tar+gzip layer with plugin.wasm (the spec's "compat" variant).
    Compat,
}

impl Variant {
    /// The spec's name of the variant.
    pub fn name(self) -> &'static str {
        match self {
            Variant::Oci => "oci",
            Variant::Compat => "compat",
        }
    }
}

/// A built image: its manifest and every blob it references, ready to write.
#[derive(Debug, Clone)]
pub struct Image {
    pub variant: Variant,
    pub tag: String,
    /// The manifest's exact bytes (its digest is the image's identity).
    pub manifest: Vec<u8>,
    /// `sha256:<hex>` of `manifest`.
    pub manifest_digest: String,
    /// The sha256 (hex) of the `.wasm` itself: the checksum for an `https://` URL.
    pub module_sha256: String,
    /// Config and layer blobs, each once.
    pub blobs: Vec<Vec<u8>>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Descriptor {
    media_type: &'static str,
    digest: String,
    size: u64,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    annotations: BTreeMap<&'static str, String>,
}

impl Descriptor {
    fn of(media_type: &'static str, bytes: &[u8]) -> Self {
        Descriptor {
            media_type,
            digest: digest(bytes),
            size: bytes.len() as u64,
            annotations: BTreeMap::new(),
        }
    }

    fn titled(mut self, title: &str) -> Self {
        self.annotations.insert(TITLE, title.to_string());
        self
    }
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Manifest {
    schema_version: u32,
    media_type: &'static str,
    config: Descriptor,
    layers: Vec<Descriptor>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    annotations: BTreeMap<&'static str, String>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Index {
    schema_version: u32,
    media_type: &'static str,
    manifests: Vec<Descriptor>,
}

/// The solo-io spec's runtime config, as `wasme` wrote it (protobuf JSON names).
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct RuntimeConfig<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    abi_versions: &'a [String],
    config: EnvoyConfig,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct EnvoyConfig {
    root_ids: [&'static str; 1],
}

/// `sha256:<hex>` of `bytes`.
pub fn digest(bytes: &[u8]) -> String {
    format!("sha256:{}", sha256_hex(bytes))
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn json<T: Serialize>(v: &T) -> Vec<u8> {
    // Serialising these plain structs cannot fail (no maps with non-string keys, no floats).
    serde_json::to_vec(v).unwrap_or_default()
}

/// Checks a tag against the distribution spec's grammar (`[A-Za-z0-9_][A-Za-z0-9._-]{0,127}`).
pub fn check_tag(tag: &str) -> Result<(), Error> {
    let ok = !tag.is_empty()
        && tag.len() <= 128
        && tag
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_')
        && tag
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidTag {
            tag: tag.to_string(),
        })
    }
}

impl Image {
    /// The image of `module` (already checked by [`crate::module::inspect`]).
    pub fn build(
        module: &[u8],
        info: &ModuleInfo,
        tag: &str,
        variant: Variant,
    ) -> Result<Image, Error> {
        check_tag(tag)?;
        let runtime_config = json(&RuntimeConfig {
            kind: "envoy_proxy",
            abi_versions: &info.abi_versions,
            config: EnvoyConfig {
                root_ids: [ROOT_ID],
            },
        });
        let mut annotations = BTreeMap::new();
        let (config, layers, blobs) = match variant {
            Variant::Oci => {
                let layers = vec![
                    Descriptor::of(WASM_CONFIG_MEDIA_TYPE, &runtime_config)
                        .titled(RUNTIME_CONFIG_FILE),
                    Descriptor::of(WASM_LAYER_MEDIA_TYPE, module).titled(PLUGIN_FILE),
                ];
                (
                    Descriptor::of(WASM_CONFIG_MEDIA_TYPE, &runtime_config),
                    layers,
                    vec![runtime_config, module.to_vec()],
                )
            }
            Variant::Compat => {
                let tar = archive::tar(&[
                    (PLUGIN_FILE, Some(module)),
                    (RUNTIME_CONFIG_FILE, Some(&runtime_config)),
                ])
                .map_err(Error::Archive)?;
                let layer = archive::gzip_stored(&tar);
                let image_config = json(&serde_json::json!({
                    "architecture": "wasm",
                    "os": "wasip1",
                    "config": {},
                    "rootfs": {"type": "layers", "diff_ids": [digest(&tar)]},
                }));
                annotations.insert("module.wasm.image/variant", "compat".to_string());
                (
                    Descriptor::of(IMAGE_CONFIG_MEDIA_TYPE, &image_config),
                    vec![Descriptor::of(TAR_GZIP_LAYER_MEDIA_TYPE, &layer)],
                    vec![image_config, layer],
                )
            }
        };
        let manifest = json(&Manifest {
            schema_version: 2,
            media_type: MANIFEST_MEDIA_TYPE,
            config,
            layers,
            annotations,
        });
        Ok(Image {
            variant,
            tag: tag.to_string(),
            manifest_digest: digest(&manifest),
            manifest,
            module_sha256: sha256_hex(module),
            blobs,
        })
    }

    /// The manifest digest's hex alone: the `sha256` value Istio wants for `oci://` URLs.
    pub fn manifest_sha256(&self) -> &str {
        self.manifest_digest
            .strip_prefix("sha256:")
            .unwrap_or(&self.manifest_digest)
    }

    /// `index.json`: the one manifest, tagged.
    pub fn index(&self) -> Vec<u8> {
        let mut d = Descriptor::of(MANIFEST_MEDIA_TYPE, &self.manifest);
        d.annotations.insert(REF_NAME, self.tag.clone());
        json(&Index {
            schema_version: 2,
            media_type: INDEX_MEDIA_TYPE,
            manifests: vec![d],
        })
    }

    /// Every file of the layout, path relative to its root, directories first, blobs sorted.
    pub fn files(&self) -> Vec<(String, Option<Vec<u8>>)> {
        let mut blobs: BTreeMap<String, &[u8]> = BTreeMap::new();
        blobs.insert(sha256_hex(&self.manifest), &self.manifest);
        for b in &self.blobs {
            blobs.insert(sha256_hex(b), b);
        }
        let mut out = vec![
            (
                OCI_LAYOUT_FILE.to_string(),
                Some(br#"{"imageLayoutVersion":"1.0.0"}"#.to_vec()),
            ),
            (INDEX_FILE.to_string(), Some(self.index())),
            ("blobs/".to_string(), None),
            ("blobs/sha256/".to_string(), None),
        ];
        out.extend(
            blobs
                .into_iter()
                .map(|(hex, b)| (format!("blobs/sha256/{hex}"), Some(b.to_vec()))),
        );
        out
    }

    /// Writes the layout into `dir`, replacing a layout already there. A directory that
    /// exists, is not empty and holds no `oci-layout` file is left alone (an error).
    pub fn write_layout(&self, dir: &Path) -> Result<(), Error> {
        clear_dir(dir, OCI_LAYOUT_FILE, "an OCI image layout")?;
        for (rel, data) in self.files() {
            let p = dir.join(&rel);
            match data {
                None => std::fs::create_dir_all(&p).map_err(|e| Error::io("creating", &p, e))?,
                Some(bytes) => {
                    std::fs::write(&p, bytes).map_err(|e| Error::io("writing", &p, e))?
                }
            }
        }
        Ok(())
    }

    /// The layout as one tar file (`oci-archive:` for skopeo, a tarball for `crane push`).
    pub fn archive(&self) -> Result<Vec<u8>, Error> {
        let files = self.files();
        let entries: Vec<archive::Entry<'_>> = files
            .iter()
            .map(|(p, d)| (p.as_str(), d.as_deref()))
            .collect();
        archive::tar(&entries).map_err(Error::Archive)
    }

    pub fn write_archive(&self, file: &Path) -> Result<(), Error> {
        if let Some(parent) = file.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| Error::io("creating", parent, e))?;
        }
        std::fs::write(file, self.archive()?).map_err(|e| Error::io("writing", file, e))
    }
}

/// Makes `dir` an empty directory. If it exists and is not empty it must contain `stamp`
/// (proof that this tool wrote it, described as `what`); otherwise nothing is touched.
pub(crate) fn clear_dir(dir: &Path, stamp: &str, what: &str) -> Result<(), Error> {
    match std::fs::read_dir(dir) {
        Ok(mut entries) => {
            if entries.next().is_some() && !dir.join(stamp).is_file() {
                return Err(Error::Refuse {
                    path: dir.to_path_buf(),
                    reason: format!(
                        "it exists, is not empty and is not {what} (no {stamp}); \
                         choose another directory or remove it"
                    ),
                });
            }
            std::fs::remove_dir_all(dir).map_err(|e| Error::io("removing", dir, e))?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io("reading", dir, e)),
    }
    std::fs::create_dir_all(dir).map_err(|e| Error::io("creating", dir, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::module::test_module;

    fn info() -> ModuleInfo {
        ModuleInfo {
            abi_versions: vec!["proxy_abi_version_0_2_1".into()],
        }
    }

    #[test]
    fn the_same_module_gives_the_same_digest_and_another_module_another() {
        let m = test_module(&["proxy_abi_version_0_2_1"]);
        let a = Image::build(&m, &info(), "0.1.0", Variant::Oci).unwrap();
        let b = Image::build(&m, &info(), "0.1.0", Variant::Oci).unwrap();
        assert_eq!(a.manifest, b.manifest);
        assert_eq!(a.archive().unwrap(), b.archive().unwrap());
        let other = test_module(&["proxy_abi_version_0_2_1", "x"]);
        let c = Image::build(&other, &info(), "0.1.0", Variant::Oci).unwrap();
        assert_ne!(a.manifest_digest, c.manifest_digest);
        // The tag lives in index.json only: retagging keeps the digest.
        let d = Image::build(&m, &info(), "latest", Variant::Oci).unwrap();
        assert_eq!(a.manifest_digest, d.manifest_digest);
        let e = Image::build(&m, &info(), "0.1.0", Variant::Compat).unwrap();
        assert_ne!(a.manifest_digest, e.manifest_digest);
    }

    #[test]
    fn the_oci_variant_has_the_two_layers_istio_requires() {
        let m = test_module(&["proxy_abi_version_0_2_1"]);
        let img = Image::build(&m, &info(), "0.1.0", Variant::Oci).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&img.manifest).unwrap();
        assert_eq!(v["config"]["mediaType"], WASM_CONFIG_MEDIA_TYPE);
        let layers = v["layers"].as_array().unwrap();
        assert_eq!(layers.len(), 2);
        assert_eq!(layers[0]["mediaType"], WASM_CONFIG_MEDIA_TYPE);
        assert_eq!(layers[0]["digest"], v["config"]["digest"]);
        assert_eq!(layers[1]["mediaType"], WASM_LAYER_MEDIA_TYPE);
        assert_eq!(layers[1]["digest"], digest(&m).as_str());
        let rc: serde_json::Value = serde_json::from_slice(&img.blobs[0]).unwrap();
        assert_eq!(
            rc,
            serde_json::json!({"type": "envoy_proxy",
                "abiVersions": ["proxy_abi_version_0_2_1"],
                "config": {"rootIds": ["ai_lb"]}})
        );
    }

    #[test]
    fn bad_tags_are_refused() {
        for t in ["", "-x", "a b", "a/b", "a:b", &"x".repeat(129)] {
            let e = check_tag(t).unwrap_err().to_string();
            assert!(e.contains("tag"), "{e}");
        }
        for t in ["0.1.0", "latest", "_x", "v1.2.3-rc.1"] {
            check_tag(t).unwrap();
        }
    }

    #[test]
    fn a_non_layout_directory_is_not_overwritten() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("precious.txt"), "x").unwrap();
        let m = test_module(&["proxy_abi_version_0_2_1"]);
        let img = Image::build(&m, &info(), "0.1.0", Variant::Oci).unwrap();
        let e = img.write_layout(d.path()).unwrap_err().to_string();
        assert!(e.contains(&d.path().display().to_string()), "{e}");
        assert!(e.contains("not an OCI image layout"), "{e}");
        assert!(d.path().join("precious.txt").exists());
        // An empty directory, or a layout written before, is fine.
        let out = d.path().join("layout");
        img.write_layout(&out).unwrap();
        img.write_layout(&out).unwrap();
        assert!(out.join("oci-layout").is_file());
    }
}
