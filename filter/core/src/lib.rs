//! The filter's decisions, free of proxy-wasm: configuration, signal snapshots, scoring,
//! breakers, picking and admission. Time (`now_ms`, monotonic host milliseconds) and
//! randomness (`&mut impl rand::RngCore`) are passed in, so every decision is a pure function
//! of its inputs and tested natively. Nothing here panics on external input.
//!
//! # How the glue uses it (route mode)
//! 1. `on_configure`: [`config::FilterConfig::from_json`] (errors name field and value), then
//!    [`picker::Router::new`].
//! 2. Subscriber VM (one per process): open `WatchPool` on `pools[i].agentCluster`; for each
//!    message [`picker::Router::apply_pool_event`] (or [`pool::PoolState::apply_event`]), then
//!    publish [`pool::PoolState::encode`] in shared data.
//! 3. Worker VMs: every `watch.refreshMs`, [`picker::Router::set_pool_state_bytes`] (skips an
//!    unchanged version).
//! 4. Per request: pool from the cluster ([`config::FilterConfig::pool_by_cluster`]), model from
//!    `modelHeader`, then [`picker::Router::decide_for`] with the request's
//!    [`picker::Router::request_size`]:
//!    - `Decision::Steer { ranked, .. }` / `Decision::FailOpen { ranked }`:
//!      [`picker::Router::write_ranked`] into a reused `String`, set `routingHeader` to it, and
//!      call [`picker::Router::on_request_start`] with the first address
//!      ([`picker::Router::address`]), that size and the time.
//!    - `Decision::Fallback(reason)`: set nothing; Envoy's fallback policy balances.
//! 5. At stream end, for every request started in step 4, however it ended:
//!    [`picker::Router::on_request_end`] with the same size and start time; then [`picker::Router::on_outcome`] with an
//!    [`breaker::Outcome`]; count the returned [`breaker::BreakerEvent`]s. Time-driven
//!    transitions: [`picker::Router::tick`] or [`picker::Router::take_breaker_events`].
//!    Breakers can be shared between VMs with [`breaker::Breaker::encode`]/`decode` and
//!    [`picker::Router::breaker`]/[`picker::Router::set_breaker`].
//! 6. Stats: [`counters::Counters::iter`]; status page / debug header:
//!    [`status::scoreboard_json`].
#![deny(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

pub mod adaptive;
pub mod admission;
pub mod body;
pub mod breaker;
pub mod config;
pub mod counters;
pub mod error;
pub mod feed;
pub mod learned;
pub mod lifecycle;
pub mod outcome;
pub mod picker;
pub mod pool;
pub mod pre_oom;
pub mod prefix;
pub mod probe;
pub mod recovery;
pub mod score;
pub mod signals;
pub mod status;
pub mod triggers;
pub mod versions;

pub use breaker::{Breaker, BreakerEvent, BreakerState, Outcome, TripReason};
pub use config::{FilterConfig, Mode};
pub use counters::Counters;
pub use error::ConfigError;
pub use picker::{Decision, FallbackReason, PodId, Ranked, RequestSize, Router};
pub use pool::PoolState;
pub use score::{score, CutReason, Score};
pub use signals::{GpuReading, GpuSignal, PodSignals, SignalIssue};
