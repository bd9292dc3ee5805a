//! Per-request glue: translates Envoy's hooks into the core's request lifecycle
//! ([`ai_lb_filter_core::lifecycle::Exchange`], the same one the wasm filter drives), against a
//! router owned by the Envoy worker thread (no locks on the pick) and breakers shared by every
//! worker ([`crate::breakers`]). The host calls are the module ABI's ([`NativeHost`]).
//!
//! Admission (the limiter, priority classes and the held queue) and the big-request hold are
//! the core's gate (`lifecycle::hold::FilterGate`) over buckets shared by every worker
//! ([`crate::admission`]); held requests wake on their own stream ([`crate::held`]). Guard mode
//! (`filter.mode: "guard"`, the inference pod's inbound sidecar) runs the core's
//! `lifecycle::guard::guard_request` on the local pod's signals the feed keeps
//! ([`crate::feed`]) and nothing else. Not here (stated in filter/native/README.md): the per-pod
//! in-flight gauge.

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ai_lb_filter_core::admission::config::GuardConfig;
use ai_lb_filter_core::admission::MemoryStore;
use ai_lb_filter_core::breaker::{Breaker, BreakerState, Transition, TripReason};
use ai_lb_filter_core::config::Mode;
use ai_lb_filter_core::lifecycle::admission::{
    self as admission, AdmissionParts, AdmissionRt, AdmissionWorker, Woken,
};
use ai_lb_filter_core::lifecycle::guard::{guard_request, GuardCount};
use ai_lb_filter_core::lifecycle::hold::{self, BigHold, FilterGate, HoldParts, HoldWorker};
use ai_lb_filter_core::lifecycle::{
    self, BreakerStore, Exchange, Host, Next as LifeNext, Parts, Stats,
};
use ai_lb_filter_core::picker::Router;
use ai_lb_filter_core::versions::VersionCounts;
use ai_lb_filter_core::Counters as CoreCounters;
use rand::rngs::SmallRng;
use rand::SeedableRng;

use crate::admission::{AdmTally, AdmissionIds, HoldIds, HoldTally};
use crate::breakers::SharedBreakers;
use crate::config::{NativeConfig, Steering};
use crate::feed::{self, now_ms, Feed, Shared};
use crate::held::HeldWake;
use crate::host::{self, ConfigHandle, LabeledCounter, LabeledGauge, Level, Map, StatSink, Stream};
use crate::main_tick::{self, MainTick};

/// Counter ids (0 = not defined; never counted). The names are the wasm filter's, so one
/// dashboard reads both data paths (Envoy prefixes them `dynamicmodulescustom.` here,
/// `wasmcustom.` there).
#[derive(Debug, Clone)]
pub struct Counters {
    /// The core's counters, in [`CoreCounters::iter`] order (`ailb.<name>`).
    core: [usize; CORE_COUNTERS],
    stream_opens: usize,
    stream_failures: usize,
    stream_closes: usize,
    state_busy: usize,
    /// Per [`TripReason`], in [`TripReason::ALL`] order (`ailb.breaker_opened.<reason>`).
    breaker_opened: [usize; TripReason::ALL.len()],
    breaker_half_opened: usize,
    breaker_closed: usize,
    /// Per pod (label `ailb_endpoint`, `ip:port`, as the wasm filter's stats tags give it):
    /// requests steered there, and the failures
    /// attributed to it, added once a second per worker ([`Worker::export`]).
    picks: LabeledCounter,
    failures: LabeledCounter,
    /// Per pod (label `ailb_endpoint`), set once a second on the main thread's tick
    /// ([`export_pod_gauges`]): its score x1000, breaker (0 closed, 1 half-open, 2 open) and
    /// metrics age (ms).
    score: LabeledGauge,
    breaker_state: LabeledGauge,
    gpu_signal: LabeledGauge,
    metrics_age_ms: LabeledGauge,
    /// Guard mode only (0 otherwise), in [`GuardCount::ALL`] order (`ailb.guard.*`).
    guard: [usize; GuardCount::ALL.len()],
    /// `versions`: per model version (label `ailb_version`), in [`VersionCounts::iter`] order
    /// (`ailb.version.<name>`), added once a second per worker; and its domain state (0
    /// closed, 1 half-open, 2 open) as that worker sees it.
    version: [LabeledCounter; VersionCounts::COUNT],
    version_state: LabeledGauge,
    /// `learnedWeights` (empty when off): per pool, its model's weights in
    /// [`ai_lb_filter_core::learned::WEIGHT_NAMES`] order (`ailb.pool.<pool>.learned.<name>`),
    /// set once a second by one worker ([`export_learned_gauges`]) from its own model.
    learned: Vec<[usize; ai_lb_filter_core::learned::DIM]>,
}

/// One filter config: what Envoy's config object points to. Lives until every stream of it
/// is gone (Envoy holds it for them).
#[derive(Debug)]
pub struct ConfigRt {
    pub id: u64,
    pub cfg: NativeConfig,
    pub shared: Arc<Shared>,
    /// Circuit breakers shared by every worker.
    pub breakers: Arc<SharedBreakers>,
    pub counters: Counters,
    /// Admission's stats (None: admission is off).
    adm_ids: Option<AdmissionIds>,
    /// The big-request hold's stats (None: `bigRequestHold` is off).
    hold_ids: Option<HoldIds>,
    /// Guard mode: the guard's settings (`admission.guard`, defaults without it). None: route
    /// mode.
    guard: Option<GuardConfig>,
    /// The tenants' token buckets, shared by every worker.
    buckets: Arc<MemoryStore>,
    /// Wakes held requests (admission on only), every `tick_ms`.
    held: Option<HeldWake>,
    /// `breaker.syntheticProbe` (route mode): the probes in flight. None: off.
    pub probes: Option<crate::probes::Probes>,
    /// Route mode: wakes the main thread for the probes and the per-pod gauges. None in guard
    /// mode, or when Envoy gave no scheduler (then a request sets the gauges).
    main_tick: Option<MainTick>,
    tick_ms: u64,
    /// When the per-pod gauges are next due (ms; [`export_pod_gauges`]).
    gauges_due_ms: AtomicU64,
    /// When the learned-weight gauges are next due (ms; [`export_learned_gauges`]).
    learned_due_ms: AtomicU64,
    /// Workers keep a weak handle: a worker of a config that is gone is dropped when its
    /// thread next makes one (configs come and go with Envoy config updates).
    alive: Arc<()>,
    _feed: Feed,
}

impl ConfigRt {
    pub fn new(handle: &ConfigHandle, bytes: &[u8]) -> Result<ConfigRt, String> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let cfg = crate::config::parse(bytes)?;
        let shared = Arc::new(Shared {
            pools: cfg
                .filter
                .pools
                .iter()
                .map(|_| Default::default())
                .collect(),
            ..Default::default()
        });
        let core_names = CoreCounters::default().iter().map(|(name, _)| name);
        let counters = Counters {
            // Id 0 (never counted) for the ones not exported (`Counters::exported`).
            core: core_names.map(|n| {
                if CoreCounters::exported(n) {
                    handle.define_counter(&format!("ailb.{n}"))
                } else {
                    0
                }
            }),
            stream_opens: handle.define_counter("ailb.stream.opens"),
            stream_failures: handle.define_counter("ailb.stream.failures"),
            stream_closes: handle.define_counter("ailb.stream.closes"),
            state_busy: handle.define_counter("ailb.state_busy"),
            breaker_opened: TripReason::ALL
                .map(|r| handle.define_counter(&format!("ailb.breaker_opened.{}", r.as_str()))),
            breaker_half_opened: handle.define_counter("ailb.breaker_half_opened"),
            breaker_closed: handle.define_counter("ailb.breaker_closed"),
            picks: handle.define_labeled_counter("ailb.endpoint.picks", "ailb_endpoint"),
            failures: handle.define_labeled_counter("ailb.endpoint.failures", "ailb_endpoint"),
            score: handle.define_labeled_gauge("ailb.endpoint.score", "ailb_endpoint"),
            breaker_state: handle
                .define_labeled_gauge("ailb.endpoint.breaker_state", "ailb_endpoint"),
            gpu_signal: handle.define_labeled_gauge("ailb.endpoint.gpu_signal", "ailb_endpoint"),
            metrics_age_ms: handle
                .define_labeled_gauge("ailb.endpoint.metrics_age_ms", "ailb_endpoint"),
            version: VersionCounts::default().iter().map(|(n, _)| {
                handle.define_labeled_counter(&format!("ailb.version.{n}"), "ailb_version")
            }),
            version_state: handle.define_labeled_gauge("ailb.version.domain_state", "ailb_version"),
            guard: match cfg.filter.mode {
                Mode::Guard => GuardCount::ALL.map(|c| handle.define_counter(c.name())),
                Mode::Route => [0; GuardCount::ALL.len()],
            },
            learned: match cfg.filter.learned_weights {
                Some(_) => cfg
                    .filter
                    .pools
                    .iter()
                    .map(|p| {
                        ai_lb_filter_core::learned::WEIGHT_NAMES.map(|n| {
                            handle.define_gauge(&format!("ailb.pool.{}.learned.{n}", p.name))
                        })
                    })
                    .collect(),
                None => Vec::new(),
            },
        };
        // Guard mode judges requests against the local pod and does nothing else (the wasm
        // filter's guard neither routes nor admits by tenant).
        let guard = (cfg.filter.mode == Mode::Guard).then(|| {
            cfg.filter
                .admission
                .as_ref()
                .map(|a| a.guard)
                .unwrap_or_default()
        });
        let routes = guard.is_none();
        let admission_on = routes && cfg.filter.admission.as_ref().is_some_and(|a| a.enabled);
        let adm_ids = admission_on.then(|| AdmissionIds::define(handle));
        // Held requests are judged as often as the wasm filter's root ticks while it holds.
        let tick_ms = cfg.filter.watch.refresh_ms.clamp(10, 100);
        let hold_on = routes && cfg.filter.big_request_hold.is_some();
        let hold_ids = hold_on.then(|| HoldIds::define(handle));
        let held = match admission_on || hold_on {
            true => Some(HeldWake::start(std::time::Duration::from_millis(tick_ms))?),
            false => None,
        };
        let probes =
            (routes && cfg.filter.synthetic_probe.is_some()).then(crate::probes::Probes::default);
        let main_tick = match (routes, &probes) {
            (false, _) => None,
            // Probes are sent on the tick: without one they could not be.
            (true, Some(_)) => Some(MainTick::start(
                handle,
                std::time::Duration::from_millis(tick_ms),
            )?),
            (true, None) => match MainTick::start(handle, main_tick::GAUGE_PERIOD) {
                Ok(t) => Some(t),
                Err(e) => {
                    host::log(
                        Level::Warn,
                        &format!("{e}; the per-pod gauges are set by requests only"),
                    );
                    None
                }
            },
        };
        let feed = feed::start(&cfg.filter, &cfg.agents, Arc::clone(&shared))?;
        Ok(ConfigRt {
            id: NEXT.fetch_add(1, Ordering::Relaxed),
            breakers: Arc::new(SharedBreakers::new(cfg.filter.pools.len())),
            cfg,
            shared,
            counters,
            adm_ids,
            hold_ids,
            guard,
            buckets: Arc::new(MemoryStore::new()),
            held,
            probes,
            main_tick,
            tick_ms,
            gauges_due_ms: AtomicU64::new(0),
            learned_due_ms: AtomicU64::new(0),
            alive: Arc::new(()),
            _feed: feed,
        })
    }
}

/// A worker thread's routing state for one config (the main thread keeps one too, for its
/// tick: [`crate::main_tick`]).
pub(crate) struct Worker {
    config_id: u64,
    alive: std::sync::Weak<()>,
    /// The feed's published pool states.
    shared: Arc<Shared>,
    router: Router,
    rng: SmallRng,
    /// Per pool: the published version installed here.
    seen: Vec<u64>,
    breakers: WorkerBreakers,
    scratch: String,
    /// Reused buffers for keying prompts (`prefixAffinity`).
    prompt_ids: Vec<u32>,
    key_scratch: Vec<u64>,
    next_tick_ms: u64,
    /// This worker's number in the process (the status page says which worker answered).
    ordinal: u64,
    stats: WorkerStats,
    /// The core's counters as last added to Envoy's (exported as deltas after each event).
    core_seen: [u64; CORE_COUNTERS],
    /// When this worker next adds its pending per-pod counts to Envoy's counters (ms).
    flush_due_ms: u64,
    /// `versions`: the per-version counts as last added to Envoy's, and when next (ms).
    versions_seen: HashMap<String, VersionCounts>,
    versions_due_ms: u64,
    /// Admission (None: off): its config, tenants and held queue in this worker.
    admission: Option<AdmissionRt>,
    adm_stats: AdmTally,
    buckets: Arc<MemoryStore>,
    /// Big requests waiting in this worker (`bigRequestHold`).
    big_hold: BigHold,
    hold_stats: HoldTally,
}

/// The number of the core's counters ([`ai_lb_filter_core::Counters::iter`]).
const CORE_COUNTERS: usize = CoreCounters::COUNT;

/// This worker's side of the shared breakers: the pools' epochs it copied, and the cooldown
/// jitter of the breakers it creates (see `Breaker::with_jitter`: random, so sidecars that
/// open a pod's breaker on the same agent snapshot probe it at different moments).
struct WorkerBreakers {
    shared: Arc<SharedBreakers>,
    /// Per pool: the shared breakers' epoch copied here (0: copy at the next refresh).
    seen: Vec<u64>,
    jitter: u8,
}

impl BreakerStore for WorkerBreakers {
    fn sync(&mut self, router: &mut Router, pool: usize, _now: u64) {
        if let Some(seen) = self.seen.get_mut(pool) {
            self.shared.sync(router, pool, seen);
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
        self.shared
            .update(router, pool, pod, now, self.jitter, |b| update(b))
            .map(|w| w.transitions)
    }
}

/// What the lifecycle counted on this worker and Envoy's counters do not have yet.
#[derive(Default)]
struct WorkerStats {
    /// Per pod: picks and failures not yet added to Envoy's labelled counters. A labelled
    /// increment has Envoy encode the label into its symbol table (a lock and an allocation),
    /// so the request path only counts here and [`flush_counts`] adds them once a second.
    pending: HashMap<String, [u64; 2]>,
    /// Breaker transitions this worker wrote, counted after the event (opens by reason).
    transitions: Vec<BreakerState>,
    opened: Vec<Option<TripReason>>,
}

impl WorkerStats {
    fn count(&mut self, pod: &str, which: usize) {
        if let Some(c) = self.pending.get_mut(pod) {
            c[which] += 1;
        } else {
            let mut c = [0; 2];
            c[which] = 1;
            self.pending.insert(pod.to_string(), c);
        }
    }
}

impl Stats for WorkerStats {
    fn picked(&mut self, pod: &str) {
        self.count(pod, 0);
    }
    fn failed(&mut self, pod: &str) {
        self.count(pod, 1);
    }
    fn transitions(&mut self, _pod: &str, ts: &[Transition]) {
        self.transitions.extend(ts.iter().map(|t| t.to));
        self.opened.extend(
            ts.iter()
                .filter(|t| t.to == BreakerState::Open)
                .map(|t| t.reason),
        );
    }
}

impl lifecycle::Worker for Worker {
    /// Installs pool `pool`'s published state when its version moved, then the other
    /// workers' breaker changes; polls breakers and staleness every 100 ms of requests.
    fn refresh(&mut self, pool: usize, now: u64) {
        if let (Some(slot), Some(seen)) = (self.shared.pools.get(pool), self.seen.get_mut(pool)) {
            if slot.version.load(Ordering::Acquire) != *seen {
                let (v, bytes) = slot.read();
                *seen = v;
                // A state that does not decode is counted by the router (pool_decode_errors).
                let _ = self.router.set_pool_state_bytes(pool, &bytes, now);
                // Pods new to this worker get their shared breakers too.
                if let Some(b) = self.breakers.seen.get_mut(pool) {
                    *b = 0;
                }
            }
        }
        self.breakers.sync(&mut self.router, pool, now);
        if now >= self.next_tick_ms {
            self.next_tick_ms = now + 100;
            self.router.tick(now);
        }
    }

    fn parts(&mut self) -> Parts<'_> {
        Parts {
            router: &mut self.router,
            rng: &mut self.rng,
            scratch: &mut self.scratch,
            prompt_ids: &mut self.prompt_ids,
            key_scratch: &mut self.key_scratch,
            breakers: &mut self.breakers,
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

impl HoldWorker for Worker {
    fn hold_parts(&mut self) -> HoldParts<'_> {
        HoldParts {
            hold: &mut self.big_hold,
            router: &mut self.router,
            stats: &mut self.hold_stats,
        }
    }
}

impl AdmissionWorker for Worker {
    fn admission(&mut self) -> Option<AdmissionParts<'_>> {
        let rt = self.admission.as_mut()?;
        Some(AdmissionParts {
            rt,
            router: &mut self.router,
            stats: &mut self.adm_stats,
            store: &*self.buckets,
        })
    }
}

impl Worker {
    /// Adds what the last event counted to Envoy's counters: admission's and the hold's, the
    /// counts of [`Worker::export_counts`], and once a second the per-version counts.
    fn export(&mut self, rt: &ConfigRt, s: &Stream) {
        let c = &rt.counters;
        if let Some(ids) = &rt.adm_ids {
            self.adm_stats.flush(ids, s);
        }
        if let Some(ids) = &rt.hold_ids {
            self.hold_stats.flush(ids, s);
        }
        self.export_counts(rt, s);
        let now = now_ms();
        if self.router.config().versions.is_some() && now >= self.versions_due_ms {
            self.versions_due_ms = now + 1000;
            for (version, counts, state) in self.router.version_totals() {
                let last = self
                    .versions_seen
                    .get(&version)
                    .copied()
                    .unwrap_or_default();
                let pairs = counts.iter().into_iter().zip(last.iter());
                for (id, ((_, v), (_, old))) in c.version.iter().zip(pairs) {
                    if v > old {
                        s.inc_labeled(*id, &version, v - old);
                    }
                }
                s.set_labeled(c.version_state, &version, state.gauge_value());
                self.versions_seen.insert(version, counts);
            }
        }
    }

    /// Adds to `s` (a stream, or the config on the main thread) the core's counters (deltas;
    /// `ailb.<name>`, the wasm filter's names), the breaker transitions this worker wrote, what
    /// the feed threads counted, and once a second the per-pod picks and failures.
    pub(crate) fn export_counts(&mut self, rt: &ConfigRt, s: &impl StatSink) {
        let c = &rt.counters;
        for (i, (_, v)) in self.router.counters().iter().iter().enumerate() {
            let (Some(seen), Some(id)) = (self.core_seen.get_mut(i), c.core.get(i)) else {
                continue;
            };
            if *v > *seen {
                s.inc(*id, *v - *seen);
                *seen = *v;
            }
        }
        for to in self.stats.transitions.drain(..) {
            let id = match to {
                BreakerState::Open => continue,
                BreakerState::HalfOpen => c.breaker_half_opened,
                BreakerState::Closed => c.breaker_closed,
            };
            s.inc(id, 1);
        }
        for reason in self.stats.opened.drain(..) {
            let id = TripReason::ALL
                .iter()
                .position(|r| Some(*r) == reason)
                .and_then(|i| c.breaker_opened.get(i).copied())
                .unwrap_or(0);
            s.inc(id, 1);
        }
        // What the feed threads counted applying the agents' events (pool events, rejected
        // snapshots, signal issues, hardware faults, model servers down: counted where events
        // are applied, as the wasm filter's subscribing VM does), since any worker last
        // exported.
        let sh = &rt.shared;
        for (tally, id) in sh.feed_counters.iter().zip(c.core) {
            let n = tally.take_new();
            if n > 0 {
                s.inc(id, n);
            }
        }
        export_feed_tallies(rt, s);
        let now = now_ms();
        if now < self.flush_due_ms || self.stats.pending.is_empty() {
            return;
        }
        self.flush_due_ms = now + 1000;
        for (pod, [picks, failures]) in self.stats.pending.drain() {
            s.inc_labeled(c.picks, &pod, picks);
            s.inc_labeled(c.failures, &pod, failures);
        }
    }
}

/// Numbers the workers of the process, in order of their first request.
static ORDINALS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

thread_local! {
    static WORKERS: RefCell<Vec<Worker>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` on this thread's worker for `rt` (created at the thread's first request). None
/// when this thread's workers are already in use (a re-entered hook).
pub(crate) fn with_worker<R>(rt: &ConfigRt, f: impl FnOnce(&mut Worker) -> R) -> Option<R> {
    WORKERS.with(|w| {
        let mut ws = w.try_borrow_mut().ok()?;
        let i = match ws.iter().position(|w| w.config_id == rt.id) {
            Some(i) => i,
            None => {
                ws.retain(|w| w.alive.strong_count() > 0);
                let seed = now_ms() ^ (ws.len() as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
                let jitter = (seed.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 56) as u8;
                let pools = rt.cfg.filter.pools.len();
                ws.push(Worker {
                    config_id: rt.id,
                    alive: Arc::downgrade(&rt.alive),
                    shared: Arc::clone(&rt.shared),
                    router: Router::new(rt.cfg.filter.clone()),
                    rng: SmallRng::seed_from_u64(seed),
                    seen: vec![0; pools],
                    breakers: WorkerBreakers {
                        shared: Arc::clone(&rt.breakers),
                        seen: vec![0; pools],
                        jitter,
                    },
                    scratch: String::with_capacity(256),
                    prompt_ids: Vec::new(),
                    key_scratch: Vec::new(),
                    next_tick_ms: 0,
                    ordinal: ORDINALS.fetch_add(1, Ordering::Relaxed),
                    stats: WorkerStats::default(),
                    core_seen: [0; CORE_COUNTERS],
                    flush_due_ms: 0,
                    versions_seen: HashMap::new(),
                    versions_due_ms: 0,
                    admission: rt
                        .cfg
                        .filter
                        .admission
                        .clone()
                        .filter(|a| a.enabled)
                        .map(AdmissionRt::new),
                    adm_stats: AdmTally::default(),
                    buckets: Arc::clone(&rt.buckets),
                    big_hold: BigHold::default(),
                    hold_stats: HoldTally::default(),
                });
                ws.len() - 1
            }
        };
        ws.get_mut(i).map(f)
    })
}

/// Whether the once-a-second export `due` is this caller's to do (it moves `due` a second on).
fn take_due(due: &AtomicU64, now: u64) -> bool {
    let d = due.load(Ordering::Relaxed);
    now >= d
        && due
            .compare_exchange(d, now + 1000, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
}

/// Sets the per-pod gauges from this thread's worker, at most once a second for the whole
/// process: on the main thread's tick ([`crate::main_tick`]), or, when Envoy gave no scheduler
/// for one, the first request routed after the second is up. The worker re-reads the shared
/// pool states first (on the main thread no request does); scores and metrics ages are alike
/// on every worker, breakers are shared. Pods that left keep their last values (Envoy keeps
/// the stats), as with the wasm filter.
pub(crate) fn export_pod_gauges(rt: &ConfigRt, s: &impl StatSink, now: u64) {
    if !take_due(&rt.gauges_due_ms, now) {
        return;
    }
    let rows = with_worker(rt, |w| {
        for pool in 0..w.router.pool_count() {
            lifecycle::Worker::refresh(w, pool, now);
        }
        (0..w.router.pool_count())
            .flat_map(|i| w.router.pod_status(i, now))
            .map(|r| {
                (
                    r.address.to_string(),
                    r.score_gauge_value(),
                    r.breaker.gauge_value(),
                    r.metrics_age_ms,
                    r.gpu_signal_gauge_value(),
                )
            })
            .collect::<Vec<_>>()
    })
    .unwrap_or_default();
    let c = &rt.counters;
    for (pod, score, breaker, age, gpu_signal) in &rows {
        s.set_labeled(c.score, pod, *score);
        s.set_labeled(c.breaker_state, pod, *breaker);
        s.set_labeled(c.gpu_signal, pod, *gpu_signal);
        if let Some(age) = age {
            s.set_labeled(c.metrics_age_ms, pod, *age);
        }
    }
}

/// Sets the learned-weight gauges (`learnedWeights` on) at most once a second for the whole
/// process, from the model of the worker whose request finds them due; a model that has not
/// trained (that worker steered nothing yet) leaves them as another worker last set them. On
/// a request: the main thread's worker steers nothing, so its model never trains.
fn export_learned_gauges(rt: &ConfigRt, s: &Stream, now: u64) {
    if rt.cfg.filter.learned_weights.is_none() || !take_due(&rt.learned_due_ms, now) {
        return;
    }
    let learned = with_worker(rt, |w| {
        (0..w.router.pool_count())
            .map(|i| {
                w.router
                    .learned_model(i)
                    .filter(|m| m.updates() > 0)
                    .map(|m| m.gauges().map(|(_, v)| v).collect::<Vec<_>>())
            })
            .collect::<Vec<_>>()
    })
    .unwrap_or_default();
    for (ids, vals) in rt.counters.learned.iter().zip(&learned) {
        for (id, v) in ids.iter().zip(vals.iter().flatten()) {
            s.set_gauge(*id, *v);
        }
    }
}

/// One request: the core's [`Exchange`], driven from Envoy's hooks.
#[derive(Debug)]
pub struct Request {
    rt: *const ConfigRt,
    ex: Exchange,
    /// Admission and the big-request hold (the core's gate; lets everything through when
    /// both are off).
    gate: FilterGate,
    /// Held, and woken every tick by the config's [`HeldWake`].
    registered: bool,
}

/// Numbers requests for the workers' held queues (unique among those waiting at once).
static REQUEST_IDS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);

/// What a request-body hook tells Envoy.
#[derive(Debug, PartialEq, Eq)]
pub enum BodyNext {
    Continue,
    /// Buffer with flow control and call again (the body is still being read).
    Wait,
    /// The request was answered locally: keep the body back.
    Stop,
}

/// What a headers hook tells Envoy.
#[derive(Debug, PartialEq, Eq)]
pub enum Next {
    Continue,
    /// Wait for the body (buffered by Envoy).
    StopAndBuffer,
    /// A local reply was sent.
    Replied,
}

/// The proxy as the core sees it, for one hook of one stream.
struct NativeHost<'a> {
    s: &'a Stream,
    steering: Steering,
}

impl Host for NativeHost<'_> {
    fn now_ms(&self) -> u64 {
        now_ms()
    }
    fn request_header(&self, name: &str) -> Option<Cow<'_, str>> {
        self.s.header_str(Map::Request, name).map(Cow::Borrowed)
    }
    fn set_request_header(&mut self, name: &str, value: Option<&str>) -> bool {
        self.s.set_header(Map::Request, name, value)
    }
    fn response_header(&self, name: &str) -> Option<Cow<'_, str>> {
        self.s.header_str(Map::Response, name).map(Cow::Borrowed)
    }
    fn set_response_header(&mut self, name: &str, value: &str) {
        self.s.set_header(Map::Response, name, Some(value));
    }
    fn send_local_reply(&mut self, status: u16, headers: &[(&str, &str)], body: &[u8]) {
        self.s.send_response(u32::from(status), headers, body);
    }
    fn cluster_name(&self) -> Option<Cow<'_, str>> {
        self.s.cluster_name().map(Cow::Borrowed)
    }
    fn upstream_address(&self) -> Option<Cow<'_, str>> {
        self.s.upstream_address().map(Cow::Borrowed)
    }
    fn response_code(&self) -> Option<u16> {
        self.s.response_code()
    }
    /// The ABI gives no response flags; the code details carry the same facts.
    fn response_flags(&self) -> u64 {
        0
    }
    fn response_code_details(&self) -> Option<Cow<'_, str>> {
        self.s.response_code_details().map(Cow::Borrowed)
    }
    fn steer(&mut self, routing_header: &str, ranked: &str) -> bool {
        let chosen = ranked.split(',').next().unwrap_or("");
        if self.steering.header() {
            let ok = self
                .s
                .set_header(Map::Request, routing_header, Some(ranked));
            // With both, the header steers whatever the override call says.
            if ok && self.steering.override_host() {
                self.s.set_upstream_override_host(chosen);
            }
            ok
        } else {
            self.s.set_upstream_override_host(chosen)
        }
    }
    fn warn(&mut self, msg: &str) {
        host::log(Level::Warn, msg);
    }
    fn retries_follow_ranked(&self) -> bool {
        // The routing header's list serves retries; the override host alone leaves them to
        // the cluster's own balancer.
        self.steering.header()
    }
    fn peer_principal(&self) -> Option<Cow<'_, str>> {
        self.s.peer_uri_san().map(Cow::Borrowed)
    }
    fn set_hits_addend(&mut self, n: u64) -> bool {
        self.s
            .set_filter_state_typed("envoy.ratelimit.hits_addend", &n.to_string())
    }
    fn response_chunk(&self, _size: usize) -> Option<Vec<u8>> {
        Some(self.s.response_chunk())
    }
}

impl Request {
    pub fn new(rt: *const ConfigRt) -> Self {
        let id = REQUEST_IDS.fetch_add(1, Ordering::Relaxed);
        Request {
            rt,
            ex: Exchange::new(),
            gate: FilterGate::new(id),
            registered: false,
        }
    }

    /// The config this request belongs to. Envoy keeps a filter's config alive for as long as
    /// any of its streams exists, so the reference does not borrow the request.
    fn rt<'a>(&self) -> Option<&'a ConfigRt> {
        #[allow(unsafe_code)]
        // SAFETY: set from the config pointer Envoy passed to `on_http_filter_new`; Envoy keeps
        // that config until its streams are destroyed.
        unsafe {
            self.rt.as_ref()
        }
    }

    /// Runs one lifecycle event on this thread's worker, then exports what it counted.
    fn event<R>(
        &mut self,
        s: &Stream,
        f: impl FnOnce(&mut Exchange, &mut NativeHost<'_>, &mut Worker, &mut FilterGate) -> R,
    ) -> Option<R> {
        let rt = self.rt()?;
        let mut host = NativeHost {
            s,
            steering: rt.cfg.steering,
        };
        let (ex, gate) = (&mut self.ex, &mut self.gate);
        let out = with_worker(rt, |w| {
            let out = f(ex, &mut host, w, gate);
            // A pool state installed by the event may carry agent-reported trips.
            lifecycle::carry_signal_trips(&mut host, w, now_ms());
            w.export(rt, s);
            out
        });
        if out.is_none() {
            // This thread's workers are in use (a hook re-entered): counted, never silent.
            rt.shared.busy.add(1);
        }
        out
    }

    pub fn on_request_headers(&mut self, s: &Stream, end_of_stream: bool) -> Next {
        if let Some(rt) = self.rt() {
            if let Some(cfg) = &rt.guard {
                return guard_headers(rt, cfg, s);
            }
        }
        let next = self
            .event(s, |ex, h, w, g| {
                ex.on_request_headers(h, w, g, end_of_stream)
            })
            .unwrap_or(LifeNext::Continue);
        if let Some(rt) = self.rt() {
            let now = now_ms();
            if rt.main_tick.is_none() {
                export_pod_gauges(rt, s, now);
            }
            export_learned_gauges(rt, s, now);
        }
        self.wake_if_held(s);
        match next {
            LifeNext::Continue => Next::Continue,
            LifeNext::StopForBody => Next::StopAndBuffer,
            LifeNext::Stop => Next::Replied,
        }
    }

    /// A request-body chunk; true when the filter still waits for more (Envoy buffers). The
    /// body is held back only up to `maxBodyReadBytes`: past that its first bytes are read and
    /// the rest streams (waiting for the end would make Envoy answer 413 at its limit).
    pub fn on_request_body(&mut self, s: &Stream, end_of_stream: bool) -> BodyNext {
        if !self.ex.waiting_body() {
            return BodyNext::Continue;
        }
        // Envoy buffers with flow control here (StopIterationAndWatermark, see lib.rs).
        if !end_of_stream && self.ex.wants_more_body(s.request_body_len(), true) {
            return BodyNext::Wait;
        }
        match self.body_done(s, true, end_of_stream) {
            LifeNext::Stop => BodyNext::Stop,
            LifeNext::Continue | LifeNext::StopForBody => BodyNext::Continue,
        }
    }

    /// Trailers: the body ended without end_of_stream. True when the request stops here
    /// (answered locally).
    pub fn on_request_trailers(&mut self, s: &Stream) -> bool {
        self.ex.waiting_body() && self.body_done(s, false, true) == LifeNext::Stop
    }

    /// The body is here, whole or up to `maxBodyReadBytes` (`in_hook`: the last chunk is the
    /// current body hook's).
    fn body_done(&mut self, s: &Stream, in_hook: bool, ended: bool) -> LifeNext {
        let cap = self.ex.body_read_limit();
        let mut body = s.request_body(in_hook);
        let complete = ended && body.len() <= cap;
        body.truncate(cap);
        let next = self
            .event(s, |ex, h, w, g| {
                ex.on_request_body(h, w, g, &body, complete)
            })
            .unwrap_or(LifeNext::Continue);
        self.wake_if_held(s);
        next
    }

    /// A request the gate just held is woken every tick from now on ([`crate::held`]).
    fn wake_if_held(&mut self, s: &Stream) {
        let Some(wake) = self.rt().and_then(|rt| rt.held.as_ref()) else {
            return;
        };
        let held = self.gate.adm.held() || self.gate.hold.held();
        if !held || self.registered {
            return;
        }
        if let Some(sched) = s.scheduler() {
            wake.hold(self.gate.id(), sched);
            self.registered = true;
        } else {
            host::log(
                Level::Warn,
                "ai-lb native: no scheduler for a held request; it waits for its client",
            );
        }
    }

    /// A held request's tick: the core's `wake_held` on this stream (the worker's held queue
    /// expires and releases; this request is answered 503, routed and resumed, or waits on).
    pub fn on_scheduled(&mut self, s: &Stream) {
        let Some(rt) = self.rt().filter(|_| self.registered) else {
            return;
        };
        let (id, tick) = (self.gate.id(), rt.tick_ms);
        let by_priority = self.gate.adm.held();
        let woken = self
            .event(s, |_, h, w, _| match by_priority {
                true => admission::wake_held(h, w, id, now_ms(), tick),
                false => hold::wake_big_held(h, w, id, now_ms(), tick),
            })
            .unwrap_or(Woken::Waiting);
        if woken == Woken::Waiting {
            return;
        }
        self.forget_held();
        if woken == Woken::Released {
            s.continue_decoding();
        }
    }

    /// Stops waking this request (deletes its scheduler).
    fn forget_held(&mut self) {
        if std::mem::take(&mut self.registered) {
            if let Some(wake) = self.rt().and_then(|rt| rt.held.as_ref()) {
                wake.forget(self.gate.id());
            }
        }
    }

    pub fn on_response_headers(&mut self, s: &Stream, end_of_stream: bool) {
        if self.ex.pool().is_none() {
            return;
        }
        self.event(s, |ex, h, w, g| {
            ex.on_response_headers(h, w, g, end_of_stream)
        });
    }

    /// A response-body chunk: the first one is the time to first byte, and passes a probe
    /// whose answer started well.
    pub fn on_response_body(&mut self, s: &Stream, end_of_stream: bool) {
        if self.ex.pool().is_none() {
            return;
        }
        self.event(s, |ex, h, w, g| {
            ex.on_response_body(h, w, g, 0, end_of_stream)
        });
    }

    /// The request is over: close the pick and tell the breakers how it went.
    pub fn on_stream_complete(&mut self, s: &Stream) {
        self.forget_held();
        if self.rt().is_some_and(|rt| rt.guard.is_some()) {
            return;
        }
        self.event(s, |ex, h, w, g| ex.on_end(h, w, g));
    }
}

/// Adds to Envoy's counters what the feed thread and busy hooks counted since any worker last
/// did: the agent streams' opens, failures and closes, and hooks that found their worker busy.
fn export_feed_tallies(rt: &ConfigRt, s: &impl StatSink) {
    let (sh, c) = (&rt.shared, &rt.counters);
    for (tally, id) in [
        (&sh.busy, c.state_busy),
        (&sh.stream_opens, c.stream_opens),
        (&sh.stream_failures, c.stream_failures),
        (&sh.stream_closes, c.stream_closes),
    ] {
        let n = tally.take_new();
        if n > 0 {
            s.inc(id, n);
        }
    }
}

/// Guard mode: one request judged against the local pod's signals (the core decides, counts
/// and answers the 503); the feed's stream counters are exported here, since no worker runs.
fn guard_headers(rt: &ConfigRt, cfg: &GuardConfig, s: &Stream) -> Next {
    let mut host = NativeHost {
        s,
        steering: rt.cfg.steering,
    };
    let signals = rt.shared.local_signals();
    let next = guard_request(&mut host, cfg, signals, now_ms(), &mut |c| {
        if let Some(id) = rt.counters.guard.get(c.index()) {
            s.inc(*id, 1);
        }
    });
    export_feed_tallies(rt, s);
    match next {
        LifeNext::Continue | LifeNext::StopForBody => Next::Continue,
        LifeNext::Stop => Next::Replied,
    }
}

impl Drop for Request {
    /// A stream destroyed while held (no completion seen) leaves the registry too.
    fn drop(&mut self) {
        self.forget_held();
    }
}
