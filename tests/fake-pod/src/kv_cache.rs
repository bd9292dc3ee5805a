//! Decides which KV blocks the fake pod holds, which of them a new request hits and which one
//! is evicted: vLLM V1's automatic prefix caching, reduced to its bookkeeping
//! (vllm-project/vllm `vllm/v1/core/block_pool.py` at 002f349, `kv_cache_manager.py`
//! `get_computed_blocks`, `kv_cache_utils.py` `hash_block_tokens`).
//!
//! - The cache is `num_blocks` blocks of `block_size` tokens. A FULL block is keyed by a hash
//!   chained on its parent's ([`ai_lb_prefix::chain_key`] over its token ids, the first block's
//!   parent being `model_seed(model)`); a partial block has no key and is never hit.
//! - A block in use by running requests has a reference count; a hit on it shares it (one
//!   more reference), never copies it. When the count drops to 0 a keyed block goes to the
//!   tail of a free LRU (still cached, still hittable); an unkeyed one goes back to the plain
//!   free list.
//! - A new block comes from the plain free list first, else the LRU's head (oldest freed) is
//!   evicted: its key is dropped (a `BlockRemoved` event). A cached block in the LRU that a
//!   new request hits is taken back out ([`BlockPool::touch`]).
//! - A request frees its blocks last-first, so a prompt's tail is evicted before its head
//!   (vLLM `KVCacheManager.free` frees in reverse order).
//! - Like vLLM, the pool does not de-duplicate: two requests that compute the same block each
//!   cache their own copy (one `BlockStored` each), and each copy's eviction is one
//!   `BlockRemoved`.
//!
//! Pure: no clock, no I/O. Counters are in tokens, as vLLM's `prefix_cache_stats`.

use std::collections::{BTreeMap, HashMap};

/// How the engine caches (validated by `config.rs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheParams {
    /// Tokens per KV block (`--block-size`, vLLM's default 16).
    pub block_size: u32,
    /// `--prefix-caching`: false = no block is ever keyed or hit (vLLM
    /// `--no-enable-prefix-caching`).
    pub prefix_caching: bool,
    /// Parent key of a chain's first block: `ai_lb_prefix::model_seed(model)`.
    pub seed: u64,
}

impl Default for CacheParams {
    fn default() -> Self {
        Self {
            block_size: ai_lb_prefix::DEFAULT_BLOCK_TOKENS as u32,
            prefix_caching: true,
            seed: ai_lb_prefix::model_seed(""),
        }
    }
}

/// A change of the cache's contents, as vLLM's KV-event stream states it
/// (`vllm/distributed/kv_events.py`); the server publishes them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Full blocks keyed, in chain order; `token_ids` are theirs, concatenated.
    BlockStored {
        block_hashes: Vec<u64>,
        /// Key of the block before the first one; `None` for a chain's first block.
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        block_size: u32,
    },
    /// Cached blocks evicted.
    BlockRemoved { block_hashes: Vec<u64> },
    /// Every cached key dropped.
    AllBlocksCleared,
}

/// Index of a physical block.
pub type BlockId = u32;

#[derive(Debug, Clone, Default)]
struct Block {
    ref_cnt: u32,
    hash: Option<u64>,
    /// Position in the free LRU while it sits there.
    lru_stamp: Option<u64>,
}

/// Prefix-cache counters, in tokens (vLLM `vllm:prefix_cache_queries` / `_hits`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Prompt tokens of every admitted request.
    pub queries: u64,
    /// Of those, tokens found in the cache (whole blocks).
    pub hits: u64,
    /// Blocks evicted from the LRU to make room.
    pub evictions: u64,
}

/// The KV blocks of one engine.
#[derive(Debug)]
pub struct BlockPool {
    block_size: u32,
    caching: bool,
    blocks: Vec<Block>,
    /// Free blocks without a key, reused first (LIFO).
    free_plain: Vec<BlockId>,
    /// Free blocks with a key, by the stamp they were freed at: the first is evicted first.
    lru: BTreeMap<u64, BlockId>,
    next_stamp: u64,
    /// Key -> the blocks holding it (more than one when two requests computed it).
    cached: HashMap<u64, Vec<BlockId>>,
    in_use: u32,
    events: Option<Vec<KvEvent>>,
    stats: CacheStats,
}

/// Keys of every full block of `token_ids` (the hash chain of vLLM's block hashes).
pub fn block_hashes(seed: u64, token_ids: &[u32], block_size: u32) -> Vec<u64> {
    let mut out = Vec::with_capacity(token_ids.len() / block_size.max(1) as usize);
    ai_lb_prefix::block_keys_into(seed, token_ids, block_size as usize, usize::MAX, &mut out);
    out
}

impl BlockPool {
    /// `num_blocks` free blocks of `block_size` tokens; `caching` false never keys a block.
    pub fn new(num_blocks: u32, block_size: u32, caching: bool) -> Self {
        Self {
            block_size: block_size.max(1),
            caching,
            blocks: vec![Block::default(); num_blocks as usize],
            // Reversed so that block 0 is handed out first.
            free_plain: (0..num_blocks).rev().collect(),
            lru: BTreeMap::new(),
            next_stamp: 0,
            cached: HashMap::new(),
            in_use: 0,
            events: None,
            stats: CacheStats::default(),
        }
    }

    /// Starts recording [`KvEvent`]s (off by default: nobody drains them).
    pub fn enable_events(&mut self) {
        self.events.get_or_insert_with(Vec::new);
    }

    /// Moves the recorded events to `out`, oldest first.
    pub fn take_events(&mut self, out: &mut Vec<KvEvent>) {
        if let Some(ev) = self.events.as_mut() {
            out.append(ev);
        }
    }

    fn emit(&mut self, ev: KvEvent) {
        let Some(events) = self.events.as_mut() else {
            return;
        };
        // Consecutive removals (one eviction per allocated block) travel as one event.
        if let (
            KvEvent::BlockRemoved { block_hashes: new },
            Some(KvEvent::BlockRemoved { block_hashes }),
        ) = (&ev, events.last_mut())
        {
            block_hashes.extend_from_slice(new);
            return;
        }
        events.push(ev);
    }

    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    pub fn num_blocks(&self) -> u32 {
        self.blocks.len() as u32
    }

    pub fn caching(&self) -> bool {
        self.caching
    }

    /// Blocks referenced by running requests.
    pub fn in_use(&self) -> u32 {
        self.in_use
    }

    /// Blocks a new request can take: never-keyed free blocks plus the LRU (evictable).
    pub fn free_capacity(&self) -> u32 {
        (self.free_plain.len() + self.lru.len()) as u32
    }

    /// Cached (keyed) blocks, in use or in the LRU.
    pub fn cached_blocks(&self) -> u32 {
        self.cached.values().map(|v| v.len() as u32).sum()
    }

    /// Free keyed blocks waiting in the LRU.
    pub fn lru_len(&self) -> u32 {
        self.lru.len() as u32
    }

    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    /// vLLM's `kv_cache_usage_perc`: blocks in use by running requests / all blocks. Free
    /// cached blocks in the LRU are not used (vLLM `BlockPool.get_usage` = 1 − free / total,
    /// the free queue holding them).
    pub fn usage(&self) -> f64 {
        if self.blocks.is_empty() {
            return 0.0;
        }
        (f64::from(self.in_use) / self.blocks.len() as f64).clamp(0.0, 1.0)
    }

    /// Reference count of a block (tests and invariants).
    pub fn ref_count(&self, id: BlockId) -> Option<u32> {
        self.blocks.get(id as usize).map(|b| b.ref_cnt)
    }

    /// The longest run of cached blocks at the head of `hashes`, at most `max_blocks` long:
    /// one block id per hit (the first copy). Changes nothing.
    pub fn lookup(&self, hashes: &[u64], max_blocks: usize) -> Vec<BlockId> {
        if !self.caching {
            return Vec::new();
        }
        hashes
            .iter()
            .take(max_blocks)
            .map_while(|h| self.cached.get(h).and_then(|ids| ids.first().copied()))
            .collect()
    }

    /// How many of `ids` sit in the LRU (taking them back costs free capacity).
    pub fn free_among(&self, ids: &[BlockId]) -> u32 {
        ids.iter()
            .filter(|id| {
                self.blocks
                    .get(**id as usize)
                    .is_some_and(|b| b.ref_cnt == 0)
            })
            .count() as u32
    }

    /// Counts one admitted request's prompt: `prompt_tokens` queried, `hit_tokens` found.
    pub fn record_query(&mut self, prompt_tokens: u32, hit_tokens: u32) {
        self.stats.queries += u64::from(prompt_tokens);
        self.stats.hits += u64::from(hit_tokens);
    }

    /// Shares `ids` with one more request: each count + 1, taken out of the LRU at 0.
    pub fn touch(&mut self, ids: &[BlockId]) {
        for &id in ids {
            let Some(b) = self.blocks.get_mut(id as usize) else {
                continue;
            };
            if b.ref_cnt == 0 {
                if let Some(stamp) = b.lru_stamp.take() {
                    self.lru.remove(&stamp);
                }
                self.in_use += 1;
            }
            b.ref_cnt += 1;
        }
    }

    /// A new block with count 1: a never-keyed free block, else the LRU's oldest (evicted,
    /// its key dropped). `None` when every block is in use.
    pub fn allocate(&mut self) -> Option<BlockId> {
        let id = match self.free_plain.pop() {
            Some(id) => id,
            None => {
                let (_, id) = self.lru.pop_first()?;
                self.evict(id);
                id
            }
        };
        let b = self.blocks.get_mut(id as usize)?;
        b.lru_stamp = None;
        b.ref_cnt = 1;
        self.in_use += 1;
        Some(id)
    }

    fn evict(&mut self, id: BlockId) {
        let Some(hash) = self.blocks.get_mut(id as usize).and_then(|b| b.hash.take()) else {
            return;
        };
        if let Some(ids) = self.cached.get_mut(&hash) {
            ids.retain(|x| *x != id);
            if ids.is_empty() {
                self.cached.remove(&hash);
            }
        }
        self.stats.evictions += 1;
        self.emit(KvEvent::BlockRemoved {
            block_hashes: vec![hash],
        });
    }

    /// Keys the full blocks `ids[i]` with `hashes[i]` (a run of one request's chain whose
    /// first block's parent is `parent`), `token_ids` being their tokens concatenated. Blocks
    /// already keyed are left alone. No-op without caching.
    pub fn cache_blocks(
        &mut self,
        ids: &[BlockId],
        hashes: &[u64],
        parent: Option<u64>,
        token_ids: &[u32],
    ) {
        if !self.caching || ids.is_empty() {
            return;
        }
        let mut stored = Vec::with_capacity(ids.len());
        for (&id, &hash) in ids.iter().zip(hashes) {
            let Some(b) = self.blocks.get_mut(id as usize) else {
                continue;
            };
            if b.hash.is_some() {
                continue;
            }
            b.hash = Some(hash);
            self.cached.entry(hash).or_default().push(id);
            stored.push(hash);
        }
        if !stored.is_empty() {
            self.emit(KvEvent::BlockStored {
                block_hashes: stored,
                parent_block_hash: parent,
                token_ids: token_ids.to_vec(),
                block_size: self.block_size,
            });
        }
    }

    /// Releases one request's blocks, last first: each count − 1; at 0 a keyed block joins
    /// the LRU's tail, an unkeyed one the plain free list.
    pub fn free(&mut self, ids: &[BlockId]) {
        for &id in ids.iter().rev() {
            let Some(b) = self.blocks.get_mut(id as usize) else {
                continue;
            };
            if b.ref_cnt == 0 {
                continue;
            }
            b.ref_cnt -= 1;
            if b.ref_cnt > 0 {
                continue;
            }
            self.in_use -= 1;
            if b.hash.is_some() {
                let stamp = self.next_stamp;
                self.next_stamp += 1;
                b.lru_stamp = Some(stamp);
                self.lru.insert(stamp, id);
            } else {
                self.free_plain.push(id);
            }
        }
    }

    /// Drops every key (vLLM `reset_prefix_cache`): only when no block is in use, as vLLM
    /// refuses otherwise. Returns whether it did.
    pub fn reset(&mut self) -> bool {
        if self.in_use > 0 {
            return false;
        }
        for (_, id) in std::mem::take(&mut self.lru) {
            if let Some(b) = self.blocks.get_mut(id as usize) {
                b.hash = None;
                b.lru_stamp = None;
            }
            self.free_plain.push(id);
        }
        self.cached.clear();
        self.emit(KvEvent::AllBlocksCleared);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ids(n: u32) -> Vec<u32> {
        (1..=n).collect()
    }

    /// Allocates `n` blocks and keys the full ones of `tokens` (a request's whole life).
    fn store(pool: &mut BlockPool, tokens: &[u32]) -> Vec<BlockId> {
        let hashes = block_hashes(7, tokens, pool.block_size());
        let n = tokens.len().div_ceil(pool.block_size() as usize);
        let blocks: Vec<BlockId> = (0..n).filter_map(|_| pool.allocate()).collect();
        let full = hashes.len();
        let bs = pool.block_size() as usize;
        pool.cache_blocks(&blocks[..full], &hashes, None, &tokens[..full * bs]);
        blocks
    }

    #[test]
    fn only_full_blocks_are_keyed_and_hit() {
        let mut p = BlockPool::new(10, 4, true);
        p.enable_events();
        let t = ids(10); // 2 full blocks + 2 tokens
        let b = store(&mut p, &t);
        assert_eq!(b.len(), 3);
        assert_eq!(p.cached_blocks(), 2);
        let mut ev = Vec::new();
        p.take_events(&mut ev);
        assert_eq!(
            ev,
            vec![KvEvent::BlockStored {
                block_hashes: block_hashes(7, &t, 4),
                parent_block_hash: None,
                token_ids: t[..8].to_vec(),
                block_size: 4,
            }]
        );
        let h = block_hashes(7, &t, 4);
        assert_eq!(p.lookup(&h, usize::MAX), b[..2].to_vec());
        assert_eq!(p.lookup(&h, 1), b[..1].to_vec());
        let mut other = t.clone();
        other[5] = 99;
        assert_eq!(p.lookup(&block_hashes(7, &other, 4), 9), b[..1].to_vec());
    }

    #[test]
    fn freed_blocks_stay_cached_and_lru_evicts_oldest_first() {
        let mut p = BlockPool::new(4, 2, true);
        p.enable_events();
        let a = store(&mut p, &[1, 2, 3, 4]); // 2 blocks
        let b = store(&mut p, &[9, 9]); // 1 block
        p.free(&a);
        p.free(&b);
        assert_eq!(p.in_use(), 0);
        assert_eq!(p.cached_blocks(), 3);
        assert_eq!(p.usage(), 0.0, "free cached blocks are not in use");
        let mut ev = Vec::new();
        p.take_events(&mut ev);
        // Plain free block first, then the LRU: a's tail was freed first, so it goes first.
        let ha = block_hashes(7, &[1, 2, 3, 4], 2);
        let hb = block_hashes(7, &[9, 9], 2);
        let x = p.allocate().unwrap();
        assert!(
            !a.contains(&x) && !b.contains(&x),
            "the never-used block first"
        );
        ev.clear();
        p.take_events(&mut ev);
        assert!(ev.is_empty());
        assert_eq!(p.allocate(), Some(a[1]));
        assert_eq!(p.allocate(), Some(a[0]));
        assert_eq!(p.allocate(), Some(b[0]));
        assert_eq!(p.allocate(), None);
        p.take_events(&mut ev);
        assert_eq!(
            ev,
            vec![KvEvent::BlockRemoved {
                block_hashes: vec![ha[1], ha[0], hb[0]]
            }]
        );
        assert_eq!(p.stats().evictions, 3);
        assert_eq!(p.cached_blocks(), 0);
    }

    #[test]
    fn a_hit_in_the_lru_is_taken_back_out_and_shared_blocks_count_once() {
        let mut p = BlockPool::new(4, 2, true);
        let a = store(&mut p, &[1, 2, 3, 4]);
        p.free(&a);
        let h = block_hashes(7, &[1, 2, 3, 4], 2);
        let hit = p.lookup(&h, 9);
        assert_eq!(p.free_among(&hit), 2);
        p.touch(&hit);
        assert_eq!(p.in_use(), 2);
        assert_eq!(p.free_among(&hit), 0);
        p.touch(&hit); // a second request shares them
        assert_eq!(p.in_use(), 2, "shared, not counted twice");
        assert_eq!(p.ref_count(hit[0]), Some(2));
        assert_eq!(p.usage(), 0.5);
        // Neither is evictable while in use.
        assert!(p.allocate().is_some() && p.allocate().is_some());
        assert_eq!(p.allocate(), None);
        p.free(&hit);
        p.free(&hit);
        assert_eq!(p.ref_count(hit[0]), Some(0));
        p.free(&hit); // a stray free never goes negative
        assert_eq!(p.ref_count(hit[0]), Some(0));
        assert_eq!(p.in_use(), 2);
    }

    #[test]
    fn without_caching_nothing_is_keyed_or_hit() {
        let mut p = BlockPool::new(4, 2, false);
        p.enable_events();
        let a = store(&mut p, &[1, 2, 3, 4]);
        p.free(&a);
        assert_eq!(p.cached_blocks(), 0);
        assert!(p.lookup(&block_hashes(7, &[1, 2, 3, 4], 2), 9).is_empty());
        let mut ev = Vec::new();
        p.take_events(&mut ev);
        assert!(ev.is_empty());
    }

    #[test]
    fn reset_clears_keys_only_when_idle() {
        let mut p = BlockPool::new(4, 2, true);
        p.enable_events();
        let a = store(&mut p, &[1, 2]);
        assert!(!p.reset());
        p.free(&a);
        assert!(p.reset());
        assert_eq!(p.cached_blocks(), 0);
        let mut ev = Vec::new();
        p.take_events(&mut ev);
        assert_eq!(ev.last(), Some(&KvEvent::AllBlocksCleared));
        assert_eq!(p.free_capacity(), 4);
    }

    proptest! {
        /// Whatever the order of allocations, hits and frees: counts never go negative, the
        /// in-use count matches the blocks with a count, usage stays in [0, 1], every block is
        /// in exactly one place (in use, plain free list or LRU) and the key map agrees with
        /// the blocks' keys.
        #[test]
        fn pool_invariants_hold(ops in proptest::collection::vec((0u8..4, 0u32..6, 0u32..3), 1..200)) {
            let mut p = BlockPool::new(12, 2, true);
            let mut held: Vec<Vec<BlockId>> = Vec::new();
            for (op, a, b) in ops {
                match op {
                    0 => {
                        // a new request over a small token alphabet so prefixes repeat
                        let tokens: Vec<u32> = (0..(a + 1) * 2).map(|i| (i / 2 + b) % 3).collect();
                        let hashes = block_hashes(1, &tokens, 2);
                        let hit = p.lookup(&hashes, hashes.len().saturating_sub(1));
                        let need = hashes.len() as u32 - hit.len() as u32;
                        if p.free_capacity() - p.free_among(&hit) >= need {
                            p.touch(&hit);
                            let mut blocks = hit.clone();
                            for _ in 0..need {
                                if let Some(id) = p.allocate() { blocks.push(id); }
                            }
                            let n = blocks.len();
                            p.cache_blocks(&blocks[hit.len()..], &hashes[hit.len()..n],
                                hit.len().checked_sub(1).map(|i| hashes[i]), &tokens[hit.len() * 2..n * 2]);
                            held.push(blocks);
                        }
                    }
                    1 if !held.is_empty() => {
                        let i = a as usize % held.len();
                        let blocks = held.swap_remove(i);
                        p.free(&blocks);
                    }
                    2 => { let _ = p.reset(); }
                    _ => {}
                }
                let counted = p.blocks.iter().filter(|b| b.ref_cnt > 0).count() as u32;
                prop_assert_eq!(counted, p.in_use());
                prop_assert!((0.0..=1.0).contains(&p.usage()));
                let free = p.free_plain.len() + p.lru.len();
                prop_assert_eq!(free + counted as usize, p.blocks.len());
                for (h, ids) in &p.cached {
                    for id in ids { prop_assert_eq!(p.blocks[*id as usize].hash, Some(*h)); }
                }
                let keyed = p.blocks.iter().filter(|b| b.hash.is_some()).count() as u32;
                prop_assert_eq!(keyed, p.cached_blocks());
                let refs: u32 = held.iter().flatten().map(|_| 1).sum();
                let total: u32 = p.blocks.iter().map(|b| b.ref_cnt).sum();
                prop_assert_eq!(refs, total);
            }
        }
    }
}
