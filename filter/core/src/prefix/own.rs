//! Decides what this sidecar knows of the pods' caches before their agents report it: the
//! prefixes it sent to each pod in the last `ownTtlMs`. A pod caches a prompt's blocks once it
//! has prefilled them, and its agent's next report (tens of ms later) lists them; until then
//! only the sidecar that sent the prompt knows, and its next request with the same prefix
//! should follow it there.
//!
//! One bounded map per pool, key block → (pod, when sent): the latest send of a key wins, and
//! the oldest entries go first when it is full (a ring of insertions), so memory is fixed.

use std::collections::{HashMap, VecDeque};

/// Most key blocks remembered per pool (about 64 prompts of 8 192 tokens in 64-token blocks).
pub const OWN_CAPACITY: usize = 8192;

#[derive(Debug, Clone, Default)]
pub struct OwnSends {
    latest: HashMap<u32, (u32, u64)>,
    order: VecDeque<(u32, u64)>,
}

impl OwnSends {
    /// Records that `keys` were sent to pod `pod` at `now_ms`.
    pub fn record(&mut self, pod: u32, keys: &[u32], now_ms: u64) {
        for &k in keys {
            if self.order.len() >= OWN_CAPACITY {
                if let Some((old, at)) = self.order.pop_front() {
                    if self.latest.get(&old).is_some_and(|e| e.1 == at) {
                        self.latest.remove(&old);
                    }
                }
            }
            self.latest.insert(k, (pod, now_ms));
            self.order.push_back((k, now_ms));
        }
    }

    /// The pod this sidecar last sent the prompt's first key block to within `ttl_ms`, and
    /// how many of the prompt's leading key blocks it sent there since.
    pub fn leading_match(&self, keys: &[u32], now_ms: u64, ttl_ms: u64) -> Option<(u32, usize)> {
        let fresh = |k: &u32| {
            self.latest
                .get(k)
                .filter(|(_, at)| now_ms.saturating_sub(*at) <= ttl_ms)
                .map(|(pod, _)| *pod)
        };
        let pod = fresh(keys.first()?)?;
        let n = keys.iter().take_while(|k| fresh(k) == Some(pod)).count();
        Some((pod, n))
    }

    /// Forgets everything (the pool's pods were renumbered).
    pub fn clear(&mut self) {
        self.latest.clear();
        self.order.clear();
    }

    pub fn len(&self) -> usize {
        self.latest.len()
    }

    pub fn is_empty(&self) -> bool {
        self.latest.is_empty()
    }
}

/// The rendezvous (highest random weight) score of pod `pod_hash` for a prompt whose leading
/// key block is `key`: every sidecar computes the same, so a prefix no pod holds yet goes to
/// the same pod from all of them (Thaler and Ravishankar's HRW hashing).
pub fn rendezvous(key: u32, pod_hash: u64) -> u64 {
    let mut x = pod_hash ^ u64::from(key).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// FNV-1a 64's offset basis: where [`fnv1a`] starts.
pub const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// `h` extended by `bytes` with FNV-1a 64 (a stable hash, the same in every VM and build).
pub fn fnv1a(h: u64, bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(h, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// A stable hash of a pod's address (FNV-1a 64) for [`rendezvous`].
pub fn pod_hash(address: &str) -> u64 {
    fnv1a(FNV_OFFSET, address.bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_latest_send_wins_and_old_ones_expire() {
        let mut o = OwnSends::default();
        o.record(1, &[10, 11, 12], 100);
        assert_eq!(o.leading_match(&[10, 11, 12, 13], 150, 1000), Some((1, 3)));
        // The same prefix sent to pod 2 later: it is there now, for the blocks sent.
        o.record(2, &[10, 11], 200);
        assert_eq!(o.leading_match(&[10, 11, 12], 250, 1000), Some((2, 2)));
        // Expired.
        assert_eq!(o.leading_match(&[10, 11], 1300, 1000), None);
        assert_eq!(o.leading_match(&[99], 250, 1000), None);
        assert_eq!(o.leading_match(&[], 250, 1000), None);
    }

    #[test]
    fn memory_is_bounded_and_the_oldest_go_first() {
        let mut o = OwnSends::default();
        let keys: Vec<u32> = (0..(OWN_CAPACITY as u32 + 100)).collect();
        o.record(3, &keys, 1);
        assert_eq!(o.len(), OWN_CAPACITY);
        assert_eq!(o.leading_match(&[0], 1, 10), None);
        assert_eq!(o.leading_match(&[100], 1, 10), Some((3, 1)));
        // A key re-sent keeps its newest entry when its older ring entry is evicted.
        let mut o = OwnSends::default();
        o.record(1, &[7], 1);
        o.record(2, &[7], 2);
        let filler: Vec<u32> = (1000..1000 + OWN_CAPACITY as u32 - 1).collect();
        o.record(5, &filler, 3);
        assert_eq!(o.leading_match(&[7], 3, 10), Some((2, 1)));
    }

    #[test]
    fn rendezvous_spreads_keys_and_agrees_everywhere() {
        let pods: Vec<u64> = (0..8)
            .map(|i| pod_hash(&format!("10.0.0.{i}:8000")))
            .collect();
        let mut wins = [0u32; 8];
        for key in 0..8000u32 {
            let best = (0..8).max_by_key(|&i| rendezvous(key, pods[i])).unwrap();
            wins[best] += 1;
        }
        // Each pod wins about an eighth (1000 ± 15 %).
        assert!(wins.iter().all(|w| (850..1150).contains(w)), "{wins:?}");
        // Removing a pod moves only its keys.
        let moved = (0..8000u32)
            .filter(|&key| {
                let all = (0..8).max_by_key(|&i| rendezvous(key, pods[i])).unwrap();
                let without = (1..8).max_by_key(|&i| rendezvous(key, pods[i])).unwrap();
                all != 0 && all != without
            })
            .count();
        assert_eq!(moved, 0);
    }
}
