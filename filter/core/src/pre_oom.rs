//! Degrade before OOM (`preOom`, issue 30 part 2): decides how much of its share a pod keeps
//! while its agent reports one of its GPUs about to run out of memory, and when it gets no new
//! request at all.
//!
//! The agent's GPU-memory watermark (agent flags `--oom-*`) reports a pre-OOM state on a GPU
//! whose memory is at or above 92 % of its total and has grown faster than 800 MB/s for three
//! 500 ms intervals in a row: a countdown (15 s) and the time to OOM projected at the current
//! growth rate. The filter takes the earlier of the two as the pod's *time to OOM*, counted
//! on the filter's own clock from when the snapshot was sampled (its receive time less its
//! age), so it keeps running between snapshots:
//!
//! - While the time to OOM is above `cutBeforeMs`, the pod's draw weight is multiplied by
//!   `(timeToOom − cutBeforeMs) / (countdownTotal − cutBeforeMs)`, clamped to
//!   `[minShare, 1]`: linear from its whole share when the countdown starts to `minShare` at
//!   the cut.
//! - From `cutBeforeMs` before the OOM the pod is cut (`CutReason::PreOom`, stat `pre_oom.cut`):
//!   no new request, so the requests it is running can finish, its memory can fall, and none
//!   is in flight there when it would crash.
//! - The state clears when the agent stops reporting it (the growth fell): the next snapshot
//!   without it ends the cut, and the pod's share comes back linearly from `minShare` to
//!   whole over `recoverMs` (0: at once). The agent clears the state as soon as one interval
//!   grows slower than its threshold, which happens early while a cut pod drains, with its
//!   memory still near the top; given its whole share back at once, it would grow again at
//!   once and, three intervals later, be cut again a little higher each time until it
//!   crashed. A stale snapshot is cut as stale first (the normal rules), so a pre-OOM state
//!   is never acted on past `cutoffs.stalenessMs`.
//!
//! On by default: it acts only on a state the agent reports explicitly (and only agents with
//! the watermark report it), and what it does is send a pod fewer requests for a few seconds,
//! which costs little if the projection was wrong and saves every request in flight if it was
//! right. `preOom: {enabled: false}` turns it off.

use ai_lb_proto::GpuStats;
use serde::Deserialize;

use crate::error::ConfigError;
use crate::signals::SignalIssue;

/// The validated `preOom` section.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PreOomConfig {
    /// The pod is cut when its time to OOM is at most this (ms).
    pub cut_before_ms: u64,
    /// The least share of its weight a pod keeps while counting down (before the cut).
    pub min_share: f64,
    /// After the state clears, the pod's share comes back from `min_share` to whole over
    /// this long (ms); 0: at once.
    pub recover_ms: u64,
}

impl Default for PreOomConfig {
    fn default() -> Self {
        Self {
            cut_before_ms: 5000,
            min_share: 0.1,
            recover_ms: 10_000,
        }
    }
}

impl PreOomConfig {
    /// The share a pod whose state cleared `since_ms` ago keeps (1: recovered).
    pub fn recovering(&self, since_ms: u64) -> f64 {
        if since_ms >= self.recover_ms {
            return 1.0;
        }
        let f = since_ms as f64 / self.recover_ms as f64;
        (self.min_share + (1.0 - self.min_share) * f).clamp(self.min_share, 1.0)
    }
}

/// A pod's pre-OOM state as reported, with its deadlines on the filter's clock (monotonic
/// host ms). Of several GPUs reporting one, the one with the earliest time to OOM.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PreOomSignal {
    /// When the agent's countdown ends.
    pub countdown_end_ms: u64,
    /// When the GPU runs out of memory at the reported growth rate (None: not projected).
    pub projected_oom_ms: Option<u64>,
    /// The countdown's full length (ms, > 0).
    pub countdown_total_ms: u64,
}

impl PreOomSignal {
    /// The time to OOM at `now_ms`: the earlier of the countdown's end and the projection.
    pub fn time_to_oom_ms(&self, now_ms: u64) -> u64 {
        let end = self
            .projected_oom_ms
            .map_or(self.countdown_end_ms, |p| p.min(self.countdown_end_ms));
        end.saturating_sub(now_ms)
    }

    /// The earlier of the two signals (for a pod with several GPUs in the state).
    pub fn earlier(self, other: PreOomSignal) -> PreOomSignal {
        let far = u64::MAX;
        if other.time_to_oom_ms(0) < self.time_to_oom_ms(0) || self.time_to_oom_ms(0) == far {
            other
        } else {
            self
        }
    }
}

/// Reads GPU `i`'s pre-OOM state from a snapshot sampled at `sampled_at_ms` (receive time less
/// its age). A nonsense state (a zero countdown length, a countdown longer than its length) is
/// dropped with an issue: the pod is then judged as without one.
pub fn from_gpu(
    i: usize,
    g: &GpuStats,
    sampled_at_ms: u64,
    issues: &mut Vec<SignalIssue>,
) -> Option<PreOomSignal> {
    let p = g.pre_oom.as_ref()?;
    if p.countdown_total_ms == 0 || p.countdown_ms > p.countdown_total_ms {
        issues.push(SignalIssue {
            field: format!("gpus[{i}].pre_oom"),
            value: format!(
                "countdown {} of {} ms",
                p.countdown_ms, p.countdown_total_ms
            ),
            action: "countdown not within 0..=its length (> 0): pre-OOM state dropped",
        });
        return None;
    }
    Some(PreOomSignal {
        countdown_end_ms: sampled_at_ms.saturating_add(p.countdown_ms),
        projected_oom_ms: p
            .projected_oom_in_ms
            .map(|ms| sampled_at_ms.saturating_add(ms)),
        countdown_total_ms: p.countdown_total_ms,
    })
}

/// What a pod's pre-OOM state does to it now.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Verdict {
    /// Its weight is multiplied by this (in `[minShare, 1]`).
    Degrade(f64),
    /// No new request.
    Cut,
}

/// Judges `sig` at `now_ms` (pure; see the module docs for the curve).
pub fn judge(sig: &PreOomSignal, cfg: &PreOomConfig, now_ms: u64) -> Verdict {
    let left = sig.time_to_oom_ms(now_ms);
    if left <= cfg.cut_before_ms {
        return Verdict::Cut;
    }
    let span = sig.countdown_total_ms.saturating_sub(cfg.cut_before_ms);
    let share = if span == 0 {
        cfg.min_share
    } else {
        (left - cfg.cut_before_ms) as f64 / span as f64
    };
    Verdict::Degrade(share.clamp(cfg.min_share, 1.0))
}

/// Where a pod stands in a pre-OOM episode, to count each episode's start and cut once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Phase {
    #[default]
    Normal,
    Degraded,
    Cut,
    /// The state cleared at this time (ms): the share comes back over `recoverMs`.
    Recovering(u64),
}

/// `preOom` as written; absent: on with the defaults.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "PreOom")
)]
pub struct RawPreOom {
    /// Acts on the agents' pre-OOM reports. On by default: it acts only on a state an agent
    /// reports explicitly.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(extend("default" = true)))]
    pub enabled: Option<bool>,
    /// A pod gets no new request from this long (ms) before its projected OOM (the earlier of
    /// the agent's countdown and its projection at the current growth rate); before that its
    /// share falls linearly from whole to `minShare`.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 5000, "minimum" = 0, "maximum" = 600_000))
    )]
    pub cut_before_ms: Option<u64>,
    /// The least share of its weight a counting-down pod keeps before it is cut.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 0.1, "minimum" = 0, "maximum" = 1))
    )]
    pub min_share: Option<f64>,
    /// After the agent stops reporting the state, the pod's share comes back linearly from
    /// `minShare` to whole over this long (ms); 0: whole at once. A pod cleared while it still
    /// holds most of its memory would otherwise grow again at once at its whole share.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 10_000, "minimum" = 0, "maximum" = 600_000))
    )]
    pub recover_ms: Option<u64>,
}

impl RawPreOom {
    /// Validates the section (absent: `RawPreOom::default()`); None: turned off. Errors name
    /// `preOom.<field>` and the value.
    pub fn validate(&self) -> Result<Option<PreOomConfig>, ConfigError> {
        let d = PreOomConfig::default();
        let cut_before_ms = match self.cut_before_ms {
            None => d.cut_before_ms,
            Some(x) if x <= 600_000 => x,
            Some(x) => {
                return Err(ConfigError::new(
                    "preOom.cutBeforeMs",
                    x,
                    "must be within 0..=600000 (ms before the projected OOM)",
                ))
            }
        };
        let min_share = match self.min_share {
            None => d.min_share,
            Some(x) if x.is_finite() && (0.0..=1.0).contains(&x) => x,
            Some(x) => {
                return Err(ConfigError::new(
                    "preOom.minShare",
                    x,
                    "must be within [0, 1] (the least share of its weight a pod keeps)",
                ))
            }
        };
        let recover_ms = match self.recover_ms {
            None => d.recover_ms,
            Some(x) if x <= 600_000 => x,
            Some(x) => {
                return Err(ConfigError::new(
                    "preOom.recoverMs",
                    x,
                    "must be within 0..=600000 (ms for the share to come back)",
                ))
            }
        };
        Ok((self.enabled != Some(false)).then_some(PreOomConfig {
            cut_before_ms,
            min_share,
            recover_ms,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ai_lb_proto::PreOom;

    fn sig(end: u64, oom: Option<u64>) -> PreOomSignal {
        PreOomSignal {
            countdown_end_ms: end,
            projected_oom_ms: oom,
            countdown_total_ms: 15_000,
        }
    }

    #[test]
    fn the_share_falls_linearly_to_the_cut() {
        let c = PreOomConfig::default();
        let s = sig(15_000, None);
        assert_eq!(judge(&s, &c, 0), Verdict::Degrade(1.0));
        assert_eq!(judge(&s, &c, 5000), Verdict::Degrade(0.5));
        assert_eq!(judge(&s, &c, 9000), Verdict::Degrade(0.1));
        assert_eq!(judge(&s, &c, 9999), Verdict::Degrade(0.1), "minShare");
        assert_eq!(judge(&s, &c, 10_000), Verdict::Cut);
        assert_eq!(judge(&s, &c, 99_000), Verdict::Cut);
    }

    #[test]
    fn the_share_comes_back_over_recover_ms() {
        let c = PreOomConfig::default();
        assert_eq!(c.recovering(0), 0.1);
        assert!((c.recovering(5000) - 0.55).abs() < 1e-12);
        assert_eq!(c.recovering(10_000), 1.0);
        let now = PreOomConfig { recover_ms: 0, ..c };
        assert_eq!(now.recovering(0), 1.0);
    }

    #[test]
    fn an_earlier_projection_wins() {
        let c = PreOomConfig::default();
        let s = sig(15_000, Some(7000));
        assert_eq!(judge(&s, &c, 1999), Verdict::Degrade(0.1));
        assert_eq!(judge(&s, &c, 2000), Verdict::Cut);
        assert_eq!(s.earlier(sig(15_000, None)), s);
        assert_eq!(sig(15_000, None).earlier(s), s);
    }

    #[test]
    fn nonsense_states_are_dropped_and_said() {
        let mut issues = Vec::new();
        let g = |countdown_ms, countdown_total_ms| GpuStats {
            pre_oom: Some(PreOom {
                countdown_ms,
                countdown_total_ms,
                projected_oom_in_ms: Some(3000),
            }),
            ..GpuStats::default()
        };
        assert_eq!(from_gpu(0, &g(5, 0), 100, &mut issues), None);
        assert_eq!(from_gpu(1, &g(20_000, 15_000), 100, &mut issues), None);
        assert_eq!(issues.len(), 2);
        assert_eq!(issues[1].field, "gpus[1].pre_oom");
        let s = from_gpu(0, &g(12_000, 15_000), 100, &mut issues).unwrap();
        assert_eq!(s.countdown_end_ms, 12_100);
        assert_eq!(s.projected_oom_ms, Some(3100));
        assert_eq!(issues.len(), 2);
        assert_eq!(from_gpu(0, &GpuStats::default(), 100, &mut issues), None);
    }

    #[test]
    fn config_defaults_and_refusals() {
        assert_eq!(
            RawPreOom::default().validate().unwrap(),
            Some(PreOomConfig::default())
        );
        let off = RawPreOom {
            enabled: Some(false),
            ..RawPreOom::default()
        };
        assert_eq!(off.validate().unwrap(), None);
        let bad = RawPreOom {
            min_share: Some(1.5),
            ..RawPreOom::default()
        };
        let e = bad.validate().unwrap_err().to_string();
        assert!(e.contains("preOom.minShare"), "{e}");
        let bad = RawPreOom {
            cut_before_ms: Some(700_000),
            ..RawPreOom::default()
        };
        assert!(bad.validate().is_err());
    }
}
