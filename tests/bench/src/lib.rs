//! Benchmark suite for ai-lb: starts a heterogeneous fake-GPU pool with agents and per-policy
//! client sidecars (`topology`), replays the same seeded traces through round_robin,
//! least_request and ai-lb (`scenario`), measures capacity (`calibrate`), the filter's per-request overhead (`overhead`, and the three figures of `overhead_figures`) and how
//! fresh its view is (`freshness`),
//! and turns per-request records into percentiles, shares and ratios (`analysis`), next to
//! each request's no-queue TTFT floor from the fake pod's timing model (`floor`).

pub mod analysis;
pub mod attempts;
pub mod calibrate;
pub mod floor;
pub mod freshness;
pub mod overhead;
pub mod overhead_figures;
pub mod repeats;
pub mod scenario;
pub mod soak;
pub mod topology;
