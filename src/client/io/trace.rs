//! The chunk timeline (`crate::timeline`) as this worker records it: each
//! chunk's stamps (queued, on the wire, received, result) while a
//! timeline is being recorded, and nothing otherwise.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::Instant;

use crate::timeline::Trace;

/// When a chunk in flight was queued, started on the wire, and (if it was
/// not the round's last push) received whole by its server.
pub(super) struct Stamp {
    pub(super) queued: Instant,
    pub(super) sent: Instant,
    pub(super) received: Option<Instant>,
    pub(super) round: u32,
    pub(super) len: usize,
}

impl Stamp {
    /// A chunk queued at `queued` goes on the wire now.
    pub(super) fn sent(queued: Instant, round: u32, len: usize) -> Stamp {
        Stamp { queued, sent: Instant::now(), received: None, round, len }
    }
}

/// The chunks' timeline, while one is recorded, and its writer thread.
#[derive(Default)]
pub(super) struct Tracing {
    trace: RwLock<Option<Arc<Trace>>>,
    /// Whether `trace` holds one: read per chunk sent, without the lock.
    on: AtomicBool,
    writer: Mutex<Option<JoinHandle<()>>>,
}

impl Tracing {
    /// Record every chunk pushed from now on in a timeline at `path`
    /// (`crate::timeline`), replacing one already recorded.
    pub(super) fn open(&self, path: &str, rank: u32) -> std::io::Result<()> {
        let who = format!("worker {rank}");
        let (t, w) = Trace::open(path, rank, &format!("gradhub {who}"), &[], &who)?;
        self.start(t, w);
        Ok(())
    }

    fn start(&self, t: Arc<Trace>, w: JoinHandle<()>) {
        self.stop();
        *self.trace.write().unwrap_or_else(|e| e.into_inner()) = Some(t);
        self.on.store(true, Ordering::Release);
        *self.writer.lock().unwrap_or_else(|e| e.into_inner()) = Some(w);
    }

    /// Stop recording; returns once the file is written.
    pub(super) fn stop(&self) {
        self.on.store(false, Ordering::Release);
        let t = self.trace.write().unwrap_or_else(|e| e.into_inner()).take();
        drop(t);
        // Ends when the last `Trace` is gone (the I/O thread may hold one for a moment).
        if let Some(w) = self.writer.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = w.join();
        }
    }

    /// Whether a timeline is recorded (stamps are taken only then).
    pub(super) fn on(&self) -> bool {
        self.on.load(Ordering::Acquire)
    }

    pub(super) fn current(&self) -> Option<Arc<Trace>> {
        self.trace.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
}
