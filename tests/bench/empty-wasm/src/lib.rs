//! A proxy-wasm HTTP filter that does nothing, or only the listed pieces of the ai-lb filter's
//! per-request host work: the floor any Rust proxy-wasm filter costs in this Envoy, and what
//! each piece adds to it. Never shipped.
//!
//! The overhead benchmark runs it (`ai-lb-bench overhead --overhead-filter empty-wasm`) in front
//! of plain Envoy's least_request cluster. Its plugin configuration (the harness passes
//! `AI_LB_BENCH_EMPTY_WASM_STEPS`) is a comma-separated list of steps, done per request in the
//! phase where the ai-lb filter does them:
//!
//! | step | phase | what |
//! |---|---|---|
//! | `clock` | request headers | read the host clock |
//! | `drop-header` | request headers | remove `x-gateway-destination-endpoint` |
//! | `drop-header-if-present` | request headers | read it, remove it only if present |
//! | `read-path` | request headers | read `:path` |
//! | `read-cluster` | request headers | read the property `xds.cluster_name` |
//! | `pause-body` | request headers and body | stop at the headers, resume at the body's end |
//! | `read-body` | request body | read the whole buffered body (with `pause-body`) |
//! | `set-header` | request headers, or the body's end with `pause-body` | write `x-gateway-destination-endpoint` |
//! | `read-attempts` | response headers | read `x-envoy-attempt-count` |
//! | `log-props` | log | read `upstream.address`, `response.code`, `response.flags` |
//!
//! An unknown step makes `on_configure` fail, so Envoy refuses the config.

use std::rc::Rc;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(EmptyRoot::default()) });
}}

const HEADER: &str = "x-gateway-destination-endpoint";

/// The steps named in the configuration.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Steps {
    pub clock: bool,
    pub drop_header: bool,
    pub drop_header_if_present: bool,
    pub read_path: bool,
    pub read_cluster: bool,
    pub pause_body: bool,
    pub read_body: bool,
    pub set_header: bool,
    pub read_attempts: bool,
    pub log_props: bool,
}

impl Steps {
    /// Parses `a,b,c` (blank = no step); the error names the unknown step.
    pub fn parse(text: &str) -> Result<Steps, String> {
        let mut s = Steps::default();
        for step in text.split(',').map(str::trim).filter(|x| !x.is_empty()) {
            let flag = match step {
                "clock" => &mut s.clock,
                "drop-header" => &mut s.drop_header,
                "drop-header-if-present" => &mut s.drop_header_if_present,
                "read-path" => &mut s.read_path,
                "read-cluster" => &mut s.read_cluster,
                "pause-body" => &mut s.pause_body,
                "read-body" => &mut s.read_body,
                "set-header" => &mut s.set_header,
                "read-attempts" => &mut s.read_attempts,
                "log-props" => &mut s.log_props,
                other => return Err(format!("empty-wasm: unknown step {other:?}")),
            };
            *flag = true;
        }
        Ok(s)
    }
}

#[derive(Default)]
struct EmptyRoot {
    steps: Rc<Steps>,
}

impl Context for EmptyRoot {}

impl RootContext for EmptyRoot {
    fn on_configure(&mut self, _size: usize) -> bool {
        let bytes = hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX)
            .ok()
            .flatten()
            .unwrap_or_default();
        match Steps::parse(&String::from_utf8_lossy(&bytes)) {
            Ok(s) => {
                self.steps = Rc::new(s);
                true
            }
            Err(e) => {
                let _ = hostcalls::log(LogLevel::Critical, &e);
                false
            }
        }
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        if *self.steps == Steps::default() {
            return Some(Box::new(Empty));
        }
        Some(Box::new(Probe {
            steps: self.steps.clone(),
            waiting: false,
        }))
    }
}

/// No step: every callback is the SDK's default (continue).
struct Empty;

impl Context for Empty {}

impl HttpContext for Empty {}

struct Probe {
    steps: Rc<Steps>,
    waiting: bool,
}

fn request_header(name: &str) -> Option<String> {
    hostcalls::get_map_value(MapType::HttpRequestHeaders, name)
        .ok()
        .flatten()
}

fn set_request_header(value: Option<&str>) {
    let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, HEADER, value);
}

fn property(path: &[&str]) -> Option<Vec<u8>> {
    hostcalls::get_property(path.to_vec()).ok().flatten()
}

impl Context for Probe {}

impl HttpContext for Probe {
    fn on_http_request_headers(&mut self, _n: usize, end_of_stream: bool) -> Action {
        let s = *self.steps;
        if s.clock {
            let _ = hostcalls::get_current_time();
        }
        if s.drop_header {
            set_request_header(None);
        }
        if s.drop_header_if_present && request_header(HEADER).is_some() {
            set_request_header(None);
        }
        if s.read_path {
            let _ = request_header(":path");
        }
        if s.read_cluster {
            let _ = property(&["xds", "cluster_name"]);
        }
        if s.pause_body && !end_of_stream {
            self.waiting = true;
            return Action::Pause;
        }
        if s.set_header {
            set_request_header(Some("127.0.0.1:1"));
        }
        Action::Continue
    }

    fn on_http_request_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        if !self.waiting {
            return Action::Continue;
        }
        if !end_of_stream {
            return Action::Pause;
        }
        self.waiting = false;
        if self.steps.read_body {
            let _ = hostcalls::get_buffer(BufferType::HttpRequestBody, 0, size);
        }
        if self.steps.set_header {
            set_request_header(Some("127.0.0.1:1"));
        }
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _n: usize, _end_of_stream: bool) -> Action {
        if self.steps.read_attempts {
            let _ = hostcalls::get_map_value(MapType::HttpResponseHeaders, "x-envoy-attempt-count");
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        if self.steps.log_props {
            let _ = property(&["upstream", "address"]);
            let _ = property(&["response", "code"]);
            let _ = property(&["response", "flags"]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Steps;

    #[test]
    fn steps_parse_and_an_unknown_one_is_named() {
        assert_eq!(Steps::parse("").unwrap(), Steps::default());
        let s = Steps::parse("clock, pause-body,read-body").unwrap();
        assert!(s.clock && s.pause_body && s.read_body && !s.set_header);
        let e = Steps::parse("clock,sleep").unwrap_err();
        assert!(e.contains("\"sleep\""), "{e}");
    }
}
