//! Prefix-cache affinity (`prefixAffinity`) in the pick: holders win within a tier of wait, a
//! queued holder spills to a free pod, cut or refused pods are never chosen for affinity, a
//! prompt no pod holds meets on its rendezvous pod from every sidecar, a sidecar's own sends
//! count until the agents report them, and with the block absent nothing changes.

use ai_lb_filter_core::config::FilterConfig;
use ai_lb_filter_core::picker::{Decision, RequestSize, Router};
use ai_lb_filter_core::prefix::keys::{keys_of, prompt_ids, seed_of};
use ai_lb_filter_core::prefix::PromptKeys;
use ai_lb_proto::{
    GpuStats, InferenceStats, PeerState, PeerStatus, PodIdentity, PodSnapshot, PoolEvent,
    PrefixCacheSummary,
};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";
const BT: u32 = 64;

fn addr(i: usize) -> String {
    format!("10.0.0.{}:8000", i + 1)
}

/// One pod: `running`/`waiting` of 8 seats, KV use of 12 500 tokens, and the key blocks it
/// holds.
#[derive(Clone, Debug, Default)]
struct Pod {
    running: u32,
    waiting: u32,
    kv: f64,
    held: Vec<u32>,
    occupancy: f64,
}

fn snapshot(i: usize, p: &Pod, seq: u64) -> PodSnapshot {
    let mut keys = p.held.clone();
    keys.sort_unstable();
    keys.dedup();
    PodSnapshot {
        identity: Some(PodIdentity {
            address: addr(i),
            pod_name: format!("pod-{i}"),
            ..Default::default()
        }),
        gpus: vec![GpuStats {
            utilization: Some(1.0),
            sm_occupancy: Some(p.occupancy.max(0.2)),
            ..Default::default()
        }],
        inference: Some(InferenceStats {
            waiting: Some(p.waiting),
            running: Some(p.running),
            queue_capacity: Some(8),
            kv_cache_usage: Some(p.kv),
            kv_capacity_tokens: Some(12_500),
            ..Default::default()
        }),
        sequence: seq,
        agent_instance: format!("agent-{i}"),
        prefix_cache: Some(PrefixCacheSummary {
            block_tokens: BT,
            keys,
            truncated: false,
            model: MODEL.into(),
        }),
        ..Default::default()
    }
}

fn event(pods: &[Pod], seq: u64) -> PoolEvent {
    PoolEvent {
        full: true,
        peers: pods
            .iter()
            .enumerate()
            .map(|(i, p)| PeerState {
                peer: format!("agent-{i}:9090"),
                status: PeerStatus::Live as i32,
                snapshot: Some(snapshot(i, p, seq)),
                reason: String::new(),
            })
            .collect(),
        ..Default::default()
    }
}

fn config(affinity: Option<&str>) -> FilterConfig {
    let aff = affinity.map_or(String::new(), |a| format!(r#","prefixAffinity":{a}"#));
    FilterConfig::from_json(
        format!(
            r#"{{"pools":[{{"name":"p","cluster":"c"}}],"minPods":1,"floorWeight":0.05{aff}}}"#
        )
        .as_bytes(),
    )
    .unwrap()
}

fn router(pods: &[Pod], affinity: Option<&str>) -> Router {
    let mut r = Router::new(config(affinity));
    r.apply_pool_event(0, &event(pods, 1), 1000);
    r
}

/// A chat prompt with a system prompt of about `system_tokens` tokens shared by `group`, and a
/// question unique to `q`, keyed in the pool's space.
fn prompt(group: u32, system_tokens: usize, q: u32) -> (PromptKeys, RequestSize) {
    let system: String = (0..system_tokens)
        .map(|i| format!("g{group:02}{}", i % 10))
        .collect();
    let body = serde_json::json!({"model": MODEL, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": format!("question {q}: what is the answer to this one?")}]})
    .to_string();
    let mut ids = Vec::new();
    let (_, found) = prompt_ids(body.as_bytes(), 8192, &mut ids);
    assert!(found);
    let mut keys = PromptKeys::default();
    keys_of(&ids, seed_of(MODEL), BT, &mut Vec::new(), &mut keys);
    let size = RequestSize {
        weight: 1.0,
        kv_tokens: ids.len() as f64 + 100.0,
        output_tokens: 100.0,
    };
    (keys, size)
}

/// The pods six sidecars (a fresh router each, drawing with `seed(sidecar)`) pick for `q` at
/// t = 1000, each pick counted once by `counted` (the counter the test expects it under).
fn from_six_sidecars(
    pods: &[Pod],
    q: &PromptKeys,
    size: RequestSize,
    seed: impl Fn(u64) -> u64,
    counted: impl Fn(&Router) -> u64,
) -> std::collections::BTreeSet<String> {
    let mut seen = std::collections::BTreeSet::new();
    for sidecar in 0..6u64 {
        let mut r = router(pods, Some("{}"));
        seen.insert(pick(&mut r, q, size, 1000, seed(sidecar)));
        assert_eq!(counted(&r), 1, "sidecar {sidecar}");
    }
    seen
}

fn pick(r: &mut Router, q: &PromptKeys, size: RequestSize, now: u64, seed: u64) -> String {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    match r.decide_with(0, None, size, Some(q), now, &mut rng) {
        Decision::Steer { ranked, .. } | Decision::FailOpen { ranked } => r
            .address(0, &ranked, ranked.first().unwrap())
            .unwrap()
            .to_string(),
        d => panic!("{d:?}"),
    }
}

fn held_by(q: &PromptKeys, n: usize) -> Vec<u32> {
    q.keys[..n.min(q.keys.len())].to_vec()
}

#[test]
fn a_holder_with_a_free_seat_takes_every_request_of_its_prefix() {
    let (q, _) = prompt(1, 1500, 0);
    assert!(q.keys.len() >= 20, "{}", q.keys.len());
    let mut pods = vec![Pod::default(); 8];
    pods[5].held = held_by(&q, q.keys.len() - 2);
    pods[5].running = 3;
    let mut r = router(&pods, Some("{}"));
    for seed in 0..200 {
        // Different questions of the same group: the system prompt's blocks match.
        let (q, size) = prompt(1, 1500, seed as u32 + 1);
        assert_eq!(pick(&mut r, &q, size, 1000, seed), addr(5), "seed {seed}");
    }
    let c = r.counters();
    assert_eq!(
        (c.prefix_keyed, c.prefix_hit, c.prefix_spill),
        (200, 200, 0)
    );
    assert!(c.prefix_blocks_held * 10 >= c.prefix_blocks * 8, "{c:?}");
}

#[test]
fn without_the_block_the_prompt_changes_nothing() {
    let (q, size) = prompt(1, 1500, 0);
    let mut pods = vec![Pod::default(); 8];
    pods[5].held = q.keys.clone();
    let mut a = router(&pods, None);
    let mut b = router(&pods, None);
    for seed in 0..100 {
        let mut r1 = ChaCha8Rng::seed_from_u64(seed);
        let mut r2 = ChaCha8Rng::seed_from_u64(seed);
        let da = a.decide_with(0, None, size, Some(&q), 1000, &mut r1);
        let db = b.decide_for(0, None, size, 1000, &mut r2);
        assert_eq!(format!("{da:?}"), format!("{db:?}"));
    }
    assert_eq!(a.counters().prefix_keyed, 0);
    assert_eq!(
        a.prefix_space(0),
        None,
        "off: the glue need not key prompts"
    );
    assert_eq!(
        router(&pods, Some("{}")).prefix_space(0),
        Some((BT, seed_of(MODEL)))
    );
}

#[test]
fn a_holder_whose_queue_formed_spills_to_a_pod_with_a_free_seat() {
    let (q, size) = prompt(2, 1500, 0);
    let mut pods = vec![Pod::default(); 4];
    pods[0].held = q.keys.clone();
    pods[0].running = 8;
    pods[0].waiting = 3;
    let mut r = router(&pods, Some("{}"));
    for seed in 0..100 {
        assert_ne!(pick(&mut r, &q, size, 1000, seed), addr(0), "seed {seed}");
    }
    // The first spills; the pod it spilled to holds the prefix from then on (this sidecar
    // sent it there), so the rest are hits there.
    let c = r.counters();
    assert!(c.prefix_spill >= 1, "{c:?}");
    assert_eq!(c.prefix_spill + c.prefix_hit, 100, "{c:?}");
}

#[test]
fn both_queued_the_holder_wins_within_the_slack_and_loses_past_it() {
    let (q, size) = prompt(3, 1500, 0);
    // Two pods only, both full with a queue: the holder's wait is longer by 2/8 rounds.
    let mut pods = vec![Pod::default(); 2];
    pods[0].held = q.keys.clone();
    (pods[0].running, pods[0].waiting) = (8, 3);
    (pods[1].running, pods[1].waiting) = (8, 1);
    let mut r = router(&pods, Some("{}"));
    for seed in 0..50 {
        assert_eq!(pick(&mut r, &q, size, 1000, seed), addr(0), "seed {seed}");
    }
    // Much longer (20 more waiting = 2.5 rounds over a slack of 1): the other pod.
    pods[0].waiting = 21;
    let mut r = router(&pods, Some("{}"));
    for seed in 0..50 {
        assert_eq!(pick(&mut r, &q, size, 1000, seed), addr(1), "seed {seed}");
    }
    // With no slack, affinity only breaks exact ties: the shorter wait wins.
    pods[0].waiting = 3;
    let mut r = router(&pods, Some(r#"{"queueSlackRounds":0}"#));
    assert_eq!(pick(&mut r, &q, size, 1000, 1), addr(1));
}

#[test]
fn a_cut_or_broken_holder_is_never_chosen_for_its_prefix() {
    let (q, size) = prompt(4, 1500, 0);
    let mut pods = vec![Pod::default(); 4];
    pods[2].held = q.keys.clone();
    pods[2].occupancy = 0.99; // over the GPU hard limit
    pods[3].held = q.keys.clone();
    let mut r = router(&pods, Some("{}"));
    // Pod 3's breaker opens on consecutive failures.
    for _ in 0..10 {
        let failed = ai_lb_filter_core::Outcome {
            status: Some(500),
            ..Default::default()
        };
        r.on_outcome(0, &addr(3), None, &failed, 1000);
    }
    for seed in 0..200 {
        let a = pick(&mut r, &q, size, 1001, seed);
        assert!(a != addr(2) && a != addr(3), "seed {seed}: {a}");
    }
}

#[test]
fn the_kv_cache_a_holder_shares_is_not_needed_again() {
    let (q, _) = prompt(5, 1500, 0);
    // 2 000 tokens of KV left on each pod; the request needs ~1 700 + 3 000 output, of which
    // the holder already has ~1 500 (its prefix).
    let size = RequestSize {
        weight: 1.0,
        kv_tokens: f64::from(q.tokens) + 600.0,
        output_tokens: 600.0,
    };
    let mut pods = vec![Pod::default(); 4];
    for p in pods.iter_mut() {
        p.kv = 1.0 - 1500.0 / 12_500.0;
        p.running = 4;
    }
    pods[1].held = q.keys.clone();
    let mut r = router(&pods, Some("{}"));
    for seed in 0..50 {
        assert_eq!(pick(&mut r, &q, size, 1000, seed), addr(1), "seed {seed}");
    }
}

#[test]
fn a_new_long_prefix_meets_on_one_pod_from_every_sidecar() {
    let pods = vec![Pod::default(); 8];
    for group in 0..20 {
        let (q, size) = prompt(10 + group, 1500, 0);
        let seen = from_six_sidecars(
            &pods,
            &q,
            size,
            |sidecar| sidecar * 7919 + u64::from(group),
            |r| r.counters().prefix_rendezvous,
        );
        assert_eq!(seen.len(), 1, "group {group}: {seen:?}");
    }
    // A short one (under rendezvousMinTokens) is picked as any request.
    let (q, size) = prompt(40, 100, 0);
    let mut seen = std::collections::BTreeSet::new();
    for sidecar in 0..30u64 {
        let mut r = router(&pods, Some("{}"));
        seen.insert(pick(&mut r, &q, size, 1000, sidecar));
    }
    assert!(seen.len() > 2, "{seen:?}");
}

#[test]
fn a_sidecar_follows_its_own_recent_sends_until_they_expire() {
    let pods = vec![Pod::default(); 8];
    // Short prompts (no rendezvous), reported by no agent.
    let cfg = r#"{"rendezvousMinTokens":100000,"ownTtlMs":500}"#;
    let mut r = router(&pods, Some(cfg));
    let (q, size) = prompt(7, 400, 0);
    let first = pick(&mut r, &q, size, 1000, 1);
    for seed in 2..40 {
        let (q2, size2) = prompt(7, 400, seed as u32);
        assert_eq!(pick(&mut r, &q2, size2, 1100, seed), first, "seed {seed}");
    }
    // Within the TTL it follows them even where a sidecar without them would go elsewhere;
    // past it, it picks as that sidecar does.
    let fresh = |seed: u64, now: u64| {
        let mut f = router(&pods, Some(cfg));
        let (q2, size2) = prompt(7, 400, seed as u32);
        pick(&mut f, &q2, size2, now, seed)
    };
    let elsewhere = (40..200).find(|&s| fresh(s, 1200) != first).unwrap();
    let (q2, size2) = prompt(7, 400, elsewhere as u32);
    assert_eq!(pick(&mut r, &q2, size2, 1200, elsewhere), first);
    let late = 1200 + 501;
    let s3 = (1000..2000).find(|&s| fresh(s, late) != first).unwrap();
    let (q3, size3) = prompt(7, 400, s3 as u32);
    assert_eq!(pick(&mut r, &q3, size3, late, s3), fresh(s3, late));
}

#[test]
fn reported_keys_of_another_model_or_block_size_never_match() {
    let (q, size) = prompt(8, 1500, 0);
    let mut pods = vec![Pod::default(); 8];
    pods[6].held = q.keys.clone();
    let mut ev = event(&pods, 1);
    ev.peers[6]
        .snapshot
        .as_mut()
        .unwrap()
        .prefix_cache
        .as_mut()
        .unwrap()
        .model = "other".into();
    let mut r = Router::new(config(Some(
        r#"{"rendezvousMinTokens":100000,"ownTtlMs":0}"#,
    )));
    r.apply_pool_event(0, &ev, 1000);
    let hits = (0..100)
        .filter(|&s| pick(&mut r, &q, size, 1000 + s, s) == addr(6))
        .count();
    assert!(hits < 40, "{hits}");
    assert_eq!(r.counters().prefix_hit, 0);
}

#[test]
fn a_queued_holder_spills_to_another_holder_with_a_free_seat() {
    let (q, size) = prompt(20, 1500, 0);
    let mut pods = vec![Pod::default(); 6];
    pods[0].held = q.keys.clone();
    // Eight waiting behind eight running: a wait of about two service rounds, past the slack
    // (one round for the whole prompt) its extra blocks earn it.
    (pods[0].running, pods[0].waiting) = (8, 8);
    // Pod 4 holds the system prompt's first ten blocks and has free seats.
    pods[4].held = held_by(&q, 10);
    pods[4].running = 6;
    for seed in 0..100 {
        let mut r = router(&pods, Some("{}"));
        assert_eq!(pick(&mut r, &q, size, 1000, seed), addr(4), "seed {seed}");
    }
}

#[test]
fn a_conversations_pod_with_a_short_queue_beats_a_system_prompt_holder_with_a_free_seat() {
    // A later turn of a conversation: pod 2 holds the whole conversation and has one request
    // waiting (a wait of a quarter of a service round); pods 0, 1 and 3-5 hold only the
    // system prompt's first blocks and have free seats. Recomputing most of the prompt
    // elsewhere costs more than the short wait: the conversation's pod takes it.
    let (q, size) = prompt(21, 1500, 0);
    let mut pods = vec![Pod::default(); 6];
    for p in pods.iter_mut() {
        p.held = held_by(&q, 4);
        p.running = 4;
    }
    pods[2].held = q.keys.clone();
    (pods[2].running, pods[2].waiting) = (8, 1);
    for seed in 0..100 {
        let mut r = router(&pods, Some("{}"));
        assert_eq!(pick(&mut r, &q, size, 1000, seed), addr(2), "seed {seed}");
    }
    // With no slack (affinity only breaks ties within a tier), the free seat wins.
    for seed in 0..100 {
        let mut r = router(&pods, Some(r#"{"queueSlackRounds":0}"#));
        assert_ne!(pick(&mut r, &q, size, 1000, seed), addr(2), "seed {seed}");
    }
}

#[test]
fn a_prompt_no_pod_holds_is_balanced_by_load_not_sent_to_its_rendezvous_pod() {
    // Traffic whose prompts never recur: the rendezvous pod of a long prompt is one more
    // candidate, and loses to a less loaded one (it only wins ties).
    let (q, size) = prompt(22, 1500, 0);
    let idle = vec![Pod::default(); 8];
    let meet = pick(&mut router(&idle, Some("{}")), &q, size, 1000, 1);
    let i = (0..8).find(|&i| addr(i) == meet).unwrap();
    let mut pods = idle.clone();
    for (j, p) in pods.iter_mut().enumerate() {
        p.running = if j == i { 6 } else { 2 };
    }
    for seed in 0..100 {
        let mut r = router(&pods, Some("{}"));
        assert_ne!(pick(&mut r, &q, size, 1000, seed), meet, "seed {seed}");
        assert_eq!(r.counters().prefix_rendezvous, 0);
    }
}

#[test]
fn every_sidecar_spills_a_queued_prefix_to_the_same_pod() {
    let mut pods = vec![Pod::default(); 8];
    for group in 0..10 {
        let (q, size) = prompt(30 + group, 1500, 0);
        pods[0].held = q.keys.clone();
        (pods[0].running, pods[0].waiting) = (8, 4);
        let seen = from_six_sidecars(
            &pods,
            &q,
            size,
            |sidecar| sidecar * 31 + u64::from(group),
            |r| r.counters().prefix_spill,
        );
        assert_eq!(seen.len(), 1, "group {group}: {seen:?}");
        assert!(!seen.contains(&addr(0)));
    }
}

#[test]
fn a_groups_requests_meet_whatever_their_questions() {
    // A system prompt shorter than rendezvousMinTokens, with questions that take the prompt
    // past it: the rendezvous key is the first 256 tokens, which the questions do not change.
    let pods = vec![Pod::default(); 8];
    for group in 0..10 {
        let mut seen = std::collections::BTreeSet::new();
        for question in 0..6u32 {
            let (mut q, size) = prompt(50 + group, 900, question);
            // Make the prompt count over the threshold (a long question).
            q.tokens = q.tokens.max(1100);
            let mut r = router(&pods, Some("{}"));
            seen.insert(pick(&mut r, &q, size, 1000, u64::from(question) * 17 + 3));
        }
        assert_eq!(seen.len(), 1, "group {group}: {seen:?}");
    }
}
