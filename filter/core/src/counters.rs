//! Decides nothing: the counters the glue exports as Envoy stats (fallbacks by reason,
//! fail-opens, signal issues, breaker transitions, pool events).

use crate::breaker::BreakerState;

/// Monotonic counters; the glue reads them and adds the deltas to its Envoy metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counters {
    /// Requests steered to a chosen pod.
    pub steered: u64,
    /// Fallback: no agent data for the pool yet (or no pod with an address).
    pub fallback_no_agent_data: u64,
    /// Fallback: no pod serves the requested model.
    pub fallback_no_model: u64,
    /// Fallback: every candidate's metrics are stale.
    pub fallback_all_stale: u64,
    /// Fallback: fewer than `minPods` candidates with fresh metrics.
    pub fallback_too_few_pods: u64,
    /// Every candidate scored 0: picked evenly among them.
    pub fail_open: u64,
    /// Decided, but the ranked list did not reach Envoy (the pool changed during the
    /// decision, or the proxy refused the header): Envoy's own balancing took the request.
    pub steer_failed: u64,
    /// Request bodies over `maxBodyReadBytes`: routed on the fields complete in their first
    /// `maxBodyReadBytes` (no prefix keying), the rest streamed untouched.
    pub body_truncated: u64,
    /// Steered to a pod over the GPU hard limit because both drawn candidates would queue
    /// and it had a free seat (`twoChoices`).
    pub overflow_over_gpu_limit: u64,
    /// Long answers (`longOutputTokens`) that would have finished sooner on a candidate whose
    /// long answers already held their share of its seats (`longOutputSeatShare`): compared
    /// there as any request.
    pub long_output_share_full: u64,
    /// Readings dropped or clamped on entry (see [`crate::signals::SignalIssue`]).
    pub signal_issues: u64,
    /// Snapshots ignored entirely (no valid serving address).
    pub snapshots_rejected: u64,
    /// Pool events applied.
    pub pool_events: u64,
    /// Shared pool state that failed to decode.
    pub pool_decode_errors: u64,
    /// Hardware faults detected (Xid/ECC increase).
    pub hardware_faults: u64,
    /// Pods whose model server stopped answering its agent (counted once per outage, on the
    /// snapshot that first shows it).
    pub model_server_down: u64,
    /// Pods newly judged slow by their recent inter-token latency (`cutoffs.slowItlRatio`
    /// times the pool's median), once per episode.
    pub slow_decode: u64,
    /// Snapshots whose agent error rate was at `breaker.agentErrorRate` but not acted on,
    /// because more than half of the pool's pods were too.
    pub agent_errors_pool_wide: u64,
    /// Requests whose prompt was keyed for prefix affinity (`prefixAffinity`).
    pub prefix_keyed: u64,
    /// Keyed requests steered to a pod holding at least `minMatchBlocks` of their prompt.
    pub prefix_hit: u64,
    /// Keyed requests some pod held, steered elsewhere because the holder would make them
    /// wait longer (a hot prefix spilling to another pod).
    pub prefix_spill: u64,
    /// Keyed requests no pod held, steered to their rendezvous pod.
    pub prefix_rendezvous: u64,
    /// Key blocks of the keyed requests, and of those the chosen pod held (their ratio is the
    /// share of prompt blocks this sidecar expects to hit).
    pub prefix_blocks: u64,
    pub prefix_blocks_held: u64,
    /// Requests that failed on a pod while its traffic ramped back after its breaker closed
    /// (`breaker.recoveryRamp`): each re-opens the breaker.
    pub breaker_ramp_failures: u64,
    /// `breaker.syntheticProbe`: probes handed to the proxy, probes that passed and that failed
    /// (each as its answer arrived), and probes the proxy refused to send.
    pub probe_sent: u64,
    pub probe_passed: u64,
    pub probe_failed: u64,
    pub probe_not_sent: u64,
    /// `breaker.adaptiveThresholds`: judgements where a pod's adapted threshold counted a
    /// failure or opened its breaker where its static one would not have (stricter), or spared
    /// it where the static one would have (laxer): a response's TTFT against the SLO, a
    /// worker's failure-rate window after an outcome, an agent's error rate in a new snapshot.
    pub breaker_thresholds_stricter: u64,
    pub breaker_thresholds_laxer: u64,
    /// New snapshots of a pod whose thresholds stayed static for want of a background (fewer
    /// than `minPods` other pods with fresh readings).
    pub breaker_thresholds_static: u64,
    /// `errorEvidence`: breakers the evidence test opened (reason `agent_error_rate`) while the
    /// windowed rate was still under the pod's threshold.
    pub breaker_thresholds_evidence: u64,
    /// `versions`: requests without a version header routed over the whole pool because no
    /// weighted version had an available pod whose domain admits.
    pub versions_unsplit: u64,
    /// `versions`: pinned requests answered 503 for a version no pod reports nor the config
    /// names (kept out of the per-version stats, which only known versions get).
    pub versions_rejected_unknown: u64,
    /// `learnedWeights`: outcomes queued as training samples; samples dropped from a full
    /// ring before an update; updates that trained on at least one sample; updates after which
    /// the model fell back to the static score, by reason (a weight or the loss not finite,
    /// an output under 0.001 for every pod, a loss diverging 3 updates in a row).
    pub learned_samples: u64,
    pub learned_samples_dropped: u64,
    pub learned_updates: u64,
    pub learned_fallback_not_finite: u64,
    pub learned_fallback_all_zero: u64,
    pub learned_fallback_diverging: u64,
    /// `preOom`: pods whose agent started reporting a pre-OOM state (their share lowered), and
    /// pods cut for it (`cutBeforeMs` before the projected OOM); once per episode each.
    pub pre_oom_degraded: u64,
    pub pre_oom_cut: u64,
    /// `breaker.truncation` ([`crate::triggers`]): chosen pods' answers judged truncated,
    /// answered a GPU out-of-memory error, truncated but not counted (the pod's memory-error
    /// rate at or below `memoryErrorRate`), and answers too large to judge (the breaker then
    /// behaves as without the option).
    pub answers_truncated: u64,
    pub answers_memory_errors: u64,
    pub answers_truncated_ignored: u64,
    pub answers_unjudged: u64,
    /// Breaker transitions by target state.
    pub breaker_opened: u64,
    pub breaker_half_opened: u64,
    pub breaker_closed: u64,
}

impl Counters {
    /// Counts an update of `learnedWeights` that fell back to the static score.
    pub fn count_learned_fallback(&mut self, why: crate::learned::Fallback) {
        use crate::learned::Fallback;
        match why {
            Fallback::NotFinite => self.learned_fallback_not_finite += 1,
            Fallback::AllZero => self.learned_fallback_all_zero += 1,
            Fallback::Diverging => self.learned_fallback_diverging += 1,
        }
    }

    /// How many counters [`Counters::iter`] lists.
    pub const COUNT: usize = 50;

    /// Counts one breaker transition into `to`.
    pub fn count_transition(&mut self, to: BreakerState) {
        match to {
            BreakerState::Open => self.breaker_opened += 1,
            BreakerState::HalfOpen => self.breaker_half_opened += 1,
            BreakerState::Closed => self.breaker_closed += 1,
        }
    }

    /// Whether the glues export counter `name` as `ailb.<name>`: every counter but the
    /// worker-local breaker transitions (`breaker.*`), which both glues count from the breakers
    /// every worker shares instead (`ailb.breaker_opened.<reason>`, `ailb.breaker_half_opened`,
    /// `ailb.breaker_closed`); exporting both would give two families of one stat that disagree.
    pub fn exported(name: &str) -> bool {
        !name.starts_with("breaker.")
    }

    /// `(stat name, value)` pairs, stable names for Envoy counters.
    pub fn iter(&self) -> [(&'static str, u64); Self::COUNT] {
        [
            ("steered", self.steered),
            ("fallback.no_agent_data", self.fallback_no_agent_data),
            ("fallback.no_model", self.fallback_no_model),
            ("fallback.all_stale", self.fallback_all_stale),
            ("fallback.too_few_pods", self.fallback_too_few_pods),
            ("fail_open", self.fail_open),
            ("steer_failed", self.steer_failed),
            ("body_truncated", self.body_truncated),
            ("overflow_over_gpu_limit", self.overflow_over_gpu_limit),
            ("long_output_share_full", self.long_output_share_full),
            ("signal_issues", self.signal_issues),
            ("snapshots_rejected", self.snapshots_rejected),
            ("pool_events", self.pool_events),
            ("pool_decode_errors", self.pool_decode_errors),
            ("hardware_faults", self.hardware_faults),
            ("model_server_down", self.model_server_down),
            ("slow_decode", self.slow_decode),
            ("agent_errors_pool_wide", self.agent_errors_pool_wide),
            ("prefix.keyed", self.prefix_keyed),
            ("prefix.hit", self.prefix_hit),
            ("prefix.spill", self.prefix_spill),
            ("prefix.rendezvous", self.prefix_rendezvous),
            ("prefix.blocks", self.prefix_blocks),
            ("prefix.blocks_held", self.prefix_blocks_held),
            ("breaker_ramp_failures", self.breaker_ramp_failures),
            ("probe.sent", self.probe_sent),
            ("probe.passed", self.probe_passed),
            ("probe.failed", self.probe_failed),
            ("probe.not_sent", self.probe_not_sent),
            (
                "breaker_thresholds.stricter",
                self.breaker_thresholds_stricter,
            ),
            ("breaker_thresholds.laxer", self.breaker_thresholds_laxer),
            ("breaker_thresholds.static", self.breaker_thresholds_static),
            (
                "breaker_thresholds.evidence",
                self.breaker_thresholds_evidence,
            ),
            ("versions.unsplit", self.versions_unsplit),
            ("versions.rejected_unknown", self.versions_rejected_unknown),
            ("learned.samples", self.learned_samples),
            ("learned.samples_dropped", self.learned_samples_dropped),
            ("learned.updates", self.learned_updates),
            (
                "learned.fallback.not_finite",
                self.learned_fallback_not_finite,
            ),
            ("learned.fallback.all_zero", self.learned_fallback_all_zero),
            (
                "learned.fallback.diverging",
                self.learned_fallback_diverging,
            ),
            ("pre_oom.degraded", self.pre_oom_degraded),
            ("pre_oom.cut", self.pre_oom_cut),
            ("answers.truncated", self.answers_truncated),
            ("answers.memory_errors", self.answers_memory_errors),
            ("answers.truncated_ignored", self.answers_truncated_ignored),
            ("answers.unjudged", self.answers_unjudged),
            ("breaker.opened", self.breaker_opened),
            ("breaker.half_opened", self.breaker_half_opened),
            ("breaker.closed", self.breaker_closed),
        ]
    }
}
