//! Decides which pods probably hold a request's prompt prefix in their KV cache: llm-d's
//! approximate prefix index at ebab68792
//! (`pkg/epp/framework/plugins/requestcontrol/dataproducer/{prefixhash/hashing.go,
//! approximateprefix/{plugin.go,indexer.go,types.go}}`).
//!
//! - Block hashes: the pseudo-tokens are cut into blocks of `block_size` tokens (the last block
//!   may be short), at most `max_blocks` of them. The chain starts at xxHash64 (seed 0) of the
//!   model name followed by the request's `cache_salt`; each block's hash is xxHash64 of its
//!   token ids (little-endian u32s) as 8 little-endian bytes, followed by the previous hash as
//!   8 little-endian bytes, hashed again with xxHash64.
//! - The index: per pod, an LRU of block hashes (capacity given when the pod's LRU is first
//!   created, never resized), and a map hash → pods. Recording a pick adds the request's hashes
//!   to the chosen pod's LRU (an eviction removes the pod from that hash's entry), then adds the
//!   pod to every hash's entry, in that order, as llm-d does (so a hash evicted by the same
//!   insertion stays listed for the pod until evicted again).
//! - Matching: walk the request's hashes in order; stop at the first hash no pod holds; every
//!   pod holding a hash on the way gets one more matched block.

use std::collections::{BTreeMap, HashMap};

use xxhash_rust::xxh64::{xxh64, Xxh64};

/// One block hash.
pub type BlockHash = u64;

/// llm-d's `minBlockSizeTokens`: block sizes below this are raised to it.
pub const MIN_BLOCK_SIZE_TOKENS: usize = 64;
/// llm-d's `defaultBlockSizeTokens` (vLLM's default), used when no pod reports one.
pub const DEFAULT_BLOCK_SIZE_TOKENS: usize = 16;
/// llm-d's `defaultMaxPrefixTokens`: prefix matching stops after this many tokens.
pub const DEFAULT_MAX_PREFIX_TOKENS: usize = 131_072;
/// llm-d's `defaultLRUCapacityPerServer`: LRU entries per pod when the pod reports no GPU
/// block count.
pub const DEFAULT_LRU_CAPACITY_PER_SERVER: usize = 31_250;

/// The hash chain of one prompt.
pub fn block_hashes(
    model: &str,
    cache_salt: &str,
    tokens: &[u32],
    block_size: usize,
    max_blocks: usize,
) -> Vec<BlockHash> {
    if tokens.is_empty() || block_size == 0 {
        return Vec::new();
    }
    let mut seed = Xxh64::new(0);
    seed.update(model.as_bytes());
    if !cache_salt.is_empty() {
        seed.update(cache_salt.as_bytes());
    }
    let mut prev = seed.digest();
    let mut out = Vec::with_capacity(tokens.len().div_ceil(block_size).min(max_blocks));
    let mut block_bytes = Vec::with_capacity(block_size * 4);
    for block in tokens.chunks(block_size).take(max_blocks) {
        block_bytes.clear();
        for t in block {
            block_bytes.extend_from_slice(&t.to_le_bytes());
        }
        let id = xxh64(&block_bytes, 0);
        let mut pair = [0u8; 16];
        pair[..8].copy_from_slice(&id.to_le_bytes());
        pair[8..].copy_from_slice(&prev.to_le_bytes());
        prev = xxh64(&pair, 0);
        out.push(prev);
    }
    out
}

/// The block size used for a request: the first candidate's reported block size when
/// auto-tuning (and it reports one), else the configured one; at least
/// [`MIN_BLOCK_SIZE_TOKENS`] (llm-d's `GetBlockSize`).
pub fn effective_block_size(
    auto_tune: bool,
    configured: usize,
    first_pod_block_size: Option<i64>,
) -> usize {
    let mut b = configured;
    if auto_tune {
        if let Some(reported) = first_pod_block_size.filter(|v| *v > 0) {
            b = usize::try_from(reported).unwrap_or(usize::MAX);
        }
    }
    b.max(MIN_BLOCK_SIZE_TOKENS)
}

/// llm-d's `resolveMaxBlocks` with its defaults: the token cap over the block size, or no cap
/// when the token cap is 0.
pub fn max_blocks(max_prefix_tokens: usize, block_size: usize) -> usize {
    if max_prefix_tokens > 0 && block_size > 0 {
        max_prefix_tokens / block_size
    } else {
        usize::MAX
    }
}

const NIL: usize = usize::MAX;

#[derive(Debug, Clone)]
struct Node {
    key: BlockHash,
    prev: usize,
    next: usize,
}

/// A fixed-capacity LRU set with the semantics of hashicorp/golang-lru's `Cache.Add`: adding a
/// present key makes it the most recent; adding a new key to a full cache evicts the least
/// recent one and returns it.
#[derive(Debug, Clone)]
pub struct Lru {
    cap: usize,
    map: HashMap<BlockHash, usize>,
    nodes: Vec<Node>,
    free: Vec<usize>,
    /// Most recent.
    head: usize,
    /// Least recent.
    tail: usize,
}

impl Lru {
    /// An empty LRU holding at most `cap` keys (at least 1).
    pub fn new(cap: usize) -> Lru {
        let cap = cap.max(1);
        Lru {
            cap,
            map: HashMap::new(),
            nodes: Vec::new(),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn capacity(&self) -> usize {
        self.cap
    }

    pub fn contains(&self, key: BlockHash) -> bool {
        self.map.contains_key(&key)
    }

    fn unlink(&mut self, i: usize) {
        let (prev, next) = (self.nodes[i].prev, self.nodes[i].next);
        if prev == NIL {
            self.head = next;
        } else {
            self.nodes[prev].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.nodes[next].prev = prev;
        }
    }

    fn push_front(&mut self, i: usize) {
        self.nodes[i].prev = NIL;
        self.nodes[i].next = self.head;
        if self.head != NIL {
            self.nodes[self.head].prev = i;
        }
        self.head = i;
        if self.tail == NIL {
            self.tail = i;
        }
    }

    /// Adds `key` as the most recent; returns the key evicted to make room, if any.
    pub fn add(&mut self, key: BlockHash) -> Option<BlockHash> {
        if let Some(&i) = self.map.get(&key) {
            if self.head != i {
                self.unlink(i);
                self.push_front(i);
            }
            return None;
        }
        let node = Node {
            key,
            prev: NIL,
            next: NIL,
        };
        let i = match self.free.pop() {
            Some(i) => {
                self.nodes[i] = node;
                i
            }
            None => {
                self.nodes.push(node);
                self.nodes.len() - 1
            }
        };
        self.push_front(i);
        self.map.insert(key, i);
        if self.map.len() > self.cap {
            let t = self.tail;
            self.unlink(t);
            let old = self.nodes[t].key;
            self.map.remove(&old);
            self.free.push(t);
            return Some(old);
        }
        None
    }

    /// Keys from most to least recent (tests).
    pub fn keys_recent_first(&self) -> Vec<BlockHash> {
        let mut v = Vec::with_capacity(self.len());
        let mut i = self.head;
        while i != NIL {
            v.push(self.nodes[i].key);
            i = self.nodes[i].next;
        }
        v
    }
}

/// The pods that may hold a block (a small sorted set of pod indices).
pub type PodSet = Vec<usize>;

/// The approximate prefix index over the pool's pods (pods are indices into the pool).
#[derive(Debug, Clone, Default)]
pub struct Indexer {
    hash_to_pods: HashMap<BlockHash, PodSet>,
    pod_lru: BTreeMap<usize, Lru>,
}

impl Indexer {
    pub fn new() -> Indexer {
        Indexer::default()
    }

    /// The pods listed for `hash`.
    pub fn get(&self, hash: BlockHash) -> &[usize] {
        self.hash_to_pods
            .get(&hash)
            .map(Vec::as_slice)
            .unwrap_or(&[])
    }

    /// Records that `pod` was sent `hashes`; its LRU is created with `capacity` entries if it
    /// has none yet.
    pub fn add(&mut self, hashes: &[BlockHash], pod: usize, capacity: usize) {
        let lru = self
            .pod_lru
            .entry(pod)
            .or_insert_with(|| Lru::new(capacity));
        for &h in hashes {
            if let Some(evicted) = lru.add(h) {
                if let Some(set) = self.hash_to_pods.get_mut(&evicted) {
                    set.retain(|p| *p != pod);
                    if set.is_empty() {
                        self.hash_to_pods.remove(&evicted);
                    }
                }
            }
        }
        for &h in hashes {
            let set = self.hash_to_pods.entry(h).or_default();
            if let Err(at) = set.binary_search(&pod) {
                set.insert(at, pod);
            }
        }
    }

    /// Matched blocks per pod for one prompt's hashes (pods with no match are absent).
    pub fn match_longest_prefix(&self, hashes: &[BlockHash]) -> BTreeMap<usize, usize> {
        let mut res = BTreeMap::new();
        for &h in hashes {
            let pods = self.get(h);
            if pods.is_empty() {
                break;
            }
            for &p in pods {
                *res.entry(p).or_insert(0) += 1;
            }
        }
        res
    }

    /// Blocks held per pod (the admin page).
    pub fn pod_block_counts(&self) -> BTreeMap<usize, usize> {
        self.pod_lru.iter().map(|(p, l)| (*p, l.len())).collect()
    }

    /// Hashes listed in the hash → pods map.
    pub fn hash_entries(&self) -> usize {
        self.hash_to_pods.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn xxh64_is_the_reference_function() {
        // Reference vectors of xxHash64 with seed 0.
        assert_eq!(xxh64(b"", 0), 0xEF46_DB37_51D8_E999);
        assert_eq!(xxh64(b"a", 0), 0xD24E_C4F1_A98C_6E5B);
    }

    #[test]
    fn the_chain_is_seeded_by_model_and_salt_and_links_blocks() {
        let tokens: Vec<u32> = (0..10).collect();
        let h = block_hashes("m", "", &tokens, 4, usize::MAX);
        assert_eq!(h.len(), 3, "two full blocks and a short last one");
        // By hand: seed, then each block.
        let mut prev = xxh64(b"m", 0);
        for (i, block) in tokens.chunks(4).enumerate() {
            let bytes: Vec<u8> = block.iter().flat_map(|t| t.to_le_bytes()).collect();
            let id = xxh64(&bytes, 0);
            let mut pair = Vec::new();
            pair.extend_from_slice(&id.to_le_bytes());
            pair.extend_from_slice(&prev.to_le_bytes());
            prev = xxh64(&pair, 0);
            assert_eq!(h[i], prev, "block {i}");
        }
        // Model + salt are one stream.
        let salted = block_hashes("m", "x", &tokens, 4, usize::MAX);
        assert_ne!(salted[0], h[0]);
        assert_eq!(salted, block_hashes("mx", "", &tokens, 4, usize::MAX));
        // Other model: other chain.
        assert_ne!(block_hashes("n", "", &tokens, 4, usize::MAX)[0], h[0]);
        // A cap.
        assert_eq!(block_hashes("m", "", &tokens, 4, 2), h[..2].to_vec());
        assert!(block_hashes("m", "", &[], 4, 9).is_empty());
    }

    #[test]
    fn a_shared_prefix_shares_leading_hashes_only() {
        let a: Vec<u32> = (0..256).collect();
        let mut b = a.clone();
        b[200] = 9999;
        let (ha, hb) = (
            block_hashes("m", "", &a, 64, usize::MAX),
            block_hashes("m", "", &b, 64, usize::MAX),
        );
        assert_eq!(ha[..3], hb[..3]);
        assert_ne!(ha[3], hb[3]);
    }

    #[test]
    fn block_size_is_at_least_64_and_follows_the_first_pod_when_tuning() {
        assert_eq!(effective_block_size(true, 16, Some(16)), 64);
        assert_eq!(effective_block_size(true, 16, Some(128)), 128);
        assert_eq!(effective_block_size(true, 256, None), 256);
        assert_eq!(effective_block_size(true, 256, Some(0)), 256);
        assert_eq!(effective_block_size(false, 100, Some(128)), 100);
        assert_eq!(max_blocks(DEFAULT_MAX_PREFIX_TOKENS, 64), 2048);
        assert_eq!(max_blocks(0, 64), usize::MAX);
    }

    #[test]
    fn lru_evicts_the_least_recent_and_add_refreshes() {
        let mut l = Lru::new(3);
        assert_eq!(l.add(1), None);
        assert_eq!(l.add(2), None);
        assert_eq!(l.add(3), None);
        assert_eq!(l.add(1), None, "present: refreshed, nothing evicted");
        assert_eq!(l.add(4), Some(2));
        assert_eq!(l.keys_recent_first(), vec![4, 1, 3]);
        assert_eq!(l.add(5), Some(3));
        assert_eq!(l.add(6), Some(1));
        assert_eq!(l.len(), 3);
        assert!(!l.contains(1) && l.contains(6));
    }

    #[test]
    fn index_matches_leading_blocks_and_stops_at_the_first_gap() {
        let mut ix = Indexer::new();
        ix.add(&[1, 2, 3], 0, 100);
        ix.add(&[1, 2], 1, 100);
        assert_eq!(
            ix.match_longest_prefix(&[1, 2, 3, 4]),
            BTreeMap::from([(0, 3), (1, 2)])
        );
        // Block 1 unknown: nothing matches even though later ones are held.
        assert!(ix.match_longest_prefix(&[9, 2, 3]).is_empty());
        assert_eq!(ix.pod_block_counts(), BTreeMap::from([(0, 3), (1, 2)]));
    }

    #[test]
    fn eviction_unlists_the_pod_and_capacity_is_fixed_at_creation() {
        let mut ix = Indexer::new();
        ix.add(&[1, 2], 0, 2);
        ix.add(&[3], 0, 1000); // capacity stays 2
        assert_eq!(ix.get(1), &[] as &[usize]);
        assert_eq!(ix.get(2), &[0]);
        assert_eq!(ix.get(3), &[0]);
        assert_eq!(ix.pod_block_counts()[&0], 2);
        assert_eq!(ix.hash_entries(), 2);
    }

    #[test]
    fn hashes_evicted_by_their_own_insertion_stay_listed_as_in_llm_d() {
        let mut ix = Indexer::new();
        ix.add(&[1, 2, 3], 0, 2);
        // The LRU holds 2 and 3; hash 1 was evicted before the map was filled.
        assert_eq!(ix.get(1), &[0]);
        assert_eq!(ix.pod_block_counts()[&0], 2);
    }

    proptest! {
        #[test]
        fn lru_never_exceeds_capacity_and_keeps_the_last_keys(
            cap in 1usize..20,
            keys in proptest::collection::vec(0u64..40, 0..200),
        ) {
            let mut l = Lru::new(cap);
            for &k in &keys {
                l.add(k);
                prop_assert!(l.len() <= cap);
            }
            // The most recent distinct keys are held.
            let mut recent = Vec::new();
            for &k in keys.iter().rev() {
                if !recent.contains(&k) {
                    recent.push(k);
                }
                if recent.len() == cap {
                    break;
                }
            }
            prop_assert_eq!(l.keys_recent_first(), recent);
        }

        #[test]
        fn matched_blocks_never_exceed_the_request(
            adds in proptest::collection::vec((proptest::collection::vec(0u64..8, 0..6), 0usize..4), 0..20),
            req in proptest::collection::vec(0u64..8, 0..8),
        ) {
            let mut ix = Indexer::new();
            for (h, p) in &adds {
                ix.add(h, *p, 5);
            }
            for (_, n) in ix.match_longest_prefix(&req) {
                prop_assert!(n <= req.len());
            }
        }
    }
}
