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
mod tests;
