//! Tenant keys: decides which bucket a request is charged to, from the configured sources tried
//! in order (a header, a hash of the API key, the mTLS peer principal), falling back to
//! `default`. Keys are bounded and printable so they are safe in shared-data keys and stats.
#![deny(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use sha2::{Digest, Sha256};

use super::config::TenantKeySource;

/// The tenant of requests no source identifies.
pub const DEFAULT_TENANT: &str = "default";
/// Longer keys are replaced by `sha256:` + a hash prefix.
pub const MAX_TENANT_LEN: usize = 128;

/// `sha256:` + the first 16 hex digits of SHA-256(`key`): what `apiKeyHash` produces, so an
/// operator can configure a tenant with `printf %s "$KEY" | sha256sum | cut -c1-16`.
pub fn api_key_hash(key: &str) -> String {
    let d = Sha256::digest(key.as_bytes());
    let mut s = String::with_capacity(7 + 16);
    s.push_str("sha256:");
    for b in d.iter().take(8) {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// Makes a key safe: printable ASCII without spaces, at most [`MAX_TENANT_LEN`] bytes;
/// anything else is hashed.
pub fn sanitize(raw: &str) -> String {
    let ok =
        !raw.is_empty() && raw.len() <= MAX_TENANT_LEN && raw.bytes().all(|b| b.is_ascii_graphic());
    if ok {
        raw.to_string()
    } else {
        api_key_hash(raw)
    }
}

/// The tenant of a request. `header` looks a request header up by lower-case name.
pub fn resolve<'h>(
    sources: &[TenantKeySource],
    header: impl Fn(&str) -> Option<&'h str>,
    peer_principal: Option<&str>,
) -> String {
    for src in sources {
        let found = match src {
            TenantKeySource::Header(name) => header(name)
                .map(str::trim)
                .filter(|v| !v.is_empty())
                .map(sanitize),
            TenantKeySource::ApiKeyHash => header("authorization")
                .and_then(|v| {
                    let v = v.trim();
                    let (scheme, rest) = v.split_once(' ')?;
                    scheme.eq_ignore_ascii_case("bearer").then_some(rest.trim())
                })
                .or_else(|| header("x-api-key").map(str::trim))
                .filter(|k| !k.is_empty())
                .map(api_key_hash),
            TenantKeySource::PeerPrincipal => peer_principal
                .map(str::trim)
                .filter(|p| !p.is_empty())
                .map(sanitize),
        };
        if let Some(t) = found {
            return t;
        }
    }
    DEFAULT_TENANT.to_string()
}

#[cfg(test)]
#[allow(clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn sources_in_order_with_fallback() {
        let srcs = vec![
            TenantKeySource::Header("x-tenant-id".into()),
            TenantKeySource::ApiKeyHash,
            TenantKeySource::PeerPrincipal,
        ];
        let h = |pairs: &'static [(&'static str, &'static str)]| {
            move |n: &str| pairs.iter().find(|(k, _)| *k == n).map(|(_, v)| *v)
        };
        assert_eq!(
            resolve(
                &srcs,
                h(&[("x-tenant-id", "team-a"), ("authorization", "Bearer sk-1")]),
                None
            ),
            "team-a"
        );
        assert_eq!(
            resolve(
                &srcs,
                h(&[("authorization", "Bearer sk-1")]),
                Some("spiffe://x")
            ),
            api_key_hash("sk-1")
        );
        assert_eq!(
            resolve(&srcs, h(&[("x-api-key", "sk-1")]), None),
            api_key_hash("sk-1")
        );
        assert_eq!(
            resolve(
                &srcs,
                h(&[("authorization", "Basic abc")]),
                Some("spiffe://c/ns/a/sa/b")
            ),
            "spiffe://c/ns/a/sa/b"
        );
        assert_eq!(
            resolve(&srcs, h(&[("x-tenant-id", "  ")]), None),
            DEFAULT_TENANT
        );
        assert_eq!(
            resolve(&[], h(&[("x-tenant-id", "a")]), None),
            DEFAULT_TENANT
        );
    }

    #[test]
    fn hash_is_sha256_prefix_and_keys_are_sanitized() {
        // SHA-256("abc") = ba7816bf8f01cfea...
        assert_eq!(api_key_hash("abc"), "sha256:ba7816bf8f01cfea");
        assert_eq!(sanitize("team a"), api_key_hash("team a"));
        assert_eq!(sanitize(&"x".repeat(200)).len(), 23);
        assert_eq!(sanitize("ok-team_1"), "ok-team_1");
    }
}
