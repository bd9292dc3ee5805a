//! Decides nothing: the state one VM's root context and HTTP contexts share (single-threaded):
//! the router and its view of each pool's shared state, the metric ids, the shared breakers'
//! copy, admission and the big-request hold, and how a view is brought up to date. It is the
//! worker the core's request lifecycle runs against ([`lifecycle::Worker`]).

use std::cell::{Cell, Ref, RefCell, RefMut};

use rand::rngs::SmallRng;

use ai_lb_filter_core::lifecycle;
use ai_lb_filter_core::picker::Router;
use proxy_wasm::types::LogLevel;

use ai_lb_filter_core::lifecycle::admission::{AdmissionParts, AdmissionRt, AdmissionWorker};
use ai_lb_filter_core::lifecycle::hold::{BigHold, HoldParts, HoldWorker};

use crate::admission::HostStore;
use crate::breakers::Breakers;
use crate::metrics::Metrics;
use crate::{host, shared};

/// This VM's copy of one pool's shared state: the version installed and when it was last
/// checked.
#[derive(Debug, Clone, Copy, Default)]
pub struct PoolView {
    pub seen_version: u64,
    pub checked_ms: u64,
}

/// State shared by the root context and the HTTP contexts of one VM (single-threaded).
pub struct State {
    pub router: Router,
    pub metrics: Metrics,
    pub rng: SmallRng,
    /// Reused buffer for the routing header value.
    pub scratch: String,
    /// Reused buffers for keying prompts (`prefixAffinity`).
    pub prompt_ids: Vec<u32>,
    pub key_scratch: Vec<u64>,
    /// Admission control, when the plugin config has an enabled `admission` section.
    pub admission: Option<AdmissionRt>,
    /// This VM's view of the shared breakers (synced before each pick and on ticks).
    pub breakers: Breakers,
    /// Big requests waiting in this worker (`bigRequestHold`).
    pub big_hold: BigHold,
    /// Per pool (config order): the shared state version installed here.
    pub views: Vec<PoolView>,
    /// Pool names (config order), for the shared-data keys.
    pub pool_names: Vec<String>,
    /// `watch.refreshMs`: how old a view may be before a pick re-reads it.
    pub refresh_ms: u64,
    /// This VM's id (the status page says which VM answered).
    pub vm: u64,
}

impl lifecycle::Worker for State {
    /// Re-reads the pool's shared state when this view is older than `watch.refreshMs` (an
    /// idle VM ticks slowly), then other VMs' breaker changes (one shared read when none).
    fn refresh(&mut self, pool: usize, now: u64) {
        refresh_view_if_old(self, pool, now);
        self.breakers.sync(&mut self.router, pool, now);
    }

    fn parts(&mut self) -> lifecycle::Parts<'_> {
        lifecycle::Parts {
            router: &mut self.router,
            rng: &mut self.rng,
            scratch: &mut self.scratch,
            prompt_ids: &mut self.prompt_ids,
            key_scratch: &mut self.key_scratch,
            breakers: &mut self.breakers,
            stats: &mut self.metrics,
        }
    }

    fn router(&self) -> &Router {
        &self.router
    }

    fn ordinal(&self) -> u64 {
        self.vm
    }
}

impl HoldWorker for State {
    fn hold_parts(&mut self) -> HoldParts<'_> {
        HoldParts {
            hold: &mut self.big_hold,
            router: &mut self.router,
            stats: &mut self.metrics,
        }
    }
}

impl AdmissionWorker for State {
    fn admission(&mut self) -> Option<AdmissionParts<'_>> {
        let rt = self.admission.as_mut()?;
        Some(AdmissionParts {
            rt,
            router: &mut self.router,
            stats: &mut self.metrics,
            store: &HostStore,
        })
    }
}

/// Re-reads pool `i`'s shared state into the router when its version moved (one 8-byte
/// shared-data read when it did not).
pub fn refresh_view(s: &mut State, i: usize, now: u64) {
    let (Some(view), Some(name)) = (s.views.get_mut(i), s.pool_names.get(i)) else {
        return;
    };
    view.checked_ms = now;
    let v = shared::read_u64(&shared::version_key(name));
    if v == view.seen_version {
        return;
    }
    let (bytes, _) = host::shared_get(&shared::state_key(name));
    let Some(bytes) = bytes else {
        return;
    };
    view.seen_version = v;
    if let Err(e) = s.router.set_pool_state_bytes(i, &bytes, now) {
        host::log(LogLevel::Warn, &format!("ai-lb: pool `{name}`: {e}"));
    }
}

/// Before a pick: re-reads the pool's view when it is older than `watch.refreshMs` (a VM that
/// was idle ticks slowly, see [`tick_period_ms`]).
pub fn refresh_view_if_old(s: &mut State, i: usize, now: u64) {
    let old = s
        .views
        .get(i)
        .is_some_and(|v| now.saturating_sub(v.checked_ms) >= s.refresh_ms);
    if old {
        refresh_view(s, i, now);
    }
}

thread_local! {
    /// Callbacks that found the VM's state borrowed (exported as `ailb.state_busy`).
    static BUSY: Cell<u64> = const { Cell::new(0) };
}

/// The state was borrowed already (a re-entered callback); counted.
#[derive(Debug)]
pub struct Busy;

/// Borrows the VM's state mutably; a failure (a re-entered callback) is counted, never silent.
pub fn lock(state: &RefCell<State>) -> Result<RefMut<'_, State>, Busy> {
    state.try_borrow_mut().map_err(|_| {
        count_busy();
        Busy
    })
}

/// Borrows the VM's state to read; a failure is counted.
pub fn read(state: &RefCell<State>) -> Result<Ref<'_, State>, Busy> {
    state.try_borrow().map_err(|_| {
        count_busy();
        Busy
    })
}

/// Counts a callback that found the VM's state borrowed.
pub fn count_busy() {
    BUSY.with(|b| b.set(b.get() + 1));
}

/// Callbacks that found the state busy since the last call (the root exports them).
pub fn take_busy() -> u64 {
    BUSY.with(|b| b.replace(0))
}
