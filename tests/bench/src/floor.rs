//! Decides the no-queue TTFT floor of each request: its time to first token alone on the
//! fastest pod of the pool, with its prefix cached as well as a prefix cache can hold it,
//! computed from the fake pod's own timing model (`ai-lb-fake-pod`: `model.rs` iteration time
//! `a + b·decodes + p·prefill_tokens`, the presets of `config.rs`, the chunked-prefill budget,
//! the front-end overhead and the time scale), so no policy can beat it.
//!
//! For an otherwise idle pod the engine prefills the uncached tokens in iterations of at most
//! `max_batched_tokens` tokens (each `a + p·chunk`, no decodes running) after the front-end
//! overhead, and produces the first token at the end of the last prefill iteration (vLLM
//! samples it from the prefill's logits; the fake engine's `complete` emits it there). So
//!
//! `floor = time_scale × (overhead + Σ_chunks (a + p·chunk))`, minimised over the pool's presets.
//!
//! No separate decode step is added: the engine does not run one before the first token, and
//! adding one would put the floor above what an idle pod delivers (a unit test drives the
//! engine itself to pin this).
//!
//! What is cached (vLLM's automatic prefix caching keeps full blocks only, and always
//! recomputes at least the last prompt token: `get_computed_blocks`, max hit = prompt − 1):
//! - shared-prefix: the group's system prompt with its role tokens, in full 16-token blocks,
//!   except for the group's very first request (in trace order), which finds nothing;
//! - multi-turn: from the second turn on, everything up to the previous turn's answer; the
//!   first turn as shared-prefix (its session group's system prompt, if any);
//! - other workloads: nothing (their prompts share no prefix).

use std::collections::{BTreeMap, BTreeSet};

use ai_lb_fake_pod::config::Preset;
use ai_lb_fake_pod::model::EngineParams;
use ai_lb_loadgen::stats::Record;
use clap::ValueEnum;
use serde::Serialize;

use crate::analysis::Pcts;

/// Tokens per KV block: the fake pod's default (`--block-size`, which the bench does not set).
pub const BLOCK_TOKENS: u32 = ai_lb_prefix::DEFAULT_BLOCK_TOKENS as u32;

/// The timing constants of one preset, as the floor uses them (seconds, scaled).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PresetModel {
    pub preset: String,
    pub a: f64,
    pub p: f64,
    pub overhead: f64,
    pub max_batched_tokens: u32,
    pub time_scale: f64,
}

impl PresetModel {
    fn of(name: &str, e: &EngineParams) -> Self {
        PresetModel {
            preset: name.to_string(),
            a: e.a,
            p: e.p,
            overhead: e.overhead,
            max_batched_tokens: e.max_batched_tokens,
            time_scale: e.time_scale,
        }
    }

    /// TTFT in seconds of a request with `uncached` prompt tokens (at least 1) on an idle pod.
    pub fn ttft_s(&self, uncached: u32) -> f64 {
        let budget = self.max_batched_tokens.max(1);
        let mut left = uncached.max(1);
        let mut t = self.overhead;
        while left > 0 {
            let chunk = left.min(budget);
            t += self.a + self.p * f64::from(chunk);
            left -= chunk;
        }
        t * self.time_scale
    }
}

/// The presets of a pool (names as `--preset` spells them), distinct, at `time_scale`.
pub fn pool_models(presets: &[&str], time_scale: f64) -> Result<Vec<PresetModel>, String> {
    let names: BTreeSet<&str> = presets.iter().copied().collect();
    names
        .into_iter()
        .map(|n| {
            let p = Preset::from_str(n, false)
                .map_err(|_| format!("pool preset {n:?} is not a fake-pod preset"))?;
            Ok(PresetModel::of(n, &p.spec().engine(time_scale)))
        })
        .collect()
}

/// Prompt tokens a prefix cache can serve: `shared` leading tokens cut to full blocks, never
/// the last prompt token.
pub fn cached_tokens(prompt: u32, shared: u32, block: u32) -> u32 {
    let block = block.max(1);
    let limit = shared.min(prompt.saturating_sub(1));
    limit / block * block
}

/// Prompt tokens of each record that the best cache holds (see the module doc), by id.
pub fn cached_by_id(records: &[&Record], block: u32) -> BTreeMap<u64, u32> {
    // Requests that find their group's prefix: shared-prefix requests and first turns that
    // share a system prompt, in trace order (scheduled send time, then id).
    let mut firsts: Vec<&Record> = records
        .iter()
        .copied()
        .filter(|r| r.turn.unwrap_or(1) == 1 && r.prefix_tokens.unwrap_or(0) > 0)
        .collect();
    firsts.sort_by_key(|r| (r.scheduled_us, r.id));
    let mut seen = BTreeSet::new();
    let mut first_of_group = BTreeSet::new();
    for r in firsts {
        if let Some(g) = r.group {
            if seen.insert(g) {
                first_of_group.insert(r.id);
            }
        }
    }
    records
        .iter()
        .map(|r| {
            let shared = match r.prefix_tokens {
                Some(_) if first_of_group.contains(&r.id) => 0,
                Some(n) => n,
                None => 0,
            };
            (r.id, cached_tokens(r.prompt_tokens, shared, block))
        })
        .collect()
}

/// Floor TTFT of one request in ms: the fastest preset's idle TTFT of its uncached tokens.
pub fn floor_ms(models: &[PresetModel], prompt: u32, cached: u32) -> Option<f64> {
    let uncached = prompt.saturating_sub(cached).max(1);
    models
        .iter()
        .map(|m| m.ttft_s(uncached) * 1000.0)
        .min_by(f64::total_cmp)
}

/// Floor of every request that was sent (any outcome but skipped / not sent), by id. The
/// cache state is decided over all `records` (the trace's order defines each group's first).
pub fn floors(records: &[&Record], models: &[PresetModel], block: u32) -> BTreeMap<u64, f64> {
    let cached = cached_by_id(records, block);
    records
        .iter()
        .filter(|r| r.was_sent())
        .filter_map(|r| {
            let c = cached.get(&r.id).copied().unwrap_or(0);
            floor_ms(models, r.prompt_tokens, c).map(|f| (r.id, f))
        })
        .collect()
}

/// The floor's distribution over `ids` (those present in `floors`).
pub fn distribution<'a>(floors: &BTreeMap<u64, f64>, ids: impl Iterator<Item = &'a u64>) -> Pcts {
    Pcts::of(ids.filter_map(|id| floors.get(id).copied()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ai_lb_fake_pod::model::{Engine, NewRequest, TokenEvent};
    use ai_lb_loadgen::stats::Outcome;
    use ai_lb_loadgen::workload::Tag;

    fn rec(
        id: u64,
        at: u64,
        prompt: u32,
        group: Option<u32>,
        turn: Option<u32>,
        shared: Option<u32>,
    ) -> Record {
        Record {
            outcome: Outcome::Ok,
            group,
            turn,
            prefix_tokens: shared,
            ..Record::new(id, Tag::Short, prompt, 10, at)
        }
    }

    /// The engine's own TTFT for a request of `prompt` tokens on an idle pod.
    fn engine_ttft(params: EngineParams, prompt: u32) -> f64 {
        let mut e = Engine::new(params);
        e.submit(
            NewRequest {
                id: 1,
                prompt_tokens: prompt,
                max_tokens: 2,
                token_ids: Vec::new(),
            },
            0.0,
        )
        .unwrap();
        let mut out: Vec<TokenEvent> = Vec::new();
        while out.is_empty() {
            let Some(t) = e.next_wake() else { break };
            e.advance_to(t, &mut out);
        }
        out.first().map(|ev| ev.since_arrival).unwrap()
    }

    #[test]
    fn floor_is_what_the_fake_engine_does_on_an_idle_pod() {
        for (preset, name) in [(Preset::H100_8b, "h100-8b"), (Preset::A100_8b, "a100-8b")] {
            for ts in [1.0, 0.25] {
                let params = preset.spec().engine(ts);
                let m = PresetModel::of(name, &params);
                for prompt in [1, 16, 1083, 8192, 8193, 20_000] {
                    let want = engine_ttft(params.clone(), prompt);
                    let got = m.ttft_s(prompt);
                    assert!(
                        (want - got).abs() < 1e-12,
                        "{name} ts {ts} {prompt}: {want} vs {got}"
                    );
                }
            }
        }
    }

    #[test]
    fn formula_by_hand_and_the_fastest_preset_wins() {
        let m = pool_models(&["a100-8b", "h100-8b", "a100-8b"], 1.0).unwrap();
        assert_eq!(m.len(), 2);
        let h = m.iter().find(|x| x.preset == "h100-8b").unwrap();
        // 4 ms front end + one iteration of a + 1000 p.
        let want = 0.004 + 0.004_570 + 1000.0 * 0.000_011;
        assert!((h.ttft_s(1000) - want).abs() < 1e-12);
        // 9000 tokens: two chunks (8192 + 808), two fixed costs.
        let two = 0.004 + 2.0 * 0.004_570 + 9000.0 * 0.000_011;
        assert!((h.ttft_s(9000) - two).abs() < 1e-12);
        assert_eq!(floor_ms(&m, 1000, 0), Some(want * 1000.0));
        assert!(pool_models(&["tpu"], 1.0).unwrap_err().contains("tpu"));
        let half = pool_models(&["h100-8b"], 0.5).unwrap();
        assert!((half[0].ttft_s(1000) - want / 2.0).abs() < 1e-12);
    }

    #[test]
    fn cache_holds_full_blocks_and_never_the_last_token() {
        assert_eq!(cached_tokens(1083, 902, 16), 896);
        assert_eq!(
            cached_tokens(100, 100, 16),
            96,
            "prompt - 1 = 99 -> 6 blocks"
        );
        assert_eq!(cached_tokens(97, 200, 16), 96);
        assert_eq!(
            cached_tokens(96, 200, 16),
            80,
            "the last token is always computed"
        );
        assert_eq!(cached_tokens(10, 15, 16), 0);
        assert_eq!(cached_tokens(0, 5, 16), 0);
    }

    #[test]
    fn first_request_of_a_group_finds_nothing_later_ones_the_system_prompt() {
        let rs = [
            rec(0, 100, 1083, Some(1), None, Some(902)),
            rec(1, 50, 1000, Some(2), None, Some(902)),
            rec(2, 200, 1083, Some(1), None, Some(902)),
            rec(3, 300, 2000, None, None, None),
        ];
        let refs: Vec<&Record> = rs.iter().collect();
        let c = cached_by_id(&refs, 16);
        assert_eq!((c[&0], c[&1], c[&2], c[&3]), (0, 0, 896, 0));
    }

    #[test]
    fn later_turns_find_the_previous_turn_and_first_turns_their_group() {
        let rs = [
            // Session A (group 0, system prompt of 300 tokens): turn 1 first in its group.
            rec(0, 10, 400, Some(0), Some(1), Some(302)),
            rec(1, 900, 700, Some(0), Some(2), Some(500)),
            // Session B, same group, later: its first turn finds the system prompt.
            rec(2, 20, 410, Some(0), Some(1), Some(302)),
            // Session C without a system prompt: nothing on turn 1.
            rec(3, 30, 120, Some(1), Some(1), Some(0)),
            rec(4, 800, 300, Some(1), Some(2), Some(220)),
        ];
        let refs: Vec<&Record> = rs.iter().collect();
        let c = cached_by_id(&refs, 16);
        assert_eq!((c[&0], c[&1], c[&2], c[&3], c[&4]), (0, 496, 288, 0, 208));
        let m = pool_models(&["h100-8b"], 1.0).unwrap();
        let f = floors(&refs, &m, 16);
        assert_eq!(f.len(), 5);
        assert!((f[&1] - m[0].ttft_s(700 - 496) * 1000.0).abs() < 1e-9);
        let d = distribution(&f, [0u64, 1, 99].iter());
        assert_eq!(d.count, 2);
    }

    #[test]
    fn unsent_requests_have_no_floor_but_still_count_as_a_groups_first() {
        let mut first = rec(0, 1, 1083, Some(1), None, Some(902));
        first.outcome = Outcome::SkippedInFlightCap;
        let rs = [first, rec(1, 2, 1083, Some(1), None, Some(902))];
        let refs: Vec<&Record> = rs.iter().collect();
        let m = pool_models(&["h100-8b"], 1.0).unwrap();
        let f = floors(&refs, &m, 16);
        assert_eq!(f.keys().copied().collect::<Vec<_>>(), vec![1]);
        assert!((f[&1] - m[0].ttft_s(1083 - 896) * 1000.0).abs() < 1e-9);
    }
}
