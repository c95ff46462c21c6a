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
//! tensor key, chunk index); keys are assigned by the scheduler in first-use
//! order, which makes ties FIFO. No deadlock: the unreceived window drains
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
//! each chunk pushed on a connection is in a `flow::Phase` (queued, on the
//! wire, received, done; `flow::InFlight` keeps the credit windows and the
//! timeline stamps in step with it) and follows a `flow::Route` fixed when
//! its round starts (caller's buffer, kept copy, host owner, host peer);
//! each connection is in a `links::LinkState` (live, broken, written off,
//! dead). The data plane reports back to the client only through
//! `Completion`.
//!
//! Where things are: `submit` (starting a round), `admission` (windows,
//! the spread, credit split), `links` (the connection table, the pump),
//! `flow` (phases, routes), `receive` (frame handlers, landing results),
//! `thread` (the I/O thread's loop and its checks), `host` (the host
//! stage), `moves` (failover and joins: a pure `moves::plan`, then applied),
//! `trace` (the chunk timeline).
//!
//! Locks, outermost first; a lock is never taken while one after it is
//! held: the I/O thread's `IoCore` → `ops` (the op table) → a connection's
//! `send` → `spread`. Leaf locks (nothing taken while held): `latest`,
//! `placed`, `notes`, `fail_requested`, `trace`, `trace_writer`, the
//! connection table's `append`. The client's table lock is never taken
//! while `ops` is held: ops complete after it is released.

mod admission;
mod flow;
mod host;
mod links;
mod moves;
mod receive;
mod submit;
mod thread;
mod trace;

pub use links::{ConnTable, NewConn};
pub use moves::FailoverNote;
pub use thread::IoThread;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use mio::{Interest, Poll, Token, Waker};

use admission::Spread;
use flow::Active;
use moves::{Kept, Released};

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

/// The send side and the table of operations in flight, shared by callers and the I/O thread.
pub struct Io {
    pub conns: ConnTable,
    registry: mio::Registry,
    ops: Mutex<OpTable>,
    /// The base credit per connection (`set_credit` may change it).
    credit: AtomicUsize,
    /// Bytes of all declared tensors placed on each connection's server thread.
    placed: Mutex<Vec<u64>>,
    namespace: u32,
    max_payload: u32,
    waker: Waker,
    stop: AtomicBool,
    fail_requested: Mutex<Option<String>>,
    /// This worker's rank, and who pushes what.
    rank: u32,
    layout: Arc<HostLayout>,
    /// Present when other workers share this host (and host reduction is on).
    pub host: Option<HostStage>,
    /// A host-stage round waiting longer than this is reported (as servers do).
    stall: std::time::Duration,
    /// A worker that left the job (`NONE_LEFT`: none); see `Shared::on_peer_left`.
    pub left: AtomicU32,
    /// Chunks pushed by reference and through sockets, since the start.
    pushed_by_ref: AtomicU64,
    pushed_by_socket: AtomicU64,
    /// Of those through sockets, pushes of zeros (a header only).
    pushed_zeros: AtomicU64,
    /// The job survives a lost server (`Welcome::failover`): keep results
    /// apart (`Kept`) and wait for the failover when a connection breaks.
    pub failover: bool,
    pub peer_timeout: Duration,
    /// Failovers for the I/O thread to apply.
    notes: Mutex<Vec<FailoverNote>>,
    /// By key, the newest placement a failover gave it, with the failover's
    /// batch (see `latest`).
    latest: Mutex<HashMap<u32, (u32, Arc<TensorSpec>)>>,
    /// The chunks' timeline, while one is recorded (`start_timeline`), and
    /// its writer thread.
    trace: std::sync::RwLock<Option<Arc<crate::timeline::Trace>>>,
    /// Whether `trace` holds one: read per chunk sent, without the lock.
    trace_on: AtomicBool,
    trace_writer: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Reads a connection on a waiting caller's thread, once the I/O thread
    /// runs (see `IoCore::poll_for`).
    poller: OnceLock<super::op::Poller>,
    /// See `Spread` and `spread_limit`.
    spread: Mutex<Spread>,
    spread_fixed: Option<usize>,
    /// The default spread for the current placement (`split_credit`).
    spread_auto: AtomicUsize,
    /// Some connection waits for the spread to shrink (see `Conn::spread_blocked`).
    spread_blocked: AtomicBool,
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
    ) -> std::io::Result<Io> {
        if let Some(h) = &mut host {
            poll.registry().register(&mut h.doorbell.sock, DOORBELL, Interest::READABLE)?;
        }
        let n = streams.len();
        let io = Io {
            placed: Mutex::new(Vec::new()),
            conns: ConnTable::with_room(n),
            registry: poll.registry().try_clone()?,
            ops: Mutex::new(OpTable::default()),
            credit: AtomicUsize::new(credit),
            namespace,
            max_payload,
            waker: Waker::new(poll.registry(), WAKER)?,
            stop: AtomicBool::new(false),
            fail_requested: Mutex::new(None),
            rank,
            layout,
            host,
            stall,
            left: AtomicU32::new(NONE_LEFT),
            pushed_by_ref: AtomicU64::new(0),
            pushed_by_socket: AtomicU64::new(0),
            pushed_zeros: AtomicU64::new(0),
            failover: failover.is_some(),
            peer_timeout: failover.unwrap_or_default(),
            notes: Mutex::new(Vec::new()),
            latest: Mutex::new(HashMap::new()),
            trace: Default::default(),
            trace_on: AtomicBool::new(false),
            trace_writer: Mutex::new(None),
            poller: OnceLock::new(),
            spread: Mutex::new(Spread::default()),
            spread_fixed: spread,
            spread_auto: AtomicUsize::new(0),
            spread_blocked: AtomicBool::new(false),
        };
        io.add_conns(streams)?;
        Ok(io)
    }

    pub fn stats(&self) -> IoStats {
        let (unreceived_chunks, unreceived_bytes) = self.unreceived();
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        IoStats {
            pushed_by_ref: load(&self.pushed_by_ref),
            pushed_by_socket: load(&self.pushed_by_socket),
            pushed_zeros: load(&self.pushed_zeros),
            unreceived_chunks,
            unreceived_bytes,
        }
    }

    pub fn rank(&self) -> u32 {
        self.rank
    }

    fn ops(&self) -> MutexGuard<'_, OpTable> {
        self.ops.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.waker.wake();
    }

    /// Ask the I/O thread to fail everything in flight (it owns the receive
    /// buffers, so only it may release them).
    pub fn request_fail(&self, msg: String) {
        self.fail_requested.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(msg);
        let _ = self.waker.wake();
    }

    /// Fail every op in flight. Only called on the I/O thread. `job_failed`:
    /// the job failed (recorded for every later call), else this worker is
    /// shutting down.
    fn fail_all(&self, msg: String, owner: &dyn Completion, job_failed: bool) {
        let mut ops = self.ops();
        let msg = ops.failed.get_or_insert(msg).clone();
        for c in self.conns.iter() {
            c.send().clear();
        }
        *self.spread() = Spread::default();
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
}
