//! Decides how OpenAI-compatible requests are read and answered: request parsing and
//! validation, the prompt's token ids (the fake model's tokenizer and chat template from
//! `ai-lb-prefix`), seeded generated tokens (4-byte ASCII pieces, so an answer re-tokenises to
//! the same ids), and the JSON bodies of responses, SSE chunks and errors (vLLM's shapes).

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
    /// The prompt's token ids: the chat template of the messages, the tokens of a completion
    /// prompt, or a completion's token-id array as given.
    pub prompt_ids: Vec<u32>,
    /// `prompt_ids.len()`, at least 1 (an empty prompt still occupies one position).
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

    /// vLLM's answer when the engine runs out of GPU memory on a request.
    pub fn out_of_memory() -> Self {
        Self {
            status: 500,
            kind: "InternalServerError",
            message: "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. \
                      GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB is free."
                .to_string(),
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

/// Prompt tokens billed for `ids`: their number, at least 1.
pub fn count_prompt(ids: &[u32]) -> u32 {
    u32::try_from(ids.len()).unwrap_or(u32::MAX).max(1)
}

/// Token ids of a completion prompt string (no chat template).
pub fn completion_ids(text: &str) -> Vec<u32> {
    let mut ids = Vec::with_capacity(ai_lb_prefix::count_tokens(text));
    ai_lb_prefix::tokenize_into(text, &mut ids);
    ids
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
            let contents: Vec<String> = r.messages.iter().map(message_text).collect();
            let mut ids = Vec::new();
            ai_lb_prefix::chat_prompt_into(
                r.messages
                    .iter()
                    .zip(&contents)
                    .map(|(m, c)| (m.role.as_str(), c.as_str())),
                &mut ids,
            );
            let text = contents.join("\n");
            let (mt, field) = match r.max_completion_tokens {
                Some(v) => (Some(v), "max_completion_tokens"),
                None => (r.max_tokens, "max_tokens"),
            };
            Ok(GenRequest {
                kind,
                model: r.model,
                prompt_tokens: count_prompt(&ids),
                prompt_ids: ids,
                prompt_text: text,
                max_tokens: max_tokens(mt, field)?,
                stream: r.stream.unwrap_or(false),
                include_usage: r.stream_options.and_then(|o| o.include_usage) == Some(true),
            })
        }
        Kind::Completion => {
            let r: CompletionRequest = serde_json::from_slice(body).map_err(invalid)?;
            check_n(r.n)?;
            let (text, ids) = match r.prompt {
                Prompt::Text(t) => {
                    let ids = completion_ids(&t);
                    (t, ids)
                }
                Prompt::Texts(ts) => {
                    let t = ts.join("\n");
                    let ids = completion_ids(&t);
                    (t, ids)
                }
                Prompt::Tokens(ids) => {
                    let t = ids
                        .iter()
                        .map(|i| i.to_string())
                        .collect::<Vec<_>>()
                        .join(" ");
                    (t, ids)
                }
            };
            Ok(GenRequest {
                kind,
                model: r.model,
                prompt_text: text,
                prompt_tokens: count_prompt(&ids),
                prompt_ids: ids,
                max_tokens: max_tokens(r.max_tokens, "max_tokens")?,
                stream: r.stream.unwrap_or(false),
                include_usage: r.stream_options.and_then(|o| o.include_usage) == Some(true),
            })
        }
    }
}

/// The text of a chat message: its string content, or its parts' texts concatenated.
fn message_text(m: &ChatMessage) -> String {
    match &m.content {
        Some(Content::Text(t)) => t.clone(),
        Some(Content::Parts(parts)) => parts.iter().filter_map(|p| p.text.as_deref()).collect(),
        None => String::new(),
    }
}

/// Words of the generated text. With its leading space each is 4 or 8 bytes, i.e. one or two
/// 4-byte tokens, so the text cuts back into exactly the generated tokens.
const WORDS: &[&str] = &[
    "the", "and", "for", "are", "but", "not", "all", "can", "was", "one", "our", "out", "day",
    "get", "has", "how", "new", "now", "old", "see", "two", "way", "who", "did", "its", "let",
    "put", "say", "too", "use", "cat", "sat", "mat", "run", "set", "key", "map", "log", "bit",
    "net", "api", "box", "pod", "gpu", "hot", "low", "top", "end", "latency", "prefill", "cluster",
    "request", "balance", "decoder", "kernels", "tensors", "routing", "streams", "signals",
    "weights", "batches", "caching", "serving", "replica", "backend", "metrics", "network",
    "compute",
];

/// Seeded generator of the output tokens: the same seed and request give the same tokens.
/// Every token is a 4-byte ASCII piece (`" the"`, `" lat"`, `"ency"`): words from [`WORDS`]
/// with a leading space, cut into 4-byte pieces.
#[derive(Debug)]
pub struct TextGen {
    rng: ChaCha8Rng,
    /// Pieces of the current word not emitted yet.
    pending: Vec<u32>,
}

impl TextGen {
    pub fn new(seed: u64, req: &GenRequest) -> Self {
        let h = fnv1a(req.prompt_text.as_bytes()) ^ u64::from(req.max_tokens).rotate_left(32);
        Self {
            rng: ChaCha8Rng::seed_from_u64(seed ^ h),
            pending: Vec::new(),
        }
    }

    /// The next token's id (a 4-byte ASCII piece of the `ai-lb-prefix` tokenizer).
    pub fn next_id(&mut self) -> u32 {
        if self.pending.is_empty() {
            let w = WORDS[self.rng.random_range(0..WORDS.len())];
            let mut ids = Vec::with_capacity(2);
            ai_lb_prefix::tokenize_into(&format!(" {w}"), &mut ids);
            // Reversed, so `pop` yields them in order.
            self.pending = ids.into_iter().rev().collect();
        }
        self.pending.pop().unwrap_or(0)
    }

    /// The ids of the next `n` tokens.
    pub fn ids(&mut self, n: u32) -> Vec<u32> {
        (0..n).map(|_| self.next_id()).collect()
    }
}

/// The text of one generated token id.
pub fn token_text(id: u32) -> String {
    let mut s = String::with_capacity(4);
    ai_lb_prefix::detokenize_into(&[id], &mut s);
    s
}

/// The text of generated token ids.
pub fn tokens_text(ids: &[u32]) -> String {
    let mut s = String::with_capacity(ids.len() * 4);
    ai_lb_prefix::detokenize_into(ids, &mut s);
    s
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
        self.full_with(text, usage, true)
    }

    /// The non-streaming body; `finished: false` gives `finish_reason: null` (cut off).
    pub fn full_with(&self, text: &str, usage: Usage, finished: bool) -> String {
        let finish = if finished {
            serde_json::json!("length")
        } else {
            serde_json::Value::Null
        };
        let choice = match self.kind {
            Kind::Chat => serde_json::json!({
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": null,
                "finish_reason": finish,
            }),
            Kind::Completion => serde_json::json!({
                "index": 0,
                "text": text,
                "logprobs": null,
                "finish_reason": finish,
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
    fn prompt_counts_follow_the_fake_tokenizer() {
        for (prompt, n) in [("", 1), ("abcd", 1), ("abcde", 2), ("ééééé", 5)] {
            let body = serde_json::json!({ "prompt": prompt }).to_string();
            let r = parse(Kind::Completion, body.as_bytes()).unwrap();
            assert_eq!(r.prompt_tokens, n, "{prompt:?}");
            assert_eq!(r.prompt_ids, completion_ids(prompt));
        }
    }

    #[test]
    fn chat_request_is_parsed() {
        let body = br#"{"model":"m","messages":[{"role":"system","content":"abcd"},
            {"role":"user","content":[{"type":"text","text":"efgh"}]}],
            "max_tokens":7,"stream":true,"stream_options":{"include_usage":true},"temperature":0.2}"#;
        let r = parse(Kind::Chat, body).unwrap();
        assert_eq!(r.prompt_text, "abcd\nefgh");
        // system role, "abcd", user role, "efgh", generation prompt
        let mut ids = Vec::new();
        ai_lb_prefix::chat_prompt_into([("system", "abcd"), ("user", "efgh")], &mut ids);
        assert_eq!(r.prompt_ids, ids);
        assert_eq!(r.prompt_tokens, 5);
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
        assert_eq!(r.prompt_ids, vec![1, 2, 3, 4, 5]);
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
        let gen = |seed| TextGen::new(seed, &r).ids(8);
        assert_eq!(gen(1), gen(1));
        assert_ne!(gen(1), gen(2));
    }

    #[test]
    fn generated_tokens_are_4_byte_pieces_that_retokenise_to_themselves() {
        let r = parse(Kind::Completion, br#"{"prompt":"hello","max_tokens":300}"#).unwrap();
        let ids = TextGen::new(3, &r).ids(300);
        assert!(ids.iter().all(|id| token_text(*id).len() == 4), "{ids:?}");
        let text = tokens_text(&ids);
        assert_eq!(text.len(), 1200);
        assert_eq!(completion_ids(&text), ids);
        assert!(text.starts_with(' '), "{text}");
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
