//! Decides the prefix-cache key space that the fake pod, the agent and the filter share: how
//! text becomes the fake model's token ids ([`tokenize_into`], [`chat_prompt_into`]) and how a
//! run of token ids becomes a chain of block keys ([`block_keys_into`]), the way vLLM's
//! automatic prefix caching hashes full KV blocks, each block's hash chained on its parent's
//! (vllm-project/vllm `vllm/v1/core/kv_cache_utils.py`, `hash_block_tokens`).
//!
//! # Why this tokenizer
//! The fake pod has no real model, so it needs a tokenizer that every party can run cheaply
//! (the filter runs it inside Envoy, compiled to wasm32-wasip1) and that gives the same ids
//! everywhere. ASCII text is cut greedily into pieces of up to 4 bytes, one token each, so the
//! pod's former prompt estimate `ceil(chars / 4)` still holds for ASCII text: a chat prompt
//! adds one role token per message and one generation-prompt token, so a single-message chat
//! counts at most `ceil(chars / 4) + 2` tokens (each extra message adds its role token and at
//! most one more piece, since messages are cut separately). Non-ASCII scalars are one token
//! each (real BPE tokenizers also spend about a token per CJK character). The mapping is
//! reversible ([`detokenize_into`]), so a generated answer made of 4-byte ASCII pieces
//! re-tokenises to the very ids that were generated, and a multi-turn conversation's next
//! prompt starts with the previous prompt plus the previous answer: the property prefix
//! caching relies on.
//!
//! # Keys
//! [`model_seed`] starts a chain (two models never share keys), [`chain_key`] extends it by one
//! full block, [`short_key`] folds a key to the 32 bits agents push. Everything here is
//! integer arithmetic with wrapping operations, identical on every target; nothing allocates
//! except into the caller's `Vec`/`String`, nothing panics.
#![no_std]
#![forbid(unsafe_code)]
#![cfg_attr(
    not(test),
    deny(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::indexing_slicing
    )
)]

extern crate alloc;

#[cfg(test)]
extern crate std;

mod keys;
mod tokenizer;

pub use keys::{block_keys_into, chain_key, model_seed, short_key};
pub use tokenizer::{
    chat_prompt_into, count_tokens, detokenize_into, role_token, tokenize_into,
    DEFAULT_BLOCK_TOKENS, ROLE_ASSISTANT, ROLE_OTHER, ROLE_SYSTEM, ROLE_USER,
};
