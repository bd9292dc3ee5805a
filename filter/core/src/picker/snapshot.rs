//! What a pod takes from its agent's snapshots: whether it decodes slow against its pool, the
//! smoothed score and inter-token latency of each new snapshot, the occupancy and KV readings
//! its in-flight estimates are re-based on, and what cuts it.

use super::pod::PodRt;
use crate::breaker::TripReason;
use crate::config::{Cutoffs, FilterConfig};
use crate::score::{CutReason, Score};
use crate::signals::PodSignals;

use super::refresh::DecodeRef;

/// How long a pod judged slow stays so without a reading that says otherwise (none comes
/// while it runs too few requests to fill its window with tokens, or while fewer than three
/// pods report one). Longer than [`ITL_HOLD_MS`] because the evidence is lopsided: a pod that
/// decodes at speed again shows it with a single request (at 5 ms a token, 30 tokens in the
/// agent's 150 ms window), while a slowed one, drawn at a fifth of its weight, often runs
/// just one and shows nothing; each lapse of the judgement gives the pod its full share back.
///
/// [`ITL_HOLD_MS`]: super::pod::ITL_HOLD_MS
const SLOW_DECODE_HOLD_MS: u64 = 30_000;

/// Smoothing of each pod's inter-token latency for `longOutputTokens` (weight of a reading).
pub(super) const DECODE_SPEED_ALPHA: f64 = 0.3;

impl PodRt {
    /// Judges whether the pod decodes slow against the recent inter-token latencies `itl_ref`
    /// (the pool's median and its GPU kind's; None: too few pods report one) and, while it
    /// does, puts its speed penalty on its score `s`. True when it was not judged slow before
    /// (counted as `slow_decode`).
    pub(super) fn judge_decode_speed(
        &mut self,
        sig: &PodSignals,
        itl_ref: Option<DecodeRef>,
        cutoffs: &Cutoffs,
        now_ms: u64,
        s: &mut Score,
    ) -> bool {
        let slow = self.judged_slow(sig, itl_ref, cutoffs, now_ms);
        let newly = slow && !self.slow_decode;
        self.slow_decode = slow;
        if slow {
            s.penalty = s.penalty.min(self.slow_decode_penalty);
            s.value = s.value.min(s.raw * s.penalty);
        }
        newly
    }

    /// Whether its recent inter-token latency is `cutoffs.slowItlRatio` times the pool's median
    /// or more, and as many times its kind's ([`DecodeRef::reference`]); when so, notes when it
    /// was seen and its speed relative to that reference.
    fn judged_slow(
        &mut self,
        sig: &PodSignals,
        itl_ref: Option<DecodeRef>,
        cutoffs: &Cutoffs,
        now_ms: u64,
    ) -> bool {
        // No reading (too few tokens in the window: a slow pod running one request
        // decodes fewer than a fast one): the last judgement holds for a while.
        sig.has_metrics
            && match (itl_ref, sig.itl_recent_ms) {
                (Some(r), Some(itl)) => {
                    let reference = r.reference();
                    let slow = itl >= reference * cutoffs.slow_itl_ratio;
                    if slow {
                        self.slow_decode_seen_ms = now_ms;
                        // Its speed relative to the reference: a pod decoding 5x slower
                        // serves about a fifth as much.
                        self.slow_decode_penalty =
                            (reference / itl).min(cutoffs.slowdown_factor).max(0.0);
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
                    self.slow_decode
                        && now_ms.saturating_sub(self.slow_decode_seen_ms) <= SLOW_DECODE_HOLD_MS
                }
            }
    }

    /// Takes in the snapshot `sig` (`key`: when it was received, its sequence) with its score
    /// `s` unless already seen: the inter-token latency, the score's EMA (`ema_alpha`), and
    /// the occupancy and KV readings. True when it was new.
    pub(super) fn take_snapshot(
        &mut self,
        key: (u64, u64),
        sig: &PodSignals,
        s: &Score,
        ema_alpha: f64,
        now_ms: u64,
    ) -> bool {
        if self.seen == Some(key) {
            return false;
        }
        self.seen = Some(key);
        self.take_itl(sig, now_ms);
        if s.has_terms {
            self.ema = Some(match self.ema {
                Some(e) => ema_alpha * s.raw + (1.0 - ema_alpha) * e,
                None => s.raw,
            });
        }
        // This VM's requests sent after the model server was read are not in the
        // reading: they stay counted on top of it.
        let (n_after, kv_after, out_after) = self.recent.after(sig.engine_sampled_at_ms);
        self.rebase_occupancy(sig, n_after);
        self.rebase_kv(sig, kv_after, out_after, now_ms);
        true
    }

    /// Smooths the snapshot's recent inter-token latency into the pod's
    /// ([`DECODE_SPEED_ALPHA`]; a reading after a lapse starts it anew).
    fn take_itl(&mut self, sig: &PodSignals, now_ms: u64) {
        // The mean where the model server exports it: a long answer takes about
        // output × mean, and the median is limited to its bucket (vLLM's first ends
        // at 10 ms).
        if let Some(itl) = sig
            .itl_recent_mean_ms
            .or(sig.itl_recent_ms)
            .filter(|_| sig.has_metrics)
        {
            self.itl_ms = Some(match self.itl_ms {
                Some(e) if self.decode_ms(now_ms).is_some() => {
                    DECODE_SPEED_ALPHA * itl + (1.0 - DECODE_SPEED_ALPHA) * e
                }
                _ => itl,
            });
            self.itl_at_ms = now_ms;
        }
    }

    /// Re-bases the occupancy estimate on a snapshot that reports running or waiting (once per
    /// sequence): `n_after` of this VM's requests in flight were sent after its reading.
    fn rebase_occupancy(&mut self, sig: &PodSignals, n_after: u32) {
        if (sig.running.is_some() || sig.waiting.is_some()) && self.occ_seq != Some(sig.sequence) {
            self.occ_seq = Some(sig.sequence);
            self.inflight_base = f64::from(self.inflight.saturating_sub(n_after));
            self.snap_waiting = sig.waiting.unwrap_or(0);
            self.ended_since_snap = 0;
            self.head_blocked = self.snap_waiting > 0
                && sig
                    .queue_capacity
                    .is_some_and(|c| sig.running.unwrap_or(0) < c);
            self.snap_occ =
                Some(f64::from(sig.running.unwrap_or(0)) + f64::from(sig.waiting.unwrap_or(0)));
        }
    }

    /// Re-bases the KV estimate on a snapshot that reports KV capacity and use (once per
    /// sequence); forgets it when the snapshot does not. `kv_after` and `out_after`: the KV
    /// tokens and output reservations of this VM's requests sent after its reading.
    fn rebase_kv(&mut self, sig: &PodSignals, kv_after: f64, out_after: f64, now_ms: u64) {
        match (sig.kv_capacity_tokens, sig.kv_usage) {
            (Some(cap), Some(used)) => {
                if self.kv_seq != Some(sig.sequence) {
                    let cap = cap as f64;
                    self.kv_seq = Some(sig.sequence);
                    self.kv_cap = Some(cap);
                    self.snap_kv = used * cap;
                    // Requests sent before the reading: it shows what they hold
                    // now (their prompt once prefilled, the tokens generated so
                    // far), not the output they will grow into and hold until they
                    // end. That reservation stays counted on top.
                    let out_before = (self.inflight_out - out_after).max(0.0);
                    self.kv_on_top = kv_after + out_before;
                    self.kv_sampled_at_ms = sig.engine_sampled_at_ms;
                    self.kv_taken_at_ms = now_ms;
                }
            }
            _ => {
                self.kv_cap = None;
                self.kv_seq = None;
            }
        }
    }

    /// Takes the score `s` of its latest snapshot `sig`: whether it is cold (no usable reading
    /// or no EMA yet), what cuts it (the score's cut, else a breaker that refuses it), its
    /// capacity and whether it serves several models.
    pub(super) fn settle(&mut self, s: Score, sig: &PodSignals, cfg: &FilterConfig) {
        self.score = s;
        self.cold = !s.has_terms || self.ema.is_none();
        self.cut = s.cut.or_else(|| {
            (!self.breaker.takes_requests(&cfg.breaker)).then(|| {
                CutReason::Breaker(self.breaker.reason().unwrap_or(TripReason::ServerErrors))
            })
        });
        self.capacity = f64::from(sig.queue_capacity.unwrap_or(cfg.cutoffs.max_queue).max(1));
        self.serves_several = sig.models.len() > 1;
    }
}
