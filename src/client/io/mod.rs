//! The worker's data plane: one nonblocking connection per server thread,
//! a priority queue of chunk sends per connection with a credit (bounded
//! bytes in flight), and results received straight into the caller's buffer.
//!
//! Sends are driven by whoever has work: the caller's thread writes its own
//! chunks right away (no hand-off to another thread, which on a small round
//! trip costs as much as the network), and the I/O thread continues when a
//! socket becomes writable again or a result returns credit. Receives are
//! the I/O thread's alone.
//!
//! Two windows per connection, each of `credit` bytes (P3's slicing +
//! priority queue, ByteScheduler's credit):
//! - unreceived: pushed but not yet received whole by the server (it answers
//!   each push with a header-only Received frame). Bytes in socket queues and
//!   the network cannot be overtaken, so this bounds how much low-priority
//!   data an urgent chunk waits behind (the push that completes a round is
//!   answered by its result instead); a chunk that comes before every
//!   unreceived chunk may always go (preemption).
//! - unreturned: pushed, result not back yet. A result waits for every
//!   worker, so this keeps workers in step: a worker that ran ahead would
//!   only take link bandwidth from the ones its results wait for (measured:
//!   without it, goodput with CPU-only servers fell from ~0.9 to 0.74-0.79 of
//!   the BytePS optimum). Only chunks that come before a chunk in the
//!   job-wide order count against it, so a newly urgent tensor is not held
//!   back by less urgent chunks still waiting for other workers (counting
//!   them all made priority scheduling 14 % slower than FIFO on BERT).
//!
//! The job-wide order is the same on every worker — (priority descending,
//! tensor key, chunk index; a sharded tensor's shards interleaved); keys
//! are assigned by the scheduler in first-use order, which makes ties FIFO.
//! Pushes of zeros (a header only) go first: they hold no credit. No deadlock: the unreceived window drains
//! without any other worker's help, and the first unfinished chunk of the
//! job has no unreturned chunk before it, so every worker can send it.
//!
//! With several workers on a host (`host`), a worker pushes only the chunks
//! it owns there, from the host's sum in shared memory, and takes the other
//! chunks' results from the shared memory once their owners publish them;
//! doorbells wake this thread for both. Everything above holds per pusher.
//!
//! Failover (`scheduler::failover`): when a server is lost its connections
//! go quiet here (`LinkState::Broken`) until the scheduler says where its
//! chunks went, at most a few peer timeouts. Then this thread re-sends every
//! push the lost server had not answered (a caller's buffer, or the host's
//! sum, still holds it: results land apart, in `Kept` or the segment's
//! result buffer, and are copied over once whole) and restores the last
//! result it holds of each moved chunk, which other workers may have
//! missed. Tensors released lately keep theirs a while (`Released`).
//!
//! Two state machines carry all of this (docs/architecture.md draws them):
//! each chunk pushed on a connection is queued (in its heap), then in a
//! `flow::Phase` (on the wire, received) until it is done (its result is
//! in, and it leaves; `flow::InFlight` keeps the credit windows and the
//! timeline stamps in step with it), and follows an `item::Route` fixed
//! when its round starts (caller's buffer, kept copy, host owner, host
//! peer); each connection is in a `link::LinkState` (live, mending,
//! broken, written off, dead). The data plane reports back to the client
//! only through `Completion`.
//!
//! Where things are: `Io` (here) is made of parts that own their fields,
//! each in the file named for it, with the methods that touch only its
//! own state: the send side (`send::SendSide`: the connection table, the
//! registry, push counts), admission (`admission::Admission`: windows,
//! the spread, the credit split), the receive side (`receive::RecvSide`:
//! what wakes and steers the I/O thread), mending (`mend::Mending`),
//! failover (`failover::Failover`: notes, newest placements, released
//! tensors; a pure `failover::plan`, then applied), the host stage
//! (`host::HostSide`) and the chunk timeline (`trace::Tracing`). What
//! works across parts is `Io`'s, in two files: here (setting up, failing,
//! placement and credit, released tensors, failover notes, a local worker
//! that left, the timeline) and `send` (a round from `Io::submit` to its
//! chunks on the wire, control frames, the pump, credit coming back).
//! The I/O thread (`thread`: `IoThread` and its loop; `IoCore`, what it
//! works with, behind a lock) does each part's share of its work in that
//! part's file: frames and results in `receive`, mends in `mend`, the
//! host's doorbell and stalls in `host`, applying a failover in `failover`.
//!
//! The types every part shares are in leaf modules, which import no other
//! part: a chunk's send item, order, route, result destination and how it
//! goes again (`item`), a link's state and what its errors mean (`link`).
//! Above them: `trace` (`Stamp`; a leaf too), `admission` (`Window`,
//! `Spread`), `flow` (a chunk's phases and the windows that follow them,
//! `InFlight`; an active round, `Active`, with its `HostRound`) and
//! `conns` (`Conn`, `ConnTable`, each one's `SendHalf`). No file imports
//! another in a circle, and `impl Io` is in `mod.rs` and `send.rs` only
//! (`structure_tests` checks both). The op table (`OpTable`) is shared
//! by all of them, under one lock.
//!
//! Locks, outermost first; a lock is never taken while one after it is
//! held: the I/O thread's `IoCore` → `ops` (the op table) → a connection's
//! `send` → the spread (`Admission::spread`). Leaf locks (nothing taken
//! while held): `Failover`'s `latest` and `notes`, `Admission`'s `placed`,
//! `RecvSide`'s `fail_requested`, `Tracing`'s `trace` and `writer`, the
//! connection table's `append`. The client's table lock is never taken
//! while `ops` is held: ops complete after it is released.

mod admission;
mod conns;
mod failover;
mod flow;
mod host;
mod item;
mod link;
mod mend;
mod receive;
mod send;
mod thread;
mod trace;

#[cfg(test)]
mod structure_tests;

pub use conns::{ConnTable, NewConn};
pub use failover::FailoverNote;
pub use thread::IoThread;

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use mio::{Interest, Poll, Token, Waker};

use admission::{split_credit, Admission, Spread};
use failover::{Failover, Kept, Released};
use flow::Active;
use host::HostSide;
use receive::RecvSide;
use send::SendSide;
use trace::Tracing;

use super::op::Op;
use crate::host::HostStage;
use crate::placement::HostLayout;
use crate::protocol::TensorSpec;

pub const WAKER: Token = Token(usize::MAX);
/// This worker's doorbell (host stage): a local peer published something.
pub const DOORBELL: Token = Token(usize::MAX - 1);

/// Raw pointer to the caller's buffer. The op's keepalive owns the memory
/// until the op completes; an op is completed only after every queued send
/// of it is dropped and by the thread that receives into it.
#[derive(Clone, Copy)]
pub struct BufPtr(pub *mut u8);
// SAFETY: see above.
unsafe impl Send for BufPtr {}

pub struct Submission {
    pub op: Arc<Op>,
    pub spec: Arc<TensorSpec>,
    pub ptr: BufPtr,
    pub priority: i32,
    pub flags: u16,
    /// A sharded tensor's shard count (0: not sharded): its chunks go out
    /// the shards interleaved (`flow::Active::push_position`).
    pub shards: u32,
}

#[derive(Default)]
struct OpTable {
    active: HashMap<u32, Active>,
    rounds: HashMap<u32, u32>,
    seq: u64,
    failed: Option<String>,
    /// By key, with failover on and no host stage: where results land.
    kept: HashMap<u32, Kept>,
    /// By key moved by a failover: the spec its last applied failover
    /// moved it from, or to (what its chunks' servers hold now).
    applied: HashMap<u32, Arc<TensorSpec>>,
    /// Tensors released lately, still able to restore their last result.
    released: VecDeque<Released>,
}

/// The worker's data plane, shared by callers and the I/O thread: the
/// table of operations in flight and the parts that work on it.
pub struct Io {
    /// This worker's rank, its job's namespace, and who pushes what: read
    /// by every part.
    rank: u32,
    namespace: u32,
    layout: Arc<HostLayout>,
    ops: Mutex<OpTable>,
    send: SendSide,
    admission: Admission,
    recv: RecvSide,
    failover: Failover,
    mend: mend::Mending,
    host: HostSide,
    trace: Tracing,
}

pub const NONE_LEFT: u32 = u32::MAX;

/// The data plane's counters (`Io::stats`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IoStats {
    /// Chunks pushed by reference, through shared memory (host stage).
    pub pushed_by_ref: u64,
    /// Chunks pushed through a socket, and of those, zeros (a header only).
    pub pushed_by_socket: u64,
    pub pushed_zeros: u64,
    /// Chunks pushed asking for no result (`Extent::want`): answered by a header only.
    pub pushed_no_result: u64,
    /// Chunks queued or in flight that their servers have not received
    /// whole yet, and their bytes (what the spread counts; none once
    /// every op is done).
    pub unreceived_chunks: usize,
    pub unreceived_bytes: usize,
}

/// The data plane's one way back to the client: an op is complete (or
/// failed), the job must fail (told to every member), has it failed.
/// Keeps `io` free of the client's types.
pub trait Completion: Send + Sync {
    fn finish_op(&self, op: &Op, error: Option<String>);
    fn fail_job(&self, msg: String);
    /// This worker cannot reach server `server` (`reason`): the scheduler
    /// writes it off (failover) if it can.
    fn unreachable(&self, server: u32, reason: String);
    fn failure(&self) -> Option<String>;
    /// This worker is leaving (it said goodbye): the servers closing its
    /// connections is the job's normal end, not a loss.
    fn closing(&self) -> bool;
}

/// Why something waiting for a worker that left can never complete.
pub fn left_message(left: u32, me: u32, what: &str) -> String {
    crate::waits::left_message(&format!("worker {left}"), &format!("while worker {me} still needs it for {what}"))
}

impl Io {
    /// Registers the connections with `poll` (owned by the I/O thread).
    /// Registers the connections and sends each its DataHello (this
    /// worker's `rank`) before anything else.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        poll: &Poll,
        streams: Vec<NewConn>,
        rank: u32,
        (credit, spread): (usize, Option<usize>),
        namespace: u32,
        max_payload: u32,
        layout: Arc<HostLayout>,
        mut host: Option<HostStage>,
        stall: std::time::Duration,
        failover: Option<Duration>,
        (secret, peer_timeout): (crate::protocol::auth::Secret, Duration),
    ) -> std::io::Result<Io> {
        if let Some(h) = &mut host {
            poll.registry().register(&mut h.doorbell.sock, DOORBELL, Interest::READABLE)?;
        }
        let n = streams.len();
        let io = Io {
            rank,
            namespace,
            layout,
            ops: Mutex::new(OpTable::default()),
            send: SendSide::new(ConnTable::with_room(n), poll.registry().try_clone()?),
            admission: Admission::new(credit, spread),
            recv: RecvSide::new(Waker::new(poll.registry(), WAKER)?, max_payload),
            failover: Failover::new(failover),
            mend: mend::Mending::new(secret, peer_timeout),
            host: HostSide::new(host, stall),
            trace: Tracing::default(),
        };
        io.add_conns(streams)?;
        Ok(io)
    }

    pub fn stats(&self) -> IoStats {
        let (unreceived_chunks, unreceived_bytes) = self.admission.unreceived();
        let (pushed_by_ref, pushed_by_socket, pushed_zeros, pushed_no_result) = self.send.counts.snapshot();
        IoStats { pushed_by_ref, pushed_by_socket, pushed_zeros, pushed_no_result, unreceived_chunks, unreceived_bytes }
    }

    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// The data connections, by slot.
    pub fn conns(&self) -> &ConnTable {
        &self.send.conns
    }

    /// This worker's part in its host's stage, when other workers share
    /// the host (and host reduction is on).
    pub fn host_stage(&self) -> Option<&HostStage> {
        self.host.stage.as_ref()
    }

    fn ops(&self) -> MutexGuard<'_, OpTable> {
        self.ops.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn stop(&self) {
        self.recv.stop();
    }

    /// Ask the I/O thread to fail everything in flight (it owns the receive
    /// buffers, so only it may release them).
    pub fn request_fail(&self, msg: String) {
        self.recv.request_fail(msg);
    }

    /// Fail every op in flight. Only called on the I/O thread. `job_failed`:
    /// the job failed (recorded for every later call), else this worker is
    /// shutting down.
    fn fail_all(&self, msg: String, owner: &dyn Completion, job_failed: bool) {
        let mut ops = self.ops();
        let msg = ops.failed.get_or_insert(msg).clone();
        for c in self.send.conns.iter() {
            c.send().clear();
        }
        *self.admission.spread() = Spread::default();
        let drained: Vec<Active> = ops.active.drain().map(|(_, a)| a).collect();
        drop(ops);
        if job_failed {
            // The scheduler hears why from this worker (not only that it left).
            owner.fail_job(msg.clone());
        }
        for a in drained {
            owner.finish_op(&a.op, Some(msg.clone()));
        }
    }

    /// Server connections `conns` belong to a lost server: from now on
    /// nothing read from them counts. (A server that was only frozen may
    /// come back and answer rounds its chunks' new servers now hold.)
    pub fn write_off(&self, conns: &[usize]) {
        self.send.write_off(conns);
    }

    /// Split the credit across connections in proportion to the bytes placed
    /// on each (the whole budget is `credit` x connections in use). A
    /// window-limited connection moves credit/RTT, so equal credits would
    /// give every server the same rate, while the BytePS split gives a
    /// CPU-only server up to 2(n-1)/(n-k) times a colocated one's bytes;
    /// with equal credits its links idle while the small shares finish.
    /// `placed`: the tensor was declared (true) or released (false).
    pub fn note_placement(&self, spec: &TensorSpec, placed: bool) {
        let shares = {
            let mut bytes = self.admission.placed();
            if !spec.members.is_empty() && spec.members.binary_search(&self.rank).is_err() {
                return; // not a member: never pushes it
            }
            for (c, &slot) in spec.slots.iter().enumerate() {
                if spec.members.is_empty() && self.layout.owner(self.rank, spec.key, c as u32) != self.rank {
                    continue; // another worker on this host pushes it
                }
                let (lo, hi) = spec.chunk_range(c);
                let n = ((hi - lo) * spec.dtype.size()) as u64;
                if let Some(b) = bytes.get_mut(slot as usize) {
                    *b = if placed { *b + n } else { b.saturating_sub(n) };
                }
            }
            bytes.clone()
        };
        self.split_credit(&shares);
    }

    pub(super) fn split_credit(&self, shares: &[u64]) {
        for (c, credit) in self.send.conns.iter().zip(split_credit(self.admission.credit(), shares)) {
            c.send().credit = credit;
        }
        self.admission.set_auto(shares);
    }

    pub fn credit(&self) -> usize {
        self.admission.credit()
    }

    /// Change the base credit per connection (autotuning); a larger window
    /// is used from the next chunk each connection sends.
    pub fn set_credit(&self, bytes: usize) {
        self.admission.set_credit(bytes);
        let shares = self.admission.placed().clone();
        self.split_credit(&shares);
        self.pump_all(&(0..self.send.conns.len()).collect::<Vec<_>>());
    }

    /// Drop this worker's state of a released tensor (nothing of it in
    /// flight); with failover on, its last results stay a while (`Released`).
    pub fn forget(&self, spec: &Arc<TensorSpec>) {
        let shared = self.host.stage.as_ref().and_then(|h| h.forget(spec.key));
        {
            let mut ops = self.ops();
            let last_round = ops.rounds.remove(&spec.key).and_then(|r| r.checked_sub(1));
            let kept = ops.kept.remove(&spec.key);
            if self.failover.on {
                ops.released.push_back(Released { at: Instant::now(), spec: spec.clone(), last_round, kept, shared });
                self.failover.prune_released(&mut ops);
            }
        }
        self.note_placement(spec, false);
    }

    /// Hand a failover to the I/O thread (see `IoCore::apply_failover`).
    pub fn fail_over(&self, note: FailoverNote) {
        self.failover.note(note);
        self.recv.wake();
    }

    /// The newest placement of every key a failover moved, updated by the
    /// control thread before the client's table, so it is never older than
    /// a spec an op was submitted with. Ops start, and failovers apply,
    /// with it rather than with the note's spec: a note queued before a
    /// later one must not move chunks back (two servers lost at once).
    /// A leaf lock: nothing is locked while it is held.
    pub fn latest(&self) -> MutexGuard<'_, HashMap<u32, (u32, Arc<TensorSpec>)>> {
        self.failover.latest()
    }

    /// Worker `rank` left the job while this one goes on: a host-stage
    /// round submitted from now on checks for it.
    pub fn set_left(&self, rank: u32) {
        self.host.set_left(rank);
    }

    /// An active round of this host's stage that still waits for worker
    /// `rank`'s contribution (so, if it left, will never complete).
    pub fn waits_for_local(&self, rank: u32) -> Option<String> {
        let h = self.host.stage.as_ref()?;
        let local = h.workers.iter().position(|&r| r == rank)?;
        let ops = self.ops();
        ops.active
            .values()
            .find(|a| a.host.as_ref().is_some_and(|hr| hr.shared.missing(a.round) & (1 << local) != 0))
            .map(|a| a.spec.name.clone())
    }

    /// Record every chunk this worker pushes from now on in a timeline at
    /// `path` (`crate::timeline`), replacing one already recorded.
    pub fn start_timeline(&self, path: &str) -> std::io::Result<()> {
        self.trace.open(path, self.rank)
    }

    /// Stop recording; returns once the file is written.
    pub fn stop_timeline(&self) {
        self.trace.stop();
    }
}
