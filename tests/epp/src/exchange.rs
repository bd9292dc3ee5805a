//! Decides what the picker answers on one Envoy ext_proc stream (one HTTP request), message by
//! message, as llm-d's handler does at ebab68792 (`pkg/epp/handlers/{server.go,request.go,
//! response.go}`, `pkg/common/envoy/{chunking.go,request.go}`, `pkg/common/error/error.go`) with
//! both bodies in FULL_DUPLEX_STREAMED mode:
//!
//! - request headers: kept (names lower-cased); no answer yet. A request without a body
//!   (headers end the stream) goes at once to a random pod (500 if there is none).
//! - request body: buffered until its end; then the body is parsed (400 if llm-d's parser
//!   refuses it, or names no model), a pod is picked (503 with
//!   `x-llm-d-request-dropped-reason: rejected-no-endpoints` if the pool is empty), and the
//!   picker answers the headers, with `x-gateway-destination-endpoint: IP:PORT`,
//!   `Content-Length`, every other request header set again (llm-d re-sets all headers that
//!   are not its own control headers), `clear_route_cache` and the dynamic metadata
//!   `envoy.lb/x-gateway-destination-endpoint`; then the body, streamed back in pieces of at
//!   most 62 000 bytes, the last one ending the stream.
//! - response headers: answered with `x-went-into-resp-headers: true` and the response's
//!   headers set again; `content-type: text/event-stream` (or `"stream": true` in the request)
//!   makes the response a stream.
//! - response body: a stream is echoed chunk by chunk as it comes; any other response is
//!   buffered and sent back whole at its end. Token usage is read from it for the counters.
//! - response trailers: the buffered body (not ending the stream) and an empty trailers answer.
//! - request trailers: ignored, as llm-d ignores them (counted).
//!
//! An error answer is an ImmediateResponse after which the stream is closed. Pure: routing is
//! asked of a [`Router`] and counters go to [`Stats`].

use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_request, processing_response, BodyMutation, BodyResponse,
    CommonResponse, HeaderMutation, HeadersResponse, HttpHeaders, ImmediateResponse,
    ProcessingRequest, ProcessingResponse, StreamedBodyResponse, TrailersResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value as PbValue};

use crate::request::{self, Api};
use crate::scheduler::{SchedRequest, ScheduleError};
use crate::stats::Stats;

/// llm-d's `BodyByteLimit`: the largest body piece sent back to Envoy.
pub const BODY_BYTE_LIMIT: usize = 62_000;
/// The header and metadata key carrying the picked endpoint.
pub const DESTINATION_ENDPOINT: &str = "x-gateway-destination-endpoint";
/// The dynamic metadata namespace Envoy's load balancers read.
pub const METADATA_NAMESPACE: &str = "envoy.lb";
/// The header saying why a request was dropped.
pub const DROPPED_REASON: &str = "x-llm-d-request-dropped-reason";
/// The response header llm-d adds to every answered response ("for debugging purposes").
pub const WENT_INTO_RESP_HEADERS: &str = "x-went-into-resp-headers";

/// Headers llm-d never sets again (`pkg/epp/util/request/headers.go`: its input control
/// headers with their old names, the headers it injects, and content-length).
const SYSTEM_OWNED: [&str; 17] = [
    "x-llm-d-inference-fairness-id",
    "x-gateway-inference-fairness-id",
    "x-llm-d-inference-objective",
    "x-gateway-inference-objective",
    "x-llm-d-model-name-rewrite",
    "x-gateway-model-name-rewrite",
    "x-gateway-destination-endpoint-subset",
    "x-llm-d-slo-ttft-ms",
    "x-slo-ttft-ms",
    "x-llm-d-slo-tpot-ms",
    "x-slo-tpot-ms",
    "x-llm-d-video-fps",
    "x-llm-d-video-duration-seconds",
    "x-llm-d-video-resolution",
    "x-gateway-destination-endpoint",
    "x-gateway-destination-endpoint-served",
    "x-llm-d-request-dropped-reason",
];

fn is_system_owned(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    k == "content-length" || SYSTEM_OWNED.contains(&k.as_str())
}

/// Where a scheduled request goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Routed {
    /// `IP:PORT` of the chosen pod.
    pub endpoint: String,
}

/// What the exchange asks of the pool.
pub trait Router {
    /// Picks a pod for a parsed request (and records the pick).
    fn route(&self, req: &SchedRequest<'_>) -> Result<Routed, ScheduleError>;
    /// A random pod for a request without a body (and records the pick).
    fn random_endpoint(&self) -> Option<String>;
}

/// What to do after a message: answers to send, in order, and whether to end the stream.
#[derive(Debug, Default)]
pub struct Step {
    pub send: Vec<ProcessingResponse>,
    pub close: bool,
}

/// llm-d's error kinds and the HTTP status each becomes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ErrCode {
    BadRequest,
    Internal,
    ServiceUnavailable,
}

impl ErrCode {
    fn status(self) -> i32 {
        match self {
            ErrCode::BadRequest => 400,
            ErrCode::Internal => 500,
            ErrCode::ServiceUnavailable => 503,
        }
    }

    fn name(self) -> &'static str {
        match self {
            ErrCode::BadRequest => "BadRequest",
            ErrCode::Internal => "Internal",
            ErrCode::ServiceUnavailable => "ServiceUnavailable",
        }
    }
}

/// The state of one ext_proc stream.
#[derive(Debug, Default)]
pub struct Exchange {
    /// Request headers, names lower-cased, a later value replacing an earlier one.
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    /// The request headers and body were answered.
    request_answered: bool,
    /// The response is a stream (SSE content type, or `"stream": true`).
    streaming: bool,
    /// `content-type: text/event-stream` (how usage is read).
    event_stream: bool,
    response_headers: Vec<(String, String)>,
    response_body: Vec<u8>,
    response_complete: bool,
}

fn set_header(key: &str, value: &[u8]) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_string(),
            raw_value: value.to_vec(),
            ..HeaderValue::default()
        }),
        ..HeaderValueOption::default()
    }
}

fn header_text(h: &HeaderValue) -> String {
    if h.raw_value.is_empty() {
        h.value.clone()
    } else {
        String::from_utf8_lossy(&h.raw_value).into_owned()
    }
}

fn put(headers: &mut Vec<(String, String)>, key: String, value: String) {
    match headers.iter_mut().find(|(k, _)| *k == key) {
        Some(slot) => slot.1 = value,
        None => headers.push((key, value)),
    }
}

/// llm-d's `BuildChunkedBodyResponses`: the body in pieces of at most [`BODY_BYTE_LIMIT`]
/// bytes (one empty piece for an empty body), the last one ending the stream if `eos`.
pub fn chunked(body: &[u8], eos: bool) -> Vec<StreamedBodyResponse> {
    if body.is_empty() {
        return vec![StreamedBodyResponse {
            body: Vec::new(),
            end_of_stream: eos,
            ..StreamedBodyResponse::default()
        }];
    }
    let n = body.len().div_ceil(BODY_BYTE_LIMIT);
    body.chunks(BODY_BYTE_LIMIT)
        .enumerate()
        .map(|(i, c)| StreamedBodyResponse {
            body: c.to_vec(),
            end_of_stream: eos && i + 1 == n,
            ..StreamedBodyResponse::default()
        })
        .collect()
}

fn body_answers(body: &[u8], eos: bool, request: bool) -> Vec<ProcessingResponse> {
    chunked(body, eos)
        .into_iter()
        .map(|piece| {
            let r = BodyResponse {
                response: Some(CommonResponse {
                    body_mutation: Some(BodyMutation {
                        mutation: Some(body_mutation::Mutation::StreamedResponse(piece)),
                    }),
                    ..CommonResponse::default()
                }),
            };
            ProcessingResponse {
                response: Some(if request {
                    processing_response::Response::RequestBody(r)
                } else {
                    processing_response::Response::ResponseBody(r)
                }),
                ..ProcessingResponse::default()
            }
        })
        .collect()
}

fn destination_metadata(endpoint: &str) -> Struct {
    let inner = Struct {
        fields: [(
            DESTINATION_ENDPOINT.to_string(),
            PbValue {
                kind: Some(Kind::StringValue(endpoint.to_string())),
            },
        )]
        .into_iter()
        .collect(),
    };
    Struct {
        fields: [(
            METADATA_NAMESPACE.to_string(),
            PbValue {
                kind: Some(Kind::StructValue(inner)),
            },
        )]
        .into_iter()
        .collect(),
    }
}

fn immediate(code: ErrCode, msg: &str, headers: &[(&str, &str)]) -> Step {
    let text = format!("inference error: {} - {msg}", code.name());
    let mutation = (!headers.is_empty()).then(|| HeaderMutation {
        set_headers: headers
            .iter()
            .map(|(k, v)| set_header(k, v.as_bytes()))
            .collect(),
        ..HeaderMutation::default()
    });
    Step {
        send: vec![ProcessingResponse {
            response: Some(processing_response::Response::ImmediateResponse(
                ImmediateResponse {
                    status: Some(HttpStatus {
                        code: code.status(),
                    }),
                    headers: mutation,
                    body: text.into_bytes(),
                    ..ImmediateResponse::default()
                },
            )),
            ..ProcessingResponse::default()
        }],
        close: true,
    }
}

/// `(prompt_tokens, completion_tokens)` of a `usage` object (llm-d's `toInt`: numbers
/// truncated, numeric strings parsed, anything else 0).
fn usage_of(v: &serde_json::Value) -> Option<(u64, u64)> {
    let u = v.get("usage")?.as_object()?;
    let int = |k: &str| -> u64 {
        match u.get(k) {
            Some(serde_json::Value::Number(n)) => n.as_f64().map_or(0, |f| f.max(0.0) as u64),
            Some(serde_json::Value::String(s)) => s.parse::<f64>().map_or(0, |f| f.max(0.0) as u64),
            _ => 0,
        }
    };
    Some((int("prompt_tokens"), int("completion_tokens")))
}

/// Usage in a chunk of server-sent events: the first `data:` line mentioning `usage` that
/// parses and has a `usage` object.
fn usage_in_events(chunk: &[u8]) -> Option<(u64, u64)> {
    for line in chunk.split(|b| *b == b'\n') {
        let Some(content) = line.strip_prefix(b"data: ") else {
            continue;
        };
        let content = content.strip_suffix(b"\r").unwrap_or(content);
        if content == b"[DONE]" || !content.windows(5).any(|w| w == b"usage") {
            continue;
        }
        if let Ok(v) = serde_json::from_slice::<serde_json::Value>(content) {
            if let Some(u) = usage_of(&v) {
                return Some(u);
            }
        }
    }
    None
}

impl Exchange {
    pub fn new() -> Exchange {
        Exchange::default()
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    fn count_usage(&self, stats: &Stats, usage: Option<(u64, u64)>) {
        if let Some((p, c)) = usage {
            stats.usage_prompt_tokens.add(p);
            stats.usage_completion_tokens.add(c);
        }
    }

    /// Handles one message from Envoy.
    pub fn on_message(
        &mut self,
        msg: ProcessingRequest,
        router: &dyn Router,
        stats: &Stats,
    ) -> Step {
        use processing_request::Request as R;
        match msg.request {
            Some(R::RequestHeaders(h)) => self.on_request_headers(h, router, stats),
            Some(R::RequestBody(b)) => {
                if self.request_answered {
                    stats.unexpected_messages.inc();
                    return Step::default();
                }
                self.body.extend_from_slice(&b.body);
                if !b.end_of_stream {
                    return Step::default();
                }
                self.on_request_end(router, stats)
            }
            Some(R::RequestTrailers(_)) => {
                stats.request_trailers_ignored.inc();
                Step::default()
            }
            Some(R::ResponseHeaders(h)) => self.on_response_headers(h, stats),
            Some(R::ResponseBody(b)) => self.on_response_body(&b.body, b.end_of_stream, stats),
            Some(R::ResponseTrailers(_)) => {
                let mut send = Vec::new();
                if !self.response_complete {
                    self.response_complete = true;
                    if !self.streaming {
                        self.count_usage(
                            stats,
                            serde_json::from_slice(&self.response_body)
                                .ok()
                                .as_ref()
                                .and_then(usage_of),
                        );
                        send = body_answers(&std::mem::take(&mut self.response_body), false, false);
                    }
                }
                send.push(ProcessingResponse {
                    response: Some(processing_response::Response::ResponseTrailers(
                        TrailersResponse::default(),
                    )),
                    ..ProcessingResponse::default()
                });
                Step { send, close: false }
            }
            None => {
                stats.unexpected_messages.inc();
                Step::default()
            }
        }
    }

    fn on_request_headers(&mut self, h: HttpHeaders, router: &dyn Router, stats: &Stats) -> Step {
        if h.end_of_stream {
            // No body: a random pod (llm-d's fallbackToRandomEndpoint); the headers are not
            // kept, so none are set again.
            return match router.random_endpoint() {
                Some(endpoint) => {
                    self.request_answered = true;
                    Step {
                        send: vec![self.request_headers_answer(&endpoint, 0)],
                        close: false,
                    }
                }
                None => {
                    stats.internal_500.inc();
                    immediate(ErrCode::Internal, "no pods available in datastore", &[])
                }
            };
        }
        for hv in h.headers.unwrap_or_default().headers {
            put(
                &mut self.headers,
                hv.key.to_ascii_lowercase(),
                header_text(&hv),
            );
        }
        Step::default()
    }

    fn on_request_end(&mut self, router: &dyn Router, stats: &Stats) -> Step {
        let path = self
            .header(":path")
            .or_else(|| self.header("x-original-path"))
            .or_else(|| self.header("x-forwarded-path"))
            .map(str::to_string);
        let api = request::api_for_path(path.as_deref());
        let parsed = match request::parse(api, &self.body) {
            Ok(p) => p,
            Err(e) => {
                stats.bad_request_400.inc();
                return immediate(ErrCode::BadRequest, &e.0, &[]);
            }
        };
        stats
            .multimodal_blocks_skipped
            .add(u64::from(parsed.multimodal_skipped));
        if api != Api::Passthrough && parsed.model.is_empty() {
            stats.bad_request_400.inc();
            return immediate(ErrCode::BadRequest, "model not found in request body", &[]);
        }
        let routed = router.route(&SchedRequest {
            model: &parsed.model,
            cache_salt: &parsed.cache_salt,
            prompts: &parsed.prompts,
        });
        let endpoint = match routed {
            Ok(r) => r.endpoint,
            Err(e @ ScheduleError::NoCandidates) => {
                stats.no_pod_503.inc();
                return immediate(
                    ErrCode::ServiceUnavailable,
                    &e.to_string(),
                    &[(DROPPED_REASON, "rejected-no-endpoints")],
                );
            }
        };
        self.streaming = parsed.stream;
        self.request_answered = true;
        let body = std::mem::take(&mut self.body);
        let mut send = vec![self.request_headers_answer(&endpoint, body.len())];
        send.extend(body_answers(&body, true, true));
        Step { send, close: false }
    }

    /// llm-d's `generateRequestHeaderResponse`.
    fn request_headers_answer(&self, endpoint: &str, body_len: usize) -> ProcessingResponse {
        let mut set = vec![set_header(DESTINATION_ENDPOINT, endpoint.as_bytes())];
        if body_len > 0 {
            set.push(set_header(
                "Content-Length",
                body_len.to_string().as_bytes(),
            ));
        }
        for (k, v) in &self.headers {
            if !is_system_owned(k) {
                set.push(set_header(k, v.as_bytes()));
            }
        }
        ProcessingResponse {
            response: Some(processing_response::Response::RequestHeaders(
                HeadersResponse {
                    response: Some(CommonResponse {
                        clear_route_cache: true,
                        header_mutation: Some(HeaderMutation {
                            set_headers: set,
                            ..HeaderMutation::default()
                        }),
                        ..CommonResponse::default()
                    }),
                },
            )),
            dynamic_metadata: Some(destination_metadata(endpoint)),
            ..ProcessingResponse::default()
        }
    }

    /// Whether the response went back whole (Envoy resets the stream once the request is
    /// over; that reset ends a complete exchange, not a failed one).
    pub fn response_complete(&self) -> bool {
        self.response_complete
    }

    fn on_response_headers(&mut self, h: HttpHeaders, stats: &Stats) -> Step {
        if h.end_of_stream {
            self.response_complete = true;
        }
        for hv in h.headers.unwrap_or_default().headers {
            let v = header_text(&hv);
            if hv.key == "content-type" && v.contains("text/event-stream") {
                self.streaming = true;
                self.event_stream = true;
            }
            put(&mut self.response_headers, hv.key, v);
        }
        if self.streaming {
            stats.responses_streamed.inc();
        } else {
            stats.responses_buffered.inc();
        }
        let mut set = vec![set_header(WENT_INTO_RESP_HEADERS, b"true")];
        for (k, v) in &self.response_headers {
            if !is_system_owned(k) {
                set.push(set_header(k, v.as_bytes()));
            }
        }
        Step {
            send: vec![ProcessingResponse {
                response: Some(processing_response::Response::ResponseHeaders(
                    HeadersResponse {
                        response: Some(CommonResponse {
                            header_mutation: Some(HeaderMutation {
                                set_headers: set,
                                ..HeaderMutation::default()
                            }),
                            ..CommonResponse::default()
                        }),
                    },
                )),
                ..ProcessingResponse::default()
            }],
            close: false,
        }
    }

    fn on_response_body(&mut self, chunk: &[u8], eos: bool, stats: &Stats) -> Step {
        if self.response_complete {
            stats.unexpected_messages.inc();
            return Step::default();
        }
        if self.streaming {
            if eos {
                self.response_complete = true;
            }
            if self.event_stream {
                self.count_usage(stats, usage_in_events(chunk));
            }
            return Step {
                send: body_answers(chunk, eos, false),
                close: false,
            };
        }
        self.response_body.extend_from_slice(chunk);
        if !eos {
            return Step::default();
        }
        self.response_complete = true;
        let body = std::mem::take(&mut self.response_body);
        self.count_usage(
            stats,
            serde_json::from_slice(&body)
                .ok()
                .as_ref()
                .and_then(usage_of),
        );
        Step {
            send: body_answers(&body, true, false),
            close: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::config::core::v3::HeaderMap;
    use envoy_types::pb::envoy::service::ext_proc::v3::{HttpBody, HttpTrailers};
    use std::cell::RefCell;

    /// What the router was asked: model, cache salt, prompts.
    type Asked = (String, String, Vec<Vec<u32>>);

    /// A router that records what it was asked and answers with fixed endpoints.
    #[derive(Default)]
    struct FakeRouter {
        endpoint: Option<String>,
        asked: RefCell<Vec<Asked>>,
    }

    impl Router for FakeRouter {
        fn route(&self, req: &SchedRequest<'_>) -> Result<Routed, ScheduleError> {
            self.asked.borrow_mut().push((
                req.model.to_string(),
                req.cache_salt.to_string(),
                req.prompts.to_vec(),
            ));
            self.endpoint
                .clone()
                .map(|endpoint| Routed { endpoint })
                .ok_or(ScheduleError::NoCandidates)
        }
        fn random_endpoint(&self) -> Option<String> {
            self.endpoint.clone()
        }
    }

    fn router(ep: Option<&str>) -> FakeRouter {
        FakeRouter {
            endpoint: ep.map(str::to_string),
            ..FakeRouter::default()
        }
    }

    fn headers(list: &[(&str, &str)], eos: bool) -> ProcessingRequest {
        ProcessingRequest {
            request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
                headers: Some(HeaderMap {
                    headers: list
                        .iter()
                        .map(|(k, v)| HeaderValue {
                            key: k.to_string(),
                            raw_value: v.as_bytes().to_vec(),
                            ..HeaderValue::default()
                        })
                        .collect(),
                }),
                end_of_stream: eos,
                ..HttpHeaders::default()
            })),
            ..ProcessingRequest::default()
        }
    }

    fn resp_headers(list: &[(&str, &str)]) -> ProcessingRequest {
        let mut m = headers(list, false);
        if let Some(processing_request::Request::RequestHeaders(h)) = m.request.take() {
            m.request = Some(processing_request::Request::ResponseHeaders(h));
        }
        m
    }

    /// An exchange that has passed a whole request (headers to `path`, then `req`) to `r`.
    fn requested(path: &str, req: &[u8], r: &FakeRouter, stats: &Stats) -> Exchange {
        let mut x = Exchange::new();
        x.on_message(headers(&[(":path", path)], false), r, stats);
        x.on_message(body(req, true), r, stats);
        x
    }

    fn body(b: &[u8], eos: bool) -> ProcessingRequest {
        ProcessingRequest {
            request: Some(processing_request::Request::RequestBody(HttpBody {
                body: b.to_vec(),
                end_of_stream: eos,
                ..HttpBody::default()
            })),
            ..ProcessingRequest::default()
        }
    }

    fn resp_body(b: &[u8], eos: bool) -> ProcessingRequest {
        let mut m = body(b, eos);
        if let Some(processing_request::Request::RequestBody(x)) = m.request.take() {
            m.request = Some(processing_request::Request::ResponseBody(x));
        }
        m
    }

    fn set_headers(r: &ProcessingResponse) -> Vec<(String, String)> {
        let common = match &r.response {
            Some(processing_response::Response::RequestHeaders(h))
            | Some(processing_response::Response::ResponseHeaders(h)) => h.response.clone(),
            other => panic!("not a headers answer: {other:?}"),
        };
        common
            .and_then(|c| c.header_mutation)
            .map(|m| {
                m.set_headers
                    .into_iter()
                    .filter_map(|o| o.header)
                    .map(|h| (h.key, String::from_utf8_lossy(&h.raw_value).into_owned()))
                    .collect()
            })
            .unwrap_or_default()
    }

    fn streamed(r: &ProcessingResponse) -> (Vec<u8>, bool) {
        let common = match &r.response {
            Some(processing_response::Response::RequestBody(b))
            | Some(processing_response::Response::ResponseBody(b)) => b.response.clone(),
            other => panic!("not a body answer: {other:?}"),
        };
        match common
            .and_then(|c| c.body_mutation)
            .and_then(|m| m.mutation)
        {
            Some(body_mutation::Mutation::StreamedResponse(s)) => (s.body, s.end_of_stream),
            other => panic!("not a streamed body: {other:?}"),
        }
    }

    fn immediate_of(step: &Step) -> (i32, String, Vec<(String, String)>) {
        assert!(step.close, "an error answer ends the stream");
        match &step.send[..] {
            [ProcessingResponse {
                response: Some(processing_response::Response::ImmediateResponse(ir)),
                ..
            }] => (
                ir.status.map(|s| s.code).unwrap_or(0),
                String::from_utf8_lossy(&ir.body).into_owned(),
                ir.headers
                    .clone()
                    .map(|m| {
                        m.set_headers
                            .into_iter()
                            .filter_map(|o| o.header)
                            .map(|h| (h.key, String::from_utf8_lossy(&h.raw_value).into_owned()))
                            .collect()
                    })
                    .unwrap_or_default(),
            ),
            other => panic!("expected one immediate response, got {other:?}"),
        }
    }

    const CHAT: &[u8] = br#"{"model":"m","messages":[{"role":"user","content":"hello there"}]}"#;

    #[test]
    fn a_chat_request_is_buffered_then_routed_with_header_metadata_and_body_echoed() {
        let r = router(Some("10.0.0.7:8000"));
        let stats = Stats::new(1);
        let mut x = Exchange::new();
        let s = x.on_message(
            headers(
                &[
                    (":path", "/v1/chat/completions"),
                    (":method", "POST"),
                    ("Content-Type", "application/json"),
                    ("x-gateway-destination-endpoint", "1.2.3.4:5"),
                    ("content-length", "66"),
                ],
                false,
            ),
            &r,
            &stats,
        );
        assert!(s.send.is_empty() && !s.close);
        assert!(x
            .on_message(body(&CHAT[..10], false), &r, &stats)
            .send
            .is_empty());
        let s = x.on_message(body(&CHAT[10..], true), &r, &stats);
        assert!(!s.close);
        assert_eq!(s.send.len(), 2, "headers answer then one body piece");
        let set = set_headers(&s.send[0]);
        assert_eq!(
            set[0],
            (
                "x-gateway-destination-endpoint".into(),
                "10.0.0.7:8000".into()
            )
        );
        assert_eq!(set[1], ("Content-Length".into(), CHAT.len().to_string()));
        // Every other header set again; the client's destination and content-length are not.
        assert!(set.contains(&(":path".into(), "/v1/chat/completions".into())));
        assert!(set.contains(&("content-type".into(), "application/json".into())));
        assert_eq!(
            set.iter()
                .filter(|(k, _)| k.eq_ignore_ascii_case("x-gateway-destination-endpoint"))
                .count(),
            1
        );
        assert_eq!(
            set.iter()
                .filter(|(k, _)| k.eq_ignore_ascii_case("content-length"))
                .count(),
            1
        );
        match &s.send[0].response {
            Some(processing_response::Response::RequestHeaders(h)) => {
                assert!(h.response.as_ref().is_some_and(|c| c.clear_route_cache))
            }
            other => panic!("{other:?}"),
        }
        let md = s.send[0].dynamic_metadata.clone().unwrap();
        match md.fields["envoy.lb"].kind.clone() {
            Some(Kind::StructValue(inner)) => assert_eq!(
                inner.fields["x-gateway-destination-endpoint"].kind,
                Some(Kind::StringValue("10.0.0.7:8000".into()))
            ),
            other => panic!("{other:?}"),
        }
        assert_eq!(streamed(&s.send[1]), (CHAT.to_vec(), true));
        let asked = r.asked.borrow();
        assert_eq!(asked.len(), 1);
        assert_eq!(asked[0].0, "m");
        assert_eq!(asked[0].2, vec![request::pack_bytes(b"userhello there")]);
    }

    #[test]
    fn large_bodies_go_back_in_62000_byte_pieces() {
        let pieces = chunked(&vec![7u8; 130_000], true);
        let sizes: Vec<(usize, bool)> = pieces
            .iter()
            .map(|p| (p.body.len(), p.end_of_stream))
            .collect();
        assert_eq!(sizes, vec![(62_000, false), (62_000, false), (6_000, true)]);
        let empty = chunked(b"", true);
        assert_eq!(empty.len(), 1);
        assert!(empty[0].end_of_stream && empty[0].body.is_empty());
        assert!(!chunked(b"abc", false)[0].end_of_stream);
    }

    #[test]
    fn an_empty_pool_answers_503_with_the_dropped_reason() {
        let r = router(None);
        let stats = Stats::new(0);
        let mut x = Exchange::new();
        x.on_message(headers(&[(":path", "/v1/completions")], false), &r, &stats);
        let s = x.on_message(body(br#"{"model":"m","prompt":"hi"}"#, true), &r, &stats);
        let (status, text, hdrs) = immediate_of(&s);
        assert_eq!(status, 503);
        assert_eq!(text, "inference error: ServiceUnavailable - failed to find endpoint candidates for serving the request");
        assert_eq!(
            hdrs,
            vec![(
                "x-llm-d-request-dropped-reason".into(),
                "rejected-no-endpoints".into()
            )]
        );
        assert_eq!(stats.no_pod_503.get(), 1);
    }

    #[test]
    fn bad_bodies_and_missing_models_answer_400_and_are_not_routed() {
        for (path, b, want) in [
            (
                "/v1/chat/completions",
                &b"{not json"[..],
                "error unmarshaling request bodyMap",
            ),
            (
                "/v1/chat/completions",
                br#"{"model":"m"}"#,
                "must have valid messages field",
            ),
            (
                "/v1/completions",
                br#"{"prompt":"x"}"#,
                "model not found in request body",
            ),
        ] {
            let r = router(Some("1.1.1.1:1"));
            let stats = Stats::new(1);
            let mut x = Exchange::new();
            x.on_message(headers(&[(":path", path)], false), &r, &stats);
            let s = x.on_message(body(b, true), &r, &stats);
            let (status, text, _) = immediate_of(&s);
            assert_eq!(status, 400);
            assert!(
                text.starts_with("inference error: BadRequest - ") && text.contains(want),
                "{text}"
            );
            assert_eq!(stats.bad_request_400.get(), 1);
            assert!(r.asked.borrow().is_empty());
        }
    }

    #[test]
    fn a_passthrough_path_is_routed_without_a_prompt_or_model() {
        let r = router(Some("1.1.1.1:1"));
        let stats = Stats::new(1);
        let mut x = Exchange::new();
        x.on_message(headers(&[(":path", "/v1/messages")], false), &r, &stats);
        let s = x.on_message(body(b"anything", true), &r, &stats);
        assert_eq!(s.send.len(), 2);
        assert_eq!(r.asked.borrow()[0], (String::new(), String::new(), vec![]));
    }

    #[test]
    fn a_request_without_body_goes_to_a_random_pod_at_once() {
        let r = router(Some("1.1.1.1:1"));
        let stats = Stats::new(1);
        let mut x = Exchange::new();
        let s = x.on_message(
            headers(&[(":path", "/v1/models"), (":method", "GET")], true),
            &r,
            &stats,
        );
        assert_eq!(s.send.len(), 1);
        // Only the destination: the headers of a body-less request are not kept.
        assert_eq!(
            set_headers(&s.send[0]),
            vec![("x-gateway-destination-endpoint".into(), "1.1.1.1:1".into())]
        );
        let r = router(None);
        let s = Exchange::new().on_message(headers(&[], true), &r, &stats);
        assert_eq!(immediate_of(&s).0, 500);
        assert_eq!(stats.internal_500.get(), 1);
    }

    #[test]
    fn a_buffered_response_is_sent_back_whole_at_its_end_and_its_usage_counted() {
        let r = router(Some("1.1.1.1:1"));
        let stats = Stats::new(1);
        let mut x = requested("/v1/chat/completions", CHAT, &r, &stats);
        let s = x.on_message(
            resp_headers(&[(":status", "200"), ("content-type", "application/json")]),
            &r,
            &stats,
        );
        let set = set_headers(&s.send[0]);
        assert_eq!(set[0], ("x-went-into-resp-headers".into(), "true".into()));
        assert!(set.contains(&(":status".into(), "200".into())));
        let whole = br#"{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":7}}"#;
        assert!(x
            .on_message(resp_body(&whole[..20], false), &r, &stats)
            .send
            .is_empty());
        let s = x.on_message(resp_body(&whole[20..], true), &r, &stats);
        assert_eq!(s.send.len(), 1);
        assert_eq!(streamed(&s.send[0]), (whole.to_vec(), true));
        assert_eq!(stats.usage_prompt_tokens.get(), 5);
        assert_eq!(stats.usage_completion_tokens.get(), 7);
        assert_eq!(stats.responses_buffered.get(), 1);
        // Anything after the end is counted, not answered.
        assert!(x
            .on_message(resp_body(b"x", true), &r, &stats)
            .send
            .is_empty());
        assert_eq!(stats.unexpected_messages.get(), 1);
    }

    #[test]
    fn a_streamed_response_is_echoed_chunk_by_chunk() {
        let r = router(Some("1.1.1.1:1"));
        let stats = Stats::new(1);
        let mut x = requested("/v1/chat/completions", CHAT, &r, &stats);
        x.on_message(
            resp_headers(&[("content-type", "text/event-stream")]),
            &r,
            &stats,
        );
        let c1 = b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n";
        let s = x.on_message(resp_body(c1, false), &r, &stats);
        assert_eq!(streamed(&s.send[0]), (c1.to_vec(), false));
        let c2 = b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":\"2\"}}\n\ndata: [DONE]\n\n";
        let s = x.on_message(resp_body(c2, true), &r, &stats);
        assert_eq!(streamed(&s.send[0]), (c2.to_vec(), true));
        assert_eq!(stats.usage_prompt_tokens.get(), 3);
        assert_eq!(stats.usage_completion_tokens.get(), 2);
        assert_eq!(stats.responses_streamed.get(), 1);
    }

    #[test]
    fn stream_true_in_the_request_makes_the_response_a_stream() {
        let r = router(Some("1.1.1.1:1"));
        let stats = Stats::new(1);
        let mut x = requested(
            "/v1/completions",
            br#"{"model":"m","prompt":"p","stream":true}"#,
            &r,
            &stats,
        );
        x.on_message(
            resp_headers(&[("content-type", "application/json")]),
            &r,
            &stats,
        );
        let s = x.on_message(resp_body(b"part", false), &r, &stats);
        assert_eq!(streamed(&s.send[0]), (b"part".to_vec(), false));
    }

    #[test]
    fn trailers_flush_a_buffered_body_and_are_answered_request_trailers_ignored() {
        let r = router(Some("1.1.1.1:1"));
        let stats = Stats::new(1);
        let mut x = requested(
            "/v1/completions",
            br#"{"model":"m","prompt":"p"}"#,
            &r,
            &stats,
        );
        let s = x.on_message(
            ProcessingRequest {
                request: Some(processing_request::Request::RequestTrailers(
                    HttpTrailers::default(),
                )),
                ..ProcessingRequest::default()
            },
            &r,
            &stats,
        );
        assert!(s.send.is_empty());
        assert_eq!(stats.request_trailers_ignored.get(), 1);
        x.on_message(
            resp_headers(&[("content-type", "application/grpc")]),
            &r,
            &stats,
        );
        x.on_message(resp_body(b"abc", false), &r, &stats);
        let s = x.on_message(
            ProcessingRequest {
                request: Some(processing_request::Request::ResponseTrailers(
                    HttpTrailers::default(),
                )),
                ..ProcessingRequest::default()
            },
            &r,
            &stats,
        );
        assert_eq!(s.send.len(), 2);
        assert_eq!(streamed(&s.send[0]), (b"abc".to_vec(), false));
        assert!(matches!(
            s.send[1].response,
            Some(processing_response::Response::ResponseTrailers(_))
        ));
    }

    #[test]
    fn system_owned_headers_match_llm_d_case_insensitively() {
        assert!(is_system_owned("Content-Length"));
        assert!(is_system_owned("X-Gateway-Model-Name-Rewrite"));
        assert!(is_system_owned("x-llm-d-request-dropped-reason"));
        assert!(!is_system_owned("x-request-id"));
        assert!(!is_system_owned(":path"));
    }
}
