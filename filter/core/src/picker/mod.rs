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
//!   judgement for up to 30 s) and than the other pods of its GPU kind (then its speed is
//!   taken against the slower of the two medians: a slower GPU generation is not a slow
//!   pod), else 1: applied to the smoothed value, so it acts on the first snapshot that
//!   shows it;
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
//!     of TTFT.) A pod decoding slower than its pool's median turns over that much slower:
//!     its rounds and its load count at its speed. Only a pod judged slow has its seats at
//!     its speed too (full sooner); a slower GPU generation's free seat starts a request at
//!     once, as on any pod.
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
//!     finish first: its wait in service rounds × the mean output reservation at the pool
//!     median's inter-token latency, plus its own output at the pod's smoothed recent
//!     inter-token latency (the agent's mean over its recent window, else the median), when
//!     that is at least 10 % sooner and long answers would hold no more than their share of
//!     that pod's seats with it (`longOutputSeatShare`, in proportion to the answer's length);
//!     else, or when either candidate has no reading in the last 5 s (idle), would wait for KV
//!     cache, or just failed a request, it is compared like any request. So in a pool that
//!     mixes GPU generations the longest answers (which set the end-to-end p99) land on the
//!     faster GPUs, a pod decoding 5x slower loses them even with free seats, and the fast
//!     pods keep seats for short requests.
//!
//!   Why: every sidecar scores from the same sampled snapshot, so one weighted draw sends all
//!   of them to the same "best" pods between updates (herding); the second choice on live
//!   occupancy is what least_request's power of two choices does, on top of the GPU-aware
//!   score. Each snapshot re-bases the estimates, so ends a VM never saw (a lost callback)
//!   cannot accumulate.
//! - `proportional`: one draw with each weight divided by `1 + d / capacity`, `d` = this VM's
//!   requests started since the pod's last snapshot net of ends (not below 0).
//!
//! Half-open probes come first, under either strategy: a pod whose breaker (or the requested
//! model's) is HalfOpen with probe budget, and not cut, takes the next request as its probe,
//! ahead of the draw, the contest and prefix affinity (`View::probe_due` in `view`), unless under
//! `twoChoices` the request would wait for its KV cache. Drawn by weight among pods holding
//! the traffic's prefixes, or against pods that start at once, a healed pod could otherwise go
//! unprobed for as long as the traffic lasted (40 s and more in the demo). The budget bounds
//! it: the first probe alone, the rest of `halfOpenProbes` once it passed.
//!
//! The chosen pod comes first in the ranked list, then the next best pods by smoothed weight
//! (not HalfOpen ones: their probes are budgeted), up to `fallbackEndpoints`.
//!
//! Picking keeps a Fenwick tree of weights per (pool, requested model), so a pick costs
//! O(log n) with no heap allocation in the steady state; trees are rebuilt when the pool state
//! changes, a breaker changes, or a time deadline (staleness, cooldown) passes.
//!
//! # Where each part lives
//! - `install`: a pool's state from its agent's events or shared bytes; the pod table.
//! - `refresh`: re-weighing a pool (scores, breaker signals, decode speed, weights) when it
//!   changed or a deadline passed; `tick`.
//! - `snapshot`: what one pod takes from a new snapshot (EMA, decode speed, re-based readings).
//! - `pod`, `load`: one pod's runtime state; its estimated load and wait (`pick_key`).
//! - `view`: the draw weights per requested model (Fenwick tree), fallback order, verdict.
//! - `decide`: one decision; `candidates`: the `twoChoices` contest; `fail_open`: every pod
//!   cut; `affinity`: prefix affinity; `hold`: `bigRequestHold`.
//! - `size`: [`RequestSize`]; `inflight`: this VM's requests in flight.
//! - `breakers`: agent-signal trips, outcomes, breaker polls and sharing.
//! - `ranked`: the ranked list and the routing header; `scoreboard`: [`PodStatus`] rows.
//! - `versioned`: which model version a request goes to (`versions`, [`crate::versions`]).

mod affinity;
mod breakers;
mod candidates;
mod decide;
mod fail_open;
mod hold;
mod inflight;
mod install;
mod learned;
mod load;
mod pod;
mod ranked;
mod refresh;
mod scoreboard;
mod size;
mod snapshot;
mod versioned;
mod view;

pub use breakers::SignalTrip;
pub use ranked::{PodId, Ranked, MAX_RANKED};
pub use scoreboard::{PodStatus, PoolThresholds};
pub use size::RequestSize;
pub use versioned::{version_stat_segment, VersionRoute, VersionRow};

use std::collections::HashMap;

use crate::breaker::BreakerEvent;
use crate::config::FilterConfig;
use crate::counters::Counters;
use crate::pool::PoolState;
use crate::prefix::own::OwnSends;
use pod::PodRt;
use view::View;

/// No pod: an empty slot of a [`Ranked`] list or a view, a pod id that does not fit.
const NONE: u32 = u32::MAX;

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

/// One pool as this VM routes it: the agents' pool state, the pod table, and one view of draw
/// weights per requested model.
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
    /// Scratch for the pool's medians of recent inter-token latency and, with
    /// `learnedWeights`, observed TTFT (kept to avoid allocating).
    itl_scratch: Vec<f64>,
    /// The recent inter-token latencies of the pool's pods that report one, with their GPU
    /// kind, sorted by kind then latency (`cutoffs.slowItlRatio` against a pod's own kind).
    itl_kinds: Vec<(u64, f64)>,
    /// This VM's recent sends of prompt prefixes, by pod id (`prefixAffinity`).
    own: OwnSends,
    /// This worker's breaker domains of the pool's model versions (`versions`).
    domains: crate::versions::Domains,
    /// The pool's model (`learnedWeights`; None: off).
    learned: Option<crate::learned::LearnedModel>,
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

impl Router {
    /// A router for every pool of `cfg`, with no agent data yet.
    pub fn new(cfg: FilterConfig) -> Self {
        let pools = (0..cfg.pools.len())
            .map(|i| PoolRt {
                learned: cfg
                    .learned_weights
                    .map(|l| crate::learned::LearnedModel::new(l, i as u64)),
                ..PoolRt::default()
            })
            .collect();
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
