//! Token-bucket accounting under contention and over many requests: exact totals with CAS
//! races (simulated interleavings and real threads), reservation + reconciliation charging
//! exactly the actual usage, and the property that admission never drives a bucket negative.

use std::sync::{Arc, Mutex};

use ai_lb_filter_core::admission::bucket::{
    peek, reconcile, try_admit, Admission, MemoryStore, SharedStore,
};
use ai_lb_filter_core::admission::config::BucketParams;
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const BIG: BucketParams = BucketParams {
    tokens_per_second: 1,
    burst: 1_000_000,
};

fn reserved(a: &Admission) -> Option<u64> {
    match a {
        Admission::Admitted { grant, .. } => Some(grant.reserved),
        _ => None,
    }
}

#[test]
fn interleaved_cas_failures_keep_exact_totals() {
    let store = MemoryStore::new();
    let foreign = Arc::new(Mutex::new(Vec::<u64>::new()));
    let rng = Arc::new(Mutex::new(ChaCha8Rng::seed_from_u64(7)));
    {
        let foreign = Arc::clone(&foreign);
        let rng = Arc::clone(&rng);
        // Inside 30 % of the CAS windows, another worker admits a request of its own.
        store.set_interference(move |st, _key| {
            let (hit, cost) = {
                let mut r = rng.lock().unwrap();
                (r.random_bool(0.3), r.random_range(1..=500u64))
            };
            if hit {
                if let Some(c) = reserved(&try_admit(st, "t", &BIG, cost, 0)) {
                    foreign.lock().unwrap().push(c);
                }
            }
        });
    }
    let mut mine = 0u64;
    let mut retried = 0u32;
    for i in 0..2_000u64 {
        match try_admit(&store, "t", &BIG, 1 + i % 300, 0) {
            Admission::Admitted { grant, cas_retries } => {
                mine += grant.reserved;
                retried += cas_retries;
            }
            Admission::Rejected { .. } => {}
            Admission::Contended => panic!(
                "16 attempts at p=0.3 should not all lose (request {i}, level {:?}, foreign {})",
                peek(&store, "t", &BIG, 0),
                foreign.lock().unwrap().len()
            ),
        }
    }
    store.clear_interference();
    let theirs: u64 = foreign.lock().unwrap().iter().sum();
    assert!(
        retried > 500,
        "the interference must actually cause CAS retries, got {retried}"
    );
    let level = peek(&store, "t", &BIG, 0).level_milli;
    assert_eq!(level, (1_000_000 - mine as i64 - theirs as i64) * 1000);
}

#[test]
fn real_threads_contending_admit_exactly_the_burst() {
    let store = Arc::new(MemoryStore::new());
    let p = BucketParams {
        tokens_per_second: 1,
        burst: 10_000,
    };
    let handles: Vec<_> = (0..8)
        .map(|_| {
            let store = Arc::clone(&store);
            std::thread::spawn(move || {
                let mut got = 0u64;
                let mut contended = 0u64;
                for _ in 0..2_000 {
                    match try_admit(store.as_ref(), "t", &p, 1, 0) {
                        Admission::Admitted { grant, .. } => got += grant.reserved,
                        Admission::Contended => contended += 1,
                        Admission::Rejected { .. } => {}
                    }
                }
                (got, contended)
            })
        })
        .collect();
    let (mut total, mut contended) = (0, 0);
    for h in handles {
        let (g, c) = h.join().unwrap();
        total += g;
        contended += c;
    }
    // 16 000 requests of 1 token against a 10 000 burst with time frozen: the bucket charges
    // exactly 10 000, however the threads interleave. A `Contended` outcome (16 CAS attempts
    // lost in a row) charges nothing and is counted by the glue; real OS scheduling makes a few
    // of them possible (seen: 10 of 16 000 on a loaded 2-core box), so they are bounded here,
    // not required to be zero: the 6 000 requests beyond the burst leave room for them without
    // changing the charged total.
    assert_eq!(total, 10_000);
    assert!(
        contended < 1_000,
        "{contended} of 16 000 admissions exhausted their CAS retries"
    );
    assert_eq!(peek(store.as_ref(), "t", &p, 0).level_milli, 0);
}

#[test]
fn charged_total_equals_sum_of_actual_usage() {
    let store = MemoryStore::new();
    let p = BucketParams {
        tokens_per_second: 50,
        burst: 200_000,
    };
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let (mut actual_sum, mut now, mut admitted) = (0u64, 0u64, 0u32);
    // The first request (t = 0) takes the bucket below burst; from then on refill never
    // fills it, so no refill is lost to the cap.
    for _ in 0..500 {
        let est = rng.random_range(1..2_000u64);
        let actual = rng.random_range(0..3_000u64);
        if let Some(r) = reserved(&try_admit(&store, "t", &p, est, now)) {
            let s = reconcile(&store, "t", &p, r, actual, now).unwrap();
            assert_eq!(r + s.charged - s.refunded, actual);
            actual_sum += actual;
            admitted += 1;
        }
        now += rng.random_range(0..20u64);
    }
    assert!(admitted > 50);
    // Refill over `now` ms at 50 tokens/s is 50 milli-tokens per ms; the bucket never reached
    // burst again, so what left it is exactly the actual usage.
    let level = peek(&store, "t", &p, now).level_milli;
    assert_eq!(
        level,
        200_000_000 + now as i64 * 50 - actual_sum as i64 * 1000
    );
}

#[test]
fn tenants_have_separate_buckets() {
    let store = MemoryStore::new();
    let p = BucketParams {
        tokens_per_second: 1,
        burst: 100,
    };
    assert!(reserved(&try_admit(&store, "a", &p, 100, 0)).is_some());
    assert!(reserved(&try_admit(&store, "a", &p, 1, 0)).is_none());
    assert!(reserved(&try_admit(&store, "b", &p, 100, 0)).is_some());
    assert!(store.get("ai-lb.admission.bucket.b").is_some());
}

#[derive(Debug, Clone)]
enum Op {
    Admit { cost: u64, dt: u64 },
    Settle { actual: u64, dt: u64 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u64..5_000, 0u64..2_000).prop_map(|(cost, dt)| Op::Admit { cost, dt }),
        (0u64..8_000, 0u64..2_000).prop_map(|(actual, dt)| Op::Settle { actual, dt }),
    ]
}

proptest! {
    #[test]
    fn admission_never_drives_a_bucket_negative(
        rate in 1u64..10_000,
        burst in 1u64..20_000,
        ops in proptest::collection::vec(op(), 1..200),
    ) {
        let p = BucketParams { tokens_per_second: rate, burst };
        let store = MemoryStore::new();
        let mut now = 0u64;
        let mut pending: Vec<u64> = Vec::new();
        for o in ops {
            match o {
                Op::Admit { cost, dt } => {
                    now += dt;
                    let before = peek(&store, "t", &p, now).level_milli;
                    let a = try_admit(&store, "t", &p, cost, now);
                    let after = peek(&store, "t", &p, now).level_milli;
                    match reserved(&a) {
                        Some(r) => {
                            prop_assert!(after >= 0, "admission went negative: {before} -> {after}");
                            prop_assert_eq!(after, before - r as i64 * 1000);
                            pending.push(r);
                        }
                        None => prop_assert_eq!(after, before),
                    }
                    prop_assert!(after <= burst as i64 * 1000);
                }
                Op::Settle { actual, dt } => {
                    now += dt;
                    if let Some(r) = pending.pop() {
                        reconcile(&store, "t", &p, r, actual, now).unwrap();
                        prop_assert!(peek(&store, "t", &p, now).level_milli <= burst as i64 * 1000);
                    }
                }
            }
        }
    }
}
