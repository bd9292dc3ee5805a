//! Decides the fake model's token ids: ASCII runs cut greedily into pieces of up to 4 bytes
//! packed little-endian into a `u32` (high bit clear), every other scalar one token
//! `0x8000_0000 | codepoint`, four reserved role tokens, and the chat template built from them.

use alloc::string::String;
use alloc::vec::Vec;

/// Tokens per KV-cache block: vLLM's default `--block-size` on CUDA.
pub const DEFAULT_BLOCK_TOKENS: usize = 16;
/// Role token that opens a `system` message.
pub const ROLE_SYSTEM: u32 = 0xFFFF_FF01;
/// Role token that opens a `user` message.
pub const ROLE_USER: u32 = 0xFFFF_FF02;
/// Role token that opens an `assistant` message, and the generation prompt at the end of a
/// chat prompt.
pub const ROLE_ASSISTANT: u32 = 0xFFFF_FF03;
/// Role token of any other role (`tool`, `developer`, ...).
pub const ROLE_OTHER: u32 = 0xFFFF_FF04;

/// Bytes per ASCII piece.
const PIECE_BYTES: u32 = 4;
/// Marks a token that carries one Unicode scalar value.
const SCALAR_FLAG: u32 = 0x8000_0000;

/// An ASCII piece under construction: packed bytes and how many.
#[derive(Default)]
struct Piece {
    packed: u32,
    len: u32,
}

impl Piece {
    /// Adds one ASCII byte; returns the full piece when it reaches 4 bytes.
    fn push(&mut self, byte: u8) -> Option<u32> {
        self.packed |= u32::from(byte) << (8 * self.len);
        self.len += 1;
        if self.len == PIECE_BYTES {
            self.take()
        } else {
            None
        }
    }

    /// The pending piece, if any, leaving the builder empty.
    fn take(&mut self) -> Option<u32> {
        let out = (self.len > 0).then_some(self.packed);
        *self = Piece::default();
        out
    }
}

/// Whether `c` goes into an ASCII piece. NUL does not: a piece never holds a zero byte, so its
/// length is implied by its value and the mapping stays reversible; NUL is a scalar token.
fn in_piece(c: char) -> bool {
    c.is_ascii() && c != '\0'
}

/// Appends the token ids of `text` to `out`: ASCII runs split greedily into pieces of up to 4
/// bytes, packed little-endian into a u32 (high bit clear); every non-ASCII scalar (and NUL)
/// is one token `0x8000_0000 | codepoint`. Reversible with [`detokenize_into`].
pub fn tokenize_into(text: &str, out: &mut Vec<u32>) {
    let mut piece = Piece::default();
    for c in text.chars() {
        if in_piece(c) {
            if let Some(t) = piece.push(c as u8) {
                out.push(t);
            }
        } else {
            if let Some(t) = piece.take() {
                out.push(t);
            }
            out.push(SCALAR_FLAG | u32::from(c));
        }
    }
    if let Some(t) = piece.take() {
        out.push(t);
    }
}

/// Number of tokens [`tokenize_into`] would produce for `text`, without allocating.
pub fn count_tokens(text: &str) -> usize {
    let (mut n, mut run) = (0usize, 0usize);
    for c in text.chars() {
        if in_piece(c) {
            run += 1;
        } else {
            n += run.div_ceil(PIECE_BYTES as usize) + 1;
            run = 0;
        }
    }
    n + run.div_ceil(PIECE_BYTES as usize)
}

/// Appends the text of `ids` to `out`. Role tokens are skipped, and so are ids that no text
/// tokenises to (an empty piece, a piece with a zero byte inside or a non-ASCII byte, a
/// scalar token that is not a Unicode scalar value).
pub fn detokenize_into(ids: &[u32], out: &mut String) {
    for &id in ids {
        if id & SCALAR_FLAG != 0 {
            if let Some(c) = char::from_u32(id & !SCALAR_FLAG) {
                out.push(c);
            }
            continue;
        }
        let bytes = id.to_le_bytes();
        let len = bytes.iter().take_while(|b| **b != 0).count();
        let (text, rest) = bytes.split_at(len);
        let valid = len > 0 && rest.iter().all(|b| *b == 0) && text.iter().all(u8::is_ascii);
        if valid {
            out.extend(text.iter().map(|b| char::from(*b)));
        }
    }
}

/// The role token of a chat message's `role`: `system`, `user`, `assistant`, anything else
/// [`ROLE_OTHER`].
pub fn role_token(role: &str) -> u32 {
    match role {
        "system" => ROLE_SYSTEM,
        "user" => ROLE_USER,
        "assistant" => ROLE_ASSISTANT,
        _ => ROLE_OTHER,
    }
}

/// Appends the fake chat template of `messages` (`(role, content)` pairs) to `out`: for each
/// message `role_token(role)` then the tokens of its content; then [`ROLE_ASSISTANT`] (the
/// generation prompt). So prompt(turn k) + its generated tokens is a prefix of
/// prompt(turn k+1) when turn k+1 repeats the generated text as its assistant message and the
/// generated tokens are 4-byte ASCII pieces.
pub fn chat_prompt_into<'a>(
    messages: impl IntoIterator<Item = (&'a str, &'a str)>,
    out: &mut Vec<u32>,
) {
    for (role, content) in messages {
        out.push(role_token(role));
        tokenize_into(content, out);
    }
    out.push(ROLE_ASSISTANT);
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::vec;
    use proptest::prelude::*;

    fn tok(text: &str) -> Vec<u32> {
        let mut v = Vec::new();
        tokenize_into(text, &mut v);
        v
    }

    fn detok(ids: &[u32]) -> String {
        let mut s = String::new();
        detokenize_into(ids, &mut s);
        s
    }

    #[test]
    fn ascii_is_cut_into_little_endian_pieces_of_four() {
        assert_eq!(
            tok("abcdefghi"),
            vec![
                u32::from_le_bytes(*b"abcd"),
                u32::from_le_bytes(*b"efgh"),
                u32::from(b'i'),
            ]
        );
        assert!(tok("").is_empty());
        assert!(tok("~~~~\x7f").iter().all(|t| t & SCALAR_FLAG == 0));
    }

    #[test]
    fn non_ascii_scalars_are_one_token_each_and_break_runs() {
        assert_eq!(
            tok("héllo"),
            vec![
                u32::from(b'h'),
                0x8000_00e9,
                u32::from_le_bytes([b'l', b'l', b'o', 0]),
            ]
        );
        assert_eq!(tok("猫🐈"), vec![0x8000_732b, 0x8001_f408]);
        // NUL is a scalar token, so pieces never hold a zero byte.
        assert_eq!(tok("a\0b"), vec![0x61, 0x8000_0000, 0x62]);
        assert_eq!(detok(&tok("a\0b")), "a\0b");
    }

    #[test]
    fn count_matches_the_ascii_estimate_of_chars_over_four() {
        for (text, n) in [
            ("", 0),
            ("abcd", 1),
            ("abcde", 2),
            ("ééééé", 5),
            ("ab é cd", 3),
        ] {
            assert_eq!(count_tokens(text), n, "{text:?}");
        }
    }

    #[test]
    fn detokenize_skips_roles_and_invalid_ids() {
        let mut ids = vec![ROLE_USER];
        ids.extend(tok("hi there"));
        ids.extend([
            ROLE_ASSISTANT,
            0,                              // empty piece
            u32::from_le_bytes(*b"a\0b\0"), // zero inside a piece
            0x0000_8061,                    // non-ASCII byte in a piece
            0x8000_d800,                    // surrogate
            ROLE_OTHER,
        ]);
        assert_eq!(detok(&ids), "hi there");
    }

    #[test]
    fn roles_and_chat_template() {
        assert_eq!(role_token("system"), ROLE_SYSTEM);
        assert_eq!(role_token("user"), ROLE_USER);
        assert_eq!(role_token("assistant"), ROLE_ASSISTANT);
        assert_eq!(role_token("tool"), ROLE_OTHER);
        assert_eq!(role_token("User"), ROLE_OTHER);
        let mut p = Vec::new();
        chat_prompt_into([("system", "be brief"), ("user", "hi")], &mut p);
        let mut want = vec![ROLE_SYSTEM];
        want.extend(tok("be brief"));
        want.push(ROLE_USER);
        want.extend(tok("hi"));
        want.push(ROLE_ASSISTANT);
        assert_eq!(p, want);
    }

    /// 4-byte printable ASCII pieces, the shape of the fake pod's generated tokens.
    fn pieces() -> impl Strategy<Value = Vec<[u8; 4]>> {
        proptest::collection::vec(proptest::array::uniform4(0x20u8..0x7f), 0..40)
    }

    proptest! {
        #[test]
        fn round_trip_and_count(text in "\\PC*|[ -~\\x00]*") {
            let ids = tok(&text);
            prop_assert_eq!(detok(&ids), text.clone());
            prop_assert_eq!(count_tokens(&text), ids.len());
        }

        #[test]
        fn ascii_count_is_ceil_chars_over_four(text in "[ -~]{0,200}") {
            prop_assert_eq!(count_tokens(&text), text.len().div_ceil(4));
        }

        /// prompt(turn k) + generated tokens == prefix of prompt(turn k+1).
        #[test]
        fn multi_turn_prompt_extends_the_previous_one(
            system in "\\PC{0,40}",
            user1 in "\\PC{0,40}",
            user2 in "\\PC{0,40}",
            answer in pieces(),
        ) {
            let mut turn1 = Vec::new();
            chat_prompt_into([("system", system.as_str()), ("user", user1.as_str())], &mut turn1);
            let generated: Vec<u32> = answer.iter().map(|p| u32::from_le_bytes(*p)).collect();
            let mut text = String::new();
            detokenize_into(&generated, &mut text);
            let mut turn2 = Vec::new();
            chat_prompt_into(
                [
                    ("system", system.as_str()),
                    ("user", user1.as_str()),
                    ("assistant", text.as_str()),
                    ("user", user2.as_str()),
                ],
                &mut turn2,
            );
            turn1.extend(&generated);
            prop_assert!(turn2.starts_with(&turn1));
        }
    }
}
