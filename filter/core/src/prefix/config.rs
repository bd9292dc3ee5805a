//! Decides what `prefixAffinity` may be: the raw JSON block, its defaults and ranges, and the
//! validated [`PrefixAffinity`] the router uses (errors name `prefixAffinity.<field>` and the
//! value, as every other block of the plugin config).

use serde::Deserialize;

use crate::error::ConfigError;

/// Prefix-cache affinity (`prefixAffinity`): requests go to pods that hold their prompt's
/// prefix in their KV cache, as the pods' agents report it, within the same tier of wait (see
/// [`crate::prefix`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefixAffinity {
    /// Most prompt tokens keyed per request (the CPU the filter spends per request is linear
    /// in it): a prompt's first `max_prompt_tokens` tokens are tokenised and hashed.
    pub max_prompt_tokens: u32,
    /// Fewest leading key blocks a pod must hold to count as holding the prefix.
    pub min_match_blocks: u32,
    /// Where both candidates would queue, how many service rounds of wait a pod holding the
    /// whole prompt may have over one holding none and still win (scaled by the share of the
    /// prompt it holds).
    pub queue_slack_rounds: f64,
    /// A prompt at least this long has a rendezvous pod among the pods not holding it (the same
    /// for every sidecar): a new prefix goes there, a queued holder's spills go there.
    pub rendezvous_min_tokens: u32,
    /// How long this sidecar counts its own recent sends of a prefix to a pod as cached there
    /// (until the pod's agent reports it), ms.
    pub own_ttl_ms: u64,
}

impl Default for PrefixAffinity {
    fn default() -> Self {
        Self {
            max_prompt_tokens: 8192,
            min_match_blocks: 1,
            queue_slack_rounds: 1.0,
            rendezvous_min_tokens: 1024,
            own_ttl_ms: 2000,
        }
    }
}

/// `prefixAffinity`.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "PrefixAffinity")
)]
pub(crate) struct RawPrefixAffinity {
    /// Most prompt tokens keyed per request: the first this many tokens of the chat prompt (or completion prompt) are tokenised and hashed into key blocks, the rest ignored. The filter's CPU per request grows linearly with it.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 8192, "minimum" = 16, "maximum" = 1_048_576))
    )]
    max_prompt_tokens: Option<u64>,
    /// Fewest leading key blocks (the agents' `--prefix-block-tokens`, 64 tokens by default) a pod must hold for the prompt to count as cached there.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 1, "minimum" = 1, "maximum" = 65_536))
    )]
    min_match_blocks: Option<u64>,
    /// Where both candidates would queue, a pod holding the whole prompt wins over one holding none unless its wait is longer by more than this many service rounds (scaled by the share of the prompt it holds). Two pods that both hold some of the prompt are compared this way even when one has a free seat: a conversation's pod with a short queue beats a pod holding only its system prompt. 0: affinity only breaks ties within a tier.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 1.0, "minimum" = 0, "maximum" = 100))
    )]
    queue_slack_rounds: Option<f64>,
    /// A prompt at least this many tokens long has a rendezvous pod: the highest hash of the key of its first 256 tokens and the pod's address among the pods that do not hold it, the same pod for every sidecar. Where a holder would queue the request, it spills there, so every sidecar spills it to the same second pod. Where no pod holds the prompt that pod is one more candidate compared by load, winning ties (an idle pool caches a new prefix in one place), never preferred over a less loaded pod (prompts that never recur stay balanced by load). 0: every prompt with a key block.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 1024, "minimum" = 0, "maximum" = 1_048_576))
    )]
    rendezvous_min_tokens: Option<u64>,
    /// How long (ms) this sidecar counts the prefixes it just sent to a pod as cached there, until the pod's agent reports what it really holds. 0: only the agents' reports count.
    #[serde(default)]
    #[cfg_attr(
        feature = "schema",
        schemars(extend("default" = 2000, "minimum" = 0, "maximum" = 60_000))
    )]
    own_ttl_ms: Option<u64>,
}

fn in_range(
    path: &str,
    v: Option<u64>,
    default: u64,
    min: u64,
    max: u64,
) -> Result<u64, ConfigError> {
    match v {
        None => Ok(default),
        Some(x) if (min..=max).contains(&x) => Ok(x),
        Some(x) => Err(ConfigError::new(
            path,
            x,
            format!("must be within {min}..={max}"),
        )),
    }
}

impl TryFrom<&RawPrefixAffinity> for PrefixAffinity {
    type Error = ConfigError;

    fn try_from(r: &RawPrefixAffinity) -> Result<Self, ConfigError> {
        let d = PrefixAffinity::default();
        let queue_slack_rounds = match r.queue_slack_rounds {
            None => d.queue_slack_rounds,
            Some(x) if x.is_finite() && (0.0..=100.0).contains(&x) => x,
            Some(x) => {
                return Err(ConfigError::new(
                    "prefixAffinity.queueSlackRounds",
                    x,
                    "must be within [0, 100] (service rounds)",
                ))
            }
        };
        let u32_of = |x: u64| u32::try_from(x).unwrap_or(u32::MAX);
        Ok(PrefixAffinity {
            max_prompt_tokens: u32_of(in_range(
                "prefixAffinity.maxPromptTokens",
                r.max_prompt_tokens,
                u64::from(d.max_prompt_tokens),
                16,
                1_048_576,
            )?),
            min_match_blocks: u32_of(in_range(
                "prefixAffinity.minMatchBlocks",
                r.min_match_blocks,
                u64::from(d.min_match_blocks),
                1,
                65_536,
            )?),
            queue_slack_rounds,
            rendezvous_min_tokens: u32_of(in_range(
                "prefixAffinity.rendezvousMinTokens",
                r.rendezvous_min_tokens,
                u64::from(d.rendezvous_min_tokens),
                0,
                1_048_576,
            )?),
            own_ttl_ms: in_range(
                "prefixAffinity.ownTtlMs",
                r.own_ttl_ms,
                d.own_ttl_ms,
                0,
                60_000,
            )?,
        })
    }
}
