//! Chunks arriving and leaving: installing declared or adopted chunks
//! (from the state a replica kept, when the lost owner's replica was us),
//! releasing tensors every worker released, giving chunks up to a server
//! that joined (and dropping what still comes for them), and what only an
//! adopted chunk sees: restored results and replayed pushes. Also a worker
//! leaving the job, which strands the rounds it never pushed.

use std::collections::HashSet;

use super::accumulation::Accumulation;
use super::delta::Deltas;
use super::flush::{self, Carry, TxItem};
use super::round::{Origin, Reply, Restored, Role, Round};
use super::sum::{Chunk, ChunkBuf};
use super::validate::{Dest, PayloadKind};
use super::{ConnResult, ServerThread, FREED_MEMORY};
use crate::protocol::{Header, MsgType, TensorSpec};
use crate::server::replica;
use crate::transport::bytes;

impl ServerThread {
    pub(super) fn install(&mut self, specs: &[TensorSpec], adopt: bool) {
        let n = (self.cfg.num_workers + self.cfg.relays) as usize;
        let layout = self.cfg.layout.clone();
        for s in specs {
            self.names.insert(s.key, s.name.clone());
            for (c, &slot) in s.slots.iter().enumerate() {
                let at = (s.key, c as u32);
                let rep = s.replicas.get(c).copied();
                let (a, b) = s.chunk_range(c);
                let elems = b - a;
                // A chunk owned in another rack that our rack sums here first
                // (else, if ours, we own it, and the owner's rack is ours).
                let mine = layout.num_racks() > 0 && s.slot_for(self.cfg.rack, c) == self.cfg.slot;
                let upstream = (mine && slot != self.cfg.slot).then_some(slot);
                let relay_slot = |r: u32| s.slot_for(r, c);
                if slot != self.cfg.slot && upstream.is_none() {
                    if rep == Some(self.cfg.slot) {
                        let new = replica::Replica { elems, state: None, done: None, next: Vec::new() };
                        self.replicas.chunks.entry(at).or_insert(new);
                    } else {
                        self.replicas.chunks.remove(&at);
                    }
                    continue;
                }
                self.moved_away.remove(&at);
                if let Some(&idx) = self.index.get(&at) {
                    if self.chunks[idx].round.set_replica(rep) {
                        self.sync_replica(idx);
                    }
                    continue;
                }
                // Taken over from a lost server whose replica we were: go
                // on from the state it replicated here.
                let from = self.replicas.chunks.remove(&at).filter(|_| adopt);
                let role = match upstream {
                    Some(owner) => Role::Relay { owner },
                    None => Role::Owner { replica: rep },
                };
                let origin = if adopt { Origin::Adopted } else { Origin::Installed };
                let relay = upstream.is_some();
                // A member tensor's members push for themselves (no host stage, no relays).
                let (pushers, init_from) = match s.members.first() {
                    Some(&first) => (s.members.clone(), first),
                    None => (
                        layout.pushers_at(s.key, c as u32, self.cfg.rack, relay, &relay_slot),
                        layout.init_pusher(s.key, c as u32, self.cfg.rack, relay, &relay_slot).unwrap_or(u32::MAX),
                    ),
                };
                let order = Accumulation::new(self.cfg.sum_order, s.dtype, &pushers);
                let mut chunk = Chunk {
                    key: s.key,
                    chunk: c as u32,
                    dtype: s.dtype,
                    elems,
                    round: Round::new(role, origin, pushers, init_from, n),
                    buf: ChunkBuf::new(s.dtype, elems),
                    direct_in_progress: false,
                    deferred: Vec::new(),
                    opt: None,
                    order,
                    deltas: None,
                };
                let from = match from {
                    // An asynchronous chunk: its parameters and pushers' counts.
                    Some(r) if !r.next.is_empty() => {
                        if let (Some(state), ChunkBuf::F32(b)) = (&r.state, &mut chunk.buf) {
                            if b[0].len() == state.param.len() {
                                b[0].copy_from_slice(&state.param);
                                let staleness = self.cfg.training.staleness();
                                chunk.deltas =
                                    Some(Box::new(Deltas::restored(&chunk.round.pushers, &r.next, staleness)));
                            }
                        }
                        None
                    }
                    other => other,
                };
                if let Some(replica::Replica { state: Some(state), done: Some(d), .. }) = from {
                    if let ChunkBuf::F32(b) = &mut chunk.buf {
                        if b[(d & 1) as usize].len() == state.param.len() {
                            b[(d & 1) as usize].copy_from_slice(&state.param);
                            chunk.round.resume_after(d);
                            chunk.opt = Some(state);
                        }
                    }
                }
                let needs_sync = chunk.opt.is_some() || chunk.deltas.is_some();
                let idx = match self.free.pop() {
                    Some(i) => {
                        self.chunks[i] = chunk;
                        i
                    }
                    None => {
                        self.chunks.push(chunk);
                        self.chunks.len() - 1
                    }
                };
                self.index.insert(at, idx);
                self.keys_here.entry(s.key).or_insert_with(|| (s.dtype, Vec::new())).1.push(idx);
                if needs_sync {
                    self.sync_replica(idx); // its replica is a new one
                }
            }
        }
    }

    /// Every worker released these tensors, so each of their rounds is
    /// complete and its results were received: free their chunks (the
    /// slots are reused by later tensors). A push for them now is an error
    /// (an unknown key).
    pub(super) fn release(&mut self, keys: &[u32]) {
        self.replicas.release(keys);
        if !self.moved_away.is_empty() {
            self.moved_away.retain(|(k, _)| !keys.contains(k));
        }
        let mut freed = Vec::new();
        for key in keys {
            self.names.remove(key);
            self.opt_cfg.remove(key);
            self.shm.remove(key);
            let Some((_, idxs)) = self.keys_here.remove(key) else { continue };
            if self.freed.len() == FREED_MEMORY {
                if let Some(old) = self.freed.pop_front() {
                    self.freed_set.remove(&old);
                }
            }
            self.freed.push_back(*key);
            self.freed_set.insert(*key);
            for idx in idxs {
                let ch = &mut self.chunks[idx];
                self.index.remove(&(ch.key, ch.chunk));
                if !ch.round.untouched() {
                    // Only a worker breaking the protocol can have pushed it.
                    let who = format!("server {}/t{}", self.cfg.server, self.cfg.thread);
                    log::warn!(target: &who, "tensor key {key} released with a partial round {}", ch.round.number());
                }
                ch.round.retire();
                ch.buf = ChunkBuf::empty();
                ch.opt = None;
                ch.deferred.clear();
                ch.order.clear(&mut self.pool);
                freed.push(idx);
            }
        }
        // A push arriving into a freed chunk breaks the protocol too; its
        // destination must not be reused under it.
        let stray: Vec<usize> = self
            .conns
            .iter()
            .filter(|(_, c)| c.rx.target().is_some_and(|d| freed.contains(&d.chunk)))
            .map(|(&t, _)| t)
            .collect();
        for t in stray {
            self.close(t, "push for a tensor every worker released");
        }
        self.free.extend(freed);
    }

    /// Give up our chunks that `specs` place elsewhere (see
    /// `ThreadCmd::GiveUp`); returns the ones kept for their server-side
    /// optimizer state. A round in progress is abandoned: its pushers
    /// re-send their pushes to the new server, and whoever received a
    /// result from here restores it there.
    pub(super) fn give_up(&mut self, specs: &[TensorSpec]) -> Vec<(u32, u32)> {
        let mut kept = Vec::new();
        let mut gone = Vec::new();
        for s in specs {
            for (c, &slot) in s.slots.iter().enumerate() {
                let at = (s.key, c as u32);
                let Some(&idx) = self.index.get(&at).filter(|_| slot != self.cfg.slot) else { continue };
                if self.chunks[idx].opt.is_some() || self.opt_cfg.contains_key(&s.key) {
                    kept.push(at);
                    continue;
                }
                self.index.remove(&at);
                if let Some((_, idxs)) = self.keys_here.get_mut(&s.key) {
                    idxs.retain(|&i| i != idx);
                    if idxs.is_empty() {
                        self.keys_here.remove(&s.key);
                    }
                }
                self.moved_away.insert(at);
                self.chunks[idx].round.retire();
                gone.push(idx);
            }
        }
        if gone.is_empty() {
            return kept;
        }
        for c in self.conns.values_mut() {
            c.results.retain(|r| !gone.contains(&r.chunk));
        }
        log::info!(target: &self.who(), "gave up {} chunk(s) to a server that joined", gone.len());
        self.retired.extend(gone);
        self.free_retired();
        kept
    }

    /// Free the given-up chunks no frame is being read into or written from.
    pub(super) fn free_retired(&mut self) {
        let busy: HashSet<usize> = self
            .conns
            .values()
            .flat_map(|c| {
                let reading = c.rx.target().map(|d| d.chunk);
                let writing = match c.tx.current() {
                    Some(Carry::Result { chunk, .. }) => Some(*chunk),
                    _ => None,
                };
                reading.into_iter().chain(writing)
            })
            .collect();
        let mut freed = Vec::new();
        self.retired.retain(|&idx| {
            if busy.contains(&idx) {
                return true;
            }
            freed.push(idx);
            false
        });
        for idx in freed {
            let ch = &mut self.chunks[idx];
            ch.buf = ChunkBuf::empty();
            ch.direct_in_progress = false;
            self.pool.append(&mut ch.deferred);
            ch.order.clear(&mut self.pool);
            self.free.push(idx);
        }
    }

    /// A frame for a chunk given up here: a push is acknowledged (its
    /// worker re-sends it to the chunk's new server once it learns of the
    /// move) and, like a restored result or an optimizer config, dropped.
    pub(super) fn drop_moved(&mut self, t: usize, hdr: Header) -> ConnResult {
        let conn = self.conns.get_mut(&t).ok_or("internal: no connection")?;
        let want = hdr.payload_len as usize;
        if want > 0 {
            conn.scratch_for(want, 0, &mut self.pool);
            let kind = if hdr.msg_type == MsgType::Push { PayloadKind::Moved } else { PayloadKind::Discard };
            conn.rx.receive_into(hdr, Dest { chunk: usize::MAX, direct: false, parity: 0, len: want, kind });
            return Ok(());
        }
        if matches!(hdr.msg_type, MsgType::Push | MsgType::PushRef) {
            self.ack_moved(t, &hdr);
        }
        Ok(())
    }

    /// Acknowledge a push for a chunk given up here.
    pub(super) fn ack_moved(&mut self, t: usize, hdr: &Header) {
        if let Some(c) = self.conns.get_mut(&t) {
            flush::ack(&mut c.acks, self.cfg.namespace, hdr);
        }
    }

    /// A restored result of round s (in the connection's scratch buffer):
    /// it sets an adopted chunk's round, completes round s if it is the
    /// one being summed, or is kept for replays of round s; older ones are
    /// stale (every worker had them).
    pub(super) fn restore(&mut self, t: usize, hdr: Header, idx: usize) -> ConnResult {
        let conn = self.conns.get(&t).ok_or("internal: no connection")?;
        let ch = &mut self.chunks[idx];
        let s = hdr.round;
        // An asynchronous chunk's parameters came from its replica; a
        // worker's last answer is older news.
        if ch.deltas.is_some() {
            return Ok(());
        }
        let effect = ch.round.restore(s, hdr.priority);
        if effect == Restored::Stale {
            return Ok(());
        }
        let src = &bytes(&conn.scratch)[..ch.bytes()];
        ch.write_result((s & 1) as usize, src);
        if effect == Restored::Completes {
            // Pushes waiting for their turn in rank order have their result now.
            ch.order.clear(&mut self.pool);
            self.send_results(idx);
        }
        Ok(())
    }

    /// A push of round `hdr.round`, already complete here: answer it with
    /// the result (the payload, received into scratch, is not needed).
    pub(super) fn replay(&mut self, t: usize, hdr: Header, idx: usize, reply: Reply) -> ConnResult {
        let conn = self.conns.get_mut(&t).ok_or("internal: no connection")?;
        self.seq += 1;
        let priority = hdr.priority;
        conn.results.push(TxItem { priority, seq: self.seq, chunk: idx, round: hdr.round, reply, push: false });
        conn.note_answer(idx, hdr.round);
        self.flush(t)
    }

    /// Worker `rank` left: the workers that pushed a round it never will
    /// are told why (their connections close, which fails their job).
    pub(super) fn on_left(&mut self, rank: u32) {
        let Some(l) = self.left.get_mut(rank as usize) else { return };
        *l = true;
        let mut close: Vec<(usize, String)> = Vec::new();
        for ch in self.chunks.iter().filter(|c| !c.round.untouched()) {
            if let Some(why) = self.never_completes(ch) {
                for r in ch.round.pushed_ranks() {
                    if let Some(t) = self.worker_conn[r as usize] {
                        if !close.iter().any(|(c, _)| *c == t) {
                            close.push((t, why.clone()));
                        }
                    }
                }
            }
        }
        for (t, why) in close {
            self.close(t, &why);
        }
    }
}
