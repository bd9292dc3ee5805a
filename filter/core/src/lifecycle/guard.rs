//! Guard mode, for both data paths: the inference pod's own inbound sidecar keeps the local
//! pod's signals from its agent's `Watch` stream ([`LocalSignals::after_event`]) and judges
//! every request against them ([`guard_request`]): a rejection is answered 503 with
//! `retry-after` and `x-ai-lb-guard: rejected` before the model server sees it; stale or
//! missing signals admit, counted. The glues only carry the signals from their feed (wasm:
//! shared data written by the lease holder; native: the feed thread) to the request hook and
//! count under the names of [`GuardCount::name`].

use crate::admission::config::GuardConfig;
use crate::admission::guard::{self, FailOpen, GuardDecision, GuardReason, LocalSignals};
use crate::lifecycle::{Host, Next};

/// What the guard counts, one stat each (the same names on both data paths).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuardCount {
    Admitted,
    FailOpenMissing,
    FailOpenStale,
    Rejected(GuardReason),
}

impl GuardCount {
    /// Every stat, for glues that define their stats up front.
    pub const ALL: [GuardCount; 5] = [
        GuardCount::Admitted,
        GuardCount::FailOpenMissing,
        GuardCount::FailOpenStale,
        GuardCount::Rejected(GuardReason::QueueFull),
        GuardCount::Rejected(GuardReason::GpuSaturated),
    ];

    pub fn name(self) -> &'static str {
        match self {
            GuardCount::Admitted => "ailb.guard.admitted",
            GuardCount::FailOpenMissing => "ailb.guard.fail_open.missing",
            GuardCount::FailOpenStale => "ailb.guard.fail_open.stale",
            GuardCount::Rejected(GuardReason::QueueFull) => "ailb.guard.rejected.queue_full",
            GuardCount::Rejected(GuardReason::GpuSaturated) => "ailb.guard.rejected.gpu_saturated",
        }
    }

    /// Index in [`GuardCount::ALL`].
    pub fn index(self) -> usize {
        match self {
            GuardCount::Admitted => 0,
            GuardCount::FailOpenMissing => 1,
            GuardCount::FailOpenStale => 2,
            GuardCount::Rejected(GuardReason::QueueFull) => 3,
            GuardCount::Rejected(GuardReason::GpuSaturated) => 4,
        }
    }
}

/// One request through the guard, at its request headers: `signals` are the local pod's as
/// last received (None: nothing received yet). Continue admits; Stop means the 503 was sent.
pub fn guard_request<H: Host + ?Sized>(
    host: &mut H,
    cfg: &GuardConfig,
    signals: Option<LocalSignals>,
    now_ms: u64,
    count: &mut dyn FnMut(GuardCount),
) -> Next {
    let d = guard::decide(cfg, &signals.unwrap_or_default(), now_ms);
    match d {
        GuardDecision::Admit { fail_open } => {
            count(GuardCount::Admitted);
            match fail_open {
                Some(FailOpen::Missing) => count(GuardCount::FailOpenMissing),
                Some(FailOpen::Stale) => count(GuardCount::FailOpenStale),
                None => {}
            }
            Next::Continue
        }
        GuardDecision::Reject { reason, .. } => {
            count(GuardCount::Rejected(reason));
            let extra = d.headers();
            let mut headers: Vec<(&str, &str)> = vec![("content-type", "application/json")];
            headers.extend(extra.iter().map(|(k, v)| (*k, v.as_str())));
            let body = d.error_body().unwrap_or_default();
            host.send_local_reply(
                u16::try_from(guard::GUARD_STATUS).unwrap_or(503),
                &headers,
                body.as_bytes(),
            );
            Next::Stop
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_indexes_cover_every_count_once() {
        for (i, c) in GuardCount::ALL.iter().enumerate() {
            assert_eq!(c.index(), i);
            assert!(c.name().starts_with("ailb.guard."));
        }
        let mut names: Vec<_> = GuardCount::ALL.iter().map(|c| c.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), GuardCount::ALL.len());
    }
}
