//! One pod as this VM routes it: what it keeps between snapshots (smoothed score, readings,
//! in-flight counts, breakers, decode speed) and how it answers for its breakers and speed.

use super::inflight::RecentStarts;
use crate::breaker::{Breaker, BreakerState, FailureWindow};
use crate::prefix::own::pod_hash;
use crate::score::{CutReason, Score};

/// How long a pod's last inter-token reading counts without a new one (too few tokens in its
/// window: an idle pod): long answers use its smoothed speed. Bounded, so a pod that no longer
/// gets enough traffic to show its speed is not judged on an old reading for ever.
pub(super) const ITL_HOLD_MS: u64 = 5000;

/// Bounds of a pod's decode speed relative to its pool ([`PodRt::rel_speed`]).
pub(super) const MIN_REL_SPEED: f64 = 0.25;
pub(super) const MAX_REL_SPEED: f64 = 8.0;

/// One pod of a pool as this VM routes it, kept by serving address across pool layouts.
#[derive(Debug, Clone)]
pub(super) struct PodRt {
    pub(super) address: String,
    /// [`pod_hash`] of the address (prefix affinity's rendezvous order).
    pub(super) hash: u64,
    pub(super) peer_idx: usize,
    /// The snapshot the EMA last consumed: (received_at_ms, sequence).
    pub(super) seen: Option<(u64, u64)>,
    pub(super) ema: Option<f64>,
    pub(super) score: Score,
    pub(super) cut: Option<CutReason>,
    /// Cut by the GPU hard limit alone (breakers closed), under `twoChoices`: not drawn, but
    /// an overflow candidate when the drawn ones would queue (see the module docs).
    pub(super) hot: bool,
    pub(super) cold: bool,
    /// Smoothed score with floor, 0 when cut or refused by the pod breaker.
    pub(super) base: f64,
    /// Shown on the scoreboard.
    pub(super) shown: f64,
    pub(super) capacity: f64,
    /// Requests this VM sent to the pod that have not ended (never reset).
    pub(super) inflight: u32,
    /// The same, each request weighted by its size (see [`Router::request_size`]).
    ///
    /// [`Router::request_size`]: super::Router::request_size
    pub(super) inflight_w: f64,
    /// This VM's starts to the pod over the last 15–30 s: how many of `inflight` may count as
    /// occupying it when a reading misses them ([`PodRt::occupancy`]).
    pub(super) start_window: super::inflight::StartWindow,
    /// `inflight` (unweighted: the snapshot counts every request as one) when the latest
    /// occupancy reading arrived.
    pub(super) inflight_base: f64,
    /// Running + waiting of the latest snapshot that reported either.
    pub(super) snap_occ: Option<f64>,
    /// Waiting of that snapshot: > 0 means the pod could not admit more (seats or KV full).
    pub(super) snap_waiting: u32,
    /// This VM's requests to the pod that ended since that snapshot (see
    /// [`PodRt::waiting_now`]).
    pub(super) ended_since_snap: u32,
    /// That snapshot showed requests waiting while seats were free (running below the
    /// reported `queue_capacity`): the head of its queue waits for KV cache, and every new
    /// request waits behind it until a running request finishes.
    pub(super) head_blocked: bool,
    /// Sequence of the snapshot `snap_occ` came from.
    pub(super) occ_seq: Option<u64>,
    /// KV-cache capacity in tokens of the latest snapshot; None when it does not report both
    /// capacity and use (the KV cache is then not judged).
    pub(super) kv_cap: Option<f64>,
    /// KV tokens in use per that snapshot (use × capacity).
    pub(super) snap_kv: f64,
    /// Output tokens reserved (`max_tokens`) by this VM's requests in flight (never reset).
    pub(super) inflight_out: f64,
    /// Of `inflight`, the long answers (reserving at least `longOutputTokens`): what share of
    /// the pod's seats long decodes hold ([`PodRt::long_seats`]).
    pub(super) inflight_long: u32,
    /// KV tokens this VM counts on top of the latest reading (see [`PodRt::kv_used`]).
    pub(super) kv_on_top: f64,
    /// When the model server was read for that reading (see
    /// [`crate::PodSignals::engine_sampled_at_ms`]), and when this VM took it in.
    pub(super) kv_sampled_at_ms: u64,
    pub(super) kv_taken_at_ms: u64,
    /// Sequence of the snapshot the KV reading came from.
    pub(super) kv_seq: Option<u64>,
    /// This VM's latest starts, to re-base at the reading's time.
    pub(super) recent: RecentStarts,
    pub(super) picks: u64,
    pub(super) breaker: Breaker,
    /// This VM's recent outcomes of the pod, for the failure-rate trip.
    pub(super) window: FailureWindow,
    /// `breaker.truncation`: this VM's run of truncated answers and memory-error rate.
    pub(super) truncation: crate::triggers::TruncationTracker,
    /// When this VM last saw a request to the pod fail.
    pub(super) last_failure_ms: Option<u64>,
    pub(super) model_breakers: Vec<(String, Breaker)>,
    pub(super) serves_several: bool,
    /// Its recent inter-token latency is `cutoffs.slowItlRatio` times the pool's median.
    pub(super) slow_decode: bool,
    /// When a reading last judged it slow (ms): bounds how long the judgement holds without one.
    pub(super) slow_decode_seen_ms: u64,
    /// Its recent inter-token latency (ms; the window's mean, else its median), smoothed over
    /// snapshots ([`DECODE_SPEED_ALPHA`](super::snapshot::DECODE_SPEED_ALPHA)).
    pub(super) itl_ms: Option<f64>,
    /// When that last took a reading (ms).
    pub(super) itl_at_ms: u64,
    /// Its draw-weight factor while slow: the pool's median over its inter-token latency, at
    /// most `cutoffs.slowdownFactor`.
    pub(super) slow_decode_penalty: f64,
    /// Its smoothed inter-token latency over the pool's median of those (pods with a reading
    /// in the last [`ITL_HOLD_MS`], at least [`MIN_ITL_PODS`]), within
    /// [`MIN_REL_SPEED`]..=[`MAX_REL_SPEED`]; 1 without a reading or a median.
    ///
    /// [`MIN_ITL_PODS`]: super::refresh::MIN_ITL_PODS
    pub(super) rel_speed: f64,
    /// The share of its weight it gets while its traffic ramps back after its breaker closed
    /// (`breaker.recoveryRamp`, [`crate::recovery`]); 1 otherwise. Set when its breakers are
    /// polled.
    pub(super) ramp: f64,
    /// Its breaker thresholds as adapted to its pool (`breaker.adaptiveThresholds`,
    /// [`crate::adaptive`]); None when that is off. Set at each refresh.
    pub(super) thresholds: Option<crate::adaptive::Effective>,
    /// `breaker.adaptiveThresholds.errorEvidence`: its outcomes' evidence of failing, fed by
    /// each new snapshot ([`crate::adaptive::Evidence`]).
    pub(super) evidence: crate::adaptive::Evidence,
    /// `learnedWeights`: its features as of its latest snapshot (None: that is off, or it has
    /// no metrics), the model's score for them (None: falling back), and the samples this VM
    /// has trained on from its outcomes (cold start until `coldStartSamples`).
    pub(super) features: Option<crate::learned::Features>,
    pub(super) learned: Option<f64>,
    pub(super) learned_samples: u32,
    /// `learnedWeights`: the TTFT of its requests as this VM saw them, smoothed (ms), and when
    /// the latest came (ms); its `ttft` feature while recent ([`super::learned::TTFT_HOLD_MS`]).
    pub(super) seen_ttft_ms: Option<f64>,
    pub(super) seen_ttft_at_ms: u64,
    /// That smoothed TTFT over the pool's median of those (None: not recent, or no median).
    pub(super) rel_ttft: Option<f64>,
    /// Where it stands in a pre-OOM episode (`preOom`, [`crate::pre_oom`]).
    pub(super) pre_oom: crate::pre_oom::Phase,
}

impl PodRt {
    pub(super) fn new(address: String, peer_idx: usize) -> Self {
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
            start_window: Default::default(),
            snap_occ: None,
            snap_waiting: 0,
            ended_since_snap: 0,
            head_blocked: false,
            occ_seq: None,
            kv_cap: None,
            snap_kv: 0.0,
            inflight_out: 0.0,
            inflight_long: 0,
            kv_on_top: 0.0,
            kv_sampled_at_ms: 0,
            kv_taken_at_ms: 0,
            kv_seq: None,
            recent: RecentStarts::default(),
            picks: 0,
            breaker: Breaker::default(),
            window: FailureWindow::default(),
            truncation: crate::triggers::TruncationTracker::default(),
            last_failure_ms: None,
            model_breakers: Vec::new(),
            serves_several: false,
            slow_decode: false,
            slow_decode_seen_ms: 0,
            slow_decode_penalty: 1.0,
            rel_speed: 1.0,
            itl_ms: None,
            thresholds: None,
            evidence: crate::adaptive::Evidence::default(),
            features: None,
            learned: None,
            learned_samples: 0,
            seen_ttft_ms: None,
            seen_ttft_at_ms: 0,
            rel_ttft: None,
            itl_at_ms: 0,
            ramp: 1.0,
            pre_oom: crate::pre_oom::Phase::Normal,
        }
    }

    /// Its smoothed inter-token latency (ms) if a reading came in the last
    /// [`ITL_HOLD_MS`] (an idle pod reports none, and an old one says little about it now).
    pub(super) fn decode_ms(&self, now_ms: u64) -> Option<f64> {
        self.itl_ms
            .filter(|_| now_ms.saturating_sub(self.itl_at_ms) <= ITL_HOLD_MS)
    }

    /// Not a probe-budgeted pod (its breaker, or the model's, is not closed).
    pub(super) fn half_open(&self, model: Option<&str>) -> bool {
        self.breaker.state() == BreakerState::HalfOpen
            || self
                .model_breaker(model)
                .is_some_and(|b| b.state() != BreakerState::Closed)
    }

    pub(super) fn model_breaker(&self, model: Option<&str>) -> Option<&Breaker> {
        let m = model?;
        self.model_breakers
            .iter()
            .find(|(n, _)| n == m)
            .map(|(_, b)| b)
    }
}
