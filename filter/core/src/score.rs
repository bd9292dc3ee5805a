//! Decides how attractive one pod is: a weighted sum of four load terms, each normalised to
//! [0, 1] (GIE's scorer contract), with named hard cut-offs that zero it.
//!
//! `raw = wg·(1-gpu) + wq·(1-min(waiting/maxQueue, 1)) + wp·(1-min(p99/p99Timeout, 1)) + wm·(1-mem)`
//!
//! `gpu` is the reading `cutoffs.gpuSignal` chooses ([`PodSignals::gpu_load`]): by default SM
//! occupancy where the pod reports it, and no GPU term at all where it reports only NVML's
//! time-fraction utilisation, which reads about 1 on every busy GPU (batch 1 or 200), so it
//! could only zero the term and fire the cut-off for every busy pod alike.
//!
//! A signal the pod does not report drops its term; the remaining weights are renormalised to
//! sum 1 (so a pod without p99 is judged on the other three). A pod with no term at all is
//! "cold" and the picker gives it the pool mean (see [`crate::picker`]).

use crate::breaker::TripReason;
use crate::config::{Cutoffs, Weights};
use crate::signals::{GpuReading, PodSignals};

/// Why a pod's score was zeroed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CutReason {
    /// The GPU reading (`cutoffs.gpuSignal`) above `cutoffs.gpuHardLimit`.
    GpuHardLimit,
    /// `waiting ≥ cutoffs.maxQueue`.
    QueueFull,
    /// Metrics older than `cutoffs.stalenessMs`, or the peer is reported STALE.
    Stale,
    /// Xid/ECC errors increased in the latest snapshot.
    HardwareFault,
    /// The model server stopped answering its agent (`cutoffs.cutModelServerDown`).
    ModelServerDown,
    /// The pod's (or pod+model's) breaker is open, or half-open with its probes spent.
    Breaker(TripReason),
    /// Its agent reports a GPU running out of memory within `preOom.cutBeforeMs`
    /// ([`crate::pre_oom`]).
    PreOom,
}

impl CutReason {
    /// Stable snake_case name for stats and the status page.
    pub fn as_str(&self) -> &'static str {
        match self {
            CutReason::GpuHardLimit => "gpu_hard_limit",
            CutReason::QueueFull => "queue_full",
            CutReason::Stale => "stale",
            CutReason::HardwareFault => "hardware_fault",
            CutReason::ModelServerDown => "model_server_down",
            CutReason::Breaker(r) => r.cut_name(),
            CutReason::PreOom => "pre_oom",
        }
    }
}

/// A pod's score at one moment.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Score {
    /// In [0, 1]; 0 when cut.
    pub value: f64,
    /// The formula's value before cut-offs, in [0, 1] (fed to the EMA).
    pub raw: f64,
    /// Why `value` is 0, if it was cut.
    pub cut: Option<CutReason>,
    /// False when no term could be computed (cold pod).
    pub has_terms: bool,
    /// What the picker multiplies the pod's smoothed weight by: `cutoffs.slowdownFactor` while
    /// a GPU reports a hardware slowdown, else 1.
    pub penalty: f64,
    /// The GPU reading the GPU term and cut-off used; None: no GPU term.
    pub gpu_reading: Option<GpuReading>,
    /// Its value, 0..=1.
    pub gpu_value: Option<f64>,
}

fn clamp01(x: f64) -> f64 {
    if x.is_nan() {
        0.0
    } else {
        x.clamp(0.0, 1.0)
    }
}

/// The formula's four terms for one pod, each normalised to [0, 1] with 1 the best (an idle
/// GPU, an empty queue, no latency, free memory); None for a signal the pod does not report.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Terms {
    pub gpu: Option<f64>,
    pub queue: Option<f64>,
    pub p99: Option<f64>,
    pub memory: Option<f64>,
}

/// The terms [`score_in_pool`] weighs (`gpu_fill`: the pool's mean GPU reading, for a pod
/// that lacks its own). Also the features of `learnedWeights` ([`crate::learned`]).
pub fn terms(signals: &PodSignals, cutoffs: &Cutoffs, gpu_fill: Option<f64>) -> Terms {
    if !signals.has_metrics {
        return Terms::default();
    }
    let gpu = signals
        .gpu_load(cutoffs.gpu_signal)
        .map(|(_, g)| g)
        .or(gpu_fill);
    Terms {
        gpu: gpu.map(|g| 1.0 - clamp01(g)),
        queue: signals
            .waiting
            .map(|w| 1.0 - clamp01(f64::from(w) / f64::from(cutoffs.max_queue.max(1)))),
        p99: signals
            .p99_ms
            .map(|p| 1.0 - clamp01(p / (cutoffs.p99_timeout_ms.max(1) as f64))),
        memory: signals.memory.map(|m| 1.0 - clamp01(m)),
    }
}

/// Scores one pod at `now_ms` (monotonic host ms). Breaker cuts are applied by the picker.
pub fn score(signals: &PodSignals, weights: &Weights, cutoffs: &Cutoffs, now_ms: u64) -> Score {
    score_in_pool(signals, weights, cutoffs, now_ms, None)
}

/// [`score`] for a pod of a pool in which other pods report the GPU reading this one lacks
/// (a pool mixing GPUs with and without GPM): its GPU term takes `gpu_fill`, the pool's mean
/// of that reading, so its score compares with theirs on the same terms. Renormalising its
/// other terms instead made an A100 beside H100s score higher than an H100 at the same queue
/// and p99, so the weighted draw favoured the slower GPUs. The fill never cuts the pod.
pub fn score_in_pool(
    signals: &PodSignals,
    weights: &Weights,
    cutoffs: &Cutoffs,
    now_ms: u64,
    gpu_fill: Option<f64>,
) -> Score {
    let gpu = signals
        .gpu_load(cutoffs.gpu_signal)
        .filter(|_| signals.has_metrics);
    let t = terms(signals, cutoffs, gpu_fill);
    let mut sum = 0.0;
    let mut wsum = 0.0;
    for (term, w) in [
        (t.gpu, weights.gpu),
        (t.queue, weights.queue),
        (t.p99, weights.p99),
        (t.memory, weights.memory),
    ] {
        if let Some(v) = term {
            sum += w * v;
            wsum += w;
        }
    }
    let has_terms = wsum > 0.0;
    let raw = if has_terms { clamp01(sum / wsum) } else { 0.0 };

    let cut = if signals.hardware_fault {
        Some(CutReason::HardwareFault)
    } else if signals.is_stale(now_ms, cutoffs.staleness_ms) {
        Some(CutReason::Stale)
    } else if signals.model_server_down && cutoffs.cut_model_server_down {
        Some(CutReason::ModelServerDown)
    } else if gpu.is_some_and(|(_, g)| g > cutoffs.gpu_hard_limit) {
        Some(CutReason::GpuHardLimit)
    } else if signals.has_metrics && signals.waiting.is_some_and(|w| w >= cutoffs.max_queue) {
        Some(CutReason::QueueFull)
    } else {
        None
    };
    let penalty = if signals.has_metrics && signals.slowdown {
        cutoffs.slowdown_factor
    } else {
        1.0
    };
    Score {
        value: if cut.is_some() { 0.0 } else { raw * penalty },
        raw,
        cut,
        has_terms,
        penalty,
        gpu_reading: gpu.map(|(r, _)| r),
        gpu_value: gpu.map(|(_, v)| clamp01(v)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::signals::GpuSignal;

    /// A busy pod (NVML time fraction 1.0, as every busy GPU reads) with SM occupancy `gpu`.
    fn sig(gpu: f64, waiting: u32, p99: f64, mem: f64) -> PodSignals {
        PodSignals {
            address: "10.0.0.1:1".into(),
            gpu: Some(1.0),
            activity: crate::signals::GpuActivity {
                sm_occupancy: Some(gpu),
                ..Default::default()
            },
            waiting: Some(waiting),
            p99_ms: Some(p99),
            memory: Some(mem),
            has_metrics: true,
            confirmed_at_ms: 1000,
            ..Default::default()
        }
    }

    #[test]
    fn formula_matches_hand_computation() {
        let s = score(
            &sig(0.2, 16, 1000.0, 0.5),
            &Weights::default(),
            &Cutoffs::default(),
            1000,
        );
        let want = 0.35 * 0.8 + 0.25 * 0.75 + 0.25 * 0.8 + 0.15 * 0.5;
        assert!((s.value - want).abs() < 1e-12);
        assert_eq!(s.cut, None);
    }

    #[test]
    fn missing_term_renormalises() {
        let mut p = sig(0.0, 0, 0.0, 0.0);
        p.p99_ms = None;
        p.activity.sm_occupancy = Some(1.0);
        let s = score(
            &p,
            &Weights::default(),
            &Cutoffs {
                gpu_hard_limit: 1.0,
                ..Cutoffs::default()
            },
            1000,
        );
        let want = (0.25 + 0.15) / 0.75;
        assert!((s.value - want).abs() < 1e-12);
    }

    #[test]
    fn cutoffs_are_named() {
        let c = Cutoffs::default();
        let w = Weights::default();
        assert_eq!(
            score(&sig(0.96, 0, 0.0, 0.0), &w, &c, 1000).cut,
            Some(CutReason::GpuHardLimit)
        );
        assert_eq!(
            score(&sig(0.1, 64, 0.0, 0.0), &w, &c, 1000).cut,
            Some(CutReason::QueueFull)
        );
        assert_eq!(
            score(&sig(0.1, 0, 0.0, 0.0), &w, &c, 3001).cut,
            Some(CutReason::Stale)
        );
        assert_eq!(score(&sig(0.1, 0, 0.0, 0.0), &w, &c, 3000).cut, None);
        let mut d = sig(0.1, 0, 0.0, 0.0);
        d.model_server_down = true;
        assert_eq!(
            score(&d, &w, &c, 1000).cut,
            Some(CutReason::ModelServerDown)
        );
        let keep = Cutoffs {
            cut_model_server_down: false,
            ..c
        };
        assert_eq!(score(&d, &w, &keep, 1000).cut, None);
        let mut f = sig(0.1, 0, 0.0, 0.0);
        f.hardware_fault = true;
        let s = score(&f, &w, &c, 1000);
        assert_eq!(s.cut, Some(CutReason::HardwareFault));
        assert_eq!(s.value, 0.0);
    }

    #[test]
    fn a_saturating_time_fraction_alone_is_no_gpu_term_and_no_cut_by_default() {
        let w = Weights::default();
        let c = Cutoffs::default();
        // An A100 (no GPM) busy at batch 1 and one at a full batch both read 1.0.
        let mut p = sig(0.0, 16, 1000.0, 0.5);
        p.activity.sm_occupancy = None;
        p.gpu = Some(1.0);
        let s = score(&p, &w, &c, 1000);
        assert_eq!(s.cut, None);
        assert_eq!(s.gpu_reading, None);
        let want = (0.25 * 0.75 + 0.25 * 0.8 + 0.15 * 0.5) / 0.65;
        assert!((s.value - want).abs() < 1e-12, "{} vs {want}", s.value);
        // The same pod with the time fraction chosen explicitly (a graded simulator).
        let util = Cutoffs {
            gpu_signal: GpuSignal::Only(GpuReading::Utilization),
            ..c
        };
        let s = score(&p, &w, &util, 1000);
        assert_eq!(s.cut, Some(CutReason::GpuHardLimit));
        assert_eq!(s.gpu_reading, Some(GpuReading::Utilization));
        // With occupancy present, auto uses it, whatever the time fraction says.
        let mut h = p.clone();
        h.activity.sm_occupancy = Some(0.3);
        let s = score(&h, &w, &c, 1000);
        assert_eq!(
            (s.cut, s.gpu_reading),
            (None, Some(GpuReading::SmOccupancy))
        );
        assert_eq!(s.gpu_value, Some(0.3));
    }

    #[test]
    fn a_pod_without_the_reading_takes_the_pools_mean_beside_pods_with_it() {
        let w = Weights::default();
        let c = Cutoffs::default();
        let mut a100 = sig(0.0, 8, 1000.0, 0.5);
        a100.activity.sm_occupancy = None;
        let h100 = sig(0.4, 8, 1000.0, 0.5);
        // Alone (or in a pool where no pod has GPM): renormalised, as before.
        assert_eq!(
            score_in_pool(&a100, &w, &c, 1000, None),
            score(&a100, &w, &c, 1000)
        );
        // Beside pods whose mean occupancy is 0.4: the same score as an H100 at 0.4.
        let filled = score_in_pool(&a100, &w, &c, 1000, Some(0.4));
        let h = score(&h100, &w, &c, 1000);
        assert!(
            (filled.raw - h.raw).abs() < 1e-12,
            "{} vs {}",
            filled.raw,
            h.raw
        );
        assert_eq!(filled.gpu_reading, None, "no reading of its own");
        // A fill over the hard limit never cuts it.
        assert_eq!(score_in_pool(&a100, &w, &c, 1000, Some(0.99)).cut, None);
        // A pod with its own reading ignores the fill.
        assert_eq!(score_in_pool(&h100, &w, &c, 1000, Some(0.9)), h);
    }

    #[test]
    fn each_named_reading_scores_with_its_own_field() {
        let w = Weights::default();
        let mut p = sig(0.1, 0, 0.0, 0.0);
        p.activity = crate::signals::GpuActivity {
            sm_occupancy: Some(0.1),
            sm_utilization: Some(0.2),
            tensor: Some(0.3),
            dram: Some(0.97),
        };
        for (r, v) in [
            (GpuReading::SmOccupancy, 0.1),
            (GpuReading::SmUtilization, 0.2),
            (GpuReading::TensorActivity, 0.3),
            (GpuReading::DramActivity, 0.97),
            (GpuReading::Utilization, 1.0),
        ] {
            let c = Cutoffs {
                gpu_signal: GpuSignal::Only(r),
                ..Cutoffs::default()
            };
            let s = score(&p, &w, &c, 1000);
            assert_eq!((s.gpu_reading, s.gpu_value), (Some(r), Some(v)), "{r:?}");
            assert_eq!(s.cut.is_some(), v > 0.95, "{r:?}");
        }
        // A pod without the chosen reading has no GPU term.
        p.activity.dram = None;
        let c = Cutoffs {
            gpu_signal: GpuSignal::Only(GpuReading::DramActivity),
            ..Cutoffs::default()
        };
        assert_eq!(score(&p, &w, &c, 1000).gpu_reading, None);
    }

    #[test]
    fn a_slowed_gpu_scales_the_score_without_cutting() {
        let c = Cutoffs::default();
        let w = Weights::default();
        let calm = score(&sig(0.2, 16, 1000.0, 0.5), &w, &c, 1000);
        let mut p = sig(0.2, 16, 1000.0, 0.5);
        p.slowdown = true;
        let slowed = score(&p, &w, &c, 1000);
        assert_eq!(slowed.cut, None);
        assert_eq!(slowed.penalty, 0.25);
        assert_eq!(slowed.raw, calm.raw, "the EMA sees the load terms alone");
        assert!((slowed.value - 0.25 * calm.value).abs() < 1e-12);
        let ignore = Cutoffs {
            slowdown_factor: 1.0,
            ..c
        };
        assert_eq!(score(&p, &w, &ignore, 1000).value, calm.value);
        assert_eq!(calm.penalty, 1.0);
    }
}
