//! The send side (`SendSide`): the data connections (links) to server
//! threads, their table (`ConnTable`), each one's send half (priority
//! queue, windows, writer) and `LinkState`, and the pump that writes as
//! much as admission and the socket allow.

use std::collections::{BinaryHeap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock};
use std::time::Instant;

use mio::net::TcpStream;
use mio::Token;

use super::flow::InFlight;
use super::item::{Carry, SendItem};
use super::link::{broke, LinkState};
use super::trace::Stamp;
use super::Io;
use crate::client::ClientError;
use crate::protocol::seal::Keys;
use crate::protocol::{encode_frame, Header, MsgType, MAX_JOINED_SLOTS};
use crate::transport::{Authed, ConnError, Connection, FrameWriter, Outgoing};

/// The send side of the data plane: the connections, the registry they
/// are watched through (the I/O thread's poll), and what was pushed.
pub(super) struct SendSide {
    pub(super) conns: ConnTable,
    pub(super) registry: mio::Registry,
    pub(super) counts: PushCounts,
}

impl SendSide {
    pub(super) fn new(conns: ConnTable, registry: mio::Registry) -> SendSide {
        SendSide { conns, registry, counts: PushCounts::default() }
    }

    /// Server connections `conns` belong to a lost server: from now on
    /// nothing read from them counts. (A server that was only frozen may
    /// come back and answer rounds its chunks' new servers now hold.)
    pub(super) fn write_off(&self, conns: &[usize]) {
        for &i in conns {
            if let Some(c) = self.conns.get(i) {
                c.advance(LinkState::WrittenOff);
            }
        }
    }
}

/// Chunks pushed since the start: by reference, through sockets, and of
/// those, zeros (a header only).
#[derive(Default)]
pub(super) struct PushCounts {
    by_ref: AtomicU64,
    by_socket: AtomicU64,
    zeros: AtomicU64,
}

impl PushCounts {
    fn count(&self, by_ref: bool, zeros: bool) {
        let n = if by_ref { &self.by_ref } else { &self.by_socket };
        n.fetch_add(1, Ordering::Relaxed);
        if zeros && !by_ref {
            self.zeros.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// (by reference, through sockets, zeros).
    pub(super) fn snapshot(&self) -> (u64, u64, u64) {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        (load(&self.by_ref), load(&self.by_socket), load(&self.zeros))
    }
}

#[derive(Default)]
pub(super) struct SendHalf {
    pub(super) heap: BinaryHeap<SendItem>,
    pub(super) tx: FrameWriter<Carry>,
    /// Pushed, result not back yet: each chunk's phase, and the credit
    /// windows (`InFlight`).
    pub(super) flights: InFlight,
    /// This connection's credit (bytes); see `Io::note_placement`.
    pub(super) credit: usize,
    /// When the link stopped being `Live` for writing (broke, or its
    /// server was lost): `IoCore::check_lost` bounds the wait for a failover.
    pub(super) broken_at: Option<Instant>,
    /// Copies of pushes being written when their chunk moved (`Io::detach`),
    /// kept until the frame is out.
    pub(super) detached: Vec<Box<[u8]>>,
    /// Callers reading this connection themselves (`Io::quiet`).
    pub(super) quiet_callers: u32,
    /// Since when it is being mended (`mend`), and the chunk whose result
    /// was arriving when it broke.
    pub(super) mending: Option<(Instant, Option<(u32, u32)>)>,
    /// Chunks queued again by a mend and not written yet: the server may
    /// answer one before it goes (its round completed after the link was
    /// made again), and then it must not go (its op, and the buffer it
    /// reads, may be gone).
    pub(super) resent: HashSet<(u32, u32)>,
    /// How many times this link was mended.
    pub(super) mends: u32,
    /// When it broke first since it last carried a frame from its server
    /// (`Conn::doubtful`): the mending window counts from then, so a link
    /// that connects and breaks again and again is given up all the same.
    pub(super) doubted_at: Option<Instant>,
}
// SAFETY: the raw pointers point into caller buffers kept alive by their ops (see BufPtr).
unsafe impl Send for SendHalf {}

pub struct Conn {
    /// The socket; a mended link gets a new one (`mend`).
    link: RwLock<Arc<Connection>>,
    /// Where it was dialled (host:port), to dial again.
    pub(super) addr: String,
    desc: String,
    pub(super) send: Mutex<SendHalf>,
    /// Where it is in its life (`LinkState`), read without the send lock.
    state: AtomicU8,
    /// It broke, and has carried no frame from its server since
    /// (`SendHalf::doubted_at`); cleared by the first frame that arrives.
    pub(super) doubtful: AtomicBool,
    /// The server (rank) at the other end.
    pub server: u32,
    /// Its server shares this host's memory, so the host's sums go to it
    /// by reference.
    pub(super) by_ref: bool,
    /// Its next chunk waits for the worker's spread to shrink (`Spread`).
    pub(super) spread_blocked: AtomicBool,
}

/// A data connection to register: to thread `desc` of server `server`.
pub struct NewConn {
    stream: TcpStream,
    keys: Option<Keys>,
    addr: String,
    desc: String,
    server: u32,
    by_ref: bool,
}

impl NewConn {
    /// A connection just made and authenticated (`connect_authenticated`),
    /// made a nonblocking data connection.
    pub fn new(authed: Authed, addr: String, desc: String, server: u32, by_ref: bool) -> std::io::Result<NewConn> {
        crate::transport::tune_data_socket(&authed.stream);
        authed.stream.set_nonblocking(true)?;
        let stream = TcpStream::from_std(authed.stream);
        Ok(NewConn { stream, keys: authed.keys, addr, desc, server, by_ref })
    }
}

/// The data connections, by slot: room for the job's first servers' threads
/// and `MAX_JOINED_SLOTS` more that may join while it runs. Appended by one
/// thread at a time; read by every thread without a lock (a slot, once
/// set, never changes), as the send path indexes it for every chunk.
pub struct ConnTable {
    pub(super) slots: Box<[OnceLock<Conn>]>,
    pub(super) len: AtomicUsize,
    pub(super) append: Mutex<()>,
}

impl ConnTable {
    pub(super) fn with_room(n: usize) -> ConnTable {
        let slots = (0..n + MAX_JOINED_SLOTS).map(|_| OnceLock::new()).collect();
        ConnTable { slots, len: AtomicUsize::new(0), append: Mutex::new(()) }
    }
    /// Append `c`; returns its slot, or None when there is no room.
    pub(super) fn push(&self, c: Conn) -> Option<usize> {
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

impl SendHalf {
    /// Nothing queued, being written or in flight any more.
    pub(super) fn clear(&mut self) {
        self.heap.clear();
        self.tx.clear();
        self.flights.clear();
    }
}

impl Conn {
    pub fn state(&self) -> LinkState {
        LinkState::of(self.state.load(Ordering::SeqCst))
    }
    /// Move forward to `to` (never back); returns the state before.
    pub(super) fn advance(&self, to: LinkState) -> LinkState {
        LinkState::of(self.state.fetch_max(to as u8, Ordering::SeqCst))
    }
    /// `Mending` -> `Live` with a new socket (false: it moved on meanwhile,
    /// e.g. the scheduler wrote its server off).
    pub(super) fn mended(&self, link: Connection) -> bool {
        *self.link.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(link);
        let (from, to) = (LinkState::Mending as u8, LinkState::Live as u8);
        self.state.compare_exchange(from, to, Ordering::SeqCst, Ordering::SeqCst).is_ok()
    }
    /// The socket now.
    pub(super) fn link(&self) -> Arc<Connection> {
        self.link.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
    /// The link failed under the send lock `st`: at least `Broken` from now.
    pub(super) fn broke(&self, st: &mut SendHalf) {
        self.advance(LinkState::Broken);
        st.broken_at.get_or_insert_with(Instant::now);
    }
    pub fn desc(&self) -> &str {
        &self.desc
    }
    pub(super) fn send(&self) -> MutexGuard<'_, SendHalf> {
        self.send.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Io {
    /// Register data connections (the job's first servers', or one that
    /// joined: `ServerJoined`) as the next slots, each saying DataHello
    /// (this worker's rank) before anything else.
    pub fn add_conns(&self, streams: Vec<NewConn>) -> std::io::Result<()> {
        let conns = &self.send.conns;
        for nc in streams {
            let i = conns.len();
            let link = Connection::new(&self.send.registry, nc.stream, Token(i), nc.desc.clone())?;
            if let Some(keys) = nc.keys {
                link.seal_with(keys).map_err(std::io::Error::other)?;
            }
            let mut send = SendHalf { credit: self.admission.credit(), ..Default::default() };
            // seq 0: ahead of every frame queued later.
            let mut hello = Header::new(MsgType::DataHello);
            (hello.namespace, hello.key) = (self.namespace, self.rank);
            send.heap.push(SendItem::Control { seq: 0, header: hello, payload: Vec::new() });
            let by_ref = nc.by_ref && self.host.stage.is_some();
            let conn = Conn {
                link: RwLock::new(Arc::new(link)),
                addr: nc.addr,
                desc: nc.desc,
                send: Mutex::new(send),
                state: AtomicU8::new(LinkState::Live as u8),
                doubtful: AtomicBool::new(false),
                server: nc.server,
                by_ref,
                spread_blocked: AtomicBool::new(false),
            };
            if conns.push(conn).is_none() {
                return Err(std::io::Error::other(format!("no room for data connection {i}")));
            }
            self.admission.placed().push(0);
            self.recv.wake(); // the I/O thread makes room to read it
            self.pump(i).map_err(|e| std::io::Error::other(format!("{}: {e}", conns[i].desc())))?;
        }
        Ok(())
    }

    /// Server connections `conns` belong to a lost server: from now on
    /// nothing read from them counts. (A server that was only frozen may
    /// come back and answer rounds its chunks' new servers now hold.)
    pub fn write_off(&self, conns: &[usize]) {
        self.send.write_off(conns);
    }

    /// Callers reading connection `i` themselves (`CallerPoller`): the I/O
    /// thread is not woken for its data while there are any.
    pub(super) fn quiet(&self, i: usize, on: bool) {
        let Some(c) = self.send.conns.get(i) else { return };
        let mut guard = c.send();
        let st = &mut *guard;
        if c.state() != LinkState::Live {
            return; // taken out of the poller for good
        }
        st.quiet_callers = if on { st.quiet_callers + 1 } else { st.quiet_callers.saturating_sub(1) };
        if let Err(e) = c.link().quiet(&self.send.registry, &mut st.tx, st.quiet_callers > 0) {
            drop(guard);
            // Not watched any more would be a hang: fail loudly instead.
            self.request_fail(format!("{}: cannot change what the I/O thread watches: {e}", c.desc()));
        }
    }

    pub(super) fn pump_all(&self, slots: &[usize]) {
        for &slot in slots {
            if let Err(why) = self.pump(slot) {
                self.request_fail(format!("{}: {why}", self.send.conns[slot].desc()));
                return;
            }
        }
    }

    /// Queue a control frame for `key` on connection `slot`, ahead of any
    /// push queued after it (highest priority, FIFO among equals).
    pub fn send_control(&self, slot: usize, key: u32, msg_type: MsgType, payload: Vec<u8>) -> Result<(), ClientError> {
        let c =
            self.send.conns.get(slot).ok_or_else(|| ClientError::Failed(format!("no connection for slot {slot}")))?;
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
    pub(super) fn pump(&self, i: usize) -> Result<(), ConnError> {
        let c = &self.send.conns[i];
        let mut guard = c.send();
        if c.state() != LinkState::Live {
            return Ok(()); // nothing is written to a link that broke or was written off
        }
        let result = self.pump_locked(i, &mut guard);
        match result {
            Err(e) if broke(&e) && guard.mending.is_none() => {
                // The I/O thread mends it (`mend`), or gives it up.
                drop(guard);
                self.mend.ask(i, e.to_string());
                self.recv.wake();
                Ok(())
            }
            Err(e) if self.failover.on && broke(&e) => {
                // The server may be lost: its chunks will move (or the wait times out).
                log::warn!(target: &format!("worker {}", self.rank), "{}: {e}; waiting for the scheduler", c.desc());
                c.broke(&mut guard);
                Ok(())
            }
            other => other,
        }
    }

    pub(super) fn pump_locked(&self, i: usize, st: &mut SendHalf) -> Result<(), ConnError> {
        let c = &self.send.conns[i];
        let (heap, flights, credit, resent) = (&mut st.heap, &mut st.flights, st.credit, &mut st.resent);
        let ns = self.namespace;
        let tracing = self.trace.on();
        let next = || {
            if let SendItem::Chunk(top) = heap.peek()? {
                let order = heap.peek()?.order();
                if !(flights.unreceived.admits(order, top.len, credit)
                    && flights.unreturned.admits_before(order, top.len, credit))
                {
                    return None;
                }
                let limit = self.admission.spread_limit();
                if limit > 0 {
                    // Flags set under the lock, so a `spread_done` either
                    // came before this check or sees them.
                    let sp = self.admission.spread();
                    if !sp.window.admits_before(order, top.len, limit) {
                        c.spread_blocked.store(true, Ordering::Release);
                        self.admission.blocked.store(true, Ordering::Release);
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
                    if ch.flags & crate::protocol::FLAG_RESENT != 0 {
                        resent.remove(&(ch.key, ch.chunk));
                    }
                    let stamp = tracing.then(|| Stamp::sent(ch.queued, ch.round, ch.len));
                    flights.sent(ch.key, ch.chunk, order, ch.len, stamp);
                    self.send.counts.count(ch.by_ref, ch.flags & crate::protocol::FLAG_ZEROS != 0);
                    if ch.by_ref {
                        h.msg_type = MsgType::PushRef;
                        h.payload_len = 0;
                        return Some(Outgoing::encoded(Carry::Encoded, h.encode(&[]).to_vec()));
                    }
                    Some(Outgoing::frame(Carry::Chunk { ptr: ch.ptr, len: ch.len }, &h))
                }
                SendItem::Control { mut header, payload, .. } => {
                    header.payload_len = payload.len() as u32;
                    Some(Outgoing::encoded(Carry::Encoded, encode_frame(&header, &payload)))
                }
            }
        };
        let payload = |c: &Carry| match *c {
            // SAFETY: ptr/len describe a chunk of a live caller buffer (see BufPtr).
            Carry::Chunk { ptr, len } => unsafe { std::slice::from_raw_parts(ptr, len) },
            Carry::Encoded => &[],
        };
        let r = c.link().pump(&self.send.registry, &mut st.tx, next, payload);
        if !st.detached.is_empty() && st.tx.idle() {
            st.detached.clear();
        }
        r
    }
}
