//! Decides what a model server's `/metrics` page says: the Prometheus text exposition format
//! parsed into metric families (name, type, samples with labels, value, optional timestamp), and
//! one sample picked per metric the way llm-d's core metrics extractor does
//! (`pkg/epp/framework/plugins/datalayer/extractor/metrics/spec.go` at ebab68792:
//! `getLatestMetric` keeps the first matching sample with the newest timestamp, and
//! `extractValue` reads a gauge's or a counter's value and 0 for any other type).
//!
//! A malformed line fails the whole page, as Prometheus' Go text parser does; the scraper then
//! keeps the pod's previous readings and counts the error.

use std::collections::HashMap;

/// A family's `# TYPE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricType {
    Counter,
    Gauge,
    Histogram,
    Summary,
    /// No `# TYPE` line, or `untyped`/`unknown`.
    Untyped,
}

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub labels: Vec<(String, String)>,
    pub value: f64,
    /// Milliseconds, when the line carries one.
    pub timestamp_ms: Option<i64>,
}

impl Sample {
    /// The value of label `name`, if the sample has it.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// A metric family: its type and the samples named exactly as the family (a histogram's or a
/// summary's `_bucket`/`_sum`/`_count` samples are kept apart, see [`Page::samples`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Family {
    pub kind: MetricType,
    pub samples: Vec<Sample>,
}

/// A parsed page: families by name.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Page {
    families: HashMap<String, Family>,
}

/// Why a page could not be parsed: the line number (1-based) and what was wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("metrics page line {line}: {reason}")]
pub struct ParseError {
    pub line: usize,
    pub reason: String,
}

/// Why a metric could not be read from a page (the extractor's per-metric errors).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LookupError {
    #[error("metric family {0:?} not found")]
    NotFound(String),
    #[error("no metrics found for {0:?}")]
    Empty(String),
    #[error("no matching metric found for {name:?} with labels {labels:?}")]
    NoMatch {
        name: String,
        labels: Vec<(String, String)>,
    },
}

impl Page {
    /// The family named `name`.
    pub fn family(&self, name: &str) -> Option<&Family> {
        self.families.get(name)
    }

    /// Every family name (for tests and the admin page).
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.families.keys().map(String::as_str)
    }

    /// The samples of family `name` (empty if absent).
    pub fn samples(&self, name: &str) -> &[Sample] {
        self.families
            .get(name)
            .map(|f| f.samples.as_slice())
            .unwrap_or(&[])
    }

    /// llm-d's `getLatestMetric`: among the samples of `name` carrying every label of `labels`,
    /// the first one with the largest timestamp (a sample without one counts as 0).
    pub fn latest(&self, name: &str, labels: &[(&str, &str)]) -> Result<&Sample, LookupError> {
        let fam = self
            .families
            .get(name)
            .ok_or_else(|| LookupError::NotFound(name.to_string()))?;
        if fam.samples.is_empty() {
            return Err(LookupError::Empty(name.to_string()));
        }
        let mut best: Option<&Sample> = None;
        let mut recent = i64::MIN;
        for s in &fam.samples {
            let matches = labels.iter().all(|(k, v)| s.label(k) == Some(*v));
            if !matches {
                continue;
            }
            let ts = s.timestamp_ms.unwrap_or(0);
            if best.is_none() || ts > recent {
                recent = ts;
                best = Some(s);
            }
        }
        best.ok_or_else(|| LookupError::NoMatch {
            name: name.to_string(),
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        })
    }

    /// llm-d's `extractValue`: a gauge's or a counter's value, 0 for every other type.
    pub fn value_of(&self, name: &str, sample: &Sample) -> f64 {
        match self.families.get(name).map(|f| f.kind) {
            Some(MetricType::Gauge) | Some(MetricType::Counter) => sample.value,
            _ => 0.0,
        }
    }
}

/// Parses a text exposition page.
pub fn parse(text: &str) -> Result<Page, ParseError> {
    let mut page = Page::default();
    // The histogram or summary family whose `_bucket`/`_sum`/`_count`/quantile samples follow.
    let mut typed: HashMap<String, MetricType> = HashMap::new();
    for (i, raw) in text.lines().enumerate() {
        let line_no = i + 1;
        let err = |reason: String| ParseError {
            line: line_no,
            reason,
        };
        let line = raw.trim();
        if line.is_empty() {
            continue;
        }
        if let Some(comment) = line.strip_prefix('#') {
            let mut words = comment.split_whitespace();
            match words.next() {
                Some("TYPE") => {
                    let name = words
                        .next()
                        .ok_or_else(|| err("TYPE line without a metric name".into()))?;
                    let kind = match words.next() {
                        Some("counter") => MetricType::Counter,
                        Some("gauge") => MetricType::Gauge,
                        Some("histogram") => MetricType::Histogram,
                        Some("summary") => MetricType::Summary,
                        Some("untyped") | Some("unknown") => MetricType::Untyped,
                        Some(other) => return Err(err(format!("unknown metric type {other:?}"))),
                        None => return Err(err(format!("TYPE line for {name} without a type"))),
                    };
                    if typed.insert(name.to_string(), kind).is_some() {
                        return Err(err(format!("second TYPE line for metric name {name}")));
                    }
                    let fam = page.families.entry(name.to_string()).or_insert(Family {
                        kind,
                        samples: Vec::new(),
                    });
                    if !fam.samples.is_empty() {
                        return Err(err(format!(
                            "TYPE line for {name} after samples of the same name"
                        )));
                    }
                    fam.kind = kind;
                }
                Some("HELP") if words.next().is_none() => {
                    return Err(err("HELP line without a metric name".into()));
                }
                _ => {}
            }
            continue;
        }
        let (name, sample) = parse_sample(line).map_err(err)?;
        // A histogram's/summary's own series (`x_bucket`, `x_sum`, `x_count`) are stored under
        // their own names, typed as the family they belong to, so they never pass for gauges.
        let kind = typed
            .get(&name)
            .copied()
            .or_else(|| {
                ["_bucket", "_sum", "_count"].iter().find_map(|suf| {
                    let base = name.strip_suffix(suf)?;
                    match typed.get(base) {
                        Some(k @ (MetricType::Histogram | MetricType::Summary)) => Some(*k),
                        _ => None,
                    }
                })
            })
            .unwrap_or(MetricType::Untyped);
        page.families
            .entry(name)
            .or_insert(Family {
                kind,
                samples: Vec::new(),
            })
            .samples
            .push(sample);
    }
    Ok(page)
}

fn is_name_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_' || c == ':'
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

/// `name{labels} value [timestamp]`.
fn parse_sample(line: &str) -> Result<(String, Sample), String> {
    let mut chars = line.char_indices().peekable();
    let name_end = match chars.peek() {
        Some((_, c)) if is_name_start(*c) => {
            let mut end = line.len();
            for (i, c) in line.char_indices() {
                if !is_name_char(c) {
                    end = i;
                    break;
                }
            }
            end
        }
        _ => return Err(format!("invalid metric name at the start of {line:?}")),
    };
    let name = &line[..name_end];
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(after) = rest.strip_prefix('{') {
        let (ls, remaining) = parse_labels(after).map_err(|e| format!("{name}: {e}"))?;
        labels = ls;
        rest = remaining;
    }
    let mut fields = rest.split_whitespace();
    let value_text = fields
        .next()
        .ok_or_else(|| format!("{name}: sample without a value"))?;
    let value =
        parse_value(value_text).ok_or_else(|| format!("{name}: invalid value {value_text:?}"))?;
    let timestamp_ms = match fields.next() {
        None => None,
        Some(t) => Some(
            t.parse::<i64>()
                .map_err(|_| format!("{name}: invalid timestamp {t:?}"))?,
        ),
    };
    if let Some(extra) = fields.next() {
        return Err(format!(
            "{name}: unexpected text {extra:?} after the sample"
        ));
    }
    Ok((
        name.to_string(),
        Sample {
            labels,
            value,
            timestamp_ms,
        },
    ))
}

/// The label pairs after `{`, and what follows the closing `}`.
#[allow(clippy::type_complexity)]
fn parse_labels(s: &str) -> Result<(Vec<(String, String)>, &str), String> {
    let mut labels = Vec::new();
    let mut rest = s.trim_start();
    loop {
        if let Some(after) = rest.strip_prefix('}') {
            return Ok((labels, after));
        }
        let name_end = rest
            .char_indices()
            .find(|(_, c)| !is_name_char(*c))
            .map(|(i, _)| i)
            .ok_or("unterminated label set")?;
        let lname = &rest[..name_end];
        if lname.is_empty() || lname.starts_with(|c: char| c.is_ascii_digit() || c == ':') {
            return Err(format!("invalid label name in {rest:?}"));
        }
        rest = rest[name_end..].trim_start();
        rest = rest
            .strip_prefix('=')
            .ok_or_else(|| format!("label {lname} without '='"))?
            .trim_start();
        rest = rest
            .strip_prefix('"')
            .ok_or_else(|| format!("label {lname}: value not quoted"))?;
        let mut value = String::new();
        let mut closed = None;
        let mut it = rest.char_indices();
        while let Some((i, c)) = it.next() {
            match c {
                '\\' => match it.next() {
                    Some((_, '\\')) => value.push('\\'),
                    Some((_, '"')) => value.push('"'),
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, o)) => return Err(format!("label {lname}: invalid escape \\{o}")),
                    None => return Err(format!("label {lname}: unterminated value")),
                },
                '"' => {
                    closed = Some(i);
                    break;
                }
                c => value.push(c),
            }
        }
        let close = closed.ok_or_else(|| format!("label {lname}: unterminated value"))?;
        labels.push((lname.to_string(), value));
        rest = rest[close + 1..].trim_start();
        if let Some(after) = rest.strip_prefix(',') {
            rest = after.trim_start();
        } else if !rest.starts_with('}') {
            return Err(format!("expected ',' or '}}' after label {lname}"));
        }
    }
}

fn parse_value(s: &str) -> Option<f64> {
    match s {
        "NaN" => Some(f64::NAN),
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        _ => s.parse::<f64>().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM: &str = "\
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 3.0
vllm:num_requests_waiting{engine=\"1\",model_name=\"m\"} 7.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"781\",sliding_window=\"None\"} 1.0
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{le=\"+Inf\",model_name=\"m\"} 4.0
vllm:e2e_request_latency_seconds_count{model_name=\"m\"} 4.0
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{model_name=\"m\"} 10.0
untyped_thing 5
";

    #[test]
    fn parses_a_vllm_page() {
        let p = parse(VLLM).unwrap();
        let w = p.latest("vllm:num_requests_waiting", &[]).unwrap();
        // No timestamps: the first sample wins (llm-d's strict "newer" comparison).
        assert_eq!(w.value, 3.0);
        assert_eq!(p.value_of("vllm:num_requests_waiting", w), 3.0);
        let c = p.latest("vllm:cache_config_info", &[]).unwrap();
        assert_eq!(c.label("block_size"), Some("16"));
        assert_eq!(c.label("num_gpu_blocks"), Some("781"));
        let t = p.latest("vllm:prompt_tokens_total", &[]).unwrap();
        assert_eq!(p.value_of("vllm:prompt_tokens_total", t), 10.0);
        assert_eq!(
            p.family("vllm:e2e_request_latency_seconds_count")
                .unwrap()
                .kind,
            MetricType::Histogram
        );
    }

    #[test]
    fn untyped_and_histogram_series_read_as_zero_like_llm_d() {
        let p = parse(VLLM).unwrap();
        let s = p.latest("untyped_thing", &[]).unwrap();
        assert_eq!(s.value, 5.0);
        assert_eq!(p.value_of("untyped_thing", s), 0.0);
        let h = p
            .latest("vllm:e2e_request_latency_seconds_count", &[])
            .unwrap();
        assert_eq!(p.value_of("vllm:e2e_request_latency_seconds_count", h), 0.0);
    }

    #[test]
    fn the_newest_timestamp_wins_and_labels_filter() {
        let text = "# TYPE g gauge\ng{a=\"x\"} 1 100\ng{a=\"y\"} 2 300\ng{a=\"x\"} 3 200\n";
        let p = parse(text).unwrap();
        assert_eq!(p.latest("g", &[]).unwrap().value, 2.0);
        assert_eq!(p.latest("g", &[("a", "x")]).unwrap().value, 3.0);
        assert!(matches!(
            p.latest("g", &[("a", "z")]),
            Err(LookupError::NoMatch { .. })
        ));
        assert_eq!(
            p.latest("absent", &[]),
            Err(LookupError::NotFound("absent".into()))
        );
    }

    #[test]
    fn special_values_and_escapes() {
        let text = "# TYPE g gauge\ng{a=\"q\\\"\\\\\\n\"} NaN\nh +Inf\ni -Inf\nj 1e3\n";
        let p = parse(text).unwrap();
        let g = p.latest("g", &[]).unwrap();
        assert!(g.value.is_nan());
        assert_eq!(g.label("a"), Some("q\"\\\n"));
        assert_eq!(p.latest("h", &[]).unwrap().value, f64::INFINITY);
        assert_eq!(p.latest("i", &[]).unwrap().value, f64::NEG_INFINITY);
        assert_eq!(p.latest("j", &[]).unwrap().value, 1000.0);
    }

    #[test]
    fn malformed_lines_fail_the_page_naming_the_line() {
        for (text, line) in [
            ("# TYPE g gauge\ng{a=\"x\" 1\n", 2),
            ("g notanumber\n", 1),
            ("g\n", 1),
            ("g 1 2 3\n", 1),
            ("{a=\"b\"} 1\n", 1),
            ("# TYPE g gauge\n# TYPE g counter\n", 2),
            ("# TYPE g sometype\n", 1),
            ("g{a=b} 1\n", 1),
            ("g{a=\"\\x\"} 1\n", 1),
        ] {
            let e = parse(text).unwrap_err();
            assert_eq!(e.line, line, "{text:?}: {e}");
        }
    }

    #[test]
    fn blank_lines_comments_and_trailing_commas_are_fine() {
        let p = parse("\n# just a comment\n# TYPE g gauge\ng{a=\"1\",} 4\n\n").unwrap();
        assert_eq!(p.latest("g", &[]).unwrap().value, 4.0);
        assert_eq!(p.names().count(), 1);
    }
}
