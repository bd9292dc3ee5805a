//! `breaker.syntheticProbe` in the native module: a timer thread wakes the main thread through
//! the config's scheduler every tick; there the main thread's worker (the same routing state a
//! worker thread keeps, reading the shared pool states and breakers) asks the core which
//! half-open pods are due a probe ([`probe::due`]) and sends each as a config-level HTTP
//! callout on the pool's cluster, steered to its pod by the routing header (override_host).
//! The answer comes back on the main thread ([`on_callout_done`]) and goes to the core
//! ([`probe::answered`]), which writes the shared breaker. Counts go to Envoy through the
//! config (no stream on the main thread).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use ai_lb_filter_core::probe::{self, ProbeAnswer, ProbeCall};

use crate::feed::now_ms;
use crate::filter::{with_worker, ConfigRt};
use crate::host::{self, ConfigHandle, ConfigScheduler, Level};

/// The only event the config's scheduler carries.
pub const PROBE_EVENT: u64 = 1;

/// A probe whose answer has not come after its timeout and this long is dropped from the
/// pending list (Envoy answers every callout it started; this only bounds the list).
const FORGET_AFTER_MS: u64 = 5_000;

/// Wakes the main thread every `period` (a thread of its own); stopped and joined when dropped,
/// before the scheduler it commits to is deleted.
#[derive(Debug)]
pub struct ProbeTimer {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    // Dropped after `drop` joined the thread (fields drop after `Drop::drop`).
    _scheduler: Arc<ConfigScheduler>,
}

impl ProbeTimer {
    pub fn start(scheduler: ConfigScheduler, period: Duration) -> Result<ProbeTimer, String> {
        let scheduler = Arc::new(scheduler);
        let stop = Arc::new(AtomicBool::new(false));
        let (s, st) = (Arc::clone(&scheduler), Arc::clone(&stop));
        let thread = std::thread::Builder::new()
            .name("ai-lb-probes".into())
            .spawn(move || {
                while !st.load(Ordering::Acquire) {
                    std::thread::park_timeout(period);
                    if !st.load(Ordering::Acquire) {
                        s.commit(PROBE_EVENT);
                    }
                }
            })
            .map_err(|e| format!("ai-lb native: cannot start the probe timer thread: {e}"))?;
        Ok(ProbeTimer {
            stop,
            thread: Some(thread),
            _scheduler: scheduler,
        })
    }
}

impl Drop for ProbeTimer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

/// The probe side of one config: its timer and the probes in flight by callout id (touched on
/// the main thread only; the lock makes the config shareable with the workers).
#[derive(Debug)]
pub struct Probes {
    _timer: ProbeTimer,
    pending: Mutex<HashMap<u64, ProbeCall>>,
}

impl Probes {
    /// Starts the timer on the config's scheduler (`handle` in `on_http_filter_config_new`).
    pub fn start(handle: &ConfigHandle, period: Duration) -> Result<Probes, String> {
        let scheduler = handle.scheduler().ok_or_else(|| {
            "ai-lb native: breaker.syntheticProbe: Envoy gave the config no scheduler".to_string()
        })?;
        Ok(Probes {
            _timer: ProbeTimer::start(scheduler, period)?,
            pending: Mutex::new(HashMap::new()),
        })
    }
}

fn warn(msg: &str) {
    host::log(Level::Warn, msg);
}

/// The timer's event, on the main thread: sends the probes that are due.
pub fn on_scheduled(rt: &ConfigRt, handle: &ConfigHandle) {
    let Some(p) = &rt.probes else { return };
    let now = now_ms();
    let calls = with_worker(rt, |w| {
        let calls = probe::due(w, now, &mut warn);
        w.export_counts(rt, handle);
        calls
    })
    .unwrap_or_default();
    let Ok(mut pending) = p.pending.lock() else {
        return;
    };
    pending.retain(|_, c| now < c.sent_ms + c.timeout_ms + FORGET_AFTER_MS);
    for call in calls {
        match handle.http_callout(
            &call.cluster,
            &call.headers,
            call.body.as_bytes(),
            call.timeout_ms,
        ) {
            Ok(id) => {
                pending.insert(id, call);
            }
            Err(code) => {
                let _ = with_worker(rt, |w| {
                    probe::not_sent(w, &call, &mut |m| {
                        warn(&format!("{m} (Envoy's callout result {code})"))
                    });
                    w.export_counts(rt, handle);
                });
            }
        }
    }
}

/// A probe's callout ended, on the main thread: `status` and `body` when a response came
/// (Envoy answers its own timeout and a failed connection with a 504 or 503 response), None
/// after a reset.
pub fn on_callout_done(
    rt: &ConfigRt,
    handle: &ConfigHandle,
    callout_id: u64,
    status: Option<u16>,
    body: Vec<u8>,
) {
    let Some(p) = &rt.probes else { return };
    let Some(call) = p
        .pending
        .lock()
        .ok()
        .and_then(|mut m| m.remove(&callout_id))
    else {
        return;
    };
    let now = now_ms();
    let answer = match status {
        Some(status) => ProbeAnswer::Response { status, body },
        None => ProbeAnswer::Failed {
            timeout: now.saturating_sub(call.sent_ms) >= call.timeout_ms,
        },
    };
    let _ = with_worker(rt, |w| {
        probe::answered(w, &call, &answer, now, &mut warn);
        w.export_counts(rt, handle);
    });
}
