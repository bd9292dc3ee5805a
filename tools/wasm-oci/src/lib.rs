//! `ai-lb-wasm-oci`: packs the built filter (`ai_lb_filter_wasm.wasm`) as the OCI image that
//! Istio's WasmPlugin (and the ECDS `remote` code of istio/envoyfilter.yaml) pulls, written as
//! an OCI image layout (a directory, or one tar of it); and renders the manifests of istio/
//! with that image's digest.
//!
//! - [`module`]: what counts as a filter (a core wasm module exporting a proxy-wasm ABI).
//! - [`image`]: the image (the "oci" variant by default) and its layout; deterministic.
//! - [`render`]: istio/ (templates whose `sha256` holds [`render::TEMPLATE_MARKER`]) to
//!   ready-to-apply manifests.
//! - [`archive`]: the deterministic tar and gzip writers both need.

use std::path::{Path, PathBuf};

pub mod archive;
pub mod image;
pub mod module;
pub mod render;

pub use image::{Image, Variant};

/// Where `cargo build -p ai-lb-filter-wasm --target wasm32-wasip1 --release` puts the filter,
/// relative to the repository root.
pub const DEFAULT_MODULE: &str = "target/wasm32-wasip1/release/ai_lb_filter_wasm.wasm";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "{}: no such file; build the filter first (cargo build -p ai-lb-filter-wasm \
         --target wasm32-wasip1 --release) or name it with --wasm",
        path.display()
    )]
    MissingModule { path: PathBuf },
    #[error("{}: not a WebAssembly module: {reason}", path.display())]
    NotWasm { path: PathBuf, reason: String },
    #[error(
        "{}: a WebAssembly module, but not a proxy-wasm filter: it exports no \
         `proxy_abi_version_*` function (is this the ai-lb filter?)",
        path.display()
    )]
    NotProxyWasm { path: PathBuf },
    #[error("tag {tag:?} is not a valid OCI tag ([A-Za-z0-9_][A-Za-z0-9._-]{{0,127}})")]
    InvalidTag { tag: String },
    #[error("{}: {reason}", path.display())]
    Template { path: PathBuf, reason: String },
    #[error("refusing to write {}: {reason}", path.display())]
    Refuse { path: PathBuf, reason: String },
    #[error("{0}")]
    Archive(String),
    #[error("{action} {}: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

impl Error {
    pub(crate) fn io(action: &'static str, path: &Path, source: std::io::Error) -> Self {
        Error::Io {
            action,
            path: path.to_path_buf(),
            source,
        }
    }
}
