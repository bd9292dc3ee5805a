//! Parses the Prometheus text exposition format (0.0.4, and the OpenMetrics subset model servers
//! emit) into samples, and decides which values are unusable: a syntax error fails the whole page
//! with its line number; NaN/±Inf, and negative values where the metric type forbids them
//! (counters, histogram buckets and counts), are reported as [`ValueIssue`]s and left out of the
//! samples. Format reference: <https://prometheus.io/docs/instrumenting/exposition_formats/>.
//!
//! Hand-written byte scanner, one pass, no regex and no allocation per sample beyond the label
//! vector (names and unescaped label values borrow from the page).

use std::borrow::Cow;
use std::collections::HashMap;

/// The `# TYPE` of a metric family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricType {
    Counter,
    Gauge,
    Histogram,
    Summary,
    Untyped,
}

impl MetricType {
    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "counter" => Self::Counter,
            "gauge" => Self::Gauge,
            "histogram" | "gaugehistogram" => Self::Histogram,
            "summary" => Self::Summary,
            "untyped" | "unknown" | "info" | "stateset" => Self::Untyped,
            _ => return None,
        })
    }
}

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<'a> {
    /// Full sample name, e.g. `vllm:e2e_request_latency_seconds_bucket`.
    pub name: &'a str,
    pub labels: Vec<(&'a str, Cow<'a, str>)>,
    pub value: f64,
    /// Optional timestamp, milliseconds since the epoch.
    pub timestamp_ms: Option<i64>,
    /// 1-based line number in the page.
    pub line: usize,
}

impl Sample<'_> {
    /// The value of label `name`, if present.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_ref())
    }
}

/// A value the parser refused to forward.
#[derive(Debug, Clone, PartialEq)]
pub struct ValueIssue {
    pub line: usize,
    /// The sample name.
    pub metric: String,
    /// The value as written on the page.
    pub value: String,
    pub reason: &'static str,
}

/// A syntax error; the page as a whole is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {detail}")]
pub struct ParseError {
    pub line: usize,
    pub detail: String,
}

/// A parsed page.
#[derive(Debug, Clone, Default)]
pub struct Exposition<'a> {
    /// Valid samples, in page order.
    pub samples: Vec<Sample<'a>>,
    /// `# TYPE` declarations by family name.
    pub types: HashMap<&'a str, MetricType>,
    /// Samples dropped because of their value.
    pub issues: Vec<ValueIssue>,
}

impl<'a> Exposition<'a> {
    /// Samples whose name is exactly `name`.
    pub fn samples_named<'s>(&'s self, name: &'s str) -> impl Iterator<Item = &'s Sample<'a>> + 's {
        self.samples.iter().filter(move |s| s.name == name)
    }

    /// Whether any sample (valid or rejected) of family `name` appeared on the page.
    pub fn has_family(&self, name: &str) -> bool {
        self.types.contains_key(name)
            || self
                .samples
                .iter()
                .any(|s| s.name == name || family_of(s.name, |f| f == name).is_some())
            || self
                .issues
                .iter()
                .any(|i| i.metric == name || family_of(&i.metric, |f| f == name).is_some())
    }

    /// The declared type of `family`, if any.
    pub fn type_of(&self, family: &str) -> Option<MetricType> {
        self.types.get(family).copied()
    }
}

const SUFFIXES: [&str; 5] = ["_bucket", "_count", "_sum", "_total", "_created"];

/// The family a sample name belongs to: the name itself or the name minus a known suffix, the
/// first for which `known` answers true.
fn family_of(name: &str, known: impl Fn(&str) -> bool) -> Option<(&str, &'static str)> {
    if known(name) {
        return Some((name, ""));
    }
    for suf in SUFFIXES {
        if let Some(base) = name.strip_suffix(suf) {
            if known(base) {
                return Some((base, suf));
            }
        }
    }
    None
}

/// Parses a page. Syntax errors fail the page; bad values are listed in `issues`.
pub fn parse(text: &str) -> Result<Exposition<'_>, ParseError> {
    let mut out = Exposition::default();
    let mut last_kind: Option<(&str, (MetricType, &'static str))> = None;
    for (i, raw) in text.split('\n').enumerate() {
        let line_no = i + 1;
        let line = raw
            .strip_suffix('\r')
            .unwrap_or(raw)
            .trim_start_matches([' ', '\t']);
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix('#') {
            parse_comment(rest, line_no, &mut out)?;
            continue;
        }
        let sample = parse_sample(line, line_no)?;
        // Samples of a family are contiguous: resolve the type once per run of equal names.
        let kind = match last_kind {
            Some((name, kind)) if name == sample.name => kind,
            _ => {
                let kind = sample_kind(sample.name, &out.types);
                last_kind = Some((sample.name, kind));
                kind
            }
        };
        match check_value(sample.value, kind) {
            None => out.samples.push(sample),
            Some(reason) => out.issues.push(ValueIssue {
                line: line_no,
                metric: sample.name.to_string(),
                value: format_value(sample.value),
                reason,
            }),
        }
    }
    Ok(out)
}

fn format_value(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v == f64::INFINITY {
        "+Inf".into()
    } else if v == f64::NEG_INFINITY {
        "-Inf".into()
    } else {
        v.to_string()
    }
}

/// The declared type of the family a sample name belongs to, and the suffix that joined them.
fn sample_kind(name: &str, types: &HashMap<&str, MetricType>) -> (MetricType, &'static str) {
    match family_of(name, |f| types.contains_key(f)) {
        Some((f, suf)) => (types.get(f).copied().unwrap_or(MetricType::Untyped), suf),
        None => (MetricType::Untyped, ""),
    }
}

/// Why a value may not be forwarded, given its family's type and suffix.
fn check_value(v: f64, (mtype, suffix): (MetricType, &'static str)) -> Option<&'static str> {
    let non_negative = match mtype {
        MetricType::Counter => true,
        MetricType::Histogram => suffix == "_bucket" || suffix == "_count",
        MetricType::Summary => suffix == "_count",
        MetricType::Gauge | MetricType::Untyped => false,
    };
    if v.is_nan() {
        return Some("NaN");
    }
    if v.is_infinite() {
        return Some("infinite");
    }
    if non_negative && v < 0.0 {
        return Some("negative value in a counter, bucket or count");
    }
    None
}

fn parse_comment<'a>(
    rest: &'a str,
    line: usize,
    out: &mut Exposition<'a>,
) -> Result<(), ParseError> {
    let rest = rest.trim_start_matches([' ', '\t']);
    let (kw, tail) = split_word(rest);
    match kw {
        "TYPE" => {
            let (name, tail) = split_word(tail);
            let (ty, extra) = split_word(tail);
            if !is_metric_name(name) {
                return Err(err(
                    line,
                    format!("TYPE line: invalid metric name {name:?}"),
                ));
            }
            if !extra.trim().is_empty() {
                return Err(err(
                    line,
                    format!("TYPE line: unexpected text {:?}", extra.trim()),
                ));
            }
            let mtype = MetricType::parse(ty)
                .ok_or_else(|| err(line, format!("TYPE line: unknown metric type {ty:?}")))?;
            if out.types.insert(name, mtype).is_some() {
                return Err(err(line, format!("second TYPE line for metric {name:?}")));
            }
            Ok(())
        }
        "HELP" => {
            let (name, _) = split_word(tail);
            if !is_metric_name(name) {
                return Err(err(
                    line,
                    format!("HELP line: invalid metric name {name:?}"),
                ));
            }
            Ok(())
        }
        // Other comments, `# EOF`, `# UNIT`: ignored.
        _ => Ok(()),
    }
}

fn split_word(s: &str) -> (&str, &str) {
    let s = s.trim_start_matches([' ', '\t']);
    match s.find([' ', '\t']) {
        Some(i) => (&s[..i], &s[i..]),
        None => (s, ""),
    }
}

fn err(line: usize, detail: String) -> ParseError {
    ParseError { line, detail }
}

fn is_name_start(b: u8) -> bool {
    b.is_ascii_alphabetic() || b == b'_' || b == b':'
}

fn is_name_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b':'
}

fn is_metric_name(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty() && is_name_start(b[0]) && b[1..].iter().all(|&c| is_name_char(c))
}

fn parse_sample(line: &str, line_no: usize) -> Result<Sample<'_>, ParseError> {
    let b = line.as_bytes();
    let mut i = 0;
    if b.is_empty() || !is_name_start(b[0]) {
        return Err(err(
            line_no,
            format!("expected a metric name, found {:?}", truncate(line)),
        ));
    }
    while i < b.len() && is_name_char(b[i]) {
        i += 1;
    }
    let name = &line[..i];
    let mut labels = Vec::new();
    if i < b.len() && b[i] == b'{' {
        i += 1;
        loop {
            i = skip_ws(b, i);
            if i >= b.len() {
                return Err(err(line_no, format!("{name}: unterminated label set")));
            }
            if b[i] == b'}' {
                i += 1;
                break;
            }
            let start = i;
            if !(b[i].is_ascii_alphabetic() || b[i] == b'_') {
                return Err(err(
                    line_no,
                    format!("{name}: invalid label name at column {}", i + 1),
                ));
            }
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                i += 1;
            }
            let lname = &line[start..i];
            i = skip_ws(b, i);
            if i >= b.len() || b[i] != b'=' {
                return Err(err(
                    line_no,
                    format!("{name}: expected '=' after label {lname}"),
                ));
            }
            i = skip_ws(b, i + 1);
            if i >= b.len() || b[i] != b'"' {
                return Err(err(
                    line_no,
                    format!("{name}: label {lname} value must be quoted"),
                ));
            }
            i += 1;
            let vstart = i;
            let mut escaped = false;
            loop {
                if i >= b.len() {
                    return Err(err(
                        line_no,
                        format!("{name}: unterminated value of label {lname}"),
                    ));
                }
                match b[i] {
                    b'\\' => {
                        escaped = true;
                        i += 2;
                    }
                    b'"' => break,
                    _ => i += 1,
                }
            }
            let rawv = &line[vstart..i];
            i += 1; // closing quote
            let value = if escaped {
                Cow::Owned(unescape(rawv).map_err(|c| {
                    err(
                        line_no,
                        format!("{name}: invalid escape \\{c} in label {lname}"),
                    )
                })?)
            } else {
                Cow::Borrowed(rawv)
            };
            if labels.iter().any(|(k, _)| *k == lname) {
                return Err(err(line_no, format!("{name}: duplicate label {lname}")));
            }
            labels.push((lname, value));
            i = skip_ws(b, i);
            if i < b.len() && b[i] == b',' {
                i += 1;
            } else if i < b.len() && b[i] == b'}' {
                i += 1;
                break;
            } else {
                return Err(err(
                    line_no,
                    format!("{name}: expected ',' or '}}' after label {lname}"),
                ));
            }
        }
    }
    if i >= b.len() || !(b[i] == b' ' || b[i] == b'\t') {
        return Err(err(
            line_no,
            format!("{name}: expected a space and a value"),
        ));
    }
    let rest = &line[i..];
    let (vtext, rest) = split_word(rest);
    if vtext.is_empty() {
        return Err(err(line_no, format!("{name}: missing value")));
    }
    let value = parse_float(vtext).ok_or_else(|| {
        err(
            line_no,
            format!("{name}: invalid value {:?}", truncate(vtext)),
        )
    })?;
    let (ttext, rest) = split_word(rest);
    let mut timestamp_ms = None;
    let mut rest = rest;
    if !ttext.is_empty() {
        if ttext == "#" {
            // OpenMetrics exemplar directly after the value.
            rest = "";
        } else {
            timestamp_ms = Some(parse_timestamp(ttext).ok_or_else(|| {
                err(
                    line_no,
                    format!("{name}: invalid timestamp {:?}", truncate(ttext)),
                )
            })?);
        }
    }
    let rest = rest.trim_matches([' ', '\t']);
    if !rest.is_empty() && !rest.starts_with('#') {
        return Err(err(
            line_no,
            format!("{name}: unexpected text {:?}", truncate(rest)),
        ));
    }
    Ok(Sample {
        name,
        labels,
        value,
        timestamp_ms,
        line: line_no,
    })
}

fn truncate(s: &str) -> &str {
    match s.char_indices().nth(60) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && (b[i] == b' ' || b[i] == b'\t') {
        i += 1;
    }
    i
}

fn unescape(s: &str) -> Result<String, char> {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            match chars.next() {
                Some('\\') => out.push('\\'),
                Some('"') => out.push('"'),
                Some('n') => out.push('\n'),
                Some(other) => return Err(other),
                None => return Err(' '),
            }
        } else {
            out.push(c);
        }
    }
    Ok(out)
}

/// Go's `strconv.ParseFloat` as Prometheus uses it: decimal or exponent floats, `NaN`, `Inf`,
/// `+Inf`, `-Inf` (case-insensitive).
pub fn parse_float(s: &str) -> Option<f64> {
    let b = s.as_bytes();
    // Reject forms Rust accepts but Prometheus does not ("infinity" is accepted by both).
    if b.is_empty()
        || b.iter()
            .any(|c| !(c.is_ascii_alphanumeric() || b"+-._".contains(c)))
    {
        return None;
    }
    if s.contains('_') {
        return None;
    }
    s.parse::<f64>().ok()
}

fn parse_timestamp(s: &str) -> Option<i64> {
    if let Ok(v) = s.parse::<i64>() {
        return Some(v);
    }
    // OpenMetrics timestamps are seconds with a fraction.
    let f = s.parse::<f64>().ok().filter(|f| f.is_finite())?;
    Some((f * 1000.0) as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_labels_escapes_timestamps_and_comments() {
        let page = "# HELP x_total Things.\n# TYPE x_total counter\n\
                    x_total{a=\"1\",b=\"q\\\"uote\\\\ \\n\",} 3 1700000000000\n\
                    # random comment\n\n  y 2.5e3\r\nz{} -1\n";
        let e = parse(page).unwrap();
        assert_eq!(e.samples.len(), 3);
        let x = &e.samples[0];
        assert_eq!(x.name, "x_total");
        assert_eq!(x.label("a"), Some("1"));
        assert_eq!(x.label("b"), Some("q\"uote\\ \n"));
        assert_eq!(x.timestamp_ms, Some(1_700_000_000_000));
        assert_eq!(x.line, 3);
        assert_eq!(e.samples[1].value, 2500.0);
        assert_eq!(e.samples[2].value, -1.0);
        assert_eq!(e.type_of("x_total"), Some(MetricType::Counter));
    }

    #[test]
    fn histogram_le_inf_and_suffix_typing() {
        let page = "# TYPE h histogram\nh_bucket{le=\"0.1\"} 1\nh_bucket{le=\"+Inf\"} 2\n\
                    h_sum 0.3\nh_count 2\n";
        let e = parse(page).unwrap();
        assert_eq!(e.samples.len(), 4);
        assert_eq!(
            e.samples[1].label("le").and_then(parse_float),
            Some(f64::INFINITY)
        );
        assert!(e.has_family("h"));
        assert!(e.issues.is_empty());
    }

    #[test]
    fn bad_values_are_reported_not_forwarded() {
        let page = "# TYPE g gauge\ng NaN\ng2 +Inf\n# TYPE c_total counter\nc_total -1\n\
                    # TYPE h histogram\nh_bucket{le=\"1\"} -2\nh_sum -0.5\n# TYPE g3 gauge\ng3 -4\n";
        let e = parse(page).unwrap();
        let names: Vec<_> = e
            .issues
            .iter()
            .map(|i| (i.metric.as_str(), i.line))
            .collect();
        assert_eq!(
            names,
            vec![("g", 2), ("g2", 3), ("c_total", 5), ("h_bucket", 7)]
        );
        assert_eq!(e.issues[0].value, "NaN");
        // A negative histogram sum and a negative gauge are allowed by their types.
        assert_eq!(e.samples.len(), 2);
    }

    #[test]
    fn syntax_errors_name_the_line() {
        for (page, line) in [
            ("a 1\nb{x=\"1\" 2\n", 2),
            ("a 1\n\nb{x=1} 2\n", 3),
            ("a one\n", 1),
            ("a\n", 1),
            ("9a 1\n", 1),
            ("# TYPE a flavour\n", 1),
            ("# TYPE a gauge\n# TYPE a gauge\n", 2),
            ("a{x=\"\\q\"} 1\n", 1),
            ("a{x=\"1\",x=\"2\"} 1\n", 1),
            ("a 1 notatime\n", 1),
            ("a 1 2 3\n", 1),
            ("a{x=\"unterminated} 1\n", 1),
        ] {
            let e = parse(page).expect_err(page);
            assert_eq!(e.line, line, "{page:?}: {e}");
        }
    }

    #[test]
    fn exemplars_and_eof_are_tolerated() {
        let page = "h_bucket{le=\"1\"} 3 # {trace_id=\"abc\"} 0.5 123\n# EOF\n";
        let e = parse(page).unwrap();
        assert_eq!(e.samples[0].value, 3.0);
    }

    #[test]
    fn float_forms() {
        assert_eq!(parse_float("+Inf"), Some(f64::INFINITY));
        assert_eq!(parse_float("-inf"), Some(f64::NEG_INFINITY));
        assert!(parse_float("NaN").is_some_and(f64::is_nan));
        assert_eq!(parse_float("1e-3"), Some(0.001));
        assert_eq!(parse_float("1_000"), None);
        assert_eq!(parse_float(""), None);
    }
}
