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
