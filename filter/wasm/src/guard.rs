//! Decides nothing: the glue of guard mode (the inference pod's own inbound sidecar). The VM
//! holding the subscription lease watches the LOCAL agent (`ai_lb.v1.MetricsService/Watch`,
//! one pod) and publishes the pod's signals to shared data; every request reads them and asks
//! the core's [`guard::decide`]: reject -> 503 with `retry-after` and `x-ai-lb-guard: rejected`
//! before the model server sees it; stale or missing signals admit (counted).

use std::cell::RefCell;
use std::rc::Rc;

use prost::Message;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, LogLevel};

use ai_lb_filter_core::admission::config::GuardConfig;
use ai_lb_filter_core::admission::guard::{self, FailOpen, GuardDecision, LocalSignals};
use ai_lb_filter_core::signals::{GpuSignal, PodSignals};
use ai_lb_proto::{watch_event, WatchEvent};

use crate::host;
use crate::state::{self, State};

const ENCODED_LEN: usize = 24;
const NONE_U32: u32 = u32::MAX;

/// Shared-data key of the local pod's signals.
pub fn local_key(pool: &str) -> String {
    format!("ai_lb.{pool}.guard.local")
}

/// 24 bytes: GPU utilisation (f64 bits, NaN = unknown), waiting and capacity (u32, MAX =
/// unknown), sample time in ms (u64).
pub fn encode(s: &LocalSignals) -> [u8; ENCODED_LEN] {
    let mut out = [0u8; ENCODED_LEN];
    let gpu = s.gpu_util.unwrap_or(f64::NAN).to_bits().to_le_bytes();
    let w = s.waiting.unwrap_or(NONE_U32).to_le_bytes();
    let c = s.capacity.unwrap_or(NONE_U32).to_le_bytes();
    let at = s.sampled_at_ms.unwrap_or(0).to_le_bytes();
    for (dst, src) in out
        .iter_mut()
        .zip(gpu.iter().chain(&w).chain(&c).chain(&at))
    {
        *dst = *src;
    }
    out
}

pub fn decode(b: &[u8]) -> Option<LocalSignals> {
    let gpu = f64::from_bits(u64::from_le_bytes(b.get(0..8)?.try_into().ok()?));
    let w = u32::from_le_bytes(b.get(8..12)?.try_into().ok()?);
    let c = u32::from_le_bytes(b.get(12..16)?.try_into().ok()?);
    let at = u64::from_le_bytes(b.get(16..24)?.try_into().ok()?);
    Some(LocalSignals {
        gpu_util: (!gpu.is_nan()).then_some(gpu),
        waiting: (w != NONE_U32).then_some(w),
        capacity: (c != NONE_U32).then_some(c),
        sampled_at_ms: (at != 0).then_some(at),
    })
}

/// The new local signals after a `Watch` event received at `now_ms`: a snapshot replaces them
/// (validated by the core; sampled `age_ms` before now), a heartbeat confirms the previous
/// ones as of now. None: nothing to publish.
pub fn apply_event(
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
                // The reading `cutoffs.gpuSignal` chooses: by default SM occupancy, never a
                // saturating time fraction (which reads ~1 on any busy GPU).
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

/// Handles one encoded `WatchEvent` of pool `pool` (root context, lease holder).
pub fn on_watch_bytes(
    pool: &str,
    bytes: &[u8],
    now_ms: u64,
    gpu_signal: GpuSignal,
) -> Result<(), String> {
    let ev = WatchEvent::decode(bytes).map_err(|e| format!("undecodable WatchEvent: {e}"))?;
    let key = local_key(pool);
    let previous = host::shared_get(&key).0.as_deref().and_then(decode);
    if let Some(s) = apply_event(&ev, previous, now_ms, gpu_signal) {
        host::shared_set(&key, &encode(&s), None)
            .map_err(|e| format!("cannot publish local signals: {e:?}"))?;
    }
    Ok(())
}

/// One request through the guard.
pub struct Guard {
    state: Rc<RefCell<State>>,
    key: String,
    cfg: GuardConfig,
}

impl Guard {
    pub fn new(state: Rc<RefCell<State>>, pool: &str, cfg: GuardConfig) -> Self {
        Self {
            state,
            key: local_key(pool),
            cfg,
        }
    }

    fn count(&self, name: &str) {
        if let Ok(mut s) = state::lock(&self.state) {
            s.metrics.inc(name, 1);
        }
    }
}

impl Context for Guard {}

impl HttpContext for Guard {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let now = host::now_ms();
        let signals = host::shared_get(&self.key)
            .0
            .as_deref()
            .and_then(decode)
            .unwrap_or(LocalSignals {
                gpu_util: None,
                waiting: None,
                capacity: None,
                sampled_at_ms: None,
            });
        let d = guard::decide(&self.cfg, &signals, now);
        match d {
            GuardDecision::Admit { fail_open } => {
                self.count("ailb.guard.admitted");
                match fail_open {
                    Some(FailOpen::Missing) => self.count("ailb.guard.fail_open.missing"),
                    Some(FailOpen::Stale) => self.count("ailb.guard.fail_open.stale"),
                    None => {}
                }
                Action::Continue
            }
            GuardDecision::Reject { reason, .. } => {
                self.count(&format!("ailb.guard.rejected.{}", reason.as_str()));
                let mut headers: Vec<(&str, String)> =
                    vec![("content-type", "application/json".to_string())];
                headers.extend(d.headers());
                let hs: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
                let body = d.error_body().unwrap_or_default();
                if let Err(e) = host::send_response(guard::GUARD_STATUS, hs, body.as_bytes()) {
                    host::log(
                        LogLevel::Warn,
                        &format!("ai-lb: guard: cannot send the 503: {e:?}"),
                    );
                    return Action::Continue;
                }
                Action::Pause
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ai_lb_proto::{GpuStats, Heartbeat, InferenceStats, PodIdentity, PodSnapshot};

    #[test]
    fn signals_round_trip_with_unknowns() {
        let s = LocalSignals {
            gpu_util: Some(0.97),
            waiting: None,
            capacity: Some(8),
            sampled_at_ms: Some(1234),
        };
        let d = decode(&encode(&s)).unwrap();
        assert_eq!(d.gpu_util, Some(0.97));
        assert_eq!(d.waiting, None);
        assert_eq!(d.capacity, Some(8));
        assert_eq!(d.sampled_at_ms, Some(1234));
        assert!(decode(&[1, 2, 3]).is_none());
    }

    #[test]
    fn snapshot_then_heartbeat() {
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
        let s = apply_event(&ev, None, 10_000, GpuSignal::Auto).unwrap();
        assert_eq!(
            s.gpu_util,
            Some(0.95),
            "SM occupancy, not the saturated time fraction"
        );
        let util = GpuSignal::Only(ai_lb_filter_core::GpuReading::Utilization);
        assert_eq!(
            apply_event(&ev, None, 10_000, util).unwrap().gpu_util,
            Some(1.0)
        );
        assert_eq!(s.waiting, Some(3));
        assert_eq!(s.sampled_at_ms, Some(9_900));
        let hb = WatchEvent {
            event: Some(watch_event::Event::Heartbeat(Heartbeat::default())),
        };
        let s2 = apply_event(&hb, Some(s), 12_000, GpuSignal::Auto).unwrap();
        assert_eq!(s2.sampled_at_ms, Some(12_000));
        assert_eq!(s2.gpu_util, Some(0.95));
        assert!(apply_event(&hb, None, 12_000, GpuSignal::Auto).is_none());
    }
}
