//! Circuit breakers shared by every Envoy worker of one filter config (the wasm filter shares
//! them through Envoy's shared data; here they are plain memory behind a mutex, since the
//! module's workers are threads of one process).
//!
//! Each worker keeps its own router, so the pick reads its own copy of each breaker with no
//! lock. Every change of a pod's shared breaker bumps its pool's epoch; a worker reads that
//! one atomic before each pick and copies the pool's breakers only when it moved (or after it
//! installed a new pool state, whose pods may be new to it). So a breaker another worker just
//! opened is seen by this worker's very next request, and a pool where nothing changes costs
//! one atomic load per pick.
//!
//! The same rules as the wasm filter's: pod-level breakers are shared (per-model breakers
//! stay per worker), a success on a breaker with nothing to forget writes nothing, a
//! half-open pod's probe budget is spent once for the process.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use ai_lb_filter_core::breaker::{update_shared, Breaker, Transition};
use ai_lb_filter_core::picker::Router;

/// One pool's shared breakers.
#[derive(Debug, Default)]
struct PoolBreakers {
    /// Bumped after every change of a breaker of this pool; starts at 1, so a worker's 0 means
    /// "never copied".
    epoch: AtomicU64,
    by_pod: Mutex<HashMap<String, Breaker>>,
}

/// Every pool's shared breakers, for one filter config.
#[derive(Debug)]
pub struct SharedBreakers {
    pools: Vec<PoolBreakers>,
}

/// What an update left: the shared breaker now and its transitions (poll, then the update).
#[derive(Debug)]
pub struct Written {
    pub breaker: Breaker,
    pub transitions: Vec<Transition>,
}

impl SharedBreakers {
    pub fn new(pools: usize) -> Self {
        Self {
            pools: (0..pools)
                .map(|_| PoolBreakers {
                    epoch: AtomicU64::new(1),
                    by_pod: Mutex::new(HashMap::new()),
                })
                .collect(),
        }
    }

    /// Copies every shared breaker of `pool` into `router` when the pool's epoch moved past
    /// `seen` (the worker's last copy; 0 forces one). Pods the router does not know are
    /// skipped by `set_breaker`; the worker forces a copy after installing a new pool state.
    pub fn sync(&self, router: &mut Router, pool: usize, seen: &mut u64) {
        let Some(p) = self.pools.get(pool) else {
            return;
        };
        if p.epoch.load(Ordering::Acquire) == *seen {
            return;
        }
        let Ok(map) = p.by_pod.lock() else {
            return;
        };
        // Read under the lock, which every bump holds: the copy below is of that epoch.
        *seen = p.epoch.load(Ordering::Acquire);
        for (pod, b) in map.iter() {
            router.set_breaker(pool, pod, None, *b);
        }
    }

    /// Applies `update` to `pod`'s shared breaker (created with `jitter` if this is its first
    /// write), polling it first, and installs the result in `router`. Bumps the pool's epoch
    /// when the breaker changed. Pods no longer in the router's pool are forgotten on the way,
    /// so a pool whose pods come and go does not grow the map for the process's life.
    pub fn update(
        &self,
        router: &mut Router,
        pool: usize,
        pod: &str,
        now_ms: u64,
        jitter: u8,
        update: impl FnOnce(&mut Breaker) -> Option<Transition>,
    ) -> Option<Written> {
        let cfg = router.config().breaker;
        let p = self.pools.get(pool)?;
        let mut map = p.by_pod.lock().ok()?;
        let stored = map.get(pod).copied();
        let w = update_shared(stored, jitter, now_ms, &cfg, update);
        // Unchanged (most often a success on a closed breaker, or on a pod never written):
        // nothing is stored and no worker copies.
        if w.changed {
            if stored.is_none() && map.len() >= router.pod_addresses(pool).count() {
                let live: std::collections::HashSet<&str> = router.pod_addresses(pool).collect();
                map.retain(|k, _| live.contains(k.as_str()));
            }
            map.insert(pod.to_string(), w.breaker);
            p.epoch.fetch_add(1, Ordering::AcqRel);
        }
        let (b, transitions) = (w.breaker, w.transitions);
        drop(map);
        router.set_breaker(pool, pod, None, b);
        Some(Written {
            breaker: b,
            transitions,
        })
    }

    /// The number of shared breakers of `pool` (tests).
    #[cfg(test)]
    fn len(&self, pool: usize) -> usize {
        self.pools
            .get(pool)
            .and_then(|p| p.by_pod.lock().ok().map(|m| m.len()))
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ai_lb_filter_core::breaker::{BreakerState, TripReason};
    use ai_lb_filter_core::config::FilterConfig;
    use ai_lb_proto::{PeerState, PeerStatus, PodIdentity, PodSnapshot, PoolEvent};

    /// Replaces the router's pool with live pods at `addrs`.
    fn install_pods(r: &mut Router, addrs: &[&str]) {
        let peers = addrs
            .iter()
            .enumerate()
            .map(|(i, a)| PeerState {
                peer: format!("agent-{i}:9090"),
                status: PeerStatus::Live as i32,
                snapshot: Some(PodSnapshot {
                    identity: Some(PodIdentity {
                        address: a.to_string(),
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                reason: String::new(),
            })
            .collect();
        let ev = PoolEvent {
            full: true,
            peers,
            ..Default::default()
        };
        r.apply_pool_event(0, &ev, 1_000);
    }

    fn router() -> Router {
        let cfg = FilterConfig::from_json(
            br#"{"pools":[{"name":"default","cluster":"inference"}],
                 "breaker":{"consecutiveFailures":2,"baseCooldownMs":1000}}"#,
        )
        .unwrap();
        Router::new(cfg)
    }

    #[test]
    fn a_breaker_one_worker_opens_is_open_in_another_workers_router_after_its_sync() {
        let shared = SharedBreakers::new(1);
        let (mut a, mut b) = (router(), router());
        install_pods(&mut a, &["10.0.0.1:8000", "10.0.0.2:8000"]);
        install_pods(&mut b, &["10.0.0.1:8000", "10.0.0.2:8000"]);
        let (mut seen_a, mut seen_b) = (0, 0);
        shared.sync(&mut a, 0, &mut seen_a);
        shared.sync(&mut b, 0, &mut seen_b);
        let cfg = a.config().breaker;
        let pod = "10.0.0.1:8000";
        let mut opened = false;
        for t in 0..2 {
            let w = shared
                .update(&mut a, 0, pod, 1_000 + t, 0, |br| {
                    br.record(Some(TripReason::ServerErrors), 1_000 + t, &cfg)
                })
                .unwrap();
            opened |= w.transitions.iter().any(|t| t.to == BreakerState::Open);
        }
        assert!(opened, "two failures in a row open the breaker");
        assert_eq!(a.breaker(0, pod, None).unwrap().state(), BreakerState::Open);
        // b has not synced: still its own (closed) copy.
        assert_eq!(
            b.breaker(0, pod, None).unwrap().state(),
            BreakerState::Closed
        );
        shared.sync(&mut b, 0, &mut seen_b);
        assert_eq!(b.breaker(0, pod, None).unwrap().state(), BreakerState::Open);
        // Nothing moved since: no copy (the epoch is unchanged).
        let epoch = seen_b;
        shared.sync(&mut b, 0, &mut seen_b);
        assert_eq!(seen_b, epoch);
    }

    #[test]
    fn a_success_on_a_clean_breaker_writes_nothing() {
        let shared = SharedBreakers::new(1);
        let mut a = router();
        install_pods(&mut a, &["10.0.0.1:8000"]);
        let cfg = a.config().breaker;
        let w = shared
            .update(&mut a, 0, "10.0.0.1:8000", 5, 0, |b| {
                b.record(None, 5, &cfg)
            })
            .unwrap();
        assert!(w.transitions.is_empty());
        // A default breaker after a success equals the default one: not stored, epoch kept.
        assert_eq!(shared.len(0), 0);
        let mut seen = 1;
        shared.sync(&mut a, 0, &mut seen);
        assert_eq!(seen, 1);
    }

    #[test]
    fn breakers_of_pods_that_left_the_pool_are_forgotten() {
        let shared = SharedBreakers::new(1);
        let mut a = router();
        install_pods(&mut a, &["10.0.0.1:8000", "10.0.0.2:8000"]);
        let cfg = a.config().breaker;
        for pod in ["10.0.0.1:8000", "10.0.0.2:8000"] {
            shared.update(&mut a, 0, pod, 5, 0, |b| {
                b.record(Some(TripReason::ServerErrors), 5, &cfg)
            });
        }
        assert_eq!(shared.len(0), 2);
        // 10.0.0.1 left, 10.0.0.3 joined and fails: the map stays at the pool's size.
        install_pods(&mut a, &["10.0.0.2:8000", "10.0.0.3:8000"]);
        shared.update(&mut a, 0, "10.0.0.3:8000", 6, 0, |b| {
            b.record(Some(TripReason::ServerErrors), 6, &cfg)
        });
        assert_eq!(shared.len(0), 2);
    }
}
