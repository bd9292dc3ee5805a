//! Decides nothing: keeps this VM's copy of the shared circuit breakers in step with the other
//! VMs of the Envoy process.
//!
//! Every write of a pod's shared breaker bumps its pool's breaker epoch
//! (`ai_lb.<pool>.breakers`). A VM reads that one number before each pick and on each refresh
//! tick, and copies the pods' breakers only when it moved. So a breaker another worker just
//! opened is seen by the very next request on this worker, not up to `watch.refreshMs` later,
//! and a pool with nothing changing costs one shared-data read per pick instead of one per pod
//! per tick. A full copy still runs every [`FULL_SYNC_MS`], in case an epoch bump was lost to
//! CAS contention.

use std::collections::{HashMap, HashSet};

use ai_lb_filter_core::breaker::{Breaker, Transition};
use ai_lb_filter_core::picker::Router;

use crate::shared;

/// Copy every pod's shared breaker at least this often, whatever the epoch says.
pub const FULL_SYNC_MS: u64 = 1_000;

/// Per-pool sync bookkeeping.
struct PoolSync {
    name: String,
    epoch_key: String,
    /// The epoch of the last copy (u64::MAX: never copied).
    epoch_seen: u64,
    next_full_ms: u64,
    /// Each pod's shared breaker bytes as last installed here.
    seen: HashMap<String, Vec<u8>>,
}

/// This VM's view of the shared breakers of every pool.
pub struct Breakers {
    pools: Vec<PoolSync>,
    /// Cooldown jitter of the shared breakers this VM creates (see `Breaker::with_jitter`):
    /// random per VM, so sidecars that open a pod's breaker on the same agent snapshot probe
    /// it at different moments.
    pub jitter: u8,
}

impl Breakers {
    /// One entry per pool name, in pool order.
    pub fn new<'a>(pool_names: impl IntoIterator<Item = &'a str>, jitter: u8) -> Self {
        Self {
            pools: pool_names
                .into_iter()
                .map(|name| PoolSync {
                    name: name.to_string(),
                    epoch_key: shared::breakers_epoch_key(name),
                    epoch_seen: u64::MAX,
                    next_full_ms: 0,
                    seen: HashMap::new(),
                })
                .collect(),
            jitter,
        }
    }

    /// Installs other VMs' breaker changes for every pod of `pool` into `router`, when the
    /// pool's epoch moved since the last copy (or a full copy is due).
    pub fn sync(&mut self, router: &mut Router, pool: usize, now: u64) {
        let Some(p) = self.pools.get_mut(pool) else {
            return;
        };
        let epoch = shared::read_u64(&p.epoch_key);
        if epoch == p.epoch_seen && now < p.next_full_ms {
            return;
        }
        // Read before the copy: a write that lands during the copy bumps past it, so the next
        // sync copies again.
        p.epoch_seen = epoch;
        p.next_full_ms = now.saturating_add(FULL_SYNC_MS);
        // Only the pods whose shared breaker differs from the copy here are collected (most
        // often one), then installed.
        let mut changed = Vec::new();
        let mut pods = 0usize;
        for pod in router.pod_addresses(pool) {
            pods += 1;
            let (bytes, _) = crate::host::shared_get(&shared::breaker_key(&p.name, pod));
            let Some(bytes) = bytes else { continue };
            if p.seen.get(pod) != Some(&bytes) {
                changed.push((pod.to_string(), bytes));
            }
        }
        for (pod, bytes) in changed {
            if let Some(b) = Breaker::decode(&bytes) {
                router.set_breaker(pool, &pod, None, b);
            }
            p.seen.insert(pod, bytes);
        }
        // Holding more copies than the pool has pods: some are of pods that left. Keeps the
        // map no larger than the pool (after each sync) without a set per sync.
        if p.seen.len() > pods {
            forget_gone(&mut p.seen, router.pod_addresses(pool));
        }
    }

    /// Applies `update` to the pod's shared breaker (see [`shared::update_breaker`]) and
    /// installs the result in `router`. Returns the transitions on the shared breaker (to be
    /// counted once per process); None when the shared breaker could not be written.
    pub fn write(
        &mut self,
        router: &mut Router,
        pool: usize,
        pod: &str,
        now: u64,
        update: impl FnMut(&mut Breaker) -> Option<Transition>,
    ) -> Option<Vec<Transition>> {
        let cfg = router.config().breaker;
        let p = self.pools.get_mut(pool)?;
        let w = shared::update_breaker(&p.name, pod, now, &cfg, self.jitter, update)?;
        // This VM's own write needs no copy back, unless another VM wrote in between.
        if w.epoch.is_some_and(|e| p.epoch_seen.wrapping_add(1) == e) {
            p.epoch_seen = w.epoch.unwrap_or(p.epoch_seen);
        }
        // Written or found unchanged, these are the shared bytes now.
        p.seen.insert(pod.to_string(), w.breaker.encode().to_vec());
        router.set_breaker(pool, pod, None, w.breaker);
        Some(w.transitions)
    }
}

impl ai_lb_filter_core::lifecycle::BreakerStore for Breakers {
    fn sync(&mut self, router: &mut Router, pool: usize, now: u64) {
        Breakers::sync(self, router, pool, now);
    }

    fn update(
        &mut self,
        router: &mut Router,
        pool: usize,
        pod: &str,
        now: u64,
        update: &mut dyn FnMut(&mut Breaker) -> Option<Transition>,
    ) -> Option<Vec<Transition>> {
        self.write(router, pool, pod, now, update)
    }
}

/// Forgets the copies of pods that are no longer in the pool: in a pool whose pods come and go
/// (rollouts, autoscaling) the map would otherwise grow for the VM's life.
fn forget_gone<'a>(seen: &mut HashMap<String, Vec<u8>>, live: impl Iterator<Item = &'a str>) {
    let live: HashSet<&str> = live.collect();
    seen.retain(|pod, _| live.contains(pod.as_str()));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_of_pods_that_left_the_pool_are_forgotten() {
        let mut seen: HashMap<String, Vec<u8>> =
            ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
                .into_iter()
                .map(|p| (p.to_string(), vec![1]))
                .collect();
        forget_gone(
            &mut seen,
            ["10.0.0.3:8000", "10.0.0.1:8000", "10.0.0.9:8000"].into_iter(),
        );
        let mut left: Vec<&str> = seen.keys().map(String::as_str).collect();
        left.sort_unstable();
        assert_eq!(left, ["10.0.0.1:8000", "10.0.0.3:8000"]);
    }
}
