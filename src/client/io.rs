//! The worker's single I/O thread (the Communication Service's progress
//! engine): one nonblocking connection per server thread, a priority queue of
//! chunk sends per connection with a credit (bounded bytes in flight), and
//! results received straight into the caller's buffer.
//!
//! Why a credit: once bytes are in the kernel socket queue they cannot be
//! overtaken. Keeping at most `credit` bytes outstanding per connection means
//! a high-priority chunk waits behind at most that much low-priority data
//! (P3's slicing + priority queue, ByteScheduler's credit).

use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;

use crossbeam_channel::Receiver;
use mio::net::TcpStream;
use mio::{Events, Interest, Poll, Token};

use super::op::Op;
use super::Shared;
use crate::protocol::{decode_stall, DType, Header, MsgType, TensorSpec, HEADER_LEN};
use crate::transport::{read_nb, write_frame_nb, Io};

pub const WAKER: Token = Token(usize::MAX);

/// Raw pointer to the caller's buffer. The Op's keepalive owns the memory
/// until the Op completes, and only the I/O thread touches it meanwhile.
#[derive(Clone, Copy)]
pub struct BufPtr(pub *mut u8);
// SAFETY: see above; the pointer is only dereferenced by the I/O thread while the op is active.
unsafe impl Send for BufPtr {}

pub struct Submission {
    pub op: Arc<Op>,
    pub spec: Arc<TensorSpec>,
    pub ptr: BufPtr,
    pub priority: i32,
    pub flags: u16,
}

pub enum IoCmd {
    Submit(Submission),
    Fail(String),
    Stop,
}

/// One chunk waiting to be sent. Strict order: higher priority first, then
/// submission order (FIFO) — never a `<=`-style comparator.
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
}
impl Ord for SendItem {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.priority.cmp(&o.priority).then_with(|| o.seq.cmp(&self.seq))
    }
}
impl PartialOrd for SendItem {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}

enum Rx {
    Header { got: usize },
    Result { key: u32, chunk: usize, dst: *mut u8, len: usize, got: usize },
    /// A small frame read whole (stall notice or error text).
    Small { hdr: Header, buf: Vec<u8>, got: usize },
}

pub struct DataConn {
    pub stream: TcpStream,
    pub desc: String,
    heap: BinaryHeap<SendItem>,
    cur: Option<(SendItem, [u8; HEADER_LEN], usize)>,
    in_flight: usize,
    rx: Rx,
    hdr: [u8; HEADER_LEN],
}

// SAFETY: the raw pointers inside (queued chunks, receive target) point into
// caller buffers kept alive by their ops; a DataConn is moved to the I/O
// thread once and only used there.
unsafe impl Send for DataConn {}

impl DataConn {
    pub fn new(stream: TcpStream, desc: String) -> DataConn {
        DataConn {
            stream,
            desc,
            heap: BinaryHeap::new(),
            cur: None,
            in_flight: 0,
            rx: Rx::Header { got: 0 },
            hdr: [0; HEADER_LEN],
        }
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

pub struct IoThread {
    pub poll: Poll,
    pub conns: Vec<DataConn>,
    pub cmds: Receiver<IoCmd>,
    pub shared: Arc<Shared>,
    pub credit: usize,
    pub namespace: u32,
    pub max_payload: u32,
    active: HashMap<u32, Active>,
    rounds: HashMap<u32, u32>,
    seq: u64,
    failed: Option<String>,
}

impl IoThread {
    pub fn new(
        poll: Poll,
        mut conns: Vec<DataConn>,
        cmds: Receiver<IoCmd>,
        shared: Arc<Shared>,
        credit: usize,
        namespace: u32,
        max_payload: u32,
    ) -> std::io::Result<IoThread> {
        for (i, c) in conns.iter_mut().enumerate() {
            poll.registry().register(&mut c.stream, Token(i), Interest::READABLE | Interest::WRITABLE)?;
        }
        Ok(IoThread {
            poll,
            conns,
            cmds,
            shared,
            credit,
            namespace,
            max_payload,
            active: HashMap::new(),
            rounds: HashMap::new(),
            seq: 0,
            failed: None,
        })
    }

    pub fn run(mut self) {
        let mut events = Events::with_capacity(256);
        loop {
            if let Err(e) = self.poll.poll(&mut events, None) {
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                self.fail_all(format!("worker I/O poll failed: {e}"));
                return;
            }
            for ev in events.iter() {
                if ev.token() == WAKER {
                    continue;
                }
                let i = ev.token().0;
                if self.failed.is_some() || i >= self.conns.len() {
                    continue;
                }
                let mut res = Ok(());
                if ev.is_readable() || ev.is_read_closed() || ev.is_error() {
                    res = self.on_readable(i);
                }
                if res.is_ok() && ev.is_writable() {
                    res = self.pump(i);
                }
                if let Err(why) = res {
                    let msg = format!("{}: {why}", self.conns[i].desc);
                    self.fail_all(msg);
                }
            }
            while let Ok(cmd) = self.cmds.try_recv() {
                match cmd {
                    IoCmd::Submit(s) => self.submit(s),
                    IoCmd::Fail(msg) => self.fail_all(msg),
                    IoCmd::Stop => return,
                }
            }
        }
    }

    fn fail_all(&mut self, msg: String) {
        if self.failed.is_none() {
            self.shared.set_failure(msg.clone());
            self.failed = Some(msg.clone());
        }
        let msg = self.failed.clone().unwrap_or(msg);
        for c in &mut self.conns {
            c.heap.clear();
        }
        for (_, a) in self.active.drain() {
            self.shared.finish_op(&a.op, Some(msg.clone()));
        }
    }

    fn submit(&mut self, s: Submission) {
        if let Some(f) = &self.failed {
            self.shared.finish_op(&s.op, Some(f.clone()));
            return;
        }
        let key = s.spec.key;
        if self.active.contains_key(&key) {
            let msg = format!("tensor '{}' is already in flight", s.spec.name);
            self.shared.finish_op(&s.op, Some(msg));
            return;
        }
        let n = s.spec.num_chunks();
        if n == 0 {
            self.rounds.entry(key).and_modify(|r| *r += 1).or_insert(1);
            self.shared.finish_op(&s.op, None);
            return;
        }
        let round = *self.rounds.entry(key).or_insert(0);
        let es = s.spec.dtype.size();
        let mut touched = Vec::new();
        for c in 0..n {
            let slot = s.spec.slots[c] as usize;
            let Some(conn) = self.conns.get_mut(slot) else {
                let msg = format!("tensor '{}' placed on unknown slot {slot}", s.spec.name);
                self.shared.finish_op(&s.op, Some(msg));
                return;
            };
            let (a, b) = s.spec.chunk_range(c);
            self.seq += 1;
            conn.heap.push(SendItem {
                priority: s.priority,
                seq: self.seq,
                key,
                chunk: c as u32,
                round,
                flags: s.flags,
                dtype: s.spec.dtype,
                // SAFETY: a..b lies within the buffer of numel elements the caller passed.
                ptr: unsafe { s.ptr.0.add(a * es) },
                len: (b - a) * es,
            });
            if !touched.contains(&slot) {
                touched.push(slot);
            }
        }
        self.active.insert(key, Active { op: s.op, spec: s.spec, ptr: s.ptr, round, got: vec![false; n], remaining: n });
        for slot in touched {
            if let Err(why) = self.pump(slot) {
                let msg = format!("{}: {why}", self.conns[slot].desc);
                self.fail_all(msg);
                return;
            }
        }
    }

    /// Send as much as the credit and the socket allow on connection `i`.
    fn pump(&mut self, i: usize) -> Result<(), String> {
        let ns = self.namespace;
        let credit = self.credit;
        let c = &mut self.conns[i];
        loop {
            if c.cur.is_none() {
                let Some(top) = c.heap.peek() else { return Ok(()) };
                // Always allow one chunk, so a chunk larger than the credit still moves.
                if c.in_flight > 0 && c.in_flight + top.len > credit {
                    return Ok(());
                }
                let Some(item) = c.heap.pop() else { return Ok(()) };
                let mut h = Header::new(MsgType::Push);
                h.namespace = ns;
                h.key = item.key;
                h.chunk = item.chunk;
                h.round = item.round;
                h.flags = item.flags;
                h.priority = item.priority;
                h.dtype = item.dtype;
                h.payload_len = item.len as u32;
                c.in_flight += item.len;
                c.cur = Some((item, h.encode(), 0));
            }
            let Some((item, hdr, sent)) = c.cur.as_mut() else { return Ok(()) };
            // SAFETY: ptr/len describe a chunk of a live caller buffer (see BufPtr).
            let payload = unsafe { std::slice::from_raw_parts(item.ptr, item.len) };
            match write_frame_nb(&mut c.stream, hdr, payload, *sent) {
                Ok(Io::Done(n)) => {
                    *sent += n;
                    if *sent == HEADER_LEN + item.len {
                        c.cur = None;
                    }
                }
                Ok(_) => return Ok(()),
                Err(e) => return Err(format!("send failed: {e}")),
            }
        }
    }

    fn on_readable(&mut self, i: usize) -> Result<(), String> {
        loop {
            let c = &mut self.conns[i];
            match c.rx {
                Rx::Header { got } => match read_nb(&mut c.stream, &mut c.hdr[got..]) {
                    Ok(Io::Done(n)) if got + n == HEADER_LEN => {
                        c.rx = Rx::Header { got: 0 };
                        let hdr = Header::decode(&c.hdr, self.max_payload).map_err(|e| format!("bad frame: {e}"))?;
                        self.on_header(i, hdr)?;
                    }
                    Ok(Io::Done(n)) => c.rx = Rx::Header { got: got + n },
                    Ok(Io::WouldBlock) => return Ok(()),
                    Ok(Io::Closed) => return Err("connection closed by the server".into()),
                    Err(e) => return Err(format!("connection lost: {e}")),
                },
                Rx::Result { key, chunk, dst, len, got } => {
                    // SAFETY: dst..dst+len is this chunk's range in the active op's buffer.
                    let buf = unsafe { std::slice::from_raw_parts_mut(dst.add(got), len - got) };
                    match read_nb(&mut c.stream, buf) {
                        Ok(Io::Done(n)) if got + n == len => {
                            c.rx = Rx::Header { got: 0 };
                            self.chunk_done(i, key, chunk, len);
                            self.pump(i)?;
                        }
                        Ok(Io::Done(n)) => c.rx = Rx::Result { key, chunk, dst, len, got: got + n },
                        Ok(Io::WouldBlock) => return Ok(()),
                        Ok(Io::Closed) => return Err("connection closed by the server mid-result".into()),
                        Err(e) => return Err(format!("connection lost: {e}")),
                    }
                }
                Rx::Small { hdr, ref mut buf, got } => {
                    let len = buf.len();
                    match read_nb(&mut c.stream, &mut buf[got..]) {
                        Ok(Io::Done(n)) if got + n == len => {
                            let buf = std::mem::take(buf);
                            c.rx = Rx::Header { got: 0 };
                            self.on_small(i, hdr, buf)?;
                        }
                        Ok(Io::Done(n)) => {
                            if let Rx::Small { got, .. } = &mut c.rx {
                                *got += n;
                            }
                        }
                        Ok(Io::WouldBlock) => return Ok(()),
                        Ok(Io::Closed) => return Err("connection closed by the server".into()),
                        Err(e) => return Err(format!("connection lost: {e}")),
                    }
                }
            }
        }
    }

    fn on_header(&mut self, i: usize, hdr: Header) -> Result<(), String> {
        if hdr.namespace != self.namespace {
            return Err(format!("frame for namespace {} (this job is {})", hdr.namespace, self.namespace));
        }
        match hdr.msg_type {
            MsgType::Result => {
                let a = self
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
                if len == 0 {
                    self.chunk_done(i, hdr.key, c, 0);
                } else {
                    self.conns[i].rx = Rx::Result { key: hdr.key, chunk: c, dst, len, got: 0 };
                }
                Ok(())
            }
            MsgType::Stall | MsgType::Error => {
                let buf = vec![0u8; hdr.payload_len as usize];
                if buf.is_empty() {
                    return self.on_small(i, hdr, buf);
                }
                self.conns[i].rx = Rx::Small { hdr, buf, got: 0 };
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
        if let Some(a) = self.active.get(&hdr.key) {
            let msg = format!(
                "server {} thread {} ({}) reports tensor '{}' round {} has waited {:.1}s for worker rank(s) {:?}",
                s.server,
                s.thread,
                self.conns[i].desc,
                a.spec.name,
                hdr.round,
                s.waited_ms as f64 / 1000.0,
                s.missing
            );
            a.op.set_stall(msg);
        }
        Ok(())
    }

    fn chunk_done(&mut self, i: usize, key: u32, chunk: usize, len: usize) {
        let spec_len = self.active.get(&key).map(|a| a.spec.chunk_bytes(chunk)).unwrap_or(len);
        let c = &mut self.conns[i];
        c.in_flight = c.in_flight.saturating_sub(spec_len);
        let Some(a) = self.active.get_mut(&key) else { return };
        a.got[chunk] = true;
        a.remaining -= 1;
        if a.remaining == 0 {
            if let Some(a) = self.active.remove(&key) {
                self.rounds.insert(key, a.round.wrapping_add(1));
                self.shared.finish_op(&a.op, None);
            }
        }
    }
}
