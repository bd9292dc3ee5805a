//! The sampler decides what the pod's current snapshot is: it runs every configured source at the
//! sample interval (time from an injected clock), merges their readings into one `PodSnapshot`
//! with per-source health, publishes it by swapping an `Arc` (readers never block the sampler),
//! and wakes watchers only when the change is meaningful (a pure function, [`meaningful_change`]).

use crate::kv_events::KvFeed;
use crate::sources::{Reading, Source};
use ai_lb_proto::v1::{
    Engine, GpuStats, InferenceStats, ModelInfo, PodIdentity, PodSnapshot, SourceState,
    SourceStatus,
};
use arc_swap::ArcSwapOption;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::watch;

/// Time as the agent sees it: monotonic for ages and windows, wall clock for display only.
pub trait Clock: Send + Sync + 'static {
    fn now(&self) -> Instant;
    fn unix_ms(&self) -> u64;
}

/// The process clocks.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
    fn unix_ms(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0)
    }
}

/// A random id for this agent process, so receivers can tell restarts apart.
pub fn new_agent_instance() -> String {
    format!("{:016x}", rand::random::<u64>())
}

/// Who the pod is, from configuration; the model server's reading may refine engine and models.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct IdentityConfig {
    pub pod_name: String,
    pub namespace: String,
    /// `IP:PORT` Envoy routes to.
    pub address: String,
    /// Configured engine; `Unspecified` when auto-detected.
    pub engine: Engine,
    pub models: Vec<String>,
    /// Configured queue capacity; wins over the model server's when set.
    pub queue_capacity: Option<u32>,
    /// Configured KV-cache capacity in tokens; wins over the model server's when set.
    pub kv_capacity_tokens: Option<u64>,
}

/// One published sample. `snapshot.age_ms` is 0 and `last_success_age_ms` are relative to
/// `taken`; [`Published::render`] turns them into ages at send time.
#[derive(Debug, Clone)]
pub struct Published {
    pub snapshot: PodSnapshot,
    pub taken: Instant,
}

impl Published {
    /// The snapshot as sent at `now`: every age grown by the time since the sample.
    pub fn render(&self, now: Instant) -> PodSnapshot {
        let since = now.saturating_duration_since(self.taken).as_millis() as u64;
        let mut s = self.snapshot.clone();
        s.age_ms = s.age_ms.saturating_add(since);
        for src in &mut s.sources {
            if let Some(a) = src.last_success_age_ms.as_mut() {
                *a = a.saturating_add(since);
            }
        }
        s
    }
}

/// Where the latest snapshot lives, with its change notifications and counters.
#[derive(Debug)]
pub struct Hub {
    latest: ArcSwapOption<Published>,
    /// Bumped on every meaningful change (and on the first sample).
    changes: watch::Sender<u64>,
    /// Bumped on every urgent change (see [`urgent_change`]): streams push it without waiting
    /// out their coalescing interval.
    urgent: watch::Sender<u64>,
    samples: AtomicU64,
    rejected: Mutex<BTreeMap<(String, String), u64>>,
    instance: String,
}

impl Hub {
    pub fn new(instance: String) -> Arc<Hub> {
        Arc::new(Hub {
            latest: ArcSwapOption::const_empty(),
            changes: watch::channel(0).0,
            urgent: watch::channel(0).0,
            samples: AtomicU64::new(0),
            rejected: Mutex::new(BTreeMap::new()),
            instance,
        })
    }

    pub fn agent_instance(&self) -> &str {
        &self.instance
    }

    /// The latest sample, if one was taken.
    pub fn latest(&self) -> Option<Arc<Published>> {
        self.latest.load_full()
    }

    /// A receiver that wakes on every meaningful change.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// A receiver that wakes on every urgent change.
    pub fn subscribe_urgent(&self) -> watch::Receiver<u64> {
        self.urgent.subscribe()
    }

    /// Urgent changes published so far.
    pub fn urgent_changes(&self) -> u64 {
        *self.urgent.borrow()
    }

    pub fn samples_taken(&self) -> u64 {
        self.samples.load(Ordering::Relaxed)
    }

    /// Rejected values so far, by (source, field).
    pub fn rejected_counts(&self) -> Vec<((String, String), u64)> {
        match self.rejected.lock() {
            Ok(m) => m.iter().map(|(k, v)| (k.clone(), *v)).collect(),
            Err(p) => p.get_ref().iter().map(|(k, v)| (k.clone(), *v)).collect(),
        }
    }

    /// Stores a sample; watchers are woken only when `meaningful`, and told to skip their
    /// coalescing when `urgent` (an urgent change is always meaningful).
    pub fn publish(&self, p: Arc<Published>, meaningful: bool, urgent: bool) {
        self.latest.store(Some(p));
        self.samples.fetch_add(1, Ordering::Relaxed);
        if urgent {
            self.urgent.send_modify(|v| *v += 1);
        }
        if meaningful || urgent {
            self.changes.send_modify(|v| *v += 1);
        }
    }

    fn count_rejected(&self, source: &str, field: &str) {
        let mut m = match self.rejected.lock() {
            Ok(m) => m,
            Err(p) => p.into_inner(),
        };
        *m.entry((source.to_string(), field.to_string()))
            .or_insert(0) += 1;
    }

    /// Waits until the first sample is published.
    pub async fn first_sample(&self) {
        let mut rx = self.subscribe();
        while self.latest().is_none() {
            if rx.changed().await.is_err() {
                return;
            }
        }
    }
}

/// The health record of one configured source.
#[derive(Debug, Clone, PartialEq)]
pub struct SourceTrack {
    pub name: &'static str,
    pub last_success: Option<Instant>,
    pub consecutive_failures: u64,
    /// Last error text while failing; empty when fresh.
    pub reason: String,
    /// Never sampled yet.
    pub pending: bool,
}

impl SourceTrack {
    pub fn new(name: &'static str) -> SourceTrack {
        SourceTrack {
            name,
            last_success: None,
            consecutive_failures: 0,
            reason: String::new(),
            pending: true,
        }
    }

    /// Applies one sample outcome at `now`.
    pub fn record(&mut self, outcome: &Result<Reading, String>, now: Instant) {
        self.pending = false;
        match outcome {
            Ok(_) => {
                self.last_success = Some(now);
                self.consecutive_failures = 0;
                self.reason.clear();
            }
            Err(e) => {
                self.consecutive_failures += 1;
                self.reason = e.clone();
            }
        }
    }

    fn status(&self, now: Instant) -> SourceStatus {
        let state = if self.pending || self.consecutive_failures > 0 {
            SourceState::Failing
        } else {
            SourceState::Fresh
        };
        SourceStatus {
            name: self.name.to_string(),
            state: state as i32,
            reason: if self.pending {
                "not sampled yet".into()
            } else {
                self.reason.clone()
            },
            last_success_age_ms: self
                .last_success
                .map(|t| now.saturating_duration_since(t).as_millis() as u64),
            consecutive_failures: self.consecutive_failures,
        }
    }
}

/// Merges one round of source outcomes into a snapshot (pure). `outcomes[i]` belongs to
/// `tracks[i]` (already updated with it); a failed source contributes nothing but its status.
#[allow(clippy::too_many_arguments)]
pub fn merge(
    identity: &IdentityConfig,
    tracks: &[SourceTrack],
    outcomes: &[Result<Reading, String>],
    absent: &[&'static str],
    now: Instant,
    unix_ms: u64,
    sequence: u64,
    agent_instance: &str,
) -> PodSnapshot {
    let mut gpus: Vec<GpuStats> = Vec::new();
    let mut inference: Option<InferenceStats> = None;
    let mut engine = identity.engine;
    let mut models: Vec<ModelInfo> = identity
        .models
        .iter()
        .map(|m| ModelInfo {
            name: m.clone(),
            ..ModelInfo::default()
        })
        .collect();
    for r in outcomes.iter().flatten() {
        if let Some(g) = &r.gpus {
            gpus.extend(g.iter().cloned());
        }
        if let Some(i) = &r.inference {
            inference = Some(*i);
        }
        if let Some(e) = r.engine {
            if e != Engine::Unspecified {
                engine = e;
            }
        }
        if let Some(m) = &r.models {
            if !m.is_empty() {
                models = m.clone();
            }
        }
    }
    if let Some(inf) = inference.as_mut() {
        if let Some(cap) = identity.queue_capacity {
            inf.queue_capacity = Some(cap);
        }
        if let Some(tokens) = identity.kv_capacity_tokens {
            inf.kv_capacity_tokens = Some(tokens);
        }
    }
    let mut sources: Vec<SourceStatus> = tracks.iter().map(|t| t.status(now)).collect();
    sources.extend(absent.iter().map(|n| SourceStatus {
        name: n.to_string(),
        state: SourceState::Absent as i32,
        reason: "not configured".into(),
        last_success_age_ms: None,
        consecutive_failures: 0,
    }));
    PodSnapshot {
        identity: Some(PodIdentity {
            pod_name: identity.pod_name.clone(),
            namespace: identity.namespace.clone(),
            address: identity.address.clone(),
            engine: engine as i32,
            models,
        }),
        gpus,
        inference,
        sources,
        sample_time_unix_ms: unix_ms,
        sequence,
        agent_instance: agent_instance.to_string(),
        age_ms: 0,
        // Filled by the sampler from the KV-event feed when one is configured.
        prefix_cache: None,
    }
}

/// How much a signal must move before watchers are woken.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Thresholds {
    /// Absolute change of a 0..1 ratio (GPU util, KV cache, error rate).
    pub ratio: f64,
    /// Relative change of a queue length (at least one request).
    pub queue_rel: f64,
    /// Relative change of a latency quantile.
    pub latency_rel: f64,
}

impl Default for Thresholds {
    fn default() -> Thresholds {
        Thresholds {
            ratio: 0.02,
            queue_rel: 0.05,
            latency_rel: 0.10,
        }
    }
}

fn moved_ratio(a: Option<f64>, b: Option<f64>, th: f64) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => (a - b).abs() > th,
        (None, None) => false,
        _ => true,
    }
}

fn moved_rel(a: Option<f64>, b: Option<f64>, rel: f64, min_abs: f64) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => (a - b).abs() >= (a.abs() * rel).max(min_abs),
        (None, None) => false,
        _ => true,
    }
}

/// Whether the GPU set changed (count, index, UUID), a GPU's throttle reasons or error
/// counters changed, or its utilisation, SM occupancy or memory fraction moved by more than
/// `ratio`. Shared
/// by [`meaningful_change`] and [`urgent_change`], which differ in the threshold.
fn gpus_moved(prev: &[GpuStats], next: &[GpuStats], ratio: f64) -> bool {
    let mem_frac = |g: &GpuStats| match (g.memory_used_bytes, g.memory_total_bytes) {
        (Some(u), Some(t)) if t > 0 => Some(u as f64 / t as f64),
        (Some(u), _) => Some(u as f64 / 1e12),
        _ => None,
    };
    prev.len() != next.len()
        || prev.iter().zip(next).any(|(a, b)| {
            a.index != b.index
                || a.uuid != b.uuid
                || moved_ratio(a.utilization, b.utilization, ratio)
                || moved_ratio(a.sm_occupancy, b.sm_occupancy, ratio)
                || moved_ratio(mem_frac(a), mem_frac(b), ratio)
                || a.throttle_reasons != b.throttle_reasons
                || a.ecc_uncorrected_errors != b.ecc_uncorrected_errors
                || a.xid_errors != b.xid_errors
                || a.last_xid != b.last_xid
        })
}

/// Whether `next` differs from `prev` (the last snapshot watchers were woken for) enough to push:
/// any source state/reason change, identity/engine/model change, GPU set or error counters,
/// any change of queue or KV-cache capacity, GPU utilisation / memory / KV / error rate beyond
/// `th.ratio`, queue or P99s beyond their relative thresholds.
pub fn meaningful_change(prev: &PodSnapshot, next: &PodSnapshot, th: &Thresholds) -> bool {
    if prev.identity != next.identity || prev.agent_instance != next.agent_instance {
        return true;
    }
    if prev.sources.len() != next.sources.len()
        || prev.sources.iter().zip(&next.sources).any(|(a, b)| {
            a.name != b.name
                || a.state != b.state
                || a.reason != b.reason
                || a.last_success_age_ms.is_some() != b.last_success_age_ms.is_some()
        })
    {
        return true;
    }
    if gpus_moved(&prev.gpus, &next.gpus, th.ratio) {
        return true;
    }
    // Any change of the cached set (or its model, block size, truncation) is worth a push,
    // never an urgent one: routing by prefix tolerates a coalescing interval of staleness.
    if prev.prefix_cache != next.prefix_cache {
        return true;
    }
    match (&prev.inference, &next.inference) {
        (None, None) => false,
        (Some(a), Some(b)) => {
            let f = |v: Option<u32>| v.map(f64::from);
            let p99 =
                |q: &Option<ai_lb_proto::v1::LatencyQuantiles>| q.as_ref().and_then(|q| q.p99_ms);
            moved_rel(f(a.waiting), f(b.waiting), th.queue_rel, 1.0)
                || moved_rel(f(a.running), f(b.running), th.queue_rel, 1.0)
                || a.queue_capacity != b.queue_capacity
                || a.kv_capacity_tokens != b.kv_capacity_tokens
                || moved_ratio(a.kv_cache_usage, b.kv_cache_usage, th.ratio)
                || moved_ratio(a.error_rate, b.error_rate, th.ratio)
                || moved_ratio(a.prefix_cache_hit_rate, b.prefix_cache_hit_rate, th.ratio)
                || moved_rel(p99(&a.ttft), p99(&b.ttft), th.latency_rel, 1.0)
                || moved_rel(p99(&a.e2e), p99(&b.e2e), th.latency_rel, 1.0)
                || moved_rel(
                    p99(&a.inter_token),
                    p99(&b.inter_token),
                    th.latency_rel,
                    1.0,
                )
        }
        _ => true,
    }
}

/// A jump of a 0..1 ratio (GPU utilisation, GPU memory, KV cache, error rate) at least this
/// large between two published snapshots is urgent.
pub const URGENT_RATIO: f64 = 0.10;

/// Whether `next` differs from `prev` (the last snapshot watchers were woken for) so much that
/// receivers should see it now rather than after the streams' coalescing interval
/// (`--watch-min-interval`): the pod restarted or changed identity, a source started or
/// stopped failing, the GPU set, throttling, ECC or Xid counters changed, a ratio jumped by
/// [`URGENT_RATIO`] or more, the queue filled up or drained from full, or the queue moved by
/// at least half of the larger length (and at least 4 requests), or a capacity changed. Gradual drift is left to
/// the normal coalescing: it is what that interval is for. Pure.
pub fn urgent_change(prev: &PodSnapshot, next: &PodSnapshot) -> bool {
    if prev.identity != next.identity || prev.agent_instance != next.agent_instance {
        return true;
    }
    if prev.sources.len() != next.sources.len()
        || prev
            .sources
            .iter()
            .zip(&next.sources)
            .any(|(a, b)| a.name != b.name || a.state != b.state)
    {
        return true;
    }
    let th = URGENT_RATIO - 1e-9;
    if gpus_moved(&prev.gpus, &next.gpus, th) {
        return true;
    }
    match (&prev.inference, &next.inference) {
        (None, None) => false,
        (Some(a), Some(b)) => {
            let full = |i: &InferenceStats| match (i.waiting, i.queue_capacity) {
                (Some(w), Some(c)) => Some(w >= c),
                _ => None,
            };
            let queue_jump = match (a.waiting, b.waiting) {
                (Some(x), Some(y)) => {
                    let (x, y) = (f64::from(x), f64::from(y));
                    (x - y).abs() >= (0.5 * x.max(y)).max(4.0)
                }
                (None, None) => false,
                _ => true,
            };
            full(a) != full(b)
                || queue_jump
                || a.queue_capacity != b.queue_capacity
                || a.kv_capacity_tokens != b.kv_capacity_tokens
                || moved_ratio(a.kv_cache_usage, b.kv_cache_usage, th)
                || moved_ratio(a.error_rate, b.error_rate, th)
        }
        _ => true,
    }
}

/// Resolves once `shutdown` turns true (or its sender is gone).
pub async fn stopped(shutdown: &mut watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|s| *s).await;
}

/// Runs the sources and publishes snapshots into a [`Hub`].
pub struct Sampler {
    sources: Vec<Box<dyn Source>>,
    /// Everything but the sources, so a snapshot can be published while a source is still
    /// being awaited (see [`Sampler::stall_after`]).
    out: Outbox,
    source_timeout: Duration,
    stall_after: Duration,
}

/// The sampler's publishing side: source health, last readings, sequence and change baseline.
struct Outbox {
    tracks: Vec<SourceTrack>,
    absent: Vec<&'static str>,
    identity: IdentityConfig,
    hub: Arc<Hub>,
    clock: Arc<dyn Clock>,
    sequence: u64,
    /// The snapshot watchers were last woken for.
    baseline: Option<PodSnapshot>,
    /// Each source's last outcome (`last[i]` belongs to `sources[i]`), merged into every
    /// snapshot, so a local-only sample keeps the model server's last reading.
    last: Vec<Result<Reading, String>>,
    thresholds: Thresholds,
    /// The pod's prefix cache from its KV events, when subscribed.
    prefix: Option<Arc<KvFeed>>,
}

impl Outbox {
    /// Merges every source's last outcome into a snapshot taken at `now` and publishes it.
    /// With `stalled = Some((done, waited))`, the sources not yet `done` are shown failing
    /// with "no answer for `waited`" and without their last readings; the real records are
    /// left alone, since the answer (or the timeout) is recorded when it comes.
    fn publish(
        &mut self,
        stalled: Option<(&[AtomicBool], Duration)>,
        now: Instant,
    ) -> Arc<Published> {
        self.sequence += 1;
        let interim = stalled.map(|(done, waited)| self.stalled_view(done, waited, now));
        let (tracks, last) = match &interim {
            Some((t, l)) => (t.as_slice(), l.as_slice()),
            None => (self.tracks.as_slice(), self.last.as_slice()),
        };
        let mut snapshot = merge(
            &self.identity,
            tracks,
            last,
            &self.absent,
            now,
            self.clock.unix_ms(),
            self.sequence,
            self.hub.agent_instance(),
        );
        if let Some(feed) = &self.prefix {
            // Keys are seeded by the served model: the configured one, else the model
            // server's first.
            let model = snapshot
                .identity
                .as_ref()
                .and_then(|i| i.models.first())
                .map(|m| m.name.clone());
            snapshot.prefix_cache = feed.summary(model.as_deref(), now);
        }
        let (meaningful, urgent) = match &self.baseline {
            None => (true, false),
            Some(b) => (
                meaningful_change(b, &snapshot, &self.thresholds),
                urgent_change(b, &snapshot),
            ),
        };
        if meaningful || urgent {
            self.baseline = Some(snapshot.clone());
        }
        let published = Arc::new(Published {
            snapshot,
            taken: now,
        });
        self.hub.publish(published.clone(), meaningful, urgent);
        published
    }

    /// Copies of the tracks and last outcomes with every source not yet `done` failing.
    fn stalled_view(
        &self,
        done: &[AtomicBool],
        waited: Duration,
        now: Instant,
    ) -> (Vec<SourceTrack>, Vec<Result<Reading, String>>) {
        let mut tracks = self.tracks.clone();
        let mut last = self.last.clone();
        for (i, (t, l)) in tracks.iter_mut().zip(last.iter_mut()).enumerate() {
            if done.get(i).is_some_and(|d| !d.load(Ordering::Acquire)) {
                if t.consecutive_failures == 0 {
                    tracing::warn!(source = t.name, waited = ?waited, "source stalled");
                }
                *l = Err(format!("{}: no answer for {waited:?}", t.name));
                t.record(l, now);
            }
        }
        (tracks, last)
    }
}

impl std::fmt::Debug for Sampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sampler")
            .field("tracks", &self.out.tracks)
            .field("absent", &self.out.absent)
            .field("sequence", &self.out.sequence)
            .finish()
    }
}

impl Sampler {
    /// `absent` names sources that are not configured (reported `SOURCE_STATE_ABSENT`).
    pub fn new(
        sources: Vec<Box<dyn Source>>,
        absent: Vec<&'static str>,
        identity: IdentityConfig,
        hub: Arc<Hub>,
        clock: Arc<dyn Clock>,
        sample_interval: Duration,
    ) -> Sampler {
        let tracks = sources.iter().map(|s| SourceTrack::new(s.name())).collect();
        let last = sources
            .iter()
            .map(|s| Err(format!("{}: not sampled yet", s.name())))
            .collect();
        let source_timeout =
            sample_interval.clamp(Duration::from_millis(500), Duration::from_secs(5));
        Sampler {
            sources,
            out: Outbox {
                tracks,
                absent,
                identity,
                hub,
                clock,
                sequence: 0,
                baseline: None,
                last,
                thresholds: Thresholds::default(),
                prefix: None,
            },
            source_timeout,
            stall_after: Self::default_stall_after(sample_interval, source_timeout),
        }
    }

    /// How long a full sample waits on a source before it reports that source failing while
    /// still waiting for the answer: three sample intervals, at least 150 ms, and never past
    /// the source timeout. A model server that froze (SIGSTOP, a hung event loop) is reported
    /// after this, not after the timeout, and filters cut its pod; a slow one that answers
    /// later is fresh again on that answer.
    pub fn default_stall_after(sample_interval: Duration, source_timeout: Duration) -> Duration {
        (sample_interval * 3)
            .max(Duration::from_millis(150))
            .min(source_timeout)
    }

    /// Puts the pod's prefix-cache summary from `feed` into every snapshot.
    pub fn with_prefix_feed(mut self, feed: Arc<KvFeed>) -> Sampler {
        self.out.prefix = Some(feed);
        self
    }

    pub fn with_thresholds(mut self, thresholds: Thresholds) -> Sampler {
        self.out.thresholds = thresholds;
        self
    }

    /// Overrides the stall time ([`Sampler::default_stall_after`]); at or past the source
    /// timeout, no interim snapshot is published.
    pub fn with_stall_after(mut self, stall_after: Duration) -> Sampler {
        self.stall_after = stall_after;
        self
    }

    /// Samples every source once, publishes the merged snapshot and returns it.
    pub async fn step(&mut self) -> Arc<Published> {
        self.sample(false).await
    }

    /// Samples only the local sources (GPUs, see [`Source::local`]) and publishes them merged
    /// with the other sources' last readings; `None` when no source is local.
    pub async fn step_local(&mut self) -> Option<Arc<Published>> {
        if !self.sources.iter().any(|s| s.local()) {
            return None;
        }
        Some(self.sample(true).await)
    }

    async fn sample(&mut self, only_local: bool) -> Arc<Published> {
        let now = self.out.clock.now();
        let stall = self.stall_after;
        // A GPU read normally takes microseconds: one that has not answered within the stall
        // time fails rather than hold up the next full sample (which finds a frozen model
        // server) for the whole timeout.
        let timeout = if only_local {
            self.source_timeout.min(stall)
        } else {
            self.source_timeout
        };
        let done: Vec<AtomicBool> = self
            .sources
            .iter()
            .map(|_| AtomicBool::new(false))
            .collect();
        let watch_stall = !only_local && stall < timeout && self.sources.iter().any(|s| !s.local());
        let done_ref = &done;
        let all = futures::future::join_all(
            self.sources
                .iter_mut()
                .enumerate()
                .filter(|(_, s)| !only_local || s.local())
                .map(|(i, s)| async move {
                    let outcome = match tokio::time::timeout(timeout, s.sample(now)).await {
                        Ok(Ok(r)) => Ok(r),
                        Ok(Err(e)) => Err(e.to_string()),
                        Err(_) => Err(format!("{}: no answer within {timeout:?}", s.name())),
                    };
                    if let Some(d) = done_ref.get(i) {
                        d.store(true, Ordering::Release);
                    }
                    (i, outcome)
                }),
        );
        tokio::pin!(all);
        let outcomes = if watch_stall {
            tokio::select! {
                o = &mut all => o,
                _ = tokio::time::sleep(stall) => {
                    let at = self.out.clock.now();
                    self.out.publish(Some((&done, stall)), at);
                    all.await
                }
            }
        } else {
            all.await
        };
        for (i, outcome) in outcomes {
            let (Some(track), Some(slot)) = (self.out.tracks.get_mut(i), self.out.last.get_mut(i))
            else {
                continue;
            };
            track.record(&outcome, now);
            if let Ok(r) = &outcome {
                for rej in &r.rejected {
                    self.out.hub.count_rejected(track.name, &rej.field);
                    tracing::debug!(source = track.name, field = %rej.field, value = %rej.value, reason = %rej.reason, "rejected value");
                }
            } else if let Err(e) = &outcome {
                if track.consecutive_failures == 1 {
                    tracing::warn!(source = track.name, error = %e, "source failing");
                }
            }
            *slot = outcome;
        }
        self.out.publish(None, now)
    }

    /// Samples every source at `interval`, and the local (GPU) sources alone every
    /// `local_interval` in between, until `shutdown` turns true.
    pub async fn run(
        mut self,
        interval: Duration,
        local_interval: Duration,
        mut shutdown: watch::Receiver<bool>,
    ) {
        let has_local = self.sources.iter().any(|s| s.local());
        let tick = if has_local && !local_interval.is_zero() {
            local_interval.min(interval)
        } else {
            interval
        };
        let mut ticker = tokio::time::interval(tick);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut next_full = tokio::time::Instant::now();
        loop {
            tokio::select! {
                _ = ticker.tick() => {}
                _ = stopped(&mut shutdown) => return,
            }
            let now = tokio::time::Instant::now();
            // Half a tick of slack, so timer jitter does not push a full sample a tick late.
            if now + tick / 2 >= next_full {
                self.step().await;
                next_full = (next_full + interval).max(now + interval - tick / 2);
            } else {
                self.step_local().await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ai_lb_proto::v1::LatencyQuantiles;

    fn snap(util: f64, waiting: u32) -> PodSnapshot {
        PodSnapshot {
            identity: Some(PodIdentity {
                address: "10.0.0.1:8000".into(),
                ..Default::default()
            }),
            gpus: vec![GpuStats {
                index: 0,
                utilization: Some(util),
                ..Default::default()
            }],
            inference: Some(InferenceStats {
                waiting: Some(waiting),
                kv_cache_usage: Some(0.5),
                ttft: Some(LatencyQuantiles {
                    p99_ms: Some(100.0),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            sources: vec![SourceStatus {
                name: "sim".into(),
                state: SourceState::Fresh as i32,
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    #[test]
    fn small_moves_are_not_meaningful() {
        let th = Thresholds::default();
        let a = snap(0.50, 10);
        let mut b = snap(0.51, 10);
        b.sequence = 7;
        b.sample_time_unix_ms = 123;
        assert!(!meaningful_change(&a, &b, &th));
    }

    #[test]
    fn signal_moves_are_meaningful() {
        let th = Thresholds::default();
        let a = snap(0.50, 10);
        assert!(meaningful_change(&a, &snap(0.60, 10), &th));
        assert!(meaningful_change(&a, &snap(0.50, 11), &th));
        let mut kv = snap(0.50, 10);
        kv.inference.as_mut().unwrap().kv_cache_usage = Some(0.9);
        assert!(meaningful_change(&a, &kv, &th));
        let mut p99 = snap(0.50, 10);
        p99.inference
            .as_mut()
            .unwrap()
            .ttft
            .as_mut()
            .unwrap()
            .p99_ms = Some(150.0);
        assert!(meaningful_change(&a, &p99, &th));
        let mut gone = snap(0.50, 10);
        gone.gpus[0].utilization = None;
        assert!(meaningful_change(&a, &gone, &th));
        // A saturated time-fraction hides the batch; SM occupancy moving is a change.
        let mut busy = snap(1.0, 10);
        busy.gpus[0].sm_occupancy = Some(0.2);
        let mut fuller = busy.clone();
        fuller.gpus[0].sm_occupancy = Some(0.4);
        assert!(meaningful_change(&busy, &fuller, &th));
        assert!(!meaningful_change(&busy, &busy.clone(), &th));
    }

    #[test]
    fn only_jumps_and_state_changes_are_urgent() {
        let a = snap(0.50, 10);
        assert!(!urgent_change(&a, &snap(0.55, 10)), "drift is coalesced");
        assert!(!urgent_change(&a, &snap(0.59, 12)));
        assert!(urgent_change(&a, &snap(0.60, 10)), "a 0.10 jump");
        assert!(urgent_change(&a, &snap(0.99, 10)));
        assert!(urgent_change(&a, &snap(0.50, 20)), "queue doubled");
        let mut idle = snap(0.5, 0);
        assert!(
            !urgent_change(&idle, &snap(0.5, 3)),
            "a few queued requests"
        );
        assert!(urgent_change(&idle, &snap(0.5, 4)));
        let mut full = snap(0.5, 31);
        full.inference.as_mut().unwrap().queue_capacity = Some(32);
        let mut fuller = full.clone();
        fuller.inference.as_mut().unwrap().waiting = Some(32);
        assert!(urgent_change(&full, &fuller), "the queue filled up");
        assert!(urgent_change(&fuller, &full), "and drained from full");
        idle.inference.as_mut().unwrap().kv_cache_usage = Some(0.62);
        assert!(urgent_change(&snap(0.5, 0), &idle), "a KV-cache jump");
        let mut failing = snap(0.5, 10);
        failing.sources[0].state = SourceState::Failing as i32;
        assert!(urgent_change(&a, &failing));
        let mut reason = failing.clone();
        reason.sources[0].reason = "another error text".into();
        assert!(!urgent_change(&failing, &reason), "only the state counts");
        let mut xid = snap(0.5, 10);
        xid.gpus[0].last_xid = Some(79);
        assert!(urgent_change(&a, &xid));
        let mut restarted = snap(0.5, 10);
        restarted.agent_instance = "new".into();
        assert!(urgent_change(&a, &restarted));
        let mut p99 = snap(0.50, 10);
        p99.inference
            .as_mut()
            .unwrap()
            .ttft
            .as_mut()
            .unwrap()
            .p99_ms = Some(900.0);
        assert!(!urgent_change(&a, &p99), "windowed latencies drift");
        assert!(meaningful_change(&a, &p99, &Thresholds::default()));
    }

    /// A source that counts its samples; `local` says which cadence it is on.
    struct Counting {
        name: &'static str,
        local: bool,
        calls: Arc<AtomicU64>,
    }

    #[async_trait::async_trait]
    impl Source for Counting {
        fn name(&self) -> &'static str {
            self.name
        }
        fn local(&self) -> bool {
            self.local
        }
        async fn sample(&mut self, _now: Instant) -> Result<Reading, crate::sources::SourceError> {
            let n = self.calls.fetch_add(1, Ordering::Relaxed) + 1;
            Ok(if self.local {
                Reading {
                    gpus: Some(vec![GpuStats {
                        utilization: Some((n % 2) as f64),
                        ..Default::default()
                    }]),
                    ..Default::default()
                }
            } else {
                Reading {
                    inference: Some(InferenceStats {
                        waiting: Some(n as u32),
                        ..Default::default()
                    }),
                    ..Default::default()
                }
            })
        }
    }

    /// A sampler (100 ms samples) over counting sources named and marked local as given,
    /// its hub, and each source's call counter.
    fn counting_sampler(spec: &[(&'static str, bool)]) -> (Sampler, Arc<Hub>, Vec<Arc<AtomicU64>>) {
        let calls: Vec<Arc<AtomicU64>> = spec.iter().map(|_| Arc::new(AtomicU64::new(0))).collect();
        let sources: Vec<Box<dyn Source>> = spec
            .iter()
            .zip(&calls)
            .map(|(&(name, local), c)| {
                Box::new(Counting {
                    name,
                    local,
                    calls: c.clone(),
                }) as Box<dyn Source>
            })
            .collect();
        let (sampler, hub) = test_sampler(sources, Duration::from_millis(100));
        (sampler, hub, calls)
    }

    /// A sampler over `sources` at `interval`, with a default identity, and its hub.
    fn test_sampler(sources: Vec<Box<dyn Source>>, interval: Duration) -> (Sampler, Arc<Hub>) {
        let hub = Hub::new("x".into());
        let sampler = Sampler::new(
            sources,
            vec![],
            IdentityConfig::default(),
            hub.clone(),
            Arc::new(SystemClock),
            interval,
        );
        (sampler, hub)
    }

    /// Runs `sampler` (full samples every 100 ms, local every 20 ms) for 1 s of paused time.
    async fn run_one_second(sampler: Sampler) {
        let (stop_tx, stop_rx) = watch::channel(false);
        let task = tokio::spawn(sampler.run(
            Duration::from_millis(100),
            Duration::from_millis(20),
            stop_rx,
        ));
        tokio::time::sleep(Duration::from_millis(1_010)).await;
        stop_tx.send_replace(true);
        task.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn gpus_are_read_between_full_samples_and_keep_the_model_servers_reading() {
        let (mut sampler, hub, calls) = counting_sampler(&[("sim", true), ("model-server", false)]);
        let (gpu, server) = (calls[0].clone(), calls[1].clone());
        sampler.step().await;
        let local = sampler.step_local().await.unwrap();
        assert_eq!(
            server.load(Ordering::Relaxed),
            1,
            "a local step skips the model server"
        );
        assert_eq!(gpu.load(Ordering::Relaxed), 2);
        let inf = local.snapshot.inference.unwrap();
        assert_eq!(
            inf.waiting,
            Some(1),
            "the model server's last reading is kept"
        );
        assert_eq!(local.snapshot.sources[1].state, SourceState::Fresh as i32);
        assert!(hub.urgent_changes() >= 1, "utilisation 1 -> 0 is urgent");

        let (g0, s0) = (gpu.load(Ordering::Relaxed), server.load(Ordering::Relaxed));
        run_one_second(sampler).await;
        let full = server.load(Ordering::Relaxed) - s0;
        let all = gpu.load(Ordering::Relaxed) - g0;
        assert!(
            (10..=12).contains(&full),
            "full samples in 1 s at 100 ms: {full}"
        );
        assert!((50..=52).contains(&all), "GPU reads in 1 s at 20 ms: {all}");
    }

    /// A model-server source that answers after `delay` (the test's paused clock), or never
    /// once `frozen` is set.
    struct Freezable {
        delay: Duration,
        frozen: Arc<AtomicBool>,
    }

    #[async_trait::async_trait]
    impl Source for Freezable {
        fn name(&self) -> &'static str {
            "model-server"
        }
        async fn sample(&mut self, _now: Instant) -> Result<Reading, crate::sources::SourceError> {
            if self.frozen.load(Ordering::Relaxed) {
                std::future::pending::<()>().await;
            }
            tokio::time::sleep(self.delay).await;
            Ok(Reading {
                inference: Some(InferenceStats {
                    waiting: Some(2),
                    ..Default::default()
                }),
                ..Default::default()
            })
        }
    }

    /// A sampler at the 50 ms default over a local GPU source and a [`Freezable`] model
    /// server answering after `delay`; its hub and the freeze switch.
    fn freezable_sampler(delay: Duration) -> (Sampler, Arc<Hub>, Arc<AtomicBool>) {
        let frozen = Arc::new(AtomicBool::new(false));
        let sources: Vec<Box<dyn Source>> = vec![
            Box::new(Counting {
                name: "sim",
                local: true,
                calls: Arc::new(AtomicU64::new(0)),
            }),
            Box::new(Freezable {
                delay,
                frozen: frozen.clone(),
            }),
        ];
        let (sampler, hub) = test_sampler(sources, Duration::from_millis(50));
        (sampler, hub, frozen)
    }

    fn model_server_status(hub: &Hub) -> SourceStatus {
        hub.latest().unwrap().snapshot.sources[1].clone()
    }

    #[tokio::test(start_paused = true)]
    async fn a_frozen_model_server_is_reported_failing_after_the_stall_time_not_the_timeout() {
        let (mut sampler, hub, frozen) = freezable_sampler(Duration::ZERO);
        assert_eq!(sampler.stall_after, Duration::from_millis(150));
        assert_eq!(sampler.source_timeout, Duration::from_millis(500));
        sampler.step().await;
        assert_eq!(model_server_status(&hub).state, SourceState::Fresh as i32);
        frozen.store(true, Ordering::Relaxed);
        let mut urgent = hub.subscribe_urgent();
        urgent.borrow_and_update();
        let t0 = tokio::time::Instant::now();
        let task = tokio::spawn(async move { sampler.step().await });
        urgent.changed().await.unwrap();
        assert_eq!(
            t0.elapsed(),
            Duration::from_millis(150),
            "pushed at the stall time"
        );
        let interim = hub.latest().unwrap().snapshot.clone();
        let ms = &interim.sources[1];
        assert_eq!(ms.state, SourceState::Failing as i32);
        assert!(ms.reason.contains("no answer for 150ms"), "{}", ms.reason);
        assert!(ms.last_success_age_ms.is_some(), "it answered before");
        assert_eq!(
            interim.inference, None,
            "a stalled source's reading is dropped"
        );
        assert_eq!(
            interim.sources[0].state,
            SourceState::Fresh as i32,
            "the GPU answered"
        );
        assert!(!interim.gpus.is_empty());
        // The sample itself still ends at the timeout, and records it.
        let done = task.await.unwrap();
        assert_eq!(t0.elapsed(), Duration::from_millis(500));
        let ms = &done.snapshot.sources[1];
        assert_eq!(ms.state, SourceState::Failing as i32);
        assert_eq!(
            ms.consecutive_failures, 1,
            "the interim report is not a second failure"
        );
        assert!(
            ms.reason.contains("no answer within 500ms"),
            "{}",
            ms.reason
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_model_server_is_failing_between_the_stall_time_and_its_answer() {
        let (mut sampler, hub, _frozen) = freezable_sampler(Duration::from_millis(300));
        // Each sample reports it failing at 150 ms and fresh again on its answer at 300 ms.
        let first = sampler.step().await;
        assert_eq!(first.snapshot.sources[1].state, SourceState::Fresh as i32);
        let seq = first.snapshot.sequence;
        let done = sampler.step().await;
        assert_eq!(done.snapshot.sources[1].state, SourceState::Fresh as i32);
        assert_eq!(done.snapshot.inference.unwrap().waiting, Some(2));
        assert_eq!(
            done.snapshot.sequence,
            seq + 2,
            "one interim snapshot in between"
        );
        drop(hub);
        // A stall time at or past the timeout publishes no interim snapshot.
        let (sampler, _hub, _f) = freezable_sampler(Duration::from_millis(300));
        let mut sampler = sampler.with_stall_after(Duration::from_millis(500));
        let a = sampler.step().await.snapshot.sequence;
        assert_eq!(sampler.step().await.snapshot.sequence, a + 1);
    }

    /// A local (GPU) source that never answers.
    struct HungGpu;

    #[async_trait::async_trait]
    impl Source for HungGpu {
        fn name(&self) -> &'static str {
            "nvml"
        }
        fn local(&self) -> bool {
            true
        }
        async fn sample(&mut self, _now: Instant) -> Result<Reading, crate::sources::SourceError> {
            std::future::pending().await
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_hung_gpu_read_fails_at_the_stall_time_and_frees_the_loop() {
        let (mut sampler, _hub) = test_sampler(vec![Box::new(HungGpu)], Duration::from_millis(50));
        let t0 = tokio::time::Instant::now();
        let p = sampler.step_local().await.unwrap();
        assert_eq!(t0.elapsed(), Duration::from_millis(150));
        let gpu = &p.snapshot.sources[0];
        assert_eq!(gpu.state, SourceState::Failing as i32);
        assert!(
            gpu.reason.contains("no answer within 150ms"),
            "{}",
            gpu.reason
        );
    }

    #[test]
    fn stall_time_is_three_intervals_at_least_150_ms_within_the_timeout() {
        let ms = Duration::from_millis;
        let t = Sampler::default_stall_after;
        assert_eq!(t(ms(50), ms(500)), ms(150));
        assert_eq!(t(ms(10), ms(500)), ms(150));
        assert_eq!(t(ms(100), ms(500)), ms(300));
        assert_eq!(t(ms(1000), ms(1000)), ms(1000));
    }

    #[tokio::test(start_paused = true)]
    async fn without_local_sources_only_full_samples_run() {
        let (mut sampler, _hub, calls) = counting_sampler(&[("model-server", false)]);
        assert!(sampler.step_local().await.is_none());
        run_one_second(sampler).await;
        let n = calls[0].load(Ordering::Relaxed);
        assert!((10..=12).contains(&n), "{n}");
    }

    #[test]
    fn a_prefix_cache_change_is_meaningful_not_urgent() {
        use ai_lb_proto::v1::PrefixCacheSummary;
        let th = Thresholds::default();
        let mut a = snap(0.5, 10);
        a.prefix_cache = Some(PrefixCacheSummary {
            block_tokens: 64,
            keys: vec![1, 2],
            truncated: false,
            model: "m".into(),
        });
        assert!(!meaningful_change(&a, &a.clone(), &th));
        let mut b = a.clone();
        b.prefix_cache.as_mut().unwrap().keys.push(3);
        assert!(meaningful_change(&a, &b, &th));
        assert!(!urgent_change(&a, &b));
        let mut none = a.clone();
        none.prefix_cache = None;
        assert!(meaningful_change(&a, &none, &th));
        assert!(!urgent_change(&a, &none));
        // So is a hit rate that moved (or appeared).
        let mut hit = a.clone();
        hit.inference.as_mut().unwrap().prefix_cache_hit_rate = Some(0.5);
        assert!(meaningful_change(&a, &hit, &th));
        assert!(!urgent_change(&a, &hit));
    }

    #[test]
    fn kv_capacity_change_is_meaningful() {
        let th = Thresholds::default();
        let mut a = snap(0.50, 10);
        a.inference.as_mut().unwrap().kv_capacity_tokens = Some(400_000);
        let same = a.clone();
        assert!(!meaningful_change(&a, &same, &th));
        let mut grown = a.clone();
        grown.inference.as_mut().unwrap().kv_capacity_tokens = Some(400_016);
        assert!(meaningful_change(&a, &grown, &th), "any change is pushed");
        let mut lost = a.clone();
        lost.inference.as_mut().unwrap().kv_capacity_tokens = None;
        assert!(meaningful_change(&a, &lost, &th));
    }

    #[test]
    fn configured_capacities_win_over_the_model_server() {
        let t0 = Instant::now();
        let mut track = SourceTrack::new("model-server");
        let reading = Ok(Reading {
            inference: Some(InferenceStats {
                queue_capacity: Some(8),
                kv_capacity_tokens: Some(32_768),
                ..Default::default()
            }),
            ..Default::default()
        });
        track.record(&reading, t0);
        let tracks = [track];
        let outcomes = [reading];
        let merged = |id: &IdentityConfig| {
            merge(id, &tracks, &outcomes, &[], t0, 0, 1, "x")
                .inference
                .unwrap()
        };
        let engine_says = merged(&IdentityConfig::default());
        assert_eq!(engine_says.kv_capacity_tokens, Some(32_768));
        assert_eq!(engine_says.queue_capacity, Some(8));
        let operator_says = merged(&IdentityConfig {
            queue_capacity: Some(64),
            kv_capacity_tokens: Some(400_000),
            ..Default::default()
        });
        assert_eq!(operator_says.kv_capacity_tokens, Some(400_000));
        assert_eq!(operator_says.queue_capacity, Some(64));
    }

    #[test]
    fn source_state_and_errors_are_meaningful() {
        let th = Thresholds::default();
        let a = snap(0.5, 1);
        let mut b = snap(0.5, 1);
        b.sources[0].state = SourceState::Failing as i32;
        b.sources[0].reason = "sim: HTTP 500".into();
        assert!(meaningful_change(&a, &b, &th));
        let mut c = b.clone();
        c.sources[0].reason = "sim: cannot connect".into();
        assert!(meaningful_change(&b, &c, &th));
        let mut x = snap(0.5, 1);
        x.gpus[0].xid_errors = Some(1);
        assert!(meaningful_change(&a, &x, &th));
        let mut m = snap(0.5, 1);
        m.identity.as_mut().unwrap().models = vec![ModelInfo {
            name: "llama".into(),
            ..Default::default()
        }];
        assert!(meaningful_change(&a, &m, &th));
    }

    #[test]
    fn merge_reports_health_and_drops_failed_data() {
        let t0 = Instant::now();
        let t1 = t0 + Duration::from_millis(300);
        let mut ok = SourceTrack::new("sim");
        let mut bad = SourceTrack::new("model-server");
        let good = Ok(Reading {
            gpus: Some(vec![GpuStats {
                utilization: Some(0.4),
                ..Default::default()
            }]),
            ..Default::default()
        });
        ok.record(&good, t0);
        ok.record(&good, t1);
        bad.record(&Ok(Reading::default()), t0);
        let err = Err("model-server: HTTP 503 from x".to_string());
        bad.record(&err, t1);
        let id = IdentityConfig {
            address: "10.0.0.1:8000".into(),
            models: vec!["m".into()],
            queue_capacity: Some(32),
            ..Default::default()
        };
        let s = merge(&id, &[ok, bad], &[good, err], &["nvml"], t1, 5, 9, "abc");
        assert_eq!(s.gpus.len(), 1);
        assert!(s.inference.is_none());
        assert_eq!(s.sequence, 9);
        assert_eq!(s.agent_instance, "abc");
        assert_eq!(s.identity.as_ref().unwrap().models[0].name, "m");
        assert_eq!(s.sources[0].state, SourceState::Fresh as i32);
        assert_eq!(s.sources[0].last_success_age_ms, Some(0));
        assert_eq!(s.sources[1].state, SourceState::Failing as i32);
        assert_eq!(s.sources[1].consecutive_failures, 1);
        assert_eq!(s.sources[1].last_success_age_ms, Some(300));
        assert!(s.sources[1].reason.contains("503"));
        assert_eq!(s.sources[2].state, SourceState::Absent as i32);
    }

    #[test]
    fn render_grows_ages() {
        let t0 = Instant::now();
        let mut s = snap(0.5, 1);
        s.sources[0].last_success_age_ms = Some(20);
        let p = Published {
            snapshot: s,
            taken: t0,
        };
        let r = p.render(t0 + Duration::from_millis(250));
        assert_eq!(r.age_ms, 250);
        assert_eq!(r.sources[0].last_success_age_ms, Some(270));
    }
}
