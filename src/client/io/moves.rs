//! Chunks that change server while the job runs: a lost server's taken over
//! (failover), or moved to a server that joined. The results this worker
//! keeps to restore them (`Kept`, `Released`), detaching a chunk from a
//! live server, and applying a `FailoverNote` on the I/O thread.

use super::flow::Carry;
use std::collections::HashMap;
use std::sync::{Arc, MutexGuard};
use std::time::Instant;

use super::flow::{ChunkSrc, SendItem};
use super::links::{Conn, LinkState};
use super::thread::IoCore;
use super::{Io, OpTable};
use crate::host::Staging;
use crate::protocol::{Header, MsgType, TensorSpec, NO_SERVER};

/// A tensor's last results (failover on, no host stage): each chunk's
/// result lands here and is copied to the caller's buffer once whole, so
/// the buffer holds this worker's push until then, and the last result
/// stays until the next one arrives.
pub(super) struct Kept {
    pub(super) buf: Box<[u8]>,
    /// The round of the result each chunk holds (`NO_ROUND`: none yet).
    pub(super) round: Vec<u32>,
}

pub(super) const NO_ROUND: u32 = u32::MAX;

/// A released tensor's means to restore its last results after a failover
/// (another worker may still wait for one this worker received): kept for
/// `RELEASED_FOR` peer timeouts, and `RELEASED_BYTES` at most.
pub(super) struct Released {
    pub(super) at: Instant,
    pub(super) spec: Arc<TensorSpec>,
    pub(super) last_round: Option<u32>,
    pub(super) kept: Option<Kept>,
    pub(super) staging: Option<Arc<Staging>>,
}
pub(super) const RELEASED_FOR: u32 = 3;
pub(super) const RELEASED_BYTES: usize = 64 << 20;

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

impl Io {
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
    pub(super) fn prune_released(&self, ops: &mut OpTable) {
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

    /// Chunk `chunk` of `key` moved off connection `from`, whose server is
    /// live: drop its queued sends there, let its bytes in flight leave the
    /// windows (the I/O thread ignores what the server still says of it:
    /// `IoThread::moved_off`). A push being
    /// written goes on from a copy (the frame cannot be cut short, and the
    /// op may complete at the new server and free the caller's buffer).
    pub(super) fn detach(&self, from: &Conn, key: u32, chunk: u32) {
        let mut st = from.send();
        st.heap.retain(|i| !matches!(i, SendItem::Chunk(c) if c.key == key && c.chunk == chunk));
        st.flights.forget(key, chunk);
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

    /// The newest placement of every key a failover moved, updated by the
    /// control thread before the client's table, so it is never older than
    /// a spec an op was submitted with. Ops start, and failovers apply,
    /// with it rather than with the note's spec: a note queued before a
    /// later one must not move chunks back (two servers lost at once).
    /// A leaf lock: nothing is locked while it is held.
    pub fn latest(&self) -> MutexGuard<'_, HashMap<u32, (u32, Arc<TensorSpec>)>> {
        self.latest.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn latest_spec(&self, key: u32) -> Option<Arc<TensorSpec>> {
        self.latest().get(&key).map(|(_, s)| s.clone())
    }
}

/// Where this worker holds a tensor's last results (see `Kept`).
pub(super) struct Held<'a> {
    pub(super) spec: &'a TensorSpec,
    pub(super) kept: Option<&'a Kept>,
    pub(super) staging: Option<&'a Arc<Staging>>,
}

impl Io {
    /// Queue a `Restore` of chunk `c`'s result of round `last`, if this
    /// worker holds it (it pushes the chunk, and received that round).
    pub(super) fn queue_restore(
        &self,
        seq: &mut u64,
        from: &Held,
        c: usize,
        last: Option<u32>,
        touched: &mut Vec<usize>,
    ) -> bool {
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

impl IoCore {
    /// The scheduler moved a lost server's chunks (`FailoverNote`): drop its
    /// connections, re-send what it had not answered to the chunks' new
    /// servers and restore the last results this worker holds of them.
    pub(super) fn apply_failover(&mut self, note: FailoverNote) {
        let io = self.io.clone();
        let io = &*io;
        for &i in &note.conns {
            let Some(c) = io.conns.get(i).filter(|_| i < self.rx.len()) else { continue };
            if c.advance(LinkState::Dead) == LinkState::Dead {
                continue;
            }
            self.rx[i].reset();
            c.link.deregister(&io.registry);
            let mut st = c.send();
            st.broken_at.get_or_insert_with(Instant::now);
            st.clear();
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
                        if from.state() < LinkState::WrittenOff {
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
}
