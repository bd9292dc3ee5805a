//! The nvml source over a fake `GpuBackend`: visible-devices filtering, NotSupported → absent,
//! failed queries → rejected, unit conversion, Xid counting, GPM activity (supported, not
//! supported, garbage, recomputed once per interval).

use ai_lb_agent::sources::nvml::{
    DeviceReading, Field, GpmReading, GpuBackend, NvmlSource, VisibleEnv, XidEvent,
};
use ai_lb_agent::sources::{Source, SourceError};
use ai_lb_proto::v1::GpuActivitySource;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const GPM_INTERVAL: Duration = Duration::from_millis(100);

fn open(f: Fake, e: &VisibleEnv) -> Result<NvmlSource, SourceError> {
    NvmlSource::new(Box::new(f), e, GPM_INTERVAL)
}

#[derive(Clone)]
struct FakeGpu {
    uuid: String,
    reading: DeviceReading,
    xid_supported: bool,
    /// Successive GPM readings, one per `gpm` call after the first (None: no GPM).
    gpm: Option<Vec<GpmReading>>,
}

#[derive(Clone, Default)]
struct Fake {
    gpus: Vec<FakeGpu>,
    /// `gpm` calls per device, shared with the test.
    gpm_calls: Arc<Mutex<Vec<u32>>>,
    /// Events the test queues; drained by `poll_xid`.
    events: Arc<Mutex<Vec<XidEvent>>>,
    fail_read: bool,
}

impl GpuBackend for Fake {
    fn device_count(&mut self) -> Result<u32, String> {
        Ok(self.gpus.len() as u32)
    }
    fn device_uuid(&mut self, index: u32) -> Result<String, String> {
        Ok(self.gpus[index as usize].uuid.clone())
    }
    fn read(&mut self, index: u32) -> Result<DeviceReading, String> {
        if self.fail_read {
            return Err("GPU is lost".into());
        }
        Ok(self.gpus[index as usize].reading.clone())
    }
    fn watch_xid(&mut self, index: u32) -> bool {
        self.gpus[index as usize].xid_supported
    }
    fn poll_xid(&mut self) -> Vec<XidEvent> {
        std::mem::take(&mut *self.events.lock().unwrap())
    }
    fn gpm(&mut self, index: u32) -> Option<Field<GpmReading>> {
        let mut calls = self.gpm_calls.lock().unwrap();
        calls.push(index);
        let n = calls.iter().filter(|&&i| i == index).count();
        match &self.gpus[index as usize].gpm {
            None => Some(Field::NotSupported),
            // The first sample only starts an interval.
            Some(_) if n == 1 => None,
            Some(list) => Some(Field::Value(list[(n - 2).min(list.len() - 1)].clone())),
        }
    }
}

fn gpm(occ: f64, sm: f64, tensor: f64, dram: f64) -> GpmReading {
    GpmReading {
        sm_occupancy_percent: Field::Value(occ),
        sm_util_percent: Field::Value(sm),
        tensor_percent: Field::Value(tensor),
        dram_bw_percent: Field::Value(dram),
    }
}

fn full_reading() -> DeviceReading {
    DeviceReading {
        name: Field::Value("NVIDIA H200".into()),
        utilization_percent: Field::Value(87),
        memory_bytes: Field::Value((60 << 30, 141 << 30)),
        temperature_celsius: Field::Value(61),
        power_milliwatts: Field::Value(512_345),
        power_limit_milliwatts: Field::Value(700_000),
        throttle_reasons: Field::Value(0x4),
        ecc_uncorrected_volatile: Field::Value(0),
    }
}

fn fake(n: usize) -> Fake {
    Fake {
        gpus: (0..n)
            .map(|i| FakeGpu {
                uuid: format!("GPU-{i}{i}{i}{i}-aaaa"),
                reading: full_reading(),
                xid_supported: true,
                gpm: None,
            })
            .collect(),
        ..Default::default()
    }
}

fn env(nv: Option<&str>, cuda: Option<&str>) -> VisibleEnv {
    VisibleEnv {
        nvidia_visible_devices: nv.map(str::to_string),
        cuda_visible_devices: cuda.map(str::to_string),
    }
}

#[tokio::test]
async fn reads_and_converts_units() {
    let mut s = open(fake(1), &env(None, None)).unwrap();
    let r = s.sample(Instant::now()).await.unwrap();
    assert!(r.rejected.is_empty());
    let g = &r.gpus.unwrap()[0];
    assert_eq!(g.name, "NVIDIA H200");
    assert_eq!(g.uuid, "GPU-0000-aaaa");
    assert_eq!(g.utilization, Some(0.87));
    assert_eq!(g.memory_used_bytes, Some(60 << 30));
    assert_eq!(g.memory_total_bytes, Some(141 << 30));
    assert_eq!(g.temperature_celsius, Some(61.0));
    assert_eq!(g.power_watts, Some(512.345));
    assert_eq!(g.power_limit_watts, Some(700.0));
    assert_eq!(g.throttle_reasons, Some(4));
    assert_eq!(g.throttle_reason_names, vec!["SwPowerCap".to_string()]);
    assert_eq!(g.ecc_uncorrected_errors, Some(0));
    assert_eq!((g.xid_errors, g.last_xid), (Some(0), None));
}

#[tokio::test]
async fn not_supported_is_absent_never_zero() {
    let mut f = fake(1);
    f.gpus[0].reading = DeviceReading {
        name: Field::Value("Tesla T4".into()),
        utilization_percent: Field::NotSupported,
        memory_bytes: Field::Value((1, 2)),
        temperature_celsius: Field::Value(40),
        power_milliwatts: Field::NotSupported,
        power_limit_milliwatts: Field::NotSupported,
        throttle_reasons: Field::NotSupported,
        ecc_uncorrected_volatile: Field::Failed("Unknown error".into()),
    };
    f.gpus[0].xid_supported = false;
    let mut s = open(f, &env(None, None)).unwrap();
    let r = s.sample(Instant::now()).await.unwrap();
    let g = &r.gpus.unwrap()[0];
    assert_eq!(g.utilization, None);
    assert_eq!(g.power_watts, None);
    assert_eq!(g.throttle_reasons, None);
    assert!(g.throttle_reason_names.is_empty());
    assert_eq!(g.ecc_uncorrected_errors, None);
    assert_eq!(g.xid_errors, None, "no event support: absent, not 0");
    // NotSupported is silent; a failed query is reported.
    assert_eq!(r.rejected.len(), 1);
    assert_eq!(r.rejected[0].field, "gpu[0].ecc_uncorrected_errors");
}

#[tokio::test]
async fn impossible_values_are_rejected() {
    let mut f = fake(1);
    f.gpus[0].reading.utilization_percent = Field::Value(250);
    f.gpus[0].reading.memory_bytes = Field::Value((10, 5));
    let mut s = open(f, &env(None, None)).unwrap();
    let r = s.sample(Instant::now()).await.unwrap();
    let g = &r.gpus.unwrap()[0];
    assert_eq!(g.utilization, None);
    assert_eq!((g.memory_used_bytes, g.memory_total_bytes), (None, Some(5)));
    assert_eq!(r.rejected.len(), 2, "{:?}", r.rejected);
}

#[test]
fn visible_devices_filtering() {
    let pick = |e: VisibleEnv| -> Vec<u32> {
        open(fake(4), &e)
            .unwrap()
            .devices()
            .into_iter()
            .map(|d| d.0)
            .collect()
    };
    assert_eq!(pick(env(None, None)), vec![0, 1, 2, 3]);
    assert_eq!(pick(env(Some("all"), None)), vec![0, 1, 2, 3]);
    assert_eq!(pick(env(Some("none"), None)), Vec::<u32>::new());
    assert_eq!(pick(env(Some("void"), None)), Vec::<u32>::new());
    assert_eq!(pick(env(Some("3,1"), None)), vec![1, 3]);
    assert_eq!(pick(env(Some("GPU-2222-aaaa"), None)), vec![2]);
    assert_eq!(pick(env(Some("GPU-2222"), None)), vec![2], "UUID prefix");
    assert_eq!(pick(env(Some("all"), Some("0,2"))), vec![0, 2]);
    assert_eq!(pick(env(Some("1,2,3"), Some("2"))), vec![3]);
    let e = open(fake(2), &env(Some("first"), None)).unwrap_err();
    assert!(
        e.to_string().contains("NVIDIA_VISIBLE_DEVICES") && e.to_string().contains("first"),
        "{e}"
    );
}

#[tokio::test]
async fn xid_events_are_counted_per_gpu() {
    let f = fake(2);
    let events = f.events.clone();
    let mut s = open(f, &env(Some("1"), None)).unwrap();
    events.lock().unwrap().extend([
        XidEvent {
            uuid: "GPU-1111-aaaa".into(),
            xid: Some(79),
        },
        XidEvent {
            uuid: "GPU-0000-aaaa".into(),
            xid: Some(48),
        },
        XidEvent {
            uuid: "GPU-1111-aaaa".into(),
            xid: Some(94),
        },
    ]);
    let r = s.sample(Instant::now()).await.unwrap();
    let g = r.gpus.unwrap();
    assert_eq!(g.len(), 1, "GPU 0 is not visible");
    assert_eq!((g[0].xid_errors, g[0].last_xid), (Some(2), Some(94)));
    // Counts accumulate since start; an unknown Xid code counts but keeps the last code.
    events.lock().unwrap().push(XidEvent {
        uuid: "GPU-1111-aaaa".into(),
        xid: None,
    });
    let g = s.sample(Instant::now()).await.unwrap().gpus.unwrap();
    assert_eq!((g[0].xid_errors, g[0].last_xid), (Some(3), Some(94)));
}

#[tokio::test]
async fn device_read_failure_fails_the_sample() {
    let mut f = fake(1);
    f.fail_read = true;
    let mut s = open(f, &env(None, None)).unwrap();
    match s.sample(Instant::now()).await {
        Err(SourceError::Other { detail, .. }) => assert!(detail.contains("GPU is lost")),
        other => panic!("expected an error, got {other:?}"),
    }
}

#[test]
fn missing_nvml_library_is_a_clear_constructor_error() {
    // On a host with a driver this opens NVML; everywhere else it must say what to do.
    if let Err(e) = NvmlSource::open(&env(None, None), GPM_INTERVAL) {
        let msg = e.to_string();
        assert!(
            msg.contains("NVML") && msg.contains("--gpu-source sim or none"),
            "{msg}"
        );
    }
}

#[tokio::test]
async fn gpm_activity_needs_two_samples_then_is_reported_as_fractions() {
    let mut f = fake(1);
    f.gpus[0].gpm = Some(vec![
        gpm(12.5, 80.0, 30.0, 65.0),
        gpm(40.0, 95.0, 50.0, 90.0),
    ]);
    let calls = f.gpm_calls.clone();
    let mut s = open(f, &env(None, None)).unwrap();
    let t0 = Instant::now();
    let g = &s.sample(t0).await.unwrap().gpus.unwrap()[0];
    // One sample is not an interval: absent, not zero.
    assert_eq!(g.sm_occupancy, None);
    assert_eq!(g.activity_source, GpuActivitySource::Unspecified as i32);
    let r = s.sample(t0 + GPM_INTERVAL).await.unwrap();
    assert!(r.rejected.is_empty(), "{:?}", r.rejected);
    let g = &r.gpus.unwrap()[0];
    assert_eq!(g.sm_occupancy, Some(0.125));
    assert_eq!(g.sm_utilization, Some(0.8));
    assert_eq!(g.tensor_activity, Some(0.3));
    assert_eq!(g.dram_activity, Some(0.65));
    assert_eq!(g.activity_source, GpuActivitySource::Gpm as i32);
    // Within the interval the last values are reported without a new GPM sample.
    let g = &s
        .sample(t0 + GPM_INTERVAL + Duration::from_millis(20))
        .await
        .unwrap()
        .gpus
        .unwrap()[0];
    assert_eq!(g.sm_occupancy, Some(0.125));
    assert_eq!(calls.lock().unwrap().len(), 2);
    let g = &s.sample(t0 + 2 * GPM_INTERVAL).await.unwrap().gpus.unwrap()[0];
    assert_eq!(g.sm_occupancy, Some(0.4));
    assert_eq!(calls.lock().unwrap().len(), 3);
}

#[tokio::test]
async fn a_gpu_without_gpm_reports_no_activity_and_is_not_asked_again() {
    let f = fake(1);
    let calls = f.gpm_calls.clone();
    let mut s = open(f, &env(None, None)).unwrap();
    let t0 = Instant::now();
    for k in 0..4 {
        let r = s.sample(t0 + k * GPM_INTERVAL).await.unwrap();
        assert!(r.rejected.is_empty());
        let g = &r.gpus.unwrap()[0];
        assert_eq!(
            (
                g.sm_occupancy,
                g.sm_utilization,
                g.tensor_activity,
                g.dram_activity
            ),
            (None, None, None, None)
        );
        assert_eq!(g.activity_source, GpuActivitySource::Unspecified as i32);
        // The time-fraction reading is still there.
        assert_eq!(g.utilization, Some(0.87));
    }
    assert_eq!(calls.lock().unwrap().len(), 1, "NotSupported is asked once");
}

#[tokio::test]
async fn garbage_gpm_values_are_rejected_one_by_one() {
    let mut f = fake(1);
    f.gpus[0].gpm = Some(vec![GpmReading {
        sm_occupancy_percent: Field::Value(f64::NAN),
        sm_util_percent: Field::Value(140.0),
        tensor_percent: Field::Failed("Unknown error".into()),
        dram_bw_percent: Field::Value(55.0),
    }]);
    let mut s = open(f, &env(None, None)).unwrap();
    let t0 = Instant::now();
    s.sample(t0).await.unwrap();
    let r = s.sample(t0 + GPM_INTERVAL).await.unwrap();
    let g = &r.gpus.as_ref().unwrap()[0];
    assert_eq!(
        (g.sm_occupancy, g.sm_utilization, g.tensor_activity),
        (None, None, None)
    );
    assert_eq!(g.dram_activity, Some(0.55));
    let fields: Vec<&str> = r.rejected.iter().map(|r| r.field.as_str()).collect();
    assert_eq!(
        fields,
        vec![
            "gpu[0].sm_occupancy",
            "gpu[0].sm_utilization",
            "gpu[0].tensor_activity"
        ]
    );
}
