//! What the tool accepts as the filter: a core WebAssembly module (not a component, not a
//! truncated or foreign file) that exports a proxy-wasm ABI version, which is what Envoy's
//! wasm runtime looks for before it loads a plugin.

use std::path::Path;

use crate::Error;

/// The 4-byte magic every WebAssembly binary starts with (`\0asm`).
const MAGIC: [u8; 4] = *b"\0asm";
/// Core module, binary format version 1.
const CORE_VERSION: [u8; 4] = [1, 0, 0, 0];
/// What a component (the component model's binary) has where a module has its version.
const COMPONENT_VERSION: [u8; 4] = [0x0d, 0x00, 0x01, 0x00];
const EXPORT_SECTION: u8 = 7;
const FUNC_EXPORT: u8 = 0;
/// Prefix of the export a proxy-wasm SDK adds to name the ABI it speaks
/// (`proxy_abi_version_0_2_1` for the Rust SDK 0.2).
pub const ABI_EXPORT_PREFIX: &str = "proxy_abi_version_";

/// What the image's runtime config says about the module.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModuleInfo {
    /// The `proxy_abi_version_*` functions it exports, in export order.
    pub abi_versions: Vec<String>,
}

/// Reads the module at `path` and checks it (see [`inspect`]).
pub fn read(path: &Path) -> Result<(Vec<u8>, ModuleInfo), Error> {
    let bytes = std::fs::read(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            Error::MissingModule {
                path: path.to_path_buf(),
            }
        } else {
            Error::io("reading", path, e)
        }
    })?;
    let info = inspect(path, &bytes)?;
    Ok((bytes, info))
}

/// Checks that `bytes` (read from `path`, named in errors) is a well-framed core module
/// exporting a proxy-wasm ABI version. Section contents other than the exports are not
/// validated: Envoy's runtime does that when it loads the module.
pub fn inspect(path: &Path, bytes: &[u8]) -> Result<ModuleInfo, Error> {
    let not_wasm = |reason: String| Error::NotWasm {
        path: path.to_path_buf(),
        reason,
    };
    if bytes.is_empty() {
        return Err(not_wasm("the file is empty".into()));
    }
    if bytes.len() < 8 || bytes[..4] != MAGIC {
        return Err(not_wasm(format!(
            "it does not start with the wasm magic `\\0asm` (first bytes: {:02x?})",
            &bytes[..bytes.len().min(8)]
        )));
    }
    if bytes[4..8] == COMPONENT_VERSION {
        return Err(not_wasm(
            "it is a WebAssembly component; Envoy loads core modules (build for wasm32-wasip1)"
                .into(),
        ));
    }
    if bytes[4..8] != CORE_VERSION {
        return Err(not_wasm(format!(
            "unknown binary format version {:02x?} (a core module has 01 00 00 00)",
            &bytes[4..8]
        )));
    }
    let mut r = Reader { bytes, pos: 8 };
    let mut abi_versions = Vec::new();
    while r.pos < bytes.len() {
        let at = r.pos;
        let id = r
            .byte()
            .ok_or_else(|| not_wasm(format!("truncated at byte {at}")))?;
        let size = r
            .leb_u32()
            .ok_or_else(|| not_wasm(format!("section {id} at byte {at}: truncated size")))?;
        let end = r
            .pos
            .checked_add(size as usize)
            .filter(|&e| e <= bytes.len())
            .ok_or_else(|| {
                not_wasm(format!(
                    "section {id} at byte {at} claims {size} bytes, past the end of the file \
                     ({} bytes): truncated",
                    bytes.len()
                ))
            })?;
        if id == EXPORT_SECTION {
            let mut s = Reader {
                bytes: &bytes[..end],
                pos: r.pos,
            };
            abi_versions = exports(&mut s)
                .ok_or_else(|| not_wasm(format!("export section at byte {at} is malformed")))?;
        }
        r.pos = end;
    }
    if abi_versions.is_empty() {
        return Err(Error::NotProxyWasm {
            path: path.to_path_buf(),
        });
    }
    Ok(ModuleInfo { abi_versions })
}

/// The `proxy_abi_version_*` function exports of an export section's body.
fn exports(r: &mut Reader<'_>) -> Option<Vec<String>> {
    let count = r.leb_u32()?;
    let mut out = Vec::new();
    for _ in 0..count {
        let len = r.leb_u32()? as usize;
        let name = r.take(len)?;
        let kind = r.byte()?;
        r.leb_u32()?;
        let name = std::str::from_utf8(name).ok()?;
        if kind == FUNC_EXPORT && name.starts_with(ABI_EXPORT_PREFIX) {
            out.push(name.to_string());
        }
    }
    (r.pos == r.bytes.len()).then_some(out)
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn byte(&mut self) -> Option<u8> {
        let b = *self.bytes.get(self.pos)?;
        self.pos += 1;
        Some(b)
    }

    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let s = self.bytes.get(self.pos..self.pos.checked_add(n)?)?;
        self.pos += n;
        Some(s)
    }

    /// An unsigned LEB128 of at most 5 bytes (the encoding of every wasm u32).
    fn leb_u32(&mut self) -> Option<u32> {
        let mut v: u64 = 0;
        for i in 0..5 {
            let b = self.byte()?;
            v |= u64::from(b & 0x7f) << (7 * i);
            if b & 0x80 == 0 {
                return u32::try_from(v).ok();
            }
        }
        None
    }
}

/// A minimal module for tests: one function exported under each name (the type section and
/// code are valid, so Envoy would accept it too; the tool only reads the exports).
pub fn test_module(exports: &[&str]) -> Vec<u8> {
    fn leb(mut n: usize, out: &mut Vec<u8>) {
        loop {
            let b = (n & 0x7f) as u8;
            n >>= 7;
            if n == 0 {
                out.push(b);
                return;
            }
            out.push(b | 0x80);
        }
    }
    fn section(id: u8, body: &[u8], out: &mut Vec<u8>) {
        out.push(id);
        leb(body.len(), out);
        out.extend_from_slice(body);
    }
    let mut m = Vec::from(MAGIC);
    m.extend_from_slice(&CORE_VERSION);
    // type 0: () -> ()
    section(1, &[1, 0x60, 0, 0], &mut m);
    // one function of type 0
    section(3, &[1, 0], &mut m);
    let mut ex = Vec::new();
    leb(exports.len(), &mut ex);
    for name in exports {
        leb(name.len(), &mut ex);
        ex.extend_from_slice(name.as_bytes());
        ex.push(FUNC_EXPORT);
        ex.push(0);
    }
    section(EXPORT_SECTION, &ex, &mut m);
    // code: one body, no locals, `end`
    section(10, &[1, 2, 0, 0x0b], &mut m);
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p() -> &'static Path {
        Path::new("dir/filter.wasm")
    }

    fn err(bytes: &[u8]) -> String {
        inspect(p(), bytes).unwrap_err().to_string()
    }

    #[test]
    fn a_proxy_wasm_module_names_its_abi() {
        let m = test_module(&[
            "_start",
            "proxy_abi_version_0_2_1",
            "proxy_on_memory_allocate",
        ]);
        assert_eq!(
            inspect(p(), &m).unwrap().abi_versions,
            vec!["proxy_abi_version_0_2_1".to_string()]
        );
    }

    #[test]
    fn every_rejection_names_the_path_and_the_reason() {
        for (bytes, want) in [
            (Vec::new(), "the file is empty"),
            (b"{\"not\": \"wasm\"}".to_vec(), "wasm magic"),
            (b"\0asm".to_vec(), "wasm magic"),
            (
                [&MAGIC[..], &COMPONENT_VERSION[..]].concat(),
                "WebAssembly component",
            ),
            ([&MAGIC[..], &[2, 0, 0, 0][..]].concat(), "version"),
        ] {
            let e = err(&bytes);
            assert!(
                e.starts_with("dir/filter.wasm: not a WebAssembly module"),
                "{e}"
            );
            assert!(e.contains(want), "{e}");
        }
    }

    #[test]
    fn a_truncated_module_is_rejected() {
        let m = test_module(&["proxy_abi_version_0_2_1"]);
        let e = err(&m[..m.len() - 2]);
        assert!(e.contains("truncated"), "{e}");
        let mut bad = m.clone();
        // the export section's first name length, made longer than the section
        let i = m.iter().position(|&b| b == EXPORT_SECTION).unwrap();
        bad[i + 3] = 0x7f;
        let e = err(&bad);
        assert!(e.contains("malformed"), "{e}");
    }

    #[test]
    fn a_module_without_proxy_wasm_abi_is_not_a_filter() {
        let e = err(&test_module(&["_start", "memory"]));
        assert!(e.contains("dir/filter.wasm"), "{e}");
        assert!(e.contains("proxy_abi_version_"), "{e}");
        assert!(e.contains("not a proxy-wasm filter"), "{e}");
    }

    #[test]
    fn a_missing_file_says_how_to_build_it() {
        let e = read(Path::new("no/such/dir/x.wasm"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("no/such/dir/x.wasm"), "{e}");
        assert!(e.contains("cargo build -p ai-lb-filter-wasm"), "{e}");
    }
}
