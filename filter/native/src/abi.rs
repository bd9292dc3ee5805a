//! Hand-written FFI declarations for the Envoy 1.40.0 `dynamic_modules` HTTP filter ABI.
//!
//! Scope: only what an HTTP filter module needs (hooks Envoy looks up in the module, plus a
//! handful of callbacks Envoy exports). Every layout and parameter list below was checked
//! against the official 1.40.0 binary (`nm -D` for names; disassembly of the argument
//! registers for the callbacks declared here).
//!
//! Conventions used throughout:
//! * C enums are passed and returned as 32-bit integers, so they appear here as `u32` aliases
//!   with plain integer constants (an unexpected value from Envoy can then never be UB).
//! * C `bool` is Rust `bool`; C `size_t` is `usize`.
//! * Buffers are (pointer, length) pairs; by value they travel in two integer registers.

#![allow(non_camel_case_types, unsafe_code)]

use std::os::raw::{c_char, c_void};

// ---------------------------------------------------------------------------------------------
// ABI version
// ---------------------------------------------------------------------------------------------

/// String the module returns from `envoy_dynamic_module_on_program_init` (NUL-terminated).
/// The 1.40.0 binary carries "v0.2.0". A mismatch only produces a warning in 1.40 ("Dynamic
/// module ABI version .. is deprecated"), but a null return makes Envoy refuse the module, which
/// is what [`program_init`] does outside [`envoy_supports`]'s window.
pub const ABI_VERSION: &[u8] = b"v0.2.0\0";

/// The Envoy release (major, minor) whose ABI this file declares and whose binary it was
/// checked against.
pub const BUILT_FOR_ENVOY: (u32, u32) = (1, 40);

/// Envoy's rule for dynamic modules (arch overview "Dynamic modules", Compatibility): a module
/// built for Envoy X.Y works with Envoy X.Y and X.(Y+1). Outside that a changed signature would
/// be undefined behaviour, and Envoy 1.40 does not refuse a module on its own.
pub fn envoy_supports(built_for: (u32, u32), running: (u32, u32)) -> bool {
    running.0 == built_for.0
        && (running.1 == built_for.1 || Some(running.1) == built_for.1.checked_add(1))
}

/// The version field of `envoy --version` output (`envoy  version: <sha>/1.40.0/Clean/RELEASE/
/// BoringSSL`, a suffix such as `-dev` allowed) and its (major, minor).
pub fn parse_envoy_version(text: &str) -> Option<((u32, u32), &str)> {
    let field = text.split("version: ").nth(1)?.split('/').nth(1)?.trim();
    let mut numbers = field.split(|c: char| !c.is_ascii_digit());
    let major = numbers.next()?.parse().ok()?;
    let minor = numbers.next()?.parse().ok()?;
    Some(((major, minor), field))
}

/// Whether a module built for `built_for` loads into the Envoy whose `--version` printed
/// `version_text` (Err: why it could not be learnt), with the log line that says so and its
/// level. Refusals name both versions; an unknown version loads, with a warning.
pub fn load_decision(
    built_for: (u32, u32),
    version_text: Result<&str, &str>,
) -> (bool, LogLevel, String) {
    let abi = String::from_utf8_lossy(ABI_VERSION.strip_suffix(b"\0").unwrap_or(ABI_VERSION));
    let (major, minor) = built_for;
    let built = format!("built for Envoy {major}.{minor} (dynamic-module ABI {abi})");
    let window = format!(
        "Envoy {major}.{minor}.x or {major}.{}.x",
        minor.saturating_add(1)
    );
    let running = version_text.and_then(|t| parse_envoy_version(t).ok_or("no version in it"));
    match running {
        Ok((v, field)) if envoy_supports(built_for, v) => (
            true,
            log_level::INFO,
            format!("ai-lb native: {built}, loaded into Envoy {field}: supported ({window})"),
        ),
        Ok((_, field)) => (
            false,
            log_level::ERROR,
            format!(
                "ai-lb native: refusing to load: this module was {built} and runs only in \
                 {window}; this Envoy is {field}. Run it in a supported Envoy, or port \
                 filter/native/src/abi.rs to this Envoy's ABI and rebuild"
            ),
        ),
        Err(why) => (
            true,
            log_level::WARN,
            format!(
                "ai-lb native: could not learn this Envoy's version (`--version`: {why}); \
                 loading anyway. This module was {built} and is supported in {window} only"
            ),
        ),
    }
}

/// `envoy_dynamic_module_on_program_init` for a module built for `built_for`: asks the binary
/// this module was loaded into for its version (`/proc/self/exe --version`, once per process,
/// tens of milliseconds), logs [`load_decision`]'s line, and returns [`ABI_VERSION`], or null
/// so that Envoy refuses the module.
pub fn program_init(built_for: (u32, u32)) -> *const c_char {
    let text = std::process::Command::new("/proc/self/exe")
        .arg("--version")
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output()
        .map_err(|e| e.to_string())
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
    let (load, level, line) = load_decision(built_for, text.as_deref().map_err(String::as_str));
    // SAFETY: the buffer points into `line`, which outlives the call; Envoy copies it.
    unsafe { envoy_dynamic_module_callback_log(level, ModuleBuffer::from_text(&line)) };
    if load {
        ABI_VERSION.as_ptr().cast()
    } else {
        std::ptr::null()
    }
}

// ---------------------------------------------------------------------------------------------
// Opaque handles
// ---------------------------------------------------------------------------------------------

/// Envoy's per-config object (C: `..._http_filter_config_envoy_ptr`). Passed to config hooks;
/// used for defining metrics (only valid for that during `on_http_filter_config_new`).
pub type HttpFilterConfigEnvoyPtr = *mut c_void;
/// The module's own per-config object, returned from `on_http_filter_config_new`.
pub type HttpFilterConfigModulePtr = *const c_void;
/// Envoy's per-stream filter object; first argument of almost every HTTP callback.
pub type HttpFilterEnvoyPtr = *mut c_void;
/// The module's per-stream object, returned from `on_http_filter_new`.
pub type HttpFilterModulePtr = *const c_void;
/// A stream's scheduler (C: `..._http_filter_scheduler_module_ptr`): Envoy's object that posts
/// an event to the stream's worker thread, from any thread; it holds the stream weakly (an
/// event for a stream that is gone is dropped). The module deletes it.
pub type HttpFilterSchedulerPtr = *mut c_void;
/// A filter config's scheduler (C: `..._http_filter_config_scheduler_module_ptr`): posts events
/// to the main thread (`on_http_filter_config_scheduled`) from any thread.
pub type HttpFilterConfigSchedulerPtr = *mut c_void;

// ---------------------------------------------------------------------------------------------
// Buffers and header pairs
// ---------------------------------------------------------------------------------------------

/// Bytes owned by Envoy (C: `envoy_dynamic_module_type_envoy_buffer`). Valid only until the
/// current hook returns, or until a setter touches the same data. A null `ptr` means "absent".
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct EnvoyBuffer {
    pub ptr: *const c_char,
    pub length: usize,
}

impl EnvoyBuffer {
    pub const fn null() -> Self {
        Self {
            ptr: std::ptr::null(),
            length: 0,
        }
    }
    /// View the bytes.
    ///
    /// # Safety
    /// Only inside the hook in which Envoy filled this buffer, while Envoy has not changed it.
    pub unsafe fn as_bytes<'a>(&self) -> &'a [u8] {
        if self.ptr.is_null() || self.length == 0 {
            &[]
        } else {
            std::slice::from_raw_parts(self.ptr as *const u8, self.length)
        }
    }
}

/// Bytes owned by the module (C: `envoy_dynamic_module_type_module_buffer`). Envoy copies what
/// it needs before the callback returns.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ModuleBuffer {
    pub ptr: *const c_char,
    pub length: usize,
}

impl ModuleBuffer {
    pub const fn null() -> Self {
        Self {
            ptr: std::ptr::null(),
            length: 0,
        }
    }
    pub fn from_bytes(b: &[u8]) -> Self {
        Self {
            ptr: b.as_ptr() as *const c_char,
            length: b.len(),
        }
    }
    pub fn from_text(s: &str) -> Self {
        Self::from_bytes(s.as_bytes())
    }
}

/// A header key/value pair whose bytes Envoy owns (C: `..._envoy_http_header`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct EnvoyHttpHeader {
    pub key_ptr: *const c_char,
    pub key_length: usize,
    pub value_ptr: *const c_char,
    pub value_length: usize,
}

impl EnvoyHttpHeader {
    /// The key's bytes.
    ///
    /// # Safety
    /// Only inside the hook in which Envoy handed this header over.
    pub unsafe fn key<'a>(&self) -> &'a [u8] {
        EnvoyBuffer {
            ptr: self.key_ptr,
            length: self.key_length,
        }
        .as_bytes()
    }
    /// The value's bytes.
    ///
    /// # Safety
    /// As for [`EnvoyHttpHeader::key`].
    pub unsafe fn value<'a>(&self) -> &'a [u8] {
        EnvoyBuffer {
            ptr: self.value_ptr,
            length: self.value_length,
        }
        .as_bytes()
    }
}

/// A header key/value pair whose bytes the module owns (C: `..._module_http_header`); used
/// by `send_response`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ModuleHttpHeader {
    pub key_ptr: *const c_char,
    pub key_length: usize,
    pub value_ptr: *const c_char,
    pub value_length: usize,
}

impl ModuleHttpHeader {
    /// Points at `key` and `value`, which must outlive the call the header is passed to.
    pub fn new(key: &str, value: &str) -> Self {
        Self {
            key_ptr: key.as_ptr().cast(),
            key_length: key.len(),
            value_ptr: value.as_ptr().cast(),
            value_length: value.len(),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Integer "enums"
// ---------------------------------------------------------------------------------------------

/// Which header map a header callback operates on.
pub type HttpHeaderType = u32;
pub mod header_type {
    pub const REQUEST_HEADER: u32 = 0;
    pub const RESPONSE_HEADER: u32 = 2;
}

/// Which body a body callback operates on. "Received" = the chunk delivered to the current
/// body hook only; "Buffered" = what Envoy has buffered so far for this direction.
pub type HttpBodyType = u32;
pub mod body_type {
    pub const RECEIVED_REQUEST_BODY: u32 = 0;
    pub const BUFFERED_REQUEST_BODY: u32 = 1;
    pub const RECEIVED_RESPONSE_BODY: u32 = 2;
}

/// Return value of the request/response *headers* hooks (mirrors Envoy's FilterHeadersStatus).
pub type HeadersStatus = u32;
pub mod headers_status {
    pub const CONTINUE: u32 = 0;
    pub const STOP_ITERATION: u32 = 1;
}

/// Return value of the request/response *body* hooks (mirrors FilterDataStatus).
pub type BodyStatus = u32;
pub mod body_status {
    pub const CONTINUE: u32 = 0;
    pub const STOP_ITERATION_AND_BUFFER: u32 = 1;
    pub const STOP_ITERATION_AND_WATERMARK: u32 = 2;
}

/// Return value of the request/response *trailers* hooks (mirrors FilterTrailersStatus).
pub type TrailersStatus = u32;
pub mod trailers_status {
    pub const CONTINUE: u32 = 0;
    pub const STOP_ITERATION: u32 = 1;
}

/// Log levels for the log callbacks (0 = most verbose).
pub type LogLevel = u32;
pub mod log_level {
    pub const DEBUG: u32 = 1;
    pub const INFO: u32 = 2;
    pub const WARN: u32 = 3;
    pub const ERROR: u32 = 4;
}

/// Result of the metrics callbacks.
pub type MetricsResult = u32;
pub mod metrics_result {
    pub const SUCCESS: u32 = 0;
}

/// Outcome passed to the callout-done hooks.
pub type HttpCalloutResult = u32;

/// What starting an HTTP callout returned (C: `..._http_callout_init_result`): 0 success, then
/// missing required headers, cluster not found, duplicate callout id, cannot create request.
pub type HttpCalloutInitResult = u32;
pub mod http_callout_init_result {
    pub const SUCCESS: u32 = 0;
}
pub mod http_callout_result {
    /// A response arrived (any status); the others are a reset and an over-large response.
    pub const SUCCESS: u32 = 0;
}

/// Reason passed to the stream-callout reset hooks.
pub type HttpStreamResetReason = u32;

/// Attribute ids for the `get_attribute_*` callbacks. The enum is append-only; the values
/// below are positions in the 1.40 list (the binary handles ids up to 70). String attributes
/// go through `..._get_attribute_string`, numeric ones through `..._get_attribute_int`;
/// asking with the wrong kind returns false.
pub type AttributeId = u32;
pub mod attribute_id {
    pub const RESPONSE_CODE: u32 = 15; // int, once response headers exist
    pub const RESPONSE_CODE_DETAILS: u32 = 16; // string
    pub const CONNECTION_URI_SAN_PEER_CERTIFICATE: u32 = 37; // string, mTLS peers only
    pub const UPSTREAM_ADDRESS: u32 = 41; // string "ip:port", once a host was picked
    pub const XDS_CLUSTER_NAME: u32 = 57; // string, needs a matched route
}

// ---------------------------------------------------------------------------------------------
// Hooks the module exports (Envoy looks them up with dlsym)
// ---------------------------------------------------------------------------------------------
//
// Implement each as `#[no_mangle] pub extern "C" fn <symbol>(...)` with exactly the parameter
// and return types of the alias. To have rustc check an export against its alias, write e.g.
//     const _: OnHttpFilterNew = envoy_dynamic_module_on_http_filter_new;
// (a safe `extern "C" fn` item coerces to the `unsafe extern "C" fn` pointer type).
// Never let a panic unwind out of these functions. The hooks Envoy 1.40 requires (it rejects
// a module missing one) are declared here, each checked against its export in lib.rs; of the
// optional ones Envoy skips when absent, local reply and per-route config are not
// implemented, the config-level scheduler and callout hooks are (`breaker.syntheticProbe`).
// Likewise only the callbacks and enum values this module uses are bound.

/// `envoy_dynamic_module_on_program_init`: called once right after dlopen. Return
/// `ABI_VERSION.as_ptr()`; returning null makes the load fail.
pub type OnProgramInit = unsafe extern "C" fn() -> *const c_char;

/// `envoy_dynamic_module_on_http_filter_config_new`: one call per filter config, main thread.
/// `name` = `filter_name`, `config` = the decoded `filter_config` bytes. Return null to reject.
pub type OnHttpFilterConfigNew = unsafe extern "C" fn(
    config_envoy: HttpFilterConfigEnvoyPtr,
    name: EnvoyBuffer,
    config: EnvoyBuffer,
) -> HttpFilterConfigModulePtr;

/// `envoy_dynamic_module_on_http_filter_config_destroy`
pub type OnHttpFilterConfigDestroy = unsafe extern "C" fn(config_module: HttpFilterConfigModulePtr);

/// `envoy_dynamic_module_on_http_filter_new`: one call per HTTP stream, worker thread.
/// Returning null fails the stream.
pub type OnHttpFilterNew = unsafe extern "C" fn(
    config_module: HttpFilterConfigModulePtr,
    filter_envoy: HttpFilterEnvoyPtr,
) -> HttpFilterModulePtr;

/// `envoy_dynamic_module_on_http_filter_request_headers` -> `headers_status::*`
pub type OnHttpFilterRequestHeaders = unsafe extern "C" fn(
    filter_envoy: HttpFilterEnvoyPtr,
    filter_module: HttpFilterModulePtr,
    end_of_stream: bool,
) -> HeadersStatus;

/// `envoy_dynamic_module_on_http_filter_request_body` -> `body_status::*`
pub type OnHttpFilterRequestBody = unsafe extern "C" fn(
    filter_envoy: HttpFilterEnvoyPtr,
    filter_module: HttpFilterModulePtr,
    end_of_stream: bool,
) -> BodyStatus;

/// `envoy_dynamic_module_on_http_filter_request_trailers` -> `trailers_status::*`
pub type OnHttpFilterRequestTrailers = unsafe extern "C" fn(
    filter_envoy: HttpFilterEnvoyPtr,
    filter_module: HttpFilterModulePtr,
) -> TrailersStatus;

/// `envoy_dynamic_module_on_http_filter_response_headers` -> `headers_status::*`
pub type OnHttpFilterResponseHeaders = unsafe extern "C" fn(
    filter_envoy: HttpFilterEnvoyPtr,
    filter_module: HttpFilterModulePtr,
    end_of_stream: bool,
) -> HeadersStatus;

/// `envoy_dynamic_module_on_http_filter_response_body` -> `body_status::*`
pub type OnHttpFilterResponseBody = unsafe extern "C" fn(
    filter_envoy: HttpFilterEnvoyPtr,
    filter_module: HttpFilterModulePtr,
    end_of_stream: bool,
) -> BodyStatus;

/// `envoy_dynamic_module_on_http_filter_response_trailers` -> `trailers_status::*`
pub type OnHttpFilterResponseTrailers = unsafe extern "C" fn(
    filter_envoy: HttpFilterEnvoyPtr,
    filter_module: HttpFilterModulePtr,
) -> TrailersStatus;

/// `envoy_dynamic_module_on_http_filter_stream_complete`: end of stream, before access logs
/// and before `..._destroy`. A good place to read final attributes (upstream address, code).
pub type OnHttpFilterStreamComplete =
    unsafe extern "C" fn(filter_envoy: HttpFilterEnvoyPtr, filter_module: HttpFilterModulePtr);

/// `envoy_dynamic_module_on_http_filter_destroy`: free the per-stream object.
pub type OnHttpFilterDestroy = unsafe extern "C" fn(filter_module: HttpFilterModulePtr);

/// `envoy_dynamic_module_on_http_filter_http_callout_done`
pub type OnHttpFilterHttpCalloutDone = unsafe extern "C" fn(
    filter_envoy: HttpFilterEnvoyPtr,
    filter_module: HttpFilterModulePtr,
    callout_id: u64,
    result: HttpCalloutResult,
    headers: *const EnvoyHttpHeader,
    headers_size: usize,
    body_chunks: *const EnvoyBuffer,
    body_chunks_size: usize,
);

/// `envoy_dynamic_module_on_http_filter_http_stream_headers`
pub type OnHttpFilterHttpStreamHeaders = unsafe extern "C" fn(
    filter_envoy: HttpFilterEnvoyPtr,
    filter_module: HttpFilterModulePtr,
    stream_id: u64,
    headers: *const EnvoyHttpHeader,
    headers_size: usize,
    end_stream: bool,
);

/// `envoy_dynamic_module_on_http_filter_http_stream_data`
pub type OnHttpFilterHttpStreamData = unsafe extern "C" fn(
    filter_envoy: HttpFilterEnvoyPtr,
    filter_module: HttpFilterModulePtr,
    stream_id: u64,
    data: *const EnvoyBuffer,
    data_count: usize,
    end_stream: bool,
);

/// `envoy_dynamic_module_on_http_filter_http_stream_trailers`
pub type OnHttpFilterHttpStreamTrailers = unsafe extern "C" fn(
    filter_envoy: HttpFilterEnvoyPtr,
    filter_module: HttpFilterModulePtr,
    stream_id: u64,
    trailers: *const EnvoyHttpHeader,
    trailers_size: usize,
);

/// `envoy_dynamic_module_on_http_filter_http_stream_complete`
pub type OnHttpFilterHttpStreamComplete = unsafe extern "C" fn(
    filter_envoy: HttpFilterEnvoyPtr,
    filter_module: HttpFilterModulePtr,
    stream_id: u64,
);

/// `envoy_dynamic_module_on_http_filter_http_stream_reset`
pub type OnHttpFilterHttpStreamReset = unsafe extern "C" fn(
    filter_envoy: HttpFilterEnvoyPtr,
    filter_module: HttpFilterModulePtr,
    stream_id: u64,
    reason: HttpStreamResetReason,
);

/// `envoy_dynamic_module_on_http_filter_scheduled`
pub type OnHttpFilterScheduled = unsafe extern "C" fn(
    filter_envoy: HttpFilterEnvoyPtr,
    filter_module: HttpFilterModulePtr,
    event_id: u64,
);

/// `envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark`
pub type OnHttpFilterDownstreamAboveWriteBufferHighWatermark =
    unsafe extern "C" fn(filter_envoy: HttpFilterEnvoyPtr, filter_module: HttpFilterModulePtr);

/// `envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark`
pub type OnHttpFilterDownstreamBelowWriteBufferLowWatermark =
    unsafe extern "C" fn(filter_envoy: HttpFilterEnvoyPtr, filter_module: HttpFilterModulePtr);

// ----- optional hooks (a missing symbol just disables the feature) -----

/// `envoy_dynamic_module_on_http_filter_config_scheduled`: on the main thread, for an event
/// committed to the config's scheduler (`..._http_filter_config_scheduler_commit`).
pub type OnHttpFilterConfigScheduled = unsafe extern "C" fn(
    config_envoy: HttpFilterConfigEnvoyPtr,
    config_module: HttpFilterConfigModulePtr,
    event_id: u64,
);

/// `envoy_dynamic_module_on_http_filter_config_http_callout_done`: on the main thread, when a
/// callout started with `..._http_filter_config_http_callout` ended. `headers` and
/// `body_chunks` are Envoy's, valid during the hook, null when no response came.
pub type OnHttpFilterConfigHttpCalloutDone = unsafe extern "C" fn(
    config_envoy: HttpFilterConfigEnvoyPtr,
    config_module: HttpFilterConfigModulePtr,
    callout_id: u64,
    result: HttpCalloutResult,
    headers: *const EnvoyHttpHeader,
    headers_size: usize,
    body_chunks: *const EnvoyBuffer,
    body_chunks_size: usize,
);

// ----- per-route hooks (looked up only when a DynamicModuleFilterPerRoute config is used) -----

// ---------------------------------------------------------------------------------------------
// Callbacks Envoy exports (resolved from the envoy executable when the module is dlopen'ed)
// ---------------------------------------------------------------------------------------------

// `unsafe extern` is accepted from Rust 1.82 on and is mandatory in edition 2024.
unsafe extern "C" {
    // ----- logging (goes to Envoy's `dynamic_modules` logger) -----

    /// Log `message` at `level` (`log_level::*`). Still exported, superseded by `_v2`.
    pub fn envoy_dynamic_module_callback_log(level: LogLevel, message: ModuleBuffer);

    // ----- headers / trailers (`header_type::*` selects the map) -----

    /// Read the `index`-th value of header `key` into `*result` (null buffer when absent).
    /// If `optional_size` is non-null, the number of values for `key` is stored there, so
    /// calling with index 0 gives both the first value and the count.
    pub fn envoy_dynamic_module_callback_http_get_header(
        filter_envoy: HttpFilterEnvoyPtr,
        header_type: HttpHeaderType,
        key: ModuleBuffer,
        result: *mut EnvoyBuffer,
        index: usize,
        optional_size: *mut usize,
    ) -> bool;

    /// Replace all values of `key` with `value`. Passing a null/empty `value`
    /// (`ModuleBuffer::null()`) REMOVES the header: there is no separate remove callback.
    pub fn envoy_dynamic_module_callback_http_set_header(
        filter_envoy: HttpFilterEnvoyPtr,
        header_type: HttpHeaderType,
        key: ModuleBuffer,
        value: ModuleBuffer,
    ) -> bool;

    // ----- attributes (`attribute_id::*`) -----

    /// String-valued attribute into `*result`; false when unavailable or not a string.
    pub fn envoy_dynamic_module_callback_http_filter_get_attribute_string(
        filter_envoy: HttpFilterEnvoyPtr,
        attribute_id: AttributeId,
        result: *mut EnvoyBuffer,
    ) -> bool;

    /// Integer-valued attribute into `*result`; false when unavailable or not an integer.
    pub fn envoy_dynamic_module_callback_http_filter_get_attribute_int(
        filter_envoy: HttpFilterEnvoyPtr,
        attribute_id: AttributeId,
        result: *mut u64,
    ) -> bool;

    // ----- body (`body_type::*`) -----

    /// Total byte count of the selected body (0 if none).
    pub fn envoy_dynamic_module_callback_http_get_body_size(
        filter_envoy: HttpFilterEnvoyPtr,
        body_type: HttpBodyType,
    ) -> usize;

    /// Number of contiguous slices making up the selected body.
    pub fn envoy_dynamic_module_callback_http_get_body_chunks_size(
        filter_envoy: HttpFilterEnvoyPtr,
        body_type: HttpBodyType,
    ) -> usize;

    /// Fill `result` (array of `..._get_body_chunks_size` entries) with the slices.
    pub fn envoy_dynamic_module_callback_http_get_body_chunks(
        filter_envoy: HttpFilterEnvoyPtr,
        body_type: HttpBodyType,
        result: *mut EnvoyBuffer,
    ) -> bool;

    // ----- flow control / local reply -----

    /// Send a local reply. `headers` may be null when `headers_size` is 0; `details` (the
    /// response-code-details string) may be null.
    pub fn envoy_dynamic_module_callback_http_send_response(
        filter_envoy: HttpFilterEnvoyPtr,
        status_code: u32,
        headers: *const ModuleHttpHeader,
        headers_size: usize,
        body: ModuleBuffer,
        details: ModuleBuffer,
    );

    /// Asks the cluster's load balancer for `host` (`ip:port`) on this request's first attempt
    /// (Envoy's upstream override host, as stateful sessions use; retries choose again).
    /// `strict`: fail rather than fall back when the host is not in the cluster. False when the
    /// address is not an IP address or the stream has no decoder callbacks.
    pub fn envoy_dynamic_module_callback_http_set_upstream_override_host(
        filter_envoy: HttpFilterEnvoyPtr,
        host: ModuleBuffer,
        strict: bool,
    ) -> bool;

    // ----- scheduler (wakes a stream on its worker thread) -----

    /// Creates the stream's scheduler; delete it with `..._scheduler_delete`.
    pub fn envoy_dynamic_module_callback_http_filter_scheduler_new(
        filter_envoy: HttpFilterEnvoyPtr,
    ) -> HttpFilterSchedulerPtr;

    /// Posts `event_id` to the stream's worker thread: `on_http_filter_scheduled` runs there
    /// (unless the stream is gone). Callable from any thread.
    pub fn envoy_dynamic_module_callback_http_filter_scheduler_commit(
        scheduler: HttpFilterSchedulerPtr,
        event_id: u64,
    );

    /// Deletes a scheduler from `..._scheduler_new`.
    pub fn envoy_dynamic_module_callback_http_filter_scheduler_delete(
        scheduler: HttpFilterSchedulerPtr,
    );

    // ----- config-level scheduler and HTTP callouts (main thread) -----
    // Checked against the 1.40.0 binary: scheduler_new reads its config pointer (rdi) only;
    // commit takes (scheduler, event id); the callout takes (config, *callout_id, cluster
    // buffer in rdx:rcx, headers in r8 with 32-byte entries, their count in r9, then the body
    // buffer and a 64-bit timeout on the stack).

    /// Creates the config's scheduler; delete it with `..._config_scheduler_delete`.
    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_new(
        config_envoy: HttpFilterConfigEnvoyPtr,
    ) -> HttpFilterConfigSchedulerPtr;

    /// Posts `event_id` to the main thread: `on_http_filter_config_scheduled` runs there
    /// (unless the config is gone). Callable from any thread.
    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_commit(
        scheduler: HttpFilterConfigSchedulerPtr,
        event_id: u64,
    );

    /// Deletes a scheduler from `..._config_scheduler_new`.
    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_delete(
        scheduler: HttpFilterConfigSchedulerPtr,
    );

    /// Sends an HTTP request on `cluster_name` from the main thread; its end comes to
    /// `on_http_filter_config_http_callout_done` with the id written to `*callout_id`.
    /// `headers` must hold `:method`, `:path` and `:authority`.
    pub fn envoy_dynamic_module_callback_http_filter_config_http_callout(
        config_envoy: HttpFilterConfigEnvoyPtr,
        callout_id: *mut u64,
        cluster_name: ModuleBuffer,
        headers: *const ModuleHttpHeader,
        headers_size: usize,
        body: ModuleBuffer,
        timeout_ms: u64,
    ) -> HttpCalloutInitResult;

    /// Add `value` to a counter outside any stream (the main thread's hooks); labels as for
    /// `..._http_filter_increment_counter`.
    pub fn envoy_dynamic_module_callback_http_filter_config_increment_counter(
        config_envoy: HttpFilterConfigEnvoyPtr,
        counter_id: usize,
        label_values: *const ModuleBuffer,
        label_values_len: usize,
        value: u64,
    ) -> MetricsResult;

    /// Set a gauge outside any stream (the main thread's hooks); labels as for
    /// `..._http_filter_set_gauge`.
    pub fn envoy_dynamic_module_callback_http_filter_config_set_gauge(
        config_envoy: HttpFilterConfigEnvoyPtr,
        gauge_id: usize,
        label_values: *const ModuleBuffer,
        label_values_len: usize,
        value: u64,
    ) -> MetricsResult;

    /// Resumes a request stopped in a request hook (headers, body or trailers).
    pub fn envoy_dynamic_module_callback_http_filter_continue_decoding(
        filter_envoy: HttpFilterEnvoyPtr,
    );

    // ----- filter state -----

    /// Sets filter state `key` through the object factory Envoy registered for that key (as
    /// `envoy.ratelimit.hits_addend`: a number as text). False when no factory knows the key
    /// or it refused the value.
    pub fn envoy_dynamic_module_callback_http_set_filter_state_typed(
        filter_envoy: HttpFilterEnvoyPtr,
        key: ModuleBuffer,
        value: ModuleBuffer,
    ) -> bool;

    // ----- counters -----

    /// Define a counter; only succeeds while `on_http_filter_config_new` runs (else FROZEN).
    /// With `label_names_len == 0` it is a plain counter. The id written to `*counter_id` is
    /// used by the increment callbacks. The stat appears as `<metrics_namespace>.<name>`.
    pub fn envoy_dynamic_module_callback_http_filter_config_define_counter(
        config_envoy: HttpFilterConfigEnvoyPtr,
        name: ModuleBuffer,
        label_names: *const ModuleBuffer,
        label_names_len: usize,
        counter_id: *mut usize,
    ) -> MetricsResult;

    /// Add `value` to a counter from a stream context. Pass null/0 labels for a plain counter;
    /// otherwise exactly as many label values as names were defined.
    pub fn envoy_dynamic_module_callback_http_filter_increment_counter(
        filter_envoy: HttpFilterEnvoyPtr,
        counter_id: usize,
        label_values: *const ModuleBuffer,
        label_values_len: usize,
        value: u64,
    ) -> MetricsResult;

    // ----- gauges (same shapes as the counters) -----

    /// Define a gauge; only succeeds while `on_http_filter_config_new` runs (else FROZEN).
    /// With `label_names_len == 0` it is a plain gauge.
    pub fn envoy_dynamic_module_callback_http_filter_config_define_gauge(
        config_envoy: HttpFilterConfigEnvoyPtr,
        name: ModuleBuffer,
        label_names: *const ModuleBuffer,
        label_names_len: usize,
        gauge_id: *mut usize,
    ) -> MetricsResult;

    /// Define a histogram; only succeeds while `on_http_filter_config_new` runs (else FROZEN).
    pub fn envoy_dynamic_module_callback_http_filter_config_define_histogram(
        config_envoy: HttpFilterConfigEnvoyPtr,
        name: ModuleBuffer,
        label_names: *const ModuleBuffer,
        label_names_len: usize,
        histogram_id: *mut usize,
    ) -> MetricsResult;

    /// Record `value` in a histogram from a stream context (labels as for counters).
    pub fn envoy_dynamic_module_callback_http_filter_record_histogram_value(
        filter_envoy: HttpFilterEnvoyPtr,
        histogram_id: usize,
        label_values: *const ModuleBuffer,
        label_values_len: usize,
        value: u64,
    ) -> MetricsResult;

    /// Set a gauge from a stream context. Pass null/0 labels for a plain gauge; otherwise
    /// exactly as many label values as names were defined.
    pub fn envoy_dynamic_module_callback_http_filter_set_gauge(
        filter_envoy: HttpFilterEnvoyPtr,
        gauge_id: usize,
        label_values: *const ModuleBuffer,
        label_values_len: usize,
        value: u64,
    ) -> MetricsResult;

}

#[cfg(test)]
mod tests {
    use super::*;

    const V1_40: &str =
        "envoy  version: 9e5580933739775e8bce696a57a2e1bc99368f23/1.40.0/Clean/RELEASE/BoringSSL\n";

    #[test]
    fn envoys_window_is_the_built_minor_and_the_next() {
        assert!(envoy_supports((1, 40), (1, 40)));
        assert!(envoy_supports((1, 40), (1, 41)));
        assert!(!envoy_supports((1, 40), (1, 39)));
        assert!(!envoy_supports((1, 40), (1, 42)));
        assert!(!envoy_supports((1, 40), (2, 40)));
        assert!(!envoy_supports((1, u32::MAX), (1, 0)));
    }

    #[test]
    fn the_version_comes_from_envoys_version_line() {
        assert_eq!(parse_envoy_version(V1_40), Some(((1, 40), "1.40.0")));
        let dev = "envoy  version: abc/1.41.0-dev/Modified/DEBUG/BoringSSL";
        assert_eq!(parse_envoy_version(dev), Some(((1, 41), "1.41.0-dev")));
        assert_eq!(parse_envoy_version("usage: envoy ..."), None);
        assert_eq!(parse_envoy_version("envoy  version: abc/x.y/Clean"), None);
    }

    #[test]
    fn a_refusal_names_both_versions_and_an_unknown_version_loads_with_a_warning() {
        let (load, level, line) = load_decision((1, 40), Ok(V1_40));
        assert!(load && level == log_level::INFO, "{line}");
        assert!(line.contains("1.40.0") && line.contains("v0.2.0"), "{line}");

        let (load, level, line) = load_decision((1, 38), Ok(V1_40));
        assert!(!load && level == log_level::ERROR, "{line}");
        assert!(
            line.contains("built for Envoy 1.38")
                && line.contains("Envoy 1.38.x or 1.39.x")
                && line.contains("this Envoy is 1.40.0"),
            "{line}"
        );

        let (load, level, line) = load_decision((1, 40), Err("No such file or directory"));
        assert!(load && level == log_level::WARN, "{line}");
        assert!(
            line.contains("No such file") && line.contains("1.40"),
            "{line}"
        );
        let (load, level, _) = load_decision((1, 40), Ok("not envoy"));
        assert!(load && level == log_level::WARN);
    }
}
