//! Latency-aware quota (issue 30 part 5): what a request is charged in its tenant's bucket,
//! scaled by the latency its chosen pod was predicted to give against an SLO τ:
//!
//! `quota = max(minTokens, min(maxTokens, base × (τ / predicted)^exponent))`
//!
//! - base: the request's weighted cost as settled (the response's `usage`, weighted);
//! - predicted (ms): the chosen pod's TTFT p99 (as its agent reports it) + the request's output
//!   reservation × the pod's smoothed inter-token latency, read when the request is routed.
//!
//! The scale is applied at settlement, not at admission: the pod is picked after admission
//! (and after a hold), so the reservation taken at admission is the plain cost and the
//! settlement charges (or refunds to) the scaled one. A pod with no TTFT reading, or no decode
//! reading for a request that generates, gives no prediction: the plain cost is charged
//! (counted `quota.no_prediction`).
#![deny(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use serde::{Deserialize, Serialize};

use crate::error::ConfigError;

const PREFIX: &str = "admission.latencyAwareQuota";

/// The validated `admission.latencyAwareQuota` section.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatencyQuota {
    /// τ: the latency SLO (ms) a prediction is compared with.
    pub slo_ms: f64,
    pub exponent: f64,
    pub min_tokens: u64,
    pub max_tokens: u64,
}

impl Default for LatencyQuota {
    fn default() -> Self {
        Self {
            slo_ms: 2_000.0,
            exponent: 0.8,
            min_tokens: 64,
            max_tokens: 2_048,
        }
    }
}

/// How one quota came out, for the stats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuotaEffect {
    ScaledUp,
    ScaledDown,
    Unchanged,
    ClampedMin,
    ClampedMax,
}

impl QuotaEffect {
    pub fn stat(self) -> &'static str {
        match self {
            Self::ScaledUp => "quota.scaled_up",
            Self::ScaledDown => "quota.scaled_down",
            Self::Unchanged => "quota.unchanged",
            Self::ClampedMin => "quota.clamped_min",
            Self::ClampedMax => "quota.clamped_max",
        }
    }
}

impl LatencyQuota {
    /// Predicted latency (ms) on a pod: its TTFT plus `output_tokens` at its decode speed.
    /// None when a reading it needs is missing or not a positive finite number.
    pub fn predict_ms(
        ttft_ms: Option<f64>,
        decode_ms_per_token: Option<f64>,
        output_tokens: u64,
    ) -> Option<f64> {
        let ttft = ttft_ms.filter(|t| t.is_finite() && *t >= 0.0)?;
        let decode = if output_tokens == 0 {
            0.0
        } else {
            let d = decode_ms_per_token.filter(|d| d.is_finite() && *d > 0.0)?;
            d * output_tokens as f64
        };
        let p = ttft + decode;
        (p.is_finite() && p > 0.0).then_some(p)
    }

    /// `(τ / predicted)^exponent`, finite and positive (None for a nonsense prediction).
    pub fn scale(&self, predicted_ms: f64) -> Option<f64> {
        if !(predicted_ms.is_finite() && predicted_ms > 0.0) {
            return None;
        }
        let s = (self.slo_ms / predicted_ms).powf(self.exponent);
        (s.is_finite() && s > 0.0).then_some(s)
    }

    /// The quota of a request of plain cost `base` at `scale`, and how it came out.
    pub fn quota(&self, base: u64, scale: f64) -> (u64, QuotaEffect) {
        let scaled = base as f64 * scale;
        let lo = self.min_tokens as f64;
        let hi = self.max_tokens as f64;
        // `as` saturates; the clamp keeps it within min..=max anyway.
        let q = scaled.clamp(lo, hi).round() as u64;
        let effect = if scaled < lo {
            QuotaEffect::ClampedMin
        } else if scaled > hi {
            QuotaEffect::ClampedMax
        } else if q > base {
            QuotaEffect::ScaledUp
        } else if q < base {
            QuotaEffect::ScaledDown
        } else {
            QuotaEffect::Unchanged
        };
        (q, effect)
    }

    /// Validates the raw section; errors name `admission.latencyAwareQuota.<field>` and the value.
    pub(crate) fn from_raw(raw: &RawLatencyQuota) -> Result<Self, ConfigError> {
        let d = Self::default();
        let slo = raw.slo_ms.unwrap_or(d.slo_ms as u64);
        if !(1..=600_000).contains(&slo) {
            return Err(err("sloMs", slo, "must be an integer within 1..=600000 ms"));
        }
        let exponent = raw.exponent.unwrap_or(d.exponent);
        if !(exponent.is_finite() && exponent > 0.0 && exponent <= 4.0) {
            return Err(err("exponent", exponent, "must be a number in (0, 4]"));
        }
        let min_tokens = raw.min_tokens.unwrap_or(d.min_tokens);
        if !(1..=1_024).contains(&min_tokens) {
            return Err(err(
                "minTokens",
                min_tokens,
                "must be an integer within 1..=1024",
            ));
        }
        let max_tokens = raw.max_tokens.unwrap_or(d.max_tokens);
        if !(1_024..=100_000_000).contains(&max_tokens) {
            return Err(err(
                "maxTokens",
                max_tokens,
                "must be an integer within 1024..=100000000",
            ));
        }
        Ok(Self {
            slo_ms: slo as f64,
            exponent,
            min_tokens,
            max_tokens,
        })
    }

    pub(crate) fn to_raw(self) -> RawLatencyQuota {
        RawLatencyQuota {
            slo_ms: Some(self.slo_ms as u64),
            exponent: Some(self.exponent),
            min_tokens: Some(self.min_tokens),
            max_tokens: Some(self.max_tokens),
        }
    }
}

fn err(path: &str, value: impl std::fmt::Display, reason: &str) -> ConfigError {
    ConfigError::new(format!("{PREFIX}.{path}"), value, reason)
}

/// Latency-aware quota: the tenant is charged `max(minTokens, min(maxTokens, cost × (sloMs /
/// predicted)^exponent))` instead of the request's weighted cost, where `predicted` is the
/// chosen pod's TTFT p99 + the output reservation × its inter-token latency when the request
/// was routed. Applied when the reservation is settled with the response's `usage` (the pod is
/// chosen after admission); no prediction: the plain cost. Use it when a tenant's budget
/// should buy latency rather than raw tokens (requests served slower than the SLO cost less,
/// faster ones more) and per-request costs are modest: the cap makes every request above
/// `maxTokens` cost the same. Off unless present.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "LatencyAwareQuota")
)]
pub struct RawLatencyQuota {
    /// τ: the latency SLO (ms) of a whole request that the prediction is compared with.
    #[cfg_attr(feature = "schema", schemars(extend("default" = 2000, "minimum" = 1, "maximum" = 600_000)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slo_ms: Option<u64>,
    /// Exponent of `τ / predicted`.
    #[cfg_attr(feature = "schema", schemars(extend("default" = 0.8, "exclusiveMinimum" = 0, "maximum" = 4)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exponent: Option<f64>,
    /// Least quota charged (weighted tokens).
    #[cfg_attr(feature = "schema", schemars(extend("default" = 64, "minimum" = 1, "maximum" = 1024)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_tokens: Option<u64>,
    /// Most quota charged (weighted tokens).
    #[cfg_attr(feature = "schema", schemars(extend("default" = 2048, "minimum" = 1024, "maximum" = 100_000_000)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u64>,
}
