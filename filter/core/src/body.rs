//! Reads what routing needs from an OpenAI-style JSON body, in one parse:
//! - the top-level `model` string, when no model header names it. Anything else (not JSON,
//!   no `model`, not a string) means "no model" and the request is picked among all pods;
//! - the output reservation: `max_completion_tokens`, else `max_tokens`, times `n` (each
//!   choice holds its own output in the KV cache). A field that is not a non-negative
//!   integer counts as absent and never costs the model its parse.

use serde::Deserialize;
use serde_json::Value;

/// Most choices (`n`) counted in the output reservation.
const MAX_CHOICES: u64 = 128;

#[derive(Deserialize)]
struct Fields {
    #[serde(default)]
    model: Option<Value>,
    #[serde(default)]
    max_completion_tokens: Option<Value>,
    #[serde(default)]
    max_tokens: Option<Value>,
    #[serde(default)]
    n: Option<Value>,
}

/// What routing reads from a request body.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct RoutingFields {
    /// The top-level `model`, if it is a non-empty string (trimmed).
    pub model: Option<String>,
    /// Output tokens reserved, if the body sets `max_completion_tokens` or `max_tokens`.
    pub max_output_tokens: Option<u64>,
}

/// The routing fields of `body` (all absent when it is not a JSON object).
pub fn routing_fields(body: &[u8]) -> RoutingFields {
    // Only an object: serde would also read a struct from a JSON array.
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return RoutingFields::default();
    }
    let Ok(f) = serde_json::from_slice::<Fields>(body) else {
        return RoutingFields::default();
    };
    let model = f
        .model
        .as_ref()
        .and_then(Value::as_str)
        .map(|m| m.trim().to_string())
        .filter(|m| !m.is_empty());
    let per_choice = f
        .max_completion_tokens
        .as_ref()
        .and_then(Value::as_u64)
        .or_else(|| f.max_tokens.as_ref().and_then(Value::as_u64));
    let choices =
        f.n.as_ref()
            .and_then(Value::as_u64)
            .unwrap_or(1)
            .clamp(1, MAX_CHOICES);
    RoutingFields {
        model,
        max_output_tokens: per_choice.map(|t| t.saturating_mul(choices)),
    }
}

/// The routing fields of the first bytes of a body too large to read whole (a request body
/// over `maxBodyReadBytes`, e.g. a multimodal request with base64 images): the top-level
/// fields that lie complete within `prefix`, read by a scanner that skips nested values
/// without parsing them and stops where the prefix ends. A field cut by the end of the prefix
/// (a string not closed, a number not followed by a delimiter) counts as absent: a model
/// placed after the large messages array is not seen, and the request is picked among all
/// pods, as for a body with no model.
pub fn routing_fields_prefix(prefix: &[u8]) -> RoutingFields {
    let mut model = None;
    let (mut max_completion, mut max_tokens, mut n) = (None, None, None);
    scan_top_level(prefix, |key, value| match key {
        b"\"model\"" => {
            model = serde_json::from_slice::<String>(value)
                .ok()
                .map(|m| m.trim().to_string())
                .filter(|m| !m.is_empty());
        }
        b"\"max_completion_tokens\"" => max_completion = parse_u64(value),
        b"\"max_tokens\"" => max_tokens = parse_u64(value),
        b"\"n\"" => n = parse_u64(value),
        _ => {}
    });
    let per_choice = max_completion.or(max_tokens);
    let choices = n.unwrap_or(1).clamp(1, MAX_CHOICES);
    RoutingFields {
        model,
        max_output_tokens: per_choice.map(|t| t.saturating_mul(choices)),
    }
}

fn parse_u64(v: &[u8]) -> Option<u64> {
    std::str::from_utf8(v).ok()?.parse().ok()
}

/// Calls `field(key, value)` for each complete top-level `"key": value` of a JSON object in
/// `b` (the key with its quotes, the value's raw bytes), until the object or the bytes end or
/// something is not JSON. Nested values are skipped by bracket depth, strings by their quotes.
fn scan_top_level(b: &[u8], mut field: impl FnMut(&[u8], &[u8])) {
    let mut i = skip_ws(b, 0);
    if b.get(i) != Some(&b'{') {
        return;
    }
    i += 1;
    loop {
        i = skip_ws(b, i);
        if b.get(i) == Some(&b',') {
            i = skip_ws(b, i + 1);
        }
        if b.get(i) != Some(&b'"') {
            return;
        }
        let Some(key_end) = string_end(b, i) else {
            return;
        };
        let Some(key) = b.get(i..key_end) else {
            return;
        };
        i = skip_ws(b, key_end);
        if b.get(i) != Some(&b':') {
            return;
        }
        i = skip_ws(b, i + 1);
        let Some(end) = value_end(b, i) else {
            return;
        };
        let Some(value) = b.get(i..end) else {
            return;
        };
        field(key, value);
        i = end;
    }
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while b.get(i).is_some_and(u8::is_ascii_whitespace) {
        i += 1;
    }
    i
}

/// The index after the closing quote of the string opening at `i`; None if cut.
fn string_end(b: &[u8], i: usize) -> Option<usize> {
    let mut j = i + 1;
    loop {
        match b.get(j)? {
            b'\\' => j += 2,
            b'"' => return Some(j + 1),
            _ => j += 1,
        }
    }
}

/// The index after the value starting at `i`; None when the value is cut by the end of `b`
/// (a scalar must be followed by a delimiter to be known complete).
fn value_end(b: &[u8], i: usize) -> Option<usize> {
    match b.get(i)? {
        b'"' => string_end(b, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            loop {
                match b.get(j)? {
                    b'"' => {
                        j = string_end(b, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth = depth.saturating_sub(1);
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
        }
        _ => {
            let mut j = i;
            loop {
                let c = *b.get(j)?;
                if matches!(c, b',' | b'}' | b']') || c.is_ascii_whitespace() {
                    break;
                }
                j += 1;
            }
            Some(j)
        }
    }
}

/// The body's top-level `model`, if it is a non-empty string.
#[cfg(test)]
fn model_of(body: &[u8]) -> Option<String> {
    routing_fields(body).model
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_top_level_model() {
        let body = br#"{"messages":[{"role":"user","content":"hi \"x\""}],"model":"llama-3-8b","stream":true}"#;
        assert_eq!(model_of(body).as_deref(), Some("llama-3-8b"));
    }

    #[test]
    fn escaped_model_names_are_unescaped() {
        assert_eq!(model_of(br#"{"model":"a\/b"}"#).as_deref(), Some("a/b"));
    }

    #[test]
    fn no_model_for_non_json_missing_or_non_string_model() {
        assert_eq!(model_of(b"not json"), None);
        assert_eq!(model_of(br#"{"prompt":"x"}"#), None);
        assert_eq!(model_of(br#"{"model":42}"#), None);
        assert_eq!(model_of(br#"{"model":"  "}"#), None);
        assert_eq!(model_of(br#"["model"]"#), None);
    }

    #[test]
    fn reads_the_output_reservation_times_choices() {
        let f = routing_fields(br#"{"model":"m","max_tokens":100,"messages":[]}"#);
        assert_eq!(f.max_output_tokens, Some(100));
        let f = routing_fields(br#"{"max_completion_tokens":7,"max_tokens":100,"n":3}"#);
        assert_eq!(f.max_output_tokens, Some(21));
        assert_eq!(routing_fields(br#"{"model":"m"}"#).max_output_tokens, None);
    }

    #[test]
    fn a_prefix_gives_the_fields_that_lie_complete_in_it() {
        let body = br#"{"model":"m1","max_tokens":100,"n":2,"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}}]}]}"#;
        // Whole: the same as the full parse.
        assert_eq!(routing_fields_prefix(body), routing_fields(body));
        // Cut inside the messages: model and reservation are before the cut.
        let cut = &body[..body.len() - 20];
        let f = routing_fields_prefix(cut);
        assert_eq!(f.model.as_deref(), Some("m1"));
        assert_eq!(f.max_output_tokens, Some(200));
        // A model after the large array is not seen; a number cut mid-way is absent.
        let late = br#"{"messages":[{"content":"xxxxxxxx"}],"model":"m2"}"#;
        assert_eq!(routing_fields_prefix(&late[..20]).model, None);
        assert_eq!(routing_fields_prefix(late).model.as_deref(), Some("m2"));
        assert_eq!(
            routing_fields_prefix(br#"{"max_tokens":10"#).max_output_tokens,
            None
        );
        assert_eq!(routing_fields_prefix(br#"{"model":"ab"#).model, None);
        // Strings with escaped quotes and brackets do not confuse the depth count.
        let tricky = br#"{"messages":[{"content":"a \"]}{ b"}],"model":"m3","max_tokens":5}"#;
        assert_eq!(routing_fields_prefix(tricky).model.as_deref(), Some("m3"));
        assert_eq!(routing_fields_prefix(tricky).max_output_tokens, Some(5));
        // Not an object, or garbage: nothing.
        assert_eq!(routing_fields_prefix(b"[1,2]"), RoutingFields::default());
        assert_eq!(
            routing_fields_prefix(b"\x00\xff{"),
            RoutingFields::default()
        );
        assert_eq!(routing_fields_prefix(b""), RoutingFields::default());
    }

    #[test]
    fn every_prefix_of_a_body_gives_a_subset_of_its_fields() {
        let body = br#"{"stream":true,"model":"llama","messages":[{"role":"user","content":"hi [x] {y}"}],"max_completion_tokens":64,"n":1}"#;
        let full = routing_fields(body);
        for cut in 0..=body.len() {
            let f = routing_fields_prefix(&body[..cut]);
            assert!(
                f.model.is_none() || f.model == full.model,
                "cut {cut}: {f:?}"
            );
            assert!(
                f.max_output_tokens.is_none() || f.max_output_tokens == full.max_output_tokens,
                "cut {cut}: {f:?}"
            );
        }
    }

    #[test]
    fn a_bad_output_field_is_absent_and_keeps_the_model() {
        for body in [
            &br#"{"model":"m","max_tokens":"100"}"#[..],
            br#"{"model":"m","max_tokens":-5}"#,
            br#"{"model":"m","max_tokens":1.5}"#,
            br#"{"model":"m","max_tokens":null,"n":"x"}"#,
        ] {
            let f = routing_fields(body);
            assert_eq!(
                f.model.as_deref(),
                Some("m"),
                "{}",
                String::from_utf8_lossy(body)
            );
            assert_eq!(f.max_output_tokens, None);
        }
        // A huge n is bounded; a huge max_tokens saturates.
        let f = routing_fields(br#"{"max_tokens":18446744073709551615,"n":1000}"#);
        assert_eq!(f.max_output_tokens, Some(u64::MAX));
        let f = routing_fields(br#"{"max_tokens":10,"n":1000}"#);
        assert_eq!(f.max_output_tokens, Some(1280));
    }
}
