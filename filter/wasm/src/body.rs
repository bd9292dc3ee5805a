//! Decides which model a request asks for when no model header names it: the top-level
//! `model` string of an OpenAI-style JSON body. Anything else (not JSON, no `model`, not a
//! string) means "no model" and the request is picked among all pods.

use serde::Deserialize;

#[derive(Deserialize)]
struct ModelOnly<'a> {
    #[serde(borrow, default)]
    model: Option<std::borrow::Cow<'a, str>>,
}

/// The body's top-level `model`, if it is a non-empty string.
pub fn model_of(body: &[u8]) -> Option<String> {
    // Only an object: serde would also read a struct from a JSON array.
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return None;
    }
    let parsed: ModelOnly<'_> = serde_json::from_slice(body).ok()?;
    parsed
        .model
        .map(|m| m.trim().to_string())
        .filter(|m| !m.is_empty())
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
}
