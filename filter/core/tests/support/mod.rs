//! A proxy for one request as the core's lifecycle tests see it ([`MockHost`]): headers in
//! maps, what the core did recorded. Shared by the tests that drive `lifecycle::Exchange` with
//! no Envoy (`lifecycle.rs`, `admission_gate.rs`, `breaker_triggers.rs`), with the shared
//! breakers in a map ([`MapStore`]), stats that record nothing ([`NoStats`]), a worker that
//! syncs that map on each refresh ([`SyncWorker`]) and a pool of idle pods ([`pods_event`]).
#![allow(dead_code)]

use std::borrow::Cow;
use std::cell::Cell;
use std::collections::HashMap;

use ai_lb_filter_core::breaker::{Breaker, Transition};
use ai_lb_filter_core::lifecycle::{BreakerStore, Host, Parts, Stats, Worker};
use ai_lb_filter_core::picker::Router;
use ai_lb_proto::{
    InferenceStats, ModelInfo, PeerState, PeerStatus, PodIdentity, PodSnapshot, PoolEvent,
};
use rand::rngs::SmallRng;
use rand::SeedableRng;

/// A local reply: status, headers, body.
pub type Reply = (u16, Vec<(String, String)>, String);

#[derive(Default)]
pub struct MockHost {
    pub now: u64,
    pub req: HashMap<String, String>,
    pub resp: HashMap<String, String>,
    /// The routed cluster (None: the request matched no cluster).
    pub cluster: Option<String>,
    pub upstream: Option<String>,
    pub code: Option<u16>,
    pub details: Option<String>,
    /// Every ranked list handed to the proxy.
    pub steered: Vec<String>,
    pub replies: Vec<Reply>,
    pub warnings: Vec<String>,
    pub refuse_steer: bool,
    /// Envoy's own balancer serves retries (the native module's `steering: overrideHost`).
    pub retries_elsewhere: bool,
    /// Reads of what only the log phase needs (code, flags, details), and of the upstream.
    pub end_reads: Cell<usize>,
    pub upstream_reads: Cell<usize>,
    /// `hits_addend` values set; None: the proxy refuses the filter state.
    pub hits: Option<Vec<u64>>,
    /// The response chunk being delivered (None: the proxy cannot read it).
    pub chunk: Option<Vec<u8>>,
    pub peer: Option<String>,
}

impl MockHost {
    /// A request at `now` on the `inference` cluster.
    pub fn at(now: u64) -> MockHost {
        MockHost {
            now,
            cluster: Some("inference".into()),
            ..Default::default()
        }
    }

    /// Header `name` of local reply `i`.
    pub fn reply_header(&self, i: usize, name: &str) -> Option<&str> {
        self.replies
            .get(i)?
            .1
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

impl Host for MockHost {
    fn now_ms(&self) -> u64 {
        self.now
    }
    fn request_header(&self, name: &str) -> Option<Cow<'_, str>> {
        self.req.get(name).map(|v| Cow::Borrowed(v.as_str()))
    }
    fn set_request_header(&mut self, name: &str, value: Option<&str>) -> bool {
        match value {
            Some(v) => self.req.insert(name.into(), v.into()),
            None => self.req.remove(name),
        };
        true
    }
    fn response_header(&self, name: &str) -> Option<Cow<'_, str>> {
        self.resp.get(name).map(|v| Cow::Borrowed(v.as_str()))
    }
    fn set_response_header(&mut self, name: &str, value: &str) {
        self.resp.insert(name.into(), value.into());
    }
    fn send_local_reply(&mut self, status: u16, headers: &[(&str, &str)], body: &[u8]) {
        let hs = headers.iter().map(|(k, v)| (k.to_string(), v.to_string()));
        let body = String::from_utf8_lossy(body).into_owned();
        self.replies.push((status, hs.collect(), body));
    }
    fn cluster_name(&self) -> Option<Cow<'_, str>> {
        self.cluster.as_deref().map(Cow::Borrowed)
    }
    fn upstream_address(&self) -> Option<Cow<'_, str>> {
        self.upstream_reads.set(self.upstream_reads.get() + 1);
        self.upstream.as_deref().map(Cow::Borrowed)
    }
    fn response_code(&self) -> Option<u16> {
        self.end_reads.set(self.end_reads.get() + 1);
        self.code
    }
    fn response_flags(&self) -> u64 {
        self.end_reads.set(self.end_reads.get() + 1);
        0
    }
    fn response_code_details(&self) -> Option<Cow<'_, str>> {
        self.end_reads.set(self.end_reads.get() + 1);
        self.details.as_deref().map(Cow::Borrowed)
    }
    fn retries_follow_ranked(&self) -> bool {
        !self.retries_elsewhere
    }
    fn steer(&mut self, routing_header: &str, ranked: &str) -> bool {
        if self.refuse_steer {
            return false;
        }
        self.req.insert(routing_header.into(), ranked.into());
        self.steered.push(ranked.into());
        true
    }
    fn warn(&mut self, msg: &str) {
        self.warnings.push(msg.into());
    }
    fn peer_principal(&self) -> Option<Cow<'_, str>> {
        self.peer.as_deref().map(Cow::Borrowed)
    }
    fn set_hits_addend(&mut self, n: u64) -> bool {
        match &mut self.hits {
            Some(h) => {
                h.push(n);
                true
            }
            None => false,
        }
    }
    fn response_chunk(&self, _size: usize) -> Option<Vec<u8>> {
        self.chunk.clone()
    }
}

/// Shared breakers in a map (as the native module keeps them), no epoch; `writes` counts the
/// updates that changed one.
#[derive(Default)]
pub struct MapStore {
    pub by_pod: HashMap<String, Breaker>,
    pub writes: usize,
}

impl BreakerStore for MapStore {
    fn sync(&mut self, router: &mut Router, pool: usize, _now: u64) {
        for (pod, b) in &self.by_pod {
            router.set_breaker(pool, pod, None, *b);
        }
    }
    fn update(
        &mut self,
        router: &mut Router,
        pool: usize,
        pod: &str,
        now: u64,
        update: &mut dyn FnMut(&mut Breaker) -> Option<Transition>,
    ) -> Option<Vec<Transition>> {
        let cfg = router.config().breaker;
        let before = self.by_pod.get(pod).copied().unwrap_or_default();
        let mut b = before;
        let mut ts: Vec<Transition> = b.poll(now, &cfg).into_iter().collect();
        ts.extend(update(&mut b));
        if b != before {
            self.by_pod.insert(pod.into(), b);
            self.writes += 1;
        }
        router.set_breaker(pool, pod, None, b);
        Some(ts)
    }
}

/// Stats that record nothing.
#[derive(Default)]
pub struct NoStats;

impl Stats for NoStats {
    fn picked(&mut self, _: &str) {}
    fn failed(&mut self, _: &str) {}
    fn transitions(&mut self, _: &str, _: &[Transition]) {}
}

/// A worker of the lifecycle with the shared breakers in a [`MapStore`], synced on each
/// refresh as the data paths sync theirs, and stats `S`; it counts its refreshes.
pub struct SyncWorker<S> {
    pub router: Router,
    pub rng: SmallRng,
    pub scratch: String,
    pub ids: Vec<u32>,
    pub keys: Vec<u64>,
    pub store: MapStore,
    pub stats: S,
    pub refreshes: usize,
    pub ordinal: u64,
}

impl<S: Stats> SyncWorker<S> {
    /// A worker around `router`, its draws seeded by `seed`.
    pub fn new(router: Router, stats: S, seed: u64, ordinal: u64) -> Self {
        SyncWorker {
            router,
            rng: SmallRng::seed_from_u64(seed),
            scratch: String::new(),
            ids: Vec::new(),
            keys: Vec::new(),
            store: MapStore::default(),
            stats,
            refreshes: 0,
            ordinal,
        }
    }
}

impl<S: Stats> Worker for SyncWorker<S> {
    fn refresh(&mut self, pool: usize, now: u64) {
        self.refreshes += 1;
        self.store.sync(&mut self.router, pool, now);
    }
    fn parts(&mut self) -> Parts<'_> {
        Parts {
            router: &mut self.router,
            rng: &mut self.rng,
            scratch: &mut self.scratch,
            prompt_ids: &mut self.ids,
            key_scratch: &mut self.keys,
            breakers: &mut self.store,
            stats: &mut self.stats,
        }
    }
    fn router(&self) -> &Router {
        &self.router
    }
    fn ordinal(&self) -> u64 {
        self.ordinal
    }
}

/// A full pool event: one live pod per address serving model `m`, pod `i` running `running(i)`
/// of 8 seats with nothing waiting and its KV cache a tenth full.
pub fn pods_event(pods: &[&str], running: impl Fn(usize) -> u32) -> PoolEvent {
    let peers = pods
        .iter()
        .enumerate()
        .map(|(i, a)| PeerState {
            peer: format!("agent-{i}:9090"),
            status: PeerStatus::Live as i32,
            snapshot: Some(PodSnapshot {
                identity: Some(PodIdentity {
                    address: a.to_string(),
                    models: vec![ModelInfo {
                        name: "m".into(),
                        ..Default::default()
                    }],
                    ..Default::default()
                }),
                inference: Some(InferenceStats {
                    waiting: Some(0),
                    running: Some(running(i)),
                    queue_capacity: Some(8),
                    kv_cache_usage: Some(0.1),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            reason: String::new(),
        })
        .collect();
    PoolEvent {
        full: true,
        peers,
        ..Default::default()
    }
}
