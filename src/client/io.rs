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
//! Locks: `ops` before a connection's `send`, never the reverse; the client's
//! table lock is only taken inside `ops` (completing an op), never around it.

use std::collections::{BinaryHeap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use mio::net::TcpStream;
use mio::{Events, Interest, Poll, Token, Waker};

use super::op::Op;
use super::Shared;
use crate::protocol::{decode_stall, DType, Header, MsgType, TensorSpec, HEADER_LEN};
use crate::transport::{read_nb, write_frame_nb, Io as IoOutcome};

pub const WAKER: Token = Token(usize::MAX);

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

/// One chunk waiting to be sent. Strict total order, identical on every
/// worker: higher priority first, then lower key (earlier first use), then
/// lower chunk index — never a `<=`-style comparator.
#[derive(PartialEq, Eq)]
struct SendItem {
    priority: i32,
    seq: u64,
    key: u32,
    chunk: u32,
    round: u32,
    flags: u16,
    dtype: DType,
    ptr: *const u8,
    len: usize,
    /// A control frame carrying its own payload (OptConfig); not a push, so
    /// it takes no credit and expects no result.
    owned: Option<(MsgType, Vec<u8>)>,
}
impl SendItem {
    /// Position in the job-wide order (smaller = sooner).
    fn order(&self) -> Order {
        (std::cmp::Reverse(self.priority), self.key, self.chunk, self.seq)
    }
}
type Order = (std::cmp::Reverse<i32>, u32, u32, u64);

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
    cur: Option<(SendItem, [u8; HEADER_LEN], usize)>,
    /// Pushed, not yet received whole by the server (bounded by `credit`).
    unreceived: Window,
    /// Pushed, result not back yet: at most `credit` bytes of it may come
    /// before a chunk in the job-wide order for that chunk to go.
    unreturned: Window,
    /// Registered for writability: only while a write would block, because
    /// with it set every ACK wakes the I/O thread for nothing.
    watching_writable: bool,
    /// This connection's credit (bytes); see `Io::note_placement`.
    credit: usize,
}
// SAFETY: the raw pointers point into caller buffers kept alive by their ops (see BufPtr).
unsafe impl Send for SendHalf {}

pub struct Conn {
    stream: TcpStream,
    pub desc: String,
    send: Mutex<SendHalf>,
}

impl Conn {
    pub fn new(stream: TcpStream, desc: String) -> Conn {
        Conn { stream, desc, send: Mutex::new(SendHalf::default()) }
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
    got: Vec<bool>,
    remaining: usize,
}

#[derive(Default)]
struct OpTable {
    active: HashMap<u32, Active>,
    rounds: HashMap<u32, u32>,
    seq: u64,
    failed: Option<String>,
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
    pub conns: Vec<Conn>,
    registry: mio::Registry,
    ops: Mutex<OpTable>,
    credit: usize,
    /// Bytes of all declared tensors placed on each connection's server thread.
    placed: Mutex<Vec<u64>>,
    namespace: u32,
    max_payload: u32,
    waker: Waker,
    stop: AtomicBool,
    fail_requested: Mutex<Option<String>>,
}

impl Io {
    /// Registers the connections with `poll` (owned by the I/O thread).
    pub fn new(
        poll: &Poll,
        mut streams: Vec<(TcpStream, String)>,
        credit: usize,
        namespace: u32,
        max_payload: u32,
    ) -> std::io::Result<Io> {
        for (i, (s, _)) in streams.iter_mut().enumerate() {
            poll.registry().register(s, Token(i), Interest::READABLE)?;
        }
        let n = streams.len();
        let conns: Vec<Conn> = streams.into_iter().map(|(s, d)| Conn::new(s, d)).collect();
        for c in &conns {
            c.send().credit = credit;
        }
        Ok(Io {
            placed: Mutex::new(vec![0; n]),
            conns,
            registry: poll.registry().try_clone()?,
            ops: Mutex::new(OpTable::default()),
            credit,
            namespace,
            max_payload,
            waker: Waker::new(poll.registry(), WAKER)?,
            stop: AtomicBool::new(false),
            fail_requested: Mutex::new(None),
        })
    }

    /// Split the credit across connections in proportion to the bytes placed
    /// on each (the whole budget is `credit` x connections in use). A
    /// window-limited connection moves credit/RTT, so equal credits would
    /// give every server the same rate, while the BytePS split gives a
    /// CPU-only server up to 2(n-1)/(n-k) times a colocated one's bytes;
    /// with equal credits its links idle while the small shares finish.
    pub fn note_placement(&self, spec: &TensorSpec) {
        let shares = {
            let mut placed = self.placed.lock().unwrap_or_else(|e| e.into_inner());
            for (c, &slot) in spec.slots.iter().enumerate() {
                let (lo, hi) = spec.chunk_range(c);
                if let Some(b) = placed.get_mut(slot as usize) {
                    *b += ((hi - lo) * spec.dtype.size()) as u64;
                }
            }
            placed.clone()
        };
        for (c, credit) in self.conns.iter().zip(split_credit(self.credit, &shares)) {
            c.send().credit = credit;
        }
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

    /// Queue every chunk of a push_pull and start sending from this thread.
    pub fn submit(&self, s: Submission, shared: &Shared) {
        let key = s.spec.key;
        let n = s.spec.num_chunks();
        let mut touched = Vec::new();
        {
            let mut ops = self.ops();
            if let Some(f) = &ops.failed {
                let f = f.clone();
                drop(ops);
                shared.finish_op(&s.op, Some(f));
                return;
            }
            if ops.active.contains_key(&key) {
                drop(ops);
                shared.finish_op(&s.op, Some(format!("tensor '{}' is already in flight", s.spec.name)));
                return;
            }
            let round = *ops.rounds.entry(key).or_insert(0);
            if n == 0 {
                ops.rounds.insert(key, round.wrapping_add(1));
                drop(ops);
                shared.finish_op(&s.op, None);
                return;
            }
            if let Some(&bad) = s.spec.slots.iter().find(|&&slot| slot as usize >= self.conns.len()) {
                drop(ops);
                shared.finish_op(&s.op, Some(format!("tensor '{}' placed on unknown slot {bad}", s.spec.name)));
                return;
            }
            let es = s.spec.dtype.size();
            // Items go on the queues while `ops` is held, so a concurrent
            // failure either sees them (and drops them) or runs before them.
            for c in 0..n {
                let slot = s.spec.slots[c] as usize;
                let (a, b) = s.spec.chunk_range(c);
                ops.seq += 1;
                self.conns[slot].send().heap.push(SendItem {
                    priority: s.priority,
                    seq: ops.seq,
                    key,
                    chunk: c as u32,
                    round,
                    flags: s.flags,
                    dtype: s.spec.dtype,
                    // SAFETY: a..b lies within the buffer of numel elements the caller passed.
                    ptr: unsafe { s.ptr.0.add(a * es) },
                    len: (b - a) * es,
                    owned: None,
                });
                if !touched.contains(&slot) {
                    touched.push(slot);
                }
            }
            ops.active.insert(key, Active { op: s.op, spec: s.spec, ptr: s.ptr, round, got: vec![false; n], remaining: n });
        }
        for slot in touched {
            if let Err(why) = self.pump(slot) {
                self.request_fail(format!("{}: {why}", self.conns[slot].desc));
                return;
            }
        }
    }

    /// Queue a control frame for `key` on connection `slot`, ahead of any
    /// push queued after it (highest priority, FIFO among equals).
    pub fn send_control(&self, slot: usize, key: u32, msg_type: MsgType, payload: Vec<u8>) -> Result<(), String> {
        let c = self.conns.get(slot).ok_or_else(|| format!("no connection for slot {slot}"))?;
        {
            let mut ops = self.ops();
            if let Some(f) = &ops.failed {
                return Err(f.clone());
            }
            ops.seq += 1;
            c.send().heap.push(SendItem {
                priority: i32::MAX,
                seq: ops.seq,
                key,
                chunk: 0,
                round: 0,
                flags: 0,
                dtype: DType::None,
                ptr: std::ptr::null(),
                len: 0,
                owned: Some((msg_type, payload)),
            });
        }
        self.pump(slot)
    }

    /// Send as much as the credit and the socket allow on connection `i`.
    fn pump(&self, i: usize) -> Result<(), String> {
        let c = &self.conns[i];
        let mut st = c.send();
        let res = self.pump_locked(c, &mut st);
        let blocked = matches!(res, Ok(true));
        if blocked != st.watching_writable {
            let interest = if blocked { Interest::READABLE | Interest::WRITABLE } else { Interest::READABLE };
            // EPOLL_CTL_MOD re-checks readiness, so no wakeup is lost in between.
            self.registry
                .reregister(&mut SourceRef(&c.stream), Token(i), interest)
                .map_err(|e| format!("poll registration failed: {e}"))?;
            st.watching_writable = blocked;
        }
        res.map(|_| ())
    }

    /// Returns Ok(true) when the socket would block with data still to send.
    fn pump_locked(&self, c: &Conn, st: &mut SendHalf) -> Result<bool, String> {
        loop {
            if st.cur.is_none() {
                let Some(top) = st.heap.peek() else { return Ok(false) };
                if top.owned.is_none()
                    && !(st.unreceived.admits(top.order(), top.len, st.credit)
                        && st.unreturned.admits_before(top.order(), top.len, st.credit))
                {
                    return Ok(false);
                }
                let Some(item) = st.heap.pop() else { return Ok(false) };
                let mut h = Header::new(MsgType::Push);
                h.namespace = self.namespace;
                h.key = item.key;
                h.chunk = item.chunk;
                h.round = item.round;
                h.flags = item.flags;
                h.priority = item.priority;
                h.dtype = item.dtype;
                h.payload_len = item.len as u32;
                if let Some((t, p)) = &item.owned {
                    h.msg_type = *t;
                    h.payload_len = p.len() as u32;
                } else {
                    st.unreceived.insert(item.key, item.chunk, item.order(), item.len);
                    st.unreturned.insert(item.key, item.chunk, item.order(), item.len);
                }
                st.cur = Some((item, h.encode(), 0));
            }
            let Some((item, hdr, sent)) = st.cur.as_mut() else { return Ok(false) };
            let payload = match &item.owned {
                Some((_, p)) => p.as_slice(),
                // SAFETY: ptr/len describe a chunk of a live caller buffer (see BufPtr).
                None => unsafe { std::slice::from_raw_parts(item.ptr, item.len) },
            };
            let total = HEADER_LEN + payload.len();
            match write_frame_nb(&mut &c.stream, hdr, payload, *sent) {
                Ok(IoOutcome::Done(n)) => {
                    *sent += n;
                    if *sent == total {
                        st.cur = None;
                    }
                }
                Ok(_) => return Ok(true),
                Err(e) => return Err(format!("send failed: {e}")),
            }
        }
    }

    /// Fail every op in flight. Only called on the I/O thread.
    fn fail_all(&self, msg: String, shared: &Shared) {
        let mut ops = self.ops();
        let msg = ops.failed.get_or_insert(msg).clone();
        for c in &self.conns {
            let mut st = c.send();
            st.heap.clear();
            st.cur = None;
            st.unreceived.clear();
            st.unreturned.clear();
        }
        let drained: Vec<Active> = ops.active.drain().map(|(_, a)| a).collect();
        drop(ops);
        shared.set_failure(msg.clone());
        for a in drained {
            shared.finish_op(&a.op, Some(msg.clone()));
        }
    }
}

/// Lets a shared `&TcpStream` be reregistered (mio wants `&mut impl Source`;
/// registration only reads the file descriptor).
struct SourceRef<'a>(&'a TcpStream);

impl mio::event::Source for SourceRef<'_> {
    fn register(&mut self, r: &mio::Registry, t: Token, i: Interest) -> std::io::Result<()> {
        mio::unix::SourceFd(&std::os::fd::AsRawFd::as_raw_fd(self.0)).register(r, t, i)
    }
    fn reregister(&mut self, r: &mio::Registry, t: Token, i: Interest) -> std::io::Result<()> {
        mio::unix::SourceFd(&std::os::fd::AsRawFd::as_raw_fd(self.0)).reregister(r, t, i)
    }
    fn deregister(&mut self, r: &mio::Registry) -> std::io::Result<()> {
        mio::unix::SourceFd(&std::os::fd::AsRawFd::as_raw_fd(self.0)).deregister(r)
    }
}

enum Rx {
    Header { got: usize },
    Result { key: u32, chunk: usize, dst: *mut u8, len: usize, got: usize },
    /// A small frame read whole (stall notice or error text).
    Small { hdr: Header, buf: Vec<u8>, got: usize },
}

/// The receiving side, owned by the I/O thread.
pub struct IoThread {
    poll: Poll,
    shared: Arc<Shared>,
    rx: Vec<Rx>,
    hdr: Vec<[u8; HEADER_LEN]>,
    failed: bool,
}

impl IoThread {
    pub fn new(poll: Poll, shared: Arc<Shared>) -> IoThread {
        let n = shared.io.conns.len();
        IoThread {
            poll,
            shared,
            rx: (0..n).map(|_| Rx::Header { got: 0 }).collect(),
            hdr: vec![[0; HEADER_LEN]; n],
            failed: false,
        }
    }

    fn fail(&mut self, msg: String) {
        self.failed = true;
        // Receive targets may be released now: forget them.
        self.rx.iter_mut().for_each(|r| *r = Rx::Header { got: 0 });
        let shared = self.shared.clone();
        shared.io.fail_all(msg, &shared);
    }

    pub fn run(mut self) {
        let mut events = Events::with_capacity(256);
        loop {
            if let Err(e) = self.poll.poll(&mut events, None) {
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                self.fail(format!("worker I/O poll failed: {e}"));
                return;
            }
            if self.shared.io.stop.load(Ordering::SeqCst) {
                return;
            }
            let requested = self.shared.io.fail_requested.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(msg) = requested {
                self.fail(msg);
            }
            for ev in events.iter() {
                let i = ev.token().0;
                if ev.token() == WAKER || self.failed || i >= self.rx.len() {
                    continue;
                }
                let mut res = Ok(());
                if ev.is_readable() || ev.is_read_closed() || ev.is_error() {
                    res = self.on_readable(i);
                }
                if res.is_ok() && ev.is_writable() {
                    res = self.shared.io.pump(i);
                }
                if let Err(why) = res {
                    let msg = format!("{}: {why}", self.shared.io.conns[i].desc);
                    self.fail(msg);
                }
            }
        }
    }

    fn on_readable(&mut self, i: usize) -> Result<(), String> {
        let shared = self.shared.clone();
        let mut stream = &shared.io.conns[i].stream;
        loop {
            match self.rx[i] {
                Rx::Header { got } => match read_nb(&mut stream, &mut self.hdr[i][got..]) {
                    Ok(IoOutcome::Done(n)) if got + n == HEADER_LEN => {
                        self.rx[i] = Rx::Header { got: 0 };
                        let hdr = Header::decode(&self.hdr[i], shared.io.max_payload)
                            .map_err(|e| format!("bad frame: {e}"))?;
                        self.on_header(i, hdr)?;
                    }
                    Ok(IoOutcome::Done(n)) => self.rx[i] = Rx::Header { got: got + n },
                    Ok(IoOutcome::WouldBlock) => return Ok(()),
                    Ok(IoOutcome::Closed) => return Err("connection closed by the server".into()),
                    Err(e) => return Err(format!("connection lost: {e}")),
                },
                Rx::Result { key, chunk, dst, len, got } => {
                    // SAFETY: dst..dst+len is this chunk's range in an active op's buffer,
                    // which stays alive until this thread completes the op.
                    let buf = unsafe { std::slice::from_raw_parts_mut(dst.add(got), len - got) };
                    match read_nb(&mut stream, buf) {
                        Ok(IoOutcome::Done(n)) if got + n == len => {
                            self.rx[i] = Rx::Header { got: 0 };
                            self.chunk_done(i, key, chunk)?;
                        }
                        Ok(IoOutcome::Done(n)) => self.rx[i] = Rx::Result { key, chunk, dst, len, got: got + n },
                        Ok(IoOutcome::WouldBlock) => return Ok(()),
                        Ok(IoOutcome::Closed) => return Err("connection closed by the server mid-result".into()),
                        Err(e) => return Err(format!("connection lost: {e}")),
                    }
                }
                Rx::Small { hdr, ref mut buf, got } => {
                    let len = buf.len();
                    match read_nb(&mut stream, &mut buf[got..]) {
                        Ok(IoOutcome::Done(n)) if got + n == len => {
                            let buf = std::mem::take(buf);
                            self.rx[i] = Rx::Header { got: 0 };
                            self.on_small(i, hdr, buf)?;
                        }
                        Ok(IoOutcome::Done(n)) => {
                            if let Rx::Small { got, .. } = &mut self.rx[i] {
                                *got += n;
                            }
                        }
                        Ok(IoOutcome::WouldBlock) => return Ok(()),
                        Ok(IoOutcome::Closed) => return Err("connection closed by the server".into()),
                        Err(e) => return Err(format!("connection lost: {e}")),
                    }
                }
            }
        }
    }

    fn on_header(&mut self, i: usize, hdr: Header) -> Result<(), String> {
        let io = &self.shared.io;
        if hdr.namespace != io.namespace {
            return Err(format!("frame for namespace {} (this job is {})", hdr.namespace, io.namespace));
        }
        match hdr.msg_type {
            MsgType::Result => {
                let ops = io.ops();
                let a = ops
                    .active
                    .get(&hdr.key)
                    .ok_or_else(|| format!("result for key {} which has no push_pull in flight", hdr.key))?;
                let c = hdr.chunk as usize;
                if c >= a.spec.num_chunks() || a.spec.slots[c] as usize != i {
                    return Err(format!("result for tensor '{}' chunk {c} on the wrong connection", a.spec.name));
                }
                if hdr.round != a.round || a.got[c] {
                    return Err(format!(
                        "unexpected result for tensor '{}' chunk {c} round {} (expected round {})",
                        a.spec.name, hdr.round, a.round
                    ));
                }
                let len = a.spec.chunk_bytes(c);
                if hdr.payload_len as usize != len || hdr.dtype != a.spec.dtype {
                    return Err(format!(
                        "result for tensor '{}' chunk {c}: {} bytes of {}, expected {len} bytes of {}",
                        a.spec.name,
                        hdr.payload_len,
                        hdr.dtype.name(),
                        a.spec.dtype.name()
                    ));
                }
                let (start, _) = a.spec.chunk_range(c);
                // SAFETY: start is within the tensor.
                let dst = unsafe { a.ptr.0.add(start * a.spec.dtype.size()) };
                drop(ops);
                if len == 0 {
                    self.chunk_done(i, hdr.key, c)?;
                } else {
                    self.rx[i] = Rx::Result { key: hdr.key, chunk: c, dst, len, got: 0 };
                }
                Ok(())
            }
            MsgType::Received => {
                // The push is off the wire: its bytes no longer stand between
                // an urgent chunk and the server, so they leave the credit now,
                // not when the result (which waits for every worker) returns.
                if hdr.payload_len != 0 {
                    return Err(format!("Received frame with a {}-byte payload", hdr.payload_len));
                }
                if !io.conns[i].send().unreceived.remove(hdr.key, hdr.chunk) {
                    return Err(format!("Received for key {} chunk {}, which is not in flight here", hdr.key, hdr.chunk));
                }
                io.pump(i)
            }
            MsgType::Stall | MsgType::Error => {
                let buf = vec![0u8; hdr.payload_len as usize];
                if buf.is_empty() {
                    return self.on_small(i, hdr, buf);
                }
                self.rx[i] = Rx::Small { hdr, buf, got: 0 };
                Ok(())
            }
            other => Err(format!("unexpected {other:?} frame from the server")),
        }
    }

    fn on_small(&mut self, i: usize, hdr: Header, buf: Vec<u8>) -> Result<(), String> {
        if hdr.msg_type == MsgType::Error {
            return Err(format!("server reported an error: {}", String::from_utf8_lossy(&buf)));
        }
        let s = decode_stall(&buf).map_err(|e| format!("bad stall report: {e}"))?;
        let io = &self.shared.io;
        if let Some(a) = io.ops().active.get(&hdr.key) {
            let msg = format!(
                "server {} thread {} ({}) reports tensor '{}' round {} has waited {:.1}s for worker rank(s) {:?}",
                s.server,
                s.thread,
                io.conns[i].desc,
                a.spec.name,
                hdr.round,
                s.waited_ms as f64 / 1000.0,
                s.missing
            );
            a.op.set_stall(msg);
        }
        Ok(())
    }

    fn chunk_done(&mut self, i: usize, key: u32, chunk: usize) -> Result<(), String> {
        let io = &self.shared.io;
        {
            let mut st = io.conns[i].send();
            // The push that completed the round gets no Received frame.
            st.unreceived.remove(key, chunk as u32);
            st.unreturned.remove(key, chunk as u32);
        }
        let done = {
            let mut ops = io.ops();
            let Some(a) = ops.active.get_mut(&key) else { return Ok(()) };
            a.got[chunk] = true;
            a.remaining -= 1;
            let finished = if a.remaining == 0 { ops.active.remove(&key) } else { None };
            if let Some(a) = &finished {
                ops.rounds.insert(key, a.round.wrapping_add(1));
            }
            finished
        };
        if let Some(a) = done {
            self.shared.finish_op(&a.op, None);
        }
        // Outstanding room came back: keep the connection busy.
        io.pump(i)
    }
}

#[cfg(test)]
mod tests {
    use super::{split_credit, Order, Window};
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
