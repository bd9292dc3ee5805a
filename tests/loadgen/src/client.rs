//! Decides how one trace entry becomes one measured HTTP exchange: a streaming OpenAI
//! chat-completion request over a pooled hyper HTTP/1 client, timed to the first SSE data
//! event (TTFT) and to the end of the body (e2e), bounded by the client timeout.

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
use crate::workload::TraceEntry;

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
}

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
        }
    }

    /// The JSON request body for one entry.
    pub fn body(&self, e: &TraceEntry) -> String {
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

    /// Sends one request and measures it. `run_start` anchors `sent_us`; `scheduled_us` is the
    /// entry's own offset. Never fails: errors become the record's outcome.
    pub async fn send(&self, e: &TraceEntry, run_start: Instant, timeout: Duration) -> Record {
        let t0 = Instant::now();
        let mut rec = Record {
            id: e.id,
            tag: e.tag,
            prompt_tokens: e.prompt_tokens,
            max_tokens: e.max_tokens,
            scheduled_us: e.at_us,
            sent_us: t0.duration_since(run_start).as_micros() as u64,
            outcome: Outcome::TransportError,
            status: None,
            pod: None,
            ttft_ms: None,
            e2e_ms: None,
            output_tokens: 0,
            tokens_from_usage: false,
            error: None,
        };
        let mut sse = SseReader::new();
        let exchange = self.exchange(e, t0, &mut rec, &mut sse);
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
        rec
    }

    async fn exchange(
        &self,
        e: &TraceEntry,
        t0: Instant,
        rec: &mut Record,
        sse: &mut SseReader,
    ) -> Result<Outcome, String> {
        let mut req = Request::builder()
            .method(Method::POST)
            .uri(self.target.uri.clone())
            .header(CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(self.body(e))))
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
            at_us: 0,
            tag: Tag::Long,
            prompt_tokens: 4000,
            max_tokens: 123,
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

    #[test]
    fn tiny_prompts_are_not_empty() {
        assert_eq!(prompt_text("abc ", 12345, 4).len(), 4);
        assert_eq!(prompt_text("abc ", 1, 0).len(), 1);
    }
}
