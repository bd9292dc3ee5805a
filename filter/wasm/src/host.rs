//! Decides nothing: thin, non-panicking wrappers over the proxy-wasm hostcalls the glue uses.
//!
//! The SDK's `Context` helpers `.unwrap()` hostcall results, and a few hostcalls panic on
//! statuses they do not expect (ENVOY_FACTS: request headers are gone in the response phase and
//! reading them returns BadArgument). Every call here goes through `proxy_wasm::hostcalls`,
//! turns errors into `Option`/`Result`, and is only used in the phase where it is valid.

use std::time::UNIX_EPOCH;

use prost::Message;
use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, LogLevel, MapType, MetricType, Status, StreamType};

/// Milliseconds since the Unix epoch from the host clock (0 if the host refuses).
pub fn now_ms() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// Logs at `level`; logging failures are ignored (there is nowhere to report them).
pub fn log(level: LogLevel, msg: &str) {
    let _ = hostcalls::log(level, msg);
}

/// A property as UTF-8 text (`["upstream", "address"]`, `["xds", "cluster_name"]`, ...).
pub fn property_string(path: &[&str]) -> Option<String> {
    let bytes = hostcalls::get_property(path.to_vec()).ok()??;
    String::from_utf8(bytes).ok()
}

/// A numeric property (Envoy encodes integers as 8 little-endian bytes).
pub fn property_u64(path: &[&str]) -> Option<u64> {
    let bytes = hostcalls::get_property(path.to_vec()).ok()??;
    let arr: [u8; 8] = bytes.get(..8)?.try_into().ok()?;
    Some(u64::from_le_bytes(arr))
}

/// One request header; only valid in the request phase (None elsewhere, never a trap).
pub fn request_header(name: &str) -> Option<String> {
    header_value(MapType::HttpRequestHeaders, name)
}

/// A header's (first) value. Invalid UTF-8 is replaced (U+FFFD), not refused: Envoy passes a
/// client's obs-text bytes (0x80-0xFF) through, and the SDK's `get_map_value` unwraps
/// `String::from_utf8`, so one such byte in a header the filter reads trapped the VM (issue 31;
/// e2e `filter_header_injection`). A host status other than Ok is None (the SDK panics on
/// anything but NotFound).
#[allow(unsafe_code)] // the raw ABI call, as the SDK makes it, without its panics
fn header_value(map: MapType, name: &str) -> Option<String> {
    let mut data: *mut u8 = std::ptr::null_mut();
    let mut size: usize = 0;
    // SAFETY: `name` is a live slice for the call; on Ok the host wrote a buffer it allocated
    // through this module's `proxy_on_memory_allocate` (the Rust allocator), of `size` bytes,
    // which is then owned here exactly as the SDK owns it.
    let status =
        unsafe { proxy_get_header_map_value(map, name.as_ptr(), name.len(), &mut data, &mut size) };
    match status {
        Status::Ok if data.is_null() => Some(String::new()),
        Status::Ok => {
            // SAFETY: see above.
            let bytes = unsafe { Vec::from_raw_parts(data, size, size) };
            Some(match String::from_utf8(bytes) {
                Ok(s) => s,
                Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
            })
        }
        _ => None,
    }
}

/// Replaces (or with `None`, removes) a request header; only valid before the request is sent.
pub fn set_request_header(name: &str, value: Option<&str>) -> Result<(), Status> {
    hostcalls::set_map_value(MapType::HttpRequestHeaders, name, value)
}

/// One response header; only valid in the response phase (None elsewhere, never a trap).
pub fn response_header(name: &str) -> Option<String> {
    header_value(MapType::HttpResponseHeaders, name)
}

/// Sets a response header; only valid in the response-headers phase.
pub fn set_response_header(name: &str, value: &str) -> Result<(), Status> {
    hostcalls::set_map_value(MapType::HttpResponseHeaders, name, Some(value))
}

/// The request body received so far (up to `max` bytes).
pub fn request_body(size: usize) -> Option<Vec<u8>> {
    hostcalls::get_buffer(BufferType::HttpRequestBody, 0, size)
        .ok()
        .flatten()
}

/// The current response body chunk (`size` bytes, in `on_http_response_body`).
pub fn response_body(size: usize) -> Option<Vec<u8>> {
    hostcalls::get_buffer(BufferType::HttpResponseBody, 0, size)
        .ok()
        .flatten()
}

/// The plugin configuration bytes as given to `on_configure`.
pub fn plugin_configuration() -> Option<Vec<u8>> {
    hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX)
        .ok()
        .flatten()
}

/// The current gRPC stream message (in `on_grpc_stream_message`).
pub fn grpc_message(size: usize) -> Option<Vec<u8>> {
    hostcalls::get_buffer(BufferType::GrpcReceiveBuffer, 0, size)
        .ok()
        .flatten()
}

#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_send_local_response(
        status_code: u32,
        status_code_details_data: *const u8,
        status_code_details_size: usize,
        body_data: *const u8,
        body_size: usize,
        headers_data: *const u8,
        headers_size: usize,
        grpc_status: i32,
    ) -> Status;
    fn proxy_continue_stream(stream_type: StreamType) -> Status;
    fn proxy_get_header_map_value(
        map_type: MapType,
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> Status;
}

/// proxy-wasm's header map serialization: count, then (key len, value len) pairs, then each
/// key and value NUL-terminated; lengths little-endian u32.
pub fn serialize_map(pairs: &[(&str, &str)]) -> Vec<u8> {
    let len32 = |n: usize| u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes();
    let mut out = Vec::new();
    out.extend_from_slice(&len32(pairs.len()));
    for (k, v) in pairs {
        out.extend_from_slice(&len32(k.len()));
        out.extend_from_slice(&len32(v.len()));
    }
    for (k, v) in pairs {
        out.extend_from_slice(k.as_bytes());
        out.push(0);
        out.extend_from_slice(v.as_bytes());
        out.push(0);
    }
    out
}

/// A local reply that ends the request. Unlike the SDK's `send_http_response`, a host error
/// is returned, not a trap (the root context answers held requests whose stream may be gone).
#[allow(unsafe_code)] // the raw ABI call: the SDK's wrapper panics on any non-Ok status
pub fn send_response(status: u32, headers: Vec<(&str, &str)>, body: &[u8]) -> Result<(), Status> {
    let h = serialize_map(&headers);
    // SAFETY: every pointer/length pair describes a live slice for the duration of the call.
    let st = unsafe {
        proxy_send_local_response(
            status,
            std::ptr::null(),
            0,
            body.as_ptr(),
            body.len(),
            h.as_ptr(),
            h.len(),
            -1,
        )
    };
    match st {
        Status::Ok => Ok(()),
        e => Err(e),
    }
}

/// Resumes the current (effective) HTTP request; a host error is returned, not a trap.
#[allow(unsafe_code)] // the raw ABI call: the SDK's wrapper panics on any non-Ok status
pub fn resume_request() -> Result<(), Status> {
    // SAFETY: no pointers are passed.
    match unsafe { proxy_continue_stream(StreamType::HttpRequest) } {
        Status::Ok => Ok(()),
        e => Err(e),
    }
}

/// Sets the filter state object `envoy.ratelimit.hits_addend` (through Envoy's foreign function
/// `set_envoy_filter_state`) so that Envoy's rate limit filter sends `hits_addend = n`.
pub fn set_hits_addend(n: u64) -> Result<(), Status> {
    let arg = SetEnvoyFilterStateArguments {
        path: HITS_ADDEND_KEY.to_string(),
        value: n.to_string(),
        span: 0,
    }
    .encode_to_vec();
    hostcalls::call_foreign_function("set_envoy_filter_state", Some(&arg)).map(|_| ())
}

/// The filter state key Envoy's rate limit filter reads its hits addend from.
pub const HITS_ADDEND_KEY: &str = "envoy.ratelimit.hits_addend";

/// `envoy.source.extensions.common.wasm.SetEnvoyFilterStateArguments`: path = 1, value = 2,
/// span = 3 (LifeSpan; 0 = FilterChain).
#[derive(Clone, PartialEq, prost::Message)]
pub struct SetEnvoyFilterStateArguments {
    #[prost(string, tag = "1")]
    pub path: String,
    #[prost(string, tag = "2")]
    pub value: String,
    #[prost(int32, tag = "3")]
    pub span: i32,
}

/// Shared data value and its CAS token (`None` values when absent).
pub fn shared_get(key: &str) -> (Option<Vec<u8>>, Option<u32>) {
    hostcalls::get_shared_data(key).unwrap_or((None, None))
}

/// Sets shared data; `cas` = `Some(token)` fails with `CasMismatch` if someone wrote in between.
pub fn shared_set(key: &str, value: &[u8], cas: Option<u32>) -> Result<(), Status> {
    hostcalls::set_shared_data(key, Some(value), cas)
}

/// Defines (or finds) a metric by name; the id is stable per VM.
pub fn define_metric(kind: MetricType, name: &str) -> Option<u32> {
    hostcalls::define_metric(kind, name).ok()
}

pub fn increment_metric(id: u32, by: i64) {
    let _ = hostcalls::increment_metric(id, by);
}

pub fn record_metric(id: u32, value: u64) {
    let _ = hostcalls::record_metric(id, value);
}

/// The proxy as the core's request lifecycle sees it: the hostcalls of the context that is
/// current (the request's own, or a held one the root made current to release it).
pub struct WasmHost;

impl ai_lb_filter_core::lifecycle::Host for WasmHost {
    fn now_ms(&self) -> u64 {
        now_ms()
    }
    fn request_header(&self, name: &str) -> Option<std::borrow::Cow<'_, str>> {
        request_header(name).map(std::borrow::Cow::Owned)
    }
    fn set_request_header(&mut self, name: &str, value: Option<&str>) -> bool {
        set_request_header(name, value).is_ok()
    }
    fn response_header(&self, name: &str) -> Option<std::borrow::Cow<'_, str>> {
        response_header(name).map(std::borrow::Cow::Owned)
    }
    fn set_response_header(&mut self, name: &str, value: &str) {
        let _ = set_response_header(name, value);
    }
    fn send_local_reply(&mut self, status: u16, headers: &[(&str, &str)], body: &[u8]) {
        let _ = send_response(u32::from(status), headers.to_vec(), body);
    }
    fn cluster_name(&self) -> Option<std::borrow::Cow<'_, str>> {
        property_string(&["xds", "cluster_name"]).map(std::borrow::Cow::Owned)
    }
    fn upstream_address(&self) -> Option<std::borrow::Cow<'_, str>> {
        property_string(&["upstream", "address"]).map(std::borrow::Cow::Owned)
    }
    fn response_code(&self) -> Option<u16> {
        property_u64(&["response", "code"]).and_then(|c| u16::try_from(c).ok())
    }
    fn response_flags(&self) -> u64 {
        property_u64(&["response", "flags"]).unwrap_or(0)
    }
    fn response_code_details(&self) -> Option<std::borrow::Cow<'_, str>> {
        property_string(&["response", "code_details"]).map(std::borrow::Cow::Owned)
    }
    fn steer(&mut self, routing_header: &str, ranked: &str) -> bool {
        match set_request_header(routing_header, Some(ranked)) {
            Ok(()) => true,
            Err(e) => {
                log(
                    LogLevel::Warn,
                    &format!("ai-lb: cannot set `{routing_header}`: {e:?}"),
                );
                false
            }
        }
    }
    fn warn(&mut self, msg: &str) {
        log(LogLevel::Warn, msg);
    }
    /// The peer certificate's URI SAN, else Istio's `source.principal`.
    fn peer_principal(&self) -> Option<std::borrow::Cow<'_, str>> {
        property_string(&["connection", "uri_san_peer_certificate"])
            .filter(|p| !p.is_empty())
            .or_else(|| property_string(&["source", "principal"]))
            .map(std::borrow::Cow::Owned)
    }
    fn set_hits_addend(&mut self, n: u64) -> bool {
        set_hits_addend(n).is_ok()
    }
    fn response_chunk(&self, size: usize) -> Option<Vec<u8>> {
        if size == 0 {
            return None;
        }
        response_body(size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_map_serialization_matches_the_abi() {
        let b = serialize_map(&[("a", "bc"), ("", "d")]);
        let mut want = vec![2, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0];
        want.extend_from_slice(b"a\0bc\0\0d\0");
        assert_eq!(b, want);
    }

    #[test]
    fn filter_state_argument_encoding() {
        let b = SetEnvoyFilterStateArguments {
            path: "k".into(),
            value: "42".into(),
            span: 0,
        }
        .encode_to_vec();
        assert_eq!(b, vec![0x0a, 1, b'k', 0x12, 2, b'4', b'2']);
    }
}
