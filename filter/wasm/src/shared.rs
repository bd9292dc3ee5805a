//! Decides nothing: the layout of proxy-wasm shared data (one namespace per `vm_id`, seen by
//! every VM of the Envoy process) and the compare-and-swap loops over it.
//!
//! Keys: `ai_lb.<pool>.lease` (who subscribes), `ai_lb.<pool>.state` (the encoded pool state)
//! and `ai_lb.<pool>.version` (bumped after every publish, so workers only copy the state when
//! it changed), `ai_lb.<pool>.breaker.<pod>` (the pod's circuit breaker, 32 bytes) and
//! `ai_lb.<pool>.breakers` (bumped after every breaker write, see [`crate::breakers`]).

use std::hash::{BuildHasher, Hasher};

use proxy_wasm::types::Status;

use ai_lb_filter_core::breaker::{update_shared, Breaker, Transition};
use ai_lb_filter_core::config::BreakerConfig;

use crate::host;
use crate::lease::{self, Lease, LeaseStep};

const CAS_RETRIES: usize = 16;

pub fn lease_key(pool: &str) -> String {
    format!("ai_lb.{pool}.lease")
}

pub fn state_key(pool: &str) -> String {
    format!("ai_lb.{pool}.state")
}

pub fn version_key(pool: &str) -> String {
    format!("ai_lb.{pool}.version")
}

pub fn breaker_key(pool: &str, pod: &str) -> String {
    format!("ai_lb.{pool}.breaker.{pod}")
}

pub fn breakers_epoch_key(pool: &str) -> String {
    format!("ai_lb.{pool}.breakers")
}

/// A VM id that is unique with overwhelming probability: std's random hash keys (WASI
/// `random_get`) mixed with the host clock. (`std::process::id()` panics on wasip1.)
pub fn vm_id() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(host::now_ms());
    h.finish() | 1
}

/// Runs one lease step for VM `me`; true when `me` holds the lease afterwards.
pub fn hold_lease(key: &str, me: u64, now_ms: u64, ttl_ms: u64) -> bool {
    let (bytes, cas) = host::shared_get(key);
    let current = bytes.as_deref().and_then(Lease::decode);
    match lease::step(current, me, now_ms, ttl_ms) {
        LeaseStep::Follow => false,
        // Absent key: no CAS token exists, so two VMs may both write; the later write wins
        // and the other VM follows from its next tick on.
        LeaseStep::Write(l) => host::shared_set(key, &l.encode(), cas).is_ok(),
    }
}

/// A u64 stored little-endian (0 when absent or malformed).
pub fn read_u64(key: &str) -> u64 {
    decode_u64(host::shared_get(key).0)
}

fn decode_u64(bytes: Option<Vec<u8>>) -> u64 {
    bytes
        .and_then(|b| b.get(..8).and_then(|s| <[u8; 8]>::try_from(s).ok()))
        .map(u64::from_le_bytes)
        .unwrap_or(0)
}

/// Publishes a pool state: the state first, then a bumped version.
pub fn publish_state(pool: &str, state: &[u8]) -> Result<u64, Status> {
    host::shared_set(&state_key(pool), state, None)?;
    bump_u64(&version_key(pool))
}

/// Adds one to the u64 at `key` (absent or malformed counts as 0) with CAS retries; returns
/// the new value.
fn bump_u64(key: &str) -> Result<u64, Status> {
    for _ in 0..CAS_RETRIES {
        let (bytes, cas) = host::shared_get(key);
        let v = decode_u64(bytes).wrapping_add(1);
        match host::shared_set(key, &v.to_le_bytes(), cas) {
            Ok(()) => return Ok(v),
            Err(Status::CasMismatch) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(Status::CasMismatch)
}

/// What [`update_breaker`] left in shared data.
pub struct BreakerWrite {
    pub breaker: Breaker,
    /// Transitions `update` caused (on the shared state, so each is counted once per process).
    pub transitions: Vec<Transition>,
    /// The pool's breaker epoch after this write bumped it; None when nothing was written
    /// (unchanged) or the bump failed.
    pub epoch: Option<u64>,
}

/// Applies `update` to the pod's shared breaker with CAS retries, then bumps the pool's breaker
/// epoch when it wrote. A breaker created here gets `jitter` (see `Breaker::with_jitter`).
/// None when the breaker could not be written.
pub fn update_breaker(
    pool: &str,
    pod: &str,
    now_ms: u64,
    cfg: &BreakerConfig,
    jitter: u8,
    mut update: impl FnMut(&mut Breaker) -> Option<Transition>,
) -> Option<BreakerWrite> {
    let key = breaker_key(pool, pod);
    for _ in 0..CAS_RETRIES {
        let (bytes, cas) = host::shared_get(&key);
        let stored = bytes.as_deref().and_then(Breaker::decode);
        let w = update_shared(stored, jitter, now_ms, cfg, &mut update);
        let (b, transitions) = (w.breaker, w.transitions);
        // Unchanged (the common case: a success on a closed breaker): skip the write, which
        // would take the shared-data lock and copy for nothing.
        if !w.changed {
            return Some(BreakerWrite {
                breaker: b,
                transitions,
                epoch: None,
            });
        }
        let encoded = b.encode();
        match host::shared_set(&key, &encoded, cas) {
            Ok(()) => {
                return Some(BreakerWrite {
                    breaker: b,
                    transitions,
                    epoch: bump_u64(&breakers_epoch_key(pool)).ok(),
                })
            }
            Err(Status::CasMismatch) => continue,
            Err(_) => return None,
        }
    }
    None
}
