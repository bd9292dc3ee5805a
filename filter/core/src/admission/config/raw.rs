//! The `admission` section's raw serde layer and its validation into [`super::AdmissionConfig`]
//! (steps one and two of three; the domain types and the parse entry live in `super`). Errors
//! name the field path under `admission`, the value and the reason.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::*;
use crate::admission::derived::{DerivedPriority, RawDerivedPriority};
use crate::admission::priority::PriorityClass;
use crate::admission::quota::{LatencyQuota, RawLatencyQuota};
use crate::error::ConfigError;

/// Admission control: token buckets per tenant in weighted tokens, priority classes under
/// saturation, and the inbound guard of the inference pod's sidecar.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "Admission")
)]
pub(crate) struct RawAdmission {
    /// Admission on or off while keeping its settings.
    #[cfg_attr(feature = "schema", schemars(extend("default" = true)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    enabled: Option<bool>,
    /// How request bodies are costed.
    #[cfg_attr(feature = "schema", schemars(extend("default" = {})))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    cost: Option<RawCost>,
    /// Where the tenant key comes from, tried in order: `header:<name>`, `apiKeyHash` (SHA-256 of the
    /// bearer or `x-api-key` key, never the key) or `peerPrincipal` (the mTLS peer's SPIFFE id, which
    /// no client can claim); no duplicates. None matching: tenant `default`. A header (and the API
    /// key's `authorization` / `x-api-key`) is whatever the client writes unless a filter before
    /// ai-lb sets it from an authenticated identity: list it in `trustedHeaders` once one does
    /// (`ai-lb-check-config` warns otherwise).
    #[cfg_attr(feature = "schema", schemars(extend("default" = ["peerPrincipal"])))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tenant_key: Option<Vec<String>>,
    /// Request headers that a filter running before ai-lb sets from an authenticated identity after
    /// removing the client's copy (e.g. `header_mutation` removing it, then `jwt_authn`
    /// `claim_to_headers` setting it; `authorization` behind an `api_key_auth` that rejects unknown
    /// keys). The priority header is read only when listed here: otherwise ai-lb removes it from
    /// the request and the class comes from `priority.routes` or `priority.defaultClass`. Listing a
    /// tenant key's header here says it cannot be forged (no check-config warning). HTTP header
    /// names, matched case-insensitively; no duplicates.
    #[cfg_attr(feature = "schema", schemars(extend("default" = [])))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    trusted_headers: Option<Vec<String>>,
    /// Token bucket per tenant name (1..=128 characters). The entry `default` is the bucket given to
    /// every tenant without its own entry (each tenant gets its own bucket).
    #[cfg_attr(feature = "schema", schemars(extend("default" = {"default": {"tokensPerSecond": 2000, "burst": 64000}})))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tenants: Option<BTreeMap<String, RawBucket>>,
    /// How a request's priority class is chosen.
    #[cfg_attr(feature = "schema", schemars(extend("default" = {})))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    priority: Option<RawPriority>,
    /// What saturation means and how long standard requests wait through it.
    #[cfg_attr(feature = "schema", schemars(extend("default" = {})))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    saturation: Option<RawSaturation>,
    /// The inbound guard (mode `guard`).
    #[cfg_attr(feature = "schema", schemars(extend("default" = {})))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    guard: Option<RawGuard>,
    /// Priority derived from the request body for a request that names no class (issue 30).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    derived_priority: Option<RawDerivedPriority>,
    /// Latency-aware quota: the settled cost scaled by the chosen pod's predicted latency
    /// against an SLO.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    latency_aware_quota: Option<RawLatencyQuota>,
}

/// How a request body is turned into a weighted cost (in weighted tokens).
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "AdmissionCost")
)]
struct RawCost {
    /// Weighted tokens per unit of each modality.
    #[cfg_attr(feature = "schema", schemars(extend("default" = {})))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    weights: Option<RawWeights>,
    /// Output reservation when the request sets neither `max_completion_tokens` nor `max_tokens`.
    #[cfg_attr(feature = "schema", schemars(extend("default" = 256, "minimum" = 0, "maximum" = 1_000_000)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    default_output_tokens: Option<u32>,
    /// Bodies larger than this (bytes) are not buffered; they are costed from `content-length`.
    #[cfg_attr(feature = "schema", schemars(extend("default" = 1_048_576, "minimum" = 1, "maximum" = 67_108_864)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    max_body_bytes: Option<u64>,
    /// Visual tokens assumed for an image whose size cannot be read (a URL, an unknown format).
    #[cfg_attr(feature = "schema", schemars(extend("default" = 765, "minimum" = 0, "maximum" = 100_000)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    default_image_patches: Option<u32>,
    /// Duration (s) assumed for audio whose length cannot be read from its header.
    #[cfg_attr(feature = "schema", schemars(extend("default" = 30.0, "minimum" = 0, "maximum" = 3600)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    default_audio_seconds: Option<f64>,
    /// Audio encoder frames per second of audio (Whisper/Qwen2-Audio after pooling: 25).
    #[cfg_attr(feature = "schema", schemars(extend("default" = 25.0, "exclusiveMinimum" = 0, "maximum" = 1000)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    audio_frames_per_second: Option<f64>,
    /// Bytes per text token assumed when costing from `content-length`.
    #[cfg_attr(feature = "schema", schemars(extend("default" = 4.0, "minimum" = 0.5, "maximum" = 64)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    content_length_bytes_per_token: Option<f64>,
    /// Upper bound of a `content-length` based cost, in weighted tokens.
    #[cfg_attr(feature = "schema", schemars(extend("default" = 32_768, "minimum" = 1, "maximum" = 1_000_000_000)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    content_length_cost_cap: Option<u64>,
    /// A JSON body that does not parse: `reject` (400, OpenAI-style error) or `passUncosted` (let
    /// it through without charging the tenant).
    #[cfg_attr(feature = "schema", schemars(extend("default" = "reject")))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    malformed_json: Option<MalformedJsonPolicy>,
}

/// Weight of one unit of each modality, in weighted tokens.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "CostWeights")
)]
struct RawWeights {
    /// Weight of one text token.
    #[cfg_attr(feature = "schema", schemars(extend("default" = 1.0, "exclusiveMinimum" = 0, "maximum" = 1000)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    text: Option<f64>,
    /// Weight of one image patch (one visual token).
    #[cfg_attr(feature = "schema", schemars(extend("default" = 3.2, "minimum" = 0, "maximum" = 1000)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    image_patch: Option<f64>,
    /// Weight of one audio encoder frame.
    #[cfg_attr(feature = "schema", schemars(extend("default" = 4.8, "minimum" = 0, "maximum" = 1000)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    audio_frame: Option<f64>,
}

/// A token bucket: refill rate and size in weighted tokens. Both fields are required.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "TokenBucket")
)]
struct RawBucket {
    /// Refill rate in weighted tokens per second (integer).
    #[cfg_attr(feature = "schema", schemars(extend("minimum" = 1, "maximum" = 1_000_000_000)))]
    tokens_per_second: u64,
    /// Bucket capacity in weighted tokens: the most a tenant can spend at once after being idle.
    #[cfg_attr(feature = "schema", schemars(extend("minimum" = 1, "maximum" = 1_000_000_000_000_u64)))]
    burst: u64,
}

/// How a request's priority class (`critical`, `standard`, `sheddable`) is chosen.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "Priority")
)]
struct RawPriority {
    /// Request header carrying `critical`, `standard` or `sheddable` (HTTP header name, matched
    /// case-insensitively). Read only when listed in `admission.trustedHeaders` (any client could
    /// otherwise claim `critical`); else removed from the request and ignored.
    #[cfg_attr(feature = "schema", schemars(extend("default" = "x-ai-lb-priority")))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    header: Option<String>,
    /// Class of a request with no (valid) header and no matching route: `critical`, `standard` or
    /// `sheddable`.
    #[cfg_attr(feature = "schema", schemars(extend("default" = "standard", "enum" = ["critical", "standard", "sheddable", null])))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    default_class: Option<String>,
    /// Route overrides; the longest matching `pathPrefix` wins and beats the header.
    #[cfg_attr(feature = "schema", schemars(extend("default" = [])))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    routes: Option<Vec<RawRoute>>,
}

/// A path-prefix route whose requests always get `class`. Both fields are required.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "PriorityRoute")
)]
struct RawRoute {
    /// Path prefix, starting with `/`.
    path_prefix: String,
    /// `critical`, `standard` or `sheddable`.
    #[cfg_attr(feature = "schema", schemars(extend("enum" = ["critical", "standard", "sheddable"])))]
    class: String,
}

/// What saturation means and how long standard requests may wait through it.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "Saturation")
)]
struct RawSaturation {
    /// A pod above this normalised load counts as saturated.
    #[cfg_attr(feature = "schema", schemars(extend("default" = 0.85, "exclusiveMinimum" = 0, "maximum" = 1)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    soft_threshold: Option<f64>,
    /// How long (ms) a standard request is held through saturation before it gets 503.
    #[cfg_attr(feature = "schema", schemars(extend("default" = 2000, "minimum" = 0, "maximum" = 300_000)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    max_wait_standard_ms: Option<u64>,
    /// Most requests held per worker; beyond it standard requests get 503 at once.
    #[cfg_attr(feature = "schema", schemars(extend("default" = 256, "minimum" = 0, "maximum" = 100_000)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    max_held: Option<usize>,
    /// `retry-after` (s) given to shed (429) and timed-out (503) requests.
    #[cfg_attr(feature = "schema", schemars(extend("default" = 1, "minimum" = 1, "maximum" = 3600)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    retry_after_seconds: Option<u32>,
}

/// The inbound guard of the inference pod's own sidecar (mode `guard`).
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "Guard")
)]
struct RawGuard {
    /// Guard on or off.
    #[cfg_attr(feature = "schema", schemars(extend("default" = true)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    enabled: Option<bool>,
    /// The GPU reading `cutoffs.gpuSignal` chooses (by default SM occupancy; a GPU reporting only NVML's time fraction never trips it) at or above which, with requests already waiting, the pod rejects.
    #[cfg_attr(feature = "schema", schemars(extend("default" = 0.9, "exclusiveMinimum" = 0, "maximum" = 1)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    gpu_util_cutoff: Option<f64>,
    /// The queue is full when waiting ≥ capacity × this ratio.
    #[cfg_attr(feature = "schema", schemars(extend("default" = 1.0, "exclusiveMinimum" = 0, "maximum" = 100)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    queue_full_ratio: Option<f64>,
    /// `retry-after` (s) of a guard rejection (503).
    #[cfg_attr(feature = "schema", schemars(extend("default" = 1, "minimum" = 1, "maximum" = 3600)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    retry_after_seconds: Option<u32>,
    /// Local metrics older than this (ms) are stale and the guard admits (fail-open).
    #[cfg_attr(feature = "schema", schemars(extend("default" = 5000, "minimum" = 1, "maximum" = 600_000)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    max_staleness_ms: Option<u64>,
}

// ---------------------------------------------------------------- validation

fn err(path: &str, value: impl std::fmt::Display, reason: &str) -> ConfigError {
    ConfigError::new(format!("{PREFIX}.{path}"), value, reason)
}

pub(super) fn json_str(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| s.to_string())
}

pub(super) fn is_header_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 256
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.!#$%&'*+^`|~".contains(&b))
}

fn finite_in(
    path: &str,
    v: f64,
    lo: f64,
    hi: f64,
    lo_open: bool,
    what: &str,
) -> Result<f64, ConfigError> {
    let ok = v.is_finite() && (if lo_open { v > lo } else { v >= lo }) && v <= hi;
    if ok {
        Ok(v)
    } else {
        Err(err(path, v, what))
    }
}

fn int_in<T: Copy + PartialOrd + std::fmt::Display>(
    path: &str,
    v: T,
    lo: T,
    hi: T,
    what: &str,
) -> Result<T, ConfigError> {
    if v >= lo && v <= hi {
        Ok(v)
    } else {
        Err(err(path, v, what))
    }
}

fn class_from(path: &str, s: &str) -> Result<PriorityClass, ConfigError> {
    PriorityClass::parse(s).ok_or_else(|| {
        err(
            path,
            json_str(s),
            "must be one of \"critical\", \"standard\", \"sheddable\"",
        )
    })
}

impl TryFrom<RawAdmission> for AdmissionConfig {
    type Error = ConfigError;

    fn try_from(raw: RawAdmission) -> Result<Self, ConfigError> {
        let d = AdmissionConfig::default();
        let rc = raw.cost.unwrap_or_default();
        let rw = rc.weights.unwrap_or_default();
        let dw = d.cost.weights;
        let weights = CostWeights {
            text: finite_in(
                "cost.weights.text",
                rw.text.unwrap_or(dw.text),
                0.0,
                1000.0,
                true,
                "must be a number in (0, 1000]",
            )?,
            image_patch: finite_in(
                "cost.weights.imagePatch",
                rw.image_patch.unwrap_or(dw.image_patch),
                0.0,
                1000.0,
                false,
                "must be a number in [0, 1000]",
            )?,
            audio_frame: finite_in(
                "cost.weights.audioFrame",
                rw.audio_frame.unwrap_or(dw.audio_frame),
                0.0,
                1000.0,
                false,
                "must be a number in [0, 1000]",
            )?,
        };
        let dc = &d.cost;
        let cost = CostConfig {
            weights,
            default_output_tokens: int_in(
                "cost.defaultOutputTokens",
                rc.default_output_tokens.unwrap_or(dc.default_output_tokens),
                0,
                1_000_000,
                "must be within 0..=1000000",
            )?,
            max_body_bytes: int_in(
                "cost.maxBodyBytes",
                rc.max_body_bytes.unwrap_or(dc.max_body_bytes),
                1,
                64 << 20,
                "must be within 1..=67108864 (64 MiB)",
            )?,
            default_image_patches: int_in(
                "cost.defaultImagePatches",
                rc.default_image_patches.unwrap_or(dc.default_image_patches),
                0,
                100_000,
                "must be within 0..=100000",
            )?,
            default_audio_seconds: finite_in(
                "cost.defaultAudioSeconds",
                rc.default_audio_seconds.unwrap_or(dc.default_audio_seconds),
                0.0,
                3600.0,
                false,
                "must be a number of seconds in [0, 3600]",
            )?,
            audio_frames_per_second: finite_in(
                "cost.audioFramesPerSecond",
                rc.audio_frames_per_second
                    .unwrap_or(dc.audio_frames_per_second),
                0.0,
                1000.0,
                true,
                "must be a number in (0, 1000]",
            )?,
            content_length_bytes_per_token: finite_in(
                "cost.contentLengthBytesPerToken",
                rc.content_length_bytes_per_token
                    .unwrap_or(dc.content_length_bytes_per_token),
                0.5,
                64.0,
                false,
                "must be a number in [0.5, 64]",
            )?,
            content_length_cost_cap: int_in(
                "cost.contentLengthCostCap",
                rc.content_length_cost_cap
                    .unwrap_or(dc.content_length_cost_cap),
                1,
                1_000_000_000,
                "must be within 1..=1000000000",
            )?,
            malformed_json: rc.malformed_json.unwrap_or(dc.malformed_json),
        };

        let tenant_key = match raw.tenant_key {
            None => d.tenant_key,
            Some(list) => {
                let mut out: Vec<TenantKeySource> = Vec::with_capacity(list.len());
                for (i, s) in list.iter().enumerate() {
                    let path = format!("tenantKey[{i}]");
                    let src = TenantKeySource::parse(s).ok_or_else(|| {
                        err(
                            &path,
                            json_str(s),
                            "must be \"header:<name>\", \"apiKeyHash\" or \"peerPrincipal\"",
                        )
                    })?;
                    if out.contains(&src) {
                        return Err(err(&path, json_str(s), "is listed twice"));
                    }
                    out.push(src);
                }
                out
            }
        };

        let mut trusted_headers: Vec<String> = Vec::new();
        for (i, h) in raw.trusted_headers.unwrap_or_default().iter().enumerate() {
            let path = format!("trustedHeaders[{i}]");
            if !is_header_name(h) {
                return Err(err(
                    &path,
                    json_str(h),
                    "must be a non-empty HTTP header name",
                ));
            }
            let name = h.to_ascii_lowercase();
            if trusted_headers.contains(&name) {
                return Err(err(&path, json_str(h), "is listed twice"));
            }
            trusted_headers.push(name);
        }

        let mut tenants = TenantLimits::default();
        for (name, b) in raw.tenants.unwrap_or_default() {
            let base = format!("tenants.{name}");
            if name.is_empty() || name.len() > 128 {
                return Err(err(
                    "tenants",
                    json_str(&name),
                    "tenant names must be 1..=128 characters",
                ));
            }
            let params = BucketParams {
                tokens_per_second: int_in(
                    &format!("{base}.tokensPerSecond"),
                    b.tokens_per_second,
                    1,
                    1_000_000_000,
                    "must be an integer within 1..=1000000000 weighted tokens per second",
                )?,
                burst: int_in(
                    &format!("{base}.burst"),
                    b.burst,
                    1,
                    1_000_000_000_000,
                    "must be an integer within 1..=1000000000000 weighted tokens",
                )?,
            };
            if name == "default" {
                tenants.default = params;
            } else {
                tenants.named.insert(name, params);
            }
        }

        let rp = raw.priority.unwrap_or_default();
        let header = match rp.header {
            None => d.priority.header,
            Some(h) if is_header_name(&h) => h.to_ascii_lowercase(),
            Some(h) => {
                return Err(err(
                    "priority.header",
                    json_str(&h),
                    "must be a non-empty HTTP header name",
                ))
            }
        };
        let default_class = match rp.default_class {
            None => d.priority.default_class,
            Some(c) => class_from("priority.defaultClass", &c)?,
        };
        let mut routes = Vec::new();
        for (i, r) in rp.routes.unwrap_or_default().into_iter().enumerate() {
            if !r.path_prefix.starts_with('/') {
                return Err(err(
                    &format!("priority.routes[{i}].pathPrefix"),
                    json_str(&r.path_prefix),
                    "must start with '/'",
                ));
            }
            let class = class_from(&format!("priority.routes[{i}].class"), &r.class)?;
            routes.push(RouteClass {
                path_prefix: r.path_prefix,
                class,
            });
        }
        let priority = PriorityConfig {
            header,
            default_class,
            routes,
        };

        let rs = raw.saturation.unwrap_or_default();
        let ds = d.saturation;
        let saturation = SaturationConfig {
            soft_threshold: finite_in(
                "saturation.softThreshold",
                rs.soft_threshold.unwrap_or(ds.soft_threshold),
                0.0,
                1.0,
                true,
                "must be a number in (0, 1]",
            )?,
            max_wait_standard_ms: int_in(
                "saturation.maxWaitStandardMs",
                rs.max_wait_standard_ms.unwrap_or(ds.max_wait_standard_ms),
                0,
                300_000,
                "must be within 0..=300000 ms",
            )?,
            max_held: int_in(
                "saturation.maxHeld",
                rs.max_held.unwrap_or(ds.max_held),
                0,
                100_000,
                "must be within 0..=100000",
            )?,
            retry_after_seconds: int_in(
                "saturation.retryAfterSeconds",
                rs.retry_after_seconds.unwrap_or(ds.retry_after_seconds),
                1,
                3600,
                "must be within 1..=3600 seconds",
            )?,
        };

        let rg = raw.guard.unwrap_or_default();
        let dg = d.guard;
        let guard = GuardConfig {
            enabled: rg.enabled.unwrap_or(dg.enabled),
            gpu_util_cutoff: finite_in(
                "guard.gpuUtilCutoff",
                rg.gpu_util_cutoff.unwrap_or(dg.gpu_util_cutoff),
                0.0,
                1.0,
                true,
                "must be a utilisation in (0, 1]",
            )?,
            queue_full_ratio: finite_in(
                "guard.queueFullRatio",
                rg.queue_full_ratio.unwrap_or(dg.queue_full_ratio),
                0.0,
                100.0,
                true,
                "must be a number in (0, 100]",
            )?,
            retry_after_seconds: int_in(
                "guard.retryAfterSeconds",
                rg.retry_after_seconds.unwrap_or(dg.retry_after_seconds),
                1,
                3600,
                "must be within 1..=3600 seconds",
            )?,
            max_staleness_ms: int_in(
                "guard.maxStalenessMs",
                rg.max_staleness_ms.unwrap_or(dg.max_staleness_ms),
                1,
                600_000,
                "must be within 1..=600000 ms",
            )?,
        };

        Ok(AdmissionConfig {
            enabled: raw.enabled.unwrap_or(d.enabled),
            cost,
            tenant_key,
            trusted_headers,
            tenants,
            priority,
            saturation,
            guard,
            derived_priority: raw
                .derived_priority
                .as_ref()
                .map(DerivedPriority::from_raw)
                .transpose()?,
            latency_quota: raw
                .latency_aware_quota
                .as_ref()
                .map(LatencyQuota::from_raw)
                .transpose()?,
        })
    }
}

impl From<&AdmissionConfig> for RawAdmission {
    fn from(c: &AdmissionConfig) -> Self {
        let mut tenants: BTreeMap<String, RawBucket> = c
            .tenants
            .named
            .iter()
            .map(|(k, p)| {
                (
                    k.clone(),
                    RawBucket {
                        tokens_per_second: p.tokens_per_second,
                        burst: p.burst,
                    },
                )
            })
            .collect();
        tenants.insert(
            "default".to_string(),
            RawBucket {
                tokens_per_second: c.tenants.default.tokens_per_second,
                burst: c.tenants.default.burst,
            },
        );
        RawAdmission {
            enabled: Some(c.enabled),
            cost: Some(RawCost {
                weights: Some(RawWeights {
                    text: Some(c.cost.weights.text),
                    image_patch: Some(c.cost.weights.image_patch),
                    audio_frame: Some(c.cost.weights.audio_frame),
                }),
                default_output_tokens: Some(c.cost.default_output_tokens),
                max_body_bytes: Some(c.cost.max_body_bytes),
                default_image_patches: Some(c.cost.default_image_patches),
                default_audio_seconds: Some(c.cost.default_audio_seconds),
                audio_frames_per_second: Some(c.cost.audio_frames_per_second),
                content_length_bytes_per_token: Some(c.cost.content_length_bytes_per_token),
                content_length_cost_cap: Some(c.cost.content_length_cost_cap),
                malformed_json: Some(c.cost.malformed_json),
            }),
            tenant_key: Some(c.tenant_key.iter().map(TenantKeySource::render).collect()),
            trusted_headers: Some(c.trusted_headers.clone()),
            tenants: Some(tenants),
            priority: Some(RawPriority {
                header: Some(c.priority.header.clone()),
                default_class: Some(c.priority.default_class.as_str().to_string()),
                routes: Some(
                    c.priority
                        .routes
                        .iter()
                        .map(|r| RawRoute {
                            path_prefix: r.path_prefix.clone(),
                            class: r.class.as_str().to_string(),
                        })
                        .collect(),
                ),
            }),
            saturation: Some(RawSaturation {
                soft_threshold: Some(c.saturation.soft_threshold),
                max_wait_standard_ms: Some(c.saturation.max_wait_standard_ms),
                max_held: Some(c.saturation.max_held),
                retry_after_seconds: Some(c.saturation.retry_after_seconds),
            }),
            guard: Some(RawGuard {
                enabled: Some(c.guard.enabled),
                gpu_util_cutoff: Some(c.guard.gpu_util_cutoff),
                queue_full_ratio: Some(c.guard.queue_full_ratio),
                retry_after_seconds: Some(c.guard.retry_after_seconds),
                max_staleness_ms: Some(c.guard.max_staleness_ms),
            }),
            derived_priority: c.derived_priority.map(DerivedPriority::to_raw),
            latency_aware_quota: c.latency_quota.map(LatencyQuota::to_raw),
        }
    }
}
