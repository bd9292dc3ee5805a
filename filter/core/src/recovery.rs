//! Ramped recovery (`breaker.recoveryRamp`): after a pod's breaker closes (its half-open probes
//! passed), the pod does not get its whole score-based share back at once. Its draw weight is
//! scaled by each step of the ramp in turn (by default 0.1, 0.3, 0.5 of it, `stepMs` each, then
//! the whole), and any failure while it ramps re-opens the breaker at once, as a failed probe
//! would (the doubled cooldown is still remembered). A pod that healed only partly (a restarted
//! server still loading, a GPU that throttles again under load) then fails on a tenth of its
//! traffic instead of all of it, and is cut again after one failure instead of
//! `consecutiveFailures`.
//!
//! A step is held for `stepMs`; it passes when no request failed on the pod meanwhile (a failure
//! would have re-opened it). The ramp is read off the shared breaker (closed at
//! `open_until_ms`, see [`Breaker`]), so every worker of a sidecar ramps the same pod alike
//! without storing anything more.

use serde::Deserialize;

use crate::breaker::{Breaker, BreakerState};
use crate::error::ConfigError;

/// Most steps a ramp may have.
pub const MAX_STEPS: usize = 8;

/// The validated `breaker.recoveryRamp`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RecoveryRamp {
    steps: [f64; MAX_STEPS],
    len: usize,
    /// How long each step is held (ms, > 0).
    pub step_ms: u64,
}

impl Default for RecoveryRamp {
    /// The design documents' ramp: 0.1, 0.3, 0.5, then the whole share; 5 s a step.
    fn default() -> Self {
        Self::new(&[0.1, 0.3, 0.5], 5_000).unwrap_or(Self {
            steps: [1.0; MAX_STEPS],
            len: 0,
            step_ms: 5_000,
        })
    }
}

impl RecoveryRamp {
    /// A ramp through `steps` (each in (0, 1), increasing; at most [`MAX_STEPS`]), `step_ms`
    /// each. None when the steps are not valid (see [`RecoveryRamp::from_raw`] for the errors).
    pub fn new(steps: &[f64], step_ms: u64) -> Option<Self> {
        if steps.is_empty() || steps.len() > MAX_STEPS || step_ms == 0 {
            return None;
        }
        let mut out = [1.0; MAX_STEPS];
        let mut last = 0.0;
        for (slot, &s) in out.iter_mut().zip(steps) {
            if !(s.is_finite() && s > last && s < 1.0) {
                return None;
            }
            *slot = s;
            last = s;
        }
        Some(Self {
            steps: out,
            len: steps.len(),
            step_ms,
        })
    }

    /// The steps, in order (the whole share follows the last).
    pub fn steps(&self) -> &[f64] {
        self.steps.get(..self.len).unwrap_or(&[])
    }

    /// How long the whole ramp lasts (ms).
    pub fn total_ms(&self) -> u64 {
        self.step_ms.saturating_mul(self.len as u64)
    }

    /// Where `b` stands on the ramp at `now_ms`: the share of its weight it gets and when that
    /// step ends. None when it is not ramping: never opened, not Closed, or closed at least
    /// [`RecoveryRamp::total_ms`] ago.
    pub fn at(&self, b: &Breaker, now_ms: u64) -> Option<Step> {
        if b.state() != BreakerState::Closed || !b.closed_after_open() {
            return None;
        }
        let closed_at = b.open_until_ms();
        let since = now_ms.saturating_sub(closed_at);
        let i = usize::try_from(since / self.step_ms).ok()?;
        let share = *self.steps().get(i)?;
        let ends_ms = closed_at.saturating_add(self.step_ms.saturating_mul(i as u64 + 1));
        Some(Step { share, ends_ms })
    }

    /// Validates the raw section; errors name `breaker.recoveryRamp.<field>` and the value.
    pub fn from_raw(raw: &RawRecoveryRamp) -> Result<Self, ConfigError> {
        let d = Self::default();
        let step_ms = match raw.step_ms {
            None => d.step_ms,
            Some(x) if (100..=600_000).contains(&x) => x,
            Some(x) => {
                return Err(ConfigError::new(
                    "breaker.recoveryRamp.stepMs",
                    x,
                    "must be within 100..=600000 (milliseconds)",
                ))
            }
        };
        let Some(steps) = raw.steps.as_deref() else {
            return Ok(Self { step_ms, ..d });
        };
        if steps.is_empty() || steps.len() > MAX_STEPS {
            return Err(ConfigError::new(
                "breaker.recoveryRamp.steps",
                format!("{steps:?}"),
                format!("must list 1 to {MAX_STEPS} shares"),
            ));
        }
        let mut last = 0.0;
        for (i, &s) in steps.iter().enumerate() {
            if !(s.is_finite() && s > 0.0 && s < 1.0) {
                return Err(ConfigError::new(
                    format!("breaker.recoveryRamp.steps[{i}]"),
                    s,
                    "must be within (0, 1): the whole share follows the last step",
                ));
            }
            if s <= last {
                return Err(ConfigError::new(
                    format!("breaker.recoveryRamp.steps[{i}]"),
                    s,
                    format!("must be larger than the step before it ({last})"),
                ));
            }
            last = s;
        }
        Self::new(steps, step_ms).ok_or_else(|| {
            ConfigError::new(
                "breaker.recoveryRamp.steps",
                format!("{steps:?}"),
                "invalid",
            )
        })
    }
}

/// One step of a ramp.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Step {
    /// The share of its weight the pod gets, in (0, 1).
    pub share: f64,
    /// When this step ends (monotonic ms).
    pub ends_ms: u64,
}

/// `breaker.recoveryRamp` as written; present (an object, even `{}`) turns the ramp on.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "RecoveryRamp")
)]
pub struct RawRecoveryRamp {
    /// The share of its score-based weight a pod gets in each step after its breaker closes,
    /// increasing, each within (0, 1); the whole weight follows the last step.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = [0.1, 0.3, 0.5], "minItems" = 1, "maxItems" = 8))
    )]
    pub steps: Option<Vec<f64>>,
    /// How long each step is held (ms). A failure on the pod during the ramp re-opens its
    /// breaker at once.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 5000, "minimum" = 100, "maximum" = 600_000))
    )]
    pub step_ms: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::breaker::TripReason;
    use crate::config::BreakerConfig;

    /// A breaker opened at 0 and closed by its probes at `closed_at`.
    fn closed_at(closed_at: u64) -> (Breaker, BreakerConfig) {
        let cfg = BreakerConfig {
            half_open_probes: 1,
            base_cooldown_ms: 1_000,
            ..BreakerConfig::default()
        };
        let mut b = Breaker::default();
        b.trip(TripReason::ServerErrors, 0, &cfg);
        b.poll(1_000, &cfg);
        b.on_request(1_000);
        b.record(None, closed_at, &cfg);
        assert_eq!(b.state(), BreakerState::Closed);
        (b, cfg)
    }

    #[test]
    fn the_default_ramp_steps_through_a_tenth_three_tenths_and_half_then_ends() {
        let r = RecoveryRamp::default();
        assert_eq!(r.steps(), &[0.1, 0.3, 0.5]);
        let (b, _) = closed_at(2_000);
        let at = |t| r.at(&b, t).map(|s| (s.share, s.ends_ms));
        assert_eq!(at(2_000), Some((0.1, 7_000)));
        assert_eq!(at(6_999), Some((0.1, 7_000)));
        assert_eq!(at(7_000), Some((0.3, 12_000)));
        assert_eq!(at(16_999), Some((0.5, 17_000)));
        assert_eq!(at(17_000), None, "the whole share after the last step");
    }

    #[test]
    fn a_breaker_that_never_opened_or_is_not_closed_does_not_ramp() {
        let r = RecoveryRamp::default();
        assert_eq!(r.at(&Breaker::default(), 10), None);
        let cfg = BreakerConfig::default();
        let mut b = Breaker::default();
        b.trip(TripReason::ServerErrors, 0, &cfg);
        assert_eq!(r.at(&b, 10), None, "open");
        b.poll(1_000_000, &cfg);
        assert_eq!(b.state(), BreakerState::HalfOpen);
        assert_eq!(r.at(&b, 1_000_000), None, "half-open");
    }

    #[test]
    fn bad_steps_are_refused_naming_the_field_and_value() {
        let raw = |steps: Vec<f64>| RawRecoveryRamp {
            steps: Some(steps),
            step_ms: None,
        };
        let e = RecoveryRamp::from_raw(&raw(vec![0.1, 1.0])).unwrap_err();
        assert_eq!(e.path, "breaker.recoveryRamp.steps[1]");
        assert_eq!(e.value, "1");
        let e = RecoveryRamp::from_raw(&raw(vec![0.5, 0.3])).unwrap_err();
        assert_eq!(e.path, "breaker.recoveryRamp.steps[1]");
        let e = RecoveryRamp::from_raw(&raw(vec![])).unwrap_err();
        assert_eq!(e.path, "breaker.recoveryRamp.steps");
        let e = RecoveryRamp::from_raw(&raw(vec![f64::NAN])).unwrap_err();
        assert_eq!(e.path, "breaker.recoveryRamp.steps[0]");
        let e = RecoveryRamp::from_raw(&RawRecoveryRamp {
            steps: None,
            step_ms: Some(0),
        })
        .unwrap_err();
        assert_eq!(e.path, "breaker.recoveryRamp.stepMs");
        let ok = RecoveryRamp::from_raw(&raw(vec![0.25])).unwrap();
        assert_eq!(ok.steps(), &[0.25]);
        assert_eq!(ok.step_ms, 5_000);
    }
}
