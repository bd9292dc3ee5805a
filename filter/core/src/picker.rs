//! Decides which pod serves a request: weighted random choice in proportion to each pod's
//! smoothed score (the "power of scores" form of weighted random load balancing, as in GIE's
//! endpoint picker), corrected for the requests this sidecar already sent, never choosing a
//! pod that is cut off or whose breaker refuses it.
//!
//! Per pod, the draw weight is:
//! - 0 when cut (GPU hard limit, queue full, stale, hardware fault) or the breaker refuses
//!   (Open, or HalfOpen with its probe budget spent);
//! - else `max(ema × penalty, floorWeight)` where `ema = α·raw + (1-α)·ema` is updated once per
//!   new snapshot (first value = raw), and `penalty` is `cutoffs.slowdownFactor` while a GPU
//!   of the pod reports a hardware slowdown (NVML throttle reasons), or, the lower of that and
//!   its speed relative to the pool (pool median / its own), while the pod decodes
//!   `cutoffs.slowItlRatio` times slower than the pool's median (its median inter-token
//!   latency over the agent's recent window, 150 ms by default, against the median of the
//!   pool's pods that report one, at least three; a pod without a reading keeps its last
//!   judgement for up to 5 s), else 1: applied to the smoothed value, so it acts on the first
//!   snapshot that shows it;
//! - a pod with a snapshot but no usable reading (cold start) gets the pool MEAN of the pods
//!   with metrics that are not cut (neither 0 nor the best), floored likewise.
//!
//! The in-flight correction depends on `pickStrategy`:
//! - `twoChoices` (default): two distinct candidates are drawn by weight (up to three redraws
//!   for a distinct second one); a candidate where the request would start at once beats one
//!   where it would queue, then the lower load wins; on a tie the first draw wins, so with
//!   nothing in flight the shares are exactly score-proportional.
//!   - Waiting comes in tiers, compared first: none; queued (estimated occupancy at or over
//!     capacity, the snapshot shows more requests waiting than this VM has seen end since,
//!     its queue's head waits for KV cache,
//!     i.e. requests wait while seats are free, the GPU is over its hard limit, or a request
//!     to the pod just failed); the request does not fit the pod's estimated free KV cache
//!     itself, which frees only when enough running tokens end.
//!   - Queued candidates are compared by the service rounds the request would wait
//!     ([`PodRt::drain`]): the requests that start before it (those over the seats, or every
//!     one waiting while the head waits for KV) plus itself, over the requests running. So
//!     one request waiting behind a KV-blocked head on a pod running six beats thirty waiting
//!     for eight seats, and five waiting behind two running lose to twelve waiting for eight.
//!     (Ranking every KV-blocked queue below every seat queue sent all short traffic to the
//!     few pods without long prompts during a burst of them: queues of 20-34 there, seconds
//!     of TTFT.)
//!   - Load (the tie-break, and the measure in the other tiers) = the fuller of seats
//!     (occupancy over capacity) and KV cache (estimated use plus this request, over
//!     capacity). KV is judged only for pods that report their KV-cache capacity in tokens
//!     and its use.
//!   - Estimated occupancy = the latest snapshot's running + waiting, plus this VM's requests
//!     started since the model server was read for it (the snapshot's arrival less that
//!     reading's age: requests sent in between are not in its figures), minus those that
//!     ended since the snapshot (never below 0), over the
//!     pod's `queue_capacity` (else `cutoffs.maxQueue`). A request counts one seat on pods
//!     that report their KV cache; on others it counts by its body size against the running
//!     mean ([`Router::request_size`]: a long prompt counts for more). Without running/waiting
//!     in the snapshot: this VM's in-flight count (what least_request sees).
//!   - Estimated KV use = the snapshot's use × capacity, plus the KV tokens (prompt estimate
//!     plus `max_tokens`) of this VM's requests started since its reading, plus the
//!     `max_tokens` of those started before it and still in flight (the reading shows what
//!     they hold so far; they grow into their answer and hold it until they end). One that
//!     ends takes out only what it added; what the reading shows it holding stays until the
//!     next reading.
//!   - A big request (at least four times the mean request's KV tokens) counts as not
//!     fitting a pod whose queue's head waits for KV cache: the head takes what frees first.
//!     Between two pods where it would start at once it keeps the earlier draw (drawn by
//!     score) instead of the less loaded: sidecars rank pods on the same snapshot, and the
//!     least loaded of several draws is the same pod for all of them (herding).
//!   - Overflow: when the request would queue on the chosen pod, one pod cut by the GPU hard
//!     limit alone (score 0, breakers closed), drawn evenly, competes too, counted as queued:
//!     it wins only with the shorter wait (counted as `overflow_over_gpu_limit`). So a hot pod
//!     gets nothing while the drawn pods have free seats; when the whole pool runs hot,
//!     cutting it outright only herds its share onto the rest, which then run hot in turn.
//!   - A pod where one of this VM's requests failed in the last second counts as queued: a
//!     pod that fails fast has few requests in flight and would otherwise draw traffic.
//!   - A request that would wait for KV cache on both candidates draws up to four more and
//!     takes the best: it would otherwise wait at the head of that pod's queue, holding up
//!     every request behind it (head-of-line blocking).
//!   - A request reserving at least `longOutputTokens` output tokens (`max_tokens`, known when
//!     the body is read; 512 by default) draws two more candidates and goes where it would
//!     finish first: (its wait in service rounds × the mean output reservation + its own
//!     output) × the pod's smoothed recent inter-token latency (the agent's mean over its
//!     recent window, else the median), when that is at least 10 % sooner; else, or when
//!     either candidate has no reading in the last 5 s (idle), would wait for KV cache, or just
//!     failed a request, it is compared like any request. So in a pool that mixes GPU
//!     generations the longest answers (which set the end-to-end p99) land on the faster GPUs,
//!     and a pod decoding 5x slower loses them even with free seats.
//!
//!   Why: every sidecar scores from the same sampled snapshot, so one weighted draw sends all
//!   of them to the same "best" pods between updates (herding); the second choice on live
//!   occupancy is what least_request's power of two choices does, on top of the GPU-aware
//!   score. Each snapshot re-bases the estimates, so ends a VM never saw (a lost callback)
//!   cannot accumulate.
//! - `proportional`: one draw with each weight divided by `1 + d / capacity`, `d` = this VM's
//!   requests started since the pod's last snapshot net of ends (not below 0).
//!
//! The chosen pod comes first in the ranked list, then the next best pods by smoothed weight
//! (not HalfOpen ones: their probes are budgeted), up to `fallbackEndpoints`.
//!
//! Picking keeps a Fenwick tree of weights per (pool, requested model), so a pick costs
//! O(log n) with no heap allocation in the steady state; trees are rebuilt when the pool state
//! changes, a breaker changes, or a time deadline (staleness, cooldown) passes.

use std::collections::HashMap;

use rand::RngCore;

use crate::breaker::{
    Breaker, BreakerEvent, BreakerState, FailureWindow, Outcome, Transition, TripReason,
};
use crate::config::{BreakerConfig, FilterConfig, PickStrategy, MAX_FALLBACK_ENDPOINTS};
use crate::counters::Counters;
use crate::pool::{DecodeError, PoolState};
use crate::prefix::own::{pod_hash, rendezvous, OwnSends};
use crate::prefix::{PrefixAffinity, PromptKeys};
use crate::score::{score_in_pool, CutReason, Score};

/// Most entries in a ranked list (chosen + `MAX_FALLBACK_ENDPOINTS`).
pub const MAX_RANKED: usize = MAX_FALLBACK_ENDPOINTS + 1;

/// Prompt bytes per KV token in [`Router::request_size`] (English text runs ~4 characters per
/// token in the common BPE vocabularies).
const PROMPT_BYTES_PER_TOKEN: f64 = 4.0;

/// Bound of one request's KV estimate, so a huge `max_tokens` cannot overflow sums.
const MAX_REQUEST_KV_TOKENS: f64 = 1e9;

/// How long a failed request makes its pod count as queued for `twoChoices` (ms).
const RECENT_FAILURE_MS: u64 = 1000;

/// Extra candidates drawn for a request that fits neither first candidate's KV cache.
const KV_EXTRA_DRAWS: usize = 4;

/// Fewest pods reporting a recent inter-token latency for the pool's median to judge one
/// slow: with two, either could be the odd one.
const MIN_ITL_PODS: usize = 3;

/// How long a pod's last inter-token reading counts without a new one (too few tokens in its
/// window: an idle pod): long answers use its smoothed speed. Bounded, so a pod that no longer
/// gets enough traffic to show its speed is not judged on an old reading for ever.
const ITL_HOLD_MS: u64 = 5000;

/// How long a pod judged slow stays so without a reading that says otherwise (none comes
/// while it runs too few requests to fill its window with tokens, or while fewer than three
/// pods report one). Longer than [`ITL_HOLD_MS`] because the evidence is lopsided: a pod that
/// decodes at speed again shows it with a single request (at 5 ms a token, 30 tokens in the
/// agent's 150 ms window), while a slowed one, drawn at a fifth of its weight, often runs
/// just one and shows nothing; each lapse of the judgement gives the pod its full share back.
const SLOW_DECODE_HOLD_MS: u64 = 30_000;

/// How much sooner (relative) a long-output request must finish on a candidate to prefer it
/// over the usual comparison: readings cover ~150 ms of tokens, so small gaps are noise.
const DECODE_SPEED_MARGIN: f64 = 0.1;

/// Smoothing of each pod's inter-token latency for `longOutputTokens` (weight of a reading).
const DECODE_SPEED_ALPHA: f64 = 0.3;

/// More candidates a long-output request draws (`longOutputTokens`), after the first two.
const LONG_OUTPUT_EXTRA_DRAWS: usize = 2;

/// This VM's latest starts remembered per pod ([`RecentStarts`]): enough for the starts of
/// one engine reading's age (about 100-200 ms) at the rates one sidecar sends to one pod.
const RECENT_STARTS: usize = 8;

/// A request holding at least this many times the mean request's KV tokens is "big": it
/// counts as waiting for KV cache on a pod whose queue's head already waits for it (see
/// [`PodRt::pick_key`]), and among pods where it would start at once it keeps the earlier
/// draw instead of the less loaded (see [`Router::decide_for`]).
const BIG_KV_FACTOR: f64 = 4.0;

/// This VM's latest request starts to one pod (send time, size), newest overwriting oldest, so
/// a snapshot re-bases the in-flight estimates at the time the model server was read, not at
/// the time the snapshot arrived: requests sent in between (the reading's age, up to the
/// agent's sample interval and more) are not in its figures and stay counted on top of them.
/// Without it each snapshot erased them until the next one, and a sidecar sent a second long
/// prompt to the pod it had just filled (seen in hol-poisson-80: three sidecars each put two
/// 4 000-token prompts on one pod within 60-215 ms, the third waited 4-9 s for KV cache and
/// held up every short request behind it).
#[derive(Debug, Clone, Copy, Default)]
struct RecentStarts {
    /// (sent at ms, KV tokens, output tokens) of each remembered start still in flight.
    entries: [Option<(u64, f32, f32)>; RECENT_STARTS],
    next: u8,
}

impl RecentStarts {
    fn entry(at_ms: u64, size: &RequestSize) -> (u64, f32, f32) {
        (at_ms, size.kv_tokens as f32, size.output_tokens as f32)
    }

    fn push(&mut self, at_ms: u64, size: &RequestSize) {
        let i = usize::from(self.next) % RECENT_STARTS;
        if let Some(e) = self.entries.get_mut(i) {
            *e = Some(Self::entry(at_ms, size));
        }
        self.next = ((i + 1) % RECENT_STARTS) as u8;
    }

    /// Forgets the start at `at_ms` of a request of `size` that ended (if still remembered).
    fn remove(&mut self, at_ms: u64, size: &RequestSize) {
        let ended = Self::entry(at_ms, size);
        if let Some(e) = self.entries.iter_mut().find(|e| **e == Some(ended)) {
            *e = None;
        }
    }

    /// Count, KV tokens and output tokens of the remembered starts after `t_ms` (still in
    /// flight).
    fn after(&self, t_ms: u64) -> (u32, f64, f64) {
        self.entries
            .iter()
            .flatten()
            .filter(|e| e.0 > t_ms)
            .fold((0, 0.0, 0.0), |(n, kv, out), e| {
                (n + 1, kv + f64::from(e.1), out + f64::from(e.2))
            })
    }
}

/// How much one request counts in a VM's in-flight estimates ([`Router::request_size`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RequestSize {
    /// Seats it counts for on pods that do not report their KV cache (1 = a mean request).
    pub weight: f64,
    /// KV-cache tokens it will hold at most: prompt estimate plus output reservation.
    pub kv_tokens: f64,
    /// Output tokens it reserves (`max_tokens`), 0 when unknown: decides whether it prefers
    /// the faster-decoding pod (`longOutputTokens`).
    pub output_tokens: f64,
}

impl RequestSize {
    /// A request of unknown size: one seat, no KV estimate.
    pub const UNIT: RequestSize = RequestSize {
        weight: 1.0,
        kv_tokens: 0.0,
        output_tokens: 0.0,
    };
}

const NONE: u32 = u32::MAX;

/// A pod of one pool, valid for the pool layout it came from (see [`Router::address`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PodId(u32);

/// Chosen pod first, then fallbacks; fixed capacity, no heap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ranked {
    ids: [u32; MAX_RANKED],
    len: u8,
    generation: u64,
}

impl Ranked {
    fn new(generation: u64) -> Self {
        Self {
            ids: [NONE; MAX_RANKED],
            len: 0,
            generation,
        }
    }

    fn push(&mut self, id: u32) {
        if let Some(slot) = self.ids.get_mut(usize::from(self.len)) {
            *slot = id;
            self.len += 1;
        }
    }

    fn contains(&self, id: u32) -> bool {
        self.as_slice().contains(&id)
    }

    fn as_slice(&self) -> &[u32] {
        self.ids.get(..usize::from(self.len)).unwrap_or(&[])
    }

    pub fn len(&self) -> usize {
        usize::from(self.len)
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The chosen pod.
    pub fn first(&self) -> Option<PodId> {
        self.as_slice().first().map(|i| PodId(*i))
    }

    pub fn iter(&self) -> impl Iterator<Item = PodId> + '_ {
        self.as_slice().iter().map(|i| PodId(*i))
    }
}

/// Why the filter steers nothing and lets Envoy's fallback policy balance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FallbackReason {
    /// No event from the pool agent yet, or no pod with a serving address.
    NoAgentData,
    /// No pod serves the requested model.
    NoModel,
    /// Every candidate's metrics are stale.
    AllStale,
    /// Fewer than `minPods` candidates with fresh metrics.
    TooFewPods,
}

impl FallbackReason {
    pub fn as_str(&self) -> &'static str {
        match self {
            FallbackReason::NoAgentData => "no_agent_data",
            FallbackReason::NoModel => "no_model",
            FallbackReason::AllStale => "all_stale",
            FallbackReason::TooFewPods => "too_few_pods",
        }
    }
}

/// The routing decision for one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Decision {
    /// Steer to `ranked` (write it with [`Router::write_ranked`] into the routing header).
    Steer { ranked: Ranked, chosen_score: f64 },
    /// Steer nothing.
    Fallback(FallbackReason),
    /// Every candidate scored 0: one chosen uniformly among the candidates (cut pods
    /// included: failing open beats refusing everything), fallbacks following it.
    FailOpen { ranked: Ranked },
}

/// A pod's row on the scoreboard.
#[derive(Debug, Clone, PartialEq)]
pub struct PodStatus<'a> {
    pub address: &'a str,
    pub peer: &'a str,
    /// Smoothed score (0 when cut); for a cold pod the pool mean it was given.
    pub score: f64,
    /// The latest unsmoothed formula value.
    pub raw: f64,
    pub cut: Option<CutReason>,
    pub cold: bool,
    pub breaker: BreakerState,
    pub picks: u64,
    pub inflight: u32,
    /// Estimated occupancy over capacity, as `twoChoices` compares it (see the module docs).
    pub load: f64,
    /// Whether a new request would queue there, as `twoChoices` judges it.
    pub queued: bool,
    /// Estimated KV-cache use 0..1 (the snapshot's, moved by this VM's requests since), when
    /// the pod reports its KV capacity.
    pub kv: Option<f64>,
    /// The pod's error rate over its agent's window and the requests it covers, as reported.
    pub error_rate: Option<f64>,
    pub window_requests: Option<u64>,
    /// Metrics age at the status time (None when no snapshot).
    pub metrics_age_ms: Option<u64>,
    /// A GPU reports a hardware slowdown (the score is scaled by `cutoffs.slowdownFactor`).
    pub slowdown: bool,
    /// The pod decodes at least `cutoffs.slowItlRatio` times slower than the pool's median
    /// (its weight is scaled by its speed relative to the pool, at most `slowdownFactor`).
    pub slow_decode: bool,
    /// Its smoothed recent inter-token latency (ms), as `longOutputTokens` compares it; None
    /// without a reading in the last 5 s.
    pub decode_ms: Option<f64>,
    /// The GPU reading its score's GPU term used (`cutoffs.gpuSignal`); None: no GPU term.
    pub gpu_signal: Option<crate::signals::GpuReading>,
    /// That reading's value, 0..=1.
    pub gpu: Option<f64>,
    /// Key blocks its prefix cache holds, as its agent reports them (None: not reported).
    pub prefix_keys: Option<usize>,
    /// Its model server's prefix-cache hit rate (prompt tokens) over the agent's window.
    pub prefix_hit_rate: Option<f64>,
}

impl PodStatus<'_> {
    /// The value of the per-pod `score` gauges: the smoothed score x1000, 0..=1000.
    pub fn score_gauge_value(&self) -> u64 {
        (self.score.clamp(0.0, 1.0) * 1000.0).round() as u64
    }

    /// The value of the per-pod `gpu_signal` gauges
    /// ([`crate::signals::GpuReading::gauge_value`]).
    pub fn gpu_signal_gauge_value(&self) -> u64 {
        crate::signals::GpuReading::gauge_value(self.gpu_signal)
    }
}

#[derive(Debug, Clone)]
struct PodRt {
    address: String,
    /// [`pod_hash`] of the address (prefix affinity's rendezvous order).
    hash: u64,
    peer_idx: usize,
    /// The snapshot the EMA last consumed: (received_at_ms, sequence).
    seen: Option<(u64, u64)>,
    ema: Option<f64>,
    score: Score,
    cut: Option<CutReason>,
    /// Cut by the GPU hard limit alone (breakers closed), under `twoChoices`: not drawn, but
    /// an overflow candidate when the drawn ones would queue (see the module docs).
    hot: bool,
    cold: bool,
    /// Smoothed score with floor, 0 when cut or refused by the pod breaker.
    base: f64,
    /// Shown on the scoreboard.
    shown: f64,
    capacity: f64,
    /// Requests this VM sent to the pod that have not ended (never reset).
    inflight: u32,
    /// The same, each request weighted by its size (see [`Router::request_size`]).
    inflight_w: f64,
    /// `inflight` (unweighted: the snapshot counts every request as one) when the latest
    /// occupancy reading arrived.
    inflight_base: f64,
    /// Running + waiting of the latest snapshot that reported either.
    snap_occ: Option<f64>,
    /// Waiting of that snapshot: > 0 means the pod could not admit more (seats or KV full).
    snap_waiting: u32,
    /// This VM's requests to the pod that ended since that snapshot (see
    /// [`PodRt::waiting_now`]).
    ended_since_snap: u32,
    /// That snapshot showed requests waiting while seats were free (running below the
    /// reported `queue_capacity`): the head of its queue waits for KV cache, and every new
    /// request waits behind it until a running request finishes.
    head_blocked: bool,
    /// Sequence of the snapshot `snap_occ` came from.
    occ_seq: Option<u64>,
    /// KV-cache capacity in tokens of the latest snapshot; None when it does not report both
    /// capacity and use (the KV cache is then not judged).
    kv_cap: Option<f64>,
    /// KV tokens in use per that snapshot (use × capacity).
    snap_kv: f64,
    /// Output tokens reserved (`max_tokens`) by this VM's requests in flight (never reset).
    inflight_out: f64,
    /// KV tokens this VM counts on top of the latest reading (see [`PodRt::kv_used`]).
    kv_on_top: f64,
    /// When the model server was read for that reading (see
    /// [`crate::PodSignals::engine_sampled_at_ms`]), and when this VM took it in.
    kv_sampled_at_ms: u64,
    kv_taken_at_ms: u64,
    /// Sequence of the snapshot the KV reading came from.
    kv_seq: Option<u64>,
    /// This VM's latest starts, to re-base at the reading's time.
    recent: RecentStarts,
    picks: u64,
    breaker: Breaker,
    /// This VM's recent outcomes of the pod, for the failure-rate trip.
    window: FailureWindow,
    /// When this VM last saw a request to the pod fail.
    last_failure_ms: Option<u64>,
    model_breakers: Vec<(String, Breaker)>,
    serves_several: bool,
    /// Its recent inter-token latency is `cutoffs.slowItlRatio` times the pool's median.
    slow_decode: bool,
    /// When a reading last judged it slow (ms): bounds how long the judgement holds without one.
    slow_decode_seen_ms: u64,
    /// Its recent inter-token latency (ms; the window's mean, else its median), smoothed over
    /// snapshots ([`DECODE_SPEED_ALPHA`]).
    itl_ms: Option<f64>,
    /// When that last took a reading (ms).
    itl_at_ms: u64,
    /// Its draw-weight factor while slow: the pool's median over its inter-token latency, at
    /// most `cutoffs.slowdownFactor`.
    slow_decode_penalty: f64,
    /// Its smoothed inter-token latency over the pool's median of those (pods with a reading
    /// in the last [`ITL_HOLD_MS`], at least [`MIN_ITL_PODS`]), within
    /// [`MIN_REL_SPEED`]..=[`MAX_REL_SPEED`]; 1 without a reading or a median.
    rel_speed: f64,
}

impl PodRt {
    fn new(address: String, peer_idx: usize) -> Self {
        Self {
            hash: pod_hash(&address),
            address,
            peer_idx,
            seen: None,
            ema: None,
            score: Score {
                value: 0.0,
                raw: 0.0,
                cut: None,
                has_terms: false,
                penalty: 1.0,
                gpu_reading: None,
                gpu_value: None,
            },
            cut: None,
            hot: false,
            cold: true,
            base: 0.0,
            shown: 0.0,
            capacity: 1.0,
            inflight: 0,
            inflight_w: 0.0,
            inflight_base: 0.0,
            snap_occ: None,
            snap_waiting: 0,
            ended_since_snap: 0,
            head_blocked: false,
            occ_seq: None,
            kv_cap: None,
            snap_kv: 0.0,
            inflight_out: 0.0,
            kv_on_top: 0.0,
            kv_sampled_at_ms: 0,
            kv_taken_at_ms: 0,
            kv_seq: None,
            recent: RecentStarts::default(),
            picks: 0,
            breaker: Breaker::default(),
            window: FailureWindow::default(),
            last_failure_ms: None,
            model_breakers: Vec::new(),
            serves_several: false,
            slow_decode: false,
            slow_decode_seen_ms: 0,
            slow_decode_penalty: 1.0,
            rel_speed: 1.0,
            itl_ms: None,
            itl_at_ms: 0,
        }
    }

    /// What this VM's requests add to the latest occupancy reading: those in flight now,
    /// weighted by size, minus those in flight when it arrived, which the reading already
    /// counted as one each. So starts and ends since the reading move it, and a long prompt
    /// keeps its extra weight for as long as it runs. May be negative.
    fn delta_since_snapshot(&self) -> f64 {
        self.inflight_w - self.inflight_base
    }

    /// Estimated seats taken on the pod now, over its capacity: the snapshot's running +
    /// waiting moved by this VM's own starts and ends since; without an occupancy reading,
    /// this VM's in-flight requests (what least_request sees). When the pod reports its KV
    /// cache, a request is one seat (its size counts in the KV cache); otherwise each counts
    /// by its body size, the only hint of a long prompt.
    fn seat_load(&self) -> f64 {
        self.occupancy() / self.capacity
    }

    /// Estimated seats taken on the pod now (running + waiting), as [`PodRt::seat_load`]
    /// describes, before dividing by the capacity.
    fn occupancy(&self) -> f64 {
        let occ = if self.kv_cap.is_some() {
            match self.snap_occ {
                Some(o) => o + f64::from(self.inflight) - self.inflight_base,
                None => f64::from(self.inflight),
            }
        } else {
            match self.snap_occ {
                Some(o) => o + self.delta_since_snapshot(),
                None => self.inflight_w,
            }
        };
        occ.max(0.0)
    }

    /// Estimated KV tokens in use now: the snapshot's, plus, for this VM's requests in flight,
    /// the KV tokens of those sent after its model-server reading and the output reservation
    /// of those sent before (the reading shows what they hold so far, not the answer they
    /// grow into). None when unknown.
    ///
    /// A request that ends takes out only what it added on top: what the reading shows it
    /// holding stays until the next reading (at most one sample interval: the estimate errs
    /// full). Taking out its whole size made a request the reading never showed (it was still
    /// waiting for KV cache, holding none) leave the pod looking that much emptier than its
    /// reading until the next one, and the next long prompt went to the same full pod.
    fn kv_used(&self) -> Option<f64> {
        self.kv_cap?;
        Some(self.snap_kv + self.kv_on_top.max(0.0))
    }

    /// What a request of `size` sent at `sent_ms`, still in flight, counts on top of the
    /// latest KV reading: all of it when sent after the model server was read for it (or
    /// after this VM took the reading in), else its output reservation.
    fn kv_added(&self, size: &RequestSize, sent_ms: u64) -> f64 {
        if sent_ms > self.kv_sampled_at_ms || sent_ms >= self.kv_taken_at_ms {
            size.kv_tokens
        } else {
            size.output_tokens
        }
    }

    /// Whether a request holding `kv_tokens` would fit the KV cache now (true when unknown).
    fn fits(&self, kv_tokens: f64) -> bool {
        match (self.kv_used(), self.kv_cap) {
            (Some(used), Some(cap)) => used + kv_tokens <= cap,
            _ => true,
        }
    }

    /// The fuller of the two resources, seats and KV cache (with `kv_tokens` more), 0..
    fn load_with(&self, kv_tokens: f64) -> f64 {
        let seats = self.seat_load();
        match (self.kv_used(), self.kv_cap) {
            (Some(used), Some(cap)) => seats.max((used + kv_tokens) / cap),
            _ => seats,
        }
    }

    fn load(&self) -> f64 {
        self.load_with(0.0)
    }

    /// A request to the pod failed in the last [`RECENT_FAILURE_MS`]: it counts as queued. A
    /// pod that fails fast has few requests in flight and would otherwise look the freest.
    fn failed_recently(&self, now_ms: u64) -> bool {
        self.last_failure_ms
            .is_some_and(|t| now_ms.saturating_sub(t) < RECENT_FAILURE_MS)
    }

    /// Requests still waiting of those the latest snapshot showed waiting, as far as this VM
    /// can tell: each of its requests that ended since freed a seat and its KV cache, and a
    /// FIFO queue admits its head first, so that many have left the queue. Without this, one
    /// request caught waiting in a snapshot (arrived just before it) made the pod count as
    /// queued until the next snapshot, even after this VM saw it end.
    fn waiting_now(&self) -> u32 {
        self.snap_waiting.saturating_sub(self.ended_since_snap)
    }

    /// Whether a request holding `kv_tokens` would wait for KV cache there: it does not fit
    /// the estimated free KV cache, or the queue's head already waits for KV.
    fn waits_for_kv(&self, kv_tokens: f64) -> bool {
        self.head_blocked || !self.fits(kv_tokens)
    }

    /// Whether a big request holding `kv_tokens` has room here with `headroom` of the KV cache
    /// to spare (`bigRequestHold`): its queue's head does not wait for KV cache and the
    /// estimated use with it stays within the cache less that share (a request larger than
    /// that needs only to fit). True when the pod does not report its KV cache.
    fn room_for_big(&self, kv_tokens: f64, headroom: f64) -> bool {
        match (self.kv_used(), self.kv_cap) {
            (Some(used), Some(cap)) => {
                let spare = cap * (1.0 - headroom);
                let limit = if kv_tokens > spare { cap } else { spare };
                !self.head_blocked && used + kv_tokens <= limit
            }
            _ => true,
        }
    }

    /// How long a request sent to the pod now would wait to start, in service rounds (how
    /// many times the requests running there must turn over first); 0 when a seat is free for
    /// it. The requests that start before it (those over the seats or, while the queue's head
    /// waits for KV cache, every one waiting) plus itself, over how many run at once. So a
    /// long queue on a pod running eight requests can be the shorter wait, and a short queue
    /// behind two requests that hold the KV cache the longer.
    ///
    /// A pod judged slow ([`PodRt::slowness`] `s` > 1) turns over `s` times slower: it counts
    /// as a pod with `1/s` of its seats, turning over `1/s` of its running requests per round
    /// (at least one), so the wait is in full-speed rounds and a free seat on it is no free
    /// seat once its requests would fill its seats at its speed.
    fn drain(&self, slow: f64) -> f64 {
        let occ = self.occupancy();
        let running = match self.snap_occ {
            Some(o) => o - f64::from(self.snap_waiting),
            None => occ.min(self.capacity),
        }
        .max(1.0);
        let slots = if self.head_blocked {
            running
        } else {
            self.capacity
        };
        let (slots, running) = (slots / slow, (running / slow).max(1.0));
        if occ < slots {
            return 0.0;
        }
        (occ - slots + 1.0) / running
    }

    /// What two candidates are compared by for a request holding `kv_tokens` (lower wins):
    /// first how long it would wait, in tiers: 0 = starts at once; 1 = queues (seats taken at
    /// or over capacity, requests waiting in the snapshot and not since drained
    /// ([`PodRt::waiting_now`]), the queue's head waiting for KV
    /// cache, the GPU over its hard limit, or a recent failure); 2 = does not fit the
    /// estimated free KV cache itself, so it waits until enough running tokens end (a long
    /// prompt holds them for seconds). Within tier 0 and 2, the load with it (the score has
    /// already had its say in which two pods were drawn; dividing by it here would let a small
    /// score difference outweigh a long prompt's size; idle pods tie). Within tier 1, the
    /// estimated wait in service rounds ([`PodRt::drain`]), then the load: a queue behind a
    /// head that waits for KV cache is not always worse than a queue for seats (a pod that
    /// runs two requests and has three waiting turns over slower than one that runs eight
    /// with four waiting, but faster than one that runs eight with thirty waiting). A pod judged
    /// slow counts its load [`PodRt::slowness`] times, and its seats and turnover at that
    /// fraction ([`PodRt::drain`]): with three requests on eight seats at a quarter of the
    /// speed it is full, and loses to a full-speed pod with a short queue.
    ///
    /// `big`: the request holds [`BIG_KV_FACTOR`] times the mean request's KV tokens or
    /// more. Behind a head that waits for KV cache it waits for KV cache itself (tier 2): the
    /// head takes what frees first, and so many tokens more free only when several requests
    /// end, or a long one (seconds). Counted as a queue for seats, a long prompt went to the
    /// pod already blocked by another, the one with the fewest running.
    ///
    /// `headroom`: a big request under `bigRequestHold`; without room for it with that share
    /// of the KV cache to spare ([`PodRt::room_for_big`]) it counts as waiting for KV cache.
    fn pick_key(
        &self,
        kv_tokens: f64,
        big: bool,
        headroom: Option<f64>,
        now_ms: u64,
    ) -> (u8, f64, f64) {
        let slow = self.slowness();
        // Its seats are its seats: a faster pod's full batch still makes a request wait (for
        // a shorter time).
        let seats_slow = slow.max(1.0);
        let load = self.load_with(kv_tokens) * slow;
        if !self.fits(kv_tokens)
            || (big && self.head_blocked)
            || headroom.is_some_and(|h| !self.room_for_big(kv_tokens, h))
        {
            (2, 0.0, load)
        } else if self.head_blocked
            || self.hot
            || self.seat_load() * seats_slow >= 1.0
            || self.waiting_now() > 0
            || self.failed_recently(now_ms)
        {
            (1, self.drain(seats_slow) * slow.min(1.0), load)
        } else {
            (0, 0.0, load)
        }
    }

    /// How many times slower than its pool the pod turns its work over: 1 unless judged slow
    /// ([`PodRt::slowed`]), then 1 / its score penalty (4 for a GPU slowdown at the default
    /// `cutoffs.slowdownFactor`, about 5 for a pod decoding 5x slower than its pool). Its
    /// load and wait in [`PodRt::pick_key`] weigh that much more: a pod at a fifth of the
    /// speed with one request in flight is about as far from serving the next one as a pod at
    /// full speed with five. Without this, a slowed pod drawn against a busier one won on
    /// its lower load, or on a free seat against a pod with a short queue, and kept taking
    /// new requests in the first second after it slowed.
    /// (A penalty of 0, `cutoffs.slowdownFactor` 0, counts as 1000: finite, so an idle pod's
    /// zero load stays 0, not NaN.)
    ///
    /// A pod not judged slow counts at its decode speed relative to its pool
    /// ([`PodRt::rel_speed`], its inter-token latency over the pool's median): in a pool that
    /// mixes GPU generations an H100 decoding 1.6x faster than the A100s beside it turns its
    /// requests over that much sooner, so at the same load it is the less loaded, and its
    /// wait in a queue the shorter. Without this the faster pods of a mixed pool got less
    /// than least_request gave them (which sees their requests end sooner).
    fn slowness(&self) -> f64 {
        let judged = 1.0 / self.score.penalty.clamp(MIN_PENALTY, 1.0);
        if judged > 1.0 {
            judged.max(self.rel_speed)
        } else {
            self.rel_speed
        }
    }

    /// Judged to run slow: its GPU reports a hardware slowdown, or it decodes
    /// `cutoffs.slowItlRatio` times slower than its pool (its score carries the penalty).
    fn slowed(&self) -> bool {
        self.score.penalty < 1.0
    }

    /// Its smoothed inter-token latency (ms) if a reading came in the last
    /// [`ITL_HOLD_MS`] (an idle pod reports none, and an old one says little about it now).
    fn decode_ms(&self, now_ms: u64) -> Option<f64> {
        self.itl_ms
            .filter(|_| now_ms.saturating_sub(self.itl_at_ms) <= ITL_HOLD_MS)
    }

    /// Not a probe-budgeted pod (its breaker, or the model's, is not closed).
    fn half_open(&self, model: Option<&str>) -> bool {
        self.breaker.state() == BreakerState::HalfOpen
            || self
                .model_breaker(model)
                .is_some_and(|b| b.state() != BreakerState::Closed)
    }

    fn model_breaker(&self, model: Option<&str>) -> Option<&Breaker> {
        let m = model?;
        self.model_breakers
            .iter()
            .find(|(n, _)| n == m)
            .map(|(_, b)| b)
    }
}

/// The smallest score penalty [`PodRt::slowness`] divides by.
const MIN_PENALTY: f64 = 1e-3;

/// Bounds of a pod's decode speed relative to its pool ([`PodRt::rel_speed`]).
const MIN_REL_SPEED: f64 = 0.25;
const MAX_REL_SPEED: f64 = 8.0;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Verdict {
    Pick,
    Fallback(FallbackReason),
}

#[derive(Debug, Clone)]
struct View {
    model: Option<String>,
    slots: Vec<u32>,
    slot_of: Vec<u32>,
    w: Vec<f64>,
    tree: Vec<f64>,
    order: Vec<u32>,
    /// Pods cut only by the GPU hard limit ([`PodRt::hot`]): `twoChoices` overflow candidates.
    hot: Vec<u32>,
    verdict: Verdict,
}

impl View {
    fn new(model: Option<&str>) -> Self {
        Self {
            model: model.map(str::to_string),
            slots: Vec::new(),
            slot_of: Vec::new(),
            w: Vec::new(),
            tree: Vec::new(),
            order: Vec::new(),
            hot: Vec::new(),
            verdict: Verdict::Fallback(FallbackReason::NoAgentData),
        }
    }

    fn add(&mut self, slot: usize, delta: f64) {
        let mut i = slot + 1;
        while let Some(t) = self.tree.get_mut(i) {
            *t += delta;
            i += i & i.wrapping_neg();
        }
    }

    fn total(&self) -> f64 {
        let mut i = self.slots.len();
        let mut s = 0.0;
        while i > 0 {
            s += self.tree.get(i).copied().unwrap_or(0.0);
            i &= i - 1;
        }
        s
    }

    /// Smallest slot whose prefix sum exceeds `u`.
    fn find(&self, mut u: f64) -> usize {
        let n = self.slots.len();
        let mut pos = 0usize;
        let mut step = if n == 0 {
            0
        } else {
            1usize << (usize::BITS - 1 - n.leading_zeros())
        };
        while step > 0 {
            let next = pos + step;
            if next <= n {
                let t = self.tree.get(next).copied().unwrap_or(0.0);
                if t <= u {
                    pos = next;
                    u -= t;
                }
            }
            step >>= 1;
        }
        pos.min(n.saturating_sub(1))
    }

    fn set(&mut self, slot: usize, value: f64) {
        let old = self.w.get(slot).copied().unwrap_or(0.0);
        if let Some(w) = self.w.get_mut(slot) {
            *w = value;
        }
        self.add(slot, value - old);
    }
}

#[derive(Debug, Clone, Default)]
struct PoolRt {
    state: PoolState,
    pods: Vec<PodRt>,
    by_addr: HashMap<String, u32>,
    views: Vec<View>,
    generation: u64,
    next_refresh_ms: u64,
    dirty: bool,
    /// Pool mean of smoothed scores of pods with metrics that are not cut.
    mean: f64,
    /// Scratch for the pool's median recent inter-token latency (kept to avoid allocating).
    itl_scratch: Vec<f64>,
    /// This VM's recent sends of prompt prefixes, by pod id (`prefixAffinity`).
    own: OwnSends,
}

/// The routing state of every configured pool. Single-threaded (one per wasm VM).
#[derive(Debug)]
pub struct Router {
    cfg: FilterConfig,
    pools: Vec<PoolRt>,
    counters: Counters,
    events: Vec<BreakerEvent>,
    /// Breakers opened (or kept open) by an agent's signal since the glue last took them: one
    /// entry per pool and pod, so the list stays bounded by the pool sizes.
    signal_trips: Vec<SignalTrip>,
    /// Running mean of request body sizes, for [`Router::request_size`].
    mean_body_bytes: Option<f64>,
    /// Running mean of the output reservations (`max_tokens`) of requests that state one: a
    /// service round's length in a long answer's estimated finish.
    mean_output_tokens: Option<f64>,
}

/// Tokens of a prompt that name its prefix for the rendezvous order: the key of its key block
/// ending here (or its last, if shorter). Short enough that a system prompt's requests share
/// it whatever their questions, long enough that a common boilerplate opening does not send
/// every new prefix to one pod.
const RENDEZVOUS_KEY_TOKENS: usize = 256;

/// The prefix-affinity candidates of a request (`prefixAffinity`).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Affinity {
    /// The pod holding the prompt's prefix that would start it soonest (ties: more held).
    holder: Option<u32>,
    /// The rendezvous pod among the pods that do not hold it: where a new prompt goes, and
    /// where a held one spills, the same pod from every sidecar.
    meet: Option<u32>,
}

/// How two holders of a prompt's prefix compare when neither waits for KV cache (tier 0 or 1 of
/// [`PodRt::pick_key`]), lower first: the wait in service rounds less `queueSlackRounds` times
/// the share of the prompt held (`held` of `blocks` key blocks). So a pod holding a whole
/// conversation with a short queue beats one holding only its system prompt with a free seat,
/// and loses to it once its queue is longer than the prefill it saves is worth. None when
/// either waits for KV cache (compared by tier then).
fn holder_wait(k: (u8, f64, f64), held: usize, blocks: usize, slack: f64) -> Option<f64> {
    (k.0 <= 1).then(|| k.1 - slack * held as f64 / blocks.max(1) as f64)
}

/// Among the pods with a draw weight (never a cut pod or one its breaker refuses): the holder
/// of at least `minMatchBlocks` of the prompt's leading key blocks that would start it soonest,
/// its wait less the slack the share it holds earns ([`holder_wait`]; then the one holding
/// more, then `key`, then the rendezvous order); and, when the prompt is at least
/// `rendezvousMinTokens` long, the rendezvous pod of the others, by the key of the prompt's
/// first [`RENDEZVOUS_KEY_TOKENS`] tokens.
fn affinity_candidate(
    p: &PoolRt,
    view: &View,
    q: &PromptKeys,
    cfg: &PrefixAffinity,
    held: &impl Fn(u32) -> usize,
    key: &impl Fn(u32) -> (u8, f64, f64),
) -> Affinity {
    let bt = q.block_tokens.max(1) as usize;
    let rk_idx = (RENDEZVOUS_KEY_TOKENS / bt)
        .max(1)
        .min(q.keys.len())
        .saturating_sub(1);
    let rkey = q.keys.get(rk_idx).copied().unwrap_or(0);
    let hrw = |id: u32| {
        p.pods
            .get(id as usize)
            .map_or(0, |r| rendezvous(rkey, r.hash))
    };
    let min = cfg.min_match_blocks as usize;
    let mut holder: Option<(u32, (u8, f64, f64), usize)> = None;
    let mut meet: Option<u32> = None;
    for (slot, &id) in view.slots.iter().enumerate() {
        if view.w.get(slot).copied().unwrap_or(0.0) <= 0.0 {
            continue;
        }
        let h = held(id);
        if h < min {
            if meet.is_none_or(|m| hrw(id) > hrw(m)) {
                meet = Some(id);
            }
            continue;
        }
        let k = key(id);
        let (slack, n) = (cfg.queue_slack_rounds, q.keys.len());
        let wins = holder.is_none_or(|(b, kb, hb)| {
            match (holder_wait(k, h, n, slack), holder_wait(kb, hb, n, slack)) {
                (Some(w), Some(wb)) if w != wb => return w < wb,
                (Some(_), None) => return true,
                (None, Some(_)) => return false,
                _ => {}
            }
            k.0 < kb.0
                || (k.0 == kb.0
                    && (h > hb || (h == hb && (k < kb || (k == kb && hrw(id) > hrw(b))))))
        });
        if wins {
            holder = Some((id, k, h));
        }
    }
    Affinity {
        holder: holder.map(|(id, _, _)| id),
        meet: meet.filter(|_| !q.keys.is_empty() && q.tokens >= cfg.rendezvous_min_tokens),
    }
}

fn uniform01(rng: &mut (impl RngCore + ?Sized)) -> f64 {
    (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// One slot drawn in proportion to the view's weights (`total` > 0).
fn draw(view: &View, total: f64, rng: &mut (impl RngCore + ?Sized)) -> usize {
    let u = uniform01(rng) * total;
    let slot = view.find(u);
    if view.w.get(slot).copied().unwrap_or(0.0) > 0.0 {
        return slot;
    }
    // Rounding landed on a zero-weight slot: take the nearest positive one.
    let n = view.w.len();
    (0..n)
        .map(|k| (slot + k) % n)
        .find(|s| view.w.get(*s).copied().unwrap_or(0.0) > 0.0)
        .unwrap_or(slot)
}

fn effective(pod: &PodRt, model: Option<&str>, cfg: &FilterConfig) -> f64 {
    if pod.base <= 0.0 {
        return 0.0;
    }
    if let Some(b) = pod.model_breaker(model) {
        if !b.admits(&cfg.breaker) {
            return 0.0;
        }
    }
    match cfg.pick_strategy {
        PickStrategy::TwoChoices => pod.base,
        PickStrategy::Proportional => {
            pod.base / (1.0 + pod.delta_since_snapshot().max(0.0) / pod.capacity)
        }
    }
}

/// A pod's breaker tripped by what its agent reported (a hardware fault, its error rate), for
/// the glue to carry into the breaker shared by every worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignalTrip {
    pub pool_idx: usize,
    /// Serving address `IP:PORT`.
    pub pod: String,
    pub reason: TripReason,
}

/// Requests the agent's window must hold before its error rate can open the pod's breaker:
/// `failureRateMinRequests`, or a single one for a pod on probation (it failed recently: after
/// a cooldown the first sidecar's probes are the only traffic it gets, and a pod failing half
/// its requests passes one sidecar's probes one time in 2^probes, so the first failed probe
/// that its agent counts re-opens it on every sidecar).
fn agent_min_requests(b: &Breaker, now_ms: u64, cfg: &BreakerConfig) -> u32 {
    if b.on_probation(now_ms, cfg) {
        1
    } else {
        cfg.failure_rate_min_requests
    }
}

fn push_event(
    events: &mut Vec<BreakerEvent>,
    counters: &mut Counters,
    pod: &str,
    model: Option<&str>,
    t: Transition,
) {
    counters.count_transition(t.to);
    events.push(BreakerEvent {
        pod: pod.to_string(),
        model: model.map(str::to_string),
        from: t.from,
        to: t.to,
        reason: t.reason,
    });
}

impl Router {
    /// A router for every pool of `cfg`, with no agent data yet.
    pub fn new(cfg: FilterConfig) -> Self {
        let pools = cfg.pools.iter().map(|_| PoolRt::default()).collect();
        Self {
            cfg,
            pools,
            counters: Counters::default(),
            events: Vec::new(),
            signal_trips: Vec::new(),
            mean_body_bytes: None,
            mean_output_tokens: None,
        }
    }

    pub fn config(&self) -> &FilterConfig {
        &self.cfg
    }

    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    pub fn counters_mut(&mut self) -> &mut Counters {
        &mut self.counters
    }

    /// Time-driven breaker transitions (Open → HalfOpen) seen since the last call.
    pub fn take_breaker_events(&mut self) -> Vec<BreakerEvent> {
        std::mem::take(&mut self.events)
    }

    /// Pods whose agent's snapshot tripped (or would have tripped) their breaker since the last
    /// call: a hardware fault, or the agent's error rate (`breaker.agentErrorRate`). Every
    /// worker sees the same snapshots; the glue carries these into the shared breaker so the
    /// trip is counted once and a probe budget is not handed out while the agent still reports
    /// the pod failing.
    pub fn take_signal_trips(&mut self) -> Vec<SignalTrip> {
        std::mem::take(&mut self.signal_trips)
    }

    pub fn pool_state(&self, pool_idx: usize) -> Option<&PoolState> {
        self.pools.get(pool_idx).map(|p| &p.state)
    }

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

    /// Recomputes scores, breaker polls and every view's tree.
    fn refresh(&mut self, pool_idx: usize, now_ms: u64) {
        let cfg = &self.cfg;
        let Some(p) = self.pools.get_mut(pool_idx) else {
            return;
        };
        let Some(pool_cfg) = cfg.pools.get(pool_idx) else {
            return;
        };
        let mut next = u64::MAX;
        let mut mean_sum = 0.0;
        let mut mean_n = 0u32;
        // More than half of the pool's pods fail at the agent threshold: a pool-wide problem,
        // not a pod to cut (cutting them all would only fail open).
        let pool_wide_errors = cfg.breaker.agent_error_rate > 0.0 && {
            let (mut pods, mut failing) = (0u32, 0u32);
            for sig in p.state.peers().iter().filter_map(|e| e.signals.as_ref()) {
                pods += 1;
                if sig.failing(
                    cfg.breaker.agent_error_rate,
                    cfg.breaker.failure_rate_min_requests,
                ) {
                    failing += 1;
                }
            }
            2 * failing > pods
        };
        let itl_median = median_recent_itl(&p.state, &mut p.itl_scratch, cfg, now_ms);
        // The pool's mean GPU reading, for the pods that lack it (see `score_in_pool`).
        let gpu_fill = {
            let (mut sum, mut n) = (0.0, 0u32);
            for sig in p.state.peers().iter().filter_map(|e| e.signals.as_ref()) {
                if !sig.has_metrics || sig.is_stale(now_ms, cfg.cutoffs.staleness_ms) {
                    continue;
                }
                if let Some((_, g)) = sig.gpu_load(cfg.cutoffs.gpu_signal) {
                    if g.is_finite() {
                        sum += g.clamp(0.0, 1.0);
                        n += 1;
                    }
                }
            }
            (n > 0).then(|| sum / f64::from(n))
        };
        for pod in p.pods.iter_mut() {
            let Some(entry) = p.state.peers().get(pod.peer_idx) else {
                continue;
            };
            let Some(sig) = entry.signals.as_ref() else {
                continue;
            };
            let weights = pool_cfg.weights_for(&pod.address);
            let mut s = score_in_pool(sig, weights, &cfg.cutoffs, now_ms, gpu_fill);
            // No reading (too few tokens in the window: a slow pod running one request
            // decodes fewer than a fast one): the last judgement holds for a while.
            let slow = sig.has_metrics
                && match (itl_median, sig.itl_recent_ms) {
                    (Some(median), Some(itl)) => {
                        let slow = itl >= median * cfg.cutoffs.slow_itl_ratio;
                        if slow {
                            pod.slow_decode_seen_ms = now_ms;
                            // Its speed relative to the pool: a pod decoding 5x slower serves
                            // about a fifth as much.
                            pod.slow_decode_penalty =
                                (median / itl).min(cfg.cutoffs.slowdown_factor).max(0.0);
                        }
                        slow
                    }
                    // No reading of its own, or nothing to compare it with: the judgement
                    // last made holds for a while. Without its own reading the pool may drop
                    // under three pods reporting *because* the slow pod has too few tokens;
                    // and a fast pod between requests briefly has too few tokens too, which
                    // says nothing about this pod. Neither may clear it (a pod judged slow
                    // then flapped back to its full share). Switched off, no pod is ever
                    // judged slow, so nothing holds.
                    _ => {
                        pod.slow_decode
                            && now_ms.saturating_sub(pod.slow_decode_seen_ms) <= SLOW_DECODE_HOLD_MS
                    }
                };
            if slow && !pod.slow_decode {
                self.counters.slow_decode += 1;
            }
            pod.slow_decode = slow;
            if slow {
                s.penalty = s.penalty.min(pod.slow_decode_penalty);
                s.value = s.value.min(s.raw * s.penalty);
            }
            let key = (entry.received_at_ms, sig.sequence);
            let fresh = pod.seen != Some(key);
            if fresh {
                pod.seen = Some(key);
                // The mean where the model server exports it: a long answer takes about
                // output × mean, and the median is limited to its bucket (vLLM's first ends
                // at 10 ms).
                if let Some(itl) = sig
                    .itl_recent_mean_ms
                    .or(sig.itl_recent_ms)
                    .filter(|_| sig.has_metrics)
                {
                    pod.itl_ms = Some(match pod.itl_ms {
                        Some(e) if pod.decode_ms(now_ms).is_some() => {
                            DECODE_SPEED_ALPHA * itl + (1.0 - DECODE_SPEED_ALPHA) * e
                        }
                        _ => itl,
                    });
                    pod.itl_at_ms = now_ms;
                }
                if s.has_terms {
                    pod.ema = Some(match pod.ema {
                        Some(e) => cfg.ema_alpha * s.raw + (1.0 - cfg.ema_alpha) * e,
                        None => s.raw,
                    });
                }
                // This VM's requests sent after the model server was read are not in the
                // reading: they stay counted on top of it.
                let (n_after, kv_after, out_after) = pod.recent.after(sig.engine_sampled_at_ms);
                if (sig.running.is_some() || sig.waiting.is_some())
                    && pod.occ_seq != Some(sig.sequence)
                {
                    pod.occ_seq = Some(sig.sequence);
                    pod.inflight_base = f64::from(pod.inflight.saturating_sub(n_after));
                    pod.snap_waiting = sig.waiting.unwrap_or(0);
                    pod.ended_since_snap = 0;
                    pod.head_blocked = pod.snap_waiting > 0
                        && sig
                            .queue_capacity
                            .is_some_and(|c| sig.running.unwrap_or(0) < c);
                    pod.snap_occ = Some(
                        f64::from(sig.running.unwrap_or(0)) + f64::from(sig.waiting.unwrap_or(0)),
                    );
                }
                match (sig.kv_capacity_tokens, sig.kv_usage) {
                    (Some(cap), Some(used)) => {
                        if pod.kv_seq != Some(sig.sequence) {
                            let cap = cap as f64;
                            pod.kv_seq = Some(sig.sequence);
                            pod.kv_cap = Some(cap);
                            pod.snap_kv = used * cap;
                            // Requests sent before the reading: it shows what they hold
                            // now (their prompt once prefilled, the tokens generated so
                            // far), not the output they will grow into and hold until they
                            // end. That reservation stays counted on top.
                            let out_before = (pod.inflight_out - out_after).max(0.0);
                            pod.kv_on_top = kv_after + out_before;
                            pod.kv_sampled_at_ms = sig.engine_sampled_at_ms;
                            pod.kv_taken_at_ms = now_ms;
                        }
                    }
                    _ => {
                        pod.kv_cap = None;
                        pod.kv_seq = None;
                    }
                }
            }
            // The agent's error rate is judged on each new snapshot, and again whenever the
            // breaker is due to half-open (or already is): while the latest snapshot still
            // shows the pod failing, probing it would only confirm that, so the breaker stays
            // open for another, doubled, cooldown.
            let due = match pod.breaker.state() {
                BreakerState::Open => now_ms >= pod.breaker.open_until_ms(),
                BreakerState::HalfOpen => true,
                BreakerState::Closed => false,
            };
            let signal_trip = if fresh && sig.hardware_fault {
                Some(TripReason::HardwareFault)
            } else if (fresh || due)
                && cfg.breaker.agent_error_rate > 0.0
                && sig.failing(
                    cfg.breaker.agent_error_rate,
                    agent_min_requests(&pod.breaker, now_ms, &cfg.breaker),
                )
            {
                if pool_wide_errors {
                    if fresh {
                        self.counters.agent_errors_pool_wide += 1;
                    }
                    None
                } else {
                    Some(TripReason::AgentErrorRate)
                }
            } else {
                None
            };
            if let Some(reason) = signal_trip {
                if let Some(t) = pod.breaker.trip(reason, now_ms, &cfg.breaker) {
                    push_event(&mut self.events, &mut self.counters, &pod.address, None, t);
                }
                let known = self
                    .signal_trips
                    .iter_mut()
                    .find(|s| s.pool_idx == pool_idx && s.pod == pod.address);
                match known {
                    Some(s) => s.reason = reason,
                    None => self.signal_trips.push(SignalTrip {
                        pool_idx,
                        pod: pod.address.clone(),
                        reason,
                    }),
                }
            }
            if let Some(t) = pod.breaker.poll(now_ms, &cfg.breaker) {
                push_event(&mut self.events, &mut self.counters, &pod.address, None, t);
            }
            for (m, b) in pod.model_breakers.iter_mut() {
                if let Some(t) = b.poll(now_ms, &cfg.breaker) {
                    push_event(
                        &mut self.events,
                        &mut self.counters,
                        &pod.address,
                        Some(m),
                        t,
                    );
                }
                if b.state() == BreakerState::Open {
                    next = next.min(b.open_until_ms());
                } else if b.state() == BreakerState::HalfOpen {
                    next = next.min(now_ms.saturating_add(cfg.breaker.base_cooldown_ms));
                }
            }
            match pod.breaker.state() {
                BreakerState::Open => next = next.min(pod.breaker.open_until_ms()),
                BreakerState::HalfOpen => {
                    next = next.min(now_ms.saturating_add(cfg.breaker.base_cooldown_ms))
                }
                BreakerState::Closed => {}
            }
            // A pod cut for load (GPU hard limit, queue full) is still an overflow candidate,
            // so its going stale must be noticed on time too.
            if s.cut != Some(CutReason::Stale) && !sig.peer_stale {
                next = next.min(sig.stale_at_ms(cfg.cutoffs.staleness_ms));
            }
            pod.score = s;
            pod.cold = !s.has_terms || pod.ema.is_none();
            pod.cut = s.cut.or_else(|| {
                (!pod.breaker.admits(&cfg.breaker)).then(|| {
                    CutReason::Breaker(pod.breaker.reason().unwrap_or(TripReason::ServerErrors))
                })
            });
            pod.capacity = f64::from(sig.queue_capacity.unwrap_or(cfg.cutoffs.max_queue).max(1));
            pod.serves_several = sig.models.len() > 1;
            if pod.cut.is_none() && !pod.cold {
                let e = pod.ema.unwrap_or(0.0);
                mean_sum += e;
                mean_n += 1;
            }
        }
        let mean = if mean_n > 0 {
            mean_sum / f64::from(mean_n)
        } else {
            0.0
        };
        p.mean = mean;
        // Each pod's decode speed relative to the pool: its smoothed inter-token latency over
        // the median of the pods with a recent one.
        p.itl_scratch.clear();
        p.itl_scratch
            .extend(p.pods.iter().filter_map(|r| r.decode_ms(now_ms)));
        let median = if p.itl_scratch.len() >= MIN_ITL_PODS {
            p.itl_scratch.sort_unstable_by(f64::total_cmp);
            let n = p.itl_scratch.len();
            let hi = p.itl_scratch.get(n / 2).copied().unwrap_or(0.0);
            let lo = p.itl_scratch.get((n - 1) / 2).copied().unwrap_or(hi);
            Some((lo + hi) / 2.0).filter(|m| *m > 0.0)
        } else {
            None
        };
        for pod in p.pods.iter_mut() {
            pod.rel_speed = match (median, pod.decode_ms(now_ms)) {
                (Some(m), Some(d)) => (d / m).clamp(MIN_REL_SPEED, MAX_REL_SPEED),
                _ => 1.0,
            };
        }
        for pod in p.pods.iter_mut() {
            let value = if pod.cold {
                mean
            } else {
                pod.ema.unwrap_or(0.0)
            } * pod.score.penalty;
            pod.shown = if pod.cut.is_some() { 0.0 } else { value };
            // Cut by the GPU hard limit alone: an overflow candidate under twoChoices.
            pod.hot = cfg.pick_strategy == PickStrategy::TwoChoices
                && pod.cut == Some(CutReason::GpuHardLimit)
                && !pod.cold
                && pod.breaker.admits(&cfg.breaker)
                && pod.breaker.state() == BreakerState::Closed;
            pod.base = if pod.cut.is_some() || (pod.cold && mean_n == 0) {
                0.0
            } else {
                value.max(cfg.floor_weight).clamp(0.0, 1.0)
            };
        }
        p.next_refresh_ms = next;
        p.dirty = false;
        // Rebuild existing views in place (buffers keep their capacity).
        let mut views = std::mem::take(&mut p.views);
        for v in views.iter_mut() {
            build_view(v, p, cfg);
        }
        p.views = views;
    }

    /// Decides where one request of `model` (None: any) goes, at `now_ms`, not knowing its
    /// size ([`RequestSize::UNIT`]).
    pub fn decide(
        &mut self,
        pool_idx: usize,
        model: Option<&str>,
        now_ms: u64,
        rng: &mut (impl RngCore + ?Sized),
    ) -> Decision {
        self.decide_for(pool_idx, model, RequestSize::UNIT, now_ms, rng)
    }

    /// Decides where one request of `model` (None: any) and `size` goes, at `now_ms`.
    pub fn decide_for(
        &mut self,
        pool_idx: usize,
        model: Option<&str>,
        size: RequestSize,
        now_ms: u64,
        rng: &mut (impl RngCore + ?Sized),
    ) -> Decision {
        self.decide_with(pool_idx, model, size, None, now_ms, rng)
    }

    /// [`Router::decide_for`] for a request whose prompt was keyed ([`Router::prefix_space`],
    /// [`crate::prefix::keys::keys_of`]): with `prefixAffinity` on and `twoChoices`, a pod
    /// holding its prefix competes too (see [`crate::prefix`]).
    pub fn decide_with(
        &mut self,
        pool_idx: usize,
        model: Option<&str>,
        size: RequestSize,
        prompt: Option<&PromptKeys>,
        now_ms: u64,
        rng: &mut (impl RngCore + ?Sized),
    ) -> Decision {
        let Some(vi) = self.fresh_view(pool_idx, model, now_ms) else {
            self.counters.fallback_no_agent_data += 1;
            return Decision::Fallback(FallbackReason::NoAgentData);
        };
        let big = self.kv_is_big(size.kv_tokens);
        let cfg = &self.cfg;
        let headroom = cfg.big_request_hold.filter(|_| big).map(|h| h.kv_headroom);
        let Some(p) = self.pools.get_mut(pool_idx) else {
            return Decision::Fallback(FallbackReason::NoAgentData);
        };
        let Some(view) = p.views.get(vi) else {
            return Decision::Fallback(FallbackReason::NoAgentData);
        };
        if let Verdict::Fallback(r) = view.verdict {
            let c = &mut self.counters;
            match r {
                FallbackReason::NoAgentData => c.fallback_no_agent_data += 1,
                FallbackReason::NoModel => c.fallback_no_model += 1,
                FallbackReason::AllStale => c.fallback_all_stale += 1,
                FallbackReason::TooFewPods => c.fallback_too_few_pods += 1,
            }
            return Decision::Fallback(r);
        }
        let total = view.total();
        let mut ranked = Ranked::new(p.generation);
        if total <= 1e-12 {
            let n = view.slots.len();
            if n == 0 {
                self.counters.fallback_no_agent_data += 1;
                return Decision::Fallback(FallbackReason::NoAgentData);
            }
            // Every pod cut. Those cut only for load (GPU hard limit, queue full) can still
            // serve; a pod cut for its health (breaker, stale or faulty) gets a request only
            // when no other is left.
            let load_only = |slot: usize| {
                view.slots
                    .get(slot)
                    .and_then(|id| p.pods.get(*id as usize))
                    .is_some_and(|r| {
                        matches!(
                            r.cut,
                            None | Some(CutReason::GpuHardLimit | CutReason::QueueFull)
                        ) && r.breaker.admits(&cfg.breaker)
                            && r.model_breaker(view.model.as_deref())
                                .is_none_or(|b| b.admits(&cfg.breaker))
                    })
            };
            let eligible = (0..n).filter(|&k| load_only(k)).count();
            let (m, ok): (usize, &dyn Fn(usize) -> bool) = if eligible > 0 {
                (eligible, &load_only)
            } else {
                (n, &|_| true)
            };
            // The `r`-th slot (0-based) that `ok` admits.
            let nth = |r: usize| (0..n).filter(|&k| ok(k)).nth(r).unwrap_or(0);
            let first = usize::try_from(rng.next_u64() % m as u64).unwrap_or(0);
            let mut start = nth(first);
            if cfg.pick_strategy == PickStrategy::TwoChoices && m > 1 {
                // Two even draws, the one that can take the request sooner, as least_request
                // would.
                let other = nth((first
                    + 1
                    + usize::try_from(rng.next_u64() % (m as u64 - 1)).unwrap_or(0))
                    % m);
                let key = |slot: usize| {
                    view.slots
                        .get(slot)
                        .and_then(|id| p.pods.get(*id as usize))
                        .map_or((u8::MAX, f64::INFINITY, f64::INFINITY), |r| {
                            r.pick_key(size.kv_tokens, big, headroom, now_ms)
                        })
                };
                if key(other) < key(start) {
                    start = other;
                }
            }
            for k in (0..n)
                .map(|k| (start + k) % n)
                .filter(|&k| ok(k))
                .take(cfg.fallback_endpoints + 1)
            {
                if let Some(id) = view.slots.get(k) {
                    ranked.push(*id);
                }
            }
            if let Some(pod) = ranked.first().and_then(|id| p.pods.get_mut(id.0 as usize)) {
                pod.picks += 1;
            }
            self.counters.fail_open += 1;
            return Decision::FailOpen { ranked };
        }
        let first = draw(view, total, rng);
        let Some(&a) = view.slots.get(first) else {
            self.counters.fallback_no_agent_data += 1;
            return Decision::Fallback(FallbackReason::NoAgentData);
        };
        let mut chosen = a;
        if cfg.pick_strategy == PickStrategy::TwoChoices {
            // A second, distinct candidate (a few redraws: a dominant pod may come up twice).
            let mut second = None;
            for _ in 0..3 {
                let s = draw(view, total, rng);
                if s != first {
                    second = view.slots.get(s).copied();
                    break;
                }
            }
            let need = size.kv_tokens;
            // Prefix affinity: how many of the prompt's leading key blocks each pod holds.
            let aff_cfg = cfg.prefix_affinity;
            let prompt = prompt.filter(|q| aff_cfg.is_some() && !q.keys.is_empty());
            let own = prompt.and_then(|q| {
                let ttl = aff_cfg.map_or(0, |c| c.own_ttl_ms);
                p.own.leading_match(&q.keys, now_ms, ttl)
            });
            let held = |id: u32| -> usize {
                let Some(q) = prompt else { return 0 };
                let reported = p
                    .pods
                    .get(id as usize)
                    .and_then(|r| p.state.peers().get(r.peer_idx))
                    .and_then(|e| e.signals.as_ref())
                    .and_then(|s| s.prefix.as_ref())
                    .map_or(0, |set| set.held(q));
                let mine = own.filter(|(pod, _)| *pod == id).map_or(0, |(_, n)| n);
                reported.max(mine)
            };
            // The KV cache a request needs on a pod: less the prompt tokens it holds there
            // (shared with the requests running there; at least the last prompt token is
            // computed anew, and the output is always new).
            let need_on = |id: u32| -> f64 {
                let Some(q) = prompt else { return need };
                let cached = (held(id) as f64) * f64::from(q.block_tokens);
                let prompt_part = (need - size.output_tokens - 1.0).max(0.0);
                need - cached.min(prompt_part)
            };
            let key = |id: u32| {
                p.pods
                    .get(id as usize)
                    .map_or((u8::MAX, f64::INFINITY, f64::INFINITY), |r| {
                        r.pick_key(need_on(id), big, headroom, now_ms)
                    })
            };
            let affinity = match (prompt, aff_cfg) {
                (Some(q), Some(c)) => Some(affinity_candidate(p, view, q, &c, &held, &key)),
                _ => None,
            };
            let holder = affinity.and_then(|a| a.holder);
            let meet = affinity.and_then(|a| a.meet);
            // A candidate's affinity, 0..1: the share of the prompt's key blocks it holds (at
            // least `minMatchBlocks`); and its rank where both would start at once: blocks
            // held, then, where some pod holds the prompt, being the rendezvous pod (a spill
            // goes where every sidecar spills it). A prompt no pod holds gets no rank from its
            // rendezvous pod: that pod competes by load alone and wins only ties, so traffic
            // whose prompts never recur (no shared prefix) is balanced as without affinity
            // (with a rank there, every long prompt went to its hash-chosen pod whenever that
            // pod had a free seat, however loaded).
            let min_match = aff_cfg.map_or(usize::MAX, |c| c.min_match_blocks as usize);
            let held_enough = |id: u32| -> usize {
                let h = held(id);
                if h >= min_match {
                    h
                } else {
                    0
                }
            };
            let affinity_of = |id: u32| -> f64 {
                let Some(q) = prompt else { return 0.0 };
                held_enough(id) as f64 / q.keys.len().max(1) as f64
            };
            let rank_of = |id: u32| (held_enough(id), holder.is_some() && meet == Some(id));
            let slack = aff_cfg.map_or(0.0, |c| c.queue_slack_rounds);
            // A long answer spends its time decoding: it goes where it would finish first,
            // its wait (service rounds, each about a mean answer long) plus its own output, at
            // the pod's inter-token latency. So a pod decoding 5x slower loses it even with a
            // free seat, and a fast pod with a long queue loses it too.
            let long =
                cfg.long_output_tokens > 0 && size.output_tokens >= cfg.long_output_tokens as f64;
            let round_tokens = self.mean_output_tokens.unwrap_or(size.output_tokens);
            // None (compared as any request is) when it would wait for KV cache there (for how
            // long is unknown), the pod just failed a request, or it has no recent reading.
            let finish_ms = |id: u32, k: (u8, f64, f64)| {
                let r = p.pods.get(id as usize)?;
                if k.0 >= 2 || r.failed_recently(now_ms) {
                    return None;
                }
                let d = r.decode_ms(now_ms)?;
                Some((k.1 * round_tokens + size.output_tokens) * d)
            };
            let slowed = |id: u32| p.pods.get(id as usize).is_some_and(PodRt::slowed);
            // Whether candidate `b` would serve the request better than `a`.
            let better = |b: u32, a: u32| {
                let (kb, ka) = (key(b), key(a));
                if long {
                    match (finish_ms(b, kb), finish_ms(a, ka)) {
                        (Some(fb), Some(fa)) => {
                            if fb < fa * (1.0 - DECODE_SPEED_MARGIN) {
                                return true;
                            }
                            if fa < fb * (1.0 - DECODE_SPEED_MARGIN) {
                                return false;
                            }
                        }
                        // One finish unknown (most often: it would wait for KV cache there):
                        // a pod judged slow still loses. At a fifth of the speed a long
                        // answer takes five times as long there, far longer than the wait
                        // for running requests to free KV cache elsewhere, and past the
                        // client's timeout for the longest answers.
                        _ if slowed(a) != slowed(b) => return slowed(a),
                        _ => {}
                    }
                }
                // Prefix affinity. Two holders where neither waits for KV cache: by their waits
                // less the slack the share each holds earns (a conversation's pod with a short
                // queue over a pod holding only its system prompt with a free seat).
                if let Some(q) = prompt {
                    let n = q.keys.len();
                    let (hb, ha) = (held_enough(b), held_enough(a));
                    if hb > 0 && ha > 0 && kb.0 != ka.0 {
                        if let (Some(wb), Some(wa)) =
                            (holder_wait(kb, hb, n, slack), holder_wait(ka, ha, n, slack))
                        {
                            if wb != wa {
                                return wb < wa;
                            }
                        }
                    }
                }
                // Otherwise within a tier of wait only (a holder whose queue formed loses to a
                // pod that starts the request at once: the prefix spills). At once, the one
                // holding more of the prompt; both queued, the holder unless its wait is
                // longer by more than `queueSlackRounds` times the share it holds.
                if prompt.is_some() && kb.0 == ka.0 {
                    let (vb, va) = (affinity_of(b), affinity_of(a));
                    match kb.0 {
                        0 if rank_of(b) != rank_of(a) => return rank_of(b) > rank_of(a),
                        1 => {
                            let (wb, wa) = (kb.1 - slack * vb, ka.1 - slack * va);
                            if wb != wa {
                                return wb < wa;
                            }
                        }
                        _ => {}
                    }
                }
                // A big request that would start at once on both keeps the earlier draw (drawn
                // by score): every sidecar ranks pods on the same snapshot, so taking the less
                // loaded of its six draws sent every sidecar's long prompt of a burst to the
                // same emptiest pod within one snapshot's age (four 4 000-token prompts from
                // four sidecars within 71 ms in hol-poisson-80; the third and fourth waited
                // 8 s for KV cache). Its KV cache is what it needs, and it fits both.
                if big && kb.0 == 0 && ka.0 == 0 {
                    return false;
                }
                kb < ka
            };
            if let Some(b) = second {
                if better(b, a) {
                    chosen = b;
                }
            }
            if long {
                for _ in 0..LONG_OUTPUT_EXTRA_DRAWS {
                    if let Some(&c) = view.slots.get(draw(view, total, rng)) {
                        if better(c, chosen) {
                            chosen = c;
                        }
                    }
                }
            }
            // The pod holding the prompt's prefix, then its rendezvous pod, compete too, and
            // win ties.
            for c in [holder, meet].into_iter().flatten() {
                if c != chosen && !better(chosen, c) {
                    chosen = c;
                }
            }
            // A request that fits neither candidate's KV cache would wait at the head of that
            // pod's queue, and every request behind it with it: look further for one it fits.
            let fits = |id: u32| {
                let need = need_on(id);
                p.pods.get(id as usize).is_some_and(|r| {
                    !r.waits_for_kv(need) && headroom.is_none_or(|h| r.room_for_big(need, h))
                })
            };
            if !fits(chosen) {
                for _ in 0..KV_EXTRA_DRAWS {
                    let Some(&c) = view.slots.get(draw(view, total, rng)) else {
                        continue;
                    };
                    if better(c, chosen) {
                        chosen = c;
                    }
                    if fits(chosen) {
                        break;
                    }
                }
            }
            // A big request held in the sidecar (`bigRequestHold`) is released when some pod
            // has room for it: when the draws missed every such pod, the best of them takes
            // it (big requests are few; this scans the pool).
            if headroom.is_some() && !fits(chosen) {
                let mut best: Option<u32> = None;
                for (slot, &id) in view.slots.iter().enumerate() {
                    if view.w.get(slot).copied().unwrap_or(0.0) <= 0.0 || !fits(id) {
                        continue;
                    }
                    if best.is_none_or(|b| better(id, b)) {
                        best = Some(id);
                    }
                }
                if let Some(b) = best {
                    chosen = b;
                }
            }
            // Overflow: the request would queue on the chosen pod, so one pod over the GPU
            // hard limit, drawn evenly, competes too (as queued, so it wins only with the
            // shorter wait; a long answer also by its finish, and a slowed pod loses it). The
            // hard limit keeps load off a hot pod while others have room; once they queue
            // too, cutting it only herds its share onto them.
            if key(chosen).0 > 0 && !view.hot.is_empty() {
                let i = usize::try_from(rng.next_u64() % view.hot.len() as u64).unwrap_or(0);
                if let Some(&h) = view.hot.get(i) {
                    if better(h, chosen) {
                        chosen = h;
                        self.counters.overflow_over_gpu_limit += 1;
                    }
                }
            }
            if let Some(q) = prompt {
                let c = &mut self.counters;
                let h = held(chosen);
                c.prefix_keyed += 1;
                c.prefix_blocks += q.keys.len() as u64;
                c.prefix_blocks_held += h as u64;
                if h >= min_match {
                    c.prefix_hit += 1;
                } else if holder.is_some() {
                    c.prefix_spill += 1;
                } else if meet == Some(chosen) {
                    c.prefix_rendezvous += 1;
                }
                p.own.record(chosen, &q.keys, now_ms);
            }
        }
        ranked.push(chosen);
        for &s in &view.order {
            if ranked.len() > cfg.fallback_endpoints {
                break;
            }
            if let Some(&id) = view.slots.get(s as usize) {
                if !ranked.contains(id) {
                    ranked.push(id);
                }
            }
        }
        let mut chosen_score = 0.0;
        let mut probe = false;
        if let Some(pod) = p.pods.get_mut(chosen as usize) {
            chosen_score = pod.shown;
            pod.picks += 1;
            if pod.breaker.state() == BreakerState::HalfOpen {
                pod.breaker.on_request(now_ms);
                probe = true;
            }
            if let Some(m) = model {
                if let Some((_, b)) = pod.model_breakers.iter_mut().find(|(n, _)| n == m) {
                    if b.state() == BreakerState::HalfOpen {
                        b.on_request(now_ms);
                        probe = true;
                    }
                }
            }
        }
        if probe {
            // The probe budget may be spent: re-weigh this pod everywhere.
            if let Some(pod) = p.pods.get_mut(chosen as usize) {
                if !pod.breaker.admits(&cfg.breaker) {
                    pod.base = 0.0;
                    pod.cut = Some(CutReason::Breaker(
                        pod.breaker.reason().unwrap_or(TripReason::ServerErrors),
                    ));
                }
            }
            update_pod(p, chosen, cfg);
        }
        self.counters.steered += 1;
        Decision::Steer {
            ranked,
            chosen_score,
        }
    }

    /// The key space in which pool `pool_idx`'s pods report their prefix caches, as (tokens per
    /// key block, model seed): the first pod's that reports one. None when prefix affinity is
    /// off or no pod reports its cache: the request's prompt need not be keyed.
    pub fn prefix_space(&self, pool_idx: usize) -> Option<(u32, u64)> {
        self.cfg.prefix_affinity?;
        self.pools
            .get(pool_idx)?
            .state
            .peers()
            .iter()
            .filter_map(|e| e.signals.as_ref()?.prefix.as_ref())
            .map(|s| (s.block_tokens, s.model_seed))
            .next()
    }

    /// The prompt of a request `body` keyed for pool `pool_idx`'s prefix affinity
    /// ([`Router::decide_with`]); None when affinity is off, no pod of the pool reports its
    /// cache, or the body has no prompt. At most `prefixAffinity.maxPromptTokens` tokens are
    /// keyed; `ids` and `scratch` are reused buffers.
    pub fn key_prompt(
        &self,
        pool_idx: usize,
        body: &[u8],
        ids: &mut Vec<u32>,
        scratch: &mut Vec<u64>,
    ) -> Option<PromptKeys> {
        let cap = self.cfg.prefix_affinity?.max_prompt_tokens as usize;
        let (block_tokens, seed) = self.prefix_space(pool_idx)?;
        let (_, found) = crate::prefix::keys::prompt_ids(body, cap, ids);
        if !found {
            return None;
        }
        let mut out = PromptKeys::default();
        crate::prefix::keys::keys_of(ids, seed, block_tokens, scratch, &mut out);
        Some(out)
    }

    /// Refreshes pool `pool_idx` when due and returns the index of its view for `model`
    /// (built on first use). None when there is no such pool.
    fn fresh_view(&mut self, pool_idx: usize, model: Option<&str>, now_ms: u64) -> Option<usize> {
        let p = self.pools.get(pool_idx)?;
        if p.dirty || now_ms >= p.next_refresh_ms {
            self.refresh(pool_idx, now_ms);
        }
        let cfg = &self.cfg;
        let p = self.pools.get_mut(pool_idx)?;
        if let Some(i) = p.views.iter().position(|v| v.model.as_deref() == model) {
            return Some(i);
        }
        let mut v = View::new(model);
        build_view(&mut v, p, cfg);
        p.views.push(v);
        Some(p.views.len() - 1)
    }

    /// Whether a request of `size` to pool `pool_idx` (for `model`; None: any) should wait in
    /// the sidecar now (`bigRequestHold`): the hold is on, the request is big
    /// ([`BIG_KV_FACTOR`] times the mean request's KV tokens or more), the pool is steered
    /// (not in fallback), every pod not cut reports its KV cache, and on none would it start
    /// at once: a free seat, nothing waiting, not over the GPU hard limit, no failure in the
    /// last second, and room for it with `kvHeadroom` of the KV cache to spare
    /// ([`PodRt::room_for_big`]). So a big request takes a pod's slack, not the seats and
    /// cache the short requests behind it need. Only a request holding `minKvShare` of the
    /// largest KV cache among those pods or more is held. Anything unknown says no: a
    /// request is never held on a guess.
    pub fn should_hold(
        &mut self,
        pool_idx: usize,
        model: Option<&str>,
        size: RequestSize,
        now_ms: u64,
    ) -> bool {
        let Some(hold) = self.cfg.big_request_hold else {
            return false;
        };
        if !self.kv_is_big(size.kv_tokens) {
            return false;
        }
        let Some(vi) = self.fresh_view(pool_idx, model, now_ms) else {
            return false;
        };
        let Some(p) = self.pools.get(pool_idx) else {
            return false;
        };
        let Some(view) = p.views.get(vi) else {
            return false;
        };
        if view.verdict != Verdict::Pick {
            return false;
        }
        let mut any = false;
        let mut largest_cache = 0.0f64;
        for (slot, &id) in view.slots.iter().enumerate() {
            if view.w.get(slot).copied().unwrap_or(0.0) <= 0.0 {
                continue;
            }
            let Some(pod) = p.pods.get(id as usize) else {
                continue;
            };
            largest_cache = largest_cache.max(pod.kv_cap.unwrap_or(0.0));
            if pod.kv_cap.is_none()
                || pod
                    .pick_key(size.kv_tokens, true, Some(hold.kv_headroom), now_ms)
                    .0
                    == 0
            {
                return false;
            }
            any = true;
        }
        any && size.kv_tokens >= hold.min_kv_share * largest_cache
    }

    /// Whether a request holding `kv_tokens` is [`BIG_KV_FACTOR`] times the mean
    /// request's KV tokens (mean prompt estimate plus mean output reservation) or more; false
    /// before any sized request was seen.
    fn kv_is_big(&self, kv_tokens: f64) -> bool {
        let Some(out) = self.mean_output_tokens else {
            return false;
        };
        let prompt = self
            .mean_body_bytes
            .map_or(0.0, |b| b / PROMPT_BYTES_PER_TOKEN);
        let mean = prompt + out;
        mean > 0.0 && kv_tokens >= BIG_KV_FACTOR * mean
    }

    /// How much one request counts in this VM's in-flight estimate, from its body size (None:
    /// not known; the glue passes `content-length` when it did not read the body) and its
    /// output reservation (`max_tokens`, None when the request sets none):
    /// - `weight`: its body size over the running mean of the body sizes seen (an EWMA, so a
    ///   sidecar calibrates to its own traffic), clamped to [0.25, 16]. A 4000-token prompt
    ///   among 250-token ones counts ~16 seats on pods that do not report their KV cache: a
    ///   burst of long prompts from one sidecar spreads over pods instead of filling one pod's
    ///   KV cache before the next snapshot shows it. Body size unknown: 1.
    /// - `kv_tokens`: the KV-cache tokens it will hold at most, prompt (body bytes / 4, the
    ///   usual characters per token of English text; JSON framing counts too) plus output
    ///   reservation.
    pub fn request_size(
        &mut self,
        body_bytes: Option<usize>,
        max_output_tokens: Option<u64>,
    ) -> RequestSize {
        let prompt = body_bytes.map_or(0.0, |b| (b as f64 / PROMPT_BYTES_PER_TOKEN).ceil());
        let output = max_output_tokens
            .map_or(0.0, |t| t as f64)
            .min(MAX_REQUEST_KV_TOKENS);
        let kv_tokens = (prompt + output).min(MAX_REQUEST_KV_TOKENS);
        if max_output_tokens.is_some() {
            let m = self.mean_output_tokens.unwrap_or(output);
            self.mean_output_tokens = Some(m + 0.02 * (output - m));
        }
        let Some(b) = body_bytes else {
            return RequestSize {
                weight: 1.0,
                kv_tokens,
                output_tokens: output,
            };
        };
        let b = (b as f64).max(1.0);
        // Against the mean before this request, then fold it in.
        let mean = self.mean_body_bytes.unwrap_or(b).max(1.0);
        self.mean_body_bytes = Some(mean + 0.02 * (b - mean));
        RequestSize {
            weight: (b / mean).clamp(0.25, 16.0),
            kv_tokens,
            output_tokens: output,
        }
    }

    /// Records that a request of `size` ([`Router::request_size`]) was sent to `pod` (serving
    /// address): it counts as in flight until [`Router::on_request_end`] with the same size.
    /// `now_ms` is when it was sent: a snapshot whose model-server reading is older still
    /// counts it on top ([`RecentStarts`]).
    pub fn on_request_start(&mut self, pool_idx: usize, pod: &str, size: RequestSize, now_ms: u64) {
        self.with_pod(pool_idx, pod, |rt| {
            rt.inflight = rt.inflight.saturating_add(1);
            rt.inflight_w += size.weight;
            rt.inflight_out += size.output_tokens;
            // Not in any reading this VM has taken in yet.
            rt.kv_on_top += size.kv_tokens;
            rt.recent.push(now_ms, &size);
        });
    }

    /// Records that a request counted by [`Router::on_request_start`] (at `sent_ms`) ended,
    /// however it ended (answered, failed, cancelled): call it exactly once per start, with
    /// the same size and time.
    pub fn on_request_end(&mut self, pool_idx: usize, pod: &str, size: RequestSize, sent_ms: u64) {
        self.with_pod(pool_idx, pod, |rt| {
            rt.recent.remove(sent_ms, &size);
            rt.kv_on_top = (rt.kv_on_top - rt.kv_added(&size, sent_ms)).max(0.0);
            rt.inflight = rt.inflight.saturating_sub(1);
            rt.ended_since_snap = rt.ended_since_snap.saturating_add(1);
            if rt.inflight == 0 {
                // Nothing left in flight: drop rounding residue.
                rt.inflight_w = 0.0;
                rt.inflight_out = 0.0;
                rt.kv_on_top = 0.0;
            } else {
                rt.inflight_w -= size.weight;
                rt.inflight_out -= size.output_tokens;
            }
        });
    }

    /// Applies `f` to the pod at `pod` of pool `pool_idx` (nothing if unknown), then re-weighs
    /// it in every view.
    fn with_pod(&mut self, pool_idx: usize, pod: &str, f: impl FnOnce(&mut PodRt)) {
        let cfg = &self.cfg;
        let Some(p) = self.pools.get_mut(pool_idx) else {
            return;
        };
        let Some(&id) = p.by_addr.get(pod) else {
            return;
        };
        if let Some(rt) = p.pods.get_mut(id as usize) {
            f(rt);
        }
        update_pod(p, id, cfg);
    }

    /// Records how a request to `pod` ended; feeds the pod's breaker (the pod+model breaker
    /// when the pod serves several models and `model` is given). Returns the transitions.
    pub fn on_outcome(
        &mut self,
        pool_idx: usize,
        pod: &str,
        model: Option<&str>,
        outcome: &Outcome,
        now_ms: u64,
    ) -> Vec<BreakerEvent> {
        let cfg = &self.cfg;
        let Some(p) = self.pools.get_mut(pool_idx) else {
            return Vec::new();
        };
        let Some(&id) = p.by_addr.get(pod) else {
            return Vec::new();
        };
        let Some(rt) = p.pods.get_mut(id as usize) else {
            return Vec::new();
        };
        let failure = outcome.failure(&cfg.breaker);
        let mut out = Vec::new();
        let admitted = rt.breaker.admits(&cfg.breaker);
        let per_model = model.filter(|_| rt.serves_several);
        let t = match per_model {
            Some(m) => {
                let idx = match rt.model_breakers.iter().position(|(n, _)| n == m) {
                    Some(i) => i,
                    None => {
                        rt.model_breakers.push((m.to_string(), Breaker::default()));
                        rt.model_breakers.len() - 1
                    }
                };
                rt.model_breakers
                    .get_mut(idx)
                    .and_then(|(_, b)| b.record(failure, now_ms, &cfg.breaker))
            }
            None => {
                if failure.is_some() {
                    rt.last_failure_ms = Some(now_ms);
                }
                let t = rt.breaker.record(failure, now_ms, &cfg.breaker);
                // The failure rate, over this VM's outcomes while Closed: a pod failing half
                // its requests rarely fails `consecutiveFailures` in a row.
                let closed = rt.breaker.state() == BreakerState::Closed;
                if t.is_none()
                    && closed
                    && rt.window.record(failure.is_some(), now_ms, &cfg.breaker)
                {
                    rt.breaker
                        .trip(TripReason::FailureRate, now_ms, &cfg.breaker)
                } else {
                    t
                }
            }
        };
        if let Some(t) = t {
            push_event(&mut out, &mut self.counters, &rt.address, per_model, t);
            p.dirty = true;
        } else if rt.breaker.admits(&cfg.breaker) != admitted {
            // A half-open pod's first probe succeeded: the rest of its probes may go.
            p.dirty = true;
        } else {
            update_pod(p, id, cfg);
        }
        out
    }

    /// Advances time without a request (e.g. from the glue's tick): polls breakers and
    /// staleness. Returns transitions that happened.
    pub fn tick(&mut self, now_ms: u64) -> Vec<BreakerEvent> {
        let before = self.events.len();
        for i in 0..self.pools.len() {
            let due = self
                .pools
                .get(i)
                .is_some_and(|p| p.dirty || now_ms >= p.next_refresh_ms);
            if due {
                self.refresh(i, now_ms);
            }
        }
        self.events.split_off(before)
    }

    /// The pod's breaker (pod-level when `model` is None), for sharing between VMs.
    pub fn breaker(&self, pool_idx: usize, pod: &str, model: Option<&str>) -> Option<&Breaker> {
        let p = self.pools.get(pool_idx)?;
        let rt = p.pods.get(*p.by_addr.get(pod)? as usize)?;
        match model {
            None => Some(&rt.breaker),
            Some(_) => rt.model_breaker(model),
        }
    }

    /// Installs a breaker state read from shared data (another VM's view).
    ///
    /// One exception keeps a local verdict: a pod-level breaker this router opened for a
    /// hardware fault (seen in the pool state, which every VM reads) stays Open until its own
    /// cooldown ends, unless `breaker` is Open too; the shared breaker may not know the fault.
    pub fn set_breaker(
        &mut self,
        pool_idx: usize,
        pod: &str,
        model: Option<&str>,
        breaker: Breaker,
    ) {
        let Some(p) = self.pools.get_mut(pool_idx) else {
            return;
        };
        let Some(&id) = p.by_addr.get(pod) else {
            return;
        };
        let Some(rt) = p.pods.get_mut(id as usize) else {
            return;
        };
        let cfg = &self.cfg.breaker;
        // Whether the pick weights can change: a state or admission change (a failure count
        // moving inside Closed does not), so the common success path costs no re-layout.
        let moved = |old: &Breaker| {
            old.state() != breaker.state()
                || old.admits(cfg) != breaker.admits(cfg)
                || old.open_until_ms() != breaker.open_until_ms()
        };
        let changed = match model {
            None => {
                // An agent's signal opened this VM's breaker: another VM's older view of the
                // shared breaker does not reopen the pod before its cooldown.
                let keep_fault = rt.breaker.state() == BreakerState::Open
                    && matches!(
                        rt.breaker.reason(),
                        Some(TripReason::HardwareFault | TripReason::AgentErrorRate)
                    )
                    && breaker.state() != BreakerState::Open;
                let changed = !keep_fault && moved(&rt.breaker);
                if !keep_fault {
                    rt.breaker = breaker;
                }
                changed
            }
            Some(m) => match rt.model_breakers.iter_mut().find(|(n, _)| n == m) {
                Some((_, b)) => {
                    let changed = moved(b);
                    *b = breaker;
                    changed
                }
                None => {
                    rt.model_breakers.push((m.to_string(), breaker));
                    true
                }
            },
        };
        if changed {
            p.dirty = true;
        }
    }

    /// Serving address of a pod of a ranked list; None if the pool layout changed since.
    pub fn address(&self, pool_idx: usize, ranked: &Ranked, id: PodId) -> Option<&str> {
        let p = self.pools.get(pool_idx)?;
        if p.generation != ranked.generation {
            return None;
        }
        p.pods.get(id.0 as usize).map(|r| r.address.as_str())
    }

    /// Writes `IP:PORT,IP:PORT,...` for the routing header into `out` (cleared first; reuse
    /// it to avoid allocation). Returns false when the pool layout changed since the decision.
    pub fn write_ranked(&self, pool_idx: usize, ranked: &Ranked, out: &mut String) -> bool {
        out.clear();
        let Some(p) = self.pools.get(pool_idx) else {
            return false;
        };
        if p.generation != ranked.generation {
            return false;
        }
        for (i, id) in ranked.iter().enumerate() {
            if let Some(r) = p.pods.get(id.0 as usize) {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&r.address);
            }
        }
        !out.is_empty()
    }

    /// Scoreboard rows of one pool at `now_ms`.
    pub fn pod_status(&self, pool_idx: usize, now_ms: u64) -> Vec<PodStatus<'_>> {
        let Some(p) = self.pools.get(pool_idx) else {
            return Vec::new();
        };
        p.pods
            .iter()
            .map(|r| {
                let entry = p.state.peers().get(r.peer_idx);
                let sig = entry.and_then(|e| e.signals.as_ref());
                PodStatus {
                    address: &r.address,
                    peer: entry.map_or("", |e| e.peer.as_str()),
                    score: r.shown,
                    raw: r.score.raw,
                    cut: r.cut,
                    cold: r.cold,
                    breaker: r.breaker.state(),
                    picks: r.picks,
                    inflight: r.inflight,
                    load: r.load(),
                    queued: r.pick_key(0.0, false, None, now_ms).0 > 0,
                    kv: r.kv_used().zip(r.kv_cap).map(|(u, c)| u / c),
                    error_rate: sig.and_then(|s| s.error_rate),
                    window_requests: sig.and_then(|s| s.window_requests),
                    metrics_age_ms: sig.map(|s| s.age_ms(now_ms)),
                    slowdown: sig.is_some_and(|s| s.slowdown),
                    slow_decode: r.slow_decode,
                    decode_ms: r.decode_ms(now_ms),
                    gpu_signal: r.score.gpu_reading,
                    gpu: r.score.gpu_value,
                    prefix_keys: sig.and_then(|s| s.prefix.as_ref()).map(|p| p.keys.len()),
                    prefix_hit_rate: sig.and_then(|s| s.prefix_hit_rate),
                }
            })
            .collect()
    }

    /// Addresses of a pool's pods, in pod-table order (none for an unknown pool).
    pub fn pod_addresses(&self, pool_idx: usize) -> impl Iterator<Item = &str> + '_ {
        self.pools
            .get(pool_idx)
            .into_iter()
            .flat_map(|p| p.pods.iter().map(|r| r.address.as_str()))
    }

    /// Number of configured pools.
    pub fn pool_count(&self) -> usize {
        self.pools.len()
    }
}

/// The median recent inter-token latency over the pool's pods that report one and are neither
/// stale nor without a model server; None with fewer than [`MIN_ITL_PODS`] such pods, or when
/// `cutoffs.slowItlRatio` is 0.
fn median_recent_itl(
    state: &PoolState,
    scratch: &mut Vec<f64>,
    cfg: &FilterConfig,
    now_ms: u64,
) -> Option<f64> {
    if cfg.cutoffs.slow_itl_ratio <= 0.0 {
        return None;
    }
    scratch.clear();
    scratch.extend(
        state
            .peers()
            .iter()
            .filter_map(|e| e.signals.as_ref())
            .filter(|s| {
                s.has_metrics
                    && !s.model_server_down
                    && !s.is_stale(now_ms, cfg.cutoffs.staleness_ms)
            })
            .filter_map(|s| s.itl_recent_ms),
    );
    if scratch.len() < MIN_ITL_PODS {
        return None;
    }
    scratch.sort_unstable_by(f64::total_cmp);
    let n = scratch.len();
    let mid = scratch.get(n / 2).copied()?;
    Some(if n % 2 == 0 {
        (scratch.get(n / 2 - 1).copied()? + mid) / 2.0
    } else {
        mid
    })
}

fn update_pod(p: &mut PoolRt, id: u32, cfg: &FilterConfig) {
    let Some(pod) = p.pods.get(id as usize) else {
        return;
    };
    for v in p.views.iter_mut() {
        let slot = v.slot_of.get(id as usize).copied().unwrap_or(NONE);
        if slot == NONE {
            continue;
        }
        let w = effective(pod, v.model.as_deref(), cfg);
        v.set(slot as usize, w);
    }
}

fn build_view(v: &mut View, p: &PoolRt, cfg: &FilterConfig) {
    v.slots.clear();
    v.w.clear();
    v.order.clear();
    v.hot.clear();
    v.slot_of.clear();
    v.slot_of.resize(p.pods.len(), NONE);
    let mut fresh = 0usize;
    let mut stale = 0usize;
    let model = v.model.as_deref();
    for (i, pod) in p.pods.iter().enumerate() {
        let Some(sig) = p
            .state
            .peers()
            .get(pod.peer_idx)
            .and_then(|e| e.signals.as_ref())
        else {
            continue;
        };
        if let Some(m) = model {
            if !sig.serves(m) {
                continue;
            }
        }
        let slot = v.slots.len();
        if let Some(s) = v.slot_of.get_mut(i) {
            *s = u32::try_from(slot).unwrap_or(NONE);
        }
        v.slots.push(u32::try_from(i).unwrap_or(NONE));
        v.w.push(effective(pod, model, cfg));
        if pod.hot
            && pod
                .model_breaker(model)
                .is_none_or(|b| b.state() == BreakerState::Closed)
        {
            v.hot.push(u32::try_from(i).unwrap_or(NONE));
        }
        if pod.score.has_terms {
            if pod.score.cut == Some(CutReason::Stale) {
                stale += 1;
            } else {
                fresh += 1;
            }
        }
    }
    // Fenwick tree in O(n).
    let n = v.slots.len();
    v.tree.clear();
    v.tree.resize(n + 1, 0.0);
    for i in 1..=n {
        let w = v.w.get(i - 1).copied().unwrap_or(0.0);
        if let Some(t) = v.tree.get_mut(i) {
            *t += w;
        }
        let j = i + (i & i.wrapping_neg());
        if j <= n {
            let ti = v.tree.get(i).copied().unwrap_or(0.0);
            if let Some(t) = v.tree.get_mut(j) {
                *t += ti;
            }
        }
    }
    // Fallback order: eligible, not half-open, by base weight descending.
    for (slot, &id) in v.slots.iter().enumerate() {
        let Some(pod) = p.pods.get(id as usize) else {
            continue;
        };
        if v.w.get(slot).copied().unwrap_or(0.0) > 0.0 && !pod.half_open(model) {
            v.order.push(u32::try_from(slot).unwrap_or(NONE));
        }
    }
    let pods = &p.pods;
    let slots = &v.slots;
    let base_of = |s: &u32| {
        slots
            .get(*s as usize)
            .and_then(|id| pods.get(*id as usize))
            .map_or(0.0, |r| r.base)
    };
    v.order
        .sort_unstable_by(|a, b| base_of(b).total_cmp(&base_of(a)));
    let fallbacks = cfg.fallback_endpoints;
    v.order.truncate(fallbacks + 1);

    v.verdict = if p.state.last_event_ms().is_none() || p.pods.is_empty() {
        Verdict::Fallback(FallbackReason::NoAgentData)
    } else if n == 0 {
        Verdict::Fallback(if model.is_some() {
            FallbackReason::NoModel
        } else {
            FallbackReason::NoAgentData
        })
    } else if fresh == 0 && stale > 0 {
        Verdict::Fallback(FallbackReason::AllStale)
    } else if fresh < cfg.min_pods {
        Verdict::Fallback(FallbackReason::TooFewPods)
    } else {
        Verdict::Pick
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(weights: &[f64]) -> View {
        let mut v = View::new(None);
        v.slots = (0..weights.len() as u32).collect();
        v.w = vec![0.0; weights.len()];
        v.tree = vec![0.0; weights.len() + 1];
        for (i, w) in weights.iter().enumerate() {
            v.set(i, *w);
        }
        v
    }

    #[test]
    fn fenwick_find_matches_a_linear_scan() {
        let weights = [0.0, 0.5, 0.0, 0.25, 1.0, 0.0, 0.125];
        let v = view(&weights);
        assert!((v.total() - 1.875).abs() < 1e-12);
        for k in 0..1875 {
            let u = k as f64 / 1000.0;
            let mut acc = 0.0;
            let want = weights
                .iter()
                .position(|w| {
                    acc += w;
                    acc > u
                })
                .unwrap();
            assert_eq!(v.find(u), want, "u={u}");
            assert!(weights[v.find(u)] > 0.0);
        }
    }

    #[test]
    fn fenwick_updates_move_the_total() {
        let mut v = view(&[1.0, 1.0, 1.0]);
        v.set(1, 0.0);
        assert!((v.total() - 2.0).abs() < 1e-12);
        assert_eq!(v.find(0.99), 0);
        assert_eq!(v.find(1.0), 2);
    }

    #[test]
    fn ranked_is_bounded_and_ordered() {
        let mut r = Ranked::new(7);
        for i in 0..(MAX_RANKED as u32 + 3) {
            r.push(i);
        }
        assert_eq!(r.len(), MAX_RANKED);
        assert_eq!(r.first(), Some(PodId(0)));
        assert!(r.contains(3) && !r.contains(MAX_RANKED as u32));
    }
}
