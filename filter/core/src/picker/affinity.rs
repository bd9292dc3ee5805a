//! Prefix-cache affinity (`prefixAffinity`): the key space a pool's pods report their caches
//! in, a request's prompt keyed in it, and the pods that hold the prompt's prefix or meet it
//! (rendezvous) as extra `twoChoices` candidates (see [`crate::prefix`]).

use super::pod::PodRt;
use super::view::View;
use super::Router;
use crate::prefix::own::rendezvous;
use crate::prefix::{PrefixAffinity, PromptKeys};

/// Tokens of a prompt that name its prefix for the rendezvous order: the key of its key block
/// ending here (or its last, if shorter). Short enough that a system prompt's requests share
/// it whatever their questions, long enough that a common boilerplate opening does not send
/// every new prefix to one pod.
const RENDEZVOUS_KEY_TOKENS: usize = 256;

/// The prefix-affinity candidates of a request (`prefixAffinity`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Affinity {
    /// The pod holding the prompt's prefix that would start it soonest (ties: more held).
    pub(super) holder: Option<u32>,
    /// The rendezvous pod among the pods that do not hold it: where a new prompt goes, and
    /// where a held one spills, the same pod from every sidecar.
    pub(super) meet: Option<u32>,
}

/// How two holders of a prompt's prefix compare when neither waits for KV cache (tier 0 or 1 of
/// [`PodRt::pick_key`]), lower first: the wait in service rounds less `queueSlackRounds` times
/// the share of the prompt held (`held` of `blocks` key blocks). So a pod holding a whole
/// conversation with a short queue beats one holding only its system prompt with a free seat,
/// and loses to it once its queue is longer than the prefill it saves is worth. None when
/// either waits for KV cache (compared by tier then).
pub(super) fn holder_wait(
    k: (u8, f64, f64),
    held: usize,
    blocks: usize,
    slack: f64,
) -> Option<f64> {
    (k.0 <= 1).then(|| k.1 - slack * held as f64 / blocks.max(1) as f64)
}

/// Among the pods with a draw weight (never a cut pod or one its breaker refuses): the holder
/// of at least `minMatchBlocks` of the prompt's leading key blocks that would start it soonest,
/// its wait less the slack the share it holds earns ([`holder_wait`]; then the one holding
/// more, then `key`, then the rendezvous order); and, when the prompt is at least
/// `rendezvousMinTokens` long, the rendezvous pod of the others, by the key of the prompt's
/// first [`RENDEZVOUS_KEY_TOKENS`] tokens.
pub(super) fn affinity_candidate(
    pods: &[PodRt],
    view: &View,
    q: &PromptKeys,
    cfg: &PrefixAffinity,
    held: &impl Fn(u32) -> usize,
    key: &impl Fn(u32) -> (u8, f64, f64),
) -> Affinity {
    let bt = q.block_tokens.max(1) as usize;
    let rk_idx = (RENDEZVOUS_KEY_TOKENS / bt)
        .max(1)
        .min(q.keys.len())
        .saturating_sub(1);
    let rkey = q.keys.get(rk_idx).copied().unwrap_or(0);
    let hrw = |id: u32| {
        pods.get(id as usize)
            .map_or(0, |r| rendezvous(rkey, r.hash))
    };
    let min = cfg.min_match_blocks as usize;
    let mut holder: Option<(u32, (u8, f64, f64), usize)> = None;
    let mut meet: Option<u32> = None;
    for (slot, &id) in view.slots.iter().enumerate() {
        if view.w.get(slot).copied().unwrap_or(0.0) <= 0.0 {
            continue;
        }
        let h = held(id);
        if h < min {
            if meet.is_none_or(|m| hrw(id) > hrw(m)) {
                meet = Some(id);
            }
            continue;
        }
        let k = key(id);
        let (slack, n) = (cfg.queue_slack_rounds, q.keys.len());
        let wins = holder.is_none_or(|(b, kb, hb)| {
            match (holder_wait(k, h, n, slack), holder_wait(kb, hb, n, slack)) {
                (Some(w), Some(wb)) if w != wb => return w < wb,
                (Some(_), None) => return true,
                (None, Some(_)) => return false,
                _ => {}
            }
            k.0 < kb.0
                || (k.0 == kb.0
                    && (h > hb || (h == hb && (k < kb || (k == kb && hrw(id) > hrw(b))))))
        });
        if wins {
            holder = Some((id, k, h));
        }
    }
    Affinity {
        holder: holder.map(|(id, _, _)| id),
        meet: meet.filter(|_| !q.keys.is_empty() && q.tokens >= cfg.rendezvous_min_tokens),
    }
}

impl Router {
    /// The key space in which pool `pool_idx`'s pods report their prefix caches, as (tokens per
    /// key block, model seed): the first pod's that reports one. None when prefix affinity is
    /// off or no pod reports its cache: the request's prompt need not be keyed.
    pub fn prefix_space(&self, pool_idx: usize) -> Option<(u32, u64)> {
        self.cfg.prefix_affinity?;
        self.pools
            .get(pool_idx)?
            .state
            .peers()
            .iter()
            .filter_map(|e| e.signals.as_ref()?.prefix.as_ref())
            .map(|s| (s.block_tokens, s.model_seed))
            .next()
    }

    /// The prompt of a request `body` keyed for pool `pool_idx`'s prefix affinity
    /// ([`Router::decide_with`]); None when affinity is off, no pod of the pool reports its
    /// cache, or the body has no prompt. At most `prefixAffinity.maxPromptTokens` tokens are
    /// keyed; `ids` and `scratch` are reused buffers.
    pub fn key_prompt(
        &self,
        pool_idx: usize,
        body: &[u8],
        ids: &mut Vec<u32>,
        scratch: &mut Vec<u64>,
    ) -> Option<PromptKeys> {
        let cap = self.cfg.prefix_affinity?.max_prompt_tokens as usize;
        let (block_tokens, seed) = self.prefix_space(pool_idx)?;
        let (_, found) = crate::prefix::keys::prompt_ids(body, cap, ids);
        if !found {
            return None;
        }
        let mut out = PromptKeys::default();
        crate::prefix::keys::keys_of(ids, seed, block_tokens, scratch, &mut out);
        Some(out)
    }
}
