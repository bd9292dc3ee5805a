//! Decides how one trace entry becomes one measured HTTP exchange: a streaming OpenAI
//! chat-completion request over a pooled hyper HTTP/1 client, timed to the first SSE data
//! event (TTFT) and to the end of the body (e2e), bounded by the client timeout. Chat entries
//! (shared-prefix) send `[system, user]` built from cached texts; a multi-turn [`Session`]
//! resends the whole conversation each turn with every previous answer as it was received.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::{HeaderName, HeaderValue, CONTENT_TYPE};
use hyper::{Method, Request, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::rt::TokioExecutor;
use tokio::time::Instant;

use crate::sse::{usage_from_json, SseReader};
use crate::stats::{Outcome, Record};
use crate::text;
use crate::workload::{system_prefix_tokens, TextSpec, TraceEntry};

/// Header naming the pod that served a request.
pub const POD_HEADER: &str = "x-fake-pod";
/// Path appended to `--url`.
pub const CHAT_PATH: &str = "/v1/chat/completions";
/// Characters of prompt text per prompt token (the usual ~4 chars/token of BPE on English).
pub const CHARS_PER_TOKEN: usize = 4;
/// Largest non-streamed body kept for usage parsing.
const MAX_JSON_BODY: usize = 1 << 20;

/// What every request shares.
#[derive(Debug, Clone)]
pub struct Target {
    /// Full URI of the chat-completions endpoint.
    pub uri: Uri,
    pub model: String,
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// Add `"ignore_eos": true` so servers generate exactly `max_tokens` (vLLM extension).
    pub ignore_eos: bool,
}

/// A cloneable, pooled client bound to one target.
#[derive(Debug, Clone)]
pub struct Client {
    http: HyperClient<HttpConnector, Full<Bytes>>,
    target: Arc<Target>,
    /// `"model":"..."` already JSON-encoded.
    model_json: Arc<str>,
    /// Filler text (JSON-safe ASCII) that prompts are sliced from.
    filler: Arc<str>,
    /// System prompts of the chat workloads by (group, spec), built once ([`Client::prepare`]).
    systems: Arc<HashMap<(u32, TextSpec), Arc<str>>>,
}

/// The role and content of one chat message.
type Message = (&'static str, Arc<str>);

impl Client {
    /// `max_prompt_tokens` sizes the shared filler text.
    pub fn new(target: Target, max_prompt_tokens: u32) -> Self {
        let mut conn = HttpConnector::new();
        conn.set_nodelay(true);
        conn.enforce_http(true);
        let http = HyperClient::builder(TokioExecutor::new())
            .pool_max_idle_per_host(usize::MAX)
            .pool_idle_timeout(Duration::from_secs(90))
            .build(conn);
        let model_json = serde_json::to_string(&target.model).unwrap_or_else(|_| "\"\"".into());
        Client {
            http,
            target: Arc::new(target),
            model_json: model_json.into(),
            filler: filler(max_prompt_tokens as usize * CHARS_PER_TOKEN).into(),
            systems: Arc::default(),
        }
    }

    /// Builds every system prompt `trace` names, once, so requests only copy them.
    pub fn prepare(mut self, trace: &[TraceEntry]) -> Self {
        let mut m = HashMap::new();
        for e in trace {
            if let (Some(g), Some(spec)) = (e.group, e.system) {
                m.entry((g, spec))
                    .or_insert_with(|| Arc::from(system_text(g, spec)));
            }
        }
        self.systems = Arc::new(m);
        self
    }

    /// Group `g`'s system prompt: the prepared copy, else built now.
    fn system(&self, g: u32, spec: TextSpec) -> Arc<str> {
        match self.systems.get(&(g, spec)) {
            Some(t) => t.clone(),
            None => Arc::from(system_text(g, spec)),
        }
    }

    /// The messages of a shared-prefix entry: its group's system prompt, its question.
    fn chat_messages(&self, e: &TraceEntry) -> Vec<Message> {
        let g = e.group.unwrap_or(0);
        let mut m = Vec::with_capacity(2);
        if let Some(spec) = e.system {
            m.push(("system", self.system(g, spec)));
        }
        if let Some(q) = e.question {
            let header = text::question_header(g, e.user.unwrap_or(0), e.id);
            m.push(("user", Arc::from(text::text(&header, q.seed, q.tokens))));
        }
        m
    }

    /// The JSON body of a chat request with `messages`.
    fn chat_body(&self, messages: &[Message], max_tokens: u32) -> String {
        let text: usize = messages.iter().map(|(_, c)| c.len() + 32).sum();
        let mut b = String::with_capacity(text + 200);
        b.push_str("{\"model\":");
        b.push_str(&self.model_json);
        b.push_str(",\"messages\":[");
        for (i, (role, content)) in messages.iter().enumerate() {
            if i > 0 {
                b.push(',');
            }
            b.push_str("{\"role\":\"");
            b.push_str(role);
            b.push_str("\",\"content\":");
            text::push_json_str(&mut b, content);
            b.push('}');
        }
        b.push_str("],\"max_tokens\":");
        b.push_str(&max_tokens.to_string());
        b.push_str(",\"stream\":true,\"stream_options\":{\"include_usage\":true}");
        if self.target.ignore_eos {
            b.push_str(",\"ignore_eos\":true");
        }
        b.push('}');
        b
    }

    /// The JSON request body for one entry (a session's first turn for a session line).
    pub fn body(&self, e: &TraceEntry) -> String {
        if e.question.is_some() {
            return self.chat_body(&self.chat_messages(e), e.max_tokens);
        }
        if !e.turns.is_empty() {
            let mut s = Session::new(self, e);
            let (messages, _) = s.next_messages(0);
            return self.chat_body(&messages, e.max_tokens);
        }
        let content = prompt_text(
            &self.filler,
            e.id,
            e.prompt_tokens as usize * CHARS_PER_TOKEN,
        );
        let eos = if self.target.ignore_eos {
            ",\"ignore_eos\":true"
        } else {
            ""
        };
        format!(
            "{{\"model\":{},\"messages\":[{{\"role\":\"user\",\"content\":\"{}\"}}],\"max_tokens\":{},\"stream\":true,\"stream_options\":{{\"include_usage\":true}}{}}}",
            self.model_json, content, e.max_tokens, eos
        )
    }

    /// Sends one request (a plain or shared-prefix entry) and measures it. `run_start` anchors
    /// `sent_us`; `scheduled_us` is the entry's own offset. Never fails: errors become the
    /// record's outcome.
    pub async fn send(&self, e: &TraceEntry, run_start: Instant, timeout: Duration) -> Record {
        let mut rec = Record::new(e.id, e.tag, e.prompt_tokens, e.max_tokens, e.at_us);
        let body = if e.question.is_some() {
            let messages = self.chat_messages(e);
            rec.prompt_tokens = prompt_tokens(&messages);
            rec.group = e.group;
            rec.user = e.user;
            rec.prefix_tokens = Some(system_prefix_tokens(e.system));
            self.chat_body(&messages, e.max_tokens)
        } else {
            self.body(e)
        };
        self.measure(body, rec, run_start, timeout, false).await.0
    }

    /// Sends `body` and measures it into `rec`; with `capture`, also returns the answer's text.
    async fn measure(
        &self,
        body: String,
        mut rec: Record,
        run_start: Instant,
        timeout: Duration,
        capture: bool,
    ) -> (Record, Option<String>) {
        let t0 = Instant::now();
        rec.sent_us = t0.duration_since(run_start).as_micros() as u64;
        let mut sse = if capture {
            SseReader::capturing()
        } else {
            SseReader::new()
        };
        let exchange = self.exchange(body, t0, &mut rec, &mut sse);
        match tokio::time::timeout_at(t0 + timeout, exchange).await {
            Ok(Ok(outcome)) => rec.outcome = outcome,
            Ok(Err(err)) => {
                rec.outcome = Outcome::TransportError;
                rec.error = Some(err);
            }
            Err(_) => {
                rec.outcome = Outcome::Timeout;
                rec.error = Some(format!(
                    "no complete response within {} ms",
                    timeout.as_millis()
                ));
            }
        }
        rec.e2e_ms = Some(ms(t0.elapsed()));
        let (n, from_usage) = sse.output_tokens();
        if rec.output_tokens == 0 {
            rec.output_tokens = n;
            rec.tokens_from_usage = from_usage;
        }
        if sse.unreadable_chunks > 0 && rec.error.is_none() {
            rec.error = Some(format!(
                "{} streamed chunks were not readable JSON; the answer kept for the next turn lacks their text",
                sse.unreadable_chunks
            ));
        }
        (rec, sse.text)
    }

    async fn exchange(
        &self,
        body: String,
        t0: Instant,
        rec: &mut Record,
        sse: &mut SseReader,
    ) -> Result<Outcome, String> {
        let mut req = Request::builder()
            .method(Method::POST)
            .uri(self.target.uri.clone())
            .header(CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))
            .map_err(|err| format!("building request: {err}"))?;
        for (k, v) in &self.target.headers {
            req.headers_mut().insert(k.clone(), v.clone());
        }
        let resp = self
            .http
            .request(req)
            .await
            .map_err(|err| format!("request: {err:?}"))?;
        let status = resp.status();
        rec.status = Some(status.as_u16());
        rec.pod = resp
            .headers()
            .get(POD_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let is_json = resp
            .headers()
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|ct| ct.starts_with("application/json"));
        let mut body = resp.into_body();
        let mut json_body: Vec<u8> = Vec::new();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|err| format!("reading body: {err}"))?;
            if let Ok(data) = frame.into_data() {
                if is_json {
                    if json_body.len() + data.len() <= MAX_JSON_BODY {
                        json_body.extend_from_slice(&data);
                    }
                } else if sse.feed(&data) > 0 && rec.ttft_ms.is_none() {
                    rec.ttft_ms = Some(ms(t0.elapsed()));
                }
            }
        }
        sse.finish();
        if is_json && status.is_success() {
            // A non-streamed answer: the whole body is the first "chunk".
            rec.ttft_ms = Some(ms(t0.elapsed()));
            if let Some(n) = usage_from_json(&json_body) {
                rec.output_tokens = n;
                rec.tokens_from_usage = true;
            }
        }
        Ok(if status.is_success() {
            Outcome::Ok
        } else {
            Outcome::HttpError
        })
    }
}

/// Group `g`'s system prompt text.
fn system_text(g: u32, spec: TextSpec) -> String {
    text::text(&text::system_header(g), spec.seed, spec.tokens)
}

/// Prompt tokens of `messages` under the `ai-lb-prefix` chat template.
fn prompt_tokens(messages: &[Message]) -> u32 {
    let m: Vec<(&str, &str)> = messages.iter().map(|(r, c)| (*r, &**c)).collect();
    text::chat_prompt_tokens(&m)
}

/// One multi-turn session in progress: the conversation so far, each answer as received.
#[derive(Debug)]
pub struct Session<'a> {
    client: &'a Client,
    entry: &'a TraceEntry,
    messages: Vec<Message>,
    /// Prompt tokens of the previous turn plus its answer's tokens.
    history_tokens: Option<u32>,
}

impl<'a> Session<'a> {
    /// A session of `entry` (a line with turns) before its first turn.
    pub fn new(client: &'a Client, entry: &'a TraceEntry) -> Self {
        let mut messages = Vec::with_capacity(entry.turns.len() * 2 + 1);
        if let Some(spec) = entry.system {
            messages.push(("system", client.system(entry.group.unwrap_or(0), spec)));
        }
        Session {
            client,
            entry,
            messages,
            history_tokens: None,
        }
    }

    /// The messages of turn `k` (0-based): the conversation so far plus its question; and the
    /// question.
    fn next_messages(&mut self, k: usize) -> (Vec<Message>, Arc<str>) {
        let q = self.entry.turns.get(k).map(|t| t.question);
        let header = text::turn_header(self.entry.session.unwrap_or(0), k as u32 + 1);
        let question: Arc<str> = match q {
            Some(q) => Arc::from(text::text(&header, q.seed, q.tokens)),
            None => Arc::from(header.as_str()),
        };
        let mut m = self.messages.clone();
        m.push(("user", question.clone()));
        (m, question)
    }

    /// Sends turn `k` (0-based; turns go in order) due at `scheduled_us` and measures it. On
    /// success the question and the answer as received join the conversation.
    pub async fn turn(
        &mut self,
        k: usize,
        scheduled_us: u64,
        run_start: Instant,
        timeout: Duration,
    ) -> Record {
        let e = self.entry;
        let max_tokens = e.turns.get(k).map_or(e.max_tokens, |t| t.max_tokens);
        let (messages, question) = self.next_messages(k);
        let mut rec = Record::new(e.id + k as u64, e.tag, 0, max_tokens, scheduled_us);
        rec.prompt_tokens = prompt_tokens(&messages);
        rec.group = e.group;
        rec.session = e.session;
        rec.turn = Some(k as u32 + 1);
        rec.prefix_tokens = Some(
            self.history_tokens
                .unwrap_or_else(|| system_prefix_tokens(e.system)),
        );
        let body = self.client.chat_body(&messages, max_tokens);
        let (rec, answer) = self
            .client
            .measure(body, rec, run_start, timeout, true)
            .await;
        if rec.outcome == Outcome::Ok {
            let answer = answer.unwrap_or_default();
            self.history_tokens = Some(rec.prompt_tokens.saturating_add(text::tokens(&answer)));
            self.messages.push(("user", question));
            self.messages.push(("assistant", Arc::from(answer)));
        }
        rec
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Deterministic JSON-safe filler text of at least `len` chars.
fn filler(len: usize) -> String {
    const WORDS: &[&str] = &[
        "the", "model", "serves", "tokens", "from", "a", "queue", "while", "the", "balancer",
        "picks", "pods", "by", "load", "and", "cache", "state", "so", "latency", "stays", "low",
    ];
    let mut s = String::with_capacity(len + 16);
    let mut i = 0;
    while s.len() < len {
        s.push_str(WORDS[i % WORDS.len()]);
        s.push(' ');
        i += 1;
    }
    s
}

/// Prompt of exactly `chars` characters (when the filler is long enough), starting with the
/// request id so prompts differ.
fn prompt_text(filler: &str, id: u64, chars: usize) -> String {
    let mut s = format!("request {id}: ");
    if s.len() >= chars {
        s.truncate(chars.max(1));
        return s;
    }
    let need = chars - s.len();
    s.push_str(&filler[..need.min(filler.len())]);
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::Tag;

    fn client() -> Client {
        Client::new(
            Target {
                uri: Uri::from_static("http://127.0.0.1:1/v1/chat/completions"),
                model: "m\"x".into(),
                headers: vec![],
                ignore_eos: false,
            },
            4000,
        )
    }

    #[tokio::test]
    async fn body_is_valid_json_with_requested_lengths() {
        let c = client();
        let e = TraceEntry {
            id: 7,
            tag: Tag::Long,
            prompt_tokens: 4000,
            max_tokens: 123,
            ..TraceEntry::default()
        };
        let v: serde_json::Value = serde_json::from_str(&c.body(&e)).unwrap();
        assert_eq!(v["model"], "m\"x");
        assert_eq!(v["max_tokens"], 123);
        assert_eq!(v["stream"], true);
        assert_eq!(v["stream_options"]["include_usage"], true);
        let content = v["messages"][0]["content"].as_str().unwrap();
        assert_eq!(content.len(), 16_000);
        assert!(content.starts_with("request 7: "));
        assert!(v.get("ignore_eos").is_none());
    }

    fn chat_entry(id: u64, group: u32, q_seed: u64) -> TraceEntry {
        let system = Some(TextSpec {
            seed: 77,
            tokens: 100,
        });
        TraceEntry {
            id,
            prompt_tokens: crate::workload::first_prompt_tokens(system, 20),
            max_tokens: 9,
            group: Some(group),
            user: Some(1),
            system,
            question: Some(TextSpec {
                seed: q_seed,
                tokens: 20,
            }),
            ..TraceEntry::default()
        }
    }

    fn messages(body: &str) -> Vec<(String, String)> {
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        v["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                (
                    m["role"].as_str().unwrap().to_string(),
                    m["content"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    }

    #[tokio::test]
    async fn shared_prefix_requests_share_the_system_prompt_exactly_and_differ_after() {
        let trace = [
            chat_entry(0, 3, 5),
            chat_entry(1, 3, 5),
            chat_entry(2, 4, 5),
        ];
        let c = client().prepare(&trace);
        let [a, b, other] = trace.each_ref().map(|e| messages(&c.body(e)));
        assert_eq!(a[0].0, "system");
        assert_eq!(a[0].1, b[0].1, "one group, one system prompt");
        assert_ne!(a[0].1, other[0].1, "another group, another system prompt");
        assert_ne!(
            a[1].1, b[1].1,
            "the same question seed still differs per request"
        );
        assert_eq!(crate::text::tokens(&a[0].1), 100);
        assert_eq!(crate::text::tokens(&a[1].1), 20);
        let m: Vec<(&str, &str)> = a.iter().map(|(r, t)| (r.as_str(), t.as_str())).collect();
        assert_eq!(crate::text::chat_prompt_tokens(&m), trace[0].prompt_tokens);
        // Unprepared clients build the same text.
        assert_eq!(messages(&client().body(&trace[0])), a);
        let v: serde_json::Value = serde_json::from_str(&c.body(&trace[0])).unwrap();
        assert_eq!(v["max_tokens"], 9);
        assert_eq!(v["stream"], true);
    }

    #[test]
    fn tiny_prompts_are_not_empty() {
        assert_eq!(prompt_text("abc ", 12345, 4).len(), 4);
        assert_eq!(prompt_text("abc ", 1, 0).len(), 1);
    }
}
