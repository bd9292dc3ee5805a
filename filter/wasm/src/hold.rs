//! Decides nothing: the worker's queue of big requests waiting in the sidecar
//! (`bigRequestHold`). Whether a request waits, and when it may go, is the core's
//! [`Router::should_hold`](ai_lb_filter_core::picker::Router::should_hold); this keeps the
//! paused requests in arrival order, releases them on the root's tick (routing each on its
//! own context, then resuming it), and counts what happened:
//! - `ailb.big_hold.held` / `.released` (a pod had room) / `.expired` (waited `maxHoldMs`,
//!   routed as if the hold were off) / `.full` (the queue was full, routed at once) /
//!   `.left` (the client went away while held);
//! - `ailb.big_hold.depth` (gauge, this worker) and `ailb.big_hold.wait_ms` (histogram).
//!
//! Requests paused in a VM can only be resumed from that VM, so the queue is per worker.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::rc::Rc;

use proxy_wasm::hostcalls;

use ai_lb_filter_core::picker::RequestSize;

use crate::host;
use ai_lb_filter_core::lifecycle::{steer, Steered};

use crate::host::WasmHost;
use crate::metrics::Metrics;
use crate::root::State;

/// One request waiting in the sidecar.
#[derive(Debug)]
pub struct Held {
    /// Its proxy-wasm context id.
    pub id: u32,
    pub pool: usize,
    pub model: Option<String>,
    pub size: RequestSize,
    pub since_ms: u64,
}

/// The worker's held big requests, oldest first, and what the tick wrote for those it
/// released (taken by the request itself on its next callback).
#[derive(Debug, Default)]
pub struct BigHold {
    queue: VecDeque<Held>,
    pub resumed: HashMap<u32, Steered>,
}

impl BigHold {
    pub fn depth(&self) -> usize {
        self.queue.len()
    }

    /// Queues `h` unless `max` are already waiting (then it is given back).
    pub fn push(&mut self, h: Held, max: usize) -> Result<(), Held> {
        if self.queue.len() >= max {
            return Err(h);
        }
        self.queue.push_back(h);
        Ok(())
    }

    /// Takes request `id` out of the queue (its client went away); whether it was there.
    pub fn remove(&mut self, id: u32) -> bool {
        let before = self.queue.len();
        self.queue.retain(|h| h.id != id);
        self.queue.len() != before
    }
}

/// Counts `what` (`ailb.big_hold.<what>`).
pub fn count(metrics: &mut Metrics, what: &str) {
    metrics.inc(&format!("ailb.big_hold.{what}"), 1);
}

fn gauge(metrics: &mut Metrics, depth: usize) {
    metrics.set("ailb.big_hold.depth", depth as u64);
}

/// Queues request `h` in the worker's hold; false (counted `full`) when the queue is full
/// and the request must be routed now.
pub fn hold(state: &mut State, h: Held) -> bool {
    let Some(max) = state.router.config().big_request_hold.map(|c| c.max_held) else {
        return false;
    };
    match state.big_hold.push(h, max) {
        Ok(()) => {
            count(&mut state.metrics, "held");
            let depth = state.big_hold.depth();
            gauge(&mut state.metrics, depth);
            true
        }
        Err(_) => {
            count(&mut state.metrics, "full");
            false
        }
    }
}

/// What the tick wrote for request `id` when it released it (None: not released, or routed
/// by Envoy's fallback); a request still queued is taken out (its client went away, counted
/// `left`).
pub fn take(state: &mut State, id: u32) -> Option<Steered> {
    let resumed = state.big_hold.resumed.remove(&id);
    if state.big_hold.remove(id) {
        count(&mut state.metrics, "left");
        let depth = state.big_hold.depth();
        gauge(&mut state.metrics, depth);
    }
    resumed
}

/// On each tick: releases, oldest first, every held request that waited `maxHoldMs` or for
/// which a pod now has room (each release counts in the router's estimate before the next is
/// judged, so one free pod takes one big request). Each is routed on its own context, then
/// resumed, outside the state's borrow (resuming may run its later callbacks at once).
pub fn tick(state: &Rc<RefCell<State>>, now: u64) {
    let mut i = 0usize;
    loop {
        {
            let Ok(mut guard) = state.try_borrow_mut() else {
                return;
            };
            let s = &mut *guard;
            let Some(max_hold_ms) = s.router.config().big_request_hold.map(|c| c.max_hold_ms)
            else {
                return;
            };
            let Some(h) = s.big_hold.queue.get(i) else {
                return;
            };
            let expired = now.saturating_sub(h.since_ms) >= max_hold_ms;
            if !expired
                && s.router
                    .should_hold(h.pool, h.model.as_deref(), h.size, now)
            {
                i += 1;
                continue;
            }
            let Some(h) = s.big_hold.queue.remove(i) else {
                return;
            };
            count(&mut s.metrics, if expired { "expired" } else { "released" });
            s.metrics
                .record("ailb.big_hold.wait_ms", now.saturating_sub(h.since_ms));
            let depth = s.big_hold.depth();
            gauge(&mut s.metrics, depth);
            if hostcalls::set_effective_context(h.id).is_err() {
                // Gone without a log callback reaching us: nothing to resume.
                continue;
            }
            // The routing header is written on the held request's context.
            if let Some(r) = steer(
                &mut WasmHost,
                s,
                h.pool,
                h.model.as_deref(),
                now,
                h.size,
                None,
            ) {
                s.big_hold.resumed.insert(h.id, r);
            }
        }
        let _ = host::resume_request();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(id: u32) -> Held {
        Held {
            id,
            pool: 0,
            model: None,
            size: RequestSize::UNIT,
            since_ms: u64::from(id),
        }
    }

    #[test]
    fn the_queue_is_bounded_and_forgets_requests_whose_client_left() {
        let mut q = BigHold::default();
        assert!(q.push(held(1), 2).is_ok());
        assert!(q.push(held(2), 2).is_ok());
        // Full: given back, to be routed at once.
        assert_eq!(q.push(held(3), 2).map_err(|h| h.id), Err(3));
        assert_eq!(q.depth(), 2);
        assert!(q.remove(1));
        assert!(!q.remove(1));
        assert_eq!(q.depth(), 1);
        assert_eq!(q.queue.front().map(|h| h.id), Some(2));
        assert!(q.push(held(4), 2).is_ok());
        let order: Vec<u32> = q.queue.iter().map(|h| h.id).collect();
        assert_eq!(order, vec![2, 4]);
    }
}
