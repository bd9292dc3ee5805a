//! OpenAI-style error bodies: decides the JSON shape clients of the OpenAI API already parse
//! (`{"error": {"message", "type", "param", "code"}}`) for the filter's local replies.
#![deny(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use serde_json::{json, Value};

/// `{"error": {"message": .., "type": .., "param": null, "code": ..}}` as a string.
pub fn openai_error_body(message: &str, error_type: &str, code: Option<&str>) -> String {
    json!({
        "error": {
            "message": message,
            "type": error_type,
            "param": Value::Null,
            "code": code,
        }
    })
    .to_string()
}

#[cfg(test)]
#[allow(clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn escapes_and_shapes() {
        let b = openai_error_body("bad \"quote\"\n", "invalid_request_error", Some("x"));
        let v: Value = serde_json::from_str(&b).unwrap();
        assert_eq!(v["error"]["message"], "bad \"quote\"\n");
        assert_eq!(v["error"]["code"], "x");
        assert!(v["error"]["param"].is_null());
    }
}
