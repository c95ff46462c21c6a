//! The I/O thread: its event loop (`IoThread`), the receiving side it
//! drives (`IoCore`, behind a lock a caller waiting on a one-chunk op may
//! take to read its result itself), with the checks it runs on a tick
//! (broken links, host-stage stalls). Other threads wake and steer it
//! through the receive side (`receive::RecvSide`).

use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use mio::{Events, Poll};

use super::item::ResultDest;
use super::link::{broke, mendable, LinkState};
use super::{Completion, Io};
use super::{DOORBELL, WAKER};
use crate::protocol::ReadError;
use crate::transport::{ConnError, Drain, FrameReader};

/// What a caller spinning on an op whose result comes on connection `i`
/// runs: read it, unless the I/O thread is at it (then that thread delivers
/// it); meanwhile the I/O thread is not woken for that connection. Saves
/// the I/O thread's wake-up on the way from the socket to the caller, which
/// on a small round trip competes for the cores with the server and the
/// caller. (Weak: the ops hold it.)
pub(super) struct CallerPoller {
    pub(super) core: std::sync::Weak<Mutex<IoCore>>,
    pub(super) io: std::sync::Weak<Io>,
}

impl crate::client::op::ConnPoller for CallerPoller {
    fn poll(&self, i: usize) {
        if let Some(core) = self.core.upgrade() {
            if let Ok(mut c) = core.try_lock() {
                c.poll_for(i);
            }
        }
    }
    fn quiet(&self, i: usize, on: bool) {
        if let Some(io) = self.io.upgrade() {
            io.quiet(i, on);
        }
    }
}

/// The I/O thread: waits for events and hands them to the receiving side.
pub struct IoThread {
    pub(super) poll: Poll,
    pub(super) core: Arc<Mutex<IoCore>>,
}

/// The receiving side: what the I/O thread does with events, behind a lock
/// so that a caller waiting for a small result may read it itself (one
/// thread hop fewer: `CallerPoller`).
pub struct IoCore {
    pub(super) io: Arc<Io>,
    /// Where completions and job failures go (the client).
    pub(super) owner: Arc<dyn Completion>,
    pub(super) rx: Vec<FrameReader<ResultDest>>,
    pub(super) failed: bool,
    /// Local workers to ring once the current event is handled (host stage).
    pub(super) bells: u64,
    /// By connection: chunks moved off its (live) server to one that
    /// joined; whatever it still sends about them is stale and dropped.
    pub(super) moved_off: Vec<HashSet<(u32, u32)>>,
    /// Connections given their first read and write here (see `run`).
    pub(super) seen: usize,
}

impl IoThread {
    pub fn new(poll: Poll, io: Arc<Io>, owner: Arc<dyn Completion>) -> IoThread {
        let n = io.send.conns.len();
        let rx = (0..n).map(|_| FrameReader::default()).collect();
        let moved_off = (0..n).map(|_| HashSet::new()).collect();
        let core = IoCore { io: io.clone(), owner, rx, failed: false, bells: 0, moved_off, seen: n };
        let core = Arc::new(Mutex::new(core));
        let poller = CallerPoller { core: Arc::downgrade(&core), io: Arc::downgrade(&io) };
        let _ = io.recv.poller.set(Arc::new(poller));
        IoThread { poll, core }
    }

    pub(super) fn core(&self) -> MutexGuard<'_, IoCore> {
        self.core.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn run(mut self) {
        let mut events = Events::with_capacity(256);
        // Only the host stage has rounds to watch here (servers watch
        // theirs), and lost connections wait for a failover.
        let io = self.core().io.clone();
        let tick = match (&io.host.stage, io.failover.on) {
            (None, false) => None,
            _ => Some(crate::waits::tick(io.host.stall, io.failover.peer_timeout.max(Duration::from_millis(200)))),
        };
        loop {
            {
                let mut core = self.core();
                core.grow();
                if tick.is_some() && !core.failed {
                    if io.host.stage.is_some() {
                        core.check_host_stalls();
                    }
                    core.check_lost();
                    core.check_mends();
                }
            }
            if let Err(e) = self.poll.poll(&mut events, tick) {
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                self.core().fail(format!("worker I/O poll failed: {e}"), true);
                return;
            }
            if !self.core().handle(&events) {
                return;
            }
        }
    }
}

impl IoCore {
    /// Handle what one poll returned; false once shut down.
    pub(super) fn handle(&mut self, events: &Events) -> bool {
        if self.io.recv.stopped() {
            // Shut down: what was sent can no longer complete. Fail it
            // here, where the receive buffers are owned.
            self.fail("gradhub was shut down".into(), false);
            return false;
        }
        if let Some(msg) = self.io.recv.take_fail_request() {
            self.fail(msg, true);
        }
        self.grow();
        self.finish_mends();
        for note in self.io.failover.take_notes() {
            if !self.failed {
                self.apply_failover(note);
            }
        }
        for ev in events.iter() {
            if ev.token() == DOORBELL && !self.failed {
                self.scan_host();
                continue;
            }
            if ev.token() != WAKER {
                let readable = ev.is_readable() || ev.is_read_closed() || ev.is_error();
                self.on_event(ev.token().0, readable.then(|| Drain::of(ev)), ev.is_writable());
            }
        }
        // A connection registered since (a server joined) may have had
        // its first edge before it was in the table: read (to EOF, as that
        // edge may have been its close) and write it once now, later edges
        // come as events.
        while self.seen < self.rx.len() {
            self.seen += 1;
            self.on_event(self.seen - 1, Some(Drain::Full), true);
        }
        true
    }

    /// A caller waiting for a one-chunk op reads connection `i` itself
    /// (until it would block, as the I/O thread would on the event; the
    /// event still comes, and finds nothing to read).
    pub(super) fn poll_for(&mut self, i: usize) {
        self.grow();
        if i < self.seen {
            self.on_event(i, Some(Drain::Short), false);
        }
    }

    /// Connections added since (a server joined): room to read them.
    pub(super) fn grow(&mut self) {
        let n = self.io.send.conns.len();
        if n > self.rx.len() {
            self.rx.resize_with(n, FrameReader::default);
            self.moved_off.resize_with(n, HashSet::new);
        }
    }

    pub(super) fn fail(&mut self, msg: String, job_failed: bool) {
        self.failed = true;
        // Receive targets may be released now: forget them.
        self.rx.iter_mut().for_each(|r| {
            r.reset();
        });
        self.io.fail_all(msg, &*self.owner, job_failed);
    }

    /// `read`: whether to read, and how far (`Drain`).
    pub(super) fn on_event(&mut self, i: usize, read: Option<Drain>, writable: bool) {
        // (A link being mended is read again once its new socket is in.)
        let state = self.io.send.conns.get(i).map(|c| c.state());
        if self.failed || i >= self.rx.len() || matches!(state, Some(LinkState::Dead | LinkState::Mending)) {
            return;
        }
        let mut res = Ok(());
        if let Some(drain) = read {
            res = self.on_readable(i, drain);
        }
        if res.is_ok() && writable {
            res = self.io.pump(i);
        }
        if let Err(e) = &res {
            let leaving = self.owner.closing() || self.owner.failure().is_some();
            if mendable(e) && !leaving && self.start_mend(i, &e.to_string()) {
                self.ring_pending();
                return;
            }
            if self.io.failover.on && broke(e) && self.owner.failure().is_none() {
                self.on_lost(i, e.to_string());
                self.ring_pending();
                return;
            }
        }
        if let Err(why) = res {
            let why = match why {
                ConnError::Read(ReadError::Closed | ReadError::ClosedMidFrame) => {
                    "connection closed by the server".to_string()
                }
                other => other.to_string(),
            };
            let msg = format!("{}: {why}", self.io.send.conns[i].desc());
            self.fail(msg, true);
        }
        self.ring_pending();
    }

    /// Connection `i` broke, its server probably lost: stop using it and
    /// wait for the scheduler's failover (`check_lost` bounds the wait).
    pub(super) fn on_lost(&mut self, i: usize, why: String) {
        let io = &self.io;
        let c = &io.send.conns[i];
        self.rx[i].reset();
        c.link().deregister(&io.send.registry);
        c.broke(&mut c.send());
        let target = format!("worker {}", io.rank);
        if self.owner.closing() {
            log::debug!(target: &target, "{}: {why} while this worker leaves", c.desc());
        } else {
            log::warn!(target: &target, "{}: {why}; waiting for the scheduler's failover", c.desc());
        }
    }

    /// Fail the job if a broken connection's server was not taken over
    /// within a few peer timeouts (the scheduler reports a lost server
    /// within one): the server may be alive, with only this link down.
    pub(super) fn check_lost(&mut self) {
        let io = &self.io;
        let limit = io.failover.peer_timeout * 3;
        // Over the connections this thread has grown into: one added since
        // (a server that joined, on the control thread) is not lost yet.
        let late = (0..self.rx.len()).find(|&i| {
            let c = &io.send.conns[i];
            c.state() != LinkState::Dead && c.send().broken_at.is_some_and(|t| t.elapsed() > limit)
        });
        if let Some(i) = late {
            let msg = format!(
                "{}: the connection broke and the scheduler reported no failover within {:.1}s",
                io.send.conns[i].desc(),
                limit.as_secs_f64()
            );
            self.owner.fail_job(msg);
        }
    }
}
