//! Decides what the simulated GPUs report on `/sim/gpu` (the agent's `sim` source): NVML's
//! utilisation (the fraction of the window in which any batch step ran, as
//! `nvmlDeviceGetUtilizationRates` defines `gpu`), GPM-style activity fields on Hopper-class
//! presets (modelled from each step's batch), memory, temperature, power, and the injected
//! Xid/ECC faults, in the exact JSON shape the agent reads.

use clap::ValueEnum;
use serde::Serialize;

use crate::config::PresetSpec;
use crate::faults::Faults;
use crate::model::{Engine, EngineParams, StepShape};

/// NVML `nvmlClocksThrottleReasonHwSlowdown`, reported while a slowdown fault is active.
pub const THROTTLE_HW_SLOWDOWN: u64 = 0x8;
/// Fraction of total memory vLLM preallocates (`--gpu-memory-utilization` default 0.9).
pub const MEMORY_USED_FRACTION: f64 = 0.9;

/// Body of `GET /sim/gpu`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimGpuReport {
    pub gpus: Vec<SimGpu>,
}

/// One simulated GPU.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimGpu {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub utilization: f64,
    /// GPM fields, 0..1 over the same window; `null` where the GPU has no GPM (pre-Hopper).
    pub sm_occupancy: Option<f64>,
    pub sm_utilization: Option<f64>,
    pub tensor_activity: Option<f64>,
    pub dram_activity: Option<f64>,
    pub memory_used_bytes: u64,
    pub memory_total_bytes: u64,
    pub temperature_celsius: f64,
    pub power_watts: f64,
    pub power_limit_watts: f64,
    pub throttle_reasons: u64,
    pub ecc_uncorrected_errors: u64,
    pub xid_errors: u64,
    pub last_xid: Option<u32>,
}

/// How `utilization` is computed (`--gpu-util-model`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum GpuUtilModel {
    /// NVML's meaning: the fraction of the window in which any batch step ran (~1 as soon as
    /// one sequence decodes).
    #[default]
    Nvml,
    /// The former graded signal `busy × (0.5 + 0.5 × occupancy)`, which no real GPU reports;
    /// kept for comparisons.
    Graded,
}

/// The graded utilisation (0..1) from the busy fraction and mean batch occupancy
/// (running / max_num_seqs): `busy × (0.5 + 0.5 × occupancy)`. Real NVML utilisation is the
/// busy fraction alone; this keeps a gradient under load that no GPU reports. It is
/// `--gpu-util-model graded`, and it always drives the simulated temperature and power (as it
/// did before NVML's meaning became the default), so those stay graded with load.
pub fn utilization(busy_fraction: f64, occupancy: f64) -> f64 {
    let b = busy_fraction.clamp(0.0, 1.0);
    let o = occupancy.clamp(0.0, 1.0);
    (b * (0.5 + 0.5 * o)).clamp(0.0, 1.0)
}

/// GPM-style activity of one batch step, each 0..1 (see README.md, "GPU signals").
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Gpm {
    pub sm_occupancy: f64,
    pub sm_utilization: f64,
    pub tensor_activity: f64,
    pub dram_activity: f64,
}

/// Tokens in flight (decodes + prefill tokens) at which SM occupancy reaches half its ceiling.
pub const OCCUPANCY_HALF_TOKENS: f64 = 256.0;
/// Resident warps of any running kernel (floor) and the ceiling LLM GEMM kernels reach (large
/// tiles, many registers per thread: rarely above ~50 % of the maximum warps).
pub const OCCUPANCY_FLOOR: f64 = 0.04;
pub const OCCUPANCY_CEIL: f64 = 0.5;
/// SM activity of a batch-1 decode step (GEMV kernels leave SMs idle between launches and in
/// the tails) and the tokens in flight at which every SM is kept busy.
pub const SM_ACTIVE_BATCH1: f64 = 0.6;
pub const SM_ACTIVE_FULL_TOKENS: f64 = 64.0;
/// SM activity ceiling of a saturated step (launch gaps, synchronisation).
pub const SM_ACTIVE_CEIL: f64 = 0.95;
/// Share of its compute-bound time in which the tensor pipe is actually issuing (attention
/// softmax, norms, activations and epilogues run on the other pipes).
pub const TENSOR_SHARE: f64 = 0.7;
/// Achieved fraction of peak DRAM bandwidth while a step is memory bound.
pub const DRAM_SHARE: f64 = 0.85;

/// The GPM activity of one step with `decodes` decoding sequences and `prefill_tokens`
/// prompt tokens, from the step-time model `a + b·D + p·P` of `e`:
/// - `sm_occupancy` = floor + (ceil − floor) · x / (x + 256), x = D + P (tokens in flight);
/// - `sm_utilization` = 0.95 · (0.6 + 0.4 · min(1, x / 64));
/// - `tensor_activity` = 0.7 · min(1, p·(P + D) / T): the time the tensor pipe needs for the
///   step's tokens at the fitted per-token compute cost p, over the step time T;
/// - `dram_activity` = 0.85 · (a + b·D) / T: the memory-bound share of the step (weights
///   streamed once, each decoding sequence's KV read).
pub fn step_gpm(e: &EngineParams, step: &StepShape) -> Gpm {
    let d = f64::from(step.decodes);
    let p = f64::from(step.prefill_tokens);
    let x = d + p;
    let memory = e.a + e.b * d;
    let t = memory + e.p * p;
    let (tensor, dram) = if t > 0.0 {
        (
            TENSOR_SHARE * (e.p * x / t).min(1.0),
            DRAM_SHARE * (memory / t).min(1.0),
        )
    } else {
        (0.0, 0.0)
    };
    Gpm {
        sm_occupancy: OCCUPANCY_FLOOR
            + (OCCUPANCY_CEIL - OCCUPANCY_FLOOR) * x / (x + OCCUPANCY_HALF_TOKENS),
        sm_utilization: SM_ACTIVE_CEIL
            * (SM_ACTIVE_BATCH1 + (1.0 - SM_ACTIVE_BATCH1) * (x / SM_ACTIVE_FULL_TOKENS).min(1.0)),
        tensor_activity: tensor,
        dram_activity: dram,
    }
}

/// What the engine's last window looks like to the GPU: every value 0..1, idle time 0.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WindowSignals {
    /// Fraction of the window in which a step ran (NVML `utilization.gpu`).
    pub busy: f64,
    /// The graded utilisation ([`utilization`]).
    pub graded: f64,
    /// GPM fields averaged over the window.
    pub gpm: Gpm,
}

impl WindowSignals {
    /// The signals of `engine` over `[now - UTILIZATION_WINDOW_S, now]`, in one pass.
    pub fn of(engine: &mut Engine, now: f64) -> Self {
        let e = engine.params().clone();
        let (mut busy, mut occ) = (0.0, 0.0);
        let mut g = Gpm {
            sm_occupancy: 0.0,
            sm_utilization: 0.0,
            tensor_activity: 0.0,
            dram_activity: 0.0,
        };
        for (w, step) in engine.window(now) {
            let s = step_gpm(&e, &step);
            busy += w;
            occ += w * step.occupancy;
            g.sm_occupancy += w * s.sm_occupancy;
            g.sm_utilization += w * s.sm_utilization;
            g.tensor_activity += w * s.tensor_activity;
            g.dram_activity += w * s.dram_activity;
        }
        let unit = |v: f64| v.clamp(0.0, 1.0);
        let occupancy = if busy > 0.0 { unit(occ / busy) } else { 0.0 };
        Self {
            busy: unit(busy),
            graded: utilization(busy, occupancy),
            gpm: Gpm {
                sm_occupancy: unit(g.sm_occupancy),
                sm_utilization: unit(g.sm_utilization),
                tensor_activity: unit(g.tensor_activity),
                dram_activity: unit(g.dram_activity),
            },
        }
    }

    /// The `utilization` field under `model`.
    pub fn utilization(&self, model: GpuUtilModel) -> f64 {
        match model {
            GpuUtilModel::Nvml => self.busy,
            GpuUtilModel::Graded => self.graded,
        }
    }
}

/// A stable NVML-style UUID derived from the pod name and GPU index.
pub fn gpu_uuid(pod_name: &str, index: u32) -> String {
    let hi = fnv1a(format!("{pod_name}/{index}").as_bytes());
    let lo = fnv1a(format!("{index}\u{0}{pod_name}").as_bytes());
    format!(
        "GPU-{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        hi >> 32,
        (hi >> 16) & 0xffff,
        hi & 0xffff,
        lo >> 48,
        lo & 0xffff_ffff_ffff
    )
}

/// 64-bit FNV-1a.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Builds the report for `num_gpus` GPUs of a tensor-parallel group (all equally loaded;
/// injected Xid/ECC faults land on GPU 0). The `gpu_utilization` fault forces `utilization`
/// (and temperature and power, which otherwise follow the graded load), the `sm_occupancy`
/// fault forces SM occupancy; GPM fields are reported only where the preset's GPU has GPM
/// (Hopper and later).
pub fn report(
    spec: &PresetSpec,
    pod_name: &str,
    num_gpus: u32,
    signals: &WindowSignals,
    model: GpuUtilModel,
    faults: &Faults,
) -> SimGpuReport {
    let util = faults
        .gpu_utilization
        .unwrap_or(signals.utilization(model))
        .clamp(0.0, 1.0);
    let load = faults
        .gpu_utilization
        .unwrap_or(signals.graded)
        .clamp(0.0, 1.0);
    let gpm = spec.gpm.then_some(signals.gpm).map(|mut g| {
        if let Some(o) = faults.sm_occupancy {
            g.sm_occupancy = o.clamp(0.0, 1.0);
        }
        g
    });
    let gpus = (0..num_gpus)
        .map(|index| SimGpu {
            index,
            uuid: gpu_uuid(pod_name, index),
            name: spec.gpu_name.to_string(),
            utilization: util,
            sm_occupancy: gpm.map(|g| g.sm_occupancy),
            sm_utilization: gpm.map(|g| g.sm_utilization),
            tensor_activity: gpm.map(|g| g.tensor_activity),
            dram_activity: gpm.map(|g| g.dram_activity),
            memory_used_bytes: (spec.memory_total_bytes as f64 * MEMORY_USED_FRACTION) as u64,
            memory_total_bytes: spec.memory_total_bytes,
            temperature_celsius: 30.0 + 45.0 * load,
            power_watts: spec.idle_power_watts
                + (spec.power_limit_watts - spec.idle_power_watts) * load,
            power_limit_watts: spec.power_limit_watts,
            throttle_reasons: if faults.throttle.unwrap_or(faults.slowdown > 1.0) {
                THROTTLE_HW_SLOWDOWN
            } else {
                0
            },
            ecc_uncorrected_errors: if index == 0 { faults.ecc_errors } else { 0 },
            xid_errors: if index == 0 { faults.xid_errors } else { 0 },
            last_xid: if index == 0 { faults.last_xid } else { None },
        })
        .collect();
    SimGpuReport { gpus }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Preset;
    use crate::model::NewRequest;

    /// An engine of `preset` with `n` sequences decoding (10-token prompts, 1000-token
    /// outputs, so 200 fit in the KV cache), advanced to `t` seconds of simulated time.
    fn decoding(preset: Preset, n: u64, t: f64) -> (Engine, WindowSignals) {
        let mut e = Engine::new(preset.spec().engine(1.0));
        for id in 0..n {
            let r = NewRequest {
                id,
                prompt_tokens: 10,
                max_tokens: 1000,
                token_ids: Vec::new(),
            };
            e.submit(r, 0.0).unwrap();
        }
        let mut out = Vec::new();
        e.advance_to(t, &mut out);
        let s = WindowSignals::of(&mut e, t);
        (e, s)
    }

    #[test]
    fn one_decoding_sequence_saturates_nvml_utilization_but_not_occupancy() {
        let (_, one) = decoding(Preset::H100_8b, 1, 3.0);
        assert!(one.busy > 0.99, "{one:?}");
        assert!(one.utilization(GpuUtilModel::Nvml) > 0.99);
        assert!(one.gpm.sm_occupancy < 0.06, "{one:?}");
        // batch-1 decode is memory bound: DRAM busy, tensor pipe nearly idle
        assert!(one.gpm.dram_activity > 0.8, "{one:?}");
        assert!(one.gpm.tensor_activity < 0.01, "{one:?}");
        assert!(one.gpm.sm_utilization < 0.65, "{one:?}");
    }

    #[test]
    fn two_hundred_sequences_read_the_same_utilization_and_much_higher_occupancy() {
        let (_, one) = decoding(Preset::H100_8b, 1, 3.0);
        let (_, many) = decoding(Preset::H100_8b, 200, 3.0);
        assert!(many.busy > 0.99, "{many:?}");
        assert!(
            many.gpm.sm_occupancy > 4.0 * one.gpm.sm_occupancy,
            "{many:?} {one:?}"
        );
        assert!(
            many.gpm.sm_utilization > one.gpm.sm_utilization + 0.3,
            "{many:?}"
        );
        assert!(
            many.gpm.tensor_activity > 20.0 * one.gpm.tensor_activity,
            "{many:?}"
        );
        for v in [
            many.gpm.sm_occupancy,
            many.gpm.sm_utilization,
            many.gpm.tensor_activity,
            many.gpm.dram_activity,
        ] {
            assert!((0.0..=1.0).contains(&v), "{many:?}");
        }
    }

    #[test]
    fn idle_reads_zero() {
        let (mut e, _) = decoding(Preset::H100_8b, 0, 3.0);
        let s = WindowSignals::of(&mut e, 3.0);
        assert_eq!(s.busy, 0.0);
        assert_eq!(s.graded, 0.0);
        assert_eq!(
            s.gpm,
            Gpm {
                sm_occupancy: 0.0,
                sm_utilization: 0.0,
                tensor_activity: 0.0,
                dram_activity: 0.0
            }
        );
        // a short burst long ago is out of the window
        let (mut e, _) = decoding(Preset::H100_8b, 1, 0.0);
        assert!(e.abort(0));
        let mut out = Vec::new();
        e.advance_to(10.0, &mut out);
        assert_eq!(WindowSignals::of(&mut e, 10.0).busy, 0.0);
    }

    #[test]
    fn prefill_heavy_steps_raise_tensor_decode_heavy_steps_raise_dram() {
        let e = Preset::H100_8b.spec().engine(1.0);
        let shape = |decodes, prefill_tokens| StepShape {
            decodes,
            prefill_tokens,
            occupancy: 0.5,
        };
        let prefill = step_gpm(&e, &shape(0, 8192));
        let decode = step_gpm(&e, &shape(128, 0));
        assert!(prefill.tensor_activity > 0.6, "{prefill:?}");
        assert!(prefill.tensor_activity > 2.0 * decode.tensor_activity);
        assert!(decode.dram_activity > 0.8, "{decode:?}");
        assert!(decode.dram_activity > 5.0 * prefill.dram_activity);
        assert!(prefill.sm_occupancy > decode.sm_occupancy);
    }

    #[test]
    fn graded_option_reproduces_the_former_formula() {
        let (e, one) = decoding(Preset::H100_8b, 1, 3.0);
        let occ = 1.0 / e.params().max_num_seqs as f64;
        let former = one.busy * (0.5 + 0.5 * occ);
        assert!((one.utilization(GpuUtilModel::Graded) - former).abs() < 1e-9);
        let (e, many) = decoding(Preset::H100_8b, 200, 3.0);
        let occ = 200.0 / e.params().max_num_seqs as f64;
        let former = many.busy * (0.5 + 0.5 * occ);
        assert!((many.utilization(GpuUtilModel::Graded) - former).abs() < 1e-9);
        assert!(many.utilization(GpuUtilModel::Graded) > one.utilization(GpuUtilModel::Graded));
    }

    #[test]
    fn gpm_fields_are_null_on_a100_and_numbers_on_h100() {
        let faults = Faults::default();
        let (_, sig) = decoding(Preset::A100_8b, 4, 3.0);
        let a100 = report(
            &Preset::A100_8b.spec(),
            "p",
            1,
            &sig,
            GpuUtilModel::Nvml,
            &faults,
        );
        let v = serde_json::to_value(&a100).unwrap();
        for f in [
            "sm_occupancy",
            "sm_utilization",
            "tensor_activity",
            "dram_activity",
        ] {
            assert_eq!(v["gpus"][0][f], serde_json::Value::Null, "{f}");
        }
        assert!(v["gpus"][0]["utilization"].as_f64().unwrap() > 0.99);
        let (_, sig) = decoding(Preset::H100_8b, 4, 3.0);
        let h100 = report(
            &Preset::H100_8b.spec(),
            "p",
            1,
            &sig,
            GpuUtilModel::Nvml,
            &faults,
        );
        let v = serde_json::to_value(&h100).unwrap();
        for f in [
            "sm_occupancy",
            "sm_utilization",
            "tensor_activity",
            "dram_activity",
        ] {
            assert!(v["gpus"][0][f].as_f64().unwrap() > 0.0, "{f}");
        }
    }

    #[test]
    fn utilization_grows_with_busy_and_occupancy() {
        assert_eq!(utilization(0.0, 1.0), 0.0);
        assert_eq!(utilization(1.0, 0.0), 0.5);
        assert_eq!(utilization(1.0, 1.0), 1.0);
        assert!(utilization(1.0, 0.4) > utilization(1.0, 0.1));
        assert_eq!(utilization(2.0, f64::NAN.max(0.0)), 0.5);
    }

    #[test]
    fn uuid_is_stable_and_distinct() {
        let a = gpu_uuid("pod-a", 0);
        assert_eq!(a, gpu_uuid("pod-a", 0));
        assert_ne!(a, gpu_uuid("pod-a", 1));
        assert_ne!(a, gpu_uuid("pod-b", 0));
        assert!(a.starts_with("GPU-") && a.len() == 40, "{a}");
    }

    #[test]
    fn report_has_the_agreed_shape() {
        let spec = Preset::H100_8b.spec();
        let faults = Faults {
            gpu_utilization: Some(0.42),
            xid_errors: 1,
            last_xid: Some(79),
            ..Faults::default()
        };
        let (_, sig) = decoding(Preset::H100_8b, 1, 1.0);
        let r = report(&spec, "pod", 2, &sig, GpuUtilModel::Nvml, &faults);
        let v = serde_json::to_value(&r).unwrap();
        let g0 = &v["gpus"][0];
        let mut keys: Vec<_> = g0.as_object().unwrap().keys().cloned().collect();
        keys.sort();
        assert_eq!(
            keys,
            [
                "dram_activity",
                "ecc_uncorrected_errors",
                "index",
                "last_xid",
                "memory_total_bytes",
                "memory_used_bytes",
                "name",
                "power_limit_watts",
                "power_watts",
                "sm_occupancy",
                "sm_utilization",
                "temperature_celsius",
                "tensor_activity",
                "throttle_reasons",
                "utilization",
                "uuid",
                "xid_errors"
            ]
        );
        assert_eq!(g0["utilization"], 0.42);
        assert_eq!(g0["last_xid"], 79);
        assert_eq!(v["gpus"][1]["last_xid"], serde_json::Value::Null);
        assert_eq!(v["gpus"][1]["index"], 1);
        assert_eq!(g0["name"], "NVIDIA H100 80GB HBM3 (simulated)");
    }

    #[test]
    fn the_sm_occupancy_fault_forces_occupancy_only() {
        let spec = Preset::H100_8b.spec();
        let faults = Faults {
            sm_occupancy: Some(0.97),
            ..Faults::default()
        };
        let (_, sig) = decoding(Preset::H100_8b, 1, 1.0);
        let free = report(
            &spec,
            "pod",
            1,
            &sig,
            GpuUtilModel::Nvml,
            &Faults::default(),
        );
        let r = report(&spec, "pod", 1, &sig, GpuUtilModel::Nvml, &faults);
        assert_eq!(r.gpus[0].sm_occupancy, Some(0.97));
        assert_ne!(free.gpus[0].sm_occupancy, Some(0.97));
        assert_eq!(r.gpus[0].utilization, free.gpus[0].utilization);
        assert_eq!(r.gpus[0].dram_activity, free.gpus[0].dram_activity);
    }
}
