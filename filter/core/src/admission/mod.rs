//! Admission control: decides whether a request may use the GPU now, in weighted tokens per
//! second per tenant (token buckets in shared data, [`bucket`]), which request classes wait or
//! are shed under saturation ([`priority`]), and whether the inference pod's own sidecar turns
//! a request away before its GPU drowns ([`guard`]). Costs come from the request body
//! ([`cost`]) and are reconciled with the response's `usage` ([`usage`]). Pure: time (`now_ms`)
//! is passed in and shared data is reached through the [`bucket::SharedStore`] trait.
#![deny(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

pub mod bucket;
pub mod config;
pub mod cost;
pub mod guard;
pub mod priority;
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
