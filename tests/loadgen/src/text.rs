//! Decides the text of the shared-prefix and multi-turn prompts: ASCII slices of one cached,
//! deterministic word pool, each exactly `4 × tokens` bytes long so that the `ai-lb-prefix`
//! tokenizer (greedy 4-byte ASCII pieces, one token each) cuts it into exactly `tokens` tokens,
//! and the prompt token count under that crate's chat template.
//!
//! A text is a short header that makes it unique (group, user, request id; or session and
//! turn) followed by pool bytes from an offset drawn from its seed, so building one costs a
//! copy, not a generator run, and the same (header, seed, tokens) always gives the same text.
//! Every byte is printable ASCII other than `"` and `\`, so the text goes into JSON unescaped.

use std::sync::OnceLock;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Bytes per token of the `ai-lb-prefix` tokenizer on ASCII text.
pub const BYTES_PER_TOKEN: usize = 4;
/// Smallest question: 8 tokens (32 bytes) hold every header within [`MAX_GROUPS`],
/// [`MAX_USERS`], [`MAX_IDS`] and [`MAX_TURNS`], so a question never loses the part that makes
/// it unique.
pub const MIN_QUESTION_TOKENS: u32 = 8;
/// Bounds that keep headers within [`MIN_QUESTION_TOKENS`] (validated by `workload`).
pub const MAX_GROUPS: u32 = 1_000_000;
pub const MAX_USERS: u32 = 1_000_000;
pub const MAX_IDS: u64 = 1_000_000_000;
pub const MAX_TURNS: u32 = 1000;
/// Size of the pool texts are sliced from (a multiple of 4).
const POOL_BYTES: usize = 1 << 16;
/// Seed of the pool's word order (a constant: the pool is part of the trace format).
const POOL_SEED: u64 = 0x6169_2d6c_622d_7478;

const WORDS: &[&str] = &[
    "the",
    "a",
    "model",
    "answers",
    "questions",
    "about",
    "routing",
    "and",
    "cache",
    "blocks",
    "while",
    "pods",
    "serve",
    "tokens",
    "from",
    "queues",
    "so",
    "latency",
    "stays",
    "low",
    "when",
    "prefill",
    "runs",
    "on",
    "gpus",
    "with",
    "kv",
    "memory",
    "policy",
    "picks",
    "one",
    "of",
    "eight",
    "replicas",
    "given",
    "load",
    "prefix",
    "hit",
    "rate",
    "system",
    "prompt",
    "user",
    "session",
    "turn",
    "history",
    "reused",
    "by",
    "scheduler",
    "batch",
    "decode",
    "step",
    "time",
    "budget",
    "chunk",
    "evicted",
    "least",
    "recently",
    "used",
    "block",
    "hash",
    "chain",
    "parent",
];

/// The word pool: words in a seeded order, single spaces, exactly [`POOL_BYTES`] bytes.
fn pool() -> &'static str {
    static POOL: OnceLock<String> = OnceLock::new();
    POOL.get_or_init(|| {
        let mut rng = ChaCha8Rng::seed_from_u64(POOL_SEED);
        let mut s = String::with_capacity(POOL_BYTES + 16);
        while s.len() < POOL_BYTES {
            let w = WORDS
                .get(rng.random_range(0..WORDS.len()))
                .copied()
                .unwrap_or("the");
            s.push_str(w);
            s.push(if rng.random_range(0..12) == 0 {
                '.'
            } else {
                ' '
            });
        }
        s.truncate(POOL_BYTES);
        s
    })
}

/// Appends to `out` exactly `4 × tokens` bytes: `header` (cut if longer) then pool text from
/// an offset chosen by `seed` (wrapping around the pool). `header` must be ASCII without `"`,
/// `\` or NUL (callers pass the ones built here); the result then tokenises to exactly `tokens`
/// tokens.
pub fn write_text(out: &mut String, header: &str, seed: u64, tokens: u32) {
    let want = tokens as usize * BYTES_PER_TOKEN;
    out.reserve(want);
    let head = header.get(..header.len().min(want)).unwrap_or("");
    out.push_str(head);
    let mut left = want - head.len();
    let pool = pool();
    let slots = (POOL_BYTES / BYTES_PER_TOKEN) as u64;
    let mut off = (seed % slots) as usize * BYTES_PER_TOKEN;
    while left > 0 {
        let n = left.min(POOL_BYTES - off);
        out.push_str(pool.get(off..off + n).unwrap_or(""));
        left -= n;
        off = 0;
    }
}

/// The text as a new string (see [`write_text`]).
pub fn text(header: &str, seed: u64, tokens: u32) -> String {
    let mut s = String::new();
    write_text(&mut s, header, seed, tokens);
    s
}

/// Header of a shared-prefix group's system prompt: the group first, so two groups never share
/// a KV block.
pub fn system_header(group: u32) -> String {
    format!("[group {group} system prompt] ")
}

/// Header of a shared-prefix question: unique per request (its id is unique in the trace).
pub fn question_header(group: u32, user: u32, id: u64) -> String {
    format!("g{group} u{user} r{id}: ")
}

/// Header of a multi-turn question: unique per (session, turn).
pub fn turn_header(session: u64, turn: u32) -> String {
    format!("s{session} t{turn}: ")
}

/// Prompt tokens of `messages` (`(role, content)`) under the `ai-lb-prefix` chat template, as
/// the fake pod counts them.
pub fn chat_prompt_tokens(messages: &[(&str, &str)]) -> u32 {
    let bytes: usize = messages.iter().map(|(_, c)| c.len()).sum();
    let mut ids = Vec::with_capacity(bytes / BYTES_PER_TOKEN + messages.len() * 2 + 2);
    ai_lb_prefix::chat_prompt_into(messages.iter().copied(), &mut ids);
    u32::try_from(ids.len()).unwrap_or(u32::MAX)
}

/// Tokens of a text under the `ai-lb-prefix` tokenizer.
pub fn tokens(text: &str) -> u32 {
    u32::try_from(ai_lb_prefix::count_tokens(text)).unwrap_or(u32::MAX)
}

/// Mixes two words into a seed (SplitMix64's finaliser over `a ^ b·φ`), for per-group seeds.
pub fn mix(a: u64, b: u64) -> u64 {
    let mut z = a ^ b.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Whether `s` can go into a JSON string as is (no quote, backslash or control character).
pub fn json_safe(s: &str) -> bool {
    s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\')
}

/// Appends `s` to `out` as a JSON string literal (quoted, escaped only when needed).
pub fn push_json_str(out: &mut String, s: &str) {
    if json_safe(s) {
        out.push('"');
        out.push_str(s);
        out.push('"');
    } else {
        out.push_str(&serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_is_json_safe_ascii_of_the_right_size() {
        let p = pool();
        assert_eq!(p.len(), POOL_BYTES);
        assert!(p.is_ascii() && json_safe(p) && !p.contains('\0'));
    }

    #[test]
    fn texts_have_exactly_the_requested_tokens_even_when_wrapping() {
        for (tokens, seed) in [(1, 0), (8, 7), (900, 3), (20_000, u64::MAX)] {
            let t = text(&question_header(3, 4, 5), seed, tokens);
            assert_eq!(t.len(), tokens as usize * 4);
            assert_eq!(self::tokens(&t), tokens, "{tokens} tokens, seed {seed}");
        }
        // A header longer than the text is cut.
        assert_eq!(text("a long header here", 1, 1), "a lo");
    }

    #[test]
    fn same_inputs_same_text_and_headers_make_questions_unique() {
        assert_eq!(text("h", 9, 50), text("h", 9, 50));
        assert_ne!(text("h", 9, 50), text("h", 10, 50));
        let a = text(&question_header(1, 2, 3), 9, 50);
        let b = text(&question_header(1, 2, 4), 9, 50);
        assert_ne!(a, b, "same seed, different request");
        let room = MIN_QUESTION_TOKENS as usize * 4;
        let longest = question_header(MAX_GROUPS - 1, MAX_USERS - 1, MAX_IDS - 1);
        assert!(longest.len() <= room, "{longest}");
        assert!(turn_header(MAX_IDS - 1, MAX_TURNS).len() <= room);
    }

    #[test]
    fn chat_count_is_the_crate_template() {
        let sys = text(&system_header(0), 1, 900);
        let q = text(&question_header(0, 0, 0), 2, 180);
        // role + system + role + question + generation prompt.
        assert_eq!(
            chat_prompt_tokens(&[("system", &sys), ("user", &q)]),
            900 + 180 + 3
        );
        // role + "hi " (one piece) + "é" (one scalar token) + generation prompt.
        assert_eq!(chat_prompt_tokens(&[("user", "hi é")]), 1 + 1 + 1 + 1);
    }

    #[test]
    fn json_strings_are_escaped_only_when_needed() {
        let mut s = String::new();
        push_json_str(&mut s, "plain text");
        push_json_str(&mut s, "a \"q\" \\ \n");
        assert_eq!(s, "\"plain text\"\"a \\\"q\\\" \\\\ \\n\"");
    }

    #[test]
    fn mix_spreads_neighbouring_inputs() {
        assert_ne!(mix(1, 0), mix(1, 1));
        assert_ne!(mix(1, 1), mix(2, 1));
        assert_eq!(mix(5, 6), mix(5, 6));
    }
}
