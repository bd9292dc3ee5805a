//! Admission control: decides whether a request may use the GPU now, in weighted tokens per
//! second per tenant (token buckets in shared data, [`bucket`]), which request classes wait or
//! are shed under saturation ([`priority`]), and whether the inference pod's own sidecar turns
//! a request away before its GPU drowns ([`guard`]). Costs come from the request body
//! ([`cost`]) and are reconciled with the response's `usage` ([`usage`]). Pure: time (`now_ms`)
//! is passed in and shared data is reached through the [`bucket::SharedStore`] trait.
//!
//! # How the glue uses it
//! 1. `on_configure`: [`AdmissionConfig::from_value`] on the plugin JSON's `admission` object.
//! 2. Request headers: tenant from [`tenant::resolve`]; class from [`priority::classify`];
//!    [`cost::plan_body`] says whether to buffer the body or cost it by length
//!    ([`cost::cost_from_length`]).
//! 3. Request body (buffered): [`cost::cost_from_body`]. `Err(MalformedBody)` -> 400 with
//!    `MalformedBody::error_body()`.
//! 4. [`bucket::try_admit`] against the host's shared data (implement [`bucket::SharedStore`]
//!    over `get_shared_data` / `set_shared_data`): `Rejected` -> 429 with
//!    `RateLimited::headers()` and `error_body()`; `Contended` -> admit uncharged (counted).
//!    Keep the `Grant` in the http context.
//! 5. Saturation (the picker's view, e.g. [`priority::is_saturated`]) -> [`priority::decide`]:
//!    `Shed` -> 429, `Reject` -> 503, `Hold` -> pause the request in the worker's
//!    [`priority::HeldQueue`]; on each tick [`priority::HeldQueue::expire`] (503 them) and
//!    [`priority::HeldQueue::release`] as capacity frees (resume them). A request shed or
//!    rejected after step 4 reconciles its grant with actual 0.
//! 6. Response body chunks: [`usage::UsageScanner::feed`] (SSE or JSON). At the end,
//!    `usage()` -> `Usage::weighted(&cfg.cost.weights)` -> [`bucket::reconcile`]; no usage ->
//!    the reservation is kept ([`stats::Stats::record_kept_reservation`]).
//! 7. Inbound guard (pod sidecar): [`guard::decide`] with the local pod's signals; `Reject` ->
//!    503 with `GuardDecision::headers()` (`x-ai-lb-guard: rejected`, `retry-after`).
//! 8. Everything counted in [`stats::Stats`] for the glue to publish.
//!
//! Two optional parts (issue 30 part 5): [`derived`] gives a request that names no class a
//! tier from its parsed body (Ultra / High are bounded holds in the held queue's first lanes,
//! routed at their deadline), and [`quota`] scales the settled cost by the chosen pod's
//! predicted latency against an SLO.
#![deny(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

pub mod bucket;
pub mod config;
pub mod cost;
pub mod derived;
pub mod guard;
pub mod priority;
pub mod quota;
pub mod response;
pub mod stats;
pub mod tenant;
pub mod usage;

pub use bucket::{reconcile, try_admit, Admission, MemoryStore, SharedStore};
pub use config::AdmissionConfig;
pub use cost::{estimate_text_tokens, RequestCost};
pub use guard::{GuardDecision, LocalSignals};
pub use priority::{HeldQueue, PriorityClass, PriorityDecision};
pub use stats::Stats;
pub use usage::{Usage, UsageScanner};
