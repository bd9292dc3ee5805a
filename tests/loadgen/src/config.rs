//! Decides which flags exist, their defaults and what counts as a valid value; invalid values
//! are rejected with the flag and the value named (exit status 2).

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use hyper::header::{HeaderName, HeaderValue};
use hyper::Uri;

use crate::client::{Target, CHAT_PATH};
use crate::schedule::{Arrival, Bounds};
use crate::workload::{Burst, LengthDist, MultiTurn, SharedPrefix, ThinkDist, Workload};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ArrivalKind {
    Poisson,
    Gamma,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum WorkloadKind {
    Sharegpt,
    Hol,
    Fixed,
    /// Groups sharing a system prompt (inference-perf's `shared_prefix` shape).
    SharedPrefix,
    /// Sessions resending the whole conversation every turn.
    MultiTurn,
}

/// Open-loop load generator for OpenAI-compatible streaming endpoints.
#[derive(Debug, Clone, Parser)]
#[command(name = "ai-lb-loadgen", version, about)]
pub struct Cli {
    /// Base URL (http only); `/v1/chat/completions` is appended unless already present.
    #[arg(long, default_value = "http://127.0.0.1:10000", value_parser = parse_url)]
    pub url: Uri,
    /// `model` field of every request.
    #[arg(long, default_value = "meta-llama/Llama-3.1-8B-Instruct")]
    pub model: String,
    /// Mean arrival rate, requests per second.
    #[arg(long, default_value_t = 10.0, value_parser = positive_f64, allow_negative_numbers = true)]
    pub rate: f64,
    /// Schedule length (e.g. 30s, 500ms, 2m; bare number = seconds). Default 10s when
    /// --requests is not given either.
    #[arg(long, value_parser = parse_duration, allow_negative_numbers = true)]
    pub duration: Option<Duration>,
    /// Number of scheduled requests (with --duration: whichever ends first).
    #[arg(long, value_parser = positive_u64, allow_negative_numbers = true)]
    pub requests: Option<u64>,
    /// Inter-arrival process.
    #[arg(long, value_enum, default_value = "poisson")]
    pub arrival: ArrivalKind,
    /// Coefficient of variation of gamma inter-arrivals (1 = Poisson-like, 3 = bursty).
    #[arg(long, default_value_t = 3.0, value_parser = positive_f64, allow_negative_numbers = true)]
    pub cv: f64,
    /// Request mix.
    #[arg(long, value_enum, default_value = "sharegpt")]
    pub workload: WorkloadKind,
    /// Seed of arrivals and lengths.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,

    /// Lognormal prompt length: mean tokens (before clamping).
    #[arg(long, default_value_t = 250.0, allow_negative_numbers = true)]
    pub prompt_mean: f64,
    /// Lognormal prompt length: sigma of ln(tokens).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub prompt_sigma: f64,
    #[arg(long, default_value_t = 4)]
    pub prompt_min: u32,
    #[arg(long, default_value_t = 4096)]
    pub prompt_max: u32,
    /// Lognormal output length (max_tokens): mean tokens (before clamping).
    #[arg(long, default_value_t = 200.0, allow_negative_numbers = true)]
    pub output_mean: f64,
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub output_sigma: f64,
    #[arg(long, default_value_t = 1)]
    pub output_min: u32,
    #[arg(long, default_value_t = 2048)]
    pub output_max: u32,
    /// Fixed workload: prompt tokens.
    #[arg(long, default_value_t = 250)]
    pub prompt_tokens: u32,
    /// Fixed workload: output tokens.
    #[arg(long, default_value_t = 200)]
    pub output_tokens: u32,

    /// Head-of-line workload: when the long burst starts.
    #[arg(long, default_value = "5s", value_parser = parse_offset)]
    pub hol_at: Duration,
    /// Head-of-line workload: long requests in the burst.
    #[arg(long, default_value_t = 16)]
    pub hol_count: u32,
    /// Head-of-line workload: the burst is spread uniformly over this window.
    #[arg(long, default_value = "500ms", value_parser = parse_offset)]
    pub hol_spread: Duration,
    #[arg(long, default_value_t = 4000)]
    pub hol_prompt_tokens: u32,
    #[arg(long, default_value_t = 1000)]
    pub hol_output_tokens: u32,

    /// Shared-prefix / multi-turn: groups (each with its own system prompt; multi-turn:
    /// session groups).
    #[arg(long, default_value_t = 40)]
    pub groups: u32,
    /// Shared-prefix / multi-turn: tokens of each group's system prompt, exact (multi-turn:
    /// 0 = no system message).
    #[arg(long, default_value_t = 900)]
    pub system_tokens: u32,
    /// Shared-prefix: users per group (each request names one, uniformly drawn).
    #[arg(long, default_value_t = 5)]
    pub users_per_group: u32,
    /// Shared-prefix / multi-turn: lognormal question length, mean tokens (before clamping).
    #[arg(long, default_value_t = 180.0, allow_negative_numbers = true)]
    pub question_tokens: f64,
    #[arg(long, default_value_t = 0.3, allow_negative_numbers = true)]
    pub question_sigma: f64,
    /// At least 8 (a question starts with the header that makes it unique).
    #[arg(long, default_value_t = 8)]
    pub question_min: u32,
    #[arg(long, default_value_t = 4096)]
    pub question_max: u32,
    /// Shared-prefix / multi-turn: answer length (`max_tokens`), lognormal mean; sigma 0 =
    /// exactly this.
    #[arg(long, default_value_t = 150.0, allow_negative_numbers = true)]
    pub answer_tokens: f64,
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub answer_sigma: f64,
    #[arg(long, default_value_t = 1)]
    pub answer_min: u32,
    #[arg(long, default_value_t = 2048)]
    pub answer_max: u32,
    /// Shared-prefix / multi-turn: Zipf exponent of group popularity (0 = uniform).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub zipf: f64,
    /// Multi-turn: turns per session, `N` or uniform `A..B`.
    #[arg(long, default_value = "2..8", value_parser = parse_turns)]
    pub turns: (u32, u32),
    /// Multi-turn: think time between an answer's end and the next turn (lognormal mean).
    #[arg(long, default_value = "2s", value_parser = parse_offset)]
    pub think_mean: Duration,
    /// Multi-turn: sigma of ln(think time); 0 = always the mean.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub think_sigma: f64,
    #[arg(long, default_value = "0s", value_parser = parse_offset)]
    pub think_min: Duration,
    #[arg(long, default_value = "30s", value_parser = parse_offset)]
    pub think_max: Duration,

    /// Client timeout per request (connect to end of body).
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub timeout: Duration,
    /// Safety cap on requests in flight; arrivals beyond it are skipped and counted.
    #[arg(long, default_value_t = 10_000, value_parser = positive_usize, allow_negative_numbers = true)]
    pub max_in_flight: usize,
    /// Extra request header `Name: value` (repeatable).
    #[arg(long = "header", value_parser = parse_header)]
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// Do not send `"ignore_eos": true` (sent by default so servers generate max_tokens).
    #[arg(long)]
    pub no_ignore_eos: bool,
    /// Closed loop instead of open loop: this many workers each send the next trace entry as
    /// soon as their previous request ended, ignoring arrival times, until the trace's span has
    /// passed or its entries run out (maximum-throughput probes).
    #[arg(long, value_parser = positive_usize, allow_negative_numbers = true)]
    pub closed_loop: Option<usize>,
    /// Runtime worker threads (1 = single-threaded runtime).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub threads: u16,

    /// Write the trace (JSONL) before running.
    #[arg(long)]
    pub trace_out: Option<PathBuf>,
    /// Replay this trace (JSONL) instead of generating one; arrival/workload flags are ignored.
    #[arg(long, conflicts_with = "trace_out")]
    pub trace_in: Option<PathBuf>,
    /// Write the summary as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write one JSON record per request (JSONL).
    #[arg(long)]
    pub records: Option<PathBuf>,
    /// Print a refreshing per-pod table every second.
    #[arg(long)]
    pub live: bool,
    /// Build (and write) the trace, print its shape, send nothing.
    #[arg(long)]
    pub dry_run: bool,
}

impl Cli {
    pub fn arrival(&self) -> Arrival {
        match self.arrival {
            ArrivalKind::Poisson => Arrival::Poisson,
            ArrivalKind::Gamma => Arrival::Gamma { cv: self.cv },
        }
    }

    pub fn bounds(&self) -> Bounds {
        let duration = match (self.duration, self.requests) {
            (None, None) => Some(Duration::from_secs(10)),
            (d, _) => d,
        };
        Bounds {
            duration_us: duration.map(|d| d.as_micros() as u64),
            max_requests: self.requests,
        }
    }

    pub fn workload(&self) -> Workload {
        let prompt = LengthDist {
            mean: self.prompt_mean,
            sigma: self.prompt_sigma,
            min: self.prompt_min,
            max: self.prompt_max,
        };
        let output = LengthDist {
            mean: self.output_mean,
            sigma: self.output_sigma,
            min: self.output_min,
            max: self.output_max,
        };
        let question = LengthDist {
            mean: self.question_tokens,
            sigma: self.question_sigma,
            min: self.question_min,
            max: self.question_max,
        };
        let answer = LengthDist {
            mean: self.answer_tokens,
            sigma: self.answer_sigma,
            min: self.answer_min,
            max: self.answer_max,
        };
        match self.workload {
            WorkloadKind::SharedPrefix => Workload::SharedPrefix(SharedPrefix {
                groups: self.groups,
                system_tokens: self.system_tokens,
                users_per_group: self.users_per_group,
                question,
                answer,
                zipf: self.zipf,
            }),
            WorkloadKind::MultiTurn => Workload::MultiTurn(MultiTurn {
                groups: self.groups,
                system_tokens: self.system_tokens,
                turns_min: self.turns.0,
                turns_max: self.turns.1,
                question,
                answer,
                think: ThinkDist {
                    mean_us: self.think_mean.as_micros() as f64,
                    sigma: self.think_sigma,
                    min_us: self.think_min.as_micros() as u64,
                    max_us: self.think_max.as_micros() as u64,
                },
                zipf: self.zipf,
            }),
            WorkloadKind::Sharegpt => Workload::ShareGpt { prompt, output },
            WorkloadKind::Fixed => Workload::Fixed {
                prompt_tokens: self.prompt_tokens,
                output_tokens: self.output_tokens,
            },
            WorkloadKind::Hol => Workload::HeadOfLine {
                prompt,
                output,
                burst: Burst {
                    at_us: self.hol_at.as_micros() as u64,
                    count: self.hol_count,
                    spread_us: self.hol_spread.as_micros() as u64,
                    prompt_tokens: self.hol_prompt_tokens,
                    output_tokens: self.hol_output_tokens,
                },
            },
        }
    }

    pub fn target(&self) -> Target {
        Target {
            uri: self.url.clone(),
            model: self.model.clone(),
            headers: self.headers.clone(),
            ignore_eos: !self.no_ignore_eos,
        }
    }
}

fn positive_f64(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err("must be a finite number > 0".into()),
    }
}

fn positive_u64(s: &str) -> Result<u64, String> {
    match s.trim().parse::<u64>() {
        Ok(v) if v > 0 => Ok(v),
        _ => Err("must be a whole number > 0".into()),
    }
}

fn positive_usize(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(v) if v > 0 => Ok(v),
        _ => Err("must be a whole number > 0".into()),
    }
}

/// `30s`, `500ms`, `2m`, `1.5s`, or a bare number of seconds; may be zero.
pub fn parse_offset(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let (num, unit) = match t.find(|c: char| c.is_ascii_alphabetic()) {
        Some(i) => t.split_at(i),
        None => (t, "s"),
    };
    let mult = match unit {
        "ms" => 1e-3,
        "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        _ => return Err("unit must be ms, s, m or h (e.g. 30s, 500ms)".into()),
    };
    match num.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 && v * mult < 1e9 => {
            Ok(Duration::from_secs_f64(v * mult))
        }
        _ => Err("must be a non-negative duration like 30s, 500ms, 2m".into()),
    }
}

/// Turns per session: `N` (fixed) or `A..B` (uniform, inclusive), 1 <= A <= B <= 1000.
pub fn parse_turns(s: &str) -> Result<(u32, u32), String> {
    let t = s.trim();
    let (a, b) = t.split_once("..").unwrap_or((t, t));
    match (a.trim().parse::<u32>(), b.trim().parse::<u32>()) {
        (Ok(a), Ok(b)) if 1 <= a && a <= b && b <= 1000 => Ok((a, b)),
        _ => Err("must be N or A..B with 1 <= A <= B <= 1000 (e.g. 5 or 2..8)".into()),
    }
}

/// Like [`parse_offset`] but must be > 0.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    match parse_offset(s)? {
        d if d.is_zero() => Err("must be > 0".into()),
        d => Ok(d),
    }
}

pub fn parse_url(s: &str) -> Result<Uri, String> {
    let u: Uri = s.trim().parse().map_err(|e| format!("not a URL: {e}"))?;
    if u.scheme_str() != Some("http") {
        return Err("must start with http:// (TLS is not supported)".into());
    }
    let Some(auth) = u.authority() else {
        return Err("must name a host, e.g. http://127.0.0.1:10000".into());
    };
    let base = u.path().trim_end_matches('/');
    let path = if base.ends_with(CHAT_PATH) {
        base.to_string()
    } else {
        format!("{base}{CHAT_PATH}")
    };
    format!("http://{auth}{path}")
        .parse()
        .map_err(|e| format!("not a URL: {e}"))
}

pub fn parse_header(s: &str) -> Result<(HeaderName, HeaderValue), String> {
    let (k, v) = s.split_once(':').ok_or("must be Name:value")?;
    let name = HeaderName::from_bytes(k.trim().as_bytes()).map_err(|_| "invalid header name")?;
    let value = HeaderValue::from_str(v.trim()).map_err(|_| "invalid header value")?;
    Ok((name, value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1.5"), Ok(Duration::from_millis(1500)));
        assert!(parse_duration("0s").is_err());
        assert_eq!(parse_offset("0"), Ok(Duration::ZERO));
        assert!(parse_duration("-1s").is_err());
        assert!(parse_duration("5 parsecs").is_err());
    }

    #[test]
    fn urls_get_the_chat_path_once() {
        assert_eq!(
            parse_url("http://127.0.0.1:8080").unwrap().to_string(),
            "http://127.0.0.1:8080/v1/chat/completions"
        );
        assert_eq!(
            parse_url("http://h:1/v1/chat/completions")
                .unwrap()
                .to_string(),
            "http://h:1/v1/chat/completions"
        );
        assert_eq!(
            parse_url("http://h:1/prefix/").unwrap().path(),
            "/prefix/v1/chat/completions"
        );
        assert!(parse_url("https://h").is_err());
        assert!(parse_url("h:1").is_err());
    }

    #[test]
    fn headers() {
        let (k, v) = parse_header("x-tenant: a b").unwrap();
        assert_eq!((k.as_str(), v.to_str().unwrap()), ("x-tenant", "a b"));
        assert!(parse_header("nocolon").is_err());
        assert!(parse_header("bad name: v").is_err());
    }

    #[test]
    fn turns_are_fixed_or_a_range() {
        assert_eq!(parse_turns("5"), Ok((5, 5)));
        assert_eq!(parse_turns("2..8"), Ok((2, 8)));
        for bad in ["0", "3..2", "1..1001", "x", "2..", "-1"] {
            assert!(parse_turns(bad).is_err(), "{bad}");
        }
        let e = Cli::try_parse_from(["x", "--turns", "3..2"]).unwrap_err();
        assert!(e.to_string().contains("--turns") && e.to_string().contains("3..2"));
    }

    #[test]
    fn chat_workload_flags_reach_the_workload() {
        let c = Cli::try_parse_from([
            "x",
            "--workload",
            "multi-turn",
            "--turns",
            "3",
            "--think-mean",
            "500ms",
            "--system-tokens",
            "0",
        ])
        .unwrap();
        let Workload::MultiTurn(m) = c.workload() else {
            panic!("not multi-turn")
        };
        assert_eq!((m.turns_min, m.turns_max, m.system_tokens), (3, 3, 0));
        assert_eq!(m.think.mean_us, 500_000.0);
        let c = Cli::try_parse_from(["x", "--workload", "shared-prefix", "--zipf", "1.1"]).unwrap();
        let Workload::SharedPrefix(p) = c.workload() else {
            panic!("not shared-prefix")
        };
        assert_eq!((p.groups, p.system_tokens, p.users_per_group), (40, 900, 5));
        assert_eq!(p.zipf, 1.1);
        assert_eq!(p.answer.mean, 150.0);
    }

    #[test]
    fn defaults_parse_and_bound_the_run() {
        let c = Cli::try_parse_from(["x"]).unwrap();
        assert_eq!(
            c.bounds(),
            Bounds {
                duration_us: Some(10_000_000),
                max_requests: None
            }
        );
        let c = Cli::try_parse_from(["x", "--requests", "5"]).unwrap();
        assert_eq!(
            c.bounds(),
            Bounds {
                duration_us: None,
                max_requests: Some(5)
            }
        );
    }

    #[test]
    fn bad_values_name_flag_and_value() {
        for (flag, val) in [
            ("--rate", "-1"),
            ("--rate", "abc"),
            ("--cv", "0"),
            ("--timeout", "0s"),
            ("--max-in-flight", "0"),
            ("--url", "ftp://x"),
        ] {
            let e = Cli::try_parse_from(["x", flag, val]).unwrap_err();
            let msg = e.to_string();
            assert!(
                msg.contains(flag) && msg.contains(val),
                "{flag} {val}: {msg}"
            );
            assert_eq!(e.exit_code(), 2);
        }
    }
}
