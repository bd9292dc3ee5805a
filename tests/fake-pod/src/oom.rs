//! The `memory_growth` fault: GPU memory that grows with load and ends in an OOM crash unless
//! the load falls (issue 30 part 2).
//!
//! vLLM preallocates `MEMORY_USED_FRACTION` of the GPU; what grows past it here stands for
//! what a real engine allocates outside its KV-cache pool under load (activation peaks of
//! large batches, fragmentation, a leak per request). Above `sustained_seqs` running
//! sequences the extra grows by `bytes_per_s_per_seq` for each sequence over it; below, it
//! falls at the same rate per sequence under it, down to 0. When used memory reaches the
//! total, the engine "OOM-crashes": every request in flight fails (as when vLLM's process
//! dies), and the pod answers nothing but `/sim/gpu` and `/control` for `restart_ms`, then
//! comes back with its memory back at the preallocation.

use serde::Serialize;

/// The fault's parameters (`POST /control {"memory_growth": {...}}`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct MemoryGrowth {
    /// Bytes per second each running sequence over `sustained_seqs` adds (> 0).
    pub bytes_per_s_per_seq: f64,
    /// Running sequences at which memory holds steady (≥ 0).
    pub sustained_seqs: f64,
    /// How long the pod stays down after an OOM crash (ms).
    pub restart_ms: u64,
}

/// The memory past the preallocation, and the crashes, over time (seconds of the pod's
/// clock).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct OomModel {
    /// Bytes past the preallocation.
    pub extra_bytes: f64,
    #[serde(skip)]
    last_t: Option<f64>,
    /// Down (crashed, restarting) until this time.
    #[serde(skip)]
    down_until: Option<f64>,
    /// OOM crashes so far, and the requests in flight they failed.
    pub crashes: u64,
    pub failed_in_flight: u64,
}

impl OomModel {
    /// Advances to `now` with `running` sequences since the last call (under `growth`, None:
    /// no fault, the extra is dropped); `headroom` is the bytes between the preallocation and
    /// the total. Returns true when the pod crashes at this call.
    pub fn advance(
        &mut self,
        now: f64,
        running: usize,
        growth: Option<&MemoryGrowth>,
        headroom: f64,
    ) -> bool {
        let dt = self.last_t.map_or(0.0, |t| (now - t).max(0.0));
        self.last_t = Some(now);
        let Some(g) = growth else {
            self.extra_bytes = 0.0;
            return false;
        };
        if self.down(now) {
            return false;
        }
        if self.down_until.is_some() {
            // Restarted: the memory is back at the preallocation.
            self.down_until = None;
            self.extra_bytes = 0.0;
            return false;
        }
        let over = running as f64 - g.sustained_seqs;
        self.extra_bytes = (self.extra_bytes + over * g.bytes_per_s_per_seq * dt).max(0.0);
        if self.extra_bytes >= headroom {
            self.crashes += 1;
            self.extra_bytes = 0.0;
            self.down_until = Some(now + g.restart_ms as f64 / 1000.0);
            return true;
        }
        false
    }

    /// Whether the pod is down (crashed, not yet restarted) at `now`.
    pub fn down(&self, now: f64) -> bool {
        self.down_until.is_some_and(|t| now < t)
    }

    /// Memory used at `now` of `total`, the preallocation being `base`: the CUDA context's
    /// few hundred MB while down, else the preallocation plus the extra.
    pub fn used_bytes(&self, base: u64, total: u64, now: f64) -> u64 {
        if self.down(now) {
            return 500_000_000u64.min(total);
        }
        (base as f64 + self.extra_bytes).min(total as f64) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: MemoryGrowth = MemoryGrowth {
        bytes_per_s_per_seq: 1e8,
        sustained_seqs: 4.0,
        restart_ms: 2000,
    };

    #[test]
    fn memory_grows_with_load_and_falls_when_it_falls() {
        let mut m = OomModel::default();
        assert!(!m.advance(0.0, 14, Some(&G), 8e9));
        assert!(!m.advance(1.0, 14, Some(&G), 8e9));
        // 10 sequences over for 1 s at 100 MB/s each.
        assert!((m.extra_bytes - 1e9).abs() < 1.0);
        assert!(!m.advance(2.0, 0, Some(&G), 8e9));
        assert!((m.extra_bytes - 6e8).abs() < 1.0);
        assert!(!m.advance(10.0, 0, Some(&G), 8e9));
        assert_eq!(m.extra_bytes, 0.0, "never below the preallocation");
        assert_eq!(m.used_bytes(72, 80, 10.0), 72);
    }

    #[test]
    fn reaching_the_total_crashes_and_the_pod_restarts_reset() {
        let mut m = OomModel::default();
        m.advance(0.0, 24, Some(&G), 8e9);
        // 20 over × 100 MB/s = 2 GB/s: 8 GB in 4 s.
        assert!(!m.advance(3.9, 24, Some(&G), 8e9));
        assert!(m.advance(4.0, 24, Some(&G), 8e9));
        assert_eq!(m.crashes, 1);
        assert!(m.down(5.0));
        assert_eq!(
            m.used_bytes(72_000_000_000, 80_000_000_000, 5.0),
            500_000_000
        );
        assert!(
            !m.advance(5.0, 24, Some(&G), 8e9),
            "no second crash while down"
        );
        assert!(!m.down(6.0));
        assert!(!m.advance(6.0, 24, Some(&G), 8e9));
        assert_eq!(m.extra_bytes, 0.0, "back at the preallocation");
        assert_eq!(m.crashes, 1);
    }

    #[test]
    fn without_the_fault_nothing_grows() {
        let mut m = OomModel::default();
        m.advance(0.0, 10, Some(&G), 8e9);
        m.advance(1.0, 10, Some(&G), 8e9);
        assert!(m.extra_bytes > 0.0);
        assert!(!m.advance(2.0, 10, None, 8e9));
        assert_eq!(m.extra_bytes, 0.0);
    }
}
