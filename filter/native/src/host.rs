//! Decides nothing: safe wrappers over the Envoy callbacks of [`crate::abi`]. The only module
//! besides the hook exports that holds `unsafe`.
//!
//! A [`Stream`] is Envoy's per-request filter pointer; it is valid for the duration of the hook
//! it was handed to, and every borrowed byte slice returned here lives no longer than the
//! `&self` borrow (Envoy owns those bytes until the hook returns or the value is changed).
#![allow(unsafe_code)]

use crate::abi::{self, attribute_id, body_type, header_type, EnvoyBuffer, ModuleBuffer};

/// Log levels of Envoy's `dynamic_modules` logger.
#[derive(Debug, Clone, Copy)]
pub enum Level {
    Info,
    Warn,
    Error,
}

/// Logs through Envoy (thread-safe on Envoy's side: its loggers are).
pub fn log(level: Level, msg: &str) {
    let l = match level {
        Level::Info => abi::log_level::INFO,
        Level::Warn => abi::log_level::WARN,
        Level::Error => abi::log_level::ERROR,
    };
    // SAFETY: the buffer points into `msg`, which outlives the call; Envoy copies it.
    unsafe { abi::envoy_dynamic_module_callback_log(l, ModuleBuffer::from_text(msg)) }
}

/// Envoy's array of `n` entries at `ptr` (empty when null or 0).
///
/// # Safety
/// `ptr` points to `n` initialised entries that Envoy keeps valid during the current hook.
pub unsafe fn slice<'a, T>(ptr: *const T, n: usize) -> &'a [T] {
    if ptr.is_null() || n == 0 {
        &[]
    } else {
        std::slice::from_raw_parts(ptr, n)
    }
}

/// `values`' first element for Envoy, or null when there is none (the ABI's "no labels").
fn array_ptr<T>(values: &[T]) -> *const T {
    if values.is_empty() {
        std::ptr::null()
    } else {
        values.as_ptr()
    }
}

/// Which header map.
#[derive(Debug, Clone, Copy)]
pub enum Map {
    Request,
    Response,
}

impl Map {
    fn raw(self) -> u32 {
        match self {
            Map::Request => header_type::REQUEST_HEADER,
            Map::Response => header_type::RESPONSE_HEADER,
        }
    }
}

/// Envoy's per-request filter handle, valid only inside the hook that received it.
#[derive(Debug)]
pub struct Stream(abi::HttpFilterEnvoyPtr);

impl Stream {
    /// Wraps the pointer a hook received. It must not be kept past that hook.
    pub fn new(ptr: abi::HttpFilterEnvoyPtr) -> Self {
        Stream(ptr)
    }

    /// The first value of header `key` in `map` (None when absent).
    pub fn header(&self, map: Map, key: &str) -> Option<&[u8]> {
        let mut out = EnvoyBuffer::null();
        // SAFETY: `self.0` is the live filter pointer of the current hook; `out` is a valid
        // out-pointer; a null optional size is allowed.
        let found = unsafe {
            abi::envoy_dynamic_module_callback_http_get_header(
                self.0,
                map.raw(),
                ModuleBuffer::from_text(key),
                &mut out,
                0,
                std::ptr::null_mut(),
            )
        };
        // SAFETY: Envoy filled `out` in this hook; the slice borrows `self`.
        (found && !out.ptr.is_null()).then(|| unsafe { out.as_bytes() })
    }

    /// The first value of header `key` as text (None when absent or not UTF-8).
    pub fn header_str(&self, map: Map, key: &str) -> Option<&str> {
        std::str::from_utf8(self.header(map, key)?).ok()
    }

    /// Sets header `key` to `value`, or removes it (`None`). False when Envoy refused.
    pub fn set_header(&self, map: Map, key: &str, value: Option<&str>) -> bool {
        let v = value.map_or(ModuleBuffer::null(), ModuleBuffer::from_text);
        // SAFETY: live filter pointer; the buffers point into `key`/`value`, copied by Envoy.
        unsafe {
            abi::envoy_dynamic_module_callback_http_set_header(
                self.0,
                map.raw(),
                ModuleBuffer::from_text(key),
                v,
            )
        }
    }

    fn attr_bytes(&self, id: u32) -> Option<&[u8]> {
        let mut out = EnvoyBuffer::null();
        // SAFETY: live filter pointer, valid out-pointer.
        let ok = unsafe {
            abi::envoy_dynamic_module_callback_http_filter_get_attribute_string(
                self.0, id, &mut out,
            )
        };
        // SAFETY: filled by Envoy in this hook; borrows `self`.
        (ok && !out.ptr.is_null()).then(|| unsafe { out.as_bytes() })
    }

    fn attr_int(&self, id: u32) -> Option<u64> {
        let mut out = 0u64;
        // SAFETY: live filter pointer, valid out-pointer.
        let ok = unsafe {
            abi::envoy_dynamic_module_callback_http_filter_get_attribute_int(self.0, id, &mut out)
        };
        ok.then_some(out)
    }

    /// `xds.cluster_name`: the routed cluster (None before a route matched).
    pub fn cluster_name(&self) -> Option<&str> {
        std::str::from_utf8(self.attr_bytes(attribute_id::XDS_CLUSTER_NAME)?).ok()
    }

    /// `upstream.address` (`ip:port`) of the final attempt.
    pub fn upstream_address(&self) -> Option<&str> {
        std::str::from_utf8(self.attr_bytes(attribute_id::UPSTREAM_ADDRESS)?).ok()
    }

    /// `response.code` (None or 0 before response headers).
    pub fn response_code(&self) -> Option<u16> {
        self.attr_int(attribute_id::RESPONSE_CODE)
            .and_then(|c| u16::try_from(c).ok())
            .filter(|c| *c > 0)
    }

    /// `response.code_details` (`via_upstream`, `upstream_reset_before_response_started{...}`).
    pub fn response_code_details(&self) -> Option<&str> {
        std::str::from_utf8(self.attr_bytes(attribute_id::RESPONSE_CODE_DETAILS)?).ok()
    }

    /// `connection.uri_san_peer_certificate`: the downstream peer certificate's URI SAN (a
    /// SPIFFE id under mTLS), None on a plain connection.
    pub fn peer_uri_san(&self) -> Option<&str> {
        let b = self.attr_bytes(attribute_id::CONNECTION_URI_SAN_PEER_CERTIFICATE)?;
        std::str::from_utf8(b).ok().filter(|s| !s.is_empty())
    }

    /// Resumes the request after a request hook stopped it.
    pub fn continue_decoding(&self) {
        // SAFETY: live filter pointer.
        unsafe { abi::envoy_dynamic_module_callback_http_filter_continue_decoding(self.0) }
    }

    /// The stream's scheduler (None when Envoy gave none).
    pub fn scheduler(&self) -> Option<Scheduler> {
        // SAFETY: live filter pointer.
        let p = unsafe { abi::envoy_dynamic_module_callback_http_filter_scheduler_new(self.0) };
        (!p.is_null()).then_some(Scheduler(p))
    }

    /// Sets filter state `key` to `value` through Envoy's object factory for that key; false
    /// when Envoy refused.
    pub fn set_filter_state_typed(&self, key: &str, value: &str) -> bool {
        // SAFETY: live filter pointer; the buffers point into `key`/`value`, copied by Envoy.
        unsafe {
            abi::envoy_dynamic_module_callback_http_set_filter_state_typed(
                self.0,
                ModuleBuffer::from_text(key),
                ModuleBuffer::from_text(value),
            )
        }
    }

    /// The response-body chunk of the current body hook, copied.
    pub fn response_chunk(&self) -> Vec<u8> {
        let mut body = Vec::new();
        self.append_body(body_type::RECEIVED_RESPONSE_BODY, &mut body);
        body
    }

    /// The request body: what Envoy buffered so far, then the chunk of the current body hook
    /// (`with_current`; at the last body call that chunk is not in the buffer yet), copied.
    pub fn request_body(&self, with_current: bool) -> Vec<u8> {
        let mut body = Vec::new();
        self.append_body(body_type::BUFFERED_REQUEST_BODY, &mut body);
        if with_current {
            self.append_body(body_type::RECEIVED_REQUEST_BODY, &mut body);
        }
        body
    }

    /// The request body's size so far: what Envoy buffered plus the current hook's chunk.
    pub fn request_body_len(&self) -> usize {
        [
            body_type::BUFFERED_REQUEST_BODY,
            body_type::RECEIVED_REQUEST_BODY,
        ]
        .iter()
        // SAFETY: live filter pointer.
        .map(|kind| unsafe { abi::envoy_dynamic_module_callback_http_get_body_size(self.0, *kind) })
        .sum()
    }

    fn append_body(&self, kind: u32, out: &mut Vec<u8>) {
        // SAFETY: live filter pointer.
        let n =
            unsafe { abi::envoy_dynamic_module_callback_http_get_body_chunks_size(self.0, kind) };
        if n == 0 {
            return;
        }
        let mut chunks = vec![EnvoyBuffer::null(); n];
        // SAFETY: `chunks` has room for the `n` slices Envoy reported.
        let ok = unsafe {
            abi::envoy_dynamic_module_callback_http_get_body_chunks(
                self.0,
                kind,
                chunks.as_mut_ptr(),
            )
        };
        if !ok {
            return;
        }
        for c in &chunks {
            // SAFETY: filled by Envoy in this hook.
            out.extend_from_slice(unsafe { c.as_bytes() });
        }
    }

    /// Answers the request locally (the upstream is never asked).
    pub fn send_response(&self, status: u32, headers: &[(&str, &str)], body: &[u8]) {
        let hs: Vec<abi::ModuleHttpHeader> = headers
            .iter()
            .map(|(k, v)| abi::ModuleHttpHeader::new(k, v))
            .collect();
        // SAFETY: live filter pointer; every buffer points into data that outlives the call.
        unsafe {
            abi::envoy_dynamic_module_callback_http_send_response(
                self.0,
                status,
                hs.as_ptr(),
                hs.len(),
                ModuleBuffer::from_bytes(body),
                ModuleBuffer::null(),
            )
        }
    }

    /// Asks the load balancer for `host` (`ip:port`) on the first attempt, falling back to the
    /// cluster's own policy when it is not in the cluster (non-strict). False when refused.
    pub fn set_upstream_override_host(&self, host: &str) -> bool {
        // SAFETY: live filter pointer; the buffer points into `host`, which outlives the call
        // (Envoy copies it).
        unsafe {
            abi::envoy_dynamic_module_callback_http_set_upstream_override_host(
                self.0,
                ModuleBuffer::from_text(host),
                false,
            )
        }
    }

    /// Adds `n` to the counter `id` (from [`ConfigHandle::define_counter`]); ignores errors.
    pub fn inc(&self, id: usize, n: u64) {
        self.inc_with(id, &[], n);
    }

    /// Adds `n` to the two-label counter `id` for those labels' values; ignores errors.
    pub fn inc_labeled2(&self, id: LabeledCounter2, values: [&str; 2], n: u64) {
        self.inc_with(id.0, &values.map(ModuleBuffer::from_text), n);
    }

    /// Records `v` in the plain histogram `id` (from [`ConfigHandle::define_histogram`]).
    pub fn record(&self, id: usize, v: u64) {
        self.metric(
            abi::envoy_dynamic_module_callback_http_filter_record_histogram_value,
            id,
            &[],
            v,
        );
    }

    /// Sets the plain gauge `id` (from [`ConfigHandle::define_gauge`]) to `v`.
    pub fn set_gauge(&self, id: usize, v: u64) {
        self.metric(
            abi::envoy_dynamic_module_callback_http_filter_set_gauge,
            id,
            &[],
            v,
        );
    }

    /// Adds `n` to the one-label counter `id` for that label's `value`; ignores errors.
    pub fn inc_labeled(&self, id: LabeledCounter, value: &str, n: u64) {
        self.inc_with(id.0, &[ModuleBuffer::from_text(value)], n);
    }

    /// Sets the one-label gauge `id` for that label's `value` to `v`; ignores errors.
    pub fn set_labeled(&self, id: LabeledGauge, value: &str, v: u64) {
        self.metric(
            abi::envoy_dynamic_module_callback_http_filter_set_gauge,
            id.0,
            &[ModuleBuffer::from_text(value)],
            v,
        );
    }

    fn inc_with(&self, id: usize, values: &[ModuleBuffer], n: u64) {
        if n == 0 {
            return;
        }
        self.metric(
            abi::envoy_dynamic_module_callback_http_filter_increment_counter,
            id,
            values,
            n,
        );
    }

    /// Applies `op` (one of the ABI's counter, gauge and histogram updates, which share one
    /// signature) to metric `id` with `values` for its labels; ignores errors and id 0.
    fn metric(
        &self,
        op: UpdateMetric<abi::HttpFilterEnvoyPtr>,
        id: usize,
        values: &[ModuleBuffer],
        v: u64,
    ) {
        // SAFETY: live filter pointer in its hook; callers pass as many values as labels.
        unsafe { update_metric(op, self.0, id, values, v) }
    }
}

/// The id of a counter with one label ([`ConfigHandle::define_labeled_counter`]); only
/// [`Stream::inc_labeled`] takes it, with exactly one value. 0: never counted.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct LabeledCounter(usize);

/// A stream's scheduler: wakes the stream on its worker thread (`on_http_filter_scheduled`)
/// from any thread. Deleted when dropped; Envoy drops events for a stream that is gone.
#[derive(Debug)]
pub struct Scheduler(abi::HttpFilterSchedulerPtr);

// SAFETY: Envoy's scheduler posts to the stream's dispatcher and may be committed from any
// thread; the module deletes it once (Drop), after every committer let go of it (the held
// registry removes it under its lock first).
unsafe impl Send for Scheduler {}

impl Scheduler {
    /// Posts `event` to the stream's worker thread.
    pub fn commit(&self, event: u64) {
        // SAFETY: a live scheduler from `scheduler_new`, not deleted before Drop.
        unsafe { abi::envoy_dynamic_module_callback_http_filter_scheduler_commit(self.0, event) }
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        // SAFETY: created by `scheduler_new`, deleted once.
        unsafe { abi::envoy_dynamic_module_callback_http_filter_scheduler_delete(self.0) }
    }
}

/// The id of a counter with two labels ([`ConfigHandle::define_labeled_counter2`]); only
/// [`Stream::inc_labeled2`] takes it, with exactly two values. 0: never counted.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct LabeledCounter2(usize);

/// The id of a gauge with one label ([`ConfigHandle::define_labeled_gauge`]); only
/// [`StatSink::set_labeled`] takes it. 0: never set.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct LabeledGauge(usize);

/// The shape of the ABI's metric updates (counter, gauge, histogram), on `P`: a stream
/// ([`abi::HttpFilterEnvoyPtr`]) or, outside any stream, the config
/// ([`abi::HttpFilterConfigEnvoyPtr`]).
type UpdateMetric<P> =
    unsafe extern "C" fn(P, usize, *const ModuleBuffer, usize, u64) -> abi::MetricsResult;

/// Applies `op` to metric `id` of `target` with `values` for its labels; ignores errors and
/// id 0.
///
/// # Safety
/// `target` must be the live pointer `op` expects (a stream in its hook, the config in a
/// config-level hook) and `values` as many as the metric's labels.
unsafe fn update_metric<P>(
    op: UpdateMetric<P>,
    target: P,
    id: usize,
    values: &[ModuleBuffer],
    v: u64,
) {
    if id == 0 {
        return;
    }
    // SAFETY: the caller's; `values` (and the text each points into) outlives the call, and
    // Envoy reads exactly `values.len()` of them.
    unsafe {
        op(target, id, array_ptr(values), values.len(), v);
    }
}

/// The shape of the ABI's metric-defining callbacks (counter, gauge, histogram).
type DefineMetric = unsafe extern "C" fn(
    abi::HttpFilterConfigEnvoyPtr,
    ModuleBuffer,
    *const ModuleBuffer,
    usize,
    *mut usize,
) -> abi::MetricsResult;

/// Where stats are written: a stream in its hook ([`Stream`]), or the config on the main
/// thread ([`ConfigHandle`], in the config-level hooks).
pub trait StatSink {
    /// Adds `n` to the plain counter `id`; ignores errors and id 0.
    fn inc(&self, id: usize, n: u64);
    /// Adds `n` to the one-label counter `id` for that label's `value`.
    fn inc_labeled(&self, id: LabeledCounter, value: &str, n: u64);
    /// Sets the one-label gauge `id` for that label's `value` to `v`; ignores errors.
    fn set_labeled(&self, id: LabeledGauge, value: &str, v: u64);
}

impl StatSink for Stream {
    fn inc(&self, id: usize, n: u64) {
        Stream::inc(self, id, n);
    }
    fn inc_labeled(&self, id: LabeledCounter, value: &str, n: u64) {
        Stream::inc_labeled(self, id, value, n);
    }
    fn set_labeled(&self, id: LabeledGauge, value: &str, v: u64) {
        Stream::set_labeled(self, id, value, v);
    }
}

impl StatSink for ConfigHandle {
    fn inc(&self, id: usize, n: u64) {
        self.config_inc(id, &[], n);
    }
    fn inc_labeled(&self, id: LabeledCounter, value: &str, n: u64) {
        self.config_inc(id.0, &[ModuleBuffer::from_text(value)], n);
    }
    fn set_labeled(&self, id: LabeledGauge, value: &str, v: u64) {
        self.config_metric(
            abi::envoy_dynamic_module_callback_http_filter_config_set_gauge,
            id.0,
            &[ModuleBuffer::from_text(value)],
            v,
        );
    }
}

/// A config's scheduler: posts events to the main thread (`on_http_filter_config_scheduled`)
/// from any thread. Deleted when dropped; Envoy drops events for a config that is gone.
#[derive(Debug)]
pub struct ConfigScheduler(abi::HttpFilterConfigSchedulerPtr);

// SAFETY: Envoy's config scheduler posts to the main dispatcher and may be committed from any
// thread; the module deletes it once (Drop), after its committing thread was joined
// (`crate::main_tick::MainTick`).
unsafe impl Send for ConfigScheduler {}
unsafe impl Sync for ConfigScheduler {}

impl ConfigScheduler {
    /// Posts `event` to the main thread.
    pub fn commit(&self, event: u64) {
        // SAFETY: a live scheduler from `config_scheduler_new`, not deleted before Drop.
        unsafe {
            abi::envoy_dynamic_module_callback_http_filter_config_scheduler_commit(self.0, event)
        }
    }
}

impl Drop for ConfigScheduler {
    fn drop(&mut self) {
        // SAFETY: created by `config_scheduler_new`, deleted once.
        unsafe { abi::envoy_dynamic_module_callback_http_filter_config_scheduler_delete(self.0) }
    }
}

/// Envoy's per-config handle. Metrics are defined through it inside `on_http_filter_config_new`
/// only; the config-level hooks (main thread) get it again for the config's scheduler, HTTP
/// callouts and counters.
#[derive(Debug)]
pub struct ConfigHandle(abi::HttpFilterConfigEnvoyPtr);

impl ConfigHandle {
    pub fn new(ptr: abi::HttpFilterConfigEnvoyPtr) -> Self {
        ConfigHandle(ptr)
    }

    /// The config's scheduler (None when Envoy gave none).
    pub fn scheduler(&self) -> Option<ConfigScheduler> {
        // SAFETY: live config pointer (config_new or a config-level hook).
        let p =
            unsafe { abi::envoy_dynamic_module_callback_http_filter_config_scheduler_new(self.0) };
        (!p.is_null()).then_some(ConfigScheduler(p))
    }

    /// Sends `POST`-or-whatever `headers` (with `:method`, `:path`, `:authority`) and `body` on
    /// `cluster` from the main thread, answered in `on_http_filter_config_http_callout_done`;
    /// the callout's id, or Envoy's refusal code (`..._http_callout_init_result`).
    pub fn http_callout(
        &self,
        cluster: &str,
        headers: &[(String, String)],
        body: &[u8],
        timeout_ms: u64,
    ) -> Result<u64, u32> {
        let hs: Vec<abi::ModuleHttpHeader> = headers
            .iter()
            .map(|(k, v)| abi::ModuleHttpHeader::new(k, v))
            .collect();
        let mut id = 0u64;
        // SAFETY: live config pointer on the main thread; `hs`, the strings they point into,
        // `cluster` and `body` outlive the call (Envoy copies them into its request).
        let r = unsafe {
            abi::envoy_dynamic_module_callback_http_filter_config_http_callout(
                self.0,
                &mut id,
                ModuleBuffer::from_text(cluster),
                hs.as_ptr(),
                hs.len(),
                ModuleBuffer::from_bytes(body),
                timeout_ms,
            )
        };
        if r == abi::http_callout_init_result::SUCCESS {
            Ok(id)
        } else {
            Err(r)
        }
    }

    /// Adds `n` to counter `id` with label `values` outside any stream; ignores errors and id 0.
    fn config_inc(&self, id: usize, values: &[ModuleBuffer], n: u64) {
        if n > 0 {
            self.config_metric(
                abi::envoy_dynamic_module_callback_http_filter_config_increment_counter,
                id,
                values,
                n,
            );
        }
    }

    /// Updates metric `id` with label `values` through `op` outside any stream; ignores errors
    /// and id 0.
    fn config_metric(
        &self,
        op: UpdateMetric<abi::HttpFilterConfigEnvoyPtr>,
        id: usize,
        values: &[ModuleBuffer],
        v: u64,
    ) {
        // SAFETY: live config pointer in a config-level hook; callers pass as many values as
        // labels.
        unsafe { update_metric(op, self.0, id, values, v) }
    }

    /// Defines counter `name` (shown as `<metrics_namespace>.<name>`); 0 (never counted) when
    /// Envoy refused.
    pub fn define_counter(&self, name: &str) -> usize {
        self.define_counter_with(name, &[])
    }

    /// Defines counter `name` with the one label `label` (an Envoy tag: in `/stats` each
    /// value shows as `<name>.<label>.<value>`, in `/stats/prometheus` as a label). One label
    /// by construction, so every increment ([`Stream::inc_labeled`]) passes exactly as many
    /// values as the counter has labels.
    pub fn define_labeled_counter(&self, name: &str, label: &str) -> LabeledCounter {
        LabeledCounter(self.define_counter_with(name, &[ModuleBuffer::from_text(label)]))
    }

    /// Defines counter `name` with the two labels `labels` (shown as for one label, in order).
    pub fn define_labeled_counter2(&self, name: &str, labels: [&str; 2]) -> LabeledCounter2 {
        LabeledCounter2(self.define_counter_with(name, &labels.map(ModuleBuffer::from_text)))
    }

    /// Defines the plain gauge `name`; 0 (never set) when Envoy refused.
    pub fn define_gauge(&self, name: &str) -> usize {
        self.define(
            abi::envoy_dynamic_module_callback_http_filter_config_define_gauge,
            name,
            &[],
        )
    }

    /// Defines the plain histogram `name`; 0 (never recorded) when Envoy refused.
    pub fn define_histogram(&self, name: &str) -> usize {
        self.define(
            abi::envoy_dynamic_module_callback_http_filter_config_define_histogram,
            name,
            &[],
        )
    }

    /// Defines gauge `name` with the one label `label`, as [`Self::define_labeled_counter`].
    pub fn define_labeled_gauge(&self, name: &str, label: &str) -> LabeledGauge {
        LabeledGauge(self.define(
            abi::envoy_dynamic_module_callback_http_filter_config_define_gauge,
            name,
            &[ModuleBuffer::from_text(label)],
        ))
    }

    fn define_counter_with(&self, name: &str, labels: &[ModuleBuffer]) -> usize {
        self.define(
            abi::envoy_dynamic_module_callback_http_filter_config_define_counter,
            name,
            labels,
        )
    }

    /// Defines a metric with `define` (one of the ABI's define callbacks, which share one
    /// signature); 0 (never used) when Envoy refused.
    fn define(&self, define: DefineMetric, name: &str, labels: &[ModuleBuffer]) -> usize {
        let ptr = array_ptr(labels);
        let mut id = 0usize;
        // SAFETY: live config pointer during config_new; valid out-pointer; `labels` (and the
        // text each points into) outlives the call.
        let r = unsafe {
            define(
                self.0,
                ModuleBuffer::from_text(name),
                ptr,
                labels.len(),
                &mut id,
            )
        };
        if r == abi::metrics_result::SUCCESS {
            id
        } else {
            0
        }
    }
}
