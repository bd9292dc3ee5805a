//! Decides which prefix a request carries and how much of it a pod holds: the request's prompt
//! as the fake model's token ids (the `ai-lb-prefix` tokenizer and chat template, exactly as
//! the model server applies them), cut into key blocks of the pods' reported size and chained
//! from the model's seed; a pod's cached key blocks as its agent reports them
//! ([`PrefixSet`]); and the leading run of the prompt's keys a pod holds.
//!
//! Bounded cost: at most `maxPromptTokens` tokens are tokenised (each message's text is cut
//! before tokenising, never tokenised whole), and one 64-bit mix per token pair is hashed.

use ai_lb_prefix::{block_keys_into, model_seed, role_token, short_key, tokenize_into};
use serde::Deserialize;
use serde_json::Value;

/// Most key blocks a pod's reported set may hold; more are dropped (and said).
pub const MAX_POD_KEYS: usize = 65_536;

/// Largest key-block size a report may use (tokens).
pub const MAX_BLOCK_TOKENS: u32 = 65_536;

/// A pod's cached prefix, as its agent reports it: the `short_key` of every key block it holds
/// (a block counts only when every block before it on its chain is held too).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PrefixSet {
    /// Tokens per key block.
    pub block_tokens: u32,
    /// Seed of the model whose chains the keys follow ([`model_seed`] of its name).
    pub model_seed: u64,
    /// Sorted ascending, no duplicates.
    pub keys: Vec<u32>,
    /// The pod held more than its agent reports.
    pub truncated: bool,
}

impl PrefixSet {
    /// Whether the set holds `key`.
    pub fn contains(&self, key: u32) -> bool {
        self.keys.binary_search(&key).is_ok()
    }

    /// How many of `keys` (a prompt's key blocks, in order, keyed with this set's block size
    /// and model) the pod holds from the first on, stopping at the first it lacks.
    pub fn leading_match(&self, keys: &[u32]) -> usize {
        keys.iter().take_while(|k| self.contains(**k)).count()
    }

    /// How many of the prompt's leading key blocks the pod holds; 0 when the prompt was keyed
    /// in another block size or for another model.
    pub fn held(&self, prompt: &PromptKeys) -> usize {
        if prompt.block_tokens != self.block_tokens || prompt.seed != self.model_seed {
            return 0;
        }
        self.leading_match(&prompt.keys)
    }
}

/// A request's prompt keyed for matching: the short keys of its first full key blocks.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PromptKeys {
    /// Tokens per key block (the pool's reported block size).
    pub block_tokens: u32,
    /// Seed of the chains ([`model_seed`] of the model the pool's pods report).
    pub seed: u64,
    /// [`short_key`] of each full key block, in prompt order.
    pub keys: Vec<u32>,
    /// Prompt tokens keyed (at most `maxPromptTokens`; the partial last block included).
    pub tokens: u32,
}

impl PromptKeys {
    /// Number of key blocks.
    pub fn blocks(&self) -> usize {
        self.keys.len()
    }
}

#[derive(Deserialize)]
struct PromptFields {
    #[serde(default)]
    model: Option<Value>,
    #[serde(default)]
    messages: Option<Vec<Message>>,
    #[serde(default)]
    prompt: Option<Value>,
}

#[derive(Deserialize)]
struct Message {
    #[serde(default)]
    role: Option<String>,
    #[serde(default)]
    content: Option<Value>,
}

/// Appends `text`'s tokens to `ids` without tokenising more of it than `cap` tokens need:
/// a token covers at most 4 bytes, so the first `4 × room + 4` bytes hold every token up to
/// the cap, and the piece cut at the end lies past it (removed by the caller's truncation).
fn tokenize_capped(text: &str, cap: usize, ids: &mut Vec<u32>) {
    let room = cap.saturating_sub(ids.len());
    if room == 0 {
        return;
    }
    let mut end = text.len().min(room.saturating_mul(4).saturating_add(4));
    while end < text.len() && !text.is_char_boundary(end) {
        end += 1;
    }
    tokenize_into(text.get(..end).unwrap_or(text), ids);
}

/// The text of a message's `content`: a string, or the concatenated `text` of its parts (as
/// the model server reads it); anything else is empty.
fn content_text(content: Option<&Value>, mut f: impl FnMut(&str)) {
    match content {
        Some(Value::String(s)) => f(s),
        Some(Value::Array(parts)) => {
            for p in parts {
                if let Some(t) = p.get("text").and_then(Value::as_str) {
                    f(t);
                }
            }
        }
        _ => {}
    }
}

/// The prompt's token ids, at most `cap`: a chat body's messages through the chat template
/// (role token, content tokens, per message; the generation prompt after the last), else a
/// completion body's `prompt` string. Returns the body's `model` (if a non-empty string) and
/// whether a prompt was found.
pub fn prompt_ids(body: &[u8], cap: usize, ids: &mut Vec<u32>) -> (Option<String>, bool) {
    ids.clear();
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return (None, false);
    }
    let Ok(f) = serde_json::from_slice::<PromptFields>(body) else {
        return (None, false);
    };
    let model = f
        .model
        .as_ref()
        .and_then(Value::as_str)
        .map(|m| m.trim().to_string())
        .filter(|m| !m.is_empty());
    if let Some(messages) = f.messages.as_ref().filter(|m| !m.is_empty()) {
        for m in messages {
            if ids.len() >= cap {
                break;
            }
            ids.push(role_token(m.role.as_deref().unwrap_or("")));
            // Parts are one text for the tokenizer: their pieces run on across part
            // boundaries, so join them first (bounded by the cap).
            let mut text = String::new();
            let limit = cap
                .saturating_sub(ids.len())
                .saturating_mul(4)
                .saturating_add(4);
            content_text(m.content.as_ref(), |t| {
                if text.len() < limit {
                    text.push_str(t);
                }
            });
            tokenize_capped(&text, cap, ids);
        }
        ids.push(ai_lb_prefix::ROLE_ASSISTANT);
        ids.truncate(cap);
        return (model, true);
    }
    if let Some(Value::String(p)) = f.prompt.as_ref() {
        tokenize_capped(p, cap, ids);
        ids.truncate(cap);
        return (model, true);
    }
    (model, false)
}

/// Keys `ids` for pods that report key blocks of `block_tokens` for the model seeded `seed`.
pub fn keys_of(
    ids: &[u32],
    seed: u64,
    block_tokens: u32,
    scratch: &mut Vec<u64>,
    out: &mut PromptKeys,
) {
    scratch.clear();
    out.keys.clear();
    out.block_tokens = block_tokens;
    out.seed = seed;
    out.tokens = u32::try_from(ids.len()).unwrap_or(u32::MAX);
    if block_tokens == 0 {
        return;
    }
    block_keys_into(seed, ids, block_tokens as usize, usize::MAX, scratch);
    out.keys.extend(scratch.iter().map(|k| short_key(*k)));
}

/// The seed of a model's key chains.
pub fn seed_of(model: &str) -> u64 {
    model_seed(model)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ai_lb_prefix::chat_prompt_into;

    #[test]
    fn chat_bodies_key_as_the_model_server_tokenises_them() {
        let body = br#"{"model":" m ","messages":[{"role":"system","content":"abcd"},
            {"role":"user","content":[{"type":"text","text":"ef"},{"type":"text","text":"gh"}]}]}"#;
        let mut ids = Vec::new();
        let (model, found) = prompt_ids(body, 1000, &mut ids);
        assert!(found);
        assert_eq!(model.as_deref(), Some("m"));
        let mut want = Vec::new();
        chat_prompt_into([("system", "abcd"), ("user", "efgh")], &mut want);
        assert_eq!(ids, want);
    }

    #[test]
    fn completion_prompts_have_no_template() {
        let mut ids = Vec::new();
        let (_, found) = prompt_ids(br#"{"prompt":"abcdefgh"}"#, 1000, &mut ids);
        assert!(found);
        let mut want = Vec::new();
        tokenize_into("abcdefgh", &mut want);
        assert_eq!(ids, want);
    }

    #[test]
    fn not_a_prompt_is_no_prompt() {
        let mut ids = vec![1, 2];
        for b in [
            &b"[1]"[..],
            b"nope",
            br#"{"messages":[]}"#,
            br#"{"prompt":3}"#,
            b"",
        ] {
            let (_, found) = prompt_ids(b, 100, &mut ids);
            assert!(!found, "{}", String::from_utf8_lossy(b));
            assert!(ids.is_empty());
        }
    }

    #[test]
    fn the_cap_keeps_the_leading_tokens_exactly() {
        // A long message, with non-ASCII text in it: the capped ids are the uncapped ones' head.
        let text: String = (0..500)
            .map(|i| if i % 7 == 0 { "é€x" } else { "word " })
            .collect();
        let body = serde_json::json!({"messages":[{"role":"system","content":"be brief"},
            {"role":"user","content":text}]})
        .to_string();
        let mut full = Vec::new();
        prompt_ids(body.as_bytes(), usize::MAX, &mut full);
        for cap in [
            1,
            2,
            3,
            5,
            17,
            64,
            333,
            full.len() - 1,
            full.len(),
            full.len() + 9,
        ] {
            let mut ids = Vec::new();
            prompt_ids(body.as_bytes(), cap, &mut ids);
            assert_eq!(ids, full[..cap.min(full.len())], "cap {cap}");
        }
    }

    #[test]
    fn keys_are_the_agents_keys_and_match_leading_runs() {
        let ids: Vec<u32> = (0..300).collect();
        let seed = seed_of("m");
        let (mut scratch, mut pk) = (Vec::new(), PromptKeys::default());
        keys_of(&ids, seed, 64, &mut scratch, &mut pk);
        assert_eq!(pk.blocks(), 4);
        let mut want = Vec::new();
        block_keys_into(seed, &ids, 64, usize::MAX, &mut want);
        let want: Vec<u32> = want.into_iter().map(short_key).collect();
        assert_eq!(pk.keys, want);
        let mut held = want[..2].to_vec();
        held.push(want[3]);
        held.sort_unstable();
        let set = PrefixSet {
            block_tokens: 64,
            model_seed: seed,
            keys: held,
            truncated: false,
        };
        // Blocks 0 and 1 held, 2 missing: the run stops there even though 3 is held.
        assert_eq!(set.leading_match(&pk.keys), 2);
        assert_eq!(set.leading_match(&[]), 0);
        keys_of(&ids, seed, 0, &mut scratch, &mut pk);
        assert!(pk.keys.is_empty());
    }
}
