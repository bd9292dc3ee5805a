//! Decides nothing at run time: drives the pure engine model with a closed-loop benchmark
//! client (like `vllm bench serve --max-concurrency N` with fixed input/output lengths: N
//! clients start together, each sends its next request as soon as the previous one ends) and
//! reports mean TTFT and inter-token latency in simulated seconds. Used to check the presets
//! against the published figures they were fitted to (README.md, "The fit").

use crate::model::{Engine, EngineParams, NewRequest};

/// Mean latencies of one closed-loop run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoopResult {
    pub requests: u64,
    /// Mean time to first token, seconds.
    pub ttft: f64,
    /// Mean gap between consecutive tokens of a request, seconds.
    pub itl: f64,
    /// Simulated duration of the run, seconds.
    pub duration: f64,
}

/// Runs `clients` closed-loop clients for `rounds` requests each, every request with
/// `input_tokens` prompt tokens and `output_tokens` generated tokens.
pub fn closed_loop(
    params: EngineParams,
    clients: u32,
    rounds: u32,
    input_tokens: u32,
    output_tokens: u32,
) -> LoopResult {
    let mut engine = Engine::new(params);
    let mut remaining = vec![rounds; clients as usize];
    // request id -> client; ids are dense, so a Vec indexed by id.
    let mut owner: Vec<usize> = Vec::new();
    let mut submit = |engine: &mut Engine, owner: &mut Vec<usize>, client: usize, now: f64| {
        if remaining[client] == 0 {
            return;
        }
        remaining[client] -= 1;
        let id = owner.len() as u64;
        owner.push(client);
        // Lengths are valid by construction (callers pass small positive sizes).
        let _ = engine.submit(
            NewRequest {
                id,
                prompt_tokens: input_tokens,
                max_tokens: output_tokens.max(1),
                token_ids: Vec::new(),
            },
            now,
        );
    };
    for c in 0..clients as usize {
        submit(&mut engine, &mut owner, c, 0.0);
    }
    let (mut n, mut ttft_sum, mut gap_sum, mut gaps, mut end) = (0u64, 0.0, 0.0, 0u64, 0.0);
    let mut out = Vec::new();
    while let Some(t) = engine.next_wake() {
        out.clear();
        engine.advance_to(t, &mut out);
        for ev in &out {
            if ev.index == 0 {
                ttft_sum += ev.since_arrival;
                n += 1;
            } else {
                gap_sum += ev.since_prev;
                gaps += 1;
            }
            if ev.last {
                end = ev.at;
                if let Some(&c) = owner.get(ev.id as usize) {
                    submit(&mut engine, &mut owner, c, ev.at);
                }
            }
        }
        engine.advance_to(t, &mut out);
    }
    LoopResult {
        requests: n,
        ttft: if n > 0 { ttft_sum / n as f64 } else { 0.0 },
        itl: if gaps > 0 { gap_sum / gaps as f64 } else { 0.0 },
        duration: end,
    }
}
