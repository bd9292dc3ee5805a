//! An Envoy dynamic module HTTP filter that does nothing: every hook continues at once, no
//! config is read, no host call is made. Loaded in place of ai-lb's native module (same Envoy
//! template, same filter position), it measures what Envoy's dynamic-module machinery costs a
//! request by itself, so the overhead benchmark can split the native module's cost into that
//! floor and ai-lb's own work:
//!
//! ```sh
//! cargo build --release -p ai-lb-bench-empty-native
//! AI_LB_NATIVE_B=target/release/libai_lb_bench_empty_native.so \
//!   scripts/bench.sh overhead-rps --overhead-filter native,native-b
//! ```
//!
//! The hook set and their C signatures are those of Envoy 1.40's ABI (v0.2.0), as
//! `filter/native/src/abi.rs` declares them; pointers this filter never reads are `c_void`.
// Exporting C symbols (`#[no_mangle]`) is what a dynamic module is; nothing else here is unsafe.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_void};

/// A buffer Envoy passes by value (pointer and length).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct EnvoyBuffer {
    pub ptr: *const c_char,
    pub length: usize,
}

/// The ABI version this module was written against (Envoy 1.40).
const ABI_VERSION: &[u8] = b"v0.2.0\0";

/// Any non-null address serves as the config and the per-stream object: nothing is stored.
static MARKER: u8 = 0;

fn marker() -> *const c_void {
    std::ptr::addr_of!(MARKER).cast()
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const c_char {
    ABI_VERSION.as_ptr().cast()
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    _config_envoy: *mut c_void,
    _name: EnvoyBuffer,
    _config: EnvoyBuffer,
) -> *const c_void {
    marker()
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(_config: *const c_void) {}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_new(
    _config: *const c_void,
    _filter_envoy: *mut c_void,
) -> *const c_void {
    marker()
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_destroy(_filter: *const c_void) {}

/// Headers, body and trailers hooks all answer 0: Continue.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    _filter_envoy: *mut c_void,
    _filter: *const c_void,
    _end_of_stream: bool,
) -> u32 {
    0
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_body(
    _filter_envoy: *mut c_void,
    _filter: *const c_void,
    _end_of_stream: bool,
) -> u32 {
    0
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(
    _filter_envoy: *mut c_void,
    _filter: *const c_void,
) -> u32 {
    0
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
    _filter_envoy: *mut c_void,
    _filter: *const c_void,
    _end_of_stream: bool,
) -> u32 {
    0
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_body(
    _filter_envoy: *mut c_void,
    _filter: *const c_void,
    _end_of_stream: bool,
) -> u32 {
    0
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(
    _filter_envoy: *mut c_void,
    _filter: *const c_void,
) -> u32 {
    0
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(
    _filter_envoy: *mut c_void,
    _filter: *const c_void,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(
    _filter_envoy: *mut c_void,
    _filter: *const c_void,
    _event_id: u64,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_callout_done(
    _filter_envoy: *mut c_void,
    _filter: *const c_void,
    _callout_id: u64,
    _result: u32,
    _headers: *const c_void,
    _headers_size: usize,
    _body_chunks: *const EnvoyBuffer,
    _body_chunks_size: usize,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_headers(
    _filter_envoy: *mut c_void,
    _filter: *const c_void,
    _stream_id: u64,
    _headers: *const c_void,
    _headers_size: usize,
    _end_stream: bool,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_data(
    _filter_envoy: *mut c_void,
    _filter: *const c_void,
    _stream_id: u64,
    _data: *const EnvoyBuffer,
    _data_count: usize,
    _end_stream: bool,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_trailers(
    _filter_envoy: *mut c_void,
    _filter: *const c_void,
    _stream_id: u64,
    _trailers: *const c_void,
    _trailers_size: usize,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_complete(
    _filter_envoy: *mut c_void,
    _filter: *const c_void,
    _stream_id: u64,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_reset(
    _filter_envoy: *mut c_void,
    _filter: *const c_void,
    _stream_id: u64,
    _reason: u32,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(
    _filter_envoy: *mut c_void,
    _filter: *const c_void,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(
    _filter_envoy: *mut c_void,
    _filter: *const c_void,
) {
}
