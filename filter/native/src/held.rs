//! Decides nothing: wakes the module's held requests. A request the core's admission gate
//! holds (a standard one while its pool is saturated) stops in its request hook; Envoy 1.40's
//! dynamic-module ABI gives each stream a scheduler that posts an event to the stream's own
//! worker thread from any thread. One thread per filter config commits a tick event to every
//! held request's scheduler every `tick` (only while some are held); each request, woken on its
//! worker, runs the core's `wake_held` there (expire, release by capacity, route) and resumes
//! or answers itself. The wasm filter does the same from its root context's tick.
//!
//! A scheduler is deleted only after it left the registry, under the registry's lock, so the
//! ticking thread never commits to a deleted one.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::host::Scheduler;

/// The event id of a tick (the only event the module schedules).
pub const TICK: u64 = 1;

#[derive(Debug, Default)]
struct Registry {
    by_id: HashMap<u32, Scheduler>,
    stop: bool,
}

#[derive(Debug, Default)]
struct Inner {
    reg: Mutex<Registry>,
    cv: Condvar,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, Registry> {
        self.reg.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The held requests of one filter config and the thread that wakes them.
#[derive(Debug)]
pub struct HeldWake {
    inner: Arc<Inner>,
    thread: Option<JoinHandle<()>>,
}

impl HeldWake {
    /// Starts the waking thread, ticking every `tick` while a request is held.
    pub fn start(tick: Duration) -> Result<Self, String> {
        let inner = Arc::new(Inner::default());
        let run = Arc::clone(&inner);
        let thread = std::thread::Builder::new()
            .name("ai-lb-held".into())
            .spawn(move || wake_loop(&run, tick))
            .map_err(|e| format!("ai-lb native: cannot start the held-request thread: {e}"))?;
        Ok(Self {
            inner,
            thread: Some(thread),
        })
    }

    /// Wakes request `id` through `s` every tick until [`HeldWake::forget`].
    pub fn hold(&self, id: u32, s: Scheduler) {
        self.inner.lock().by_id.insert(id, s);
        self.inner.cv.notify_all();
    }

    /// Stops waking request `id` and deletes its scheduler.
    pub fn forget(&self, id: u32) {
        let gone = self.inner.lock().by_id.remove(&id);
        drop(gone);
    }
}

impl Drop for HeldWake {
    fn drop(&mut self) {
        self.inner.lock().stop = true;
        self.inner.cv.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn wake_loop(inner: &Inner, tick: Duration) {
    loop {
        {
            let mut reg = inner.lock();
            while !reg.stop && reg.by_id.is_empty() {
                reg = inner.cv.wait(reg).unwrap_or_else(|e| e.into_inner());
            }
            if reg.stop {
                return;
            }
            for s in reg.by_id.values() {
                s.commit(TICK);
            }
        }
        std::thread::sleep(tick);
    }
}
