//! How full a pod is and how long a request would wait there: estimated seats and KV cache in
//! use (the snapshot's, moved by this VM's requests since), the tier of wait and service
//! rounds `twoChoices` compares ([`PodRt::pick_key`]), and how much slower than its pool the
//! pod turns its work over.

use super::pod::PodRt;
use super::RequestSize;

/// How long a failed request makes its pod count as queued for `twoChoices` (ms).
const RECENT_FAILURE_MS: u64 = 1000;

/// The smallest score penalty [`PodRt::slowness`] divides by.
const MIN_PENALTY: f64 = 1e-3;

impl PodRt {
    /// What this VM's requests add to the latest occupancy reading: those in flight now,
    /// weighted by size, minus those in flight when it arrived, which the reading already
    /// counted as one each. So starts and ends since the reading move it, and a long prompt
    /// keeps its extra weight for as long as it runs. May be negative.
    pub(super) fn delta_since_snapshot(&self) -> f64 {
        self.inflight_w - self.inflight_base
    }

    /// Estimated seats taken on the pod now, over its capacity: the snapshot's running +
    /// waiting moved by this VM's own starts and ends since; without an occupancy reading,
    /// this VM's in-flight requests (what least_request sees). When the pod reports its KV
    /// cache, a request is one seat (its size counts in the KV cache); otherwise each counts
    /// by its body size, the only hint of a long prompt.
    pub(super) fn seat_load(&self) -> f64 {
        self.occupancy() / self.capacity
    }

    /// Estimated seats taken on the pod now (running + waiting), as [`PodRt::seat_load`]
    /// describes, before dividing by the capacity; never less than this VM's own requests in
    /// flight there that it sent in the last 15–30 s ([`StartWindow`]; each counted as
    /// [`PodRt::seat_load`] counts it). Each of them is somewhere at the pod, and a reading can
    /// miss them: requests held before the engine (an API server starved of CPU, a slow path in
    /// front of it) are in no engine metric, and re-basing on such a reading made them vanish,
    /// so the pod looked the emptier the longer its front-end queue grew (`misleading-frontend`:
    /// p99 TTFT 12x least_request's). Older ones stop counting, so an end this VM never saw
    /// does not hold the pod's load up for ever.
    ///
    /// [`StartWindow`]: super::inflight::StartWindow
    pub(super) fn occupancy(&self) -> f64 {
        let recent = self.inflight.min(self.start_window.starts());
        let (occ, own) = if self.kv_cap.is_some() {
            let own = f64::from(recent);
            match self.snap_occ {
                Some(o) => (o + f64::from(self.inflight) - self.inflight_base, own),
                None => (f64::from(self.inflight), own),
            }
        } else {
            // Weighted by size: the recent share of the weight in flight.
            let own = if self.inflight == 0 {
                0.0
            } else {
                self.inflight_w * f64::from(recent) / f64::from(self.inflight)
            };
            match self.snap_occ {
                Some(o) => (o + self.delta_since_snapshot(), own),
                None => (self.inflight_w, own),
            }
        };
        occ.max(own).max(0.0)
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
    pub(super) fn kv_used(&self) -> Option<f64> {
        self.kv_cap?;
        Some(self.snap_kv + self.kv_on_top.max(0.0))
    }

    /// What a request of `size` sent at `sent_ms`, still in flight, counts on top of the
    /// latest KV reading: all of it when sent after the model server was read for it (or
    /// after this VM took the reading in), else its output reservation.
    pub(super) fn kv_added(&self, size: &RequestSize, sent_ms: u64) -> f64 {
        if sent_ms > self.kv_sampled_at_ms || sent_ms >= self.kv_taken_at_ms {
            size.kv_tokens
        } else {
            size.output_tokens
        }
    }

    /// Estimated seats long answers (`longOutputTokens`) hold on the pod now: its occupancy
    /// ([`PodRt::occupancy`]) times the share of this VM's requests in flight there that are
    /// long answers. A sidecar sees only its own requests; with several sidecars alike, its
    /// share stands for theirs.
    pub(super) fn long_seats(&self) -> f64 {
        if self.inflight == 0 {
            return 0.0;
        }
        self.occupancy() * f64::from(self.inflight_long.min(self.inflight))
            / f64::from(self.inflight)
    }

    /// Whether a request holding `kv_tokens` would fit the KV cache now (true when unknown).
    pub(super) fn fits(&self, kv_tokens: f64) -> bool {
        match (self.kv_used(), self.kv_cap) {
            (Some(used), Some(cap)) => used + kv_tokens <= cap,
            _ => true,
        }
    }

    /// The fuller of the two resources, seats and KV cache (with `kv_tokens` more), 0..
    pub(super) fn load_with(&self, kv_tokens: f64) -> f64 {
        let seats = self.seat_load();
        match (self.kv_used(), self.kv_cap) {
            (Some(used), Some(cap)) => seats.max((used + kv_tokens) / cap),
            _ => seats,
        }
    }

    pub(super) fn load(&self) -> f64 {
        self.load_with(0.0)
    }

    /// A request to the pod failed in the last [`RECENT_FAILURE_MS`]: it counts as queued. A
    /// pod that fails fast has few requests in flight and would otherwise look the freest.
    pub(super) fn failed_recently(&self, now_ms: u64) -> bool {
        self.last_failure_ms
            .is_some_and(|t| now_ms.saturating_sub(t) < RECENT_FAILURE_MS)
    }

    /// Requests still waiting of those the latest snapshot showed waiting, as far as this VM
    /// can tell: each of its requests that ended since freed a seat and its KV cache, and a
    /// FIFO queue admits its head first, so that many have left the queue. Without this, one
    /// request caught waiting in a snapshot (arrived just before it) made the pod count as
    /// queued until the next snapshot, even after this VM saw it end.
    pub(super) fn waiting_now(&self) -> u32 {
        self.snap_waiting.saturating_sub(self.ended_since_snap)
    }

    /// Whether a request holding `kv_tokens` would wait for KV cache there: it does not fit
    /// the estimated free KV cache, or the queue's head already waits for KV.
    pub(super) fn waits_for_kv(&self, kv_tokens: f64) -> bool {
        self.head_blocked || !self.fits(kv_tokens)
    }

    /// Whether a big request holding `kv_tokens` has room here with `headroom` of the KV cache
    /// to spare (`bigRequestHold`): its queue's head does not wait for KV cache and the
    /// estimated use with it stays within the cache less that share (a request larger than
    /// that needs only to fit). True when the pod does not report its KV cache.
    pub(super) fn room_for_big(&self, kv_tokens: f64, headroom: f64) -> bool {
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
    /// A pod slower than its pool ([`PodRt::slowness`] `turnover` > 1) turns over `turnover`
    /// times slower: `1/turnover` of its running requests per round (at least one), so the
    /// wait is in the pool's rounds. A pod judged slow also counts `1/seats` of its seats
    /// (`seats` = its slowness; 1 otherwise): a free seat on it is no free seat once its
    /// requests would fill its seats at its speed.
    pub(super) fn drain(&self, seats: f64, turnover: f64) -> f64 {
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
        let (slots, running) = (slots / seats, (running / turnover).max(1.0));
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
    /// with four waiting, but faster than one that runs eight with thirty waiting). A pod
    /// counts its load [`PodRt::slowness`] times and its turnover at that fraction; one judged
    /// slow its seats too ([`PodRt::drain`]): with three requests on eight seats at a quarter
    /// of the speed it is full, and loses to a full-speed pod with a short queue.
    ///
    /// `big`: the request holds [`BIG_KV_FACTOR`] times the mean request's KV tokens or
    /// more. Behind a head that waits for KV cache it waits for KV cache itself (tier 2): the
    /// head takes what frees first, and so many tokens more free only when several requests
    /// end, or a long one (seconds). Counted as a queue for seats, a long prompt went to the
    /// pod already blocked by another, the one with the fewest running.
    ///
    /// `headroom`: a big request under `bigRequestHold`; without room for it with that share
    /// of the KV cache to spare ([`PodRt::room_for_big`]) it counts as waiting for KV cache.
    ///
    /// [`BIG_KV_FACTOR`]: super::size::BIG_KV_FACTOR
    pub(super) fn pick_key(
        &self,
        kv_tokens: f64,
        big: bool,
        headroom: Option<f64>,
        now_ms: u64,
    ) -> (u8, f64, f64) {
        let slow = self.slowness();
        // A slower pod turns its requests over that much slower. Its seats are its seats,
        // unless it is judged slow: a faster pod's full batch still makes a request wait (for
        // a shorter time), and a pod of a slower GPU generation with a free seat starts a
        // request at once (its decode is slower, as every pod of its kind's is). Counting
        // that pod full at a fraction of its seats left the three-kind pool's L40S starting
        // requests within 50 ms (p90) while the H100s' queued for 600 ms (p50) at 95 %.
        let turnover = slow.max(1.0);
        let seats_slow = if self.slowed() { turnover } else { 1.0 };
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
            (1, self.drain(seats_slow, turnover) * slow.min(1.0), load)
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
    pub(super) fn slowness(&self) -> f64 {
        let judged = 1.0 / self.score.penalty.clamp(MIN_PENALTY, 1.0);
        if judged > 1.0 {
            judged.max(self.rel_speed)
        } else {
            self.rel_speed
        }
    }

    /// Judged to run slow: its GPU reports a hardware slowdown, or it decodes
    /// `cutoffs.slowItlRatio` times slower than its pool (its score carries the penalty).
    pub(super) fn slowed(&self) -> bool {
        self.score.penalty < 1.0
    }
}
