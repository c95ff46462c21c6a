//! Chunks that change server while the job runs: a lost server's taken over
//! (failover), or moved to a server that joined. What the data plane holds
//! for it (`Failover`: the notes to apply, the newest placements), the
//! results this worker keeps to restore them (`Kept`, `Released`),
//! detaching a chunk from a live server, and applying a `FailoverNote` on
//! the I/O thread.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::admission::Admission;
use super::conns::Conn;
use super::item::{Again, Carry, SendItem};
use super::link::LinkState;
use super::thread::IoCore;
use super::OpTable;
use crate::host::SharedTensor;
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
    pub(super) shared: Option<Arc<SharedTensor>>,
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

/// Failover as the data plane holds it.
pub(super) struct Failover {
    /// The job survives a lost server (`Welcome::failover`): keep results
    /// apart (`Kept`) and wait for the failover when a connection breaks.
    pub(super) on: bool,
    pub(super) peer_timeout: Duration,
    /// Failovers for the I/O thread to apply.
    notes: Mutex<Vec<FailoverNote>>,
    /// By key, the newest placement a failover gave it, with the failover's
    /// batch (see `Io::latest`).
    latest: Mutex<HashMap<u32, (u32, Arc<TensorSpec>)>>,
}

impl Failover {
    /// `peer_timeout`: Some when the job survives a lost server.
    pub(super) fn new(peer_timeout: Option<Duration>) -> Failover {
        Failover {
            on: peer_timeout.is_some(),
            peer_timeout: peer_timeout.unwrap_or_default(),
            notes: Mutex::new(Vec::new()),
            latest: Mutex::new(HashMap::new()),
        }
    }

    pub(super) fn note(&self, note: FailoverNote) {
        self.notes.lock().unwrap_or_else(|e| e.into_inner()).push(note);
    }

    /// The failovers noted since the last call, for the I/O thread.
    pub(super) fn take_notes(&self) -> Vec<FailoverNote> {
        std::mem::take(&mut *self.notes.lock().unwrap_or_else(|e| e.into_inner()))
    }

    pub(super) fn latest(&self) -> MutexGuard<'_, HashMap<u32, (u32, Arc<TensorSpec>)>> {
        self.latest.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn latest_spec(&self, key: u32) -> Option<Arc<TensorSpec>> {
        self.latest().get(&key).map(|(_, s)| s.clone())
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
}

/// Chunk `chunk` of `key` moved off connection `from`, whose server is
/// live: drop its queued sends there, let its bytes in flight leave the
/// windows and the spread (the I/O thread ignores what the server still
/// says of it: `IoCore::moved_off`). A push being written goes on from a
/// copy (the frame cannot be cut short, and the op may complete at the
/// new server and free the caller's buffer).
fn detach(admission: &Admission, from: &Conn, key: u32, chunk: u32) {
    let mut st = from.send();
    st.heap.retain(|i| !matches!(i, SendItem::Chunk(c) if c.key == key && c.chunk == chunk));
    st.flights.forget(key, chunk);
    admission.spread().remove(key, chunk);
    if let Some(Carry::Chunk { ptr, len }) = st.tx.current_mut() {
        // SAFETY: the chunk of a live op's buffer being written (see BufPtr).
        let copy: Box<[u8]> = unsafe { std::slice::from_raw_parts(*ptr, *len) }.into();
        (*ptr, *len) = (copy.as_ptr(), copy.len());
        st.detached.push(copy);
    }
}

/// Where this worker holds a tensor's last results (see `Kept`).
pub(super) struct Held<'a> {
    pub(super) spec: &'a TensorSpec,
    pub(super) kept: Option<&'a Kept>,
    pub(super) shared: Option<Arc<SharedTensor>>,
}

/// What this worker holds of a tensor whose chunks move.
#[derive(Clone, Copy)]
pub(super) enum Holding<'a> {
    /// A round in flight: its number, which chunks' results are in, and
    /// (host stage) which chunks this worker has pushed for its host.
    Active { round: u32, got: &'a [bool], pushed: Option<&'a [bool]> },
    /// Nothing in flight: the last round this worker completed, if any.
    Idle { last: Option<u32> },
}

/// What to do about one chunk that changed server.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) struct Move {
    pub(super) chunk: usize,
    /// Its old and new connections (slots).
    pub(super) from: usize,
    pub(super) to: usize,
    /// Its old server is live (a move to one that joined): drop it from
    /// that connection's queue and windows, ignore what it still says.
    pub(super) detach: bool,
    /// The round of the last result to restore on the new server, if this
    /// worker received one (another worker may have missed it).
    pub(super) restore: Option<u32>,
    /// Push it again to the new server: the old one had not answered.
    pub(super) resend: bool,
}

/// The pure part of a move (torchft's way: no sockets, tested alone):
/// from the old and new placement of a tensor, what this worker holds of
/// it, and whether each connection still counts (`live`: not written
/// off), which chunks move and what each needs. Chunks move only off
/// lost servers or to servers that joined: whatever changed server is
/// re-sent and restored, whichever loss a note is for (with two at once,
/// the later placement may come first).
pub(super) fn plan(old: &TensorSpec, new: &TensorSpec, holding: Holding, live: impl Fn(usize) -> bool) -> Vec<Move> {
    let n = old.num_chunks().min(new.num_chunks());
    (0..n)
        .filter(|&c| old.slots[c] != new.slots[c])
        .map(|c| {
            let (from, to) = (old.slots[c] as usize, new.slots[c] as usize);
            let (restore, resend) = match holding {
                Holding::Active { round, got, pushed } => {
                    let restore = if got[c] { Some(round) } else { round.checked_sub(1) };
                    // Through the host stage a chunk not pushed yet goes to
                    // the new server when the host's sum is ready.
                    (restore, !got[c] && pushed.is_none_or(|p| p[c]))
                }
                Holding::Idle { last } => (last, false),
            };
            Move { chunk: c, from, to, detach: live(from), restore, resend }
        })
        .collect()
}

impl IoCore {
    /// The scheduler moved a lost server's chunks (`FailoverNote`): drop its
    /// connections, re-send what it had not answered to the chunks' new
    /// servers and restore the last results this worker holds of them.
    pub(super) fn apply_failover(&mut self, note: FailoverNote) {
        let io = self.io.clone();
        let io = &*io;
        for &i in &note.conns {
            let Some(c) = io.send.conns.get(i).filter(|_| i < self.rx.len()) else { continue };
            if c.advance(LinkState::Dead) == LinkState::Dead {
                continue;
            }
            self.rx[i].reset();
            c.link().deregister(&io.send.registry);
            let mut st = c.send();
            st.broken_at.get_or_insert_with(Instant::now);
            st.clear();
            drop(st);
            // What it held is re-queued below, or waits for nothing any more.
            io.admission.spread().drop_slot(i);
        }
        let (mut touched, mut restored, mut resent) = (Vec::new(), 0usize, 0usize);
        {
            let mut guard = io.ops();
            let ops = &mut *guard;
            io.failover.prune_released(ops);
            {
                let latest = io.failover.latest();
                ops.applied.retain(|k, _| latest.contains_key(k));
            }
            for (noted, current) in &note.moved {
                let key = noted.key;
                // The newest placement, which this note's may already be behind.
                let spec = &io.failover.latest_spec(key).unwrap_or_else(|| noted.clone());
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
                        let Some(conn) = io.send.conns.get(slot as usize) else { continue };
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
                let released = ops.released.iter().find(|r| r.spec.key == key);
                let holding = match (ops.active.get(&key), released) {
                    (Some(a), _) => {
                        Holding::Active { round: a.round, got: &a.got, pushed: a.host.as_ref().map(|h| &h.pushed[..]) }
                    }
                    (None, Some(r)) => Holding::Idle { last: r.last_round },
                    (None, None) => Holding::Idle { last: ops.rounds.get(&key).and_then(|r| r.checked_sub(1)) },
                };
                let live = |slot: usize| io.send.conns.get(slot).is_some_and(|c| c.state() < LinkState::WrittenOff);
                let moves = plan(&old, spec, holding, live);
                log::debug!(
                    target: &format!("worker {}", io.rank),
                    "failover from server {}: tensor '{}' moves {moves:?}",
                    note.lost,
                    spec.name,
                );
                for m in &moves {
                    if m.detach {
                        // Off a live server (a move to one that joined): stop
                        // counting on it for this chunk.
                        detach(&io.admission, &io.send.conns[m.from], key, m.chunk as u32);
                        if m.from >= self.moved_off.len() {
                            self.grow(); // added (a server joined) since the loop grew
                        }
                        self.moved_off[m.from].insert((key, m.chunk as u32));
                        // Its windows have room now: what waits for it may go.
                        if !touched.contains(&m.from) {
                            touched.push(m.from);
                        }
                    }
                    if let Some(back) = self.moved_off.get_mut(m.to) {
                        back.remove(&(key, m.chunk as u32)); // moved back
                    }
                }
                // Its next rounds go to the new slots (a released tensor has none).
                if ops.active.contains_key(&key) || released.is_none() {
                    io.note_placement(&old, false);
                    io.note_placement(spec, true);
                }
                let seq = &mut ops.seq;
                let from = match (ops.active.get(&key), released) {
                    (Some(a), _) => {
                        Held { spec, kept: ops.kept.get(&key), shared: a.host.as_ref().map(|h| h.shared.clone()) }
                    }
                    (None, Some(r)) => Held { spec, kept: r.kept.as_ref(), shared: r.shared.clone() },
                    (None, None) => Held {
                        spec,
                        kept: ops.kept.get(&key),
                        shared: io.host.stage.as_ref().and_then(|h| h.mapped(key)),
                    },
                };
                for m in &moves {
                    restored += self.queue_restore(seq, &from, m.chunk, m.restore, &mut touched) as usize;
                }
                if let Some(a) = ops.active.get_mut(&key) {
                    a.spec = spec.clone();
                    for m in moves.iter().filter(|m| m.resend) {
                        if let Some(slot) = io.queue_chunk(seq, a, m.chunk, Again::No) {
                            resent += 1;
                            if !touched.contains(&slot) {
                                touched.push(slot);
                            }
                        }
                    }
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

    /// Queue a `Restore` of chunk `c`'s result of round `last`, if this
    /// worker holds it (it pushes the chunk, and received that round).
    fn queue_restore(&self, seq: &mut u64, from: &Held, c: usize, last: Option<u32>, touched: &mut Vec<usize>) -> bool {
        let Some(round) = last else { return false };
        let io = &self.io;
        let spec = from.spec;
        let data: Vec<u8> = match (&from.shared, from.kept) {
            (Some(st), _) => {
                if io.layout.owner(io.rank, spec.key, c as u32) != io.rank || !st.has_result(c, round) {
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
        let Some(conn) = io.send.conns.get(slot) else { return false };
        let mut header = Header::new(MsgType::Restore);
        (header.namespace, header.key, header.chunk, header.round, header.dtype) =
            (io.namespace, spec.key, c as u32, round, spec.dtype);
        *seq += 1;
        conn.send().heap.push(SendItem::Control { seq: *seq, header, payload: data });
        if !touched.contains(&slot) {
            touched.push(slot);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::{plan, Holding, Move};
    use crate::protocol::{DType, TensorSpec};

    fn spec(slots: &[u32]) -> TensorSpec {
        TensorSpec {
            key: 7,
            name: "t".into(),
            numel: 4 * slots.len() as u64,
            dtype: DType::F32,
            chunk_elems: 4,
            slots: slots.to_vec(),
            replicas: Vec::new(),
            relays: Vec::new(),
            members: Vec::new(),
        }
    }

    fn mv(chunk: usize, from: usize, to: usize, detach: bool, restore: Option<u32>, resend: bool) -> Move {
        Move { chunk, from, to, detach, restore, resend }
    }

    #[test]
    fn only_chunks_that_changed_server_move_and_a_lost_server_is_not_detached() {
        let (old, new) = (spec(&[0, 1, 2, 1]), spec(&[0, 3, 2, 0]));
        // Slot 1's server was lost (written off): nothing to detach there.
        let got = [true, false, false, true];
        let moves = plan(&old, &new, Holding::Active { round: 5, got: &got, pushed: None }, |s| s != 1);
        assert_eq!(
            moves,
            // Chunk 1: no result yet, so re-sent; the last result to restore is
            // the previous round's. Chunk 3: its result is in: restore this
            // round's, nothing to re-send.
            vec![mv(1, 1, 3, false, Some(4), true), mv(3, 1, 0, false, Some(5), false)]
        );
    }

    #[test]
    fn a_move_to_a_server_that_joined_detaches_from_the_live_one() {
        let (old, new) = (spec(&[0, 1]), spec(&[2, 1]));
        let moves = plan(&old, &new, Holding::Active { round: 0, got: &[false, false], pushed: None }, |_| true);
        // Round 0 has no earlier result to restore.
        assert_eq!(moves, vec![mv(0, 0, 2, true, None, true)]);
    }

    #[test]
    fn through_the_host_stage_only_what_was_pushed_is_resent() {
        let (old, new) = (spec(&[0, 0, 0]), spec(&[1, 1, 1]));
        let holding = Holding::Active { round: 2, got: &[false, false, true], pushed: Some(&[true, false, true]) };
        let moves = plan(&old, &new, holding, |_| false);
        let resend: Vec<bool> = moves.iter().map(|m| m.resend).collect();
        // Chunk 1 is pushed to its new server when the host's sum is ready;
        // chunk 2's result is in.
        assert_eq!(resend, vec![true, false, false]);
    }

    #[test]
    fn an_idle_tensor_restores_its_last_round_and_resends_nothing() {
        let (old, new) = (spec(&[0, 1]), spec(&[1, 1]));
        assert_eq!(
            plan(&old, &new, Holding::Idle { last: Some(9) }, |_| false),
            vec![mv(0, 0, 1, false, Some(9), false)]
        );
        assert_eq!(plan(&old, &new, Holding::Idle { last: None }, |_| false), vec![mv(0, 0, 1, false, None, false)]);
        // A placement with fewer chunks (never in practice) moves only the common ones.
        assert!(plan(&spec(&[0, 1, 2]), &spec(&[0]), Holding::Idle { last: None }, |_| true).is_empty());
    }
}
