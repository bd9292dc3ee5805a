//! Reconciliation input: decides the actual `usage` of a response (prompt, completion, image and
//! audio tokens) from a non-streaming JSON body, or incrementally from an SSE stream whose final
//! data chunk carries `usage` (`stream_options.include_usage`), keeping O(1) state across chunks.
#![deny(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use serde::Deserialize;
use serde_json::Value;

use super::config::CostWeights;

/// Token usage reported by the model server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// All prompt tokens, including image and audio tokens (OpenAI and vLLM count them there).
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// `prompt_tokens_details.image_tokens` where the server reports it.
    pub prompt_image_tokens: u64,
    /// `prompt_tokens_details.audio_tokens`.
    pub prompt_audio_tokens: u64,
    /// `completion_tokens_details.audio_tokens`.
    pub completion_audio_tokens: u64,
}

impl Usage {
    /// The weighted tokens this usage costs, with the same weights as the admission estimate:
    /// text = prompt and completion tokens that are neither image nor audio.
    pub fn weighted(&self, w: &CostWeights) -> u64 {
        let text = self
            .prompt_tokens
            .saturating_sub(self.prompt_image_tokens)
            .saturating_sub(self.prompt_audio_tokens)
            .saturating_add(
                self.completion_tokens
                    .saturating_sub(self.completion_audio_tokens),
            );
        w.weigh(
            text,
            self.prompt_image_tokens,
            self.prompt_audio_tokens
                .saturating_add(self.completion_audio_tokens),
        )
    }
}

#[derive(Deserialize)]
struct RawDetails {
    #[serde(default)]
    image_tokens: Option<u64>,
    #[serde(default)]
    audio_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct RawUsage {
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: Option<u64>,
    #[serde(default)]
    prompt_tokens_details: Option<RawDetails>,
    #[serde(default)]
    completion_tokens_details: Option<RawDetails>,
}

impl From<RawUsage> for Usage {
    fn from(r: RawUsage) -> Self {
        let pd = r.prompt_tokens_details.as_ref();
        let cd = r.completion_tokens_details.as_ref();
        Usage {
            prompt_tokens: r.prompt_tokens,
            completion_tokens: r.completion_tokens.unwrap_or(0),
            prompt_image_tokens: pd.and_then(|d| d.image_tokens).unwrap_or(0),
            prompt_audio_tokens: pd.and_then(|d| d.audio_tokens).unwrap_or(0),
            completion_audio_tokens: cd.and_then(|d| d.audio_tokens).unwrap_or(0),
        }
    }
}

fn usage_from_value(v: &Value) -> Option<Usage> {
    RawUsage::deserialize(v).ok().map(Usage::from)
}

/// `usage` of a complete non-streaming response body; `None` if absent or unreadable.
pub fn usage_from_json(body: &[u8]) -> Option<Usage> {
    let v: Value = serde_json::from_slice(body).ok()?;
    usage_from_value(v.get("usage")?)
}

const KEY: &[u8] = b"\"usage\"";
/// A `usage` object larger than this is not a usage object we understand; it is skipped.
pub const MAX_USAGE_BYTES: usize = 4096;

#[derive(Debug, Clone)]
enum State {
    /// `matched` bytes of `"usage"` seen so far.
    Searching { matched: usize },
    /// After the key: expecting `:` then the value.
    AfterKey { colon: bool },
    /// Inside the usage object.
    Capturing { depth: u32, in_str: bool, esc: bool },
}

/// Finds the last `"usage": {...}` object in a byte stream fed in arbitrary chunks (SSE or a
/// plain JSON body). Memory: the usage object being captured (at most [`MAX_USAGE_BYTES`]) and a
/// few counters; the key match carries across chunk boundaries without keeping a tail.
/// `"usage": null` (every chunk before the last, under `include_usage`) is skipped. A quoted
/// `"usage"` inside a JSON string cannot match: its quotes are escaped there.
#[derive(Debug, Clone)]
pub struct UsageScanner {
    state: State,
    buf: Vec<u8>,
    latest: Option<Usage>,
    /// Usage objects found (a stream with continuous usage stats reports one per chunk).
    pub found: u32,
    /// Objects after a `"usage"` key that were too large or did not parse.
    pub unreadable: u32,
}

impl Default for UsageScanner {
    fn default() -> Self {
        Self::new()
    }
}

impl UsageScanner {
    pub fn new() -> Self {
        Self {
            state: State::Searching { matched: 0 },
            buf: Vec::new(),
            latest: None,
            found: 0,
            unreadable: 0,
        }
    }

    /// The last complete usage seen so far (the final one once the stream ended).
    pub fn usage(&self) -> Option<Usage> {
        self.latest
    }

    pub fn feed(&mut self, chunk: &[u8]) {
        for &c in chunk {
            self.step(c);
        }
    }

    fn step(&mut self, c: u8) {
        match &mut self.state {
            State::Searching { matched } => {
                if KEY.get(*matched) == Some(&c) {
                    *matched += 1;
                    if *matched == KEY.len() {
                        self.state = State::AfterKey { colon: false };
                    }
                } else {
                    *matched = usize::from(c == b'"');
                }
            }
            State::AfterKey { colon } => match c {
                b' ' | b'\t' | b'\r' | b'\n' => {}
                b':' if !*colon => *colon = true,
                b'{' if *colon => {
                    self.buf.clear();
                    self.buf.push(c);
                    self.state = State::Capturing {
                        depth: 1,
                        in_str: false,
                        esc: false,
                    };
                }
                _ => {
                    self.state = State::Searching {
                        matched: usize::from(c == b'"'),
                    }
                }
            },
            State::Capturing { depth, in_str, esc } => {
                if self.buf.len() >= MAX_USAGE_BYTES {
                    self.unreadable += 1;
                    self.buf = Vec::new();
                    self.state = State::Searching {
                        matched: usize::from(c == b'"'),
                    };
                    return;
                }
                self.buf.push(c);
                if *in_str {
                    if *esc {
                        *esc = false;
                    } else if c == b'\\' {
                        *esc = true;
                    } else if c == b'"' {
                        *in_str = false;
                    }
                    return;
                }
                match c {
                    b'"' => *in_str = true,
                    b'{' => *depth += 1,
                    b'}' => {
                        *depth -= 1;
                        if *depth == 0 {
                            match serde_json::from_slice::<Value>(&self.buf)
                                .ok()
                                .as_ref()
                                .and_then(usage_from_value)
                            {
                                Some(u) => {
                                    self.latest = Some(u);
                                    self.found += 1;
                                }
                                None => self.unreadable += 1,
                            }
                            self.buf.clear();
                            self.state = State::Searching { matched: 0 };
                        }
                    }
                    _ => {}
                }
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::indexing_slicing)]
mod tests {
    use super::*;

    const SSE: &str = concat!(
        "data: {\"id\":\"c1\",\"choices\":[{\"delta\":{\"content\":\"The \\\"usage\\\": {\\\"prompt_tokens\\\": 1}\"}}],\"usage\":null}\n\n",
        "data: {\"id\":\"c1\",\"choices\":[{\"delta\":{\"content\":\" end\"}}],\"usage\":null}\n\n",
        "data: {\"id\":\"c1\",\"choices\":[],\"usage\":{\"prompt_tokens\":120,\"completion_tokens\":33,",
        "\"total_tokens\":153,\"prompt_tokens_details\":{\"cached_tokens\":0,\"audio_tokens\":20}}}\n\n",
        "data: [DONE]\n\n"
    );

    fn want() -> Usage {
        Usage {
            prompt_tokens: 120,
            completion_tokens: 33,
            prompt_audio_tokens: 20,
            ..Usage::default()
        }
    }

    #[test]
    fn sse_usage_in_one_chunk() {
        let mut s = UsageScanner::new();
        s.feed(SSE.as_bytes());
        assert_eq!(s.usage(), Some(want()));
        assert_eq!((s.found, s.unreadable), (1, 0));
    }

    #[test]
    fn sse_usage_across_every_split_point() {
        let b = SSE.as_bytes();
        for cut in 0..=b.len() {
            let mut s = UsageScanner::new();
            s.feed(&b[..cut]);
            s.feed(&b[cut..]);
            assert_eq!(s.usage(), Some(want()), "split at {cut}");
        }
        let mut s = UsageScanner::new();
        for byte in b {
            s.feed(std::slice::from_ref(byte));
        }
        assert_eq!(s.usage(), Some(want()));
    }

    #[test]
    fn last_usage_wins_and_stream_without_usage_gives_none() {
        let mut s = UsageScanner::new();
        s.feed(b"data: {\"usage\": {\"prompt_tokens\": 5, \"completion_tokens\": 1}}\n\n");
        s.feed(b"data: {\"usage\": {\"prompt_tokens\": 5, \"completion_tokens\": 9}}\n\n");
        assert_eq!(s.usage().map(|u| u.completion_tokens), Some(9));
        let mut s = UsageScanner::new();
        s.feed(b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: [DONE]\n\n");
        assert_eq!(s.usage(), None);
    }

    #[test]
    fn oversize_or_bad_usage_is_skipped() {
        let mut s = UsageScanner::new();
        let big = format!(
            "{{\"usage\": {{\"x\": \"{}\"}}}}",
            "a".repeat(MAX_USAGE_BYTES)
        );
        s.feed(big.as_bytes());
        s.feed(b"{\"usage\": {\"completion_tokens\": 3}}");
        assert_eq!(s.usage(), None);
        assert_eq!(s.unreadable, 2);
    }

    #[test]
    fn non_streaming_body() {
        let body = br#"{"id":"x","choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":10,"completion_tokens":2,"total_tokens":12}}"#;
        let u = usage_from_json(body).unwrap();
        assert_eq!((u.prompt_tokens, u.completion_tokens), (10, 2));
        let mut s = UsageScanner::new();
        s.feed(body);
        assert_eq!(s.usage(), Some(u));
        assert_eq!(usage_from_json(b"{\"usage\": null}"), None);
        assert_eq!(usage_from_json(b"nope"), None);
    }

    #[test]
    fn weighted_usage_splits_modalities() {
        let w = CostWeights::default();
        let u = Usage {
            prompt_tokens: 1000,
            completion_tokens: 100,
            prompt_image_tokens: 765,
            prompt_audio_tokens: 10,
            completion_audio_tokens: 0,
        };
        assert_eq!(
            u.weighted(&w),
            (225.0 + 100.0 + 765.0 * 3.2 + 10.0 * 4.8f64).ceil() as u64
        );
    }
}
