//! The sampler decides what the pod's current snapshot is: it reads every configured source on
//! that source's own clock (one task per source; the GPUs every `--gpu-sample-interval`, the
//! model server every `--sample-interval`; time from an injected clock), merges each outcome
//! with the other sources' latest into one `PodSnapshot` with per-source health, publishes it by
//! swapping an `Arc` (readers never block the sampler), and wakes watchers only when the change
//! is meaningful (a pure function, [`meaningful_change`]). A source that does not answer holds
//! up only its own reads.

use crate::kv_events::KvFeed;
use crate::sources::{Reading, Source};
use ai_lb_proto::v1::{
    Engine, GpuStats, InferenceStats, ModelInfo, PodIdentity, PodSnapshot, SourceState,
    SourceStatus,
};
use arc_swap::ArcSwapOption;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
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
    /// Configured model version (`--model-version`); wins over the model server's when set.
    pub model_version: Option<String>,
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
    /// Reads finished per source: `[ok, failed]`.
    source_reads: Mutex<BTreeMap<String, [u64; 2]>>,
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
            source_reads: Mutex::new(BTreeMap::new()),
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

    /// Reads finished so far, by source: `(ok, failed)`.
    pub fn source_reads(&self) -> Vec<(String, u64, u64)> {
        let m = match self.source_reads.lock() {
            Ok(m) => m,
            Err(p) => p.into_inner(),
        };
        m.iter()
            .map(|(k, [ok, bad])| (k.clone(), *ok, *bad))
            .collect()
    }

    fn count_source_sample(&self, source: &str, ok: bool) {
        let mut m = match self.source_reads.lock() {
            Ok(m) => m,
            Err(p) => p.into_inner(),
        };
        let slot = m.entry(source.to_string()).or_insert([0, 0]);
        slot[usize::from(!ok)] += 1;
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
    if let Some(v) = &identity.model_version {
        for m in models.iter_mut() {
            m.version.clone_from(v);
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
                || a.pre_oom.is_some() != b.pre_oom.is_some()
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

/// Runs the sources, each on its own clock, and publishes snapshots into a [`Hub`].
///
/// Every source is sampled by a task of its own at its own interval (the local GPU sources
/// every `--gpu-sample-interval`, the others every `--sample-interval`); each outcome is merged
/// at once with the other sources' latest outcomes and published. A source that answers late
/// or never (a frozen model server, a wedged GPU read) holds up only its own task, so the
/// others keep their cadence (issue 31: one sample used to wait on every source, and a frozen
/// model server slowed the GPU readings from every 20 ms to every ~0.5 s).
pub struct Sampler {
    sources: Vec<Box<dyn Source>>,
    /// Shared by the per-source tasks; held only to merge and publish, never across a read.
    out: Arc<Mutex<Outbox>>,
    clock: Arc<dyn Clock>,
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
    /// snapshot, so a GPU reading keeps the model server's last reading.
    last: Vec<Result<Reading, String>>,
    /// Sources whose current read has waited past the stall time, and that time: until they
    /// answer (or time out) every snapshot shows them failing with "no answer for …" and
    /// without their last reading. The real records are left alone: the answer, or the
    /// timeout, is recorded when it comes.
    stalled: Vec<Option<Duration>>,
    /// The newest time a snapshot was published for: a late answer to a read started earlier
    /// does not make the snapshot look older than the readings it already holds.
    newest: Option<Instant>,
    thresholds: Thresholds,
    /// The pod's prefix cache from its KV events, when subscribed.
    prefix: Option<Arc<KvFeed>>,
    /// The GPU-memory watermark (`--oom-*`), fed every GPU reading; None: off.
    oom: Option<crate::watermark::GpuWatermarks>,
}

fn lock(out: &Mutex<Outbox>) -> std::sync::MutexGuard<'_, Outbox> {
    match out.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

impl Outbox {
    /// Merges every source's last outcome (stalled ones shown failing) into a snapshot taken
    /// at `at` (or at the newest time already published, if later) and publishes it.
    fn publish(&mut self, at: Instant) -> Arc<Published> {
        let now = self.newest.map_or(at, |n| n.max(at));
        self.newest = Some(now);
        self.sequence += 1;
        let interim = self
            .stalled
            .iter()
            .any(Option::is_some)
            .then(|| self.stalled_view(now));
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
        if let Some(oom) = self.oom.as_mut() {
            oom.annotate(&mut snapshot.gpus, now);
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

    /// Copies of the tracks and last outcomes with every stalled source failing.
    fn stalled_view(&self, now: Instant) -> (Vec<SourceTrack>, Vec<Result<Reading, String>>) {
        let mut tracks = self.tracks.clone();
        let mut last = self.last.clone();
        for ((t, l), waited) in tracks.iter_mut().zip(last.iter_mut()).zip(&self.stalled) {
            if let Some(waited) = waited {
                *l = Err(format!("{}: no answer for {waited:?}", t.name));
                t.record(l, now);
            }
        }
        (tracks, last)
    }

    /// Source `i`'s current read has waited `waited` (at `at`): publish it failing.
    fn mark_stalled(&mut self, i: usize, waited: Duration, at: Instant) -> Arc<Published> {
        if let (Some(slot), Some(t)) = (self.stalled.get_mut(i), self.tracks.get(i)) {
            *slot = Some(waited);
            if t.consecutive_failures == 0 {
                tracing::warn!(source = t.name, waited = ?waited, "source stalled");
            }
        }
        self.publish(at)
    }

    /// Records source `i`'s outcome of the read started at `now` and publishes.
    fn record(
        &mut self,
        i: usize,
        outcome: Result<Reading, String>,
        now: Instant,
    ) -> Arc<Published> {
        if let Some(s) = self.stalled.get_mut(i) {
            *s = None;
        }
        if let (Some(track), Some(slot)) = (self.tracks.get_mut(i), self.last.get_mut(i)) {
            track.record(&outcome, now);
            self.hub.count_source_sample(track.name, outcome.is_ok());
            match &outcome {
                Ok(r) => {
                    if let (Some(oom), Some(gpus)) = (self.oom.as_mut(), r.gpus.as_deref()) {
                        for i in oom.observe(gpus, now) {
                            self.hub.count_rejected(
                                track.name,
                                &format!("gpus[{i}].memory (oom watermark)"),
                            );
                        }
                    }
                    for rej in &r.rejected {
                        self.hub.count_rejected(track.name, &rej.field);
                        tracing::debug!(source = track.name, field = %rej.field, value = %rej.value, reason = %rej.reason, "rejected value");
                    }
                }
                Err(e) => {
                    if track.consecutive_failures == 1 {
                        tracing::warn!(source = track.name, error = %e, "source failing");
                    }
                }
            }
            *slot = outcome;
        }
        self.publish(now)
    }
}

/// How one source is read: the timeout of a read, and when a read still waiting is published
/// as failing (`None`: only at the timeout).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Cadence {
    timeout: Duration,
    stall: Option<Duration>,
}

/// Reads source `i` once (time from `clock`): publishes it stalled if it has not answered
/// within the stall time, then its outcome. Returns the last snapshot published.
async fn sample_source(
    i: usize,
    source: &mut dyn Source,
    out: &Mutex<Outbox>,
    clock: &dyn Clock,
    cadence: Cadence,
) -> Arc<Published> {
    let now = clock.now();
    let name = source.name();
    let timeout = cadence.timeout;
    let read = async {
        match tokio::time::timeout(timeout, source.sample(now)).await {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("{name}: no answer within {timeout:?}")),
        }
    };
    tokio::pin!(read);
    let outcome = match cadence.stall {
        Some(stall) => tokio::select! {
            o = &mut read => o,
            _ = tokio::time::sleep(stall) => {
                lock(out).mark_stalled(i, stall, clock.now());
                read.await
            }
        },
        None => read.await,
    };
    lock(out).record(i, outcome, now)
}

/// Reads source `i` every `every` until `shutdown`.
async fn run_source(
    i: usize,
    mut source: Box<dyn Source>,
    out: Arc<Mutex<Outbox>>,
    clock: Arc<dyn Clock>,
    every: Duration,
    cadence: Cadence,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut ticker = tokio::time::interval(every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = stopped(&mut shutdown) => return,
        }
        tokio::select! {
            _ = sample_source(i, source.as_mut(), &out, clock.as_ref(), cadence) => {}
            _ = stopped(&mut shutdown) => return,
        }
    }
}

/// Aborts the per-source tasks when [`Sampler::run`] is dropped.
struct AbortOnDrop(Vec<tokio::task::JoinHandle<()>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

impl std::fmt::Debug for Sampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let out = lock(&self.out);
        f.debug_struct("Sampler")
            .field("tracks", &out.tracks)
            .field("absent", &out.absent)
            .field("sequence", &out.sequence)
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
            out: Arc::new(Mutex::new(Outbox {
                tracks,
                absent,
                identity,
                hub,
                clock: clock.clone(),
                sequence: 0,
                baseline: None,
                last,
                stalled: vec![None; sources.len()],
                newest: None,
                thresholds: Thresholds::default(),
                prefix: None,
                oom: None,
            })),
            sources,
            clock,
            source_timeout,
            stall_after: Self::default_stall_after(sample_interval, source_timeout),
        }
    }

    /// How long a read of a (non-local) source may wait before the source is reported failing
    /// while the read still waits for the answer: three sample intervals, at least 150 ms,
    /// and never past the source timeout. A model server that froze (SIGSTOP, a hung event
    /// loop) is reported after this, not after the timeout, and filters cut its pod; a slow
    /// one that answers later is fresh again on that answer. A local (GPU) read times out
    /// after this long.
    pub fn default_stall_after(sample_interval: Duration, source_timeout: Duration) -> Duration {
        (sample_interval * 3)
            .max(Duration::from_millis(150))
            .min(source_timeout)
    }

    /// Puts the pod's prefix-cache summary from `feed` into every snapshot.
    pub fn with_prefix_feed(self, feed: Arc<KvFeed>) -> Sampler {
        lock(&self.out).prefix = Some(feed);
        self
    }

    /// Judges every GPU reading against the GPU-memory watermark ([`crate::watermark`]) and
    /// reports its growth rate and pre-OOM state in every snapshot.
    pub fn with_oom_watermark(self, cfg: crate::watermark::WatermarkConfig) -> Sampler {
        lock(&self.out).oom = Some(crate::watermark::GpuWatermarks::new(cfg));
        self
    }

    pub fn with_thresholds(self, thresholds: Thresholds) -> Sampler {
        lock(&self.out).thresholds = thresholds;
        self
    }

    /// Overrides the stall time ([`Sampler::default_stall_after`]); at or past the source
    /// timeout, no interim snapshot is published.
    pub fn with_stall_after(mut self, stall_after: Duration) -> Sampler {
        self.stall_after = stall_after;
        self
    }

    /// A local (GPU) read normally takes microseconds: one that has not answered within the
    /// stall time fails then. Any other read is reported stalled at the stall time and fails
    /// at the source timeout.
    fn cadence(&self, local: bool) -> Cadence {
        if local {
            Cadence {
                timeout: self.source_timeout.min(self.stall_after),
                stall: None,
            }
        } else {
            Cadence {
                timeout: self.source_timeout,
                stall: (self.stall_after < self.source_timeout).then_some(self.stall_after),
            }
        }
    }

    /// Reads every source once, concurrently, each outcome published as it comes (as in
    /// [`Sampler::run`]); returns the last snapshot published. With no source, publishes
    /// the configuration alone.
    pub async fn step(&mut self) -> Arc<Published> {
        let cadences: Vec<Cadence> = self
            .sources
            .iter()
            .map(|s| self.cadence(s.local()))
            .collect();
        let (out, clock) = (&self.out, self.clock.as_ref());
        let published = futures::future::join_all(
            self.sources
                .iter_mut()
                .zip(cadences)
                .enumerate()
                .map(|(i, (s, c))| sample_source(i, s.as_mut(), out, clock, c)),
        )
        .await;
        match published.into_iter().max_by_key(|p| p.snapshot.sequence) {
            Some(p) => p,
            None => lock(out).publish(clock.now()),
        }
    }

    /// Reads source `i` alone once and publishes it with the others' last outcomes; `None`
    /// if there is no source `i`.
    pub async fn step_source(&mut self, i: usize) -> Option<Arc<Published>> {
        let local = self.sources.get(i)?.local();
        let cadence = self.cadence(local);
        let source = self.sources.get_mut(i)?;
        Some(sample_source(i, source.as_mut(), &self.out, self.clock.as_ref(), cadence).await)
    }

    /// Reads each source on its own task until `shutdown` turns true: the local (GPU) sources
    /// every `local_interval` (at most `interval`; zero means `interval`), the others every
    /// `interval`. With no source at all, the snapshot (identity and absent sources only) is
    /// published every `interval`, so it does not age.
    pub async fn run(
        self,
        interval: Duration,
        local_interval: Duration,
        mut shutdown: watch::Receiver<bool>,
    ) {
        if self.sources.is_empty() {
            let mut ticker = tokio::time::interval(interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = ticker.tick() => {}
                    _ = stopped(&mut shutdown) => return,
                }
                lock(&self.out).publish(self.clock.now());
            }
        }
        let cadences: Vec<Cadence> = self
            .sources
            .iter()
            .map(|s| self.cadence(s.local()))
            .collect();
        let Sampler {
            sources,
            out,
            clock,
            ..
        } = self;
        let mut tasks = AbortOnDrop(Vec::with_capacity(sources.len()));
        for (i, (source, cadence)) in sources.into_iter().zip(cadences).enumerate() {
            let every = if source.local() && !local_interval.is_zero() {
                local_interval.min(interval)
            } else {
                interval
            };
            tasks.0.push(tokio::spawn(run_source(
                i,
                source,
                out.clone(),
                clock.clone(),
                every,
                cadence,
                shutdown.clone(),
            )));
        }
        for t in tasks.0.iter_mut() {
            let _ = t.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ai_lb_proto::v1::LatencyQuantiles;
    use std::sync::atomic::AtomicBool;

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

    /// Runs `sampler` (model server every 100 ms, GPUs every 20 ms) for `ms` of paused time.
    async fn run_for(sampler: Sampler, ms: u64) {
        let (stop_tx, stop_rx) = watch::channel(false);
        let task = tokio::spawn(sampler.run(
            Duration::from_millis(100),
            Duration::from_millis(20),
            stop_rx,
        ));
        tokio::time::sleep(Duration::from_millis(ms)).await;
        stop_tx.send_replace(true);
        task.await.unwrap();
    }

    async fn run_one_second(sampler: Sampler) {
        run_for(sampler, 1_010).await;
    }

    #[tokio::test(start_paused = true)]
    async fn each_source_keeps_its_own_cadence_and_the_others_last_reading() {
        let (mut sampler, hub, calls) = counting_sampler(&[("sim", true), ("model-server", false)]);
        let (gpu, server) = (calls[0].clone(), calls[1].clone());
        sampler.step().await;
        let local = sampler.step_source(0).await.unwrap();
        assert_eq!(
            server.load(Ordering::Relaxed),
            1,
            "a GPU read skips the model server"
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
        assert!(sampler.step_source(2).await.is_none());

        let (g0, s0) = (gpu.load(Ordering::Relaxed), server.load(Ordering::Relaxed));
        run_one_second(sampler).await;
        let full = server.load(Ordering::Relaxed) - s0;
        let all = gpu.load(Ordering::Relaxed) - g0;
        assert!(
            (10..=12).contains(&full),
            "model-server reads in 1 s at 100 ms: {full}"
        );
        assert!((50..=52).contains(&all), "GPU reads in 1 s at 20 ms: {all}");
        assert_eq!(
            hub.source_reads(),
            vec![
                ("model-server".to_string(), full + s0, 0),
                ("sim".to_string(), all + g0, 0)
            ]
        );
    }

    /// A model-server source that answers after `delay` (the test's paused clock), or never
    /// once `frozen` is set; counts its answers.
    struct Freezable {
        delay: Duration,
        frozen: Arc<AtomicBool>,
        answers: Arc<AtomicU64>,
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
            self.answers.fetch_add(1, Ordering::Relaxed);
            Ok(Reading {
                inference: Some(InferenceStats {
                    waiting: Some(2),
                    ..Default::default()
                }),
                ..Default::default()
            })
        }
    }

    /// A local GPU source whose reading never changes; counts its reads.
    struct SteadyGpu(Arc<AtomicU64>);

    #[async_trait::async_trait]
    impl Source for SteadyGpu {
        fn name(&self) -> &'static str {
            "sim"
        }
        fn local(&self) -> bool {
            true
        }
        async fn sample(&mut self, _now: Instant) -> Result<Reading, crate::sources::SourceError> {
            self.0.fetch_add(1, Ordering::Relaxed);
            Ok(Reading {
                gpus: Some(vec![GpuStats {
                    utilization: Some(0.5),
                    ..Default::default()
                }]),
                ..Default::default()
            })
        }
    }

    /// What a [`freezable_sampler`] test holds on to.
    struct Frozen {
        hub: Arc<Hub>,
        frozen: Arc<AtomicBool>,
        gpu_reads: Arc<AtomicU64>,
        answers: Arc<AtomicU64>,
    }

    /// A sampler at the 50 ms default over a steady local GPU source and a [`Freezable`]
    /// model server answering after `delay`.
    fn freezable_sampler(delay: Duration) -> (Sampler, Frozen) {
        let f = Frozen {
            hub: Hub::new("x".into()),
            frozen: Arc::new(AtomicBool::new(false)),
            gpu_reads: Arc::new(AtomicU64::new(0)),
            answers: Arc::new(AtomicU64::new(0)),
        };
        let sources: Vec<Box<dyn Source>> = vec![
            Box::new(SteadyGpu(f.gpu_reads.clone())),
            Box::new(Freezable {
                delay,
                frozen: f.frozen.clone(),
                answers: f.answers.clone(),
            }),
        ];
        let sampler = Sampler::new(
            sources,
            vec![],
            IdentityConfig::default(),
            f.hub.clone(),
            Arc::new(SystemClock),
            Duration::from_millis(50),
        );
        (sampler, f)
    }

    fn model_server_status(hub: &Hub) -> SourceStatus {
        hub.latest().unwrap().snapshot.sources[1].clone()
    }

    #[tokio::test(start_paused = true)]
    async fn a_frozen_model_server_is_reported_failing_after_the_stall_time_not_the_timeout() {
        let (mut sampler, f) = freezable_sampler(Duration::ZERO);
        let hub = f.hub.clone();
        assert_eq!(sampler.stall_after, Duration::from_millis(150));
        assert_eq!(sampler.source_timeout, Duration::from_millis(500));
        sampler.step().await;
        assert_eq!(model_server_status(&hub).state, SourceState::Fresh as i32);
        f.frozen.store(true, Ordering::Relaxed);
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
        // The read itself still ends at the timeout, and records it.
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

    /// Issue 31, at the sampler: while the model server is frozen the GPU keeps its 20 ms
    /// cadence (it used to be read once per 500 ms timeout), and every snapshot the GPU
    /// publishes meanwhile still shows the model server failing, without its reading.
    #[tokio::test(start_paused = true)]
    async fn a_frozen_model_server_does_not_hold_up_the_gpu_reads() {
        let (mut sampler, f) = freezable_sampler(Duration::ZERO);
        sampler.step().await;
        f.frozen.store(true, Ordering::Relaxed);
        let (g0, a0) = (
            f.gpu_reads.load(Ordering::Relaxed),
            f.answers.load(Ordering::Relaxed),
        );
        let (stop_tx, stop_rx) = watch::channel(false);
        let task = tokio::spawn(sampler.run(
            Duration::from_millis(50),
            Duration::from_millis(20),
            stop_rx,
        ));
        let mut last_seq = 0;
        for step in 1..=10u64 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let s = f.hub.latest().unwrap().render(Instant::now());
            assert!(s.sequence > last_seq, "published since the last look");
            last_seq = s.sequence;
            if step >= 2 {
                let ms = &s.sources[1];
                assert_eq!(ms.state, SourceState::Failing as i32, "at {step}00 ms");
                assert!(ms.last_success_age_ms.is_some());
                assert_eq!(s.inference, None, "at {step}00 ms");
            }
            assert_eq!(s.sources[0].state, SourceState::Fresh as i32);
        }
        // Past the second timeout (1000 ms) before stopping: stopping at the very instant it
        // is due left it to the scheduler's order whether it was counted.
        tokio::time::sleep(Duration::from_millis(50)).await;
        stop_tx.send_replace(true);
        task.await.unwrap();
        let gpu = f.gpu_reads.load(Ordering::Relaxed) - g0;
        assert!(
            (52..=55).contains(&gpu),
            "GPU reads in 1.05 s at 20 ms: {gpu}"
        );
        assert_eq!(f.answers.load(Ordering::Relaxed), a0, "still frozen");
        let failed = f
            .hub
            .source_reads()
            .into_iter()
            .find(|(n, _, _)| n == "model-server")
            .map(|(_, _, bad)| bad);
        assert_eq!(failed, Some(2), "timed out at 500 ms and 1000 ms");
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_model_server_is_failing_between_the_stall_time_and_its_answer() {
        let (mut sampler, _f) = freezable_sampler(Duration::from_millis(300));
        // Each read reports it failing at 150 ms and fresh again on its answer at 300 ms.
        let first = sampler.step_source(1).await.unwrap();
        assert_eq!(first.snapshot.sources[1].state, SourceState::Fresh as i32);
        let seq = first.snapshot.sequence;
        let done = sampler.step_source(1).await.unwrap();
        assert_eq!(done.snapshot.sources[1].state, SourceState::Fresh as i32);
        assert_eq!(done.snapshot.inference.unwrap().waiting, Some(2));
        assert_eq!(
            done.snapshot.sequence,
            seq + 2,
            "one interim snapshot in between"
        );
        // A stall time at or past the timeout publishes no interim snapshot.
        let (sampler, _f) = freezable_sampler(Duration::from_millis(300));
        let mut sampler = sampler.with_stall_after(Duration::from_millis(500));
        let a = sampler.step_source(1).await.unwrap().snapshot.sequence;
        assert_eq!(
            sampler.step_source(1).await.unwrap().snapshot.sequence,
            a + 1
        );
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
    async fn a_hung_gpu_read_fails_at_the_stall_time() {
        let (mut sampler, _hub) = test_sampler(vec![Box::new(HungGpu)], Duration::from_millis(50));
        let t0 = tokio::time::Instant::now();
        let p = sampler.step_source(0).await.unwrap();
        assert_eq!(t0.elapsed(), Duration::from_millis(150));
        let gpu = &p.snapshot.sources[0];
        assert_eq!(gpu.state, SourceState::Failing as i32);
        assert!(
            gpu.reason.contains("no answer within 150ms"),
            "{}",
            gpu.reason
        );
    }

    /// The other way round: a hung GPU read does not hold up the model server's reads.
    #[tokio::test(start_paused = true)]
    async fn a_hung_gpu_read_does_not_hold_up_the_model_server() {
        let answers = Arc::new(AtomicU64::new(0));
        let sources: Vec<Box<dyn Source>> = vec![
            Box::new(HungGpu),
            Box::new(Freezable {
                delay: Duration::ZERO,
                frozen: Arc::new(AtomicBool::new(false)),
                answers: answers.clone(),
            }),
        ];
        let (sampler, hub) = test_sampler(sources, Duration::from_millis(100));
        run_one_second(sampler).await;
        let n = answers.load(Ordering::Relaxed);
        assert!((10..=12).contains(&n), "model-server reads in 1 s: {n}");
        let s = hub.latest().unwrap().snapshot.clone();
        assert_eq!(s.sources[0].state, SourceState::Failing as i32);
        assert_eq!(s.sources[1].state, SourceState::Fresh as i32);
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
    async fn without_local_sources_only_model_server_reads_run() {
        let (sampler, _hub, calls) = counting_sampler(&[("model-server", false)]);
        run_one_second(sampler).await;
        let n = calls[0].load(Ordering::Relaxed);
        assert!((10..=12).contains(&n), "{n}");
    }

    /// With no source configured the snapshot (identity, absent sources) is still published
    /// every interval, so receivers do not see it age.
    #[tokio::test(start_paused = true)]
    async fn without_any_source_the_snapshot_is_still_renewed() {
        let hub = Hub::new("x".into());
        let sampler = Sampler::new(
            vec![],
            vec!["nvml", "model-server"],
            IdentityConfig::default(),
            hub.clone(),
            Arc::new(SystemClock),
            Duration::from_millis(100),
        );
        run_one_second(sampler).await;
        let n = hub.samples_taken();
        assert!((10..=12).contains(&n), "{n}");
        let s = hub.latest().unwrap().snapshot.clone();
        assert!(s
            .sources
            .iter()
            .all(|x| x.state == SourceState::Absent as i32));
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
    fn the_configured_model_version_is_every_model_s_version() {
        let t0 = Instant::now();
        let id = IdentityConfig {
            address: "10.0.0.1:8000".into(),
            models: vec!["m".into(), "n".into()],
            model_version: Some("v2".into()),
            ..Default::default()
        };
        let s = merge(&id, &[], &[], &[], t0, 0, 1, "x");
        let models = &s.identity.as_ref().unwrap().models;
        assert_eq!(models.len(), 2);
        assert!(models.iter().all(|m| m.version == "v2"));
        let none = merge(&IdentityConfig::default(), &[], &[], &[], t0, 0, 1, "x");
        assert!(none
            .identity
            .unwrap()
            .models
            .iter()
            .all(|m| m.version.is_empty()));
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
