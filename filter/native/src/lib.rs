//! ai-lb as an Envoy 1.40 dynamic module (`envoy.filters.http.dynamic_modules`): the same core
//! as the wasm filter, run in-process with no V8 entry per callback: the data path for
//! operators who want the lowest overhead. It drives the core's request lifecycle like the
//! wasm filter (pool by cluster, model by header or body, pick, override_host header, breakers
//! shared by the workers, debug header, status page), admission and the big-request hold, and
//! guard mode (the inference pod's inbound sidecar); filter/native/README.md says where it
//! differs.
//!
//! Layout: [`abi`] declares Envoy's C ABI, [`host`] wraps the callbacks safely, [`config`]
//! validates, [`feed`] subscribes to the agents on a thread of its own, [`breakers`] shares
//! the circuit breakers between workers, [`filter`] is the per-request glue, and the hooks
//! below only translate. No hook lets a panic escape: a panic inside one is caught and the
//! request continues untouched.
#![deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod abi;
pub mod admission;
pub mod breakers;
pub mod config;
pub mod feed;
pub mod filter;
pub mod held;
pub mod host;
pub mod main_tick;
pub mod probes;

#[allow(unsafe_code)]
mod exports {
    use std::os::raw::c_char;
    use std::panic::{catch_unwind, AssertUnwindSafe};

    use crate::abi::{self, body_status, headers_status, trailers_status, EnvoyBuffer};
    use crate::filter::{BodyNext, ConfigRt, Next, Request};
    use crate::host::{self, ConfigHandle, Level, Stream};

    /// Runs `f`, turning a panic into `fallback` (logged).
    fn guard<T>(fallback: T, f: impl FnOnce() -> T) -> T {
        catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
            host::log(
                Level::Error,
                "ai-lb native: a hook panicked; request left untouched",
            );
            fallback
        })
    }

    /// The request behind Envoy's module pointer.
    ///
    /// SAFETY (caller): `p` is a pointer returned by `on_http_filter_new` and not yet
    /// destroyed; Envoy calls one stream's hooks on one thread, one at a time.
    unsafe fn request<'a>(p: abi::HttpFilterModulePtr) -> Option<&'a mut Request> {
        (p as *mut Request).as_mut()
    }

    /// Refuses (null) to load into an Envoy outside the ABI's window, naming both versions
    /// in Envoy's log: Envoy 1.40 itself only warns on a mismatch (abi::program_init).
    #[no_mangle]
    pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const c_char {
        guard(abi::ABI_VERSION.as_ptr().cast(), || {
            abi::program_init(abi::BUILT_FOR_ENVOY)
        })
    }

    #[no_mangle]
    pub extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
        config_envoy: abi::HttpFilterConfigEnvoyPtr,
        _name: EnvoyBuffer,
        config: EnvoyBuffer,
    ) -> abi::HttpFilterConfigModulePtr {
        guard(std::ptr::null(), || {
            // SAFETY: Envoy's config bytes, valid during this call.
            let bytes = unsafe { config.as_bytes() };
            match ConfigRt::new(&ConfigHandle::new(config_envoy), bytes) {
                Ok(rt) => Box::into_raw(Box::new(rt)) as abi::HttpFilterConfigModulePtr,
                Err(e) => {
                    // A null config makes Envoy refuse the whole configuration.
                    host::log(Level::Error, &e);
                    std::ptr::null()
                }
            }
        })
    }

    #[no_mangle]
    pub extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(
        config_module: abi::HttpFilterConfigModulePtr,
    ) {
        guard((), || {
            if !config_module.is_null() {
                // SAFETY: created by Box::into_raw in config_new, destroyed once.
                drop(unsafe { Box::from_raw(config_module as *mut ConfigRt) });
            }
        })
    }

    #[no_mangle]
    pub extern "C" fn envoy_dynamic_module_on_http_filter_new(
        config_module: abi::HttpFilterConfigModulePtr,
        _filter_envoy: abi::HttpFilterEnvoyPtr,
    ) -> abi::HttpFilterModulePtr {
        guard(std::ptr::null(), || {
            let r = Request::new(config_module as *const ConfigRt);
            Box::into_raw(Box::new(r)) as abi::HttpFilterModulePtr
        })
    }

    #[no_mangle]
    pub extern "C" fn envoy_dynamic_module_on_http_filter_destroy(
        filter_module: abi::HttpFilterModulePtr,
    ) {
        guard((), || {
            if !filter_module.is_null() {
                // SAFETY: created by Box::into_raw in filter_new, destroyed once.
                drop(unsafe { Box::from_raw(filter_module as *mut Request) });
            }
        })
    }

    #[no_mangle]
    pub extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
        filter_envoy: abi::HttpFilterEnvoyPtr,
        filter_module: abi::HttpFilterModulePtr,
        end_of_stream: bool,
    ) -> abi::HeadersStatus {
        guard(headers_status::CONTINUE, || {
            // SAFETY: see `request`.
            let Some(r) = (unsafe { request(filter_module) }) else {
                return headers_status::CONTINUE;
            };
            match r.on_request_headers(&Stream::new(filter_envoy), end_of_stream) {
                Next::Continue => headers_status::CONTINUE,
                Next::StopAndBuffer | Next::Replied => headers_status::STOP_ITERATION,
            }
        })
    }

    #[no_mangle]
    pub extern "C" fn envoy_dynamic_module_on_http_filter_request_body(
        filter_envoy: abi::HttpFilterEnvoyPtr,
        filter_module: abi::HttpFilterModulePtr,
        end_of_stream: bool,
    ) -> abi::BodyStatus {
        guard(body_status::CONTINUE, || {
            // SAFETY: see `request`.
            let Some(r) = (unsafe { request(filter_module) }) else {
                return body_status::CONTINUE;
            };
            match r.on_request_body(&Stream::new(filter_envoy), end_of_stream) {
                // Buffered with flow control: a chunk that takes the buffered body past
                // Envoy's limit pauses the client instead of failing the request with 413
                // (with StopIterationAndBuffer, 128 KB held plus a 1 MiB read did).
                BodyNext::Wait => body_status::STOP_ITERATION_AND_WATERMARK,
                // Answered locally: the body goes no further.
                BodyNext::Stop => body_status::STOP_ITERATION_AND_BUFFER,
                BodyNext::Continue => body_status::CONTINUE,
            }
        })
    }

    #[no_mangle]
    pub extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(
        filter_envoy: abi::HttpFilterEnvoyPtr,
        filter_module: abi::HttpFilterModulePtr,
    ) -> abi::TrailersStatus {
        guard(trailers_status::CONTINUE, || {
            // SAFETY: see `request`.
            let stop = unsafe { request(filter_module) }
                .is_some_and(|r| r.on_request_trailers(&Stream::new(filter_envoy)));
            if stop {
                trailers_status::STOP_ITERATION
            } else {
                trailers_status::CONTINUE
            }
        })
    }

    #[no_mangle]
    pub extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
        filter_envoy: abi::HttpFilterEnvoyPtr,
        filter_module: abi::HttpFilterModulePtr,
        end_of_stream: bool,
    ) -> abi::HeadersStatus {
        guard(headers_status::CONTINUE, || {
            // SAFETY: see `request`.
            if let Some(r) = unsafe { request(filter_module) } {
                r.on_response_headers(&Stream::new(filter_envoy), end_of_stream);
            }
            headers_status::CONTINUE
        })
    }

    #[no_mangle]
    pub extern "C" fn envoy_dynamic_module_on_http_filter_response_body(
        filter_envoy: abi::HttpFilterEnvoyPtr,
        filter_module: abi::HttpFilterModulePtr,
        end_of_stream: bool,
    ) -> abi::BodyStatus {
        guard(body_status::CONTINUE, || {
            // SAFETY: see `request`.
            if let Some(r) = unsafe { request(filter_module) } {
                r.on_response_body(&Stream::new(filter_envoy), end_of_stream);
            }
            body_status::CONTINUE
        })
    }

    #[no_mangle]
    pub extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(
        _filter_envoy: abi::HttpFilterEnvoyPtr,
        _filter_module: abi::HttpFilterModulePtr,
    ) -> abi::TrailersStatus {
        trailers_status::CONTINUE
    }

    #[no_mangle]
    pub extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(
        filter_envoy: abi::HttpFilterEnvoyPtr,
        filter_module: abi::HttpFilterModulePtr,
    ) {
        guard((), || {
            // SAFETY: see `request`.
            if let Some(r) = unsafe { request(filter_module) } {
                r.on_stream_complete(&Stream::new(filter_envoy));
            }
        })
    }

    // Hooks Envoy 1.40 requires but this module never asks for (no callouts, no flow control
    // of its own).

    /// A held request's tick (see `held`): released, answered, or still waiting.
    #[no_mangle]
    pub extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(
        filter_envoy: abi::HttpFilterEnvoyPtr,
        filter_module: abi::HttpFilterModulePtr,
        _event_id: u64,
    ) {
        guard((), || {
            // SAFETY: see `request`.
            if let Some(r) = unsafe { request(filter_module) } {
                r.on_scheduled(&Stream::new(filter_envoy));
            }
        })
    }

    #[no_mangle]
    pub extern "C" fn envoy_dynamic_module_on_http_filter_http_callout_done(
        _filter_envoy: abi::HttpFilterEnvoyPtr,
        _filter_module: abi::HttpFilterModulePtr,
        _callout_id: u64,
        _result: abi::HttpCalloutResult,
        _headers: *const abi::EnvoyHttpHeader,
        _headers_size: usize,
        _body_chunks: *const EnvoyBuffer,
        _body_chunks_size: usize,
    ) {
    }

    #[no_mangle]
    pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_headers(
        _filter_envoy: abi::HttpFilterEnvoyPtr,
        _filter_module: abi::HttpFilterModulePtr,
        _stream_id: u64,
        _headers: *const abi::EnvoyHttpHeader,
        _headers_size: usize,
        _end_stream: bool,
    ) {
    }

    #[no_mangle]
    pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_data(
        _filter_envoy: abi::HttpFilterEnvoyPtr,
        _filter_module: abi::HttpFilterModulePtr,
        _stream_id: u64,
        _data: *const EnvoyBuffer,
        _data_count: usize,
        _end_stream: bool,
    ) {
    }

    #[no_mangle]
    pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_trailers(
        _filter_envoy: abi::HttpFilterEnvoyPtr,
        _filter_module: abi::HttpFilterModulePtr,
        _stream_id: u64,
        _trailers: *const abi::EnvoyHttpHeader,
        _trailers_size: usize,
    ) {
    }

    #[no_mangle]
    pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_complete(
        _filter_envoy: abi::HttpFilterEnvoyPtr,
        _filter_module: abi::HttpFilterModulePtr,
        _stream_id: u64,
    ) {
    }

    #[no_mangle]
    pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_reset(
        _filter_envoy: abi::HttpFilterEnvoyPtr,
        _filter_module: abi::HttpFilterModulePtr,
        _stream_id: u64,
        _reason: abi::HttpStreamResetReason,
    ) {
    }

    #[no_mangle]
    pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(
        _filter_envoy: abi::HttpFilterEnvoyPtr,
        _filter_module: abi::HttpFilterModulePtr,
    ) {
    }

    #[no_mangle]
    pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(
        _filter_envoy: abi::HttpFilterEnvoyPtr,
        _filter_module: abi::HttpFilterModulePtr,
    ) {
    }

    /// The main thread's tick (synthetic probes, per-pod gauges): [`crate::main_tick`].
    #[no_mangle]
    pub extern "C" fn envoy_dynamic_module_on_http_filter_config_scheduled(
        config_envoy: abi::HttpFilterConfigEnvoyPtr,
        config_module: abi::HttpFilterConfigModulePtr,
        event_id: u64,
    ) {
        guard((), || {
            // SAFETY: the config from config_new, alive while Envoy calls its hooks.
            let rt = unsafe { (config_module as *const ConfigRt).as_ref() };
            if let (Some(rt), crate::main_tick::TICK_EVENT) = (rt, event_id) {
                crate::main_tick::on_tick(rt, &ConfigHandle::new(config_envoy));
            }
        })
    }

    /// `breaker.syntheticProbe`: a probe's callout ended, on the main thread.
    #[no_mangle]
    pub extern "C" fn envoy_dynamic_module_on_http_filter_config_http_callout_done(
        config_envoy: abi::HttpFilterConfigEnvoyPtr,
        config_module: abi::HttpFilterConfigModulePtr,
        callout_id: u64,
        result: abi::HttpCalloutResult,
        headers: *const abi::EnvoyHttpHeader,
        headers_size: usize,
        body_chunks: *const EnvoyBuffer,
        body_chunks_size: usize,
    ) {
        guard((), || {
            // SAFETY: the config from config_new, alive while Envoy calls its hooks.
            let Some(rt) = (unsafe { (config_module as *const ConfigRt).as_ref() }) else {
                return;
            };
            let mut status = None;
            let mut body = Vec::new();
            if result == abi::http_callout_result::SUCCESS {
                // SAFETY: Envoy's arrays of `*_size` entries, valid during this hook (null
                // when empty).
                let hs = unsafe { host::slice(headers, headers_size) };
                status = hs.iter().find_map(|h| {
                    // SAFETY: Envoy's header bytes, valid during this hook.
                    let (k, v) = unsafe { (h.key(), h.value()) };
                    (k == b":status")
                        .then(|| std::str::from_utf8(v).ok()?.parse::<u16>().ok())
                        .flatten()
                });
                // SAFETY: as above.
                for chunk in unsafe { host::slice(body_chunks, body_chunks_size) } {
                    // SAFETY: Envoy's body bytes, valid during this hook.
                    body.extend_from_slice(unsafe { chunk.as_bytes() });
                }
            }
            crate::probes::on_callout_done(
                rt,
                &ConfigHandle::new(config_envoy),
                callout_id,
                status,
                body,
            );
        })
    }

    // The compiler checks each export against the ABI's declared hook type.
    const _: abi::OnProgramInit = envoy_dynamic_module_on_program_init;
    const _: abi::OnHttpFilterConfigNew = envoy_dynamic_module_on_http_filter_config_new;
    const _: abi::OnHttpFilterConfigDestroy = envoy_dynamic_module_on_http_filter_config_destroy;
    const _: abi::OnHttpFilterNew = envoy_dynamic_module_on_http_filter_new;
    const _: abi::OnHttpFilterDestroy = envoy_dynamic_module_on_http_filter_destroy;
    const _: abi::OnHttpFilterRequestHeaders = envoy_dynamic_module_on_http_filter_request_headers;
    const _: abi::OnHttpFilterRequestBody = envoy_dynamic_module_on_http_filter_request_body;
    const _: abi::OnHttpFilterRequestTrailers =
        envoy_dynamic_module_on_http_filter_request_trailers;
    const _: abi::OnHttpFilterResponseHeaders =
        envoy_dynamic_module_on_http_filter_response_headers;
    const _: abi::OnHttpFilterResponseBody = envoy_dynamic_module_on_http_filter_response_body;
    const _: abi::OnHttpFilterResponseTrailers =
        envoy_dynamic_module_on_http_filter_response_trailers;
    const _: abi::OnHttpFilterStreamComplete = envoy_dynamic_module_on_http_filter_stream_complete;
    const _: abi::OnHttpFilterScheduled = envoy_dynamic_module_on_http_filter_scheduled;
    const _: abi::OnHttpFilterHttpCalloutDone =
        envoy_dynamic_module_on_http_filter_http_callout_done;
    const _: abi::OnHttpFilterHttpStreamHeaders =
        envoy_dynamic_module_on_http_filter_http_stream_headers;
    const _: abi::OnHttpFilterHttpStreamData = envoy_dynamic_module_on_http_filter_http_stream_data;
    const _: abi::OnHttpFilterHttpStreamTrailers =
        envoy_dynamic_module_on_http_filter_http_stream_trailers;
    const _: abi::OnHttpFilterHttpStreamComplete =
        envoy_dynamic_module_on_http_filter_http_stream_complete;
    const _: abi::OnHttpFilterHttpStreamReset =
        envoy_dynamic_module_on_http_filter_http_stream_reset;
    const _: abi::OnHttpFilterDownstreamAboveWriteBufferHighWatermark =
        envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark;
    const _: abi::OnHttpFilterDownstreamBelowWriteBufferLowWatermark =
        envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark;
    const _: abi::OnHttpFilterConfigScheduled =
        envoy_dynamic_module_on_http_filter_config_scheduled;
    const _: abi::OnHttpFilterConfigHttpCalloutDone =
        envoy_dynamic_module_on_http_filter_config_http_callout_done;
}
