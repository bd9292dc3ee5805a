//! The ranked list a decision steers to (chosen pod first, then fallbacks; fixed capacity, no
//! heap), and how the glue reads it back: a pod's address, the routing header.

use super::{Router, NONE};
use crate::config::MAX_FALLBACK_ENDPOINTS;

/// Most entries in a ranked list (chosen + `MAX_FALLBACK_ENDPOINTS`).
pub const MAX_RANKED: usize = MAX_FALLBACK_ENDPOINTS + 1;

/// A pod of one pool, valid for the pool layout it came from (see [`Router::address`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PodId(pub(super) u32);

/// Chosen pod first, then fallbacks; fixed capacity, no heap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ranked {
    ids: [u32; MAX_RANKED],
    len: u8,
    generation: u64,
}

impl Ranked {
    pub(super) fn new(generation: u64) -> Self {
        Self {
            ids: [NONE; MAX_RANKED],
            len: 0,
            generation,
        }
    }

    pub(super) fn push(&mut self, id: u32) {
        if let Some(slot) = self.ids.get_mut(usize::from(self.len)) {
            *slot = id;
            self.len += 1;
        }
    }

    pub(super) fn contains(&self, id: u32) -> bool {
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

impl Router {
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
}

#[cfg(test)]
mod tests {
    use super::*;

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
