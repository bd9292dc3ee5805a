//! The main thread's tick (route mode): a timer thread wakes the main thread through the
//! config's scheduler; there the main thread's worker (the same routing state a worker thread
//! keeps, reading the shared pool states and breakers) sends the synthetic probes that are due
//! (`breaker.syntheticProbe`, [`crate::probes`]) and sets the per-pod gauges once a second.
//! So the gauges stay current with no traffic (a pod cut by its agent's signal, a metrics age
//! growing after its agent died), as the wasm filter's root context keeps them on its tick,
//! and the request path does not carry that work.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::filter::{export_pod_gauges, with_worker, ConfigRt};
use crate::host::{ConfigHandle, ConfigScheduler};

/// The only event the config's scheduler carries.
pub const TICK_EVENT: u64 = 1;

/// The tick's period without synthetic probes: the per-pod gauges are set once a second.
pub const GAUGE_PERIOD: Duration = Duration::from_millis(1000);

/// Wakes the main thread every `period` (a thread of its own); stopped and joined when dropped,
/// before the scheduler it commits to is deleted.
#[derive(Debug)]
pub struct MainTick {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    // Dropped after `drop` joined the thread (fields drop after `Drop::drop`).
    _scheduler: Arc<ConfigScheduler>,
}

impl MainTick {
    /// Starts the timer on the config's scheduler (`handle` in `on_http_filter_config_new`).
    pub fn start(handle: &ConfigHandle, period: Duration) -> Result<MainTick, String> {
        let scheduler = Arc::new(handle.scheduler().ok_or_else(|| {
            "ai-lb native: Envoy gave the filter config no scheduler (the main thread's tick)"
                .to_string()
        })?);
        let stop = Arc::new(AtomicBool::new(false));
        let (s, st) = (Arc::clone(&scheduler), Arc::clone(&stop));
        let thread = std::thread::Builder::new()
            .name("ai-lb-tick".into())
            .spawn(move || {
                while !st.load(Ordering::Acquire) {
                    std::thread::park_timeout(period);
                    if !st.load(Ordering::Acquire) {
                        s.commit(TICK_EVENT);
                    }
                }
            })
            .map_err(|e| format!("ai-lb native: cannot start the main tick's thread: {e}"))?;
        Ok(MainTick {
            stop,
            thread: Some(thread),
            _scheduler: scheduler,
        })
    }
}

impl Drop for MainTick {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

/// The tick's event, on the main thread: the probes that are due, the gauges when due, and
/// what the main thread's worker counted (its refreshes settle breakers too).
pub fn on_tick(rt: &ConfigRt, handle: &ConfigHandle) {
    let now = crate::feed::now_ms();
    crate::probes::send_due(rt, handle, now);
    export_pod_gauges(rt, handle, now);
    let _ = with_worker(rt, |w| w.export_counts(rt, handle));
}
