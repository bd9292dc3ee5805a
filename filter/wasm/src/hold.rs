//! Decides nothing: the worker's queue of big requests waiting in the sidecar
//! (`bigRequestHold`). Whether a request waits, and when it may go, is the core's
//! [`Router::should_hold`](ai_lb_filter_core::picker::Router::should_hold); this keeps the
//! paused requests in arrival order, picks the ones to release on the root's tick (which
//! routes each on its own context, then resumes it), and counts what happened:
//! - `ailb.big_hold.held` / `.released` (a pod had room) / `.expired` (waited `maxHoldMs`,
//!   routed as if the hold were off) / `.full` (the queue was full, routed at once) /
//!   `.left` (the client went away while held);
//! - `ailb.big_hold.depth` (gauge, this worker) and `ailb.big_hold.wait_ms` (histogram).
//!
//! Requests paused in a VM can only be resumed from that VM, so the queue is per worker.

use std::collections::{HashMap, VecDeque};

use ai_lb_filter_core::lifecycle::Steered;
use ai_lb_filter_core::picker::RequestSize;

use crate::metrics::Metrics;

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

/// Queues request `h`; false (counted `full`) when `max` are already waiting and the request
/// must be routed now.
pub fn hold(big: &mut BigHold, metrics: &mut Metrics, h: Held, max: usize) -> bool {
    match big.push(h, max) {
        Ok(()) => {
            count(metrics, "held");
            gauge(metrics, big.depth());
            true
        }
        Err(_) => {
            count(metrics, "full");
            false
        }
    }
}

/// What the tick wrote for request `id` when it released it (None: not released, or routed
/// by Envoy's fallback); a request still queued is taken out (its client went away, counted
/// `left`).
pub fn take(big: &mut BigHold, metrics: &mut Metrics, id: u32) -> Option<Steered> {
    let resumed = big.resumed.remove(&id);
    if big.remove(id) {
        count(metrics, "left");
        gauge(metrics, big.depth());
    }
    resumed
}

/// The next request to release at `now`, at or after queue position `*i`, oldest first:
/// one that waited `max_hold_ms` (`expired`) or for which `room` says a pod has room now;
/// those still waiting are stepped over. Counted, with its wait.
pub fn next_release(
    big: &mut BigHold,
    metrics: &mut Metrics,
    i: &mut usize,
    now: u64,
    max_hold_ms: u64,
    mut room: impl FnMut(&Held) -> bool,
) -> Option<Held> {
    loop {
        let h = big.queue.get(*i)?;
        let expired = now.saturating_sub(h.since_ms) >= max_hold_ms;
        if !expired && !room(h) {
            *i += 1;
            continue;
        }
        let h = big.queue.remove(*i)?;
        count(metrics, if expired { "expired" } else { "released" });
        metrics.record("ailb.big_hold.wait_ms", now.saturating_sub(h.since_ms));
        gauge(metrics, big.depth());
        return Some(h);
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
