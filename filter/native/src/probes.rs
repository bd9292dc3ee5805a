//! `breaker.syntheticProbe` in the native module: on the main thread's tick
//! ([`crate::main_tick`]) the main thread's worker (the same routing state a worker thread
//! keeps, reading the shared pool states and breakers) asks the core which half-open pods are
//! due a probe ([`probe::due`]) and sends each as a config-level HTTP callout on the pool's
//! cluster, steered to its pod by the routing header (override_host). The answer comes back on
//! the main thread ([`on_callout_done`]) and goes to the core ([`probe::answered`]), which
//! writes the shared breaker. Counts go to Envoy through the config (no stream on the main
//! thread).

use std::collections::HashMap;
use std::sync::Mutex;

use ai_lb_filter_core::probe::{self, ProbeAnswer, ProbeCall};

use crate::feed::now_ms;
use crate::filter::{with_worker, ConfigRt};
use crate::host::{self, ConfigHandle, Level};

/// A probe whose answer has not come after its timeout and this long is dropped from the
/// pending list (Envoy answers every callout it started; this only bounds the list).
const FORGET_AFTER_MS: u64 = 5_000;

/// The probes of one config in flight, by callout id (touched on the main thread only; the
/// lock makes the config shareable with the workers).
#[derive(Debug, Default)]
pub struct Probes {
    pending: Mutex<HashMap<u64, ProbeCall>>,
}

fn warn(msg: &str) {
    host::log(Level::Warn, msg);
}

/// On the main thread's tick: sends the probes that are due.
pub fn send_due(rt: &ConfigRt, handle: &ConfigHandle, now: u64) {
    let Some(p) = &rt.probes else { return };
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
