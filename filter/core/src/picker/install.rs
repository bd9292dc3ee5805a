//! Installs a pool's state from its agent's events (subscriber) or shared bytes (workers), and
//! re-lays the pod table out when its pods changed: pods keep their runtime state by address.

use std::collections::HashMap;

use super::pod::PodRt;
use super::{Router, NONE};
use crate::breaker::BreakerEvent;
use crate::pool::{DecodeError, PoolState};

impl Router {
    /// Applies one `WatchPool` event to the pool's state (a copy of it; the subscriber's path
    /// is [`Router::apply_pool_event_bytes`]).
    pub fn apply_pool_event(
        &mut self,
        pool_idx: usize,
        ev: &ai_lb_proto::PoolEvent,
        now_ms: u64,
    ) -> Vec<BreakerEvent> {
        let Some(p) = self.pools.get_mut(pool_idx) else {
            return Vec::new();
        };
        p.state.apply_event(ev, now_ms, &mut self.counters);
        self.relayout(pool_idx, now_ms)
    }

    /// Subscriber path: applies one encoded `WatchPool` event to the pool's state, one peer at
    /// a time (see [`PoolState::apply_event_bytes`], also for what an undecodable peer does).
    pub fn apply_pool_event_bytes(
        &mut self,
        pool_idx: usize,
        bytes: &[u8],
        now_ms: u64,
    ) -> Result<Vec<BreakerEvent>, DecodeError> {
        let Some(p) = self.pools.get_mut(pool_idx) else {
            return Ok(Vec::new());
        };
        let applied = p.state.apply_event_bytes(bytes, now_ms, &mut self.counters);
        let events = self.relayout(pool_idx, now_ms);
        applied.map(|()| events)
    }

    /// Worker path: installs shared bytes unless their version is the one already installed
    /// ([`PoolState::install`]: the old state goes before the new one is built, and bytes
    /// that do not decode leave the pool empty). Counts decode errors. Pods keep their EMA,
    /// breakers, in-flight counts and picks by serving address.
    pub fn set_pool_state_bytes(
        &mut self,
        pool_idx: usize,
        bytes: &[u8],
        now_ms: u64,
    ) -> Result<Vec<BreakerEvent>, DecodeError> {
        let version = match PoolState::encoded_version(bytes) {
            Ok(v) => v,
            Err(e) => {
                self.counters.pool_decode_errors += 1;
                return Err(e);
            }
        };
        let Some(p) = self.pools.get_mut(pool_idx) else {
            return Ok(Vec::new());
        };
        if (p.state.version(), p.state.last_event_ms()) == version {
            return Ok(Vec::new());
        }
        let installed = p.state.install(bytes);
        if installed.is_err() {
            self.counters.pool_decode_errors += 1;
        }
        let events = self.relayout(pool_idx, now_ms);
        installed.map(|()| events)
    }

    fn relayout(&mut self, pool_idx: usize, now_ms: u64) -> Vec<BreakerEvent> {
        let Some(p) = self.pools.get_mut(pool_idx) else {
            return Vec::new();
        };
        // Usually the same pods in the same order as before: then they stay where they are
        // (no map of the old pods, whose size is that of the pod table).
        let mut k = 0usize;
        let unchanged = p.state.peers().iter().all(|peer| match &peer.signals {
            None => true,
            Some(sig) => {
                let same = p.pods.get(k).is_some_and(|pod| pod.address == sig.address);
                k += 1;
                same
            }
        }) && k == p.pods.len();
        if unchanged {
            let mut pods = p.pods.iter_mut();
            for (i, peer) in p.state.peers().iter().enumerate() {
                if peer.signals.is_some() {
                    if let Some(pod) = pods.next() {
                        pod.peer_idx = i;
                    }
                }
            }
        } else {
            self.rebuild_pods(pool_idx);
            if let Some(p) = self.pools.get_mut(pool_idx) {
                // Its entries name pods by their old ids.
                p.own.clear();
            }
        }
        let Some(p) = self.pools.get_mut(pool_idx) else {
            return Vec::new();
        };
        p.generation = p.generation.wrapping_add(1);
        p.views.clear();
        p.dirty = true;
        let before = self.events.len();
        self.refresh(pool_idx, now_ms);
        self.events.split_off(before)
    }

    /// The pod table anew from the pool's peers; pods keep their runtime state by address.
    fn rebuild_pods(&mut self, pool_idx: usize) {
        let Some(p) = self.pools.get_mut(pool_idx) else {
            return;
        };
        let mut old: HashMap<String, PodRt> =
            p.pods.drain(..).map(|r| (r.address.clone(), r)).collect();
        p.by_addr.clear();
        for (i, peer) in p.state.peers().iter().enumerate() {
            let Some(sig) = &peer.signals else { continue };
            if p.by_addr.contains_key(&sig.address) {
                self.counters.snapshots_rejected += 1;
                continue;
            }
            let mut rt = old
                .remove(&sig.address)
                .unwrap_or_else(|| PodRt::new(sig.address.clone(), i));
            rt.peer_idx = i;
            let id = u32::try_from(p.pods.len()).unwrap_or(NONE);
            p.by_addr.insert(sig.address.clone(), id);
            p.pods.push(rt);
        }
    }
}
