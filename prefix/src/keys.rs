//! Decides the key of every full KV block: a chain seeded per model, each block's key a 64-bit
//! mix of its parent's key and its token ids, as vLLM chains block hashes on the parent's
//! (vllm-project/vllm `vllm/v1/core/kv_cache_utils.py`, `hash_block_tokens`; vLLM hashes with
//! sha256 or Python's hash over pickled tuples, we use a cheap integer mix the filter can run per
//! request in wasm).

use alloc::vec::Vec;

/// FNV-1a 64 offset basis and prime.
const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;
/// 2^64 / golden ratio, odd: spreads the block length and each word before the finaliser.
const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// Seed of a model's key chain: FNV-1a 64 of the model name's UTF-8 bytes, so two models never
/// share keys.
pub fn model_seed(model: &str) -> u64 {
    model.bytes().fold(FNV_OFFSET, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(FNV_PRIME)
    })
}

/// MurmurHash3's 64-bit finaliser (`fmix64`): every input bit affects every output bit.
fn fmix64(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// Key of one full block given its parent's key (the model seed for the first block).
///
/// The function, exactly (all arithmetic wrapping, modulo 2^64):
/// 1. `h = fmix64(parent ^ (len × GOLDEN))`, `len` = number of token ids in `block`;
/// 2. token ids are taken two at a time as one word `w = t0 | t1 << 32` (a lone last id has
///    `t1 = 0`; the length in step 1 keeps `[x]` and `[x, 0]` apart); for each word
///    `h = fmix64(h ^ (w × GOLDEN)).rotate_left(23)`;
/// 3. the key is `fmix64(h ^ len)`.
///
/// `fmix64` is MurmurHash3's 64-bit finaliser, `GOLDEN` = 0x9e3779b97f4a7c15. Integer-only,
/// so identical on every target (x86-64, aarch64, wasm32).
pub fn chain_key(parent: u64, block: &[u32]) -> u64 {
    let len = block.len() as u64;
    let mut h = fmix64(parent ^ len.wrapping_mul(GOLDEN));
    for pair in block.chunks(2) {
        let lo = pair.first().copied().unwrap_or(0);
        let hi = pair.get(1).copied().unwrap_or(0);
        let w = u64::from(lo) | (u64::from(hi) << 32);
        h = fmix64(h ^ w.wrapping_mul(GOLDEN)).rotate_left(23);
    }
    fmix64(h ^ len)
}

/// Appends to `out` the keys of the first `max_blocks` FULL blocks of `tokens` (blocks of
/// `block_tokens` ids; a partial last block has no key), chained from `seed`. Appends nothing
/// when `block_tokens` is 0.
pub fn block_keys_into(
    seed: u64,
    tokens: &[u32],
    block_tokens: usize,
    max_blocks: usize,
    out: &mut Vec<u64>,
) {
    if block_tokens == 0 {
        return;
    }
    let mut parent = seed;
    for block in tokens.chunks_exact(block_tokens).take(max_blocks) {
        parent = chain_key(parent, block);
        out.push(parent);
    }
}

/// The 32-bit form of a key that agents push: upper half xor lower half.
pub fn short_key(key: u64) -> u32 {
    ((key >> 32) ^ key) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::vec;
    use proptest::prelude::*;

    fn keys(seed: u64, tokens: &[u32], bs: usize, max: usize) -> Vec<u64> {
        let mut v = Vec::new();
        block_keys_into(seed, tokens, bs, max, &mut v);
        v
    }

    /// Pins the function: a change in the mix changes these values, and the filter (wasm),
    /// the agent and the pod would disagree.
    #[test]
    fn known_values_are_stable() {
        assert_eq!(model_seed(""), FNV_OFFSET);
        assert_eq!(model_seed("a"), 0xaf63_dc4c_8601_ec8c);
        // Expected values computed independently from the doc of `chain_key` (a Python
        // transcription of steps 1-3), not from this code.
        let seed = model_seed("meta-llama/Llama-3.1-8B-Instruct");
        assert_eq!(seed, 0x2f38_3a79_6e9d_c9c5);
        let block: Vec<u32> = (0..16).collect();
        let k1 = chain_key(seed, &block);
        assert_eq!(k1, 0x9137_da9a_0859_09b1);
        assert_eq!(chain_key(k1, &[0xFFFF_FF03, 1, 2]), 0x06fa_ebd7_74a6_adcd);
        assert_eq!(chain_key(0, &[]), fmix64(fmix64(0)));
        assert_eq!(short_key(0x1234_5678_9abc_def0), 0x1234_5678 ^ 0x9abc_def0);
    }

    #[test]
    fn keys_depend_on_parent_content_order_and_length() {
        let s = model_seed("m");
        let k = chain_key(s, &[1, 2, 3]);
        assert_ne!(k, chain_key(s ^ 1, &[1, 2, 3]));
        assert_ne!(k, chain_key(s, &[1, 2, 4]));
        assert_ne!(k, chain_key(s, &[2, 1, 3]));
        assert_ne!(chain_key(s, &[7]), chain_key(s, &[7, 0]));
        assert_ne!(model_seed("m"), model_seed("n"));
    }

    #[test]
    fn only_full_blocks_have_keys() {
        let s = model_seed("m");
        let t: Vec<u32> = (0..40).collect();
        let k = keys(s, &t, 16, usize::MAX);
        assert_eq!(k.len(), 2);
        assert_eq!(k[0], chain_key(s, &t[..16]));
        assert_eq!(k[1], chain_key(k[0], &t[16..32]));
        assert_eq!(keys(s, &t, 16, 1), vec![k[0]]);
        assert!(keys(s, &t, 0, 9).is_empty());
        assert!(keys(s, &t[..15], 16, 9).is_empty());
        // appends, does not clear
        let mut v = vec![7];
        block_keys_into(s, &t, 16, 9, &mut v);
        assert_eq!(v, vec![7, k[0], k[1]]);
    }

    proptest! {
        /// The keys of a prefix are a prefix of the keys.
        #[test]
        fn keys_of_a_prefix_are_a_prefix_of_the_keys(
            tokens in proptest::collection::vec(any::<u32>(), 0..200),
            cut in 0usize..200,
            bs in 1usize..20,
            seed in any::<u64>(),
        ) {
            let cut = cut.min(tokens.len());
            let all = keys(seed, &tokens, bs, usize::MAX);
            let pre = keys(seed, &tokens[..cut], bs, usize::MAX);
            prop_assert_eq!(pre.len(), cut / bs);
            prop_assert!(all.starts_with(&pre));
        }

        /// Two token runs share exactly the keys of their common full blocks.
        #[test]
        fn diverging_runs_share_only_common_blocks(
            common in proptest::collection::vec(any::<u32>(), 0..64),
            a in any::<u32>(),
            tail in proptest::collection::vec(any::<u32>(), 16..32),
        ) {
            let s = model_seed("m");
            let mut x = common.clone();
            x.push(a);
            x.extend(&tail);
            let mut y = common.clone();
            y.push(a.wrapping_add(1));
            y.extend(&tail);
            let (kx, ky) = (keys(s, &x, 16, usize::MAX), keys(s, &y, 16, usize::MAX));
            let shared = common.len() / 16;
            prop_assert_eq!(&kx[..shared], &ky[..shared]);
            prop_assert!(kx[shared..].iter().zip(&ky[shared..]).all(|(p, q)| p != q));
        }
    }
}
