//! Checks the presets against the published figures they were fitted to, in simulated time
//! (pure model, no clock): Llama-3.1-8B, 128 input / 128 output tokens, closed loop.

use ai_lb_fake_pod::config::Preset;
use ai_lb_fake_pod::fit::closed_loop;
use ai_lb_fake_pod::model::EngineParams;

fn params(preset: Preset) -> EngineParams {
    let s = preset.spec();
    EngineParams {
        a: s.a,
        b: s.b,
        p: s.p,
        overhead: s.overhead,
        max_num_seqs: s.max_num_seqs as usize,
        kv_cache_tokens: s.kv_cache_tokens,
        max_batched_tokens: s.max_batched_tokens,
        time_scale: 1.0,
        cache: Default::default(),
    }
}

/// Relative tolerance of the fit (documented in README.md).
const TOL: f64 = 0.15;

fn within(got: f64, target: f64) -> bool {
    (got - target).abs() <= TOL * target
}

#[test]
fn h100_preset_matches_published_figures() {
    let c1 = closed_loop(params(Preset::H100_8b), 1, 5, 128, 128);
    let c100 = closed_loop(params(Preset::H100_8b), 100, 5, 128, 128);
    println!(
        "h100-8b c=1: TTFT {:.1} ms ITL {:.2} ms | c=100: TTFT {:.1} ms ITL {:.2} ms",
        c1.ttft * 1e3,
        c1.itl * 1e3,
        c100.ttft * 1e3,
        c100.itl * 1e3
    );
    assert_eq!(c100.requests, 500);
    assert!(within(c1.ttft, 0.010), "TTFT c=1 {}", c1.ttft);
    assert!(within(c1.itl, 0.0046), "ITL c=1 {}", c1.itl);
    assert!(within(c100.ttft, 0.120), "TTFT c=100 {}", c100.ttft);
    assert!(within(c100.itl, 0.0076), "ITL c=100 {}", c100.itl);
}

#[test]
fn a100_preset_is_slower_by_the_documented_ratio() {
    let h = closed_loop(params(Preset::H100_8b), 100, 5, 128, 128);
    let a = closed_loop(params(Preset::A100_8b), 100, 5, 128, 128);
    let a1 = closed_loop(params(Preset::A100_8b), 1, 5, 128, 128);
    println!(
        "a100-8b c=1: TTFT {:.1} ms ITL {:.2} ms | c=100: TTFT {:.1} ms ITL {:.2} ms",
        a1.ttft * 1e3,
        a1.itl * 1e3,
        a.ttft * 1e3,
        a.itl * 1e3
    );
    let itl_ratio = a.itl / h.itl;
    assert!((1.5..=2.0).contains(&itl_ratio), "ITL ratio {itl_ratio}");
    assert!(a.ttft > 1.8 * h.ttft, "TTFT {} vs {}", a.ttft, h.ttft);
}

#[test]
fn l40s_preset_decodes_slowest_and_prefills_between_h100_and_a100() {
    let h = closed_loop(params(Preset::H100_8b), 100, 5, 128, 128);
    let a = closed_loop(params(Preset::A100_8b), 100, 5, 128, 128);
    let l = closed_loop(params(Preset::L40s_8b), 100, 5, 128, 128);
    let l1 = closed_loop(params(Preset::L40s_8b), 1, 5, 128, 128);
    println!(
        "l40s-8b c=1: TTFT {:.1} ms ITL {:.2} ms | c=100: TTFT {:.1} ms ITL {:.2} ms",
        l1.ttft * 1e3,
        l1.itl * 1e3,
        l.ttft * 1e3,
        l.itl * 1e3
    );
    let itl_ratio = l.itl / h.itl;
    assert!((3.5..=4.2).contains(&itl_ratio), "ITL ratio {itl_ratio}");
    assert!(l.itl > a.itl, "{} vs {}", l.itl, a.itl);
    assert!(!Preset::L40s_8b.spec().gpm, "Ada has no GPM");
}
