//! Decides which VM of an Envoy process holds the single `WatchPool` subscription of a pool:
//! a lease (owner id + expiry) kept in shared data, taken by compare-and-swap, renewed on every
//! tick by its holder and taken over by another VM once it has expired.
//!
//! Every worker VM and the main-thread VMs tick (ENVOY_FACTS), so without this each of them
//! would open its own stream. Pure: the glue reads/writes the bytes and passes `now_ms`.

/// A lease as stored in shared data: 16 bytes, owner then expiry, little-endian.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    pub owner: u64,
    pub expires_ms: u64,
}

impl Lease {
    pub fn encode(&self) -> [u8; 16] {
        let mut out = [0u8; 16];
        out[..8].copy_from_slice(&self.owner.to_le_bytes());
        out[8..].copy_from_slice(&self.expires_ms.to_le_bytes());
        out
    }

    /// `None` for anything that is not exactly 16 bytes (treated as no lease).
    pub fn decode(bytes: &[u8]) -> Option<Lease> {
        let owner: [u8; 8] = bytes.get(..8)?.try_into().ok()?;
        let expires: [u8; 8] = bytes.get(8..16)?.try_into().ok()?;
        if bytes.len() != 16 {
            return None;
        }
        Some(Lease {
            owner: u64::from_le_bytes(owner),
            expires_ms: u64::from_le_bytes(expires),
        })
    }
}

/// What a VM should do with the lease on a tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseStep {
    /// Write this lease with the CAS token just read; on success the VM is (still) the holder.
    Write(Lease),
    /// Someone else holds a live lease: do not subscribe.
    Follow,
}

/// The step for VM `me` at `now_ms`, given the lease currently stored (if any).
pub fn step(current: Option<Lease>, me: u64, now_ms: u64, ttl_ms: u64) -> LeaseStep {
    let renewed = Lease {
        owner: me,
        expires_ms: now_ms.saturating_add(ttl_ms),
    };
    match current {
        Some(l) if l.owner != me && l.expires_ms > now_ms => LeaseStep::Follow,
        _ => LeaseStep::Write(renewed),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absent_lease_is_taken() {
        assert_eq!(
            step(None, 7, 1_000, 500),
            LeaseStep::Write(Lease {
                owner: 7,
                expires_ms: 1_500
            })
        );
    }

    #[test]
    fn live_lease_of_another_vm_is_followed() {
        let l = Lease {
            owner: 3,
            expires_ms: 1_200,
        };
        assert_eq!(step(Some(l), 7, 1_000, 500), LeaseStep::Follow);
    }

    #[test]
    fn expired_lease_of_another_vm_is_taken_over() {
        let l = Lease {
            owner: 3,
            expires_ms: 1_000,
        };
        assert_eq!(
            step(Some(l), 7, 1_000, 500),
            LeaseStep::Write(Lease {
                owner: 7,
                expires_ms: 1_500
            })
        );
    }

    #[test]
    fn own_lease_is_renewed_even_if_expired() {
        let l = Lease {
            owner: 7,
            expires_ms: 10,
        };
        assert_eq!(
            step(Some(l), 7, 1_000, 500),
            LeaseStep::Write(Lease {
                owner: 7,
                expires_ms: 1_500
            })
        );
    }

    #[test]
    fn round_trips_and_rejects_wrong_lengths() {
        let l = Lease {
            owner: u64::MAX,
            expires_ms: 42,
        };
        assert_eq!(Lease::decode(&l.encode()), Some(l));
        assert_eq!(Lease::decode(&[0u8; 15]), None);
        assert_eq!(Lease::decode(&[0u8; 17]), None);
    }
}
