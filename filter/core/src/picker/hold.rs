//! Whether a big request waits in the sidecar (`bigRequestHold`) instead of taking a pod's
//! seats and KV cache from the short requests behind it.

use super::view::Verdict;
use super::{RequestSize, Router};

impl Router {
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
    ///
    /// [`BIG_KV_FACTOR`]: super::size::BIG_KV_FACTOR
    /// [`PodRt::room_for_big`]: super::pod::PodRt::room_for_big
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
        let Some(vi) = self.fresh_view(pool_idx, model, None, now_ms) else {
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
}
