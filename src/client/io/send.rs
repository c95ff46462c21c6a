//! The send side (`SendSide`: the connection table, the registry the
//! connections are watched through, the push counts) and the send path,
//! which works across the parts: starting a push_pull from the caller's
//! thread (admit it, one round of a tensor at a time; make its op active;
//! queue its chunks, through the host stage after the host's sums), the
//! pump that writes as much as admission and the socket allow, control
//! frames, and the credit a chunk received or returned gives back.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use mio::Token;

use super::conns::{Conn, ConnTable, NewConn, SendHalf};
use super::failover::{Kept, NO_ROUND};
use super::flow::{Active, HostRound};
use super::item::{Again, Carry, ChunkSend, Route, SendItem};
use super::link::{broke, LinkState};
use super::trace::Stamp;
use super::{left_message, Completion, Io, Submission};
use crate::client::ClientError;
use crate::protocol::{encode_frame, Header, MsgType};
use crate::transport::{ConnError, Connection, Outgoing};
use crate::waits::StallWatch;

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

    /// Whether link `i` is being mended (`mend`).
    pub(super) fn mending(&self, i: usize) -> bool {
        self.conns.get(i).is_some_and(|c| c.state() == LinkState::Mending)
    }
}

/// Chunks pushed since the start: by reference, through sockets, and of
/// those, zeros (a header only) and those that asked for no result.
#[derive(Default)]
pub(super) struct PushCounts {
    by_ref: AtomicU64,
    by_socket: AtomicU64,
    zeros: AtomicU64,
    no_result: AtomicU64,
}

impl PushCounts {
    fn count(&self, by_ref: bool, flags: u16) {
        let n = if by_ref { &self.by_ref } else { &self.by_socket };
        n.fetch_add(1, Ordering::Relaxed);
        if flags & crate::protocol::FLAG_ZEROS != 0 && !by_ref {
            self.zeros.fetch_add(1, Ordering::Relaxed);
        }
        if flags & crate::protocol::FLAG_NO_RESULT != 0 {
            self.no_result.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// (by reference, through sockets, zeros, no result asked).
    pub(super) fn snapshot(&self) -> (u64, u64, u64, u64) {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        (load(&self.by_ref), load(&self.by_socket), load(&self.zeros), load(&self.no_result))
    }
}

impl Io {
    /// Start a push_pull: queue its chunks and start sending from this
    /// thread; through the host stage, first add them to the host's sums.
    pub fn submit(&self, s: Submission, owner: &dyn Completion) {
        let round = match self.admit(&s) {
            Ok(Some(round)) => round,
            Ok(None) => return owner.finish_op(&s.op, None),
            Err(e) => return owner.finish_op(&s.op, Some(e)),
        };
        let n = s.spec.num_chunks();
        // A member tensor's members push for themselves: no host stage.
        let Some(h) = self.host.stage.as_ref().filter(|_| s.spec.members.is_empty()) else {
            if n == 1 {
                // Small: its caller may read its result itself (`IoCore::poll_for`).
                if let Some(poll) = self.recv.poller.get() {
                    s.op.set_poller(poll.clone(), s.spec.slots[0] as usize);
                }
            }
            let all: Vec<usize> = (0..n).collect();
            self.start(s, round, None, &all, owner);
            return;
        };
        let shared = match h.tensor(&s.spec) {
            Ok(st) => st,
            Err(e) => return owner.finish_op(&s.op, Some(e)),
        };
        let key = s.spec.key;
        let owned: Vec<bool> = (0..n).map(|c| self.layout.owner(self.rank, key, c as u32) == self.rank).collect();
        // Contributions happen before the op is visible to the I/O thread
        // (the caller's buffer is read here, and only that thread may
        // complete an op); whatever completes meanwhile is picked up by
        // the ring to ourselves below.
        let (mut ready, mut ring) = (Vec::new(), 0u64);
        let abort = || owner.failure();
        let contributed = h.contribute(&shared, s.ptr.0, round, s.flags, self.rank == 0, &abort, &mut |c| {
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
            owner.fail_job(msg.clone());
            return owner.finish_op(&s.op, Some(msg));
        }
        let hr = HostRound { shared: shared.clone(), owned, pushed: vec![false; n], stall: StallWatch::start() };
        if self.start(s, round, Some(hr), &ready, owner) {
            h.bells.ring_mask(ring | 1 << h.local);
        }
        // A local worker left while this was being submitted: see `Shared::on_peer_left`.
        if let Some(left) = self.host.left() {
            if let Some(name) = self.waits_for_local(left) {
                owner.fail_job(left_message(left, self.rank, &format!("push_pull '{name}' on their host")));
            }
        }
    }

    /// Check a submission can start; its round, or None if it is empty.
    pub(super) fn admit(&self, s: &Submission) -> Result<Option<u32>, String> {
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
        if let Some(&bad) = s.spec.slots.iter().find(|&&slot| slot as usize >= self.send.conns.len()) {
            return Err(format!("tensor '{}' placed on unknown slot {bad}", s.spec.name));
        }
        Ok(Some(round))
    }

    /// Make the op active and queue the chunks `push`. Returns false if
    /// the job had failed meanwhile.
    pub(super) fn start(
        &self,
        s: Submission,
        round: u32,
        host: Option<HostRound>,
        push: &[usize],
        owner: &dyn Completion,
    ) -> bool {
        let key = s.spec.key;
        let n = s.spec.num_chunks();
        let mut touched = Vec::new();
        {
            let mut ops = self.ops();
            if let Some(f) = &ops.failed {
                let f = f.clone();
                drop(ops);
                owner.finish_op(&s.op, Some(f));
                return false;
            }
            // Submitted with a spec a failover replaced meanwhile.
            let spec = self.failover.latest_spec(key).unwrap_or(s.spec);
            let kept = self.failover.on && host.is_none();
            if kept && !ops.kept.contains_key(&key) {
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
                shards: s.shards,
                got: vec![false; n],
                remaining: n,
                host,
                kept,
            };
            // Items go on the queues while `ops` is held, so a concurrent
            // failure either sees them (and drops them) or runs before them.
            for &c in push {
                if let Some(h) = &mut a.host {
                    h.pushed[c] = true;
                }
                if let Some(slot) = self.queue_chunk(&mut ops.seq, &a, c, Again::No) {
                    if !touched.contains(&slot) {
                        touched.push(slot);
                    }
                }
            }
            ops.active.insert(key, a);
        }
        self.pump_all(&touched);
        true
    }

    /// Put this worker's push of chunk `c` of an active op on its
    /// connection's queue; its slot (None: another worker pushes it).
    pub(super) fn queue_chunk(&self, seq: &mut u64, a: &Active, c: usize, again: Again) -> Option<usize> {
        let src = a.push_src(c)?;
        let route = a.route(c);
        let slot = a.spec.slots[c] as usize;
        *seq += 1;
        // Wholly outside the bytes the caller may have set: zeros, sent as a header.
        let (lo, hi) = a.spec.chunk_range(c);
        let es = a.spec.dtype.size();
        let zeros = again == Again::ResultOnly
            || matches!(route, Route::Caller | Route::Kept) && a.op.extent.zeros(lo * es, hi * es);
        let len = if zeros { 0 } else { src.len };
        let mut flags = if zeros { a.flags | crate::protocol::FLAG_ZEROS } else { a.flags };
        if !a.wants_result(c) {
            flags |= crate::protocol::FLAG_NO_RESULT;
        }
        let item = SendItem::Chunk(ChunkSend {
            priority: a.priority,
            seq: *seq,
            key: a.spec.key,
            chunk: c as u32,
            position: a.push_position(c),
            round: a.round,
            flags: again.flags(flags),
            dtype: a.spec.dtype,
            ptr: src.ptr,
            len,
            by_ref: route == Route::HostOwner && self.send.conns[slot].by_ref,
            queued: Instant::now(),
        });
        if self.admission.spread_limit() > 0 {
            // Before it is on a queue, so it cannot be sent (and received) first.
            self.admission.spread().insert(a.spec.key, c as u32, item.order(), len, slot);
        }
        self.send.conns[slot].send().heap.push(item);
        Some(slot)
    }

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
                    self.send.counts.count(ch.by_ref, ch.flags);
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

    /// Chunk (`key`, `chunk`) on connection `i`: on the wire → received
    /// (`InFlight::received`), and out of the spread. False if it was not
    /// on the wire there.
    pub(super) fn chunk_received(&self, i: usize, key: u32, chunk: u32) -> bool {
        if !self.send.conns[i].send().flights.received(key, chunk) {
            return false;
        }
        self.spread_done(key, chunk);
        true
    }

    /// Its result is in: done on connection `i` (`InFlight::done`) and out
    /// of the spread; its stamps, if a timeline is recorded.
    pub(super) fn chunk_returned(&self, i: usize, key: u32, chunk: u32) -> Option<Stamp> {
        let stamp = {
            let mut st = self.send.conns[i].send();
            if st.resent.remove(&(key, chunk)) {
                // Answered before its re-send went: it goes no more.
                st.heap.retain(|it| !matches!(it, SendItem::Chunk(c) if (c.key, c.chunk) == (key, chunk)));
            }
            st.flights.done(key, chunk)
        };
        self.spread_done(key, chunk);
        stamp
    }

    /// Chunk `chunk` of `key` is no longer in the spread: pump the
    /// connections that waited for it to shrink (a failure there is theirs,
    /// not the caller's connection's).
    pub(super) fn spread_done(&self, key: u32, chunk: u32) {
        if !self.admission.done(key, chunk) {
            return;
        }
        let conns = &self.send.conns;
        let blocked: Vec<usize> =
            (0..conns.len()).filter(|&i| conns[i].spread_blocked.swap(false, Ordering::AcqRel)).collect();
        self.pump_all(&blocked);
    }
}
