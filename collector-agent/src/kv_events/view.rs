//! Decides what the pod's prefix cache holds, from its KV events, in the key space of
//! `ai-lb-prefix`: a map of the pod's cached blocks (hash → parent hash, token ids, copies,
//! when last stored) and the [`Summary`] derived from it.
//!
//! Derivation: a pod block is reachable when its parent chain up to a chain's first block
//! (parent `None`) is cached. Walking reachable blocks from every first block gives each
//! chain's token ids; key block j of a chain (`block_tokens` tokens, a whole number of pod
//! blocks) is listed when every pod block up to its end is reachable, and its key is
//! `block_keys_into(model_seed(model), chain_tokens, block_tokens)`'s j-th key, i.e. what a
//! sidecar computes from a prompt with the same tokens. So evicting a block drops every key
//! block from the one that holds it to the end of every chain through it. Keys are pushed as
//! `short_key`, sorted, de-duplicated. Over the budget, the most recently stored key blocks
//! are kept, a key block's recency being the latest store of any block of it or of the chain
//! after it, so the kept set is prefix-closed (a kept key's predecessors are kept).
//!
//! vLLM does not de-duplicate blocks: two requests computing the same block store it twice
//! and each eviction removes one copy, so a block is dropped when its last copy is removed.
//! Pure: no I/O, no clock.

use super::wire::Event;
use std::collections::{HashMap, HashSet};

#[derive(Debug, Clone)]
struct Node {
    /// `None` = the first block of a chain (its parent is the model's seed).
    parent: Option<u64>,
    tokens: Vec<u32>,
    /// Stored copies not yet removed.
    copies: u32,
    /// Store counter at the last store of this block.
    stamp: u64,
}

/// The pod's prefix cache contents as a sidecar reads them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Summary {
    /// `short_key` of every listed key block, ascending, no duplicates.
    pub keys: Vec<u32>,
    /// More key blocks were cached than the budget allowed.
    pub truncated: bool,
    /// Tokens per key block.
    pub block_tokens: u32,
}

/// Why no summary can be derived.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SummaryError {
    #[error(
        "--prefix-block-tokens {block_tokens} is not a multiple of the pod's KV block size \
         {pod_block_size}: key blocks must cover whole pod blocks"
    )]
    BlockSize {
        block_tokens: u32,
        pod_block_size: u32,
    },
}

/// What applying one event did, for the counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// The view changed.
    Changed,
    /// Nothing to change (a removal of an unknown block).
    Unchanged,
    /// Not a GPU block of the base model (another `medium`, a LoRA adapter's block).
    Ignored,
    /// The pod's block size changed: the view was cleared before applying.
    BlockSizeChanged { from: u32, to: u32 },
}

/// The pod's cached blocks.
#[derive(Debug, Clone)]
pub struct PrefixView {
    block_tokens: u32,
    max_keys: usize,
    nodes: HashMap<u64, Node>,
    /// Parent hash → hashes of present blocks whose parent it is (the parent may be absent).
    children: HashMap<u64, Vec<u64>>,
    /// Present blocks that start a chain.
    roots: HashSet<u64>,
    pod_block_size: Option<u32>,
    stamp: u64,
    /// Bumped on every change, so a summary can be reused while it is unchanged.
    generation: u64,
}

impl PrefixView {
    /// `block_tokens` > 0 and `max_keys` > 0 (validated by the configuration).
    pub fn new(block_tokens: u32, max_keys: usize) -> Self {
        Self {
            block_tokens: block_tokens.max(1),
            max_keys: max_keys.max(1),
            nodes: HashMap::new(),
            children: HashMap::new(),
            roots: HashSet::new(),
            pod_block_size: None,
            stamp: 0,
            generation: 0,
        }
    }

    /// Blocks tracked (cached in the pod as far as the events say, reachable or not).
    pub fn blocks(&self) -> usize {
        self.nodes.len()
    }

    /// The pod's KV block size, once a stored event stated it.
    pub fn pod_block_size(&self) -> Option<u32> {
        self.pod_block_size
    }

    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Forgets every block (a gap that cannot be replayed, a publisher restart,
    /// `AllBlocksCleared`).
    pub fn clear(&mut self) {
        self.nodes.clear();
        self.children.clear();
        self.roots.clear();
        self.generation += 1;
    }

    /// Applies one event.
    pub fn apply(&mut self, ev: &Event) -> Applied {
        match ev {
            Event::Cleared => {
                let had = !self.nodes.is_empty();
                self.clear();
                if had {
                    Applied::Changed
                } else {
                    Applied::Unchanged
                }
            }
            Event::Removed {
                block_hashes,
                medium,
            } => {
                if !is_gpu(medium.as_deref()) {
                    return Applied::Ignored;
                }
                let mut changed = false;
                for h in block_hashes {
                    changed |= self.remove_copy(*h);
                }
                if changed {
                    self.generation += 1;
                    Applied::Changed
                } else {
                    Applied::Unchanged
                }
            }
            Event::Stored {
                block_hashes,
                parent,
                token_ids,
                block_size,
                medium,
                lora,
            } => {
                if *lora || !is_gpu(medium.as_deref()) {
                    return Applied::Ignored;
                }
                let mut result = Applied::Changed;
                if let Some(from) = self.pod_block_size.filter(|b| b != block_size) {
                    self.clear();
                    result = Applied::BlockSizeChanged {
                        from,
                        to: *block_size,
                    };
                }
                self.pod_block_size = Some(*block_size);
                let mut parent = *parent;
                for (h, tokens) in block_hashes
                    .iter()
                    .zip(token_ids.chunks_exact(*block_size as usize))
                {
                    self.store(*h, parent, tokens);
                    parent = Some(*h);
                }
                self.generation += 1;
                result
            }
        }
    }

    fn link(&mut self, h: u64, parent: Option<u64>) {
        match parent {
            None => {
                self.roots.insert(h);
            }
            Some(p) => {
                let c = self.children.entry(p).or_default();
                if !c.contains(&h) {
                    c.push(h);
                }
            }
        }
    }

    fn unlink(&mut self, h: u64, parent: Option<u64>) {
        match parent {
            None => {
                self.roots.remove(&h);
            }
            Some(p) => {
                if let Some(c) = self.children.get_mut(&p) {
                    c.retain(|x| *x != h);
                    if c.is_empty() {
                        self.children.remove(&p);
                    }
                }
            }
        }
    }

    fn store(&mut self, h: u64, parent: Option<u64>, tokens: &[u32]) {
        self.stamp += 1;
        let stamp = self.stamp;
        let old_parent = match self.nodes.get_mut(&h) {
            Some(n) => {
                n.copies = n.copies.saturating_add(1);
                n.stamp = stamp;
                let old = n.parent;
                n.parent = parent;
                n.tokens = tokens.to_vec();
                Some(old)
            }
            None => {
                self.nodes.insert(
                    h,
                    Node {
                        parent,
                        tokens: tokens.to_vec(),
                        copies: 1,
                        stamp,
                    },
                );
                None
            }
        };
        if let Some(old) = old_parent {
            if old != parent {
                self.unlink(h, old);
            }
        }
        self.link(h, parent);
    }

    /// Removes one copy of `h`; the block goes with its last copy. Whether anything changed.
    fn remove_copy(&mut self, h: u64) -> bool {
        let Some(n) = self.nodes.get_mut(&h) else {
            return false;
        };
        n.copies = n.copies.saturating_sub(1);
        if n.copies > 0 {
            return false;
        }
        let parent = n.parent;
        self.nodes.remove(&h);
        self.unlink(h, parent);
        true
    }

    /// The key blocks of every fully cached chain prefix, keyed from `seed`
    /// (`ai_lb_prefix::model_seed(model)`).
    pub fn summary(&self, seed: u64) -> Result<Summary, SummaryError> {
        let Some(bs) = self.pod_block_size else {
            return Ok(Summary {
                block_tokens: self.block_tokens,
                ..Summary::default()
            });
        };
        if self.block_tokens % bs != 0 {
            return Err(SummaryError::BlockSize {
                block_tokens: self.block_tokens,
                pod_block_size: bs,
            });
        }
        let per = (self.block_tokens / bs) as usize;
        // Key blocks in pre-order: (key, recency, index of the previous key block).
        let mut found: Vec<(u64, u64, Option<usize>)> = Vec::new();
        struct Frame {
            hash: u64,
            /// Pod blocks since the last key-block boundary, this one included.
            depth_in_key: usize,
            prev_key: u64,
            prev_index: Option<usize>,
            tokens: Vec<u32>,
            recency: u64,
        }
        let mut stack: Vec<Frame> = self
            .roots
            .iter()
            .map(|h| Frame {
                hash: *h,
                depth_in_key: 1,
                prev_key: seed,
                prev_index: None,
                tokens: Vec::with_capacity(self.block_tokens as usize),
                recency: 0,
            })
            .collect();
        while let Some(mut f) = stack.pop() {
            let Some(node) = self.nodes.get(&f.hash) else {
                continue;
            };
            f.tokens.extend_from_slice(&node.tokens);
            f.recency = f.recency.max(node.stamp);
            let (mut key, mut index) = (f.prev_key, f.prev_index);
            let boundary = f.depth_in_key == per;
            if boundary {
                key = ai_lb_prefix::chain_key(f.prev_key, &f.tokens);
                found.push((key, f.recency, f.prev_index));
                index = Some(found.len() - 1);
            }
            for child in self.children.get(&f.hash).into_iter().flatten() {
                stack.push(if boundary {
                    Frame {
                        hash: *child,
                        depth_in_key: 1,
                        prev_key: key,
                        prev_index: index,
                        tokens: Vec::with_capacity(self.block_tokens as usize),
                        recency: 0,
                    }
                } else {
                    Frame {
                        hash: *child,
                        depth_in_key: f.depth_in_key + 1,
                        prev_key: key,
                        prev_index: index,
                        tokens: f.tokens.clone(),
                        recency: f.recency,
                    }
                });
            }
        }
        // A key block is as recent as anything after it on a chain: children come after their
        // parents in pre-order, so one backward pass carries the maximum up.
        for i in (0..found.len()).rev() {
            let (_, r, parent) = found[i];
            if let Some(p) = parent {
                if found[p].1 < r {
                    found[p].1 = r;
                }
            }
        }
        let truncated = found.len() > self.max_keys;
        if truncated {
            // Newest first; on a tie the shallower (the predecessor) first: prefix-closed.
            let depth = |mut i: usize| {
                let mut d = 0usize;
                while let Some(p) = found[i].2 {
                    d += 1;
                    i = p;
                }
                d
            };
            let mut order: Vec<(u64, usize, usize)> = (0..found.len())
                .map(|i| (found[i].1, depth(i), i))
                .collect();
            order.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
            order.truncate(self.max_keys);
            let keep: HashSet<usize> = order.into_iter().map(|(_, _, i)| i).collect();
            found = found
                .into_iter()
                .enumerate()
                .filter(|(i, _)| keep.contains(i))
                .map(|(_, f)| f)
                .collect();
        }
        let mut keys: Vec<u32> = found
            .iter()
            .map(|(k, _, _)| ai_lb_prefix::short_key(*k))
            .collect();
        keys.sort_unstable();
        keys.dedup();
        Ok(Summary {
            keys,
            truncated,
            block_tokens: self.block_tokens,
        })
    }
}

/// vLLM's GPU medium (or none stated).
fn is_gpu(medium: Option<&str>) -> bool {
    medium.is_none_or(|m| m.eq_ignore_ascii_case("GPU"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ai_lb_prefix::{block_keys_into, model_seed, short_key};
    use proptest::prelude::*;

    const BS: usize = 16;

    fn seed() -> u64 {
        model_seed("m")
    }

    /// The pod's hashes of `tokens` in blocks of 16 (any identities would do).
    fn pod_hashes(tokens: &[u32]) -> Vec<u64> {
        let mut h = Vec::new();
        block_keys_into(12345, tokens, BS, usize::MAX, &mut h);
        h
    }

    fn stored(tokens: &[u32], from_block: usize, to_block: usize) -> Event {
        let h = pod_hashes(tokens);
        Event::Stored {
            block_hashes: h[from_block..to_block].to_vec(),
            parent: from_block.checked_sub(1).map(|i| h[i]),
            token_ids: tokens[from_block * BS..to_block * BS].to_vec(),
            block_size: BS as u32,
            medium: Some("GPU".into()),
            lora: false,
        }
    }

    fn removed(tokens: &[u32], blocks: &[usize]) -> Event {
        let h = pod_hashes(tokens);
        Event::Removed {
            block_hashes: blocks.iter().map(|i| h[*i]).collect(),
            medium: None,
        }
    }

    /// What a sidecar pushes for `tokens`: the short keys of its first `n` 64-token blocks.
    fn sidecar(tokens: &[u32], n: usize) -> Vec<u32> {
        let mut k = Vec::new();
        block_keys_into(seed(), tokens, 64, n, &mut k);
        let mut s: Vec<u32> = k.into_iter().map(short_key).collect();
        s.sort_unstable();
        s
    }

    fn keys(v: &PrefixView) -> Vec<u32> {
        v.summary(seed()).unwrap().keys
    }

    fn toks(n: u32, salt: u32) -> Vec<u32> {
        (0..n).map(|i| i * 7 + salt).collect()
    }

    #[test]
    fn a_chain_lists_its_whole_key_blocks_with_the_sidecars_keys() {
        let t = toks(300, 0); // 18 pod blocks, 4 whole key blocks of 64
        let mut v = PrefixView::new(64, 4096);
        assert_eq!(
            v.summary(seed()).unwrap(),
            Summary {
                keys: vec![],
                truncated: false,
                block_tokens: 64
            }
        );
        // Stored in pieces, as chunked prefill and decode store them.
        v.apply(&stored(&t, 0, 5));
        assert_eq!(keys(&v), sidecar(&t, 1));
        v.apply(&stored(&t, 5, 18));
        assert_eq!(keys(&v), sidecar(&t, 4));
        assert_eq!(v.blocks(), 18);
        // A second prompt sharing the first 100 tokens shares the first key block only.
        let mut u = t[..100].to_vec();
        u.extend(toks(100, 1));
        // Its pod blocks 0..6 (tokens 0..96) are t's. Stored from block 7 on, its block 6 is
        // missing: nothing of it past the shared key block 0 is listed.
        v.apply(&stored(&u, 7, 12));
        assert_eq!(keys(&v), sidecar(&t, 4));
        v.apply(&stored(&u, 6, 7));
        let mut want = sidecar(&t, 4);
        want.extend(sidecar(&u, 3));
        want.sort_unstable();
        want.dedup();
        assert_eq!(keys(&v), want);
    }

    #[test]
    fn evicting_a_middle_block_drops_every_key_after_it() {
        let t = toks(300, 0);
        let mut v = PrefixView::new(64, 4096);
        v.apply(&stored(&t, 0, 18));
        // Block 9 sits in key block 2 (pod blocks 8..12).
        v.apply(&removed(&t, &[9]));
        assert_eq!(keys(&v), sidecar(&t, 2));
        // Stored again (recomputed after a miss), the chain is whole again.
        v.apply(&stored(&t, 9, 10));
        assert_eq!(keys(&v), sidecar(&t, 4));
        // The first block gone: nothing is reachable.
        v.apply(&removed(&t, &[0]));
        assert!(keys(&v).is_empty());
        assert_eq!(v.blocks(), 17);
    }

    #[test]
    fn a_block_stored_twice_goes_with_its_last_copy() {
        let t = toks(64, 0);
        let mut v = PrefixView::new(64, 4096);
        v.apply(&stored(&t, 0, 4));
        v.apply(&stored(&t, 3, 4)); // a second request computed block 3 too
        v.apply(&removed(&t, &[3]));
        assert_eq!(keys(&v), sidecar(&t, 1), "one copy left");
        v.apply(&removed(&t, &[3]));
        assert!(keys(&v).is_empty());
        assert_eq!(
            v.apply(&removed(&t, &[3])),
            Applied::Unchanged,
            "unknown block"
        );
    }

    #[test]
    fn all_blocks_cleared_empties_the_view() {
        let t = toks(128, 0);
        let mut v = PrefixView::new(64, 4096);
        v.apply(&stored(&t, 0, 8));
        let g = v.generation();
        assert_eq!(v.apply(&Event::Cleared), Applied::Changed);
        assert!(v.generation() > g);
        assert!(keys(&v).is_empty());
        assert_eq!(v.blocks(), 0);
    }

    #[test]
    fn over_the_budget_the_most_recent_chains_are_kept_and_truncated_set() {
        let a = toks(256, 0); // 4 key blocks
        let b = toks(128, 1); // 2 key blocks, stored later
        let mut v = PrefixView::new(64, 3);
        v.apply(&stored(&a, 0, 16));
        v.apply(&stored(&b, 0, 8));
        let s = v.summary(seed()).unwrap();
        assert!(s.truncated);
        // b (newest) whole, then a's first key block: prefix-closed.
        let mut want = sidecar(&b, 2);
        want.extend(sidecar(&a, 1));
        want.sort_unstable();
        assert_eq!(s.keys, want);
        let mut v = PrefixView::new(64, 6);
        v.apply(&stored(&a, 0, 16));
        v.apply(&stored(&b, 0, 8));
        assert!(!v.summary(seed()).unwrap().truncated);
        assert_eq!(v.summary(seed()).unwrap().keys.len(), 6);
    }

    #[test]
    fn a_key_block_size_that_is_not_a_multiple_is_refused_naming_the_flag() {
        let t = toks(96, 0);
        let mut v = PrefixView::new(40, 4096);
        v.apply(&stored(&t, 0, 6));
        assert_eq!(
            v.summary(seed()).unwrap_err().to_string(),
            "--prefix-block-tokens 40 is not a multiple of the pod's KV block size 16: key \
             blocks must cover whole pod blocks"
        );
        // Key blocks of one pod block work too.
        let mut v = PrefixView::new(16, 4096);
        v.apply(&stored(&t, 0, 6));
        let mut k = Vec::new();
        block_keys_into(seed(), &t, 16, 6, &mut k);
        let mut want: Vec<u32> = k.into_iter().map(short_key).collect();
        want.sort_unstable();
        assert_eq!(keys(&v), want);
    }

    #[test]
    fn other_media_and_adapters_are_ignored_and_a_new_block_size_clears() {
        let t = toks(64, 0);
        let mut v = PrefixView::new(64, 4096);
        let mut cpu = stored(&t, 0, 4);
        if let Event::Stored { medium, .. } = &mut cpu {
            *medium = Some("CPU".into());
        }
        assert_eq!(v.apply(&cpu), Applied::Ignored);
        let mut lora = stored(&t, 0, 4);
        if let Event::Stored { lora, .. } = &mut lora {
            *lora = true;
        }
        assert_eq!(v.apply(&lora), Applied::Ignored);
        assert_eq!(v.blocks(), 0);
        v.apply(&stored(&t, 0, 4));
        let big = Event::Stored {
            block_hashes: vec![1],
            parent: None,
            token_ids: t[..32].to_vec(),
            block_size: 32,
            medium: None,
            lora: false,
        };
        assert_eq!(
            v.apply(&big),
            Applied::BlockSizeChanged { from: 16, to: 32 }
        );
        assert_eq!(v.blocks(), 1);
    }

    proptest! {
        /// Whatever is stored and removed, the summary lists exactly the key blocks whose
        /// pod blocks (and all before them) are cached, as the sidecar keys them.
        #[test]
        fn summary_matches_the_cached_prefixes(
            lens in proptest::collection::vec(1usize..12, 1..5),
            removals in proptest::collection::vec((0usize..5, 0usize..12), 0..8),
        ) {
            let mut v = PrefixView::new(64, 4096);
            // Prompts sharing their first 2 pod blocks.
            let prompts: Vec<Vec<u32>> = lens.iter().enumerate().map(|(i, n)| {
                let mut t = toks(32, 0);
                t.extend(toks((*n as u32) * 16, 1 + i as u32));
                t
            }).collect();
            let mut cached: Vec<Vec<bool>> = Vec::new();
            for p in &prompts {
                let n = p.len() / BS;
                v.apply(&stored(p, 0, n));
                cached.push(vec![true; n]);
            }
            // The 2 shared blocks were stored once per prompt: one copy each.
            let mut shared = [prompts.len(); 2];
            for (pi, b) in removals {
                let pi = pi % prompts.len();
                let p = &prompts[pi];
                let b = b % (p.len() / BS);
                v.apply(&removed(p, &[b]));
                if b < 2 {
                    shared[b] = shared[b].saturating_sub(1);
                } else {
                    cached[pi][b] = false;
                }
            }
            for c in cached.iter_mut() {
                for (b, n) in shared.iter().enumerate() {
                    c[b] = *n > 0;
                }
            }
            let mut want = Vec::new();
            for (p, c) in prompts.iter().zip(&cached) {
                let whole = c.iter().take_while(|x| **x).count();
                want.extend(sidecar(p, whole * BS / 64));
            }
            want.sort_unstable();
            want.dedup();
            prop_assert_eq!(keys(&v), want);
        }
    }
}
