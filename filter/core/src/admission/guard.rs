//! The inbound guard in the inference pod's own sidecar: decides from the local pod's signals
//! whether to admit a request or answer 503 at once, marked so that the client sidecar retries
//! another pod, before the GPU drowns. Stale or missing local metrics admit (fail-open).
//!
//! Rule: reject when the model server's queue is full (`waiting >= capacity * queueFullRatio`),
//! or when GPU utilisation is at or above `gpuUtilCutoff` while requests are already waiting
//! (a busy GPU with an empty queue still batches a new request in; when the server reports no
//! queue at all, utilisation alone decides).
#![deny(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use ai_lb_proto::{watch_event, WatchEvent};

use super::config::GuardConfig;
use crate::signals::{GpuSignal, PodSignals};

/// Response header marking a guard rejection; the client sidecar's retry policy retries on it
/// (`retry_on: retriable-headers`) or on the 503 (`retriable-status-codes`).
pub const GUARD_HEADER: &str = "x-ai-lb-guard";
pub const GUARD_HEADER_VALUE: &str = "rejected";
pub const GUARD_STATUS: u32 = 503;

/// The local pod's signals as last sampled.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct LocalSignals {
    /// GPU utilisation in 0..=1.
    pub gpu_util: Option<f64>,
    /// Requests waiting in the model server's queue.
    pub waiting: Option<u32>,
    /// Queue capacity (e.g. vLLM `max_num_seqs`).
    pub capacity: Option<u32>,
    /// When the signals were sampled.
    pub sampled_at_ms: Option<u64>,
}

impl LocalSignals {
    /// The local signals after a `Watch` event received at `now_ms`: a snapshot replaces them
    /// (validated like any pod's; sampled `age_ms` before now; the GPU reading is the one
    /// `cutoffs.gpuSignal` chooses, by default SM occupancy, never a saturating time fraction),
    /// a heartbeat confirms the previous ones as of now. None: nothing new (a snapshot without
    /// metrics, or a heartbeat before any snapshot).
    pub fn after_event(
        ev: &WatchEvent,
        previous: Option<LocalSignals>,
        now_ms: u64,
        gpu_signal: GpuSignal,
    ) -> Option<LocalSignals> {
        match ev.event.as_ref()? {
            watch_event::Event::Snapshot(snap) => {
                let (sig, _issues) = PodSignals::from_proto(snap, now_ms);
                let sig = sig.filter(|s| s.has_metrics)?;
                Some(LocalSignals {
                    gpu_util: sig.gpu_load(gpu_signal).map(|(_, v)| v),
                    waiting: sig.waiting,
                    capacity: sig.queue_capacity,
                    sampled_at_ms: Some(now_ms.saturating_sub(snap.age_ms).max(1)),
                })
            }
            watch_event::Event::Heartbeat(_) => previous.map(|p| LocalSignals {
                sampled_at_ms: Some(now_ms.max(1)),
                ..p
            }),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuardReason {
    QueueFull,
    GpuSaturated,
}

impl GuardReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::QueueFull => "queue_full",
            Self::GpuSaturated => "gpu_saturated",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailOpen {
    /// No local metrics at all.
    Missing,
    /// Metrics older than `maxStalenessMs`.
    Stale,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuardDecision {
    /// Admit; `fail_open` says the guard could not judge (count it).
    Admit { fail_open: Option<FailOpen> },
    Reject {
        reason: GuardReason,
        retry_after_s: u32,
    },
}

impl GuardDecision {
    /// Headers of the 503 (empty for an admission).
    pub fn headers(&self) -> Vec<(&'static str, String)> {
        match self {
            Self::Admit { .. } => Vec::new(),
            Self::Reject {
                retry_after_s,
                reason,
            } => vec![
                ("retry-after", retry_after_s.to_string()),
                (GUARD_HEADER, GUARD_HEADER_VALUE.to_string()),
                ("x-ai-lb-guard-reason", reason.as_str().to_string()),
            ],
        }
    }

    /// OpenAI-style body of the 503.
    pub fn error_body(&self) -> Option<String> {
        match self {
            Self::Admit { .. } => None,
            Self::Reject { reason, .. } => Some(super::response::openai_error_body(
                &format!(
                    "The inference server is overloaded ({}); retry on another replica.",
                    reason.as_str()
                ),
                "server_error",
                Some("overloaded"),
            )),
        }
    }
}

pub fn decide(cfg: &GuardConfig, s: &LocalSignals, now_ms: u64) -> GuardDecision {
    if !cfg.enabled {
        return GuardDecision::Admit { fail_open: None };
    }
    let Some(at) = s.sampled_at_ms else {
        return GuardDecision::Admit {
            fail_open: Some(FailOpen::Missing),
        };
    };
    if now_ms.saturating_sub(at) > cfg.max_staleness_ms {
        return GuardDecision::Admit {
            fail_open: Some(FailOpen::Stale),
        };
    }
    let util = s.gpu_util.filter(|u| u.is_finite());
    if util.is_none() && s.waiting.is_none() {
        return GuardDecision::Admit {
            fail_open: Some(FailOpen::Missing),
        };
    }
    let reject = |reason| GuardDecision::Reject {
        reason,
        retry_after_s: cfg.retry_after_seconds,
    };
    if let (Some(w), Some(c)) = (s.waiting, s.capacity) {
        if c > 0 && f64::from(w) >= f64::from(c) * cfg.queue_full_ratio {
            return reject(GuardReason::QueueFull);
        }
    }
    if let Some(u) = util {
        if u >= cfg.gpu_util_cutoff && s.waiting.is_none_or(|w| w > 0) {
            return reject(GuardReason::GpuSaturated);
        }
    }
    GuardDecision::Admit { fail_open: None }
}

#[cfg(test)]
#[allow(clippy::indexing_slicing)]
mod tests {
    use super::*;

    fn sig(
        util: Option<f64>,
        waiting: Option<u32>,
        capacity: Option<u32>,
        at: Option<u64>,
    ) -> LocalSignals {
        LocalSignals {
            gpu_util: util,
            waiting,
            capacity,
            sampled_at_ms: at,
        }
    }

    #[test]
    fn guard_decisions() {
        let c = GuardConfig::default();
        let admit = GuardDecision::Admit { fail_open: None };
        let rej = |reason| GuardDecision::Reject {
            reason,
            retry_after_s: 1,
        };
        assert_eq!(
            decide(&c, &sig(Some(0.5), Some(3), Some(128), Some(1000)), 1500),
            admit
        );
        assert_eq!(
            decide(&c, &sig(Some(0.5), Some(128), Some(128), Some(1000)), 1500),
            rej(GuardReason::QueueFull)
        );
        assert_eq!(
            decide(&c, &sig(Some(0.95), Some(2), Some(128), Some(1000)), 1500),
            rej(GuardReason::GpuSaturated)
        );
        assert_eq!(
            decide(&c, &sig(Some(0.95), Some(0), Some(128), Some(1000)), 1500),
            admit,
            "busy GPU, empty queue"
        );
        assert_eq!(
            decide(&c, &sig(Some(0.90), None, None, Some(1000)), 1500),
            rej(GuardReason::GpuSaturated)
        );
        assert_eq!(
            decide(&c, &sig(Some(0.89), None, None, Some(1000)), 1500),
            admit
        );
    }

    #[test]
    fn stale_or_missing_metrics_fail_open() {
        let c = GuardConfig::default();
        let full = sig(Some(0.99), Some(500), Some(128), Some(1000));
        assert_eq!(
            decide(&c, &full, 6000),
            GuardDecision::Reject {
                reason: GuardReason::QueueFull,
                retry_after_s: 1
            }
        );
        assert_eq!(
            decide(&c, &full, 6001),
            GuardDecision::Admit {
                fail_open: Some(FailOpen::Stale)
            }
        );
        assert_eq!(
            decide(&c, &sig(Some(0.99), Some(500), Some(128), None), 0),
            GuardDecision::Admit {
                fail_open: Some(FailOpen::Missing)
            }
        );
        assert_eq!(
            decide(&c, &sig(Some(f64::NAN), None, None, Some(0)), 0),
            GuardDecision::Admit {
                fail_open: Some(FailOpen::Missing)
            }
        );
        let off = GuardConfig {
            enabled: false,
            ..c
        };
        assert_eq!(
            decide(&off, &full, 1000),
            GuardDecision::Admit { fail_open: None }
        );
    }

    #[test]
    fn rejection_is_marked_for_the_client_sidecar() {
        let d = GuardDecision::Reject {
            reason: GuardReason::QueueFull,
            retry_after_s: 2,
        };
        let h = d.headers();
        assert!(h.contains(&(GUARD_HEADER, "rejected".to_string())));
        assert!(h.contains(&("retry-after", "2".to_string())));
        assert!(d.error_body().unwrap_or_default().contains("overloaded"));
        assert!(GuardDecision::Admit { fail_open: None }
            .headers()
            .is_empty());
    }

    #[test]
    fn a_snapshot_sets_the_signals_and_a_heartbeat_confirms_them() {
        use ai_lb_proto::{GpuStats, Heartbeat, InferenceStats, PodIdentity, PodSnapshot};
        let snap = PodSnapshot {
            identity: Some(PodIdentity {
                address: "127.0.0.1:8000".into(),
                ..Default::default()
            }),
            gpus: vec![GpuStats {
                utilization: Some(1.0),
                sm_occupancy: Some(0.95),
                ..Default::default()
            }],
            inference: Some(InferenceStats {
                waiting: Some(3),
                queue_capacity: Some(16),
                ..Default::default()
            }),
            age_ms: 100,
            ..Default::default()
        };
        let ev = WatchEvent {
            event: Some(watch_event::Event::Snapshot(snap)),
        };
        let s = LocalSignals::after_event(&ev, None, 10_000, GpuSignal::Auto).unwrap();
        assert_eq!(
            s.gpu_util,
            Some(0.95),
            "SM occupancy, not the saturated time fraction"
        );
        let util = GpuSignal::Only(crate::GpuReading::Utilization);
        assert_eq!(
            LocalSignals::after_event(&ev, None, 10_000, util)
                .unwrap()
                .gpu_util,
            Some(1.0)
        );
        assert_eq!(s.waiting, Some(3));
        assert_eq!(s.capacity, Some(16));
        assert_eq!(s.sampled_at_ms, Some(9_900));
        let hb = WatchEvent {
            event: Some(watch_event::Event::Heartbeat(Heartbeat::default())),
        };
        let s2 = LocalSignals::after_event(&hb, Some(s), 12_000, GpuSignal::Auto).unwrap();
        assert_eq!(s2.sampled_at_ms, Some(12_000));
        assert_eq!(s2.gpu_util, Some(0.95));
        assert!(LocalSignals::after_event(&hb, None, 12_000, GpuSignal::Auto).is_none());
        assert!(LocalSignals::after_event(
            &WatchEvent { event: None },
            Some(s),
            1,
            GpuSignal::Auto
        )
        .is_none());
    }
}
