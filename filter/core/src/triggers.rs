//! The document's extra pod-breaker triggers (issue 30, part 3), both off unless configured:
//!
//! - `breaker.truncation`: a pod whose answers are cut off while it runs out of GPU memory is
//!   cut. Each answer of the chosen pod is classified ([`AnswerScanner`], SSE or plain JSON):
//!   *complete* (a choice carried a `finish_reason`), *truncated* (a 2xx answer that ended with
//!   no finish reason, with fewer completion tokens than the request's `max_tokens` when both
//!   are known), a *memory error* (a 5xx whose body names CUDA out-of-memory, as vLLM answers
//!   `torch.OutOfMemoryError` / `CUDA out of memory`), another error, or not judged. The pod's
//!   **GPU memory-error rate** is the share of memory errors among the answers this worker saw
//!   from it over `breaker.failureRateWindowMs` (two half-window buckets, like the failure
//!   rate). It is read off the answers rather than the agent's ECC counters because an ECC
//!   error already opens the breaker at once (`hardware_fault`), while an out-of-memory answer
//!   is what a pod under memory pressure shows its clients, and the fake pod (like vLLM) can
//!   be made to answer it end to end. [`TruncationTracker`] opens the breaker
//!   ([`crate::breaker::TripReason::Truncated`]) once `consecutiveTruncated` answers in a row
//!   were truncated **while** that rate is above `memoryErrorRate`. A complete answer ends the
//!   run; an error is not a generation and leaves it as it is.
//! - `breaker.wellFormedProbes`: a half-open pod closes only after that many probes in a row
//!   passed *and* answered well-formed OpenAI JSON (non-streamed: an object with a `choices`
//!   array; streamed: every `data:` line such an object and a final `data: [DONE]`); a probe
//!   that answered anything else counts as a failure and re-opens the pod. The probe's verdict
//!   then waits for its answer's end instead of its first byte.
//!
//! Memory: one SSE line (at most [`MAX_LINE_BYTES`]) or, for a plain JSON answer, the body up
//! to [`MAX_BODY_BYTES`]; an answer over that is not judged (it counts as neither truncated nor
//! malformed: the breaker behaves as without the option).

use serde::Deserialize;
use serde_json::Value;

use crate::error::ConfigError;

/// Longest SSE line judged; a longer one leaves the answer unjudged.
pub const MAX_LINE_BYTES: usize = 64 * 1024;
/// Longest plain JSON body judged.
pub const MAX_BODY_BYTES: usize = 256 * 1024;
/// Bytes of an error body searched for a memory error.
const ERROR_SCAN_BYTES: usize = 4096;

/// The validated `breaker.truncation`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Truncation {
    /// Truncated answers in a row that open the breaker (with the memory-error rate above).
    pub consecutive_truncated: u32,
    /// The GPU memory-error rate the pod must exceed (strictly) for truncations to count.
    pub memory_error_rate: f64,
}

impl Default for Truncation {
    fn default() -> Self {
        Self {
            consecutive_truncated: 3,
            memory_error_rate: 0.15,
        }
    }
}

/// `breaker.truncation` as written; present (an object, even `{}`) turns it on.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "Truncation")
)]
pub struct RawTruncation {
    /// Answers in a row cut off (no finish reason, fewer tokens than the request's `max_tokens`
    /// when known) that open the breaker, while the pod's GPU memory-error rate is above
    /// `memoryErrorRate`.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 3, "minimum" = 1, "maximum" = 1000))
    )]
    pub consecutive_truncated: Option<u64>,
    /// The pod's GPU memory-error rate (the share of its answers this Envoy worker saw over
    /// `failureRateWindowMs` that were a 5xx naming CUDA out-of-memory, as vLLM answers one)
    /// above which its truncated answers count.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 0.15, "minimum" = 0, "exclusiveMaximum" = 1))
    )]
    pub memory_error_rate: Option<f64>,
}

impl Truncation {
    pub fn from_raw(raw: &RawTruncation) -> Result<Self, ConfigError> {
        let d = Self::default();
        let consecutive_truncated = match raw.consecutive_truncated {
            None => d.consecutive_truncated,
            Some(x) if (1..=1000).contains(&x) => x as u32,
            Some(x) => {
                return Err(ConfigError::new(
                    "breaker.truncation.consecutiveTruncated",
                    x,
                    "must be within 1..=1000",
                ))
            }
        };
        let memory_error_rate = match raw.memory_error_rate {
            None => d.memory_error_rate,
            Some(x) if x.is_finite() && (0.0..1.0).contains(&x) => x,
            Some(x) => {
                return Err(ConfigError::new(
                    "breaker.truncation.memoryErrorRate",
                    x,
                    "must be within [0, 1): the rate must be exceeded",
                ))
            }
        };
        Ok(Self {
            consecutive_truncated,
            memory_error_rate,
        })
    }
}

/// `breaker.wellFormedProbes` validated: 1..=250.
pub fn well_formed_probes_from_raw(v: Option<u64>) -> Result<Option<u32>, ConfigError> {
    match v {
        None => Ok(None),
        Some(x) if (1..=250).contains(&x) => Ok(Some(x as u32)),
        Some(x) => Err(ConfigError::new(
            "breaker.wellFormedProbes",
            x,
            "must be within 1..=250",
        )),
    }
}

/// How one answer ended (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    Complete,
    Truncated,
    MemoryError,
    /// Another 5xx.
    Error,
    /// Not judged (4xx, no status).
    Unknown,
    /// A 2xx answer too large to judge ([`MAX_LINE_BYTES`], [`MAX_BODY_BYTES`]).
    Unjudged,
}

/// Reads one answer as it streams (fed in arbitrary chunks) and classifies it at its end.
#[derive(Debug, Clone, Default)]
pub struct AnswerScanner {
    status: Option<u16>,
    /// Whether the body is SSE (`data:` lines), decided by its first non-blank byte.
    sse: Option<bool>,
    line: Vec<u8>,
    body: Vec<u8>,
    /// The answer grew past what is judged.
    overflow: bool,
    finished: bool,
    done: bool,
    /// A `data:` line after `[DONE]`, or one that is not OpenAI-shaped JSON.
    malformed: bool,
    /// SSE events with a choice (each carries at least one token).
    chunks: u64,
    completion_tokens: Option<u64>,
}

fn has_choices(v: &Value) -> bool {
    v.get("choices").is_some_and(Value::is_array)
}

fn finish_in(v: &Value) -> bool {
    v.get("choices")
        .and_then(Value::as_array)
        .is_some_and(|cs| {
            cs.iter()
                .any(|c| c.get("finish_reason").is_some_and(|f| !f.is_null()))
        })
}

fn completion_tokens(v: &Value) -> Option<u64> {
    v.get("usage")?.get("completion_tokens")?.as_u64()
}

fn names_memory_error(body: &[u8]) -> bool {
    let text = String::from_utf8_lossy(body).to_ascii_lowercase();
    text.contains("out of memory") || text.contains("outofmemoryerror")
}

impl AnswerScanner {
    /// A scanner for an answer with HTTP status `status` (None: not known yet).
    pub fn new(status: Option<u16>) -> Self {
        Self {
            status,
            ..Self::default()
        }
    }

    pub fn set_status(&mut self, status: Option<u16>) {
        self.status = status;
    }

    fn is_error(&self) -> bool {
        self.status.is_some_and(|s| s >= 500)
    }

    pub fn feed(&mut self, chunk: &[u8]) {
        if self.overflow {
            return;
        }
        if self.is_error() {
            let room = ERROR_SCAN_BYTES.saturating_sub(self.body.len());
            self.body
                .extend_from_slice(chunk.get(..room.min(chunk.len())).unwrap_or_default());
            return;
        }
        if self.sse.is_none() {
            if let Some(c) = chunk.iter().find(|c| !c.is_ascii_whitespace()) {
                self.sse = Some(*c != b'{' && *c != b'[');
            }
        }
        match self.sse {
            Some(true) => {
                for &c in chunk {
                    if c == b'\n' {
                        let line = std::mem::take(&mut self.line);
                        self.sse_line(&line);
                    } else if self.line.len() >= MAX_LINE_BYTES {
                        self.overflow = true;
                        self.line = Vec::new();
                        return;
                    } else {
                        self.line.push(c);
                    }
                }
            }
            _ => {
                if self.body.len().saturating_add(chunk.len()) > MAX_BODY_BYTES {
                    self.overflow = true;
                    self.body = Vec::new();
                } else {
                    self.body.extend_from_slice(chunk);
                }
            }
        }
    }

    fn sse_line(&mut self, line: &[u8]) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(data) = line.strip_prefix(b"data:") else {
            // Blank lines separate events; `event:`, `id:` and comments carry no answer.
            return;
        };
        let data = data.strip_prefix(b" ").unwrap_or(data);
        if self.done {
            self.malformed = true;
            return;
        }
        if data == b"[DONE]" {
            self.done = true;
            return;
        }
        match serde_json::from_slice::<Value>(data) {
            Ok(v) if has_choices(&v) => {
                if v.get("choices")
                    .and_then(Value::as_array)
                    .is_some_and(|c| !c.is_empty())
                {
                    self.chunks = self.chunks.saturating_add(1);
                }
                self.finished |= finish_in(&v);
                if let Some(t) = completion_tokens(&v) {
                    self.completion_tokens = Some(t);
                }
            }
            _ => self.malformed = true,
        }
    }

    /// The answer ended: how (`max_tokens`: the request's output limit, when known).
    pub fn classify(&self, max_tokens: Option<u64>) -> Answer {
        let Some(status) = self.status else {
            return Answer::Unknown;
        };
        if status >= 500 {
            return if names_memory_error(&self.body) {
                Answer::MemoryError
            } else {
                Answer::Error
            };
        }
        if !(200..300).contains(&status) {
            return Answer::Unknown;
        }
        if self.overflow {
            return Answer::Unjudged;
        }
        let (finished, tokens) = match self.sse {
            Some(true) => (
                self.finished,
                Some(self.completion_tokens.unwrap_or(0).max(self.chunks)),
            ),
            // An empty body, or a plain JSON body: parsed whole.
            _ => match serde_json::from_slice::<Value>(&self.body) {
                Ok(v) => (finish_in(&v), completion_tokens(&v)),
                Err(_) => (false, None),
            },
        };
        if finished {
            return Answer::Complete;
        }
        match (tokens, max_tokens) {
            (Some(t), Some(m)) if t >= m => Answer::Complete,
            _ => Answer::Truncated,
        }
    }

    /// Whether the (ended) answer is well-formed OpenAI JSON (see the module doc). An answer
    /// too large to judge counts as well-formed (the breaker behaves as without the option).
    pub fn well_formed(&self) -> bool {
        if self.overflow {
            return true;
        }
        if self.is_error() {
            return false;
        }
        match self.sse {
            Some(true) => {
                // A last line without its newline.
                let mut s = self.clone();
                if !s.line.is_empty() {
                    let line = std::mem::take(&mut s.line);
                    s.sse_line(&line);
                }
                !s.malformed && s.done && s.chunks > 0
            }
            _ => serde_json::from_slice::<Value>(&self.body)
                .ok()
                .is_some_and(|v| v.is_object() && has_choices(&v)),
        }
    }
}

/// What one answer did to a pod's [`TruncationTracker`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TruncationStep {
    /// The breaker must open (`Truncated`).
    pub trip: bool,
    /// A truncated answer that did not count, the pod's memory-error rate being at or below
    /// the threshold.
    pub ignored: bool,
}

/// One pod's truncation run and GPU memory-error rate, as one worker saw its answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TruncationTracker {
    run: u32,
    start_ms: u64,
    /// (answers, memory errors) of the current and the previous half-window.
    cur: (u32, u32),
    prev: (u32, u32),
}

impl TruncationTracker {
    /// The memory-error rate over the window (0 with no answers).
    pub fn memory_error_rate(&self) -> f64 {
        let n = u64::from(self.cur.0) + u64::from(self.prev.0);
        let e = u64::from(self.cur.1) + u64::from(self.prev.1);
        if n == 0 {
            0.0
        } else {
            e as f64 / n as f64
        }
    }

    pub fn run(&self) -> u32 {
        self.run
    }

    /// Records one answer at `now_ms` (`window_ms`: `failureRateWindowMs`).
    pub fn record(
        &mut self,
        answer: Answer,
        now_ms: u64,
        window_ms: u64,
        cfg: &Truncation,
    ) -> TruncationStep {
        let none = TruncationStep {
            trip: false,
            ignored: false,
        };
        if matches!(answer, Answer::Unknown | Answer::Unjudged) {
            return none;
        }
        let half = (window_ms / 2).max(1);
        let since = now_ms.saturating_sub(self.start_ms);
        if since >= 2 * half {
            self.prev = (0, 0);
            self.cur = (0, 0);
            self.start_ms = now_ms;
        } else if since >= half {
            self.prev = self.cur;
            self.cur = (0, 0);
            self.start_ms = self.start_ms.saturating_add(half);
        }
        self.cur.0 = self.cur.0.saturating_add(1);
        match answer {
            Answer::MemoryError => {
                self.cur.1 = self.cur.1.saturating_add(1);
                none
            }
            Answer::Error | Answer::Unknown | Answer::Unjudged => none,
            Answer::Complete => {
                self.run = 0;
                none
            }
            Answer::Truncated => {
                if self.memory_error_rate() > cfg.memory_error_rate {
                    self.run = self.run.saturating_add(1);
                    if self.run >= cfg.consecutive_truncated {
                        *self = TruncationTracker {
                            start_ms: now_ms,
                            ..TruncationTracker::default()
                        };
                        return TruncationStep {
                            trip: true,
                            ignored: false,
                        };
                    }
                    none
                } else {
                    // Not the memory-starved pod the trigger is about: the run starts over.
                    self.run = 0;
                    TruncationStep {
                        trip: false,
                        ignored: true,
                    }
                }
            }
        }
    }
}
