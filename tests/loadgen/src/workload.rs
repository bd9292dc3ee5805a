//! Decides what each request asks for: seeded traces of (arrival, tag, prompt length, output
//! length). ShareGPT-like lengths are lognormal (the shape of the ShareGPT length histograms
//! used by vLLM's benchmark_serving), the head-of-line scenario adds a burst of long requests,
//! and traces round-trip through JSONL so several policies replay the exact same trace.
//!
//! Two chat workloads exercise prefix caching. `shared-prefix` is the shape of inference-perf's
//! `shared_prefix` data (llm-d's scheduling benchmarks, llm-d/llm-d
//! `guides/inference-scheduling/README.md` at 086f217): groups with one system prompt each,
//! users asking questions of their group; group popularity Zipf(α). `multi-turn` is sessions
//! whose every turn resends the whole conversation (each answer as received) plus a new
//! question after a think time; sessions arrive open loop, turns follow each other closed loop.
//! Their lines carry the text seeds and lengths (`group`, `system`, `question`, `turns`), so a
//! trace replays the same prompts under every policy; the older workloads' lines are unchanged.

use std::io::{BufRead, Write};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, LogNormal};
use serde::{Deserialize, Serialize};

use crate::schedule::{self, Arrival, Bounds, ScheduleError};
use crate::text::{self, MAX_GROUPS, MAX_IDS, MAX_TURNS, MAX_USERS, MIN_QUESTION_TOKENS};

/// Which class a request belongs to, so results can be split.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Tag {
    #[default]
    Short,
    Long,
}

impl Tag {
    pub fn as_str(self) -> &'static str {
        match self {
            Tag::Short => "short",
            Tag::Long => "long",
        }
    }
}

/// A generated text: its seed (pool offset) and its exact length in tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TextSpec {
    pub seed: u64,
    pub tokens: u32,
}

/// One turn of a multi-turn session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Turn {
    pub question: TextSpec,
    pub max_tokens: u32,
    /// Pause between the end of the previous turn's answer and this turn's send,
    /// microseconds (0 for the first turn, which leaves at the session's `at_us`).
    #[serde(default)]
    pub think_us: u64,
}

/// One line of a trace. `at_us` is the send offset from the run start.
///
/// Plain lines (`sharegpt`, `hol`, `fixed`) are one request with a synthetic prompt of about
/// `prompt_tokens` tokens. A `shared-prefix` line is one chat request: the system prompt of
/// `group` (`system`), then a question (`question`); `prompt_tokens` is its exact count under
/// the `ai-lb-prefix` chat template. A `multi-turn` line is a whole session: `turns` in order,
/// ids `id .. id + turns.len()`; `prompt_tokens`/`max_tokens` are its first turn's.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceEntry {
    pub id: u64,
    pub at_us: u64,
    pub tag: Tag,
    pub prompt_tokens: u32,
    pub max_tokens: u32,
    /// Shared-prefix group, or the multi-turn session's group (which shares `system`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<u32>,
    /// Shared-prefix user within the group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<u32>,
    /// Multi-turn session number.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<u64>,
    /// The group's system prompt (absent: no system message).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system: Option<TextSpec>,
    /// Shared-prefix question.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub question: Option<TextSpec>,
    /// Multi-turn session's turns.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub turns: Vec<Turn>,
}

/// What kind of line a trace entry is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryKind {
    Plain,
    Chat,
    Session,
}

impl TraceEntry {
    pub fn kind(&self) -> EntryKind {
        if !self.turns.is_empty() {
            EntryKind::Session
        } else if self.question.is_some() {
            EntryKind::Chat
        } else {
            EntryKind::Plain
        }
    }

    /// Requests this line stands for (a session's turns, else 1).
    pub fn requests(&self) -> usize {
        self.turns.len().max(1)
    }

    /// `max_tokens` of every request of this line.
    pub fn all_max_tokens(&self) -> impl Iterator<Item = u32> + '_ {
        let plain = self.turns.is_empty().then_some(self.max_tokens);
        plain
            .into_iter()
            .chain(self.turns.iter().map(|t| t.max_tokens))
    }
}

/// Leading prompt tokens of a chat whose first message is `system` (if any) up to and
/// including the first user message's role token: what requests of one group share.
pub fn system_prefix_tokens(system: Option<TextSpec>) -> u32 {
    system.map_or(0, |s| s.tokens + 2)
}

/// Prompt tokens of `[system?, user(question)]` under the chat template: role tokens, texts,
/// generation prompt.
pub fn first_prompt_tokens(system: Option<TextSpec>, question_tokens: u32) -> u32 {
    system.map_or(0, |s| 1 + s.tokens) + 1 + question_tokens + 1
}

/// A lognormal length distribution given by its (unclamped) mean and log-space sigma,
/// rounded and clamped to [min, max].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LengthDist {
    pub mean: f64,
    pub sigma: f64,
    pub min: u32,
    pub max: u32,
}

/// Think time between turns: lognormal of mean `mean_us` and log-space `sigma` (0 = fixed),
/// rounded and clamped to [min_us, max_us].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ThinkDist {
    pub mean_us: f64,
    pub sigma: f64,
    pub min_us: u64,
    pub max_us: u64,
}

/// The shared-prefix workload's parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SharedPrefix {
    pub groups: u32,
    /// Tokens of each group's system prompt (exact).
    pub system_tokens: u32,
    pub users_per_group: u32,
    pub question: LengthDist,
    /// `max_tokens`.
    pub answer: LengthDist,
    /// Zipf exponent of group popularity (0 = uniform).
    pub zipf: f64,
}

/// The multi-turn workload's parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MultiTurn {
    /// Session groups; sessions of one group share its system prompt.
    pub groups: u32,
    /// Tokens of each group's system prompt; 0 = no system message.
    pub system_tokens: u32,
    /// Turns per session, uniform in [min, max].
    pub turns_min: u32,
    pub turns_max: u32,
    pub question: LengthDist,
    pub answer: LengthDist,
    pub think: ThinkDist,
    /// Zipf exponent of session-group popularity (0 = uniform).
    pub zipf: f64,
}

/// The request mix.
#[derive(Debug, Clone, PartialEq)]
pub enum Workload {
    /// Every request `short`, lengths drawn from the two distributions.
    ShareGpt {
        prompt: LengthDist,
        output: LengthDist,
    },
    /// Every request `short`, fixed lengths.
    Fixed {
        prompt_tokens: u32,
        output_tokens: u32,
    },
    /// ShareGPT-like `short` traffic on the arrival schedule, plus a burst of `long` requests.
    HeadOfLine {
        prompt: LengthDist,
        output: LengthDist,
        burst: Burst,
    },
    /// Chat requests sharing their group's system prompt.
    SharedPrefix(SharedPrefix),
    /// Sessions of turns that resend the conversation (arrivals are session starts).
    MultiTurn(MultiTurn),
}

/// The long-request burst of the head-of-line scenario.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Burst {
    /// Burst start, microseconds from the run start.
    pub at_us: u64,
    pub count: u32,
    /// Long requests are spread uniformly over [at, at + spread).
    pub spread_us: u64,
    pub prompt_tokens: u32,
    pub output_tokens: u32,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum WorkloadError {
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    #[error("invalid value '{value}' for '{flag}': {reason}")]
    Invalid {
        flag: &'static str,
        value: String,
        reason: &'static str,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("trace line {line}: {reason}")]
    Line { line: usize, reason: String },
    #[error("trace: {0}")]
    Io(#[from] std::io::Error),
    #[error("trace is empty")]
    Empty,
}

// Independent random streams per concern, so that changing the length parameters does not
// move the arrivals and vice versa.
const STREAM_ARRIVALS: u64 = 1;
const STREAM_LENGTHS: u64 = 2;
const STREAM_BURST: u64 = 3;
const STREAM_GROUPS: u64 = 4;
const STREAM_TEXT: u64 = 5;
const STREAM_TURNS: u64 = 6;
const STREAM_THINK: u64 = 7;
/// Mixed into the seed for system prompts (group g's seed is `mix(seed ^ this, g)`).
const SYSTEM_SEED: u64 = 0x7379_7374_656d_0001;

fn rng(seed: u64, stream: u64) -> ChaCha8Rng {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    r.set_stream(stream);
    r
}

impl LengthDist {
    /// Checks parameters; `flag` is the prefix used in error messages (e.g. `--prompt`).
    pub fn validate(
        &self,
        mean_flag: &'static str,
        sigma_flag: &'static str,
        min_flag: &'static str,
    ) -> Result<(), WorkloadError> {
        if !(self.mean.is_finite() && self.mean >= 1.0) {
            return Err(WorkloadError::Invalid {
                flag: mean_flag,
                value: self.mean.to_string(),
                reason: "must be a finite number >= 1",
            });
        }
        if !(self.sigma.is_finite() && self.sigma >= 0.0 && self.sigma <= 4.0) {
            return Err(WorkloadError::Invalid {
                flag: sigma_flag,
                value: self.sigma.to_string(),
                reason: "must be in [0, 4]",
            });
        }
        if self.min == 0 || self.min > self.max {
            return Err(WorkloadError::Invalid {
                flag: min_flag,
                value: self.min.to_string(),
                reason: "must be >= 1 and <= the matching max",
            });
        }
        Ok(())
    }

    fn sampler(&self) -> Option<LogNormal<f64>> {
        // E[X] = exp(mu + sigma²/2)  =>  mu = ln(mean) - sigma²/2.
        let mu = self.mean.ln() - self.sigma * self.sigma / 2.0;
        LogNormal::new(mu, self.sigma).ok()
    }

    /// Draws `n` lengths.
    pub fn sample_n<R: Rng>(&self, rng: &mut R, n: usize) -> Vec<u32> {
        let Some(d) = self.sampler() else {
            return vec![self.clamp(self.mean); n];
        };
        (0..n).map(|_| self.clamp(d.sample(rng))).collect()
    }

    fn clamp(&self, x: f64) -> u32 {
        let x = if x.is_finite() {
            x.round()
        } else {
            self.max as f64
        };
        x.clamp(self.min as f64, self.max as f64) as u32
    }
}

/// Builds the trace for a run: arrivals from `arrival`/`rate`/`bounds`, lengths from `workload`,
/// all from `seed`. Ids are 0.. in send order.
pub fn generate(
    seed: u64,
    rate_per_s: f64,
    arrival: Arrival,
    bounds: Bounds,
    workload: &Workload,
) -> Result<Vec<TraceEntry>, WorkloadError> {
    let times = schedule::arrivals(&mut rng(seed, STREAM_ARRIVALS), rate_per_s, arrival, bounds)?;
    match workload {
        Workload::SharedPrefix(w) => return shared_prefix(seed, &times, w),
        Workload::MultiTurn(w) => return multi_turn(seed, &times, w),
        _ => {}
    }
    let mut lens = rng(seed, STREAM_LENGTHS);
    let n = times.len();
    let mut out: Vec<TraceEntry> = match workload {
        Workload::Fixed {
            prompt_tokens,
            output_tokens,
        } => {
            for (flag, v) in [
                ("--prompt-tokens", *prompt_tokens),
                ("--output-tokens", *output_tokens),
            ] {
                if v == 0 {
                    return Err(WorkloadError::Invalid {
                        flag,
                        value: "0".into(),
                        reason: "must be >= 1",
                    });
                }
            }
            times
                .iter()
                .map(|&at_us| TraceEntry {
                    at_us,
                    prompt_tokens: *prompt_tokens,
                    max_tokens: *output_tokens,
                    ..TraceEntry::default()
                })
                .collect()
        }
        Workload::SharedPrefix(_) | Workload::MultiTurn(_) => Vec::new(),
        Workload::ShareGpt { prompt, output } | Workload::HeadOfLine { prompt, output, .. } => {
            prompt.validate("--prompt-mean", "--prompt-sigma", "--prompt-min")?;
            output.validate("--output-mean", "--output-sigma", "--output-min")?;
            let p = prompt.sample_n(&mut lens, n);
            let o = output.sample_n(&mut lens, n);
            times
                .iter()
                .zip(p.iter().zip(o.iter()))
                .map(|(&at_us, (&prompt_tokens, &max_tokens))| TraceEntry {
                    at_us,
                    prompt_tokens,
                    max_tokens,
                    ..TraceEntry::default()
                })
                .collect()
        }
    };
    if let Workload::HeadOfLine { burst, .. } = workload {
        out.extend(burst_entries(seed, burst, bounds)?);
        out.sort_by_key(|e| e.at_us); // stable: ties keep short-before-long order
    }
    for (i, e) in out.iter_mut().enumerate() {
        e.id = i as u64;
    }
    Ok(out)
}

/// Group popularity: P(group i) ∝ 1 / (i + 1)^α, group 0 the most popular (α = 0: uniform).
/// Sampled by inverting the cumulative weights (binary search), exact for any α ≥ 0.
#[derive(Debug, Clone)]
pub struct Popularity {
    cdf: Vec<f64>,
}

impl Popularity {
    pub fn new(groups: u32, alpha: f64) -> Result<Self, WorkloadError> {
        if !(alpha.is_finite() && (0.0..=10.0).contains(&alpha)) {
            return Err(invalid("--zipf", alpha, "must be in [0, 10] (0 = uniform)"));
        }
        let mut acc = 0.0;
        let cdf = (1..=groups)
            .map(|i| {
                acc += (f64::from(i)).powf(-alpha);
                acc
            })
            .collect();
        Ok(Popularity { cdf })
    }

    pub fn sample<R: Rng>(&self, rng: &mut R) -> u32 {
        let total = self.cdf.last().copied().unwrap_or(0.0);
        let u = rng.random::<f64>() * total;
        let i = self.cdf.partition_point(|&c| c <= u);
        i.min(self.cdf.len().saturating_sub(1)) as u32
    }
}

fn invalid(flag: &'static str, value: impl ToString, reason: &'static str) -> WorkloadError {
    WorkloadError::Invalid {
        flag,
        value: value.to_string(),
        reason,
    }
}

impl ThinkDist {
    pub fn validate(&self) -> Result<(), WorkloadError> {
        if !(self.mean_us.is_finite() && self.mean_us >= 0.0) {
            return Err(invalid(
                "--think-mean",
                format!("{}ms", self.mean_us / 1000.0),
                "must be a duration >= 0",
            ));
        }
        if !(self.sigma.is_finite() && (0.0..=4.0).contains(&self.sigma)) {
            return Err(invalid("--think-sigma", self.sigma, "must be in [0, 4]"));
        }
        if self.min_us > self.max_us {
            return Err(invalid(
                "--think-min",
                format!("{}ms", self.min_us / 1000),
                "must be <= '--think-max'",
            ));
        }
        Ok(())
    }

    pub fn sample<R: Rng>(&self, rng: &mut R) -> u64 {
        let x = if self.mean_us <= 0.0 {
            0.0
        } else {
            let mu = self.mean_us.ln() - self.sigma * self.sigma / 2.0;
            match LogNormal::new(mu, self.sigma) {
                Ok(d) => d.sample(rng),
                Err(_) => self.mean_us,
            }
        };
        let x = if x.is_finite() {
            x.round()
        } else {
            self.max_us as f64
        };
        x.clamp(self.min_us as f64, self.max_us as f64) as u64
    }
}

/// Checks what the chat workloads share: groups, system prompt, question and answer lengths.
fn validate_chat(
    groups: u32,
    question: &LengthDist,
    answer: &LengthDist,
) -> Result<(), WorkloadError> {
    if groups == 0 || groups > MAX_GROUPS {
        return Err(invalid("--groups", groups, "must be in 1..=1000000"));
    }
    question.validate("--question-tokens", "--question-sigma", "--question-min")?;
    if question.min < MIN_QUESTION_TOKENS {
        return Err(invalid(
            "--question-min",
            question.min,
            "must be >= 8 (a question starts with the header that makes it unique)",
        ));
    }
    answer.validate("--answer-tokens", "--answer-sigma", "--answer-min")?;
    Ok(())
}

fn too_many(n: u64) -> Result<(), WorkloadError> {
    if n >= MAX_IDS {
        return Err(invalid(
            "--requests",
            n,
            "a chat trace holds fewer than 10^9 requests",
        ));
    }
    Ok(())
}

/// The seed of group `g`'s system prompt.
pub fn system_seed(seed: u64, group: u32) -> u64 {
    text::mix(seed ^ SYSTEM_SEED, u64::from(group))
}

fn shared_prefix(
    seed: u64,
    times: &[u64],
    w: &SharedPrefix,
) -> Result<Vec<TraceEntry>, WorkloadError> {
    validate_chat(w.groups, &w.question, &w.answer)?;
    if w.system_tokens == 0 {
        return Err(invalid(
            "--system-tokens",
            0,
            "must be >= 1 for the shared-prefix workload",
        ));
    }
    if w.users_per_group == 0 || w.users_per_group > MAX_USERS {
        return Err(invalid(
            "--users-per-group",
            w.users_per_group,
            "must be in 1..=1000000",
        ));
    }
    too_many(times.len() as u64)?;
    let pop = Popularity::new(w.groups, w.zipf)?;
    let n = times.len();
    let mut groups = rng(seed, STREAM_GROUPS);
    let mut lens = rng(seed, STREAM_LENGTHS);
    let mut texts = rng(seed, STREAM_TEXT);
    let q = w.question.sample_n(&mut lens, n);
    let a = w.answer.sample_n(&mut lens, n);
    Ok(times
        .iter()
        .enumerate()
        .map(|(i, &at_us)| {
            let group = pop.sample(&mut groups);
            let user = groups.random_range(0..w.users_per_group);
            let system = Some(TextSpec {
                seed: system_seed(seed, group),
                tokens: w.system_tokens,
            });
            let question = TextSpec {
                seed: texts.random(),
                tokens: q.get(i).copied().unwrap_or(w.question.min),
            };
            TraceEntry {
                id: i as u64,
                at_us,
                prompt_tokens: first_prompt_tokens(system, question.tokens),
                max_tokens: a.get(i).copied().unwrap_or(w.answer.min),
                group: Some(group),
                user: Some(user),
                system,
                question: Some(question),
                ..TraceEntry::default()
            }
        })
        .collect())
}

fn multi_turn(seed: u64, times: &[u64], w: &MultiTurn) -> Result<Vec<TraceEntry>, WorkloadError> {
    validate_chat(w.groups, &w.question, &w.answer)?;
    if w.turns_min == 0 || w.turns_min > w.turns_max || w.turns_max > MAX_TURNS {
        return Err(invalid(
            "--turns",
            format!("{}..{}", w.turns_min, w.turns_max),
            "must be N or A..B with 1 <= A <= B <= 1000",
        ));
    }
    w.think.validate()?;
    let pop = Popularity::new(w.groups, w.zipf)?;
    let mut groups = rng(seed, STREAM_GROUPS);
    let mut counts = rng(seed, STREAM_TURNS);
    let mut lens = rng(seed, STREAM_LENGTHS);
    let mut texts = rng(seed, STREAM_TEXT);
    let mut think = rng(seed, STREAM_THINK);
    let mut out = Vec::with_capacity(times.len());
    let mut next_id = 0u64;
    for (s, &at_us) in times.iter().enumerate() {
        let group = pop.sample(&mut groups);
        let system = (w.system_tokens > 0).then(|| TextSpec {
            seed: system_seed(seed, group),
            tokens: w.system_tokens,
        });
        let k = counts.random_range(w.turns_min..=w.turns_max);
        let turns: Vec<Turn> = (0..k)
            .map(|t| {
                let q = w.question.sample_n(&mut lens, 1);
                let a = w.answer.sample_n(&mut lens, 1);
                Turn {
                    question: TextSpec {
                        seed: texts.random(),
                        tokens: q.first().copied().unwrap_or(w.question.min),
                    },
                    max_tokens: a.first().copied().unwrap_or(w.answer.min),
                    think_us: if t == 0 {
                        0
                    } else {
                        w.think.sample(&mut think)
                    },
                }
            })
            .collect();
        let first = turns.first().copied().unwrap_or(Turn {
            question: TextSpec { seed: 0, tokens: 1 },
            max_tokens: 1,
            think_us: 0,
        });
        out.push(TraceEntry {
            id: next_id,
            at_us,
            prompt_tokens: first_prompt_tokens(system, first.question.tokens),
            max_tokens: first.max_tokens,
            group: Some(group),
            session: Some(s as u64),
            system,
            turns,
            ..TraceEntry::default()
        });
        next_id += u64::from(k);
        too_many(next_id)?;
    }
    Ok(out)
}

/// Checks the chat fields of a trace line (the plain fields are checked by the caller).
fn check_chat_line(e: &TraceEntry) -> Result<(), String> {
    if let Some(s) = e.system {
        if s.tokens == 0 {
            return Err("system.tokens must be >= 1".into());
        }
    }
    match e.kind() {
        EntryKind::Plain => {
            if e.system.is_some() || e.group.is_some() || e.user.is_some() || e.session.is_some() {
                return Err("group, user, session and system need a question or turns".into());
            }
        }
        EntryKind::Chat => {
            let (Some(q), Some(g)) = (e.question, e.group) else {
                return Err("a question needs a group".into());
            };
            if e.session.is_some() {
                return Err("a line has either a question or turns, not a session".into());
            }
            if q.tokens < MIN_QUESTION_TOKENS || g >= MAX_GROUPS || e.user.unwrap_or(0) >= MAX_USERS
            {
                return Err(format!(
                    "question.tokens ({}) must be >= 8, group ({g}) and user below 10^6",
                    q.tokens
                ));
            }
            if e.id >= MAX_IDS {
                return Err(format!("id {} must be below 10^9", e.id));
            }
            let want = first_prompt_tokens(e.system, q.tokens);
            if e.prompt_tokens != want {
                return Err(format!(
                    "prompt_tokens ({}) must be the chat template's count ({want})",
                    e.prompt_tokens
                ));
            }
        }
        EntryKind::Session => {
            if e.question.is_some() || e.user.is_some() {
                return Err("a session line has turns, not a question or user".into());
            }
            let Some(s) = e.session else {
                return Err("turns need a session".into());
            };
            if s >= MAX_IDS || e.id + e.turns.len() as u64 > MAX_IDS {
                return Err(format!("session {s} and ids must stay below 10^9"));
            }
            if e.turns.len() > MAX_TURNS as usize {
                return Err(format!("{} turns, at most 1000", e.turns.len()));
            }
            for (k, t) in e.turns.iter().enumerate() {
                if t.question.tokens < MIN_QUESTION_TOKENS || t.max_tokens == 0 {
                    return Err(format!(
                        "turn {}: question.tokens ({}) must be >= 8 and max_tokens ({}) >= 1",
                        k + 1,
                        t.question.tokens,
                        t.max_tokens
                    ));
                }
            }
            let first = e.turns.first().map(|t| (t.question.tokens, t.max_tokens));
            if let Some((q, m)) = first {
                let want = first_prompt_tokens(e.system, q);
                if e.prompt_tokens != want || e.max_tokens != m {
                    return Err(format!(
                        "prompt_tokens ({}) and max_tokens ({}) must be the first turn's ({want}, {m})",
                        e.prompt_tokens, e.max_tokens
                    ));
                }
            }
        }
    }
    Ok(())
}

fn burst_entries(seed: u64, b: &Burst, bounds: Bounds) -> Result<Vec<TraceEntry>, WorkloadError> {
    if let Some(d) = bounds.duration_us {
        if b.at_us >= d {
            return Err(WorkloadError::Invalid {
                flag: "--hol-at",
                value: format!("{}ms", b.at_us / 1000),
                reason: "the burst must start before '--duration' ends",
            });
        }
    }
    for (flag, v) in [
        ("--hol-count", b.count),
        ("--hol-prompt-tokens", b.prompt_tokens),
        ("--hol-output-tokens", b.output_tokens),
    ] {
        if v == 0 {
            return Err(WorkloadError::Invalid {
                flag,
                value: "0".into(),
                reason: "must be >= 1",
            });
        }
    }
    let mut r = rng(seed, STREAM_BURST);
    let mut offs: Vec<u64> = (0..b.count)
        .map(|_| {
            if b.spread_us == 0 {
                0
            } else {
                r.random_range(0..b.spread_us)
            }
        })
        .collect();
    offs.sort_unstable();
    Ok(offs
        .into_iter()
        .map(|o| TraceEntry {
            at_us: b.at_us + o,
            tag: Tag::Long,
            prompt_tokens: b.prompt_tokens,
            max_tokens: b.output_tokens,
            ..TraceEntry::default()
        })
        .collect())
}

/// Writes one JSON object per line.
pub fn write_trace<W: Write>(mut w: W, trace: &[TraceEntry]) -> std::io::Result<()> {
    for e in trace {
        serde_json::to_writer(&mut w, e)?;
        w.write_all(b"\n")?;
    }
    w.flush()
}

/// Reads a JSONL trace (blank lines skipped), validates it and returns it sorted by `at_us`.
pub fn read_trace<R: BufRead>(r: R) -> Result<Vec<TraceEntry>, TraceError> {
    let mut out = Vec::new();
    for (i, line) in r.lines().enumerate() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let e: TraceEntry = serde_json::from_str(&line).map_err(|err| TraceError::Line {
            line: i + 1,
            reason: err.to_string(),
        })?;
        if e.prompt_tokens == 0 || e.max_tokens == 0 {
            return Err(TraceError::Line {
                line: i + 1,
                reason: format!(
                    "prompt_tokens ({}) and max_tokens ({}) must be >= 1",
                    e.prompt_tokens, e.max_tokens
                ),
            });
        }
        check_chat_line(&e).map_err(|reason| TraceError::Line {
            line: i + 1,
            reason,
        })?;
        out.push(e);
    }
    if out.is_empty() {
        return Err(TraceError::Empty);
    }
    out.sort_by_key(|e| e.at_us);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PROMPT: LengthDist = LengthDist {
        mean: 250.0,
        sigma: 1.0,
        min: 4,
        max: 4096,
    };
    const OUTPUT: LengthDist = LengthDist {
        mean: 200.0,
        sigma: 1.0,
        min: 1,
        max: 2048,
    };
    const BOUNDS: Bounds = Bounds {
        duration_us: Some(60_000_000),
        max_requests: None,
    };

    fn sharegpt() -> Workload {
        Workload::ShareGpt {
            prompt: PROMPT,
            output: OUTPUT,
        }
    }

    #[test]
    fn same_seed_same_trace() {
        let a = generate(42, 50.0, Arrival::Poisson, BOUNDS, &sharegpt()).unwrap();
        let b = generate(42, 50.0, Arrival::Poisson, BOUNDS, &sharegpt()).unwrap();
        let c = generate(43, 50.0, Arrival::Poisson, BOUNDS, &sharegpt()).unwrap();
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!(a.iter().enumerate().all(|(i, e)| e.id == i as u64));
    }

    #[test]
    fn lengths_do_not_move_arrivals() {
        let a = generate(5, 50.0, Arrival::Poisson, BOUNDS, &sharegpt()).unwrap();
        let b = generate(
            5,
            50.0,
            Arrival::Poisson,
            BOUNDS,
            &Workload::Fixed {
                prompt_tokens: 10,
                output_tokens: 10,
            },
        )
        .unwrap();
        let ta: Vec<u64> = a.iter().map(|e| e.at_us).collect();
        let tb: Vec<u64> = b.iter().map(|e| e.at_us).collect();
        assert_eq!(ta, tb);
    }

    #[test]
    fn lognormal_mean_close_and_clamped() {
        let mut r = rng(9, STREAM_LENGTHS);
        let d = LengthDist {
            mean: 250.0,
            sigma: 0.8,
            min: 1,
            max: 1_000_000,
        };
        let v = d.sample_n(&mut r, 200_000);
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64;
        assert!((mean - 250.0).abs() / 250.0 < 0.02, "mean {mean}");
        let c = LengthDist {
            mean: 250.0,
            sigma: 1.5,
            min: 50,
            max: 300,
        };
        let v = c.sample_n(&mut r, 10_000);
        assert!(v.iter().all(|&x| (50..=300).contains(&x)));
        assert!(
            v.contains(&50) && v.contains(&300),
            "clamping must bite at sigma 1.5"
        );
    }

    #[test]
    fn hol_burst_is_long_tagged_and_placed() {
        let w = Workload::HeadOfLine {
            prompt: PROMPT,
            output: OUTPUT,
            burst: Burst {
                at_us: 5_000_000,
                count: 20,
                spread_us: 500_000,
                prompt_tokens: 4000,
                output_tokens: 1000,
            },
        };
        let t = generate(
            1,
            20.0,
            Arrival::Poisson,
            Bounds {
                duration_us: Some(10_000_000),
                max_requests: None,
            },
            &w,
        )
        .unwrap();
        let long: Vec<_> = t.iter().filter(|e| e.tag == Tag::Long).collect();
        assert_eq!(long.len(), 20);
        assert!(long
            .iter()
            .all(|e| (5_000_000..5_500_000).contains(&e.at_us)));
        assert!(long
            .iter()
            .all(|e| e.prompt_tokens == 4000 && e.max_tokens == 1000));
        let shorts_after = t
            .iter()
            .filter(|e| e.tag == Tag::Short && e.at_us > 5_500_000)
            .count();
        assert!(
            shorts_after > 0,
            "short traffic keeps flowing after the burst"
        );
        assert!(t.windows(2).all(|w| w[0].at_us <= w[1].at_us));
        assert!(t.iter().enumerate().all(|(i, e)| e.id == i as u64));
    }

    #[test]
    fn hol_burst_after_duration_is_rejected() {
        let w = Workload::HeadOfLine {
            prompt: PROMPT,
            output: OUTPUT,
            burst: Burst {
                at_us: 20_000_000,
                count: 1,
                spread_us: 0,
                prompt_tokens: 1,
                output_tokens: 1,
            },
        };
        let e = generate(
            1,
            1.0,
            Arrival::Poisson,
            Bounds {
                duration_us: Some(10_000_000),
                max_requests: None,
            },
            &w,
        )
        .unwrap_err();
        assert!(e.to_string().contains("--hol-at"), "{e}");
    }

    #[test]
    fn bad_length_params_name_the_flag() {
        let w = Workload::ShareGpt {
            prompt: LengthDist {
                min: 10,
                max: 5,
                ..PROMPT
            },
            output: OUTPUT,
        };
        let e = generate(1, 1.0, Arrival::Poisson, BOUNDS, &w).unwrap_err();
        assert!(
            e.to_string().contains("--prompt-min") && e.to_string().contains("'10'"),
            "{e}"
        );
    }

    #[test]
    fn trace_round_trips_through_jsonl() {
        let t = generate(3, 100.0, Arrival::Gamma { cv: 3.0 }, BOUNDS, &sharegpt()).unwrap();
        let mut buf = Vec::new();
        write_trace(&mut buf, &t).unwrap();
        let back = read_trace(&buf[..]).unwrap();
        assert_eq!(t, back);
    }

    fn shared(zipf: f64) -> Workload {
        Workload::SharedPrefix(SharedPrefix {
            groups: 10,
            system_tokens: 300,
            users_per_group: 4,
            question: LengthDist {
                mean: 60.0,
                sigma: 0.3,
                min: 8,
                max: 200,
            },
            answer: LengthDist {
                mean: 50.0,
                sigma: 0.0,
                min: 1,
                max: 100,
            },
            zipf,
        })
    }

    fn multi(turns: (u32, u32), system_tokens: u32) -> Workload {
        Workload::MultiTurn(MultiTurn {
            groups: 3,
            system_tokens,
            turns_min: turns.0,
            turns_max: turns.1,
            question: LengthDist {
                mean: 40.0,
                sigma: 0.5,
                min: 8,
                max: 400,
            },
            answer: LengthDist {
                mean: 30.0,
                sigma: 0.0,
                min: 1,
                max: 100,
            },
            think: ThinkDist {
                mean_us: 500_000.0,
                sigma: 1.0,
                min_us: 100_000,
                max_us: 2_000_000,
            },
            zipf: 0.0,
        })
    }

    #[test]
    fn shared_prefix_trace_is_seeded_and_counts_the_template_exactly() {
        let a = generate(4, 50.0, Arrival::Poisson, BOUNDS, &shared(0.0)).unwrap();
        assert_eq!(
            a,
            generate(4, 50.0, Arrival::Poisson, BOUNDS, &shared(0.0)).unwrap()
        );
        assert_ne!(
            a,
            generate(5, 50.0, Arrival::Poisson, BOUNDS, &shared(0.0)).unwrap()
        );
        for (i, e) in a.iter().enumerate() {
            let (g, q, sys) = (e.group.unwrap(), e.question.unwrap(), e.system.unwrap());
            assert_eq!(e.id, i as u64);
            assert_eq!(e.kind(), EntryKind::Chat);
            assert!(g < 10 && e.user.unwrap() < 4);
            assert_eq!(
                sys,
                TextSpec {
                    seed: system_seed(4, g),
                    tokens: 300
                }
            );
            assert!((8..=200).contains(&q.tokens));
            assert_eq!(e.max_tokens, 50);
            assert_eq!(e.prompt_tokens, 1 + 300 + 1 + q.tokens + 1);
        }
        let groups: std::collections::BTreeSet<u32> = a.iter().map(|e| e.group.unwrap()).collect();
        assert_eq!(groups.len(), 10, "3000 requests reach every group");
        // Lengths and groups do not move arrivals.
        let plain = generate(4, 50.0, Arrival::Poisson, BOUNDS, &sharegpt()).unwrap();
        assert!(a.iter().zip(&plain).all(|(x, y)| x.at_us == y.at_us));
    }

    #[test]
    fn zipf_popularity_follows_the_power_law() {
        let mut r = rng(1, STREAM_GROUPS);
        let count = |alpha: f64, r: &mut ChaCha8Rng| {
            let p = Popularity::new(5, alpha).unwrap();
            let mut c = [0u32; 5];
            for _ in 0..200_000 {
                c[p.sample(r) as usize] += 1;
            }
            c
        };
        let u = count(0.0, &mut r);
        assert!(u.iter().all(|&n| (38_000..42_000).contains(&n)), "{u:?}");
        let z = count(1.0, &mut r);
        // P(i) ∝ 1/(i+1): group 0 twice as popular as group 1, five times group 4.
        let ratio = |a: u32, b: u32| f64::from(a) / f64::from(b);
        assert!((ratio(z[0], z[1]) - 2.0).abs() < 0.05, "{z:?}");
        assert!((ratio(z[0], z[4]) - 5.0).abs() < 0.2, "{z:?}");
        for bad in [-0.1, f64::NAN, 11.0] {
            let e = Popularity::new(5, bad).unwrap_err().to_string();
            assert!(e.contains("--zipf"), "{e}");
        }
    }

    #[test]
    fn multi_turn_sessions_carry_their_turns_and_think_times() {
        let t = generate(2, 5.0, Arrival::Poisson, BOUNDS, &multi((2, 5), 100)).unwrap();
        assert_eq!(
            t,
            generate(2, 5.0, Arrival::Poisson, BOUNDS, &multi((2, 5), 100)).unwrap()
        );
        let mut next = 0;
        let mut seen = std::collections::BTreeSet::new();
        for (s, e) in t.iter().enumerate() {
            assert_eq!(e.kind(), EntryKind::Session);
            assert_eq!((e.id, e.session), (next, Some(s as u64)));
            next += e.turns.len() as u64;
            seen.insert(e.turns.len());
            assert_eq!(e.turns[0].think_us, 0);
            assert!(e.turns[1..]
                .iter()
                .all(|x| (100_000..=2_000_000).contains(&x.think_us)));
            assert!(e
                .turns
                .iter()
                .all(|x| x.max_tokens == 30 && x.question.tokens >= 8));
            let q = e.turns[0].question.tokens;
            assert_eq!(e.prompt_tokens, 1 + 100 + 1 + q + 1);
            assert_eq!(e.system.unwrap().seed, system_seed(2, e.group.unwrap()));
        }
        assert_eq!(seen.into_iter().collect::<Vec<_>>(), vec![2, 3, 4, 5]);
        let no_system = generate(2, 5.0, Arrival::Poisson, BOUNDS, &multi((3, 3), 0)).unwrap();
        assert!(no_system
            .iter()
            .all(|e| e.system.is_none() && e.turns.len() == 3));
        assert_eq!(
            no_system[0].prompt_tokens,
            no_system[0].turns[0].question.tokens + 2
        );
    }

    #[test]
    fn chat_parameters_name_their_flag() {
        let cases: Vec<(Workload, &str)> = vec![
            (
                Workload::SharedPrefix(SharedPrefix {
                    system_tokens: 0,
                    ..match shared(0.0) {
                        Workload::SharedPrefix(w) => w,
                        _ => unreachable!(),
                    }
                }),
                "--system-tokens",
            ),
            (
                Workload::SharedPrefix(SharedPrefix {
                    groups: 0,
                    ..match shared(0.0) {
                        Workload::SharedPrefix(w) => w,
                        _ => unreachable!(),
                    }
                }),
                "--groups",
            ),
            (multi((0, 2), 0), "--turns"),
            (shared(-1.0), "--zipf"),
        ];
        for (w, flag) in cases {
            let e = generate(1, 5.0, Arrival::Poisson, BOUNDS, &w)
                .unwrap_err()
                .to_string();
            assert!(e.contains(flag), "{flag}: {e}");
        }
        let Workload::MultiTurn(mut m) = multi((2, 2), 0) else {
            unreachable!()
        };
        m.think.min_us = 3_000_000;
        let e = generate(1, 5.0, Arrival::Poisson, BOUNDS, &Workload::MultiTurn(m))
            .unwrap_err()
            .to_string();
        assert!(e.contains("--think-min") && e.contains("3000ms"), "{e}");
    }

    #[test]
    fn chat_traces_round_trip_and_bad_chat_lines_are_named() {
        for w in [shared(1.0), multi((1, 4), 50)] {
            let t = generate(3, 20.0, Arrival::Poisson, BOUNDS, &w).unwrap();
            let mut buf = Vec::new();
            write_trace(&mut buf, &t).unwrap();
            assert_eq!(read_trace(&buf[..]).unwrap(), t);
        }
        let ok = r#"{"id":0,"at_us":1,"tag":"short","prompt_tokens":13,"max_tokens":5,"group":0,"user":0,"question":{"seed":1,"tokens":11}}"#;
        assert!(read_trace(ok.as_bytes()).is_ok());
        for (line, says) in [
            (ok.replace("\"tokens\":11", "\"tokens\":4").replace(":13,", ":6,"), ">= 8"),
            (ok.replace(":13,", ":14,"), "chat template"),
            (ok.replace(",\"group\":0", ""), "needs a group"),
            (
                r#"{"id":0,"at_us":1,"tag":"short","prompt_tokens":12,"max_tokens":5,"group":0,"session":1,"turns":[{"question":{"seed":1,"tokens":10},"max_tokens":6}]}"#.to_string(),
                "first turn",
            ),
            (
                r#"{"id":0,"at_us":1,"tag":"short","prompt_tokens":5,"max_tokens":5,"group":2}"#.to_string(),
                "need a question",
            ),
        ] {
            let e = read_trace(format!("{ok}\n{line}\n").as_bytes()).unwrap_err().to_string();
            assert!(e.starts_with("trace line 2") && e.contains(says), "{says}: {e}");
        }
    }

    #[test]
    fn bad_trace_line_is_named() {
        let text = "{\"id\":0,\"at_us\":1,\"tag\":\"short\",\"prompt_tokens\":5,\"max_tokens\":5}\n\
                    {\"id\":1,\"at_us\":2,\"tag\":\"medium\",\"prompt_tokens\":5,\"max_tokens\":5}\n";
        let e = read_trace(text.as_bytes()).unwrap_err();
        assert!(e.to_string().starts_with("trace line 2"), "{e}");
        let zero = "{\"id\":0,\"at_us\":1,\"tag\":\"long\",\"prompt_tokens\":0,\"max_tokens\":5}\n";
        assert!(read_trace(zero.as_bytes())
            .unwrap_err()
            .to_string()
            .contains("line 1"));
        assert!(matches!(
            read_trace("\n".as_bytes()),
            Err(TraceError::Empty)
        ));
    }
}
