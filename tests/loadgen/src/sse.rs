//! Decides what a streamed response said: an incremental Server-Sent-Events reader (WHATWG
//! event-stream framing, OpenAI chat-completion chunks) that counts data events, spots
//! `[DONE]` and reads `usage.completion_tokens`, parsing JSON only for the usage chunk so it
//! stays cheap at thousands of chunks per second. For multi-turn sessions it can also keep the
//! answer as received (the concatenated `delta.content`, or `text` of completions), parsing
//! each content chunk into borrowed fields.

use std::borrow::Cow;

use serde::Deserialize;

/// Accumulates the state of one SSE body fed in arbitrary byte pieces.
#[derive(Debug, Default)]
pub struct SseReader {
    partial: Vec<u8>,
    /// `data:` events other than `[DONE]`.
    pub data_events: u64,
    /// Data events that carry no usage object (content / role chunks).
    pub content_chunks: u64,
    /// `usage.completion_tokens` from the last usage chunk seen.
    pub usage_completion_tokens: Option<u64>,
    pub done: bool,
    /// The answer so far, when capturing.
    pub text: Option<String>,
    /// Content chunks whose JSON could not be read while capturing (their text is missing).
    pub unreadable_chunks: u64,
}

#[derive(Deserialize)]
struct Chunk<'a> {
    #[serde(borrow, default)]
    choices: Vec<Choice<'a>>,
}

#[derive(Deserialize)]
struct Choice<'a> {
    #[serde(borrow, default)]
    delta: Option<Delta<'a>>,
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct Delta<'a> {
    #[serde(borrow, default)]
    content: Option<Cow<'a, str>>,
}

impl SseReader {
    pub fn new() -> Self {
        Self::default()
    }

    /// A reader that also keeps the answer's text ([`SseReader::text`]).
    pub fn capturing() -> Self {
        SseReader {
            text: Some(String::new()),
            ..Self::default()
        }
    }

    /// Feeds the next body piece; returns how many new data events it completed.
    pub fn feed(&mut self, mut bytes: &[u8]) -> u64 {
        let before = self.data_events;
        while let Some(nl) = bytes.iter().position(|&b| b == b'\n') {
            let (head, rest) = bytes.split_at(nl);
            bytes = &rest[1..];
            if self.partial.is_empty() {
                self.line(head);
            } else {
                let mut line = std::mem::take(&mut self.partial);
                line.extend_from_slice(head);
                self.line(&line);
            }
        }
        self.partial.extend_from_slice(bytes);
        self.data_events - before
    }

    /// Flushes a last line without a trailing newline.
    pub fn finish(&mut self) {
        if !self.partial.is_empty() {
            let line = std::mem::take(&mut self.partial);
            self.line(&line);
        }
    }

    /// Output tokens: usage when reported, else the number of content chunks.
    pub fn output_tokens(&self) -> (u64, bool) {
        match self.usage_completion_tokens {
            Some(n) => (n, true),
            None => (self.content_chunks, false),
        }
    }

    fn line(&mut self, line: &[u8]) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(data) = line.strip_prefix(b"data:") else {
            return; // comments, event:, id:, retry:, blank separators
        };
        let data = data.strip_prefix(b" ").unwrap_or(data);
        if data == b"[DONE]" {
            self.done = true;
            return;
        }
        self.data_events += 1;
        if has_usage_object(data) {
            if let Some(n) = usage_from_json(data) {
                self.usage_completion_tokens = Some(n);
                return;
            }
        }
        self.content_chunks += 1;
        if let Some(text) = &mut self.text {
            match serde_json::from_slice::<Chunk>(data) {
                Ok(c) => {
                    for ch in c.choices {
                        if let Some(t) = ch.delta.and_then(|d| d.content).or(ch.text) {
                            text.push_str(&t);
                        }
                    }
                }
                Err(_) => self.unreadable_chunks += 1,
            }
        }
    }
}

/// True when `"usage"` is followed by an object (not `null`).
fn has_usage_object(data: &[u8]) -> bool {
    const KEY: &[u8] = b"\"usage\"";
    let mut from = 0;
    while let Some(i) = find(&data[from..], KEY) {
        let after = &data[from + i + KEY.len()..];
        let mut it = after
            .iter()
            .copied()
            .skip_while(|b| b.is_ascii_whitespace());
        if it.next() == Some(b':') && it.find(|b| !b.is_ascii_whitespace()) == Some(b'{') {
            return true;
        }
        from += i + KEY.len();
    }
    false
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// `usage.completion_tokens` of a JSON object (a usage chunk, or a non-streamed response).
pub fn usage_from_json(body: &[u8]) -> Option<u64> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    v.get("usage")?.get("completion_tokens")?.as_u64()
}

#[cfg(test)]
mod tests {
    use super::*;

    const STREAM: &str = "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}],\"usage\":null}\n\n\
data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}],\"usage\":null}\n\n\
data: {\"choices\":[{\"delta\":{\"content\":\"b\"}}]}\n\n\
data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":42,\"total_tokens\":47}}\n\n\
data: [DONE]\n\n";

    #[test]
    fn counts_events_and_reads_usage() {
        let mut r = SseReader::new();
        assert_eq!(r.feed(STREAM.as_bytes()), 4);
        assert_eq!(r.content_chunks, 3);
        assert_eq!(r.output_tokens(), (42, true));
        assert!(r.done);
    }

    #[test]
    fn same_result_for_any_split() {
        let bytes = STREAM.replace("\n", "\r\n").into_bytes();
        for step in [1, 2, 3, 7, 50] {
            let mut r = SseReader::new();
            let mut n = 0;
            for piece in bytes.chunks(step) {
                n += r.feed(piece);
            }
            r.finish();
            assert_eq!(
                (n, r.content_chunks, r.usage_completion_tokens, r.done),
                (4, 3, Some(42), true),
                "step {step}"
            );
        }
    }

    #[test]
    fn falls_back_to_chunk_count_without_usage() {
        let mut r = SseReader::new();
        r.feed(b": keepalive\nevent: message\ndata:{\"choices\":[]}\n\ndata: {\"x\":1}");
        assert_eq!(r.data_events, 1, "last line incomplete until finish");
        r.finish();
        assert_eq!(r.output_tokens(), (2, false));
        assert!(!r.done);
    }

    #[test]
    fn capturing_keeps_the_answer_as_received_for_any_split() {
        let stream = STREAM.replace("\"b\"", "\" \\\"q\\\" \\u00e9\"");
        for step in [1, 5, 1000] {
            let mut r = SseReader::capturing();
            for piece in stream.as_bytes().chunks(step) {
                r.feed(piece);
            }
            r.finish();
            assert_eq!(r.text.as_deref(), Some("a \"q\" é"), "step {step}");
            assert_eq!(r.unreadable_chunks, 0);
        }
        let mut r = SseReader::capturing();
        r.feed(b"data: {\"choices\":[{\"text\":\"x\"}]}\n\ndata: {broken\n\n");
        assert_eq!((r.text.as_deref(), r.unreadable_chunks), (Some("x"), 1));
        let mut plain = SseReader::new();
        plain.feed(STREAM.as_bytes());
        assert!(plain.text.is_none(), "no capture unless asked");
    }

    #[test]
    fn usage_null_is_not_an_object() {
        assert!(!has_usage_object(br#"{"usage": null}"#));
        assert!(has_usage_object(br#"{"usage" : {"completion_tokens":1}}"#));
        assert!(!has_usage_object(br#"{"text":"usage"}"#));
        assert_eq!(
            usage_from_json(br#"{"usage":{"completion_tokens":9}}"#),
            Some(9)
        );
        assert_eq!(usage_from_json(b"not json"), None);
    }
}
