//! Decides what the picker reads from a request: which API the path names, the model, whether
//! the answer streams, and the prompt as pseudo-tokens for the prefix index. Follows llm-d at
//! ebab68792: the parser registry picks the parser claiming the longest path suffix
//! (`pkg/epp/handlers/parsers.go`), the OpenAI parser
//! (`pkg/epp/framework/plugins/requesthandling/parsers/openai/openai.go`) reads `model`,
//! `stream` and the typed body, and the default token producer, the `estimate` backend
//! (`pkg/epp/framework/plugins/requestcontrol/dataproducer/tokenizer/estimate.go`), packs the
//! request's bytes into little-endian u32 pseudo-tokens of 4 bytes: a chat request's bytes are
//! the tools as Go's `json.Marshal` writes them, then per message its role and its text; a
//! completion's are its prompt (several prompt strings: one pseudo-token sequence each; a
//! token-id prompt: those ids as they are).
//!
//! Not covered (the requests go on with no prompt, i.e. a prefix score of 0, or are refused as
//! llm-d refuses them): multimodal content blocks (images, video, audio: counted and skipped),
//! the embeddings, responses, conversations and images APIs, and the Anthropic and vLLM-HTTP
//! parsers' paths, which fall to the passthrough parser here.

use serde_json::Value;

/// The API a path names (llm-d's OpenAI parser claims, longest suffix first).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    ChatCompletions,
    Completions,
    /// Other paths the OpenAI parser claims: model and stream are read, no prompt.
    OtherOpenAi,
    /// Any other path: llm-d's passthrough parser (no model, no prompt).
    Passthrough,
}

/// Path suffixes the OpenAI parser claims, with the API each means.
const CLAIMS: [(&str, Api); 8] = [
    ("chat/completions", Api::ChatCompletions),
    ("completions", Api::Completions),
    ("embeddings", Api::OtherOpenAi),
    ("responses", Api::OtherOpenAi),
    ("conversations", Api::OtherOpenAi),
    ("chat/completions/render", Api::ChatCompletions),
    ("completions/render", Api::Completions),
    ("images/generations", Api::OtherOpenAi),
];

/// The API of a request path (query stripped); llm-d's default when there is no path is
/// `/v1/completions`.
pub fn api_for_path(path: Option<&str>) -> Api {
    let path = path.filter(|p| !p.is_empty()).unwrap_or("/v1/completions");
    let path = path.split('?').next().unwrap_or("");
    let path = path.trim().trim_end_matches('/');
    let mut best: Option<(usize, Api)> = None;
    for (suffix, api) in CLAIMS {
        if path.ends_with(suffix) && best.is_none_or(|(len, _)| suffix.len() > len) {
            best = Some((suffix.len(), api));
        }
    }
    best.map(|(_, a)| a).unwrap_or(Api::Passthrough)
}

/// What the picker reads from a request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Parsed {
    /// `model` of the body ("" when absent; refused later for OpenAI APIs).
    pub model: String,
    pub stream: bool,
    pub cache_salt: String,
    /// One pseudo-token sequence per prompt.
    pub prompts: Vec<Vec<u32>>,
    /// Multimodal content blocks skipped.
    pub multimodal_skipped: u32,
}

/// A request llm-d answers with 400: its message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BadRequest(pub String);

/// Parses a request body for `api`.
pub fn parse(api: Api, body: &[u8]) -> Result<Parsed, BadRequest> {
    if api == Api::Passthrough {
        return Ok(Parsed::default());
    }
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| BadRequest(format!("error unmarshaling request bodyMap: {e}")))?;
    let obj = v.as_object().ok_or_else(|| {
        BadRequest("error unmarshaling request bodyMap: the body is not a JSON object".into())
    })?;
    let mut p = Parsed {
        model: obj
            .get("model")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string(),
        stream: obj.get("stream").and_then(Value::as_bool).unwrap_or(false),
        ..Parsed::default()
    };
    let salt = |what: &str| -> Result<String, BadRequest> {
        match obj.get("cache_salt") {
            None | Some(Value::Null) => Ok(String::new()),
            Some(Value::String(s)) => Ok(s.clone()),
            Some(_) => Err(BadRequest(format!(
                "invalid {what} request: cache_salt must be a string"
            ))),
        }
    };
    match api {
        Api::ChatCompletions => {
            let bad = || {
                BadRequest(
                    "invalid chat completions request: must have valid messages field".into(),
                )
            };
            let messages = match obj.get("messages") {
                None | Some(Value::Null) => return Err(bad()),
                Some(Value::Array(m)) if !m.is_empty() => m,
                Some(_) => return Err(bad()),
            };
            p.cache_salt = salt("chat completions")?;
            let mut bytes = Vec::new();
            match obj.get("tools") {
                None | Some(Value::Null) => {}
                Some(Value::Array(tools)) => {
                    if !tools.is_empty() {
                        go_json(&Value::Array(tools.clone()), &mut bytes);
                    }
                }
                Some(_) => return Err(bad()),
            }
            for m in messages {
                let m = m.as_object().ok_or_else(bad)?;
                match m.get("role") {
                    None | Some(Value::Null) => {}
                    Some(Value::String(r)) => bytes.extend_from_slice(r.as_bytes()),
                    Some(_) => return Err(bad()),
                }
                match m.get("content") {
                    None | Some(Value::Null) => {}
                    Some(Value::String(s)) => bytes.extend_from_slice(s.as_bytes()),
                    Some(Value::Array(blocks)) => {
                        for b in blocks {
                            let b = b.as_object().ok_or_else(bad)?;
                            let kind = match b.get("type") {
                                None | Some(Value::Null) => "",
                                Some(Value::String(t)) => t.as_str(),
                                Some(_) => return Err(bad()),
                            };
                            match kind {
                                "text" => match b.get("text") {
                                    None | Some(Value::Null) => {}
                                    Some(Value::String(t)) => bytes.extend_from_slice(t.as_bytes()),
                                    Some(_) => return Err(bad()),
                                },
                                "image_url" | "video_url" | "input_audio" | "audio_url" => {
                                    p.multimodal_skipped += 1
                                }
                                _ => {}
                            }
                        }
                    }
                    Some(_) => return Err(bad()),
                }
            }
            p.prompts = vec![pack_bytes(&bytes)];
        }
        Api::Completions => {
            let bad = || BadRequest("invalid completions request: must have prompt field".into());
            p.cache_salt = salt("completions")?;
            match obj.get("prompt") {
                Some(Value::String(s)) if !s.is_empty() => {
                    p.prompts = vec![pack_bytes(s.as_bytes())];
                }
                Some(Value::Array(items)) if !items.is_empty() => {
                    if items.iter().all(Value::is_string) {
                        let strings: Vec<&str> = items.iter().filter_map(Value::as_str).collect();
                        if strings.len() > 1 {
                            p.prompts = strings.iter().map(|s| pack_bytes(s.as_bytes())).collect();
                        } else {
                            p.prompts = vec![pack_bytes(strings.concat().as_bytes())];
                        }
                    } else if items.iter().all(Value::is_number) {
                        let ids = items
                            .iter()
                            .map(|n| {
                                // Go's check: float64(uint32(f)) == f.
                                n.as_f64()
                                    .filter(|f| {
                                        f.fract() == 0.0 && (0.0..=f64::from(u32::MAX)).contains(f)
                                    })
                                    .map(|f| f as u32)
                                    .ok_or_else(|| {
                                        BadRequest(format!(
                                            "prompt: floating-point number {n} is not a valid token ID"
                                        ))
                                    })
                            })
                            .collect::<Result<Vec<u32>, _>>()?;
                        p.prompts = vec![ids];
                    } else {
                        return Err(BadRequest("prompt: mixed types in array".into()));
                    }
                }
                _ => return Err(bad()),
            }
        }
        Api::OtherOpenAi | Api::Passthrough => {}
    }
    // An empty prompt has no blocks (llm-d skips hashing when the token count is 0).
    p.prompts.retain(|t| !t.is_empty());
    Ok(p)
}

/// llm-d's `packBytes`: the bytes zero-padded to a multiple of 4, read as little-endian u32s.
pub fn pack_bytes(raw: &[u8]) -> Vec<u32> {
    raw.chunks(4)
        .map(|c| {
            let mut w = [0u8; 4];
            w[..c.len()].copy_from_slice(c);
            u32::from_le_bytes(w)
        })
        .collect()
}

/// Writes `v` as Go's `encoding/json.Marshal` writes the same value decoded into `any`: object
/// keys sorted, no spaces, `<`, `>`, `&`, U+2028 and U+2029 escaped, numbers as float64.
pub fn go_json(v: &Value, out: &mut Vec<u8>) {
    match v {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(b) => out.extend_from_slice(if *b { b"true" } else { b"false" }),
        Value::Number(n) => out.extend_from_slice(go_float(n.as_f64().unwrap_or(0.0)).as_bytes()),
        Value::String(s) => go_string(s, out),
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                go_json(item, out);
            }
            out.push(b']');
        }
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push(b'{');
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                go_string(k, out);
                out.push(b':');
                if let Some(item) = map.get(k) {
                    go_json(item, out);
                }
            }
            out.push(b'}');
        }
    }
}

fn go_string(s: &str, out: &mut Vec<u8>) {
    out.push(b'"');
    for c in s.chars() {
        match c {
            '"' => out.extend_from_slice(b"\\\""),
            '\\' => out.extend_from_slice(b"\\\\"),
            '\n' => out.extend_from_slice(b"\\n"),
            '\r' => out.extend_from_slice(b"\\r"),
            '\t' => out.extend_from_slice(b"\\t"),
            '\u{8}' => out.extend_from_slice(b"\\b"),
            '\u{c}' => out.extend_from_slice(b"\\f"),
            '<' | '>' | '&' | '\u{2028}' | '\u{2029}' => {
                out.extend_from_slice(format!("\\u{:04x}", c as u32).as_bytes())
            }
            c if (c as u32) < 0x20 => {
                out.extend_from_slice(format!("\\u{:04x}", c as u32).as_bytes())
            }
            c => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
    out.push(b'"');
}

/// Go's float64 JSON form: plain decimal for 1e-6 <= |f| < 1e21 (and 0), else exponent form
/// with a signed, unpadded exponent.
fn go_float(f: f64) -> String {
    let a = f.abs();
    if a == 0.0 || (1e-6..1e21).contains(&a) {
        // Rust's Display is the shortest round-trip decimal, never in exponent form.
        format!("{f}")
    } else {
        let e = format!("{f:e}");
        match e.split_once('e') {
            Some((m, exp)) if !exp.starts_with('-') => format!("{m}e+{exp}"),
            _ => e,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_pick_the_longest_claimed_suffix() {
        assert_eq!(
            api_for_path(Some("/v1/chat/completions")),
            Api::ChatCompletions
        );
        assert_eq!(
            api_for_path(Some("/v1/chat/completions/?x=1")),
            Api::ChatCompletions
        );
        assert_eq!(api_for_path(Some("/v1/completions")), Api::Completions);
        assert_eq!(
            api_for_path(Some("/v1/completions/render")),
            Api::Completions
        );
        assert_eq!(api_for_path(Some("/v1/embeddings")), Api::OtherOpenAi);
        assert_eq!(api_for_path(Some("/v1/messages")), Api::Passthrough);
        assert_eq!(api_for_path(Some("/healthz")), Api::Passthrough);
        assert_eq!(api_for_path(None), Api::Completions);
    }

    #[test]
    fn pack_bytes_pads_the_tail_with_zeros() {
        assert_eq!(pack_bytes(b""), Vec::<u32>::new());
        assert_eq!(pack_bytes(b"abcd"), vec![u32::from_le_bytes(*b"abcd")]);
        assert_eq!(
            pack_bytes(b"abcdef"),
            vec![u32::from_le_bytes(*b"abcd"), u32::from_le_bytes(*b"ef\0\0")]
        );
    }

    #[test]
    fn chat_bytes_are_tools_then_role_and_text_per_message() {
        let body = br#"{"model":"m","stream":true,"cache_salt":"s",
            "tools":[{"type":"function","function":{"name":"f<x>"}}],
            "messages":[{"role":"system","content":"be brief"},
                        {"role":"user","content":[{"type":"text","text":"hi"},
                                                  {"type":"image_url","image_url":{"url":"http://x"}},
                                                  {"type":"text","text":"!"}]}]}"#;
        let p = parse(Api::ChatCompletions, body).unwrap();
        assert_eq!(p.model, "m");
        assert!(p.stream);
        assert_eq!(p.cache_salt, "s");
        assert_eq!(p.multimodal_skipped, 1);
        let want = concat!(
            r#"[{"function":{"name":"f\u003cx\u003e"},"type":"function"}]"#,
            "systembe brief",
            "userhi!"
        );
        assert_eq!(p.prompts, vec![pack_bytes(want.as_bytes())]);
    }

    #[test]
    fn chat_requests_llm_d_refuses_are_refused() {
        for body in [
            &br#"{"model":"m"}"#[..],
            br#"{"model":"m","messages":[]}"#,
            br#"{"model":"m","messages":"hi"}"#,
            br#"{"model":"m","messages":[{"role":"user","content":5}]}"#,
            br#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":5}]}]}"#,
        ] {
            let e = parse(Api::ChatCompletions, body).unwrap_err();
            assert!(e.0.contains("messages"), "{e}");
        }
        let e = parse(Api::ChatCompletions, b"{nope").unwrap_err();
        assert!(e.0.starts_with("error unmarshaling request bodyMap"), "{e}");
    }

    #[test]
    fn completions_prompt_forms() {
        let p = parse(Api::Completions, br#"{"model":"m","prompt":"hello world"}"#).unwrap();
        assert_eq!(p.prompts, vec![pack_bytes(b"hello world")]);
        assert!(!p.stream);
        let p = parse(Api::Completions, br#"{"model":"m","prompt":["ab","cd"]}"#).unwrap();
        assert_eq!(p.prompts, vec![pack_bytes(b"ab"), pack_bytes(b"cd")]);
        let p = parse(Api::Completions, br#"{"model":"m","prompt":["only"]}"#).unwrap();
        assert_eq!(p.prompts, vec![pack_bytes(b"only")]);
        let p = parse(Api::Completions, br#"{"model":"m","prompt":[1,2,3.0]}"#).unwrap();
        assert_eq!(p.prompts, vec![vec![1, 2, 3]]);
        for (body, want) in [
            (&br#"{"model":"m"}"#[..], "must have prompt"),
            (br#"{"model":"m","prompt":""}"#, "must have prompt"),
            (br#"{"model":"m","prompt":[]}"#, "must have prompt"),
            (br#"{"model":"m","prompt":[1,"a"]}"#, "mixed types"),
            (br#"{"model":"m","prompt":[1.5]}"#, "not a valid token ID"),
            (br#"{"model":"m","prompt":[-1]}"#, "not a valid token ID"),
        ] {
            let e = parse(Api::Completions, body).unwrap_err();
            assert!(e.0.contains(want), "{body:?}: {e}");
        }
    }

    #[test]
    fn passthrough_and_other_apis_carry_no_prompt() {
        assert_eq!(
            parse(Api::Passthrough, b"not json").unwrap(),
            Parsed::default()
        );
        let p = parse(Api::OtherOpenAi, br#"{"model":"e","input":"x"}"#).unwrap();
        assert_eq!(p.model, "e");
        assert!(p.prompts.is_empty());
    }

    #[test]
    fn go_json_matches_gos_marshal() {
        let v: Value = serde_json::from_str(
            r#"{"b":[1,2.5,1e-7,1e21,true,null],"a":"q\"\\\n\t<&>\u2028\u0001"}"#,
        )
        .unwrap();
        let mut out = Vec::new();
        go_json(&v, &mut out);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            r#"{"a":"q\"\\\n\t\u003c\u0026\u003e\u2028\u0001","b":[1,2.5,1e-7,1e+21,true,null]}"#
        );
    }
}
