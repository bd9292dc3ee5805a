//! `twoChoices`: which candidate takes a request. Two drawn by weight are compared by their
//! tier of wait, then their load (see the [`super`] docs); a long answer, a request that fits
//! no KV cache, the pods holding or meeting the prompt's prefix, a held big request and a pod
//! over the GPU hard limit (overflow) bring more candidates in.

use std::cell::Cell;

use rand::RngCore;

use super::affinity::{affinity_candidate, holder_wait};
use super::decide::Request;
use super::pod::PodRt;
use super::view::{draw, View};
use crate::config::FilterConfig;
use crate::counters::Counters;
use crate::pool::PoolState;
use crate::prefix::own::OwnSends;
use crate::prefix::PromptKeys;

/// Extra candidates drawn for a request that fits neither first candidate's KV cache.
const KV_EXTRA_DRAWS: usize = 4;

/// How much sooner (relative) a long-output request must finish on a candidate to prefer it
/// over the usual comparison: readings cover ~150 ms of tokens, so small gaps are noise.
const DECODE_SPEED_MARGIN: f64 = 0.1;

/// More candidates a long-output request draws (`longOutputTokens`), after the first two.
const LONG_OUTPUT_EXTRA_DRAWS: usize = 2;

/// What two candidates are compared by ([`PodRt::pick_key`]): tier of wait, wait in service
/// rounds, load.
type Key = (u8, f64, f64);

/// One request's candidates in one view, and how two of them compare.
pub(super) struct Candidates<'a> {
    pods: &'a [PodRt],
    state: &'a PoolState,
    view: &'a View,
    req: Request<'a>,
    /// The request's keyed prompt, when `prefixAffinity` is on and it has key blocks.
    prompt: Option<&'a PromptKeys>,
    /// The pod this VM recently sent the prompt's longest leading run of key blocks to, and
    /// how many blocks.
    own: Option<(u32, usize)>,
    /// `prefixAffinity.minMatchBlocks` (`usize::MAX` when off).
    min_match: usize,
    /// `prefixAffinity.queueSlackRounds` (0 when off).
    slack: f64,
    /// The pod holding the prompt's prefix that would start it soonest, and the rendezvous pod
    /// of the others ([`affinity_candidate`]).
    holder: Option<u32>,
    meet: Option<u32>,
    /// The request reserves at least `longOutputTokens`: it goes where it would finish first.
    long: bool,
    /// A service round's length in output tokens: the mean reservation, else its own.
    round_tokens: f64,
    /// `longOutputSeatShare`, and `longOutputTokens` (at least 1).
    long_seat_share: f64,
    long_tokens: f64,
    /// A candidate's long-answer share was full when the request would have finished there
    /// sooner (counted once per request as `long_output_share_full`).
    share_full: Cell<bool>,
}

impl<'a> Candidates<'a> {
    /// The candidates of request `req` among the pods of `view`; `own`: this VM's recent sends
    /// of prompt prefixes; `mean_output_tokens`: the running mean of output reservations.
    pub(super) fn new(
        pods: &'a [PodRt],
        state: &'a PoolState,
        view: &'a View,
        own: &OwnSends,
        cfg: &FilterConfig,
        req: Request<'a>,
        mean_output_tokens: Option<f64>,
    ) -> Self {
        // Prefix affinity: how many of the prompt's leading key blocks each pod holds.
        let aff_cfg = cfg.prefix_affinity;
        let prompt = req
            .prompt
            .filter(|q| aff_cfg.is_some() && !q.keys.is_empty());
        let own = prompt.and_then(|q| {
            let ttl = aff_cfg.map_or(0, |c| c.own_ttl_ms);
            own.leading_match(&q.keys, req.now_ms, ttl)
        });
        let size = req.size;
        let mut c = Self {
            pods,
            state,
            view,
            req,
            prompt,
            own,
            min_match: aff_cfg.map_or(usize::MAX, |c| c.min_match_blocks as usize),
            slack: aff_cfg.map_or(0.0, |c| c.queue_slack_rounds),
            holder: None,
            meet: None,
            // A long answer spends its time decoding: it goes where it would finish first,
            // its wait (service rounds, each about a mean answer long) plus its own output, at
            // the pod's inter-token latency. So a pod decoding 5x slower loses it even with a
            // free seat, and a fast pod with a long queue loses it too.
            long: cfg.is_long_answer(&size),
            round_tokens: mean_output_tokens.unwrap_or(size.output_tokens),
            long_seat_share: cfg.long_output_seat_share,
            long_tokens: cfg.long_output_tokens.max(1) as f64,
            share_full: Cell::new(false),
        };
        if let (Some(q), Some(a)) = (prompt, aff_cfg) {
            let held = |id: u32| c.held(id);
            let key = |id: u32| c.key(id);
            let affinity = affinity_candidate(pods, view, q, &a, &held, &key);
            c.holder = affinity.holder;
            c.meet = affinity.meet;
        }
        c
    }

    /// The pod that takes the request, from the first draw `a` (slot `first`; `total`: the
    /// view's weight): a second distinct draw, then the extra candidates, each taken when
    /// [`Candidates::better`].
    pub(super) fn choose(
        &self,
        first: usize,
        a: u32,
        total: f64,
        rng: &mut (impl RngCore + ?Sized),
        counters: &mut Counters,
    ) -> u32 {
        let mut chosen = a;
        if let Some(b) = self.second(first, total, rng) {
            if self.better(b, a) {
                chosen = b;
            }
        }
        if self.long {
            for _ in 0..LONG_OUTPUT_EXTRA_DRAWS {
                if let Some(&c) = self.view.slots.get(draw(self.view, total, rng)) {
                    if self.better(c, chosen) {
                        chosen = c;
                    }
                }
            }
        }
        // The pod holding the prompt's prefix, then its rendezvous pod, compete too, and
        // win ties.
        for c in [self.holder, self.meet].into_iter().flatten() {
            if c != chosen && !self.better(chosen, c) {
                chosen = c;
            }
        }
        let chosen = self.look_for_room(chosen, total, rng);
        let chosen = self.release_held(chosen);
        let chosen = self.overflow(chosen, rng, counters);
        if self.share_full.get() {
            counters.long_output_share_full += 1;
        }
        chosen
    }

    /// A second, distinct candidate (a few redraws: a dominant pod may come up twice).
    fn second(&self, first: usize, total: f64, rng: &mut (impl RngCore + ?Sized)) -> Option<u32> {
        for _ in 0..3 {
            let s = draw(self.view, total, rng);
            if s != first {
                return self.view.slots.get(s).copied();
            }
        }
        None
    }

    /// A request that fits neither candidate's KV cache would wait at the head of that
    /// pod's queue, and every request behind it with it: look further for one it fits.
    fn look_for_room(&self, mut chosen: u32, total: f64, rng: &mut (impl RngCore + ?Sized)) -> u32 {
        if !self.fits(chosen) {
            for _ in 0..KV_EXTRA_DRAWS {
                let Some(&c) = self.view.slots.get(draw(self.view, total, rng)) else {
                    continue;
                };
                if self.better(c, chosen) {
                    chosen = c;
                }
                if self.fits(chosen) {
                    break;
                }
            }
        }
        chosen
    }

    /// A big request held in the sidecar (`bigRequestHold`) is released when some pod
    /// has room for it: when the draws missed every such pod, the best of them takes
    /// it (big requests are few; this scans the pool).
    fn release_held(&self, chosen: u32) -> u32 {
        if self.req.headroom.is_none() || self.fits(chosen) {
            return chosen;
        }
        let mut best: Option<u32> = None;
        for (slot, &id) in self.view.slots.iter().enumerate() {
            if self.view.w.get(slot).copied().unwrap_or(0.0) <= 0.0 || !self.fits(id) {
                continue;
            }
            if best.is_none_or(|b| self.better(id, b)) {
                best = Some(id);
            }
        }
        best.unwrap_or(chosen)
    }

    /// Overflow: the request would queue on the chosen pod, so one pod over the GPU
    /// hard limit, drawn evenly, competes too (as queued, so it wins only with the
    /// shorter wait; a long answer also by its finish, and a slowed pod loses it). The
    /// hard limit keeps load off a hot pod while others have room; once they queue
    /// too, cutting it only herds its share onto them.
    fn overflow(
        &self,
        chosen: u32,
        rng: &mut (impl RngCore + ?Sized),
        counters: &mut Counters,
    ) -> u32 {
        let hot = &self.view.hot;
        if self.key(chosen).0 > 0 && !hot.is_empty() {
            let i = usize::try_from(rng.next_u64() % hot.len() as u64).unwrap_or(0);
            if let Some(&h) = hot.get(i) {
                if self.better(h, chosen) {
                    counters.overflow_over_gpu_limit += 1;
                    return h;
                }
            }
        }
        chosen
    }

    /// Counts how the prompt's prefix fared (`prefix.*`) and remembers that this VM sent it to
    /// `chosen` (`own`).
    pub(super) fn record_prefix(&self, chosen: u32, counters: &mut Counters, own: &mut OwnSends) {
        let Some(q) = self.prompt else {
            return;
        };
        let c = counters;
        let h = self.held(chosen);
        c.prefix_keyed += 1;
        c.prefix_blocks += q.keys.len() as u64;
        c.prefix_blocks_held += h as u64;
        if h >= self.min_match {
            c.prefix_hit += 1;
        } else if self.holder.is_some() {
            c.prefix_spill += 1;
        } else if self.meet == Some(chosen) {
            c.prefix_rendezvous += 1;
        }
        own.record(chosen, &q.keys, self.req.now_ms);
    }

    /// How many of the prompt's leading key blocks pod `id` holds: as its agent reports them,
    /// or as this VM recently sent them there, whichever is more.
    fn held(&self, id: u32) -> usize {
        let Some(q) = self.prompt else { return 0 };
        let reported = self
            .pods
            .get(id as usize)
            .and_then(|r| self.state.peers().get(r.peer_idx))
            .and_then(|e| e.signals.as_ref())
            .and_then(|s| s.prefix.as_ref())
            .map_or(0, |set| set.held(q));
        let mine = self.own.filter(|(pod, _)| *pod == id).map_or(0, |(_, n)| n);
        reported.max(mine)
    }

    /// The KV cache a request needs on a pod: less the prompt tokens it holds there
    /// (shared with the requests running there; at least the last prompt token is
    /// computed anew, and the output is always new).
    fn need_on(&self, id: u32) -> f64 {
        let need = self.req.size.kv_tokens;
        let Some(q) = self.prompt else { return need };
        let cached = (self.held(id) as f64) * f64::from(q.block_tokens);
        let prompt_part = (need - self.req.size.output_tokens - 1.0).max(0.0);
        need - cached.min(prompt_part)
    }

    /// What pod `id` is compared by for this request (the worst for an unknown pod).
    fn key(&self, id: u32) -> Key {
        self.pods
            .get(id as usize)
            .map_or((u8::MAX, f64::INFINITY, f64::INFINITY), |r| {
                r.pick_key(
                    self.need_on(id),
                    self.req.big,
                    self.req.headroom,
                    self.req.now_ms,
                )
            })
    }

    /// Whether the request fits pod `id`'s KV cache without waiting for it (with the headroom
    /// a held big request must leave).
    fn fits(&self, id: u32) -> bool {
        let need = self.need_on(id);
        self.pods.get(id as usize).is_some_and(|r| {
            !r.waits_for_kv(need) && self.req.headroom.is_none_or(|h| r.room_for_big(need, h))
        })
    }

    /// Whether the request may go to half-open pod `id` as its probe ([`View::probe_due`]):
    /// unless it would wait for the pod's KV cache (or, held by `bigRequestHold`, find no room
    /// there). Such a request would wait at the head of the pod's queue, and its time to first
    /// token would judge the queue, not the pod's health; the next request that fits takes the
    /// probe.
    pub(super) fn may_probe(&self, id: u32) -> bool {
        self.fits(id)
    }

    /// Key blocks of the prompt pod `id` holds, 0 below `minMatchBlocks`.
    fn held_enough(&self, id: u32) -> usize {
        let h = self.held(id);
        if h >= self.min_match {
            h
        } else {
            0
        }
    }

    /// The share of the prompt's key blocks pod `id` holds (at least `minMatchBlocks`), 0..1.
    fn affinity_of(&self, id: u32) -> f64 {
        let Some(q) = self.prompt else { return 0.0 };
        self.held_enough(id) as f64 / q.keys.len().max(1) as f64
    }

    /// Pod `id`'s rank where both candidates would start at once: blocks held, then, where
    /// some pod holds the prompt, being the rendezvous pod (a spill goes where every sidecar
    /// spills it). A prompt no pod holds gets no rank from its rendezvous pod: that pod
    /// competes by load alone and wins only ties, so traffic whose prompts never recur (no
    /// shared prefix) is balanced as without affinity (with a rank there, every long prompt
    /// went to its hash-chosen pod whenever that pod had a free seat, however loaded).
    fn rank_of(&self, id: u32) -> (usize, bool) {
        (
            self.held_enough(id),
            self.holder.is_some() && self.meet == Some(id),
        )
    }

    /// When the request would finish on pod `id` (`k`: its key), for a long answer: its wait,
    /// then its own output at the pod's inter-token latency `d`. None (compared as any
    /// request is) when it would wait for KV cache there (for how long is unknown), the pod
    /// just failed a request, or it has no recent reading.
    ///
    /// The key's wait (`k.1`) is in rounds of the pool's median pod ([`PodRt::pick_key`]:
    /// a pod's own rounds times its relative speed), and such a round is a mean answer at
    /// the median's latency, `d / rel_speed`. Timing those rounds at the pod's own `d`
    /// counted a pod's speed twice: an H100 beside A100s (0.61 of their latency) had its
    /// queue taken for 0.61 of its length, a slower pod's for more than its length.
    fn finish_ms(&self, id: u32, k: Key) -> Option<f64> {
        let r = self.pods.get(id as usize)?;
        if k.0 >= 2 || r.failed_recently(self.req.now_ms) {
            return None;
        }
        let d = r.decode_ms(self.req.now_ms)?;
        let median_round_ms = self.round_tokens * d / r.rel_speed;
        Some(k.1 * median_round_ms + self.req.size.output_tokens * d)
    }

    /// Whether pod `id` may take a long answer because it would finish there first: with it,
    /// long answers would hold at most its share of the pod's seats ([`PodRt::long_seats`]):
    /// `longOutputSeatShare` for an answer of `longOutputTokens`, in proportion for a longer
    /// one (twice as long, twice the share). Past that, the pod keeps its other seats for
    /// short requests, and the long answer is compared there as any request is. The longest
    /// answers, which set the p99 of end-to-end latency, so keep the fast pods, and the
    /// merely long ones take them only while seats are left.
    fn takes_long(&self, id: u32) -> bool {
        let share = self.long_seat_share * self.req.size.output_tokens / self.long_tokens;
        let takes = share >= 1.0
            || self
                .pods
                .get(id as usize)
                .is_some_and(|r| r.long_seats() + 1.0 <= share * r.capacity);
        if !takes {
            self.share_full.set(true);
        }
        takes
    }

    /// Pod `id` is judged to run slow ([`PodRt::slowed`]).
    fn slowed(&self, id: u32) -> bool {
        self.pods.get(id as usize).is_some_and(PodRt::slowed)
    }

    /// Whether candidate `b` would serve the request better than `a`.
    pub(super) fn better(&self, b: u32, a: u32) -> bool {
        let (kb, ka) = (self.key(b), self.key(a));
        if let Some(v) = self.by_finish(b, kb, a, ka) {
            return v;
        }
        if let Some(v) = self.by_holder_wait(b, kb, a, ka) {
            return v;
        }
        if let Some(v) = self.by_affinity_in_tier(b, kb, a, ka) {
            return v;
        }
        // A big request that would start at once on both keeps the earlier draw (drawn
        // by score): every sidecar ranks pods on the same snapshot, so taking the less
        // loaded of its six draws sent every sidecar's long prompt of a burst to the
        // same emptiest pod within one snapshot's age (four 4 000-token prompts from
        // four sidecars within 71 ms in hol-poisson-80; the third and fourth waited
        // 8 s for KV cache). Its KV cache is what it needs, and it fits both.
        if self.req.big && kb.0 == 0 && ka.0 == 0 {
            return false;
        }
        kb < ka
    }

    /// A long answer: `b` (key `kb`) against `a` (key `ka`) by when it would finish, when
    /// one finishes sooner by the margin. None: compare as any request.
    fn by_finish(&self, b: u32, kb: Key, a: u32, ka: Key) -> Option<bool> {
        if !self.long {
            return None;
        }
        match (self.finish_ms(b, kb), self.finish_ms(a, ka)) {
            (Some(fb), Some(fa)) => {
                if fb < fa * (1.0 - DECODE_SPEED_MARGIN) {
                    return self.takes_long(b).then_some(true);
                }
                if fa < fb * (1.0 - DECODE_SPEED_MARGIN) {
                    return self.takes_long(a).then_some(false);
                }
                None
            }
            // One finish unknown (most often: it would wait for KV cache there):
            // a pod judged slow still loses. At a fifth of the speed a long
            // answer takes five times as long there, far longer than the wait
            // for running requests to free KV cache elsewhere, and past the
            // client's timeout for the longest answers.
            _ if self.slowed(a) != self.slowed(b) => Some(self.slowed(a)),
            _ => None,
        }
    }

    /// Prefix affinity. Two holders where neither waits for KV cache: by their waits
    /// less the slack the share each holds earns (a conversation's pod with a short
    /// queue over a pod holding only its system prompt with a free seat).
    fn by_holder_wait(&self, b: u32, kb: Key, a: u32, ka: Key) -> Option<bool> {
        let q = self.prompt?;
        let n = q.keys.len();
        let (hb, ha) = (self.held_enough(b), self.held_enough(a));
        if hb > 0 && ha > 0 && kb.0 != ka.0 {
            if let (Some(wb), Some(wa)) = (
                holder_wait(kb, hb, n, self.slack),
                holder_wait(ka, ha, n, self.slack),
            ) {
                if wb != wa {
                    return Some(wb < wa);
                }
            }
        }
        None
    }

    /// Otherwise within a tier of wait only (a holder whose queue formed loses to a
    /// pod that starts the request at once: the prefix spills). At once, the one
    /// holding more of the prompt; both queued, the holder unless its wait is
    /// longer by more than `queueSlackRounds` times the share it holds.
    fn by_affinity_in_tier(&self, b: u32, kb: Key, a: u32, ka: Key) -> Option<bool> {
        if self.prompt.is_none() || kb.0 != ka.0 {
            return None;
        }
        let (vb, va) = (self.affinity_of(b), self.affinity_of(a));
        match kb.0 {
            0 if self.rank_of(b) != self.rank_of(a) => Some(self.rank_of(b) > self.rank_of(a)),
            1 => {
                let (wb, wa) = (kb.1 - self.slack * vb, ka.1 - self.slack * va);
                (wb != wa).then_some(wb < wa)
            }
            _ => None,
        }
    }
}
