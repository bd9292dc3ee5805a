//! Decides nothing: the glue of guard mode (the inference pod's own inbound sidecar). The VM
//! holding the subscription lease watches the LOCAL agent (`ai_lb.v1.MetricsService/Watch`,
//! one pod) and publishes the pod's signals to shared data; every request reads them and runs
//! the core's [`guard_request`] (the native module runs the same): reject -> 503 with
//! `retry-after` and `x-ai-lb-guard: rejected` before the model server sees it; stale or
//! missing signals admit (counted).

use std::cell::RefCell;
use std::rc::Rc;

use prost::Message;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;

use ai_lb_filter_core::admission::config::GuardConfig;
use ai_lb_filter_core::admission::guard::LocalSignals;
use ai_lb_filter_core::lifecycle::guard::guard_request;
use ai_lb_filter_core::lifecycle::Next;
use ai_lb_filter_core::signals::GpuSignal;
use ai_lb_proto::WatchEvent;

use crate::host::{self, WasmHost};
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
    if let Some(s) = LocalSignals::after_event(&ev, previous, now_ms, gpu_signal) {
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
        let signals = host::shared_get(&self.key).0.as_deref().and_then(decode);
        let next = guard_request(&mut WasmHost, &self.cfg, signals, now, &mut |c| {
            self.count(c.name())
        });
        match next {
            Next::Continue | Next::StopForBody => Action::Continue,
            Next::Stop => Action::Pause,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
