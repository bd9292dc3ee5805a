//! Decides what each request asks for: seeded traces of (arrival, tag, prompt length, output
//! length). ShareGPT-like lengths are lognormal (the shape of the ShareGPT length histograms
//! used by vLLM's benchmark_serving), the head-of-line scenario adds a burst of long requests,
//! and traces round-trip through JSONL so several policies replay the exact same trace.

use std::io::{BufRead, Write};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, LogNormal};
use serde::{Deserialize, Serialize};

use crate::schedule::{self, Arrival, Bounds, ScheduleError};

/// Which class a request belongs to, so results can be split.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tag {
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

/// One request of a trace. `at_us` is the send offset from the run start.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceEntry {
    pub id: u64,
    pub at_us: u64,
    pub tag: Tag,
    pub prompt_tokens: u32,
    pub max_tokens: u32,
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
                    id: 0,
                    at_us,
                    tag: Tag::Short,
                    prompt_tokens: *prompt_tokens,
                    max_tokens: *output_tokens,
                })
                .collect()
        }
        Workload::ShareGpt { prompt, output } | Workload::HeadOfLine { prompt, output, .. } => {
            prompt.validate("--prompt-mean", "--prompt-sigma", "--prompt-min")?;
            output.validate("--output-mean", "--output-sigma", "--output-min")?;
            let p = prompt.sample_n(&mut lens, n);
            let o = output.sample_n(&mut lens, n);
            times
                .iter()
                .zip(p.iter().zip(o.iter()))
                .map(|(&at_us, (&prompt_tokens, &max_tokens))| TraceEntry {
                    id: 0,
                    at_us,
                    tag: Tag::Short,
                    prompt_tokens,
                    max_tokens,
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
            id: 0,
            at_us: b.at_us + o,
            tag: Tag::Long,
            prompt_tokens: b.prompt_tokens,
            max_tokens: b.output_tokens,
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
