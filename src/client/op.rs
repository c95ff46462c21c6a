//! A push_pull in progress, as seen by the caller: a handle to wait on,
//! or to be called back from when it completes.

use std::any::Any;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum OpError {
    #[error("{0}")]
    Failed(String),
    #[error("{0}")]
    Timeout(String),
}

/// Called once when an op completes: `Ok` when the result is in the
/// buffer, else the failure. Runs on the thread that completes the op (the
/// I/O or control thread, or the caller's if it was already done), outside
/// gradhub's locks, so it must be quick and must not block.
pub type Callback = Box<dyn FnOnce(Result<(), String>) + Send>;

/// Reads a connection on the caller's thread if it can (`Io::submit`);
/// one per worker, shared by its ops.
pub(crate) trait ConnPoller: Send + Sync {
    /// Read connection `conn`, unless another thread is at it.
    fn poll(&self, conn: usize);
    /// While on, arriving data on `conn` does not wake the I/O thread (the
    /// caller reads it); off again re-checks, so nothing is missed.
    fn quiet(&self, conn: usize, on: bool);
}
pub(crate) type Poller = std::sync::Arc<dyn ConnPoller>;

/// Which bytes of an op's buffer matter, each as `from..to` (None: all).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Extent {
    /// The only bytes that may be nonzero: the chunks wholly outside are
    /// zeros, pushed as a header only (`FLAG_ZEROS`).
    pub live: Option<(usize, usize)>,
    /// The only bytes whose result the caller needs: the chunks wholly
    /// outside are pushed asking for no result (`FLAG_NO_RESULT`), answered
    /// by a header only, and keep the bytes this worker pushed.
    pub want: Option<(usize, usize)>,
    /// No other worker's bytes fall in `live` (an all-gather's slot): the
    /// sum of a chunk wholly inside is what this worker pushed, so it is
    /// pushed asking for no result too.
    pub live_is_own: bool,
}

/// Who sums a tensor, and how it lies among them: what its declaration
/// says (`DeclEntry::members`, `DeclEntry::sharded`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Summed<'a> {
    /// The workers that sum it, by rank, ascending, this one among them
    /// (empty: every worker).
    pub members: &'a [u32],
    /// As many equal shards as members, the q-th read by the q-th member.
    pub sharded: bool,
}

impl Extent {
    /// Bytes `lo..hi` (a chunk's) are zeros.
    pub fn zeros(&self, lo: usize, hi: usize) -> bool {
        self.live.is_some_and(|(from, to)| hi <= from || lo >= to)
    }

    /// The result of bytes `lo..hi` (a chunk's) is not needed.
    pub fn unwanted(&self, lo: usize, hi: usize) -> bool {
        self.want.is_some_and(|(from, to)| hi <= from || lo >= to)
            || (self.live_is_own && self.live.is_some_and(|(from, to)| from <= lo && hi <= to))
    }
}

#[derive(Default)]
struct OpState {
    done: bool,
    error: Option<String>,
    /// Latest stall report from a server about this tensor.
    stall: Option<String>,
    /// Keeps the caller's buffer alive until the operation is over.
    keepalive: Option<Box<dyn Any + Send>>,
    callbacks: Vec<Callback>,
}

/// What completing an op leaves to run outside the locks: the callbacks,
/// then releasing the caller's buffer (in that order, so a callback may
/// still read the result).
pub(crate) struct Completed {
    callbacks: Vec<Callback>,
    result: Result<(), String>,
    keepalive: Option<Box<dyn Any + Send>>,
}

impl Completed {
    pub(crate) fn run(self) {
        for cb in self.callbacks {
            cb(self.result.clone());
        }
        drop(self.keepalive);
    }
}

pub struct Op {
    pub name: String,
    state: Mutex<OpState>,
    cv: Condvar,
    /// Mirrors `state.done` so a waiter can spin without the lock.
    done_flag: AtomicBool,
    /// The bytes of the buffer that may be nonzero, and those wanted back.
    pub(crate) extent: Extent,
    /// Run while spinning in `wait`: reads the result from the socket
    /// on the caller's thread if it can (one-chunk ops; see `Io::submit`).
    poller: OnceLock<(Poller, usize)>,
}

/// How long `wait` spins before sleeping: a futex sleep/wake costs more than
/// a small round trip, so short waits are much faster when spun.
fn spin_limit() -> Duration {
    static SPIN: OnceLock<Duration> = OnceLock::new();
    *SPIN.get_or_init(crate::settings::spin)
}

impl Op {
    pub fn new(name: String, keepalive: Option<Box<dyn Any + Send>>, extent: Extent) -> Op {
        Op {
            name,
            extent,
            state: Mutex::new(OpState { keepalive, ..Default::default() }),
            cv: Condvar::new(),
            done_flag: AtomicBool::new(false),
            poller: OnceLock::new(),
        }
    }

    /// Have `wait` run `poll(conn)` while it spins.
    pub(crate) fn set_poller(&self, poll: Poller, conn: usize) {
        let _ = self.poller.set((poll, conn));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, OpState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Mark the op done; the caller runs what is returned outside its locks.
    pub(crate) fn complete(&self, error: Option<String>) -> Option<Completed> {
        let mut st = self.lock();
        if st.done {
            return None;
        }
        st.done = true;
        st.error = error;
        self.done_flag.store(true, Ordering::Release);
        self.cv.notify_all();
        Some(Completed {
            callbacks: std::mem::take(&mut st.callbacks),
            result: self.outcome(&st),
            keepalive: st.keepalive.take(),
        })
    }

    /// Call `cb` when the op completes (at once, on this thread, if it has).
    pub fn on_complete(&self, cb: Callback) {
        let mut st = self.lock();
        if !st.done {
            st.callbacks.push(cb);
            return;
        }
        let result = self.outcome(&st);
        drop(st);
        cb(result);
    }

    fn outcome(&self, st: &OpState) -> Result<(), String> {
        match &st.error {
            None => Ok(()),
            Some(e) => Err(format!("push_pull '{}' failed: {e}", self.name)),
        }
    }

    pub(crate) fn set_stall(&self, msg: String) {
        self.lock().stall = Some(msg);
    }

    pub fn done(&self) -> bool {
        self.lock().done
    }

    /// Wait until the result is in the caller's buffer, or fail.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<(), OpError> {
        let start = Instant::now();
        let deadline = timeout.map(|t| start + t);
        let spin_until = start + spin_limit().min(timeout.unwrap_or(Duration::MAX));
        match self.poller.get() {
            Some((p, conn)) if !self.done_flag.load(Ordering::Acquire) => {
                p.quiet(*conn, true);
                while !self.done_flag.load(Ordering::Acquire) && Instant::now() < spin_until {
                    p.poll(*conn);
                }
                p.quiet(*conn, false);
            }
            Some(_) => {}
            None => {
                while !self.done_flag.load(Ordering::Acquire) && Instant::now() < spin_until {
                    std::hint::spin_loop();
                }
            }
        }
        let mut st = self.lock();
        while !st.done {
            match deadline {
                None => st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner()),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        let mut msg = format!(
                            "push_pull '{}' did not complete within {:.3}s",
                            self.name,
                            timeout.unwrap_or_default().as_secs_f64()
                        );
                        if let Some(s) = &st.stall {
                            msg.push_str("; ");
                            msg.push_str(s);
                        }
                        // Not cancelled: the other workers' sums include this
                        // one's pushes, so the tensor is still in use.
                        msg.push_str(
                            "; it is still running and its tensor stays in use until it completes (wait on it again)",
                        );
                        return Err(OpError::Timeout(msg));
                    }
                    st = self.cv.wait_timeout(st, d - now).unwrap_or_else(|e| e.into_inner()).0;
                }
            }
        }
        self.outcome(&st).map_err(OpError::Failed)
    }
}
