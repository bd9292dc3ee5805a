//! Priority derived from the request body, for a request that names no class (no trusted
//! priority header, no matching route): a score in 0..=1 from the prompt's size, the output it
//! asks for and its temperature puts it in tier Ultra, High or Standard (issue 30 part 5).
//!
//! `score = (w_c·complexity + w_o·output + w_t·(1 − clamp(temperature, floor, 1))) / (w_c + w_o + w_t)`
//! - complexity: prompt units on a log scale, `ln(p / promptTokensMin) / ln(promptTokensMax /
//!   promptTokensMin)` clamped to 0..=1 (fewer than `promptTokensMin` units: 0);
//! - output: the request's output reservation (`max_completion_tokens`, else `max_tokens`, else
//!   `cost.defaultOutputTokens`, times `n`) over `outputTokensFull`, at most 1;
//! - temperature: the body's `temperature`, 1.0 (the OpenAI default) when absent or not a number.
//!
//! The tiers map onto the existing classes and the one held queue: Ultra is `critical` and High
//! is `standard` in the per-tenant stats; under saturation each is held at most its
//! `maxHeldMs` in a lane released before every standard request (Ultra's lane first) and, at
//! that deadline, routed anyway (never answered 503). Standard keeps `priority.defaultClass`
//! and its rules.
#![deny(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use serde::{Deserialize, Serialize};

use super::priority::PriorityClass;
use crate::error::ConfigError;

const PREFIX: &str = "admission.derivedPriority";

/// A derived tier, most important first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tier {
    Ultra,
    High,
    Standard,
}

impl Tier {
    pub const ALL: [Tier; 3] = [Self::Ultra, Self::High, Self::Standard];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ultra => "ultra",
            Self::High => "high",
            Self::Standard => "standard",
        }
    }
}

/// What a tier above Standard gets: its score threshold and its bounded hold.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TierRule {
    /// Lowest score of the tier (inclusive).
    pub min_score: f64,
    /// Longest hold under saturation (ms); then the request is routed anyway. 0: never held.
    pub max_held_ms: u64,
}

/// The validated `admission.derivedPriority` section.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DerivedPriority {
    pub weight_complexity: f64,
    pub weight_output: f64,
    pub weight_temperature: f64,
    /// Prompt units at or below which complexity is 0.
    pub prompt_tokens_min: u64,
    /// Prompt units at or above which complexity is 1.
    pub prompt_tokens_max: u64,
    /// Output tokens at or above which the output term is 1.
    pub output_tokens_full: u64,
    /// Lower clamp of the temperature (its upper clamp is 1).
    pub temperature_floor: f64,
    pub ultra: TierRule,
    pub high: TierRule,
}

impl Default for DerivedPriority {
    fn default() -> Self {
        Self {
            weight_complexity: 0.4,
            weight_output: 0.35,
            weight_temperature: 0.25,
            prompt_tokens_min: 16,
            prompt_tokens_max: 16_384,
            output_tokens_full: 4_096,
            temperature_floor: 0.1,
            ultra: TierRule {
                min_score: 0.92,
                max_held_ms: 150,
            },
            high: TierRule {
                min_score: 0.7,
                max_held_ms: 600,
            },
        }
    }
}

/// What the score reads from one request (absent body fields already defaulted by the caller:
/// the output reservation by the cost's rules, the temperature here).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScoreInputs {
    /// Estimated prompt units (text tokens + image patches + audio frames).
    pub prompt_units: u64,
    /// Output reservation in tokens.
    pub output_tokens: u64,
    /// The body's `temperature`, None when absent or not a finite number.
    pub temperature: Option<f64>,
}

/// Temperature of a request that sets none (the OpenAI API's default).
pub const MISSING_TEMPERATURE: f64 = 1.0;

impl DerivedPriority {
    /// Complexity in 0..=1: prompt units on a log scale between the two bounds.
    pub fn complexity(&self, prompt_units: u64) -> f64 {
        let lo = self.prompt_tokens_min.max(1) as f64;
        let hi = self.prompt_tokens_max as f64;
        let p = prompt_units as f64;
        if p <= lo {
            return 0.0;
        }
        let span = (hi / lo).ln();
        if !(span.is_finite() && span > 0.0) {
            return 1.0;
        }
        ((p / lo).ln() / span).clamp(0.0, 1.0)
    }

    /// Output term in 0..=1.
    pub fn output(&self, output_tokens: u64) -> f64 {
        (output_tokens as f64 / self.output_tokens_full.max(1) as f64).clamp(0.0, 1.0)
    }

    /// Temperature term in 0..=1: `1 − clamp(t, floor, 1)`; a missing or unreadable value is 1.0.
    pub fn coolness(&self, temperature: Option<f64>) -> f64 {
        let t = temperature
            .filter(|t| t.is_finite())
            .unwrap_or(MISSING_TEMPERATURE);
        1.0 - t.clamp(self.temperature_floor, 1.0)
    }

    /// The score in 0..=1 (weights are relative: divided by their sum).
    pub fn score(&self, x: &ScoreInputs) -> f64 {
        let sum = self.weight_complexity + self.weight_output + self.weight_temperature;
        if !(sum.is_finite() && sum > 0.0) {
            return 0.0;
        }
        let s = self.weight_complexity * self.complexity(x.prompt_units)
            + self.weight_output * self.output(x.output_tokens)
            + self.weight_temperature * self.coolness(x.temperature);
        (s / sum).clamp(0.0, 1.0)
    }

    /// The tier of a score: Ultra from `ultra.minScore`, else High from `high.minScore`.
    pub fn tier(&self, score: f64) -> Tier {
        if score >= self.ultra.min_score {
            Tier::Ultra
        } else if score >= self.high.min_score {
            Tier::High
        } else {
            Tier::Standard
        }
    }

    /// The class a tier counts under (per-tenant stats), and its bounded hold (None: the
    /// class's own rules apply).
    pub fn class_of(
        &self,
        tier: Tier,
        default_class: PriorityClass,
    ) -> (PriorityClass, Option<u64>) {
        match tier {
            Tier::Ultra => (PriorityClass::Critical, Some(self.ultra.max_held_ms)),
            Tier::High => (PriorityClass::Standard, Some(self.high.max_held_ms)),
            Tier::Standard => (default_class, None),
        }
    }

    /// Validates the raw section; errors name `admission.derivedPriority.<field>` and the value.
    pub(crate) fn from_raw(raw: &RawDerivedPriority) -> Result<Self, ConfigError> {
        let d = Self::default();
        let rw = raw.weights.as_ref();
        let weight = |name: &str, v: Option<f64>, dv: f64| -> Result<f64, ConfigError> {
            let v = v.unwrap_or(dv);
            if v.is_finite() && (0.0..=1.0).contains(&v) {
                Ok(v)
            } else {
                Err(err(
                    &format!("weights.{name}"),
                    v,
                    "must be a number in [0, 1]",
                ))
            }
        };
        let weight_complexity = weight(
            "complexity",
            rw.and_then(|w| w.complexity),
            d.weight_complexity,
        )?;
        let weight_output = weight(
            "outputLength",
            rw.and_then(|w| w.output_length),
            d.weight_output,
        )?;
        let weight_temperature = weight(
            "temperature",
            rw.and_then(|w| w.temperature),
            d.weight_temperature,
        )?;
        let sum = weight_complexity + weight_output + weight_temperature;
        if sum <= 0.0 {
            return Err(err(
                "weights",
                format!("{{complexity: {weight_complexity}, outputLength: {weight_output}, temperature: {weight_temperature}}}"),
                "at least one weight must be above 0 (the score divides by their sum)",
            ));
        }
        let prompt_tokens_min = int(
            "promptTokensMin",
            raw.prompt_tokens_min.unwrap_or(d.prompt_tokens_min),
            1,
            1_024,
        )?;
        let prompt_tokens_max = int(
            "promptTokensMax",
            raw.prompt_tokens_max.unwrap_or(d.prompt_tokens_max),
            2_048,
            10_000_000,
        )?;
        let output_tokens_full = int(
            "outputTokensFull",
            raw.output_tokens_full.unwrap_or(d.output_tokens_full),
            1,
            1_000_000,
        )?;
        let floor = raw.temperature_floor.unwrap_or(d.temperature_floor);
        if !(floor.is_finite() && (0.0..1.0).contains(&floor)) {
            return Err(err("temperatureFloor", floor, "must be a number in [0, 1)"));
        }
        let rule =
            |name: &str, r: Option<&RawTierRule>, dr: TierRule| -> Result<TierRule, ConfigError> {
                let s = r.and_then(|r| r.min_score).unwrap_or(dr.min_score);
                if !(s.is_finite() && s > 0.0 && s <= 1.0) {
                    return Err(err(
                        &format!("{name}.minScore"),
                        s,
                        "must be a number in (0, 1]",
                    ));
                }
                let h = int(
                    &format!("{name}.maxHeldMs"),
                    r.and_then(|r| r.max_held_ms).unwrap_or(dr.max_held_ms),
                    0,
                    60_000,
                )?;
                Ok(TierRule {
                    min_score: s,
                    max_held_ms: h,
                })
            };
        Ok(Self {
            weight_complexity,
            weight_output,
            weight_temperature,
            prompt_tokens_min,
            prompt_tokens_max,
            output_tokens_full,
            temperature_floor: floor,
            ultra: rule("ultra", raw.ultra.as_ref(), d.ultra)?,
            high: rule("high", raw.high.as_ref(), d.high)?,
        })
    }

    pub(crate) fn to_raw(self) -> RawDerivedPriority {
        let rule = |r: TierRule| RawTierRule {
            min_score: Some(r.min_score),
            max_held_ms: Some(r.max_held_ms),
        };
        RawDerivedPriority {
            weights: Some(RawDerivedWeights {
                complexity: Some(self.weight_complexity),
                output_length: Some(self.weight_output),
                temperature: Some(self.weight_temperature),
            }),
            prompt_tokens_min: Some(self.prompt_tokens_min),
            prompt_tokens_max: Some(self.prompt_tokens_max),
            output_tokens_full: Some(self.output_tokens_full),
            temperature_floor: Some(self.temperature_floor),
            ultra: Some(rule(self.ultra)),
            high: Some(rule(self.high)),
        }
    }
}

fn err(path: &str, value: impl std::fmt::Display, reason: &str) -> ConfigError {
    ConfigError::new(format!("{PREFIX}.{path}"), value, reason)
}

fn int(path: &str, v: u64, lo: u64, hi: u64) -> Result<u64, ConfigError> {
    if (lo..=hi).contains(&v) {
        Ok(v)
    } else {
        Err(err(
            path,
            v,
            &format!("must be an integer within {lo}..={hi}"),
        ))
    }
}

/// Priority derived from the request body when the request names no class (no trusted
/// priority header, no matching route): `score = (complexity·w + outputLength·w + (1 −
/// clamp(temperature, temperatureFloor, 1))·w) / Σw`, then tier Ultra (score ≥
/// `ultra.minScore`; counted as `critical`), High (≥ `high.minScore`; counted as `standard`)
/// or Standard (`priority.defaultClass`). Under saturation Ultra and High are held at most
/// their `maxHeldMs`, released before every standard request, and routed at that deadline
/// (never 503). Off unless present. Needs the body parsed (a body costed by its length, or
/// larger than `cost.maxBodyBytes`, stays Standard).
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "DerivedPriority")
)]
pub struct RawDerivedPriority {
    /// Relative weights of the three terms (the score divides by their sum, so with the
    /// defaults' sum of 1 the weights are the shares).
    #[cfg_attr(feature = "schema", schemars(extend("default" = {})))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights: Option<RawDerivedWeights>,
    /// Prompt units (estimated text tokens + image patches + audio frames) at or below which
    /// complexity is 0; the log scale runs from here to `promptTokensMax`.
    #[cfg_attr(feature = "schema", schemars(extend("default" = 16, "minimum" = 1, "maximum" = 1024)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_min: Option<u64>,
    /// Prompt units at or above which complexity is 1.
    #[cfg_attr(feature = "schema", schemars(extend("default" = 16384, "minimum" = 2048, "maximum" = 10_000_000)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_max: Option<u64>,
    /// Output reservation (tokens: `max_completion_tokens`, else `max_tokens`, else
    /// `cost.defaultOutputTokens`, times `n`) at or above which the expected-output term is 1
    /// (linear below).
    #[cfg_attr(feature = "schema", schemars(extend("default" = 4096, "minimum" = 1, "maximum" = 1_000_000)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_tokens_full: Option<u64>,
    /// Lower clamp of the request's `temperature` (the upper clamp is 1); a request with no
    /// numeric `temperature` counts as 1.0, the API's default (temperature term 0).
    #[cfg_attr(feature = "schema", schemars(extend("default" = 0.1, "minimum" = 0, "exclusiveMaximum" = 1)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature_floor: Option<f64>,
    /// Tier Ultra (counted as class `critical`).
    #[cfg_attr(feature = "schema", schemars(extend("default" = {})))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ultra: Option<RawTierRule>,
    /// Tier High (counted as class `standard`). A `minScore` at or above Ultra's leaves no High
    /// tier.
    #[cfg_attr(feature = "schema", schemars(extend("default" = {})))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub high: Option<RawTierRule>,
}

/// Relative weights of the derived score's terms, each in [0, 1], not all 0.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "DerivedPriorityWeights")
)]
pub struct RawDerivedWeights {
    /// Weight of the prompt's complexity (log-scaled prompt size).
    #[cfg_attr(feature = "schema", schemars(extend("default" = 0.4, "minimum" = 0, "maximum" = 1)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub complexity: Option<f64>,
    /// Weight of the expected output length.
    #[cfg_attr(feature = "schema", schemars(extend("default" = 0.35, "minimum" = 0, "maximum" = 1)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_length: Option<f64>,
    /// Weight of `1 − temperature` (clamped).
    #[cfg_attr(feature = "schema", schemars(extend("default" = 0.25, "minimum" = 0, "maximum" = 1)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
}

/// A derived tier's threshold and bounded hold.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "DerivedTier")
)]
pub struct RawTierRule {
    /// Lowest score of the tier (inclusive). Defaults: Ultra 0.92, High 0.7.
    #[cfg_attr(feature = "schema", schemars(extend("exclusiveMinimum" = 0, "maximum" = 1)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_score: Option<f64>,
    /// Longest hold (ms) under saturation, in a lane released before standard requests; at
    /// this deadline the request is routed to the best pod anyway (not answered 503). 0: never
    /// held. Defaults: Ultra 150, High 600.
    #[cfg_attr(feature = "schema", schemars(extend("minimum" = 0, "maximum" = 60_000)))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_held_ms: Option<u64>,
}
