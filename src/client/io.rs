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
//! go quiet here (`SendHalf::lost`) until the scheduler says where its
//! chunks went, at most a few peer timeouts. Then this thread re-sends every
//! push the lost server had not answered (a caller's buffer, or the host's
//! sum, still holds it: results land apart, in `Kept` or the segment's
//! result buffer, and are copied over once whole) and restores the last
//! result it holds of each moved chunk, which other workers may have
//! missed. Tensors released lately keep theirs a while (`Released`).
//!
//! Locks: `ops` before a connection's `send`, never the reverse; the client's
//! table lock is only taken inside `ops` (completing an op), never around it.

use std::collections::{BinaryHeap, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use mio::net::TcpStream;
use mio::{Events, Interest, Poll, Token, Waker};

use super::op::Op;
use super::{ClientError, Shared};
use crate::host::{HostStage, Staging};
use crate::placement::HostLayout;
use crate::protocol::{decode_stall, DType, Header, MsgType, ReadError, TensorSpec, MAX_JOINED_SLOTS, NO_SERVER};
use crate::transport::{ConnError, Connection, Drain, Frame, FrameReader, FrameWriter, Outgoing};

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

/// One chunk of a push_pull: a slice of the caller's buffer.
#[derive(PartialEq, Eq)]
struct ChunkSend {
    priority: i32,
    seq: u64,
    key: u32,
    chunk: u32,
    round: u32,
    flags: u16,
    dtype: DType,
    ptr: *const u8,
    len: usize,
    /// The data is in the host's shared segment, which the server maps:
    /// send only the header (PushRef).
    by_ref: bool,
    /// When it was queued (the timeline's QUEUED stage).
    queued: Instant,
}

/// Something waiting to be sent on a connection. Strict total order,
/// identical on every worker: higher priority first, then lower key
/// (earlier first use), then lower chunk index — never a `<=`-style comparator.
#[derive(PartialEq, Eq)]
enum SendItem {
    Chunk(ChunkSend),
    /// A frame with a payload of its own (DataHello, OptConfig, Restore):
    /// not a push, so it takes no credit and expects no result; these go
    /// out in the order they were queued, before every push.
    Control {
        seq: u64,
        header: Header,
        payload: Vec<u8>,
    },
}

impl SendItem {
    /// Position in the job-wide order (smaller = sooner).
    fn order(&self) -> Order {
        match self {
            SendItem::Chunk(c) => (std::cmp::Reverse(c.priority), c.key, c.chunk, c.seq),
            // Control frames: FIFO among themselves, before every push.
            SendItem::Control { seq, .. } => (std::cmp::Reverse(i32::MAX), 0, 0, *seq),
        }
    }
}
type Order = (std::cmp::Reverse<i32>, u32, u32, u64);

/// What the frame being written carries: a chunk of a caller's buffer, or
/// nothing beyond its encoded bytes (control frames).
#[derive(Clone, Copy)]
enum Carry {
    Chunk { ptr: *const u8, len: usize },
    Encoded,
}

/// Chunks pushed on a connection and not yet released: their bytes and order.
#[derive(Default)]
struct Window {
    bytes: usize,
    by_chunk: HashMap<(u32, u32), (Order, usize)>,
    orders: std::collections::BTreeMap<Order, usize>,
}

impl Window {
    fn insert(&mut self, key: u32, chunk: u32, order: Order, len: usize) {
        self.bytes += len;
        self.by_chunk.insert((key, chunk), (order, len));
        self.orders.insert(order, len);
    }
    fn remove(&mut self, key: u32, chunk: u32) -> bool {
        match self.by_chunk.remove(&(key, chunk)) {
            Some((order, len)) => {
                self.bytes -= len;
                self.orders.remove(&order);
                true
            }
            None => false,
        }
    }
    #[cfg(test)]
    fn contains(&self, key: u32, chunk: u32) -> bool {
        self.by_chunk.contains_key(&(key, chunk))
    }
    /// Whether a chunk of this order may go: within `limit`, or, over it,
    /// if it comes before every chunk in the window (preemption).
    fn admits(&self, order: Order, len: usize, limit: usize) -> bool {
        self.bytes == 0 || self.bytes + len <= limit || self.orders.keys().next().is_some_and(|&f| order < f)
    }
    /// Whether a chunk of this order may go when only the chunks that come
    /// before it in the job-wide order count against `limit`. The first
    /// unfinished chunk of the job has none before it, so it can always
    /// move (no deadlock), and a newly urgent tensor is not held back by
    /// less urgent chunks still waiting for other workers.
    fn admits_before(&self, order: Order, len: usize, limit: usize) -> bool {
        let mut ahead = 0;
        for (_, &l) in self.orders.range(..order) {
            ahead += l;
            if ahead + len > limit {
                return false;
            }
        }
        true
    }
    fn clear(&mut self) {
        *self = Window::default();
    }
}

/// Worker-wide: every chunk queued or in flight on any connection and not
/// yet received whole by its server. A chunk may go only while the bytes
/// before it in the job-wide order stay under the spread limit, so no
/// connection runs ahead of a slower one by more than that: each server's
/// flow then moves at its share of the worker's link (BytePS's split
/// assumes it), instead of TCP's equal share per flow, which let the flows
/// to colocated servers finish early and left the links of CPU-only
/// servers the last ones busy.
#[derive(Default)]
struct Spread {
    window: Window,
    /// Each entry's connection, to drop a lost one's.
    slot: HashMap<(u32, u32), usize>,
}

impl Spread {
    fn insert(&mut self, key: u32, chunk: u32, order: Order, len: usize, slot: usize) {
        // A chunk re-queued (failover) replaces its entry.
        self.window.remove(key, chunk);
        self.window.insert(key, chunk, order, len);
        self.slot.insert((key, chunk), slot);
    }
    fn remove(&mut self, key: u32, chunk: u32) {
        if self.window.remove(key, chunk) {
            self.slot.remove(&(key, chunk));
        }
    }
    fn drop_slot(&mut self, slot: usize) {
        let gone: Vec<(u32, u32)> = self.slot.iter().filter(|(_, &s)| s == slot).map(|(&k, _)| k).collect();
        for (key, chunk) in gone {
            self.remove(key, chunk);
        }
    }
}

impl Ord for SendItem {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        // BinaryHeap pops the greatest: the greatest is the soonest.
        o.order().cmp(&self.order())
    }
}
impl PartialOrd for SendItem {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}

#[derive(Default)]
struct SendHalf {
    heap: BinaryHeap<SendItem>,
    tx: FrameWriter<Carry>,
    /// Pushed, not yet received whole by the server (bounded by `credit`).
    unreceived: Window,
    /// Pushed, result not back yet: at most `credit` bytes of it may come
    /// before a chunk in the job-wide order for that chunk to go.
    unreturned: Window,
    /// This connection's credit (bytes); see `Io::note_placement`.
    credit: usize,
    /// When the connection broke (its server lost, see `scheduler::failover`):
    /// nothing is written to it any more.
    lost: Option<Instant>,
    /// Copies of pushes being written when their chunk moved (`Io::detach`),
    /// kept until the frame is out.
    detached: Vec<Box<[u8]>>,
    /// With a timeline: each chunk in flight's stages so far, by (key, chunk).
    stamps: HashMap<(u32, u32), Stamp>,
    /// Callers reading this connection themselves (`Io::quiet`).
    quiet_callers: u32,
}

/// When a chunk in flight was queued, started on the wire, and (if it was
/// not the round's last push) received whole by its server.
struct Stamp {
    queued: Instant,
    sent: Instant,
    received: Option<Instant>,
    round: u32,
    len: usize,
}
// SAFETY: the raw pointers point into caller buffers kept alive by their ops (see BufPtr).
unsafe impl Send for SendHalf {}

pub struct Conn {
    link: Connection,
    send: Mutex<SendHalf>,
    /// Its server was lost (`Io::write_off`): whatever still comes from it
    /// is ignored, even before the I/O thread applies the failover.
    written_off: AtomicBool,
    /// The server (rank) at the other end.
    pub server: u32,
    /// Its server shares this host's memory, so the host's sums go to it
    /// by reference.
    by_ref: bool,
    /// Its next chunk waits for the worker's spread to shrink (`Spread`).
    spread_blocked: AtomicBool,
}

/// A data connection to register: to thread `desc` of server `server`.
pub struct NewConn {
    pub stream: TcpStream,
    pub desc: String,
    pub server: u32,
    pub by_ref: bool,
}

/// The data connections, by slot: room for the job's first servers' threads
/// and `MAX_JOINED_SLOTS` more that may join while it runs. Appended by one
/// thread at a time; read by every thread without a lock (a slot, once
/// set, never changes), as the send path indexes it for every chunk.
pub struct ConnTable {
    slots: Box<[OnceLock<Conn>]>,
    len: AtomicUsize,
    append: Mutex<()>,
}

impl ConnTable {
    fn with_room(n: usize) -> ConnTable {
        let slots = (0..n + MAX_JOINED_SLOTS).map(|_| OnceLock::new()).collect();
        ConnTable { slots, len: AtomicUsize::new(0), append: Mutex::new(()) }
    }
    /// Append `c`; returns its slot, or None when there is no room.
    fn push(&self, c: Conn) -> Option<usize> {
        let _one = self.append.lock().unwrap_or_else(|e| e.into_inner());
        let i = self.len.load(Ordering::Acquire);
        self.slots.get(i)?.set(c).ok()?;
        self.len.store(i + 1, Ordering::Release);
        Some(i)
    }
    pub fn len(&self) -> usize {
        self.len.load(Ordering::Acquire)
    }
    pub fn get(&self, i: usize) -> Option<&Conn> {
        if i < self.len() {
            self.slots[i].get()
        } else {
            None
        }
    }
    pub fn iter(&self) -> impl Iterator<Item = &Conn> {
        (0..self.len()).filter_map(|i| self.get(i))
    }
}

impl std::ops::Index<usize> for ConnTable {
    type Output = Conn;
    /// Slots come from specs checked against `len()` when an op starts.
    fn index(&self, i: usize) -> &Conn {
        match self.get(i) {
            Some(c) => c,
            None => panic!("no data connection for slot {i} (the job has {})", self.len()),
        }
    }
}

impl Conn {
    pub fn desc(&self) -> &str {
        &self.link.peer
    }
    fn send(&self) -> MutexGuard<'_, SendHalf> {
        self.send.lock().unwrap_or_else(|e| e.into_inner())
    }
}

struct Active {
    op: Arc<Op>,
    spec: Arc<TensorSpec>,
    ptr: BufPtr,
    round: u32,
    priority: i32,
    flags: u16,
    got: Vec<bool>,
    remaining: usize,
    /// Set when the host's workers sum this tensor together first.
    host: Option<HostRound>,
}

/// A round through the host stage: which chunks this worker pushes (for
/// the host, from `staging`), and which of those it has queued.
struct HostRound {
    staging: Arc<Staging>,
    owned: Vec<bool>,
    pushed: Vec<bool>,
    /// When this worker contributed, and whether a stall was reported.
    since: std::time::Instant,
    stall_reported: bool,
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

/// A tensor's last results (failover on, no host stage): each chunk's
/// result lands here and is copied to the caller's buffer once whole, so
/// the buffer holds this worker's push until then, and the last result
/// stays until the next one arrives.
struct Kept {
    buf: Box<[u8]>,
    /// The round of the result each chunk holds (`NO_ROUND`: none yet).
    round: Vec<u32>,
}

const NO_ROUND: u32 = u32::MAX;

/// A released tensor's means to restore its last results after a failover
/// (another worker may still wait for one this worker received): kept for
/// `RELEASED_FOR` peer timeouts, and `RELEASED_BYTES` at most.
struct Released {
    at: Instant,
    spec: Arc<TensorSpec>,
    last_round: Option<u32>,
    kept: Option<Kept>,
    staging: Option<Arc<Staging>>,
}
const RELEASED_FOR: u32 = 3;
const RELEASED_BYTES: usize = 64 << 20;

/// A failover to apply on the I/O thread: the lost server's connections,
/// and the moved tensors' new specs, each with the worker's current spec
/// of it if it has one (an active op's or a released tensor's are found there).
pub struct FailoverNote {
    pub lost: u32,
    pub conns: Vec<usize>,
    pub moved: Vec<(Arc<TensorSpec>, Option<Arc<TensorSpec>>)>,
    /// OptConfig payloads of the moved tensors with a server-side optimizer:
    /// sent to their new servers before anything else, so a server that
    /// took a chunk over without its state refuses it (instead of summing).
    pub opt: HashMap<u32, Vec<u8>>,
}

/// Per-connection credits: `base` x (connections with bytes placed), split in
/// proportion to `placed`; never below `base / 4`, so a connection can always
/// keep a chunk moving. Before any placement every connection gets `base`.
pub fn split_credit(base: usize, placed: &[u64]) -> Vec<usize> {
    let total: u64 = placed.iter().sum();
    if total == 0 {
        return vec![base; placed.len()];
    }
    let budget = (base * placed.iter().filter(|&&b| b > 0).count()) as f64;
    placed.iter().map(|&b| ((budget * b as f64 / total as f64) as usize).max(base / 4)).collect()
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
    pub pushed_by_ref: AtomicU64,
    pub pushed_by_socket: AtomicU64,
    /// Of those through sockets, pushes of zeros (a header only).
    pub pushed_zeros: AtomicU64,
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
    /// Some connection waits for the spread to shrink (see `Conn::spread_blocked`).
    spread_blocked: AtomicBool,
}

pub const NONE_LEFT: u32 = u32::MAX;

/// Why something waiting for a worker that left can never complete.
pub fn left_message(left: u32, me: u32, what: &str) -> String {
    format!(
        "worker {left} has left the job (it shut down or exited) while worker {me} still needs it for {what}: \
         every worker must run the same collective operations"
    )
}

/// Where the chunks of a submission come from and go to.
struct ChunkSrc {
    ptr: *const u8,
    len: usize,
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
            spread_blocked: AtomicBool::new(false),
        };
        io.add_conns(streams)?;
        Ok(io)
    }

    /// Record every chunk this worker pushes from now on in a timeline at
    /// `path` (`crate::timeline`), replacing one already recorded.
    pub fn start_timeline(&self, path: &str) -> std::io::Result<()> {
        let who = format!("worker {}", self.rank);
        let (t, w) = crate::timeline::Trace::open(path, self.rank, &format!("gradhub {who}"), &[], &who)?;
        self.stop_timeline();
        *self.trace.write().unwrap_or_else(|e| e.into_inner()) = Some(t);
        self.trace_on.store(true, Ordering::Release);
        *self.trace_writer.lock().unwrap_or_else(|e| e.into_inner()) = Some(w);
        Ok(())
    }

    /// Stop recording; returns once the file is written.
    pub fn stop_timeline(&self) {
        self.trace_on.store(false, Ordering::Release);
        let t = self.trace.write().unwrap_or_else(|e| e.into_inner()).take();
        drop(t);
        // Ends when the last `Trace` is gone (the I/O thread may hold one for a moment).
        if let Some(w) = self.trace_writer.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = w.join();
        }
    }

    fn tracing(&self) -> Option<Arc<crate::timeline::Trace>> {
        self.trace.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Register data connections (the job's first servers', or one that
    /// joined: `ServerJoined`) as the next slots, each saying DataHello
    /// (this worker's rank) before anything else.
    pub fn add_conns(&self, streams: Vec<NewConn>) -> std::io::Result<()> {
        for nc in streams {
            let i = self.conns.len();
            let link = Connection::new(&self.registry, nc.stream, Token(i), nc.desc)?;
            let mut send = SendHalf { credit: self.credit.load(Ordering::Relaxed), ..Default::default() };
            // seq 0: ahead of every frame queued later.
            let mut hello = Header::new(MsgType::DataHello);
            (hello.namespace, hello.key) = (self.namespace, self.rank);
            send.heap.push(SendItem::Control { seq: 0, header: hello, payload: Vec::new() });
            let by_ref = nc.by_ref && self.host.is_some();
            let conn = Conn {
                link,
                send: Mutex::new(send),
                written_off: AtomicBool::new(false),
                server: nc.server,
                by_ref,
                spread_blocked: AtomicBool::new(false),
            };
            if self.conns.push(conn).is_none() {
                return Err(std::io::Error::other(format!("no room for data connection {i}")));
            }
            self.placed.lock().unwrap_or_else(|e| e.into_inner()).push(0);
            let _ = self.waker.wake(); // the I/O thread makes room to read it
            self.pump(i).map_err(|e| std::io::Error::other(format!("{}: {e}", self.conns[i].desc())))?;
        }
        Ok(())
    }

    pub fn rank(&self) -> u32 {
        self.rank
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
            let mut bytes = self.placed.lock().unwrap_or_else(|e| e.into_inner());
            for (c, &slot) in spec.slots.iter().enumerate() {
                if self.layout.owner(self.rank, spec.key, c as u32) != self.rank {
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

    fn split_credit(&self, shares: &[u64]) {
        for (c, credit) in self.conns.iter().zip(split_credit(self.credit.load(Ordering::Relaxed), shares)) {
            c.send().credit = credit;
        }
    }

    pub fn credit(&self) -> usize {
        self.credit.load(Ordering::Relaxed)
    }

    /// Change the base credit per connection (autotuning); a larger window
    /// is used from the next chunk each connection sends.
    pub fn set_credit(&self, bytes: usize) {
        self.credit.store(bytes.max(1), Ordering::Relaxed);
        let shares = self.placed.lock().unwrap_or_else(|e| e.into_inner()).clone();
        self.split_credit(&shares);
        self.pump_all(&(0..self.conns.len()).collect::<Vec<_>>());
    }

    /// Drop this worker's state of a released tensor (nothing of it in
    /// flight); with failover on, its last results stay a while (`Released`).
    pub fn forget(&self, spec: &Arc<TensorSpec>) {
        let staging = self.host.as_ref().and_then(|h| h.forget(spec.key));
        {
            let mut ops = self.ops();
            let last_round = ops.rounds.remove(&spec.key).and_then(|r| r.checked_sub(1));
            let kept = ops.kept.remove(&spec.key);
            if self.failover {
                ops.released.push_back(Released { at: Instant::now(), spec: spec.clone(), last_round, kept, staging });
                self.prune_released(&mut ops);
            }
        }
        self.note_placement(spec, false);
    }

    /// Drop released tensors' results once no failover can need them.
    fn prune_released(&self, ops: &mut OpTable) {
        let limit = self.peer_timeout * RELEASED_FOR;
        let size = |r: &Released| r.spec.numel as usize * r.spec.dtype.size();
        let mut bytes: usize = ops.released.iter().map(size).sum();
        while let Some(r) = ops.released.front() {
            if r.at.elapsed() < limit && bytes <= RELEASED_BYTES {
                break;
            }
            bytes -= size(r);
            ops.released.pop_front();
        }
    }

    /// Server connections `conns` belong to a lost server: from now on
    /// nothing read from them counts. (A server that was only frozen may
    /// come back and answer rounds its chunks' new servers now hold.)
    pub fn write_off(&self, conns: &[usize]) {
        for &i in conns {
            if let Some(c) = self.conns.get(i) {
                c.written_off.store(true, Ordering::SeqCst);
            }
        }
    }

    /// Chunk `chunk` of `key` moved off connection `from`, whose server is
    /// live: drop its queued sends there, let its bytes in flight leave the
    /// windows (the I/O thread ignores what the server still says of it:
    /// `IoThread::moved_off`). A push being
    /// written goes on from a copy (the frame cannot be cut short, and the
    /// op may complete at the new server and free the caller's buffer).
    fn detach(&self, from: &Conn, key: u32, chunk: u32) {
        let mut st = from.send();
        st.heap.retain(|i| !matches!(i, SendItem::Chunk(c) if c.key == key && c.chunk == chunk));
        st.unreceived.remove(key, chunk);
        st.unreturned.remove(key, chunk);
        st.stamps.remove(&(key, chunk));
        self.spread().remove(key, chunk);
        if let Some(Carry::Chunk { ptr, len }) = st.tx.current_mut() {
            // SAFETY: the chunk of a live op's buffer being written (see BufPtr).
            let copy: Box<[u8]> = unsafe { std::slice::from_raw_parts(*ptr, *len) }.into();
            (*ptr, *len) = (copy.as_ptr(), copy.len());
            st.detached.push(copy);
        }
    }

    /// Hand a failover to the I/O thread (see `IoThread::apply_failover`).
    pub fn fail_over(&self, note: FailoverNote) {
        self.notes.lock().unwrap_or_else(|e| e.into_inner()).push(note);
        let _ = self.waker.wake();
    }

    fn ops(&self) -> MutexGuard<'_, OpTable> {
        self.ops.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The newest placement of every key a failover moved, updated by the
    /// control thread before the client's table, so it is never older than
    /// a spec an op was submitted with. Ops start, and failovers apply,
    /// with it rather than with the note's spec: a note queued before a
    /// later one must not move chunks back (two servers lost at once).
    /// A leaf lock: nothing is locked while it is held.
    pub fn latest(&self) -> MutexGuard<'_, HashMap<u32, (u32, Arc<TensorSpec>)>> {
        self.latest.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn latest_spec(&self, key: u32) -> Option<Arc<TensorSpec>> {
        self.latest().get(&key).map(|(_, s)| s.clone())
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

    /// Start a push_pull: queue its chunks and start sending from this
    /// thread; through the host stage, first add them to the host's sums.
    pub fn submit(&self, s: Submission, shared: &Shared) {
        let round = match self.admit(&s) {
            Ok(Some(round)) => round,
            Ok(None) => return shared.finish_op(&s.op, None),
            Err(e) => return shared.finish_op(&s.op, Some(e)),
        };
        let n = s.spec.num_chunks();
        let es = s.spec.dtype.size();
        let (spec, base) = (s.spec.clone(), s.ptr);
        let chunk_src = move |c: usize| {
            let (a, b) = spec.chunk_range(c);
            // SAFETY: a..b lies within the buffer of numel elements the caller passed.
            ChunkSrc { ptr: unsafe { base.0.add(a * es) }, len: (b - a) * es }
        };
        let Some(h) = &self.host else {
            if n == 1 {
                // Small: its caller may read its result itself (`IoCore::poll_for`).
                if let Some(poll) = self.poller.get() {
                    s.op.set_poller(poll.clone(), s.spec.slots[0] as usize);
                }
            }
            let all: Vec<usize> = (0..n).collect();
            self.start(s, round, None, &all, chunk_src, shared);
            return;
        };
        let staging = match h.staging(&s.spec) {
            Ok(st) => st,
            Err(e) => return shared.finish_op(&s.op, Some(e)),
        };
        let key = s.spec.key;
        let owned: Vec<bool> = (0..n).map(|c| self.layout.owner(self.rank, key, c as u32) == self.rank).collect();
        // Contributions happen before the op is visible to the I/O thread
        // (the caller's buffer is read here, and only that thread may
        // complete an op); whatever completes meanwhile is picked up by
        // the ring to ourselves below.
        let (mut ready, mut ring) = (Vec::new(), 0u64);
        let abort = || shared.failure();
        let contributed = h.contribute(&staging, s.ptr.0, round, s.flags, self.rank == 0, &abort, &mut |c| {
            if c.complete {
                if owned[c.chunk] {
                    ready.push(c.chunk);
                } else {
                    ring |= 1 << crate::placement::owner_index(h.workers.len(), key, c.chunk as u32);
                }
            }
        });
        if let Err(e) = contributed {
            // Other workers of this host may be waiting for this sum: the job cannot go on.
            let msg = format!("worker {}: summing tensor '{}' on its host failed: {e}", self.rank, s.spec.name);
            shared.fail_job(msg.clone());
            return shared.finish_op(&s.op, Some(msg));
        }
        let hr = HostRound {
            staging: staging.clone(),
            owned,
            pushed: vec![false; n],
            since: std::time::Instant::now(),
            stall_reported: false,
        };
        let wire = |c: usize| {
            let (ptr, len) = staging.wire(c, round);
            ChunkSrc { ptr, len }
        };
        if self.start(s, round, Some(hr), &ready, wire, shared) {
            h.bells.ring_mask(ring | 1 << h.local);
        }
        // A local worker left while this was being submitted: see `Shared::on_peer_left`.
        let left = self.left.load(Ordering::Acquire);
        if left != NONE_LEFT {
            if let Some(name) = self.waits_for_local(left) {
                shared.fail_job(left_message(left, self.rank, &format!("push_pull '{name}' on their host")));
            }
        }
    }

    /// An active round of this host's stage that still waits for worker
    /// `rank`'s contribution (so, if it left, will never complete).
    pub fn waits_for_local(&self, rank: u32) -> Option<String> {
        let h = self.host.as_ref()?;
        let local = h.workers.iter().position(|&r| r == rank)?;
        let ops = self.ops();
        ops.active
            .values()
            .find(|a| a.host.as_ref().is_some_and(|hr| hr.staging.missing(a.round) & (1 << local) != 0))
            .map(|a| a.spec.name.clone())
    }

    /// Check a submission can start; its round, or None if it is empty.
    fn admit(&self, s: &Submission) -> Result<Option<u32>, String> {
        let mut ops = self.ops();
        if let Some(f) = &ops.failed {
            return Err(f.clone());
        }
        let key = s.spec.key;
        if ops.active.contains_key(&key) {
            return Err(format!("tensor '{}' is already in flight", s.spec.name));
        }
        let round = *ops.rounds.entry(key).or_insert(0);
        if s.spec.num_chunks() == 0 {
            ops.rounds.insert(key, round.wrapping_add(1));
            return Ok(None);
        }
        if let Some(&bad) = s.spec.slots.iter().find(|&&slot| slot as usize >= self.conns.len()) {
            return Err(format!("tensor '{}' placed on unknown slot {bad}", s.spec.name));
        }
        Ok(Some(round))
    }

    /// Make the op active and queue the chunks `push` (their bytes from
    /// `src`). Returns false if the job had failed meanwhile.
    fn start(
        &self,
        s: Submission,
        round: u32,
        host: Option<HostRound>,
        push: &[usize],
        src: impl Fn(usize) -> ChunkSrc,
        shared: &Shared,
    ) -> bool {
        let key = s.spec.key;
        let n = s.spec.num_chunks();
        let mut touched = Vec::new();
        {
            let mut ops = self.ops();
            if let Some(f) = &ops.failed {
                let f = f.clone();
                drop(ops);
                shared.finish_op(&s.op, Some(f));
                return false;
            }
            // Submitted with a spec a failover replaced meanwhile.
            let spec = self.latest_spec(key).unwrap_or(s.spec);
            if self.failover && host.is_none() && !ops.kept.contains_key(&key) {
                let bytes = spec.numel as usize * spec.dtype.size();
                ops.kept.insert(key, Kept { buf: vec![0u8; bytes].into(), round: vec![NO_ROUND; n] });
            }
            let mut a = Active {
                op: s.op,
                spec,
                ptr: s.ptr,
                round,
                priority: s.priority,
                flags: s.flags,
                got: vec![false; n],
                remaining: n,
                host,
            };
            // Items go on the queues while `ops` is held, so a concurrent
            // failure either sees them (and drops them) or runs before them.
            for &c in push {
                if let Some(h) = &mut a.host {
                    h.pushed[c] = true;
                }
                let slot = self.queue_chunk(&mut ops.seq, &a, c, src(c));
                if !touched.contains(&slot) {
                    touched.push(slot);
                }
            }
            ops.active.insert(key, a);
        }
        self.pump_all(&touched);
        true
    }

    /// Put chunk `c` of an active op on its connection's queue.
    fn queue_chunk(&self, seq: &mut u64, a: &Active, c: usize, src: ChunkSrc) -> usize {
        let slot = a.spec.slots[c] as usize;
        *seq += 1;
        // Wholly outside the bytes the caller may have set: zeros, sent as a header.
        let (lo, hi) = a.spec.chunk_range(c);
        let es = a.spec.dtype.size();
        let zeros = a.host.is_none() && a.op.live.is_some_and(|(from, to)| hi * es <= from || lo * es >= to);
        let len = if zeros { 0 } else { src.len };
        let item = SendItem::Chunk(ChunkSend {
            priority: a.priority,
            seq: *seq,
            key: a.spec.key,
            chunk: c as u32,
            round: a.round,
            flags: if zeros { a.flags | crate::protocol::FLAG_ZEROS } else { a.flags },
            dtype: a.spec.dtype,
            ptr: src.ptr,
            len,
            by_ref: a.host.is_some() && self.conns[slot].by_ref,
            queued: Instant::now(),
        });
        if self.spread_limit() > 0 {
            // Before it is on a queue, so it cannot be sent (and received) first.
            self.spread().insert(a.spec.key, c as u32, item.order(), len, slot);
        }
        self.conns[slot].send().heap.push(item);
        slot
    }

    /// Callers reading connection `i` themselves (`CallerPoller`): the I/O
    /// thread is not woken for its data while there are any.
    fn quiet(&self, i: usize, on: bool) {
        let Some(c) = self.conns.get(i) else { return };
        let mut guard = c.send();
        let st = &mut *guard;
        if st.lost.is_some() || c.written_off.load(Ordering::SeqCst) {
            return; // taken out of the poller for good
        }
        st.quiet_callers = if on { st.quiet_callers + 1 } else { st.quiet_callers.saturating_sub(1) };
        if let Err(e) = c.link.quiet(&self.registry, &mut st.tx, st.quiet_callers > 0) {
            drop(guard);
            // Not watched any more would be a hang: fail loudly instead.
            self.request_fail(format!("{}: cannot change what the I/O thread watches: {e}", c.desc()));
        }
    }

    /// See `Client::unreceived`.
    pub fn unreceived(&self) -> (usize, usize) {
        let sp = self.spread();
        (sp.slot.len(), sp.window.bytes)
    }

    /// Bytes that may come before a chunk in the spread for it to go; 0: no limit.
    fn spread_limit(&self) -> usize {
        self.spread_fixed.unwrap_or_else(|| self.credit() * crate::SPREAD_CREDITS)
    }

    fn spread(&self) -> MutexGuard<'_, Spread> {
        self.spread.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Chunk `chunk` of `key` is no longer in the spread: pump the
    /// connections that waited for it to shrink (a failure there is theirs,
    /// not the caller's connection's).
    fn spread_done(&self, key: u32, chunk: u32) {
        if self.spread_fixed == Some(0) {
            return; // off for good: nothing was counted
        }
        {
            let mut sp = self.spread();
            sp.remove(key, chunk);
            if !self.spread_blocked.swap(false, Ordering::AcqRel) {
                return;
            }
        }
        let blocked: Vec<usize> =
            (0..self.conns.len()).filter(|&i| self.conns[i].spread_blocked.swap(false, Ordering::AcqRel)).collect();
        self.pump_all(&blocked);
    }

    fn pump_all(&self, slots: &[usize]) {
        for &slot in slots {
            if let Err(why) = self.pump(slot) {
                self.request_fail(format!("{}: {why}", self.conns[slot].desc()));
                return;
            }
        }
    }

    /// Queue a control frame for `key` on connection `slot`, ahead of any
    /// push queued after it (highest priority, FIFO among equals).
    pub fn send_control(&self, slot: usize, key: u32, msg_type: MsgType, payload: Vec<u8>) -> Result<(), ClientError> {
        let c = self.conns.get(slot).ok_or_else(|| ClientError::Failed(format!("no connection for slot {slot}")))?;
        {
            let mut ops = self.ops();
            if let Some(f) = &ops.failed {
                return Err(ClientError::Failed(f.clone()));
            }
            ops.seq += 1;
            let mut header = Header::new(msg_type);
            (header.namespace, header.key) = (self.namespace, key);
            c.send().heap.push(SendItem::Control { seq: ops.seq, header, payload });
        }
        self.pump(slot).map_err(|e| ClientError::Failed(format!("{}: {e}", c.desc())))
    }

    /// Send as much as the credit and the socket allow on connection `i`.
    fn pump(&self, i: usize) -> Result<(), ConnError> {
        let c = &self.conns[i];
        let mut guard = c.send();
        if guard.lost.is_some() {
            return Ok(());
        }
        let result = self.pump_locked(i, &mut guard);
        match result {
            Err(e) if self.failover && broke(&e) => {
                // The server may be lost: its chunks will move (or the wait times out).
                log::warn!(target: &format!("worker {}", self.rank), "{}: {e}; waiting for the scheduler", c.desc());
                guard.lost = Some(Instant::now());
                Ok(())
            }
            other => other,
        }
    }

    fn pump_locked(&self, i: usize, st: &mut SendHalf) -> Result<(), ConnError> {
        let c = &self.conns[i];
        let (heap, unreceived, unreturned, credit) = (&mut st.heap, &mut st.unreceived, &mut st.unreturned, st.credit);
        let ns = self.namespace;
        let (tracing, stamps) = (self.trace_on.load(Ordering::Acquire), &mut st.stamps);
        let next = || {
            if let SendItem::Chunk(top) = heap.peek()? {
                let order = heap.peek()?.order();
                if !(unreceived.admits(order, top.len, credit) && unreturned.admits_before(order, top.len, credit)) {
                    return None;
                }
                let limit = self.spread_limit();
                if limit > 0 {
                    // Flags set under the lock, so a `spread_done` either
                    // came before this check or sees them.
                    let sp = self.spread();
                    if !sp.window.admits_before(order, top.len, limit) {
                        c.spread_blocked.store(true, Ordering::Release);
                        self.spread_blocked.store(true, Ordering::Release);
                        return None;
                    }
                }
            }
            let item = heap.pop()?;
            let order = item.order();
            match item {
                SendItem::Chunk(ch) => {
                    let mut h = Header {
                        msg_type: MsgType::Push,
                        flags: ch.flags,
                        dtype: ch.dtype,
                        namespace: ns,
                        key: ch.key,
                        chunk: ch.chunk,
                        round: ch.round,
                        priority: ch.priority,
                        payload_len: ch.len as u32,
                    };
                    unreceived.insert(ch.key, ch.chunk, order, ch.len);
                    unreturned.insert(ch.key, ch.chunk, order, ch.len);
                    if tracing {
                        let (queued, sent, round, len) = (ch.queued, Instant::now(), ch.round, ch.len);
                        stamps.insert((ch.key, ch.chunk), Stamp { queued, sent, received: None, round, len });
                    }
                    if ch.by_ref {
                        self.pushed_by_ref.fetch_add(1, Ordering::Relaxed);
                        h.msg_type = MsgType::PushRef;
                        h.payload_len = 0;
                        return Some(Outgoing::encoded(Carry::Encoded, h.encode().to_vec()));
                    }
                    self.pushed_by_socket.fetch_add(1, Ordering::Relaxed);
                    if ch.flags & crate::protocol::FLAG_ZEROS != 0 {
                        self.pushed_zeros.fetch_add(1, Ordering::Relaxed);
                    }
                    Some(Outgoing::frame(Carry::Chunk { ptr: ch.ptr, len: ch.len }, &h))
                }
                SendItem::Control { mut header, payload, .. } => {
                    header.payload_len = payload.len() as u32;
                    Some(Outgoing::encoded(Carry::Encoded, [&header.encode()[..], &payload].concat()))
                }
            }
        };
        let payload = |c: &Carry| match *c {
            // SAFETY: ptr/len describe a chunk of a live caller buffer (see BufPtr).
            Carry::Chunk { ptr, len } => unsafe { std::slice::from_raw_parts(ptr, len) },
            Carry::Encoded => &[],
        };
        let r = c.link.pump(&self.registry, &mut st.tx, next, payload);
        if !st.detached.is_empty() && st.tx.idle() {
            st.detached.clear();
        }
        r
    }

    /// Fail every op in flight. Only called on the I/O thread. `job_failed`:
    /// the job failed (recorded for every later call), else this worker is
    /// shutting down.
    fn fail_all(&self, msg: String, shared: &Shared, job_failed: bool) {
        let mut ops = self.ops();
        let msg = ops.failed.get_or_insert(msg).clone();
        for c in self.conns.iter() {
            let mut st = c.send();
            st.heap.clear();
            st.tx.clear();
            st.unreceived.clear();
            st.unreturned.clear();
            st.stamps.clear();
        }
        *self.spread() = Spread::default();
        let drained: Vec<Active> = ops.active.drain().map(|(_, a)| a).collect();
        drop(ops);
        if job_failed {
            // The scheduler hears why from this worker (not only that it left).
            shared.fail_job(msg.clone());
        }
        for a in drained {
            shared.finish_op(&a.op, Some(msg.clone()));
        }
    }
}

/// Whether an error means the connection broke (its server may be lost),
/// not that the server said or sent something wrong.
fn broke(e: &ConnError) -> bool {
    matches!(e, ConnError::Io(_) | ConnError::Read(ReadError::Closed | ReadError::ClosedMidFrame | ReadError::Io(_)))
}

/// Where this worker holds a tensor's last results (see `Kept`).
struct Held<'a> {
    spec: &'a TensorSpec,
    kept: Option<&'a Kept>,
    staging: Option<&'a Arc<Staging>>,
}

impl Io {
    /// Queue a `Restore` of chunk `c`'s result of round `last`, if this
    /// worker holds it (it pushes the chunk, and received that round).
    fn queue_restore(&self, seq: &mut u64, from: &Held, c: usize, last: Option<u32>, touched: &mut Vec<usize>) -> bool {
        let Some(round) = last else { return false };
        let spec = from.spec;
        let data: Vec<u8> = match (from.staging, from.kept) {
            (Some(st), _) => {
                if self.layout.owner(self.rank, spec.key, c as u32) != self.rank || !st.has_result(c, round) {
                    return false;
                }
                let (p, len) = st.result(c);
                // SAFETY: the chunk's result in the host's segment, which the
                // next round's result cannot overwrite before this worker's
                // next round (it is this thread's to receive).
                unsafe { std::slice::from_raw_parts(p, len) }.to_vec()
            }
            (None, Some(k)) if k.round[c] == round => {
                let (s, e) = spec.chunk_range(c);
                let es = spec.dtype.size();
                k.buf[s * es..e * es].to_vec()
            }
            _ => return false,
        };
        let slot = spec.slots[c] as usize;
        let Some(conn) = self.conns.get(slot) else { return false };
        let mut header = Header::new(MsgType::Restore);
        (header.namespace, header.key, header.chunk, header.round, header.dtype) =
            (self.namespace, spec.key, c as u32, round, spec.dtype);
        *seq += 1;
        conn.send().heap.push(SendItem::Control { seq: *seq, header, payload: data });
        if !touched.contains(&slot) {
            touched.push(slot);
        }
        true
    }
}

/// Where an incoming result goes: chunk `chunk` of tensor `key`, `len`
/// bytes at `dst` in the caller's buffer.
#[derive(Clone, Copy)]
struct ResultDest {
    key: u32,
    chunk: usize,
    dst: *mut u8,
    len: usize,
}

// SAFETY: `dst` points into an active op's buffer, which stays valid until
// the op completes; results are written and ops completed only by the
// holder of the `IoCore` lock (the I/O thread, or a caller waiting on a
// one-chunk op: `IoCore::poll_for`).
unsafe impl Send for ResultDest {}

/// What a caller spinning on an op whose result comes on connection `i`
/// runs: read it, unless the I/O thread is at it (then that thread delivers
/// it); meanwhile the I/O thread is not woken for that connection. Saves
/// the I/O thread's wake-up on the way from the socket to the caller, which
/// on a small round trip competes for the cores with the server and the
/// caller. (Weak: the ops hold it.)
struct CallerPoller {
    core: std::sync::Weak<Mutex<IoCore>>,
    shared: std::sync::Weak<Shared>,
}

impl super::op::ConnPoller for CallerPoller {
    fn poll(&self, i: usize) {
        if let Some(core) = self.core.upgrade() {
            if let Ok(mut c) = core.try_lock() {
                c.poll_for(i);
            }
        }
    }
    fn quiet(&self, i: usize, on: bool) {
        if let Some(shared) = self.shared.upgrade() {
            shared.io.quiet(i, on);
        }
    }
}

/// The I/O thread: waits for events and hands them to the receiving side.
pub struct IoThread {
    poll: Poll,
    core: Arc<Mutex<IoCore>>,
}

/// The receiving side: what the I/O thread does with events, behind a lock
/// so that a caller waiting for a small result may read it itself (one
/// thread hop fewer: `Io::poller`).
pub struct IoCore {
    shared: Arc<Shared>,
    rx: Vec<FrameReader<ResultDest>>,
    failed: bool,
    /// Local workers to ring once the current event is handled (host stage).
    bells: u64,
    /// By connection: its server was lost and taken over (never read again).
    dead: Vec<bool>,
    /// By connection: chunks moved off its (live) server to one that
    /// joined; whatever it still sends about them is stale and dropped.
    moved_off: Vec<HashSet<(u32, u32)>>,
    /// Connections given their first read and write here (see `run`).
    seen: usize,
}

impl IoThread {
    pub fn new(poll: Poll, shared: Arc<Shared>) -> IoThread {
        let n = shared.io.conns.len();
        let rx = (0..n).map(|_| FrameReader::default()).collect();
        let moved_off = (0..n).map(|_| HashSet::new()).collect();
        let core =
            IoCore { shared: shared.clone(), rx, failed: false, bells: 0, dead: vec![false; n], moved_off, seen: n };
        let core = Arc::new(Mutex::new(core));
        let poller = CallerPoller { core: Arc::downgrade(&core), shared: Arc::downgrade(&shared) };
        let _ = shared.io.poller.set(Arc::new(poller));
        IoThread { poll, core }
    }

    fn core(&self) -> MutexGuard<'_, IoCore> {
        self.core.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn run(mut self) {
        let mut events = Events::with_capacity(256);
        // Only the host stage has rounds to watch here (servers watch
        // theirs), and lost connections wait for a failover.
        let shared = self.core().shared.clone();
        let io = &shared.io;
        let tick = match (&io.host, io.failover) {
            (None, false) => None,
            _ => Some(
                (io.stall.min(io.peer_timeout.max(Duration::from_millis(200))) / 4)
                    .clamp(Duration::from_millis(50), Duration::from_secs(1)),
            ),
        };
        loop {
            {
                let mut core = self.core();
                core.grow();
                if tick.is_some() && !core.failed {
                    if io.host.is_some() {
                        core.check_host_stalls();
                    }
                    core.check_lost();
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
    fn handle(&mut self, events: &Events) -> bool {
        if self.shared.io.stop.load(Ordering::SeqCst) {
            // Shut down: what was sent can no longer complete. Fail it
            // here, where the receive buffers are owned.
            self.fail("gradhub was shut down".into(), false);
            return false;
        }
        let requested = self.shared.io.fail_requested.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(msg) = requested {
            self.fail(msg, true);
        }
        self.grow();
        let notes = std::mem::take(&mut *self.shared.io.notes.lock().unwrap_or_else(|e| e.into_inner()));
        for note in notes {
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
    fn poll_for(&mut self, i: usize) {
        self.grow();
        if i < self.seen {
            self.on_event(i, Some(Drain::Short), false);
        }
    }

    /// Connections added since (a server joined): room to read them.
    fn grow(&mut self) {
        let n = self.shared.io.conns.len();
        if n > self.rx.len() {
            self.rx.resize_with(n, FrameReader::default);
            self.dead.resize(n, false);
            self.moved_off.resize_with(n, HashSet::new);
        }
    }

    fn fail(&mut self, msg: String, job_failed: bool) {
        self.failed = true;
        // Receive targets may be released now: forget them.
        self.rx.iter_mut().for_each(|r| {
            r.reset();
        });
        let shared = self.shared.clone();
        shared.io.fail_all(msg, &shared, job_failed);
    }

    /// `read`: whether to read, and how far (`Drain`).
    fn on_event(&mut self, i: usize, read: Option<Drain>, writable: bool) {
        if self.failed || i >= self.rx.len() || self.dead[i] {
            return;
        }
        let mut res = Ok(());
        if let Some(drain) = read {
            res = self.on_readable(i, drain);
        }
        if res.is_ok() && writable {
            res = self.shared.io.pump(i);
        }
        if let Err(e) = &res {
            if self.shared.io.failover && broke(e) && self.shared.failure().is_none() {
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
            let msg = format!("{}: {why}", self.shared.io.conns[i].desc());
            self.fail(msg, true);
        }
        self.ring_pending();
    }

    /// Connection `i` broke, its server probably lost: stop using it and
    /// wait for the scheduler's failover (`check_lost` bounds the wait).
    fn on_lost(&mut self, i: usize, why: String) {
        let io = &self.shared.io;
        let c = &io.conns[i];
        self.rx[i].reset();
        c.link.deregister(&io.registry);
        let mut st = c.send();
        if st.lost.is_none() {
            st.lost = Some(Instant::now());
        }
        log::warn!(target: &format!("worker {}", io.rank), "{}: {why}; waiting for the scheduler's failover", c.desc());
    }

    /// Fail the job if a broken connection's server was not taken over
    /// within a few peer timeouts (the scheduler reports a lost server
    /// within one): the server may be alive, with only this link down.
    fn check_lost(&mut self) {
        let io = &self.shared.io;
        let limit = io.peer_timeout * 3;
        // Over the connections this thread has grown into: one added since
        // (a server that joined, on the control thread) is not lost yet.
        let late = (0..self.dead.len())
            .find(|&i| !self.dead[i] && io.conns[i].send().lost.is_some_and(|t| t.elapsed() > limit));
        if let Some(i) = late {
            let msg = format!(
                "{}: the connection broke and the scheduler reported no failover within {:.1}s",
                io.conns[i].desc(),
                limit.as_secs_f64()
            );
            self.shared.fail_job(msg);
        }
    }

    /// The scheduler moved a lost server's chunks (`FailoverNote`): drop its
    /// connections, re-send what it had not answered to the chunks' new
    /// servers and restore the last results this worker holds of them.
    fn apply_failover(&mut self, note: FailoverNote) {
        let shared = self.shared.clone();
        let io = &shared.io;
        for &i in &note.conns {
            if i >= self.dead.len() || self.dead[i] {
                continue;
            }
            self.dead[i] = true;
            self.rx[i].reset();
            let c = &io.conns[i];
            c.link.deregister(&io.registry);
            let mut st = c.send();
            st.lost.get_or_insert_with(Instant::now);
            st.heap.clear();
            st.tx.clear();
            st.unreceived.clear();
            st.unreturned.clear();
            st.stamps.clear();
            drop(st);
            // What it held is re-queued below, or waits for nothing any more.
            io.spread().drop_slot(i);
        }
        let (mut touched, mut restored, mut resent) = (Vec::new(), 0usize, 0usize);
        {
            let mut guard = io.ops();
            let ops = &mut *guard;
            io.prune_released(ops);
            {
                let latest = io.latest();
                ops.applied.retain(|k, _| latest.contains_key(k));
            }
            for (noted, current) in &note.moved {
                let key = noted.key;
                // The newest placement, which this note's may already be behind.
                let spec = &io.latest_spec(key).unwrap_or_else(|| noted.clone());
                let old = match (ops.active.get(&key), ops.applied.insert(key, spec.clone())) {
                    (Some(a), _) => Some(a.spec.clone()),
                    (None, Some(prev)) => Some(prev),
                    (None, None) => match ops.released.iter().find(|r| r.spec.key == key) {
                        Some(r) => Some(r.spec.clone()),
                        None => current.clone(),
                    },
                };
                if let Some(cfg) = note.opt.get(&key) {
                    let mut slots = spec.slots.clone();
                    slots.sort_unstable();
                    slots.dedup();
                    for slot in slots {
                        let Some(conn) = io.conns.get(slot as usize) else { continue };
                        let mut header = Header::new(MsgType::OptConfig);
                        (header.namespace, header.key) = (io.namespace, key);
                        ops.seq += 1;
                        conn.send().heap.push(SendItem::Control { seq: ops.seq, header, payload: cfg.clone() });
                        if !touched.contains(&(slot as usize)) {
                            touched.push(slot as usize);
                        }
                    }
                }
                // Nothing of it here (never used by this worker yet).
                let Some(old) = old else { continue };
                // Chunks move only off lost servers: whatever changed server
                // is re-sent and restored, whichever loss this note is for
                // (with two at once, the later placement may come first).
                let n = old.num_chunks().min(spec.num_chunks());
                let moved: Vec<usize> = (0..n).filter(|&c| old.slots[c] != spec.slots[c]).collect();
                log::debug!(
                    target: &format!("worker {}", io.rank),
                    "failover from server {}: tensor '{}' chunks {:?} move from slots {:?} to {:?} (in flight: round {:?}, got {:?})",
                    note.lost,
                    spec.name,
                    moved,
                    moved.iter().map(|&c| old.slots[c]).collect::<Vec<_>>(),
                    moved.iter().map(|&c| spec.slots[c]).collect::<Vec<_>>(),
                    ops.active.get(&key).map(|a| a.round),
                    ops.active.get(&key).map(|a| moved.iter().map(|&c| a.got[c]).collect::<Vec<_>>()),
                );
                // Off a live server (a move to one that joined): stop
                // counting on it for these chunks.
                for &c in &moved {
                    let slot = old.slots[c] as usize;
                    if let Some(from) = io.conns.get(slot) {
                        if !from.written_off.load(Ordering::SeqCst) {
                            io.detach(from, key, c as u32);
                            if slot >= self.moved_off.len() {
                                self.grow(); // added (a server joined) since the loop grew
                            }
                            self.moved_off[slot].insert((key, c as u32));
                            // Its windows have room now: what waits for it may go.
                            if !touched.contains(&slot) {
                                touched.push(slot);
                            }
                        }
                    }
                    if let Some(back) = self.moved_off.get_mut(spec.slots[c] as usize) {
                        back.remove(&(key, c as u32)); // moved back
                    }
                }
                let seq = &mut ops.seq;
                if let Some(a) = ops.active.get_mut(&key) {
                    io.note_placement(&a.spec, false);
                    io.note_placement(spec, true);
                    a.spec = spec.clone();
                    for &c in &moved {
                        let last = if a.got[c] { Some(a.round) } else { a.round.checked_sub(1) };
                        let from =
                            Held { spec, kept: ops.kept.get(&key), staging: a.host.as_ref().map(|h| &h.staging) };
                        restored += io.queue_restore(seq, &from, c, last, &mut touched) as usize;
                        if a.got[c] {
                            continue;
                        }
                        let src = match &a.host {
                            Some(h) if h.pushed[c] => {
                                let (ptr, len) = h.staging.wire(c, a.round);
                                ChunkSrc { ptr, len }
                            }
                            Some(_) => continue, // pushed when the host's sum is ready, to the new server
                            None => {
                                let (s, e) = spec.chunk_range(c);
                                let es = spec.dtype.size();
                                // SAFETY: the chunk's range in the op's buffer.
                                ChunkSrc { ptr: unsafe { a.ptr.0.add(s * es) }, len: (e - s) * es }
                            }
                        };
                        let slot = io.queue_chunk(seq, a, c, src);
                        resent += 1;
                        if !touched.contains(&slot) {
                            touched.push(slot);
                        }
                    }
                    continue;
                }
                // Not in flight here: restore the last round this worker completed.
                let (last, kept, staging, released);
                if let Some(r) = ops.released.iter().find(|r| r.spec.key == key) {
                    (last, kept, staging, released) = (r.last_round, r.kept.as_ref(), r.staging.clone(), true);
                } else {
                    last = ops.rounds.get(&key).and_then(|r| r.checked_sub(1));
                    kept = ops.kept.get(&key);
                    staging = io.host.as_ref().and_then(|h| h.mapped(key));
                    released = false;
                }
                if !released {
                    // Its next rounds go to the new slots.
                    io.note_placement(&old, false);
                    io.note_placement(spec, true);
                }
                let from = Held { spec, kept, staging: staging.as_ref() };
                for &c in &moved {
                    restored += io.queue_restore(seq, &from, c, last, &mut touched) as usize;
                }
            }
        }
        match note.lost {
            NO_SERVER => log::info!(
                target: &format!("worker {}", io.rank),
                "chunks moved to a server that joined: re-sent {resent} push(es), restored {restored} result(s)"
            ),
            lost => log::warn!(
                target: &format!("worker {}", io.rank),
                "server {lost} was lost; its chunks moved: re-sent {resent} push(es), restored {restored} result(s)"
            ),
        }
        io.pump_all(&touched);
    }

    fn ring_pending(&mut self) {
        if let (Some(h), bells) = (&self.shared.io.host, std::mem::take(&mut self.bells)) {
            if bells != 0 {
                h.bells.ring_mask(bells);
            }
        }
    }

    /// Report host-stage rounds that have waited too long for a local
    /// worker's contribution: logged once, and quoted by a timed-out wait.
    fn check_host_stalls(&mut self) {
        let io = &self.shared.io;
        let Some(h) = &io.host else { return };
        let mut ops = io.ops();
        for a in ops.active.values_mut() {
            let Some(hr) = &mut a.host else { continue };
            let waited = hr.since.elapsed();
            if hr.stall_reported || waited < io.stall {
                continue;
            }
            let missing = hr.staging.missing(a.round);
            if missing == 0 {
                continue; // the host's sums are complete: servers watch the rest
            }
            hr.stall_reported = true;
            let ranks: Vec<u32> =
                h.workers.iter().enumerate().filter(|(l, _)| missing >> l & 1 == 1).map(|(_, &r)| r).collect();
            let msg = format!(
                "tensor '{}' round {} has waited {:.1}s for worker rank(s) {ranks:?} of this host to push_pull it",
                a.spec.name,
                a.round,
                waited.as_secs_f64()
            );
            log::warn!(target: &format!("worker {}", io.rank), "stall: {msg}");
            a.op.set_stall(msg);
        }
    }

    /// A local worker rang: push the owned chunks whose host sums are
    /// complete, copy out the results other owners published.
    fn scan_host(&mut self) {
        let shared = self.shared.clone();
        let io = &shared.io;
        let Some(h) = &io.host else { return };
        h.doorbell.drain();
        let mut touched = Vec::new();
        let mut copies = Vec::new();
        {
            let mut guard = io.ops();
            let ops = &mut *guard;
            for a in ops.active.values_mut() {
                let Some(hr) = &a.host else { continue };
                let mut push = Vec::new();
                for c in 0..a.got.len() {
                    if a.got[c] {
                        continue;
                    }
                    if hr.owned[c] {
                        if !hr.pushed[c] && hr.staging.ready(c, a.round) {
                            push.push(c);
                        }
                    } else if hr.staging.has_result(c, a.round) {
                        let (src, len) = hr.staging.result(c);
                        let (start, _) = a.spec.chunk_range(c);
                        // SAFETY: start is within the tensor.
                        let dst = unsafe { a.ptr.0.add(start * a.spec.dtype.size()) };
                        copies.push((a.spec.key, c, src, dst, len));
                    }
                }
                let staging = hr.staging.clone();
                for c in push {
                    let (ptr, len) = staging.wire(c, a.round);
                    let slot = io.queue_chunk(&mut ops.seq, a, c, ChunkSrc { ptr, len });
                    if let Some(hr) = &mut a.host {
                        hr.pushed[c] = true;
                    }
                    if !touched.contains(&slot) {
                        touched.push(slot);
                    }
                }
            }
        }
        io.pump_all(&touched);
        for (key, c, src, dst, len) in copies {
            // SAFETY: the published result in shared memory, into the
            // caller's buffer of an active op (only this thread completes it).
            unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
            self.mark_got(key, c);
        }
    }

    fn on_readable(&mut self, i: usize, drain: Drain) -> Result<(), ConnError> {
        let shared = self.shared.clone();
        let conn = &shared.io.conns[i];
        let link = &conn.link;
        loop {
            if conn.written_off.load(Ordering::SeqCst) {
                return Ok(()); // its server was lost; the failover closes it
            }
            // SAFETY: the destination is this chunk's range in an active op's
            // buffer, which stays alive until this thread completes the op.
            let dst = |d: ResultDest| unsafe { std::slice::from_raw_parts_mut(d.dst, d.len) };
            match link.read_frame(&mut self.rx[i], shared.io.max_payload, dst, drain)? {
                None => return Ok(()),
                Some(Frame::Header(hdr)) => self.on_header(i, hdr)?,
                Some(Frame::Payload(_, d)) => self.chunk_done(i, d.key, d.chunk)?,
                Some(Frame::Message(hdr, buf)) => self.on_small(i, hdr, buf)?,
            }
        }
    }

    fn on_header(&mut self, i: usize, hdr: Header) -> Result<(), ConnError> {
        let io = &self.shared.io;
        if hdr.namespace != io.namespace {
            return Err(ConnError::Invalid(format!(
                "frame for namespace {} (this job is {})",
                hdr.namespace, io.namespace
            )));
        }
        let stale = !self.moved_off[i].is_empty()
            && matches!(hdr.msg_type, MsgType::Result | MsgType::ResultRef | MsgType::Received)
            && self.moved_off[i].contains(&(hdr.key, hdr.chunk));
        if stale {
            // Of a chunk moved off this server (`Io::detach`): read and dropped.
            self.rx[i].receive_owned(hdr);
            return Ok(());
        }
        match hdr.msg_type {
            MsgType::Result | MsgType::ResultRef => {
                let by_ref = hdr.msg_type == MsgType::ResultRef;
                let mut guard = io.ops();
                let ops = &mut *guard;
                let a = ops
                    .active
                    .get(&hdr.key)
                    .ok_or_else(|| format!("result for key {} which has no push_pull in flight", hdr.key))?;
                let c = hdr.chunk as usize;
                if c >= a.spec.num_chunks() || a.spec.slots[c] as usize != i {
                    return Err(ConnError::Invalid(format!(
                        "result for tensor '{}' chunk {c} on the wrong connection",
                        a.spec.name
                    )));
                }
                if hdr.round != a.round || a.got[c] {
                    return Err(ConnError::Invalid(format!(
                        "unexpected result for tensor '{}' chunk {c} round {} (expected round {})",
                        a.spec.name, hdr.round, a.round
                    )));
                }
                let len = a.spec.chunk_bytes(c);
                let sent = if by_ref { 0 } else { len };
                if by_ref && !(io.conns[i].by_ref && a.host.as_ref().is_some_and(|h| h.owned[c])) {
                    return Err(ConnError::Invalid(format!(
                        "result by reference for tensor '{}' chunk {c}, which this worker did not push by reference",
                        a.spec.name
                    )));
                }
                if hdr.payload_len as usize != sent || hdr.dtype != a.spec.dtype {
                    return Err(ConnError::Invalid(format!(
                        "result for tensor '{}' chunk {c}: {} bytes of {}, expected {sent} bytes of {}",
                        a.spec.name,
                        hdr.payload_len,
                        hdr.dtype.name(),
                        a.spec.dtype.name()
                    )));
                }
                let dst = match &a.host {
                    // A chunk this worker pushes for its host: into the shared buffer.
                    Some(h) if h.owned[c] => h.staging.result(c).0,
                    Some(_) => {
                        return Err(ConnError::Invalid(format!(
                            "result for tensor '{}' chunk {c}, which another worker of this host pushes",
                            a.spec.name
                        )))
                    }
                    None => {
                        let (start, _) = a.spec.chunk_range(c);
                        let at = start * a.spec.dtype.size();
                        match ops.kept.get_mut(&hdr.key) {
                            // Kept apart until whole (see `Kept`).
                            Some(k) => k.buf[at..].as_mut_ptr(),
                            // SAFETY: start is within the tensor.
                            None => unsafe { a.ptr.0.add(at) },
                        }
                    }
                };
                drop(guard);
                if by_ref {
                    // Already in the shared buffer.
                    return self.chunk_done(i, hdr.key, c);
                }
                self.rx[i].receive_into(hdr, ResultDest { key: hdr.key, chunk: c, dst, len });
                Ok(())
            }
            MsgType::Received => {
                // The push is off the wire: its bytes no longer stand between
                // an urgent chunk and the server, so they leave the credit now,
                // not when the result (which waits for every worker) returns.
                if hdr.payload_len != 0 {
                    return Err(ConnError::Invalid(format!("Received frame with a {}-byte payload", hdr.payload_len)));
                }
                {
                    let mut st = io.conns[i].send();
                    if !st.unreceived.remove(hdr.key, hdr.chunk) {
                        return Err(ConnError::Invalid(format!(
                            "Received for key {} chunk {}, which is not in flight here",
                            hdr.key, hdr.chunk
                        )));
                    }
                    if let Some(s) = st.stamps.get_mut(&(hdr.key, hdr.chunk)) {
                        s.received = Some(Instant::now());
                    }
                }
                io.spread_done(hdr.key, hdr.chunk);
                io.pump(i)
            }
            MsgType::Stall | MsgType::Error => {
                self.rx[i].receive_owned(hdr);
                Ok(())
            }
            other => Err(ConnError::Invalid(format!("unexpected {other:?} frame from the server"))),
        }
    }

    fn on_small(&mut self, i: usize, hdr: Header, buf: Vec<u8>) -> Result<(), ConnError> {
        if matches!(hdr.msg_type, MsgType::Result | MsgType::ResultRef | MsgType::Received) {
            return Ok(()); // stale: see `on_header`
        }
        if hdr.msg_type == MsgType::Error {
            let msg = format!("server reported an error: {}", String::from_utf8_lossy(&buf));
            // The server refused this worker (e.g. a round that can never
            // complete): the scheduler may not know, so tell it.
            let io = &self.shared.io;
            self.shared.fail_job(format!("worker {}: {}: {msg}", io.rank, io.conns[i].desc()));
            return Err(ConnError::Invalid(msg));
        }
        let s = decode_stall(&buf).map_err(|e| format!("bad stall report: {e}"))?;
        let io = &self.shared.io;
        if let Some(a) = io.ops().active.get(&hdr.key) {
            let msg = format!(
                "server {} thread {} ({}) reports tensor '{}' round {} has waited {:.1}s for worker rank(s) {:?}",
                s.server,
                s.thread,
                io.conns[i].desc(),
                a.spec.name,
                hdr.round,
                s.waited_ms as f64 / 1000.0,
                s.missing
            );
            a.op.set_stall(msg);
        }
        Ok(())
    }

    fn chunk_done(&mut self, i: usize, key: u32, chunk: usize) -> Result<(), ConnError> {
        let io = &self.shared.io;
        let stamp = {
            let mut st = io.conns[i].send();
            // The push that completed the round gets no Received frame.
            st.unreceived.remove(key, chunk as u32);
            st.unreturned.remove(key, chunk as u32);
            st.stamps.remove(&(key, chunk as u32))
        };
        // Before the op can complete: its caller may queue the chunk's next
        // round at once, which must not find this one still counted.
        io.spread_done(key, chunk as u32);
        // Stamps exist only while a timeline is recorded: no lock otherwise.
        if let Some((s, trace)) = stamp.and_then(|s| Some((s, io.tracing()?))) {
            let name = io.ops().active.get(&key).map(|a| a.spec.name.clone()).unwrap_or_default();
            trace.chunk(&crate::timeline::ChunkStages {
                tensor: &name,
                chunk: chunk as u32,
                round: s.round,
                bytes: s.len,
                server: io.conns[i].server,
                queued: s.queued,
                sent: s.sent,
                received: s.received,
                result: Instant::now(),
            });
        }
        if let Some(h) = &io.host {
            let ops = io.ops();
            if let Some(hr) = ops.active.get(&key).and_then(|a| a.host.as_ref().map(|hr| (a, hr))) {
                let (a, hr) = hr;
                // The result is in the shared buffer: take a copy, let the others take theirs.
                let (src, len) = hr.staging.result(chunk);
                let (start, _) = a.spec.chunk_range(chunk);
                // SAFETY: both ranges are this chunk's; the op is active and
                // only this thread completes it.
                unsafe { std::ptr::copy_nonoverlapping(src, a.ptr.0.add(start * a.spec.dtype.size()), len) };
                hr.staging.publish(chunk, a.round);
                self.bells |= ((1u64 << h.workers.len()) - 1) & !(1 << h.local);
            }
        }
        self.mark_got(key, chunk);
        // Outstanding room came back: keep the connection busy.
        self.shared.io.pump(i)
    }

    /// Chunk `chunk`'s result is in (in `Kept` with failover on and no host
    /// stage: copied to the caller's buffer now); complete the op with its
    /// last chunk.
    fn mark_got(&mut self, key: u32, chunk: usize) {
        let io = &self.shared.io;
        let done = {
            let mut guard = io.ops();
            let ops = &mut *guard;
            let Some(a) = ops.active.get_mut(&key) else { return };
            if let Some(k) = ops.kept.get_mut(&key) {
                // The whole result is in: now it may replace this worker's push.
                let (start, end) = a.spec.chunk_range(chunk);
                let es = a.spec.dtype.size();
                let src = &k.buf[start * es..end * es];
                // SAFETY: the chunk's range in the caller's buffer of an active op.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), a.ptr.0.add(start * es), src.len()) };
                k.round[chunk] = a.round;
            }
            a.got[chunk] = true;
            a.remaining -= 1;
            let finished = if a.remaining == 0 { ops.active.remove(&key) } else { None };
            if let Some(a) = &finished {
                ops.rounds.insert(key, a.round.wrapping_add(1));
            }
            finished
        };
        if let Some(a) = done {
            if a.host.as_ref().is_some_and(|h| h.stall_reported) {
                log::info!(target: &format!("worker {}", io.rank), "stall resolved: tensor '{}' round {} complete", a.spec.name, a.round);
            }
            self.shared.finish_op(&a.op, None);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{split_credit, Order, Spread, Window};
    use std::cmp::Reverse;

    fn order(priority: i32, key: u32, chunk: u32) -> Order {
        (Reverse(priority), key, chunk, 0)
    }

    #[test]
    fn windows_preempt_and_count_only_what_comes_first() {
        let mut w = Window::default();
        // Empty: anything goes, even a chunk larger than the limit.
        assert!(w.admits(order(0, 1, 0), 500, 100) && w.admits_before(order(0, 1, 0), 500, 100));
        w.insert(1, 0, order(0, 1, 0), 60);
        w.insert(1, 1, order(0, 1, 1), 60);
        // Over the limit, a later chunk of the same tensor waits...
        assert!(!w.admits(order(0, 1, 2), 60, 100));
        assert!(!w.admits_before(order(0, 1, 2), 60, 100));
        // ...a more urgent one preempts: nothing in the window comes before it.
        assert!(w.admits(order(5, 2, 0), 60, 100));
        assert!(w.admits_before(order(5, 2, 0), 60, 100));
        // Once urgent chunks are out, the next urgent chunk counts only them.
        w.insert(2, 0, order(5, 2, 0), 60);
        assert!(!w.admits(order(5, 2, 1), 30, 100)); // 150 bytes in flight
        assert!(w.admits_before(order(5, 2, 1), 30, 100)); // 60 before it
        assert!(!w.admits_before(order(5, 2, 1), 50, 100));
        assert!(w.remove(1, 0) && !w.remove(1, 0) && w.contains(1, 1) && !w.contains(1, 0));
        assert_eq!(w.bytes, 120);
        w.clear();
        assert_eq!(w.bytes, 0);
    }

    #[test]
    fn the_spread_counts_each_chunk_once_until_received_or_its_connection_is_lost() {
        let mut s = Spread::default();
        s.insert(1, 0, order(0, 1, 0), 100, 0);
        s.insert(1, 1, order(0, 1, 1), 100, 1);
        s.insert(1, 2, order(0, 1, 2), 100, 0);
        // Only what comes before a chunk counts: the first always goes.
        assert!(s.window.admits_before(order(0, 1, 0), 100, 150));
        assert!(s.window.admits_before(order(0, 1, 1), 100, 250));
        assert!(!s.window.admits_before(order(0, 1, 2), 100, 250));
        // Re-queued (failover): replaced, not counted twice.
        s.insert(1, 1, order(0, 1, 1), 100, 2);
        assert_eq!((s.slot.len(), s.window.bytes), (3, 300));
        // Received: gone; removing twice changes nothing.
        s.remove(1, 0);
        s.remove(1, 0);
        assert_eq!((s.slot.len(), s.window.bytes), (2, 200));
        assert!(s.window.admits_before(order(0, 1, 2), 100, 250));
        // A lost connection's entries go; the others stay.
        s.drop_slot(0);
        assert_eq!((s.slot.len(), s.window.bytes), (1, 100));
        assert!(s.window.contains(1, 1) && !s.window.contains(1, 2));
    }

    #[test]
    fn credit_follows_the_placed_bytes() {
        // Before any tensor is placed: the base credit everywhere.
        assert_eq!(split_credit(100, &[0, 0, 0]), vec![100, 100, 100]);
        // Equal shares keep the base credit.
        assert_eq!(split_credit(100, &[5, 5, 5, 5]), vec![100; 4]);
        // BytePS k=2, n=4: CPU-only servers 0.3 M each, colocated 0.1 M each.
        assert_eq!(split_credit(1000, &[3, 3, 1, 1, 1, 1]), vec![1800, 1800, 600, 600, 600, 600]);
        // Unused connections keep a floor and do not dilute the budget.
        assert_eq!(split_credit(400, &[1, 1, 0]), vec![400, 400, 100]);
    }
}
