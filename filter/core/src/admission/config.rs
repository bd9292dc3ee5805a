//! Admission configuration: decides which plugin-JSON values under `admission` are accepted, in
//! three steps (raw serde structs, validation into domain types naming field + value, use).
#![deny(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::derived::DerivedPriority;
use super::priority::PriorityClass;
use super::quota::LatencyQuota;
use crate::error::ConfigError;

mod raw;
pub(crate) use raw::RawAdmission;
use raw::{is_header_name, json_str};

const PREFIX: &str = "admission";

/// Weight of one unit of each modality, in weighted tokens. A text token weighs `text`; one
/// image patch (one visual token) weighs `image_patch`; one audio frame weighs `audio_frame`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostWeights {
    pub text: f64,
    pub image_patch: f64,
    pub audio_frame: f64,
}

impl Default for CostWeights {
    fn default() -> Self {
        Self {
            text: 1.0,
            image_patch: 3.2,
            audio_frame: 4.8,
        }
    }
}

/// What to do with a JSON request body that does not parse.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub enum MalformedJsonPolicy {
    /// Answer 400 with an OpenAI-style error body.
    Reject,
    /// Let it through without charging the tenant (the model server will answer it).
    PassUncosted,
}

/// How a request body is turned into a weighted cost.
#[derive(Debug, Clone, PartialEq)]
pub struct CostConfig {
    pub weights: CostWeights,
    /// Output reservation when the request sets neither `max_completion_tokens` nor `max_tokens`.
    pub default_output_tokens: u32,
    /// Bodies larger than this are not buffered or parsed; they are costed from `content-length`.
    pub max_body_bytes: u64,
    /// Visual tokens assumed for an image whose size cannot be read (a URL, an unknown format).
    pub default_image_patches: u32,
    /// Duration assumed for audio whose length cannot be read from its header.
    pub default_audio_seconds: f64,
    /// Audio encoder frames per second of audio (Whisper/Qwen2-Audio after pooling: 25).
    pub audio_frames_per_second: f64,
    /// Bytes per text token assumed when costing from `content-length`.
    pub content_length_bytes_per_token: f64,
    /// Upper bound of a `content-length` based cost, in weighted tokens.
    pub content_length_cost_cap: u64,
    pub malformed_json: MalformedJsonPolicy,
}

impl Default for CostConfig {
    fn default() -> Self {
        Self {
            weights: CostWeights::default(),
            default_output_tokens: 256,
            max_body_bytes: 1 << 20,
            default_image_patches: 765,
            default_audio_seconds: 30.0,
            audio_frames_per_second: 25.0,
            content_length_bytes_per_token: 4.0,
            content_length_cost_cap: 32_768,
            malformed_json: MalformedJsonPolicy::Reject,
        }
    }
}

/// Where the tenant key of a request comes from; sources are tried in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TenantKeySource {
    /// The value of this request header (name stored lower-case).
    Header(String),
    /// A SHA-256 of the API key (`authorization: Bearer <key>` or `x-api-key`), never the key.
    ApiKeyHash,
    /// The mTLS peer principal (SPIFFE id) of the calling workload.
    PeerPrincipal,
}

impl TenantKeySource {
    fn parse(s: &str) -> Option<Self> {
        match s {
            "apiKeyHash" => Some(Self::ApiKeyHash),
            "peerPrincipal" => Some(Self::PeerPrincipal),
            _ => {
                let name = s.strip_prefix("header:")?;
                if is_header_name(name) {
                    Some(Self::Header(name.to_ascii_lowercase()))
                } else {
                    None
                }
            }
        }
    }

    fn render(&self) -> String {
        match self {
            Self::Header(h) => format!("header:{h}"),
            Self::ApiKeyHash => "apiKeyHash".to_string(),
            Self::PeerPrincipal => "peerPrincipal".to_string(),
        }
    }
}

/// A token bucket's refill rate and size, in weighted tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketParams {
    /// Refill rate in weighted tokens per second.
    pub tokens_per_second: u64,
    /// Bucket capacity: the most a tenant can spend at once after being idle.
    pub burst: u64,
}

impl Default for BucketParams {
    fn default() -> Self {
        Self {
            tokens_per_second: 2_000,
            burst: 64_000,
        }
    }
}

/// Bucket parameters per tenant; tenants without an entry get `default` (each its own bucket).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TenantLimits {
    pub default: BucketParams,
    pub named: BTreeMap<String, BucketParams>,
}

impl TenantLimits {
    pub fn params_for(&self, tenant: &str) -> BucketParams {
        self.named.get(tenant).copied().unwrap_or(self.default)
    }
}

/// A path-prefix route whose requests always get `class`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteClass {
    pub path_prefix: String,
    pub class: PriorityClass,
}

/// How a request's priority class is chosen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PriorityConfig {
    /// Request header carrying `critical`, `standard` or `sheddable` (lower-case name).
    pub header: String,
    pub default_class: PriorityClass,
    /// Route overrides; the longest matching prefix wins and beats the header.
    pub routes: Vec<RouteClass>,
}

impl Default for PriorityConfig {
    fn default() -> Self {
        Self {
            header: "x-ai-lb-priority".to_string(),
            default_class: PriorityClass::Standard,
            routes: Vec::new(),
        }
    }
}

/// What saturation means and how long standard requests may wait through it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SaturationConfig {
    /// A pod above this normalised load counts as saturated (0..=1).
    pub soft_threshold: f64,
    /// How long a standard request is held before it gets 503.
    pub max_wait_standard_ms: u64,
    /// Most requests held per worker; beyond it standard requests get 503 at once.
    pub max_held: usize,
    /// `retry-after` given to shed (429) and timed-out (503) requests.
    pub retry_after_seconds: u32,
}

impl Default for SaturationConfig {
    fn default() -> Self {
        Self {
            soft_threshold: 0.85,
            max_wait_standard_ms: 2_000,
            max_held: 256,
            retry_after_seconds: 1,
        }
    }
}

/// The inbound guard of the inference pod's own sidecar.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GuardConfig {
    pub enabled: bool,
    /// The GPU reading `cutoffs.gpuSignal` chooses (0..=1; by default SM occupancy) at or above
    /// which, with requests already waiting, the pod rejects.
    pub gpu_util_cutoff: f64,
    /// The queue is full when waiting >= capacity * this ratio.
    pub queue_full_ratio: f64,
    pub retry_after_seconds: u32,
    /// Local metrics older than this are stale and the guard admits (fail-open).
    pub max_staleness_ms: u64,
}

impl Default for GuardConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            gpu_util_cutoff: 0.90,
            queue_full_ratio: 1.0,
            retry_after_seconds: 1,
            max_staleness_ms: 5_000,
        }
    }
}

/// The validated `admission` section.
#[derive(Debug, Clone, PartialEq)]
pub struct AdmissionConfig {
    pub enabled: bool,
    pub cost: CostConfig,
    /// Tenant key sources, tried in order; none matching puts the request in tenant `default`.
    pub tenant_key: Vec<TenantKeySource>,
    /// Request headers (lower-case) that a filter running before this one sets from an
    /// authenticated identity, after removing the client's copy. The priority header is read
    /// only when listed here; a tenant key read from an unlisted header is forgeable
    /// ([`AdmissionConfig::trust_warnings`]).
    pub trusted_headers: Vec<String>,
    pub tenants: TenantLimits,
    pub priority: PriorityConfig,
    pub saturation: SaturationConfig,
    pub guard: GuardConfig,
    /// Priority derived from the body for requests that name no class (None: off).
    pub derived_priority: Option<DerivedPriority>,
    /// Latency-aware quota at settlement (None: off).
    pub latency_quota: Option<LatencyQuota>,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            cost: CostConfig::default(),
            // Only what no client can claim: a header or an API key is the client's to write,
            // so those sources are opt-in (issue 31).
            tenant_key: vec![TenantKeySource::PeerPrincipal],
            trusted_headers: Vec::new(),
            tenants: TenantLimits::default(),
            priority: PriorityConfig::default(),
            saturation: SaturationConfig::default(),
            guard: GuardConfig::default(),
            derived_priority: None,
            latency_quota: None,
        }
    }
}

/// A config that is accepted but lets a client claim what it should not (`ai-lb-check-config`
/// prints these): the field path, its value, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrustWarning {
    pub path: String,
    pub value: String,
    pub reason: String,
}

impl std::fmt::Display for TrustWarning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "field `{}`: value {}: {}",
            self.path, self.value, self.reason
        )
    }
}

impl AdmissionConfig {
    /// Whether a filter before ai-lb sets request header `name` (any case) from an
    /// authenticated identity (`trustedHeaders`).
    pub fn trusts(&self, name: &str) -> bool {
        self.trusted_headers
            .iter()
            .any(|h| h.eq_ignore_ascii_case(name))
    }

    /// The priority header to read: only a trusted one (else any client could claim `critical`).
    pub fn priority_header(&self) -> Option<&str> {
        let h = self.priority.header.as_str();
        self.trusts(h).then_some(h)
    }

    /// The priority header when it is NOT trusted: the request lifecycle removes it from every
    /// request, so neither this filter nor anything after it acts on the client's claim.
    pub fn untrusted_priority_header(&self) -> Option<&str> {
        let h = self.priority.header.as_str();
        (!self.trusts(h)).then_some(h)
    }

    /// Tenant key sources a client can forge: a `header:` source whose header is not trusted,
    /// and `apiKeyHash` unless both headers it reads (`authorization`, then `x-api-key`) are.
    pub fn trust_warnings(&self) -> Vec<TrustWarning> {
        let mut out = Vec::new();
        for (i, src) in self.tenant_key.iter().enumerate() {
            let reason = match src {
                TenantKeySource::Header(h) if !self.trusts(h) => format!(
                    "any client can send `{h}` and be charged to the tenant it names (or to a \
                     fresh bucket for every name it invents); take the tenant from \
                     `peerPrincipal`, or from a header that an authentication filter before \
                     ai-lb sets after removing the client's copy, and list that header in \
                     `admission.trustedHeaders`"
                ),
                TenantKeySource::ApiKeyHash
                    if !(self.trusts("authorization") && self.trusts("x-api-key")) =>
                {
                    "any client can invent API keys, each one a tenant with a fresh bucket, \
                     unless a filter before ai-lb rejects unknown keys (e.g. Envoy's \
                     `api_key_auth`) and removes the header it does not check; list \
                     `authorization` and `x-api-key` in `admission.trustedHeaders` once one does"
                        .to_string()
                }
                _ => continue,
            };
            out.push(TrustWarning {
                path: format!("{PREFIX}.tenantKey[{i}]"),
                value: json_str(&src.render()),
                reason,
            });
        }
        out
    }
}

/// Looks up the value at a serde path, to quote it in the error.
fn value_at<'v>(root: &'v Value, path: &serde_path_to_error::Path) -> Option<&'v Value> {
    let mut cur = root;
    for seg in path.iter() {
        cur = match seg {
            serde_path_to_error::Segment::Seq { index } => cur.get(*index)?,
            serde_path_to_error::Segment::Map { key } => cur.get(key.as_str())?,
            serde_path_to_error::Segment::Enum { .. } | serde_path_to_error::Segment::Unknown => {
                return None
            }
        };
    }
    Some(cur)
}

/// What [`AdmissionConfig::from_value`] accepts: the plugin JSON's `admission` value, or an
/// already validated config (so callers written when `FilterConfig::admission` was raw JSON keep
/// compiling; validating a validated config returns it unchanged).
pub trait AdmissionSource {
    fn to_admission(&self) -> Result<AdmissionConfig, ConfigError>;
}

impl AdmissionSource for Value {
    fn to_admission(&self) -> Result<AdmissionConfig, ConfigError> {
        AdmissionConfig::from_json_value(self)
    }
}

impl AdmissionSource for AdmissionConfig {
    fn to_admission(&self) -> Result<AdmissionConfig, ConfigError> {
        Ok(self.clone())
    }
}

impl AdmissionConfig {
    /// Parses and validates the `admission` object of the plugin JSON. `null` means defaults.
    pub fn from_value<S: AdmissionSource + ?Sized>(v: &S) -> Result<Self, ConfigError> {
        v.to_admission()
    }

    fn from_json_value(v: &Value) -> Result<Self, ConfigError> {
        if v.is_null() {
            return Ok(Self::default());
        }
        if !v.is_object() {
            return Err(ConfigError::new(PREFIX, v, "must be a JSON object"));
        }
        let raw: RawAdmission = serde_path_to_error::deserialize(v).map_err(|e| {
            let p = e.path();
            let shown = if p.iter().next().is_none() {
                String::new()
            } else {
                p.to_string()
            };
            let path = if shown.is_empty() {
                PREFIX.to_string()
            } else {
                format!("{PREFIX}.{shown}")
            };
            let value = value_at(v, p).map(|x| x.to_string()).unwrap_or_default();
            ConfigError::new(path, value, e.inner().to_string())
        })?;
        Self::try_from(raw)
    }

    /// The config written back as plugin JSON (every field explicit); `from_value` of it yields
    /// an equal config.
    pub fn to_value(&self) -> Value {
        serde_json::to_value(RawAdmission::from(self)).unwrap_or(Value::Null)
    }
}

#[cfg(test)]
#[allow(clippy::indexing_slicing)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn empty_object_gives_defaults() {
        assert_eq!(
            AdmissionConfig::from_value(&json!({})),
            Ok(AdmissionConfig::default())
        );
        assert_eq!(
            AdmissionConfig::from_value(&Value::Null),
            Ok(AdmissionConfig::default())
        );
    }

    #[test]
    fn full_config_parses() {
        let c = AdmissionConfig::from_value(&json!({
            "cost": {"weights": {"text": 1.0, "imagePatch": 2.0, "audioFrame": 3.0}, "malformedJson": "passUncosted"},
            "tenantKey": ["header:X-Team", "peerPrincipal"],
            "tenants": {"default": {"tokensPerSecond": 100, "burst": 1000}, "gold": {"tokensPerSecond": 9000, "burst": 90000}},
            "priority": {"header": "x-prio", "defaultClass": "sheddable", "routes": [{"pathPrefix": "/v1/embeddings", "class": "critical"}]},
            "saturation": {"softThreshold": 0.7, "maxWaitStandardMs": 500},
            "guard": {"gpuUtilCutoff": 0.95}
        }))
        .unwrap();
        assert_eq!(c.cost.weights.image_patch, 2.0);
        assert_eq!(c.cost.malformed_json, MalformedJsonPolicy::PassUncosted);
        assert_eq!(
            c.tenant_key,
            vec![
                TenantKeySource::Header("x-team".into()),
                TenantKeySource::PeerPrincipal
            ]
        );
        assert_eq!(
            c.tenants.params_for("nobody"),
            BucketParams {
                tokens_per_second: 100,
                burst: 1000
            }
        );
        assert_eq!(c.tenants.params_for("gold").burst, 90000);
        assert_eq!(c.priority.routes[0].class, PriorityClass::Critical);
        assert_eq!(c.priority.default_class, PriorityClass::Sheddable);
        assert_eq!(c.saturation.max_wait_standard_ms, 500);
        assert_eq!(c.guard.gpu_util_cutoff, 0.95);
    }

    #[test]
    fn zero_rate_names_the_field_and_value() {
        let e = AdmissionConfig::from_value(
            &json!({"tenants": {"default": {"tokensPerSecond": 0, "burst": 10}}}),
        )
        .unwrap_err();
        assert_eq!(e.path, "admission.tenants.default.tokensPerSecond");
        assert_eq!(e.value, "0");
    }

    #[test]
    fn type_error_names_the_field_and_value() {
        let e = AdmissionConfig::from_value(
            &json!({"tenants": {"default": {"tokensPerSecond": 1.5, "burst": 10}}}),
        )
        .unwrap_err();
        assert_eq!(e.path, "admission.tenants.default.tokensPerSecond");
        assert_eq!(e.value, "1.5");
    }

    #[test]
    fn unknown_field_is_rejected() {
        let e = AdmissionConfig::from_value(&json!({"guard": {"gpuUtil": 0.9}})).unwrap_err();
        assert!(e.path.starts_with("admission.guard"), "{e}");
        assert!(e.reason.contains("gpuUtil"), "{e}");
    }

    #[test]
    fn bad_values_are_rejected_with_paths() {
        let cases = [
            (
                json!({"cost": {"weights": {"text": 0.0}}}),
                "admission.cost.weights.text",
            ),
            (
                json!({"cost": {"malformedJson": "drop"}}),
                "admission.cost.malformedJson",
            ),
            (json!({"tenantKey": ["cookie:x"]}), "admission.tenantKey[0]"),
            (
                json!({"tenantKey": ["apiKeyHash", "apiKeyHash"]}),
                "admission.tenantKey[1]",
            ),
            (
                json!({"priority": {"defaultClass": "gold"}}),
                "admission.priority.defaultClass",
            ),
            (
                json!({"priority": {"routes": [{"pathPrefix": "v1", "class": "critical"}]}}),
                "admission.priority.routes[0].pathPrefix",
            ),
            (
                json!({"saturation": {"softThreshold": 1.5}}),
                "admission.saturation.softThreshold",
            ),
            (
                json!({"guard": {"retryAfterSeconds": 0}}),
                "admission.guard.retryAfterSeconds",
            ),
        ];
        for (v, path) in cases {
            let e = AdmissionConfig::from_value(&v).unwrap_err();
            assert_eq!(e.path, path, "{v}: {e}");
        }
        let e = AdmissionConfig::from_value(&json!([1])).unwrap_err();
        assert_eq!(e.path, "admission");
    }

    /// Issue 31: the default tenant is the mTLS peer (no client can claim it), a priority header
    /// is read only when a trusted filter sets it, and forgeable tenant keys are named.
    #[test]
    fn trust_defaults_and_trusted_headers() {
        let d = AdmissionConfig::default();
        assert_eq!(d.tenant_key, vec![TenantKeySource::PeerPrincipal]);
        assert!(d.trusted_headers.is_empty());
        assert_eq!(d.priority_header(), None);
        assert_eq!(d.untrusted_priority_header(), Some("x-ai-lb-priority"));
        assert!(d.trust_warnings().is_empty());

        let c = AdmissionConfig::from_value(&json!({
            "tenantKey": ["header:X-Tenant-Id", "apiKeyHash", "header:x-ai-lb-tenant", "peerPrincipal"],
            "trustedHeaders": ["X-AI-LB-Tenant", "x-ai-lb-priority"]
        }))
        .unwrap();
        assert_eq!(
            c.trusted_headers,
            vec!["x-ai-lb-tenant", "x-ai-lb-priority"]
        );
        assert_eq!(c.priority_header(), Some("x-ai-lb-priority"));
        assert_eq!(c.untrusted_priority_header(), None);
        let w = c.trust_warnings();
        assert_eq!(w.len(), 2, "{w:?}");
        assert_eq!(w[0].path, "admission.tenantKey[0]");
        assert_eq!(w[0].value, "\"header:x-tenant-id\"");
        assert!(
            w[0].reason.contains("any client can send `x-tenant-id`"),
            "{}",
            w[0]
        );
        assert_eq!(w[1].path, "admission.tenantKey[1]");
        assert!(w[1].reason.contains("invent API keys"), "{}", w[1]);
        assert!(w[0]
            .to_string()
            .starts_with("field `admission.tenantKey[0]`: value \"header:x-tenant-id\": "));

        let keys = AdmissionConfig::from_value(&json!({
            "tenantKey": ["apiKeyHash"], "trustedHeaders": ["authorization", "x-api-key"]
        }))
        .unwrap();
        assert!(keys.trust_warnings().is_empty());

        for (v, path) in [
            (
                json!({"trustedHeaders": ["x a"]}),
                "admission.trustedHeaders[0]",
            ),
            (
                json!({"trustedHeaders": ["a", "A"]}),
                "admission.trustedHeaders[1]",
            ),
            (
                json!({"trustedHeaders": [""]}),
                "admission.trustedHeaders[0]",
            ),
        ] {
            assert_eq!(
                AdmissionConfig::from_value(&v).unwrap_err().path,
                path,
                "{v}"
            );
        }
    }

    #[test]
    fn round_trips_through_json() {
        let mut c = AdmissionConfig::default();
        c.tenants.named.insert(
            "a".into(),
            BucketParams {
                tokens_per_second: 5,
                burst: 7,
            },
        );
        c.priority.routes.push(RouteClass {
            path_prefix: "/x".into(),
            class: PriorityClass::Sheddable,
        });
        c.trusted_headers.push("x-ai-lb-tenant".into());
        assert_eq!(AdmissionConfig::from_value(&c.to_value()), Ok(c));
    }
}
