//! Decides how OpenAI-compatible requests are read and answered: request parsing and
//! validation, the prompt-token estimate (ceil(chars / 4) of the prompt text), seeded generated
//! text, and the JSON bodies of responses, SSE chunks and errors (vLLM's shapes).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::gpu::fnv1a;

/// Output length when the request names none (vLLM uses the remaining context; we pick a
/// fixed, documented default).
pub const DEFAULT_MAX_TOKENS: u32 = 128;

/// Which endpoint a request came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Chat,
    Completion,
}

#[derive(Debug, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
}

#[derive(Debug, Deserialize)]
struct ChatRequest {
    #[serde(default)]
    model: Option<String>,
    messages: Vec<ChatMessage>,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    max_completion_tokens: Option<u32>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    n: Option<u32>,
}

#[derive(Debug, Deserialize)]
struct ChatMessage {
    #[allow(dead_code)]
    role: String,
    #[serde(default)]
    content: Option<Content>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
struct ContentPart {
    #[serde(default)]
    text: Option<String>,
}

#[derive(Debug, Deserialize)]
struct CompletionRequest {
    #[serde(default)]
    model: Option<String>,
    prompt: Prompt,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    n: Option<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
}

/// A request reduced to what the simulation needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GenRequest {
    pub kind: Kind,
    pub model: Option<String>,
    /// Prompt text (messages' contents joined by '\n'), used to seed the generated text.
    pub prompt_text: String,
    pub prompt_tokens: u32,
    pub max_tokens: u32,
    pub stream: bool,
    pub include_usage: bool,
}

/// An error answered in OpenAI's shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: u16,
    pub kind: &'static str,
    pub message: String,
    pub param: Option<&'static str>,
}

impl ApiError {
    pub fn bad_request(message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self {
            status: 400,
            kind: "BadRequestError",
            message: message.into(),
            param,
        }
    }

    pub fn not_found_model(model: &str) -> Self {
        Self {
            status: 404,
            kind: "NotFoundError",
            message: format!("The model `{model}` does not exist."),
            param: Some("model"),
        }
    }

    pub fn injected() -> Self {
        Self {
            status: 500,
            kind: "InternalServerError",
            message: "injected failure (fake-pod error_rate fault)".to_string(),
            param: None,
        }
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self {
            status: 503,
            kind: "ServiceUnavailableError",
            message: message.into(),
            param: None,
        }
    }

    /// `{"error": {"message", "type", "param", "code"}}`.
    pub fn body(&self) -> String {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.status,
            }
        })
        .to_string()
    }
}

/// Prompt-token estimate: ceil(characters / 4), at least 1.
pub fn estimate_tokens(text: &str) -> u32 {
    let chars = text.chars().count() as u64;
    u32::try_from(chars.div_ceil(4).max(1)).unwrap_or(u32::MAX)
}

fn check_n(n: Option<u32>) -> Result<(), ApiError> {
    match n {
        None | Some(1) => Ok(()),
        Some(n) => Err(ApiError::bad_request(
            format!("n={n} is not supported by the fake pod (only n=1)"),
            Some("n"),
        )),
    }
}

fn max_tokens(v: Option<u32>, field: &'static str) -> Result<u32, ApiError> {
    match v {
        None => Ok(DEFAULT_MAX_TOKENS),
        Some(0) => Err(ApiError::bad_request(
            format!("{field} must be at least 1, got 0"),
            Some(field),
        )),
        Some(n) => Ok(n),
    }
}

/// Parses and validates a request body.
pub fn parse(kind: Kind, body: &[u8]) -> Result<GenRequest, ApiError> {
    let invalid = |e: serde_json::Error| {
        ApiError::bad_request(format!("invalid JSON request body: {e}"), None)
    };
    match kind {
        Kind::Chat => {
            let r: ChatRequest = serde_json::from_slice(body).map_err(invalid)?;
            check_n(r.n)?;
            if r.messages.is_empty() {
                return Err(ApiError::bad_request(
                    "messages must not be empty",
                    Some("messages"),
                ));
            }
            let mut text = String::new();
            for (i, m) in r.messages.iter().enumerate() {
                if i > 0 {
                    text.push('\n');
                }
                match &m.content {
                    Some(Content::Text(t)) => text.push_str(t),
                    Some(Content::Parts(parts)) => {
                        for p in parts {
                            text.push_str(p.text.as_deref().unwrap_or(""));
                        }
                    }
                    None => {}
                }
            }
            let (mt, field) = match r.max_completion_tokens {
                Some(v) => (Some(v), "max_completion_tokens"),
                None => (r.max_tokens, "max_tokens"),
            };
            Ok(GenRequest {
                kind,
                model: r.model,
                prompt_tokens: estimate_tokens(&text),
                prompt_text: text,
                max_tokens: max_tokens(mt, field)?,
                stream: r.stream.unwrap_or(false),
                include_usage: r.stream_options.and_then(|o| o.include_usage) == Some(true),
            })
        }
        Kind::Completion => {
            let r: CompletionRequest = serde_json::from_slice(body).map_err(invalid)?;
            check_n(r.n)?;
            let (text, tokens) = match r.prompt {
                Prompt::Text(t) => {
                    let n = estimate_tokens(&t);
                    (t, n)
                }
                Prompt::Texts(ts) => {
                    let t = ts.join("\n");
                    let n = estimate_tokens(&t);
                    (t, n)
                }
                Prompt::Tokens(ids) => {
                    let n = u32::try_from(ids.len()).unwrap_or(u32::MAX).max(1);
                    let t = ids
                        .iter()
                        .map(|i| i.to_string())
                        .collect::<Vec<_>>()
                        .join(" ");
                    (t, n)
                }
            };
            Ok(GenRequest {
                kind,
                model: r.model,
                prompt_text: text,
                prompt_tokens: tokens,
                max_tokens: max_tokens(r.max_tokens, "max_tokens")?,
                stream: r.stream.unwrap_or(false),
                include_usage: r.stream_options.and_then(|o| o.include_usage) == Some(true),
            })
        }
    }
}

const WORDS: &[&str] = &[
    "the",
    "model",
    "token",
    "batch",
    "cache",
    "router",
    "latency",
    "pod",
    "GPU",
    "request",
    "stream",
    "queue",
    "kernel",
    "memory",
    "prefill",
    "decode",
    "signal",
    "score",
    "weight",
    "envoy",
    "cluster",
    "host",
    "load",
    "balance",
    "fast",
    "slow",
    "warm",
    "cold",
    "simulated",
    "answer",
    "is",
    "a",
    "of",
    "to",
    "and",
    "in",
    "that",
    "for",
    "with",
    "on",
    "as",
    "it",
    "by",
    "this",
    "from",
    "at",
    "we",
    "can",
    "will",
    "each",
    "more",
    "than",
    "when",
    "which",
    "time",
    "first",
    "next",
    "last",
    "every",
    "metric",
    "value",
    "tensor",
    "layer",
    "vector",
];

/// Seeded generator of the output text: the same seed and request give the same text.
#[derive(Debug)]
pub struct TextGen {
    rng: ChaCha8Rng,
}

impl TextGen {
    pub fn new(seed: u64, req: &GenRequest) -> Self {
        let h = fnv1a(req.prompt_text.as_bytes()) ^ u64::from(req.max_tokens).rotate_left(32);
        Self {
            rng: ChaCha8Rng::seed_from_u64(seed ^ h),
        }
    }

    /// The next token's text (a word with a leading space, except the first).
    pub fn token(&mut self, index: u32) -> String {
        let w = WORDS[self.rng.random_range(0..WORDS.len())];
        if index == 0 {
            w.to_string()
        } else {
            format!(" {w}")
        }
    }
}

/// `usage` block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
}

impl Usage {
    pub fn new(prompt: u32, completion: u32) -> Self {
        Self {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt.saturating_add(completion),
        }
    }
}

/// Fields shared by every response of one request.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    /// Precomputed start of every streamed chunk.
    head: String,
}

impl ResponseMeta {
    pub fn new(kind: Kind, id: String, created: u64, model: String) -> Self {
        let mut m = Self {
            kind,
            id,
            created,
            model,
            head: String::new(),
        };
        m.head = m.chunk_head();
        m
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Completion, _) => "text_completion",
        }
    }

    /// The non-streaming response body.
    pub fn full(&self, text: &str, usage: Usage) -> String {
        let choice = match self.kind {
            Kind::Chat => serde_json::json!({
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": null,
                "finish_reason": "length",
            }),
            Kind::Completion => serde_json::json!({
                "index": 0,
                "text": text,
                "logprobs": null,
                "finish_reason": "length",
            }),
        };
        serde_json::json!({
            "id": self.id,
            "object": self.object(false),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage,
        })
        .to_string()
    }

    /// One SSE `data:` payload carrying one token; the first chat chunk also carries the role,
    /// the last one `finish_reason: "length"`. Built by string concatenation (this runs once
    /// per token of every stream, the pod's hottest path); the token is JSON-escaped.
    pub fn chunk(&self, token: &str, first: bool, last: bool) -> String {
        let token = serde_json::to_string(token).unwrap_or_else(|_| "\"\"".to_string());
        let head = &self.head;
        let finish = if last { "\"length\"" } else { "null" };
        match self.kind {
            Kind::Chat => {
                let role = if first { "\"role\":\"assistant\"," } else { "" };
                format!(
                    "{head}{{\"index\":0,\"delta\":{{{role}\"content\":{token}}},\"logprobs\":null,\"finish_reason\":{finish}}}]}}"
                )
            }
            Kind::Completion => format!(
                "{head}{{\"index\":0,\"text\":{token},\"logprobs\":null,\"finish_reason\":{finish}}}]}}"
            ),
        }
    }

    /// `{"id":..,"object":..,"created":..,"model":..,"choices":[` of a chunk.
    fn chunk_head(&self) -> String {
        let id = serde_json::to_string(&self.id).unwrap_or_default();
        let model = serde_json::to_string(&self.model).unwrap_or_default();
        format!(
            "{{\"id\":{id},\"object\":\"{}\",\"created\":{},\"model\":{model},\"choices\":[",
            self.object(true),
            self.created
        )
    }

    /// The final usage chunk (`stream_options.include_usage`).
    pub fn usage_chunk(&self, usage: Usage) -> String {
        serde_json::json!({
            "id": self.id,
            "object": self.object(true),
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage,
        })
        .to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_estimate_is_ceil_chars_over_four() {
        assert_eq!(estimate_tokens(""), 1);
        assert_eq!(estimate_tokens("abcd"), 1);
        assert_eq!(estimate_tokens("abcde"), 2);
        assert_eq!(estimate_tokens("ééééé"), 2);
    }

    #[test]
    fn chat_request_is_parsed() {
        let body = br#"{"model":"m","messages":[{"role":"system","content":"abcd"},
            {"role":"user","content":[{"type":"text","text":"efgh"}]}],
            "max_tokens":7,"stream":true,"stream_options":{"include_usage":true},"temperature":0.2}"#;
        let r = parse(Kind::Chat, body).unwrap();
        assert_eq!(r.prompt_text, "abcd\nefgh");
        assert_eq!(r.prompt_tokens, 3);
        assert_eq!(r.max_tokens, 7);
        assert!(r.stream && r.include_usage);
        assert_eq!(r.model.as_deref(), Some("m"));
    }

    #[test]
    fn max_completion_tokens_wins_and_default_applies() {
        let r = parse(
            Kind::Chat,
            br#"{"messages":[{"role":"user","content":"x"}],"max_tokens":5,"max_completion_tokens":9}"#,
        )
        .unwrap();
        assert_eq!(r.max_tokens, 9);
        let r = parse(Kind::Completion, br#"{"prompt":"hello"}"#).unwrap();
        assert_eq!(r.max_tokens, DEFAULT_MAX_TOKENS);
        assert!(!r.stream);
        let r = parse(Kind::Completion, br#"{"prompt":[1,2,3,4,5]}"#).unwrap();
        assert_eq!(r.prompt_tokens, 5);
    }

    #[test]
    fn bad_requests_say_why() {
        for (kind, body, needle) in [
            (Kind::Chat, &b"{not json"[..], "invalid JSON"),
            (Kind::Chat, &br#"{"model":"m"}"#[..], "messages"),
            (Kind::Chat, &br#"{"messages":[]}"#[..], "messages"),
            (
                Kind::Chat,
                &br#"{"messages":[{"role":"user","content":"x"}],"max_tokens":-1}"#[..],
                "-1",
            ),
            (
                Kind::Completion,
                &br#"{"prompt":"x","max_tokens":0}"#[..],
                "max_tokens",
            ),
            (Kind::Completion, &br#"{"prompt":"x","n":2}"#[..], "n=2"),
        ] {
            let e = parse(kind, body).unwrap_err();
            assert_eq!(e.status, 400);
            assert!(e.message.contains(needle), "{}", e.message);
            let v: serde_json::Value = serde_json::from_str(&e.body()).unwrap();
            assert_eq!(v["error"]["code"], 400);
        }
    }

    #[test]
    fn text_is_deterministic_per_seed_and_request() {
        let r = parse(Kind::Completion, br#"{"prompt":"hello","max_tokens":8}"#).unwrap();
        let gen = |seed| {
            let mut g = TextGen::new(seed, &r);
            (0..8).map(|i| g.token(i)).collect::<String>()
        };
        assert_eq!(gen(1), gen(1));
        assert_ne!(gen(1), gen(2));
    }

    #[test]
    fn chunks_have_openai_shape() {
        let m = ResponseMeta::new(Kind::Chat, "chatcmpl-1".into(), 1, "m".into());
        let c: serde_json::Value = serde_json::from_str(&m.chunk("a\"b", false, false)).unwrap();
        assert_eq!(c["choices"][0]["delta"]["content"], "a\"b");
        assert!(c["choices"][0]["delta"].get("role").is_none());
        let k = ResponseMeta::new(Kind::Completion, "cmpl-1".into(), 1, "m".into());
        let c: serde_json::Value = serde_json::from_str(&k.chunk("t", true, true)).unwrap();
        assert_eq!(c["object"], "text_completion");
        assert_eq!(c["choices"][0]["text"], "t");
        assert_eq!(c["choices"][0]["finish_reason"], "length");
        let c: serde_json::Value = serde_json::from_str(&m.chunk("hi", true, false)).unwrap();
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(c["choices"][0]["finish_reason"], serde_json::Value::Null);
        let c: serde_json::Value = serde_json::from_str(&m.chunk(" x", false, true)).unwrap();
        assert_eq!(c["choices"][0]["finish_reason"], "length");
        let u: serde_json::Value = serde_json::from_str(&m.usage_chunk(Usage::new(3, 4))).unwrap();
        assert_eq!(u["usage"]["total_tokens"], 7);
        assert_eq!(u["choices"].as_array().unwrap().len(), 0);
    }
}
