//! The data connections (links) to server threads: their table
//! (`ConnTable`), each one (`Conn`: its socket, where it was dialled, its
//! `LinkState`) and its send half (`SendHalf`: the priority queue, the
//! chunks in flight and their windows, the writer). What works on them is
//! the send side's (`send`), the receive side's (`receive`, `thread`) and
//! mending's (`mend`).

use std::collections::{BinaryHeap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock};
use std::time::Instant;

use mio::net::TcpStream;

use super::flow::InFlight;
use super::item::{Carry, SendItem};
use super::link::LinkState;
use crate::protocol::seal::Keys;
use crate::protocol::MAX_JOINED_SLOTS;
use crate::transport::{Authed, Connection, FrameWriter};

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
    /// Copies of pushes being written when their chunk moved (`failover::detach`),
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
    pub(super) link: RwLock<Arc<Connection>>,
    /// Where it was dialled (host:port), to dial again.
    pub(super) addr: String,
    pub(super) desc: String,
    pub(super) send: Mutex<SendHalf>,
    /// Where it is in its life (`LinkState`), read without the send lock.
    pub(super) state: AtomicU8,
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
    pub(super) stream: TcpStream,
    pub(super) keys: Option<Keys>,
    pub(super) addr: String,
    pub(super) desc: String,
    pub(super) server: u32,
    pub(super) by_ref: bool,
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
