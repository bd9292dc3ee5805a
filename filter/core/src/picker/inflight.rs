//! This VM's requests in flight to each pod: counted at start and end, and remembered by send
//! time so a snapshot re-bases the estimates at the time its model server was read.

use super::pod::PodRt;
use super::view::update_pod;
use super::{RequestSize, Router};

/// Half the span over which this VM's own starts to a pod bound its occupancy from below
/// ([`StartWindow`]): starts older than 15–30 s no longer count there.
pub(super) const START_WINDOW_HALF_MS: u64 = 15_000;

/// This VM's starts to one pod over the last 15–30 s, in two half windows: how many of its
/// requests in flight there can still be counted as occupying it when a reading misses them
/// ([`PodRt::occupancy`]). A request whose end this VM never saw (a lost end) so stops
/// counting there within 30 s, where the in-flight count alone would keep it for ever.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct StartWindow {
    current: u32,
    previous: u32,
    /// When the current half began (ms).
    since_ms: u64,
}

impl StartWindow {
    /// Moves the halves on to `now_ms`.
    pub(super) fn roll(&mut self, now_ms: u64) {
        let elapsed = now_ms.saturating_sub(self.since_ms);
        if elapsed >= 2 * START_WINDOW_HALF_MS {
            self.previous = 0;
            self.current = 0;
            self.since_ms = now_ms;
        } else if elapsed >= START_WINDOW_HALF_MS {
            self.previous = self.current;
            self.current = 0;
            self.since_ms += START_WINDOW_HALF_MS;
        }
    }

    fn count(&mut self, now_ms: u64) {
        self.roll(now_ms);
        self.current = self.current.saturating_add(1);
    }

    /// Starts in the window (as of the latest roll).
    pub(super) fn starts(&self) -> u32 {
        self.current.saturating_add(self.previous)
    }
}

/// This VM's latest starts remembered per pod ([`RecentStarts`]): enough for the starts of
/// one engine reading's age (about 100-200 ms) at the rates one sidecar sends to one pod.
const RECENT_STARTS: usize = 8;

/// This VM's latest request starts to one pod (send time, size), newest overwriting oldest, so
/// a snapshot re-bases the in-flight estimates at the time the model server was read, not at
/// the time the snapshot arrived: requests sent in between (the reading's age, up to the
/// agent's sample interval and more) are not in its figures and stay counted on top of them.
/// Without it each snapshot erased them until the next one, and a sidecar sent a second long
/// prompt to the pod it had just filled (seen in hol-poisson-80: three sidecars each put two
/// 4 000-token prompts on one pod within 60-215 ms, the third waited 4-9 s for KV cache and
/// held up every short request behind it).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct RecentStarts {
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
    pub(super) fn after(&self, t_ms: u64) -> (u32, f64, f64) {
        self.entries
            .iter()
            .flatten()
            .filter(|e| e.0 > t_ms)
            .fold((0, 0.0, 0.0), |(n, kv, out), e| {
                (n + 1, kv + f64::from(e.1), out + f64::from(e.2))
            })
    }
}

impl Router {
    /// Records that a request of `size` ([`Router::request_size`]) was sent to `pod` (serving
    /// address): it counts as in flight until [`Router::on_request_end`] with the same size.
    /// `now_ms` is when it was sent: a snapshot whose model-server reading is older still
    /// counts it on top ([`RecentStarts`]).
    pub fn on_request_start(&mut self, pool_idx: usize, pod: &str, size: RequestSize, now_ms: u64) {
        let long = self.cfg.is_long_answer(&size);
        self.with_pod(pool_idx, pod, |rt| {
            rt.inflight = rt.inflight.saturating_add(1);
            if long {
                rt.inflight_long = rt.inflight_long.saturating_add(1);
            }
            rt.inflight_w += size.weight;
            rt.inflight_out += size.output_tokens;
            // Not in any reading this VM has taken in yet.
            rt.kv_on_top += size.kv_tokens;
            rt.recent.push(now_ms, &size);
            rt.start_window.count(now_ms);
        });
    }

    /// Records that a request counted by [`Router::on_request_start`] (at `sent_ms`) ended,
    /// however it ended (answered, failed, cancelled): call it exactly once per start, with
    /// the same size and time.
    pub fn on_request_end(&mut self, pool_idx: usize, pod: &str, size: RequestSize, sent_ms: u64) {
        let long = self.cfg.is_long_answer(&size);
        self.with_pod(pool_idx, pod, |rt| {
            if long {
                rt.inflight_long = rt.inflight_long.saturating_sub(1);
            }
            rt.recent.remove(sent_ms, &size);
            rt.kv_on_top = (rt.kv_on_top - rt.kv_added(&size, sent_ms)).max(0.0);
            rt.inflight = rt.inflight.saturating_sub(1);
            rt.ended_since_snap = rt.ended_since_snap.saturating_add(1);
            if rt.inflight == 0 {
                // Nothing left in flight: drop rounding residue.
                rt.inflight_w = 0.0;
                rt.inflight_out = 0.0;
                rt.inflight_long = 0;
                rt.kv_on_top = 0.0;
            } else {
                rt.inflight_w -= size.weight;
                rt.inflight_out -= size.output_tokens;
            }
        });
    }

    /// Applies `f` to the pod at `pod` of pool `pool_idx` (nothing if unknown), then re-weighs
    /// it in every view.
    pub(super) fn with_pod(&mut self, pool_idx: usize, pod: &str, f: impl FnOnce(&mut PodRt)) {
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
}
