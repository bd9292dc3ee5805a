//! proxy-wasm glue: translates Envoy host calls into `ai-lb-filter-core` calls. No decisions
//! live here beyond which VM subscribes ([`lease`]); the request's life is the core's
//! `lifecycle`, driven from [`http`], and when to reconnect is the core's `feed`.
#![deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod admission;
pub mod breakers;
pub mod grpc_service;
pub mod guard;
pub mod host;
pub mod http;
pub mod lease;
pub mod metrics;
pub mod root;
pub mod shared;
pub mod state;

use proxy_wasm::types::LogLevel;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    // After the SDK's own hook (installed by set_log_level): a trap says where it came from.
    std::panic::set_hook(Box::new(|info| {
        host::log(LogLevel::Critical, &format!("ai-lb filter panicked: {info}"));
    }));
    proxy_wasm::set_root_context(|_| Box::new(root::Root::new()));
}}
