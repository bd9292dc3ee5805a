//! Decides which pod serves a request: llm-d's default scheduling profile at ebab68792
//! (`pkg/epp/config/loader/defaults.go`, the same profile the Helm charts ship in
//! `config/charts/routerlib/templates/_config.yaml`): no filters; the queue scorer
//! (`scorer/queuedepth/queue.go`: (max − own) / (max − min) of `vllm:num_requests_waiting`
//! over the candidates, 1 for every pod when they are all equal) weight 2, the KV-cache
//! utilisation scorer (`scorer/kvcacheutilization/kvcache_utilization.go`: 1 −
//! `vllm:kv_cache_usage_perc`) weight 2, the prefix-cache scorer (`scorer/prefix/plugin.go`:
//! matched blocks / request blocks, 0 when the request has no blocks) weight 3; each score
//! clamped to [0, 1] and the weighted scores summed in that order
//! (`pkg/epp/scheduling/scheduler_profile.go`); the max-score picker
//! (`picker/maxscore/picker.go`: shuffle the candidates, stable sort by score, highest first,
//! one endpoint). Before the request goes out, the chosen pod is recorded in the approximate
//! prefix index with the request's block hashes (`approximateprefix/plugin.go`, `PreRequest`;
//! the LRU of a pod seen for the first time gets the pod's `num_gpu_blocks` entries when
//! auto-tuning, else `lruCapacityPerServer`).
//!
//! Pure: the pods' metrics are passed in and randomness comes from the injected RNG.

use rand::seq::SliceRandom;
use rand::Rng;

use crate::podmetrics::PodMetrics;
use crate::prefix::{self, Indexer};

/// Scorer weights of the profile.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Weights {
    pub queue: f64,
    pub kv_cache: f64,
    pub prefix: f64,
}

impl Default for Weights {
    /// llm-d's defaults: queue 2, KV cache 2, prefix 3.
    fn default() -> Self {
        Weights {
            queue: 2.0,
            kv_cache: 2.0,
            prefix: 3.0,
        }
    }
}

/// The approximate prefix producer's parameters (llm-d's `config` in approximateprefix/types.go).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixSettings {
    /// Read the block size and the LRU capacity from the pods' metrics.
    pub auto_tune: bool,
    /// Block size when not auto-tuned (or no pod reports one); raised to 64.
    pub block_size_tokens: usize,
    /// Tokens matched at most (0: no cap).
    pub max_prefix_tokens: usize,
    /// LRU entries per pod when the pod reports no GPU block count (or not auto-tuning).
    pub lru_capacity_per_server: usize,
}

impl Default for PrefixSettings {
    fn default() -> Self {
        PrefixSettings {
            auto_tune: true,
            block_size_tokens: prefix::DEFAULT_BLOCK_SIZE_TOKENS,
            max_prefix_tokens: prefix::DEFAULT_MAX_PREFIX_TOKENS,
            lru_capacity_per_server: prefix::DEFAULT_LRU_CAPACITY_PER_SERVER,
        }
    }
}

/// What scheduling needs from a request.
#[derive(Debug, Clone, Copy)]
pub struct SchedRequest<'a> {
    /// The target model (seeds the hash chain).
    pub model: &'a str,
    pub cache_salt: &'a str,
    /// One pseudo-token sequence per prompt.
    pub prompts: &'a [Vec<u32>],
}

/// One pod's scores.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PodScore {
    pub queue: f64,
    pub kv_cache: f64,
    pub prefix: f64,
    /// The weighted sum.
    pub total: f64,
}

/// The decision.
#[derive(Debug, Clone, PartialEq)]
pub struct Pick {
    /// Index of the chosen pod.
    pub pod: usize,
    /// Per pod, in pool order.
    pub scores: Vec<PodScore>,
    /// Blocks of the request the chosen pod matched.
    pub matched_blocks: usize,
    /// Blocks of the request (all prompts).
    pub total_blocks: usize,
    /// Block size used, tokens.
    pub block_size: usize,
    /// LRU capacity given to the chosen pod if its LRU was created now.
    pub lru_capacity: usize,
}

/// Why no pod was picked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    #[error("failed to find endpoint candidates for serving the request")]
    NoCandidates,
}

/// Clamp to [0, 1] (llm-d's `enforceScoreRange`).
fn clamp01(s: f64) -> f64 {
    s.clamp(0.0, 1.0)
}

/// The queue scorer over the candidates' waiting counts.
pub fn queue_scores(waiting: &[i64]) -> Vec<f64> {
    let (min, max) = waiting
        .iter()
        .fold((i64::MAX, i64::MIN), |(lo, hi), &w| (lo.min(w), hi.max(w)));
    waiting
        .iter()
        .map(|&w| {
            if max == min {
                1.0
            } else {
                (max - w) as f64 / (max - min) as f64
            }
        })
        .collect()
}

/// The scheduler: the profile's weights, the prefix index and the picker's RNG.
#[derive(Debug)]
pub struct Scheduler<R> {
    weights: Weights,
    prefix: PrefixSettings,
    indexer: Indexer,
    rng: R,
}

impl<R: Rng> Scheduler<R> {
    pub fn new(weights: Weights, prefix: PrefixSettings, rng: R) -> Self {
        Scheduler {
            weights,
            prefix,
            indexer: Indexer::new(),
            rng,
        }
    }

    pub fn indexer(&self) -> &Indexer {
        &self.indexer
    }

    /// Scores `pods` (the candidates, in pool order), picks one and records the request's
    /// blocks for it in the prefix index.
    pub fn schedule(
        &mut self,
        req: &SchedRequest<'_>,
        pods: &[PodMetrics],
    ) -> Result<Pick, ScheduleError> {
        let first = pods.first().ok_or(ScheduleError::NoCandidates)?;
        // Produce: block hashes and per-pod matches.
        let block_size = prefix::effective_block_size(
            self.prefix.auto_tune,
            self.prefix.block_size_tokens,
            Some(first.block_size),
        );
        let max_blocks = prefix::max_blocks(self.prefix.max_prefix_tokens, block_size);
        let per_prompt: Vec<Vec<prefix::BlockHash>> = req
            .prompts
            .iter()
            .map(|t| prefix::block_hashes(req.model, req.cache_salt, t, block_size, max_blocks))
            .filter(|h| !h.is_empty())
            .collect();
        let mut matched = vec![0usize; pods.len()];
        let mut total_blocks = 0;
        for hashes in &per_prompt {
            for (pod, n) in self.indexer.match_longest_prefix(hashes) {
                if let Some(m) = matched.get_mut(pod) {
                    *m += n;
                }
            }
            total_blocks += hashes.len();
        }
        // Score.
        let waiting: Vec<i64> = pods.iter().map(|p| p.waiting).collect();
        let queue = queue_scores(&waiting);
        let scores: Vec<PodScore> = pods
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let q = clamp01(queue[i]);
                let kv = clamp01(1.0 - p.kv_usage);
                let pf = if total_blocks == 0 {
                    0.0
                } else {
                    clamp01(matched[i] as f64 / total_blocks as f64)
                };
                let mut total = 0.0;
                total += q * self.weights.queue;
                total += kv * self.weights.kv_cache;
                total += pf * self.weights.prefix;
                PodScore {
                    queue: q,
                    kv_cache: kv,
                    prefix: pf,
                    total,
                }
            })
            .collect();
        // Pick: shuffle, stable sort, highest first.
        let mut order: Vec<usize> = (0..pods.len()).collect();
        order.shuffle(&mut self.rng);
        order.sort_by(|a, b| scores[*b].total.total_cmp(&scores[*a].total));
        let pod = order[0];
        // PreRequest: record the pick in the index.
        let gpu_blocks = usize::try_from(pods[pod].num_gpu_blocks).unwrap_or(0);
        let lru_capacity = if self.prefix.auto_tune && gpu_blocks > 0 {
            gpu_blocks
        } else if self.prefix.lru_capacity_per_server > 0 {
            self.prefix.lru_capacity_per_server
        } else {
            prefix::DEFAULT_LRU_CAPACITY_PER_SERVER
        };
        for hashes in &per_prompt {
            self.indexer.add(hashes, pod, lru_capacity);
        }
        Ok(Pick {
            pod,
            matched_blocks: matched[pod],
            scores,
            total_blocks,
            block_size,
            lru_capacity,
        })
    }

    /// A uniformly random pod, for requests without a body (llm-d's `GetRandomEndpoint`).
    pub fn random_pod(&mut self, n: usize) -> Option<usize> {
        (n > 0).then(|| self.rng.random_range(0..n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    fn sched(seed: u64) -> Scheduler<ChaCha8Rng> {
        Scheduler::new(
            Weights::default(),
            PrefixSettings::default(),
            ChaCha8Rng::seed_from_u64(seed),
        )
    }

    fn pod(waiting: i64, kv: f64) -> PodMetrics {
        PodMetrics {
            waiting,
            kv_usage: kv,
            block_size: 16,
            num_gpu_blocks: 1000,
            ..PodMetrics::default()
        }
    }

    fn prompt(seed: u32, len: u32) -> Vec<Vec<u32>> {
        vec![(0..len)
            .map(|i| i.wrapping_mul(2_654_435_761) ^ seed)
            .collect()]
    }

    fn req<'a>(p: &'a [Vec<u32>]) -> SchedRequest<'a> {
        SchedRequest {
            model: "m",
            cache_salt: "",
            prompts: p,
        }
    }

    #[test]
    fn queue_scores_are_min_max_normalised() {
        assert_eq!(queue_scores(&[0, 5, 10]), vec![1.0, 0.5, 0.0]);
        assert_eq!(queue_scores(&[3, 3]), vec![1.0, 1.0]);
        assert_eq!(queue_scores(&[7]), vec![1.0]);
    }

    #[test]
    fn the_longest_queue_is_never_picked_when_all_else_is_equal() {
        let mut s = sched(1);
        let pods = [pod(0, 0.1), pod(40, 0.1), pod(0, 0.1)];
        for i in 0..200 {
            let p = prompt(i, 100);
            let pick = s.schedule(&req(&p), &pods).unwrap();
            assert_ne!(pick.pod, 1);
            assert_eq!(pick.scores[1].queue, 0.0);
        }
    }

    #[test]
    fn weights_sum_in_profile_order_and_kv_is_one_minus_usage() {
        let mut s = sched(2);
        let p = prompt(1, 10);
        let pick = s.schedule(&req(&p), &[pod(0, 0.25), pod(4, 1.5)]).unwrap();
        assert_eq!(
            pick.scores[0],
            PodScore {
                queue: 1.0,
                kv_cache: 0.75,
                prefix: 0.0,
                total: 2.0 + 1.5
            }
        );
        // Usage above 1 clamps the KV score at 0.
        assert_eq!(pick.scores[1].kv_cache, 0.0);
        assert_eq!(pick.pod, 0);
    }

    #[test]
    fn ties_break_at_random_and_are_seeded() {
        let pods = [pod(0, 0.0), pod(0, 0.0), pod(0, 0.0)];
        let run = |seed| {
            let mut s = sched(seed);
            (0..60)
                .map(|i| s.schedule(&req(&prompt(i, 5)), &pods).unwrap().pod)
                .collect::<Vec<_>>()
        };
        let a = run(7);
        assert_eq!(a, run(7), "same seed, same picks");
        for p in 0..3 {
            assert!(a.contains(&p), "pod {p} never picked in {a:?}");
        }
    }

    #[test]
    fn a_repeated_prompt_follows_its_prefix() {
        let mut s = sched(3);
        let pods = [pod(0, 0.0), pod(0, 0.0), pod(0, 0.0)];
        let p = prompt(42, 500); // 8 blocks of 64
        let first = s.schedule(&req(&p), &pods).unwrap();
        assert_eq!(first.total_blocks, 8);
        assert_eq!(first.block_size, 64, "16 from the pod, raised to 64");
        assert_eq!(first.matched_blocks, 0);
        assert_eq!(first.lru_capacity, 1000, "num_gpu_blocks when auto-tuning");
        for _ in 0..20 {
            let again = s.schedule(&req(&p), &pods).unwrap();
            assert_eq!(again.pod, first.pod);
            assert_eq!(again.matched_blocks, 8);
            assert_eq!(again.scores[again.pod].prefix, 1.0);
        }
        // A prompt sharing the first half matches half its blocks on that pod.
        let mut half = p.clone();
        for t in half[0].iter_mut().skip(256) {
            *t ^= 0xFFFF;
        }
        let h = s.schedule(&req(&half), &pods).unwrap();
        assert_eq!(h.pod, first.pod);
        assert_eq!(h.matched_blocks, 4);
    }

    #[test]
    fn prefix_weight_three_beats_one_queue_step() {
        // The cached pod has the longest queue (queue score 0) but a full prefix match:
        // 0 + 2 + 3 = 5 against 2 + 2 + 0 = 4.
        let mut s = sched(4);
        let p = prompt(9, 300);
        let first = s
            .schedule(&req(&p), &[pod(0, 0.0), pod(0, 0.0)])
            .unwrap()
            .pod;
        let mut pods = [pod(0, 0.0), pod(0, 0.0)];
        pods[first].waiting = 10;
        assert_eq!(s.schedule(&req(&p), &pods).unwrap().pod, first);
    }

    #[test]
    fn no_prompt_means_prefix_zero_and_no_candidates_is_an_error() {
        let mut s = sched(5);
        let pick = s.schedule(&req(&[]), &[pod(0, 0.0)]).unwrap();
        assert_eq!(pick.total_blocks, 0);
        assert_eq!(pick.scores[0].prefix, 0.0);
        assert_eq!(s.schedule(&req(&[]), &[]), Err(ScheduleError::NoCandidates));
        assert_eq!(s.random_pod(0), None);
        assert!(s.random_pod(3).is_some_and(|p| p < 3));
    }

    #[test]
    fn without_auto_tune_the_configured_sizes_apply() {
        let mut s = Scheduler::new(
            Weights::default(),
            PrefixSettings {
                auto_tune: false,
                block_size_tokens: 128,
                max_prefix_tokens: 256,
                lru_capacity_per_server: 7,
            },
            ChaCha8Rng::seed_from_u64(1),
        );
        let p = prompt(1, 1000);
        let pick = s.schedule(&req(&p), &[pod(0, 0.0)]).unwrap();
        assert_eq!(pick.block_size, 128);
        assert_eq!(pick.total_blocks, 2, "256 tokens / 128");
        assert_eq!(pick.lru_capacity, 7);
    }

    proptest! {
        #[test]
        fn scores_stay_in_range_and_the_pick_has_the_top_score(
            waiting in proptest::collection::vec(0i64..100, 1..8),
            kv in proptest::collection::vec(-1.0f64..2.0, 8),
            seed in 0u64..1000,
        ) {
            let pods: Vec<PodMetrics> = waiting.iter().zip(&kv).map(|(w, k)| pod(*w, *k)).collect();
            let mut s = sched(seed);
            let p = prompt(seed as u32, 70);
            let pick = s.schedule(&req(&p), &pods).unwrap();
            let best = pick.scores.iter().map(|s| s.total).fold(f64::MIN, f64::max);
            prop_assert_eq!(pick.scores[pick.pod].total, best);
            for sc in &pick.scores {
                for v in [sc.queue, sc.kv_cache, sc.prefix] {
                    prop_assert!((0.0..=1.0).contains(&v));
                }
                prop_assert!(sc.total >= 0.0 && sc.total <= 7.0);
            }
        }
    }
}
