//! The big-request hold of one worker (`bigRequestHold`), for both data paths. Whether a
//! request waits, and when it may go, is the router's
//! [`Router::should_hold`](crate::picker::Router::should_hold); this keeps the paused requests
//! in arrival order, picks the ones to release on a tick, and counts what happened:
//! - `ailb.big_hold.held` / `.released` (a pod had room) / `.expired` (waited `maxHoldMs`,
//!   routed as if the hold were off) / `.full` (the queue was full, routed at once) /
//!   `.left` (the client went away while held);
//! - `ailb.big_hold.depth` (gauge, this worker) and `ailb.big_hold.wait_ms` (histogram).
//!
//! A paused request can only be resumed on its own worker, so the queue is per worker. The
//! wasm filter's root releases them on its tick and routes each on its own context; the
//! native module's held requests wake on their own stream ([`wake_big_held`]).

use std::collections::{BTreeSet, HashMap, VecDeque};

use crate::picker::{RequestSize, Router};

use super::admission::Woken;
use super::{Gate, GateStep, Host, Steered, Worker};

/// The hold's counters `ailb.big_hold.<name>`.
pub const COUNTERS: [&str; 5] = ["held", "released", "expired", "full", "left"];

/// Where the hold's stats go (Envoy's, through the glue): `ailb.big_hold.<what>` counters,
/// the `ailb.big_hold.depth` gauge and the `ailb.big_hold.wait_ms` histogram.
pub trait HoldStats {
    fn count(&mut self, what: &str);
    fn depth(&mut self, depth: u64);
    fn waited(&mut self, ms: u64);
}

/// One request waiting in the sidecar.
#[derive(Debug, Clone)]
pub struct Held {
    /// Its handle (the proxy-wasm context id; the native module's request number).
    pub id: u32,
    pub pool: usize,
    pub model: Option<String>,
    pub size: RequestSize,
    pub since_ms: u64,
}

/// The worker's held big requests, oldest first, and what a tick decided for those it
/// released (taken by the request itself on its next callback).
#[derive(Debug, Default)]
pub struct BigHold {
    queue: VecDeque<Held>,
    /// Released requests and the ranked list their release wrote.
    pub resumed: HashMap<u32, Steered>,
    /// Released requests not yet routed, for a glue whose held requests wake on their own
    /// stream ([`wake_big_held`]).
    pub released: HashMap<u32, Held>,
    /// When [`wake_big_held`] next runs the tick (ms).
    pub next_tick_ms: u64,
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

/// What the hold borrows from a worker at once.
pub struct HoldParts<'a> {
    pub hold: &'a mut BigHold,
    pub router: &'a mut Router,
    pub stats: &'a mut dyn HoldStats,
}

/// A worker that keeps a big-request hold.
pub trait HoldWorker: Worker {
    fn hold_parts(&mut self) -> HoldParts<'_>;
}

/// Queues request `h`; false (counted `full`) when `max` are already waiting and the request
/// must be routed now.
pub fn hold(big: &mut BigHold, stats: &mut dyn HoldStats, h: Held, max: usize) -> bool {
    match big.push(h, max) {
        Ok(()) => {
            stats.count("held");
            stats.depth(big.depth() as u64);
            true
        }
        Err(_) => {
            stats.count("full");
            false
        }
    }
}

/// What a release wrote for request `id` (None: not released, or routed by Envoy's
/// fallback); a request still queued is taken out (its client went away, counted `left`).
pub fn take(big: &mut BigHold, stats: &mut dyn HoldStats, id: u32) -> Option<Steered> {
    let resumed = big.resumed.remove(&id);
    big.released.remove(&id);
    if big.remove(id) {
        stats.count("left");
        stats.depth(big.depth() as u64);
    }
    resumed
}

/// The next request to release at `now`, at or after queue position `*i`, oldest first:
/// one that waited `max_hold_ms` (`expired`) or for which `room` says a pod has room now;
/// those still waiting are stepped over. Counted, with its wait.
pub fn next_release(
    big: &mut BigHold,
    stats: &mut dyn HoldStats,
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
        stats.count(if expired { "expired" } else { "released" });
        stats.waited(now.saturating_sub(h.since_ms));
        stats.depth(big.depth() as u64);
        return Some(h);
    }
}

/// For a glue whose held requests wake on their own stream (the native module): at most once
/// per `tick_ms`, on a fresh view of their pools, releases the requests that waited
/// `maxHoldMs` and at most one a pod has room for (it is routed on its own stream before the
/// next is judged, so one free pod takes one big request); then routes request `id` here if
/// it was released.
pub fn wake_big_held<H, W>(host: &mut H, worker: &mut W, id: u32, now: u64, tick_ms: u64) -> Woken
where
    H: Host + ?Sized,
    W: HoldWorker + ?Sized,
{
    let p = worker.hold_parts();
    let Some(max_hold_ms) = p.router.config().big_request_hold.map(|c| c.max_hold_ms) else {
        return Woken::Released;
    };
    let due = (now >= p.hold.next_tick_ms).then(|| {
        p.hold.next_tick_ms = now.saturating_add(tick_ms);
        p.hold
            .queue
            .iter()
            .map(|h| h.pool)
            .collect::<BTreeSet<usize>>()
    });
    if let Some(pools) = due {
        for pool in pools {
            worker.refresh(pool, now);
        }
        let HoldParts {
            hold,
            router,
            stats,
        } = worker.hold_parts();
        let (mut i, mut by_room) = (0usize, 0usize);
        let room = |h: &Held| {
            let ok = by_room == 0 && !router.should_hold(h.pool, h.model.as_deref(), h.size, now);
            by_room += usize::from(ok);
            ok
        };
        let mut room = room;
        while let Some(h) = next_release(hold, stats, &mut i, now, max_hold_ms, &mut room) {
            hold.released.insert(h.id, h);
        }
    }
    let Some(h) = worker.hold_parts().hold.released.remove(&id) else {
        return Woken::Waiting;
    };
    let steered = super::steer(host, worker, h.pool, h.model.as_deref(), now, h.size, None);
    if let Some(st) = steered {
        worker.hold_parts().hold.resumed.insert(id, st);
    }
    Woken::Released
}

/// The big-request hold of one request, as a [`Gate`].
#[derive(Debug)]
pub struct HoldGate {
    pub id: u32,
    held: bool,
}

impl HoldGate {
    pub fn new(id: u32) -> Self {
        Self { id, held: false }
    }

    /// Whether the hold keeps this request (and it has not come back yet).
    pub fn held(&self) -> bool {
        self.held
    }
}

impl<W: HoldWorker + ?Sized> Gate<W> for HoldGate {
    /// A big request no pod has room for waits in the worker's hold (`bigRequestHold`).
    fn before_route<H: Host + ?Sized>(
        &mut self,
        _host: &mut H,
        worker: &mut W,
        pool: usize,
        model: Option<&str>,
        size: RequestSize,
        now: u64,
    ) -> GateStep {
        let HoldParts {
            hold: big,
            router,
            stats,
        } = worker.hold_parts();
        if !router.should_hold(pool, model, size, now) {
            return GateStep::Proceed;
        }
        let h = Held {
            id: self.id,
            pool,
            model: model.map(str::to_string),
            size,
            since_ms: now,
        };
        let max = router.config().big_request_hold.map_or(0, |c| c.max_held);
        self.held = hold(big, stats, h, max);
        if self.held {
            GateStep::Held
        } else {
            GateStep::Proceed
        }
    }

    fn take_resumed(&mut self, worker: &mut W) -> Option<Steered> {
        if !std::mem::take(&mut self.held) {
            return None;
        }
        let p = worker.hold_parts();
        take(p.hold, p.stats, self.id)
    }
}

/// The whole gate of a request, as both glues run it: admission (when configured) first,
/// then the big-request hold (when configured) for what admission lets through.
#[derive(Debug)]
pub struct FilterGate {
    pub adm: super::admission::AdmissionGate,
    pub hold: HoldGate,
}

impl FilterGate {
    pub fn new(id: u32) -> Self {
        Self {
            adm: super::admission::AdmissionGate::new(id),
            hold: HoldGate::new(id),
        }
    }

    /// The request's handle in the worker's queues.
    pub fn id(&self) -> u32 {
        self.hold.id
    }
}

impl<W> Gate<W> for FilterGate
where
    W: super::admission::AdmissionWorker + HoldWorker + ?Sized,
{
    fn begin<H: Host + ?Sized>(
        &mut self,
        host: &mut H,
        worker: &mut W,
        end_of_stream: bool,
        now: u64,
    ) -> GateStep {
        self.adm.begin(host, worker, end_of_stream, now)
    }

    fn body<H: Host + ?Sized>(
        &mut self,
        host: &mut H,
        worker: &mut W,
        body: &[u8],
        complete: bool,
        now: u64,
    ) -> GateStep {
        self.adm.body(host, worker, body, complete, now)
    }

    fn before_route<H: Host + ?Sized>(
        &mut self,
        host: &mut H,
        worker: &mut W,
        pool: usize,
        model: Option<&str>,
        size: RequestSize,
        now: u64,
    ) -> GateStep {
        match self.adm.before_route(host, worker, pool, model, size, now) {
            GateStep::Proceed => self.hold.before_route(host, worker, pool, model, size, now),
            other => other,
        }
    }

    fn routed(&mut self, worker: &mut W, pool: usize, steered: &Steered, now: u64) {
        self.adm.routed(worker, pool, steered, now);
    }

    fn take_resumed(&mut self, worker: &mut W) -> Option<Steered> {
        let big = self.hold.take_resumed(worker);
        self.adm.take_resumed(worker).or(big)
    }

    fn on_response_headers<H: Host + ?Sized>(&mut self, host: &mut H, worker: &mut W, eos: bool) {
        self.adm.on_response_headers(host, worker, eos);
    }

    fn on_response_body<H: Host + ?Sized>(
        &mut self,
        host: &mut H,
        worker: &mut W,
        size: usize,
        end_of_stream: bool,
    ) {
        self.adm.on_response_body(host, worker, size, end_of_stream);
    }

    fn on_end<H: Host + ?Sized>(&mut self, host: &mut H, worker: &mut W, now: u64) {
        Gate::<W>::on_end(&mut self.adm, host, worker, now);
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
