//! Starting a push_pull: admit it (one round of a tensor at a time), make
//! its op active, and queue its chunks (through the host stage: after the
//! host's sums), sending from the caller's thread at once.

use super::Completion;
use std::time::Instant;

use super::failover::{Kept, NO_ROUND};
use super::flow::{Active, HostRound};
use super::item::{Again, ChunkSend, Route, SendItem};
use super::{left_message, Io, Submission};
use crate::waits::StallWatch;

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
        let Some(h) = &self.host.stage else {
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
            || matches!(route, Route::Caller | Route::Kept)
                && a.op.live.is_some_and(|(from, to)| hi * es <= from || lo * es >= to);
        let len = if zeros { 0 } else { src.len };
        let item = SendItem::Chunk(ChunkSend {
            priority: a.priority,
            seq: *seq,
            key: a.spec.key,
            chunk: c as u32,
            round: a.round,
            flags: again.flags(if zeros { a.flags | crate::protocol::FLAG_ZEROS } else { a.flags }),
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
}
