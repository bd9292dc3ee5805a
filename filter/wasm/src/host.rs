//! Decides nothing: thin, non-panicking wrappers over the proxy-wasm hostcalls the glue uses.
//!
//! The SDK's `Context` helpers `.unwrap()` hostcall results, and a few hostcalls panic on
//! statuses they do not expect (ENVOY_FACTS: request headers are gone in the response phase and
//! reading them returns BadArgument). Every call here goes through `proxy_wasm::hostcalls`,
//! turns errors into `Option`/`Result`, and is only used in the phase where it is valid.

use std::time::UNIX_EPOCH;

use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, LogLevel, MapType, MetricType, Status};

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

/// One request header; only valid in the request phase.
pub fn request_header(name: &str) -> Option<String> {
    hostcalls::get_map_value(MapType::HttpRequestHeaders, name)
        .ok()
        .flatten()
}

/// Replaces (or with `None`, removes) a request header; only valid before the request is sent.
pub fn set_request_header(name: &str, value: Option<&str>) -> Result<(), Status> {
    hostcalls::set_map_value(MapType::HttpRequestHeaders, name, value)
}

/// One response header; only valid in the response phase.
pub fn response_header(name: &str) -> Option<String> {
    hostcalls::get_map_value(MapType::HttpResponseHeaders, name)
        .ok()
        .flatten()
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

/// A local reply that ends the request (status page).
pub fn send_response(status: u32, headers: Vec<(&str, &str)>, body: &[u8]) -> Result<(), Status> {
    hostcalls::send_http_response(status, headers, Some(body))
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
