//! Results on their way out: finishing an owner's round (averaging, the
//! server-side optimizer, holding it for the replica), queueing the result
//! to the round's pushers in priority order, writing acks, notices and
//! results to a connection, and watching rounds that wait too long (stalls,
//! and results held for a replica that never acks).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::round::Reply;
use super::{ConnResult, ServerThread};
use crate::protocol::{encode_frame, encode_stall, Header, MsgType, FLAG_NO_RESULT};
use crate::transport::Outgoing;

/// A result waiting to be sent; higher priority first, then FIFO.
#[derive(PartialEq, Eq)]
pub(super) struct TxItem {
    pub priority: i32,
    pub seq: u64,
    pub chunk: usize,
    pub round: u32,
    pub reply: Reply,
    /// A relay's push of its rack's sum to the owner, not a result.
    pub push: bool,
}
impl Ord for TxItem {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.priority.cmp(&o.priority).then_with(|| o.seq.cmp(&self.seq))
    }
}
impl PartialOrd for TxItem {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}

/// What a frame being written carries: a result (its payload is a chunk's
/// result buffer), or nothing beyond pre-encoded bytes (acks, notices).
#[derive(Clone, Copy)]
pub(super) enum Carry {
    Result { chunk: usize, parity: usize },
    Encoded,
}

/// A round waiting too long: its chunk indices here, the missing ranks, how long.
type StalledRound = (Vec<usize>, Vec<u32>, Duration);

/// Append the `Received` ack of the frame `hdr` (a push, or a replica's
/// update) to `acks`: the one place it is built.
pub(super) fn ack(acks: &mut Vec<u8>, namespace: u32, hdr: &Header) {
    let mut ack = Header::new(MsgType::Received);
    (ack.namespace, ack.key, ack.chunk, ack.round) = (namespace, hdr.key, hdr.chunk, hdr.round);
    acks.extend_from_slice(&ack.encode(&[]));
}

impl ServerThread {
    /// Every pusher pushed an owner's round: finish the sum and send the
    /// result to each of them, or hold it for the replica's ack.
    pub(super) fn finish_round(&mut self, idx: usize) {
        let nw = self.cfg.num_workers;
        let ch = &mut self.chunks[idx];
        self.cfg.traffic.add((ch.bytes() * ch.round.pushers.len()) as u64, ch.round.since());
        let forward = ch.finish(nw, self.opt_cfg.get(&ch.key), self.cfg.namespace);
        if ch.round.stall_reported() {
            let name = self.names.get(&ch.key).map(String::as_str).unwrap_or("?");
            // Formatted here only: this function runs for every chunk of every round.
            let who = format!("server {}/t{}", self.cfg.server, self.cfg.thread);
            log::info!(
                target: &who,
                "stall resolved: tensor '{name}' chunk {} round {} complete",
                ch.chunk,
                ch.round.number()
            );
        }
        if let Some((slot, frame)) = forward {
            ch.round.hold(Instant::now());
            self.send_to_replica(slot, frame);
            return;
        }
        self.send_results(idx);
    }

    /// The chunk's round is complete (its result in the round's parity
    /// buffer): start the next one, send the result to the round's pushers.
    pub(super) fn send_results(&mut self, idx: usize) {
        let ch = &mut self.chunks[idx];
        let priority = ch.round.priority;
        let round = ch.round.complete();
        let mut returned = 0;
        for i in 0..self.chunks[idx].round.pushers.len() {
            let r = self.chunks[idx].round.pushers[i];
            // A restored result completes a round some pushers had not pushed.
            if !self.chunks[idx].round.pushed(r) {
                continue;
            }
            let Some(t) = self.worker_conn[r as usize] else { continue };
            self.seq += 1;
            let reply = self.chunks[idx].round.reply(r);
            if let Some(c) = self.conns.get_mut(&t) {
                c.results.push(TxItem { priority, seq: self.seq, chunk: idx, round, reply, push: false });
                c.note_answer(idx, round);
                returned += usize::from(reply != Reply::Nothing);
            }
            if let Err(why) = self.flush(t) {
                self.close(t, &why.to_string());
            }
        }
        self.cfg.traffic.returned((self.chunks[idx].bytes() * returned) as u64);
        self.chunks[idx].round.delivered();
    }

    /// Write acks, then notices, then results in priority order, until done
    /// or the socket is full.
    pub(super) fn flush(&mut self, t: usize) -> ConnResult {
        let Some(conn) = self.conns.get_mut(&t) else { return Ok(()) };
        let chunks = &self.chunks;
        let shm = &self.shm;
        let ns = self.cfg.namespace;
        let (acks, notices, results) = (&mut conn.acks, &mut conn.notices, &mut conn.results);
        let next = || {
            if !acks.is_empty() {
                return Some(Outgoing::encoded(Carry::Encoded, std::mem::take(acks)));
            }
            if let Some(n) = notices.pop_front() {
                return Some(Outgoing::encoded(Carry::Encoded, n));
            }
            let item = results.pop()?;
            let ch = &chunks[item.chunk];
            let parity = (item.round & 1) as usize;
            let mut h = Header {
                msg_type: if item.push { MsgType::Push } else { MsgType::Result },
                flags: if item.push { ch.round.flags } else { 0 },
                dtype: ch.dtype,
                namespace: ns,
                key: ch.key,
                chunk: ch.chunk,
                round: item.round,
                priority: item.priority,
                payload_len: (ch.elems * ch.dtype.size()) as u32,
            };
            if item.reply == Reply::Nothing {
                // The round is complete; the pusher wanted no bytes of it.
                h.flags = FLAG_NO_RESULT;
                h.payload_len = 0;
                return Some(Outgoing::encoded(Carry::Encoded, h.encode(&[]).to_vec()));
            }
            if item.reply == Reply::ByRef {
                if let Some(st) = shm.get(&ch.key) {
                    let src = ch.result_bytes(parity);
                    let (dst, len) = st.result(ch.chunk as usize);
                    // SAFETY: the pusher's chunk of this round in the segment:
                    // it waits for this frame before touching it again.
                    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, len.min(src.len())) };
                    h.msg_type = MsgType::ResultRef;
                    h.payload_len = 0;
                    return Some(Outgoing::encoded(Carry::Encoded, h.encode(&[]).to_vec()));
                }
            }
            Some(Outgoing::frame(Carry::Result { chunk: item.chunk, parity }, &h))
        };
        let payload = |c: &Carry| match *c {
            Carry::Result { chunk, parity } => chunks[chunk].result_bytes(parity),
            Carry::Encoded => &[],
        };
        conn.link.pump(self.poll.registry(), &mut conn.tx, next, payload)?;
        Ok(())
    }

    /// Results held for a replica's ack that never came (its link broke and
    /// no failover gave the chunk another within 3 peer timeouts): the
    /// job cannot go on safely, so every worker here is told why.
    pub(super) fn check_held(&mut self) {
        let limit = self.cfg.peer_timeout * 3;
        let now = Instant::now();
        let Some(ch) = self.chunks.iter().find(|c| c.round.held_past(now, limit)) else {
            return;
        };
        let why = format!(
            "tensor '{}' chunk {} round {}: its replica (server thread slot {}) has not acknowledged the round's \
             optimizer update for {:.1}s, and no failover came",
            self.name(ch.key),
            ch.chunk,
            ch.round.number(),
            ch.round.replica().map_or("none".to_string(), |s| s.to_string()),
            limit.as_secs_f64()
        );
        for c in self.chunks.iter_mut().filter(|c| matches!(c.round.phase(), super::round::Phase::Held { .. })) {
            c.round.retire();
        }
        let workers: Vec<usize> = self.conns.iter().filter(|(_, c)| c.rank.is_some()).map(|(&t, _)| t).collect();
        for t in workers {
            self.close(t, &why);
        }
    }

    /// Report rounds that have waited too long: which ranks did not push.
    pub(super) fn check_stalls(&mut self) {
        let now = Instant::now();
        // (key, round) -> (chunk indices, missing ranks, waited)
        let mut by_key: HashMap<(u32, u32), StalledRound> = HashMap::new();
        for (i, ch) in self.chunks.iter_mut().enumerate() {
            // A held round waits for its replica, not for a worker (`check_held`).
            let Some(waited) = ch.round.stalled(now, self.cfg.stall) else { continue };
            let e = by_key.entry((ch.key, ch.round.number())).or_insert_with(|| (Vec::new(), Vec::new(), waited));
            e.0.push(i);
            for r in ch.round.missing() {
                if !e.1.contains(&r) {
                    e.1.push(r);
                }
            }
        }
        for ((key, round), (idxs, mut missing, waited)) in by_key {
            crate::metrics::count(&crate::metrics::STALLS);
            missing.sort_unstable();
            let name = self.names.get(&key).cloned().unwrap_or_default();
            // Pushers after the workers are other racks' relays (`HostLayout::relay_id`).
            let nw = self.cfg.num_workers;
            let relays: Vec<u32> = missing.iter().filter(|&&r| r >= nw).map(|&r| r - nw).collect();
            let workers: Vec<u32> = missing.iter().copied().filter(|&r| r < nw).collect();
            let also = match relays.is_empty() {
                true => String::new(),
                false => format!(" and the rack relays at server thread slot(s) {relays:?}"),
            };
            log::warn!(
                target: &self.who(),
                "stall: tensor '{name}' (key {key}) round {round} has waited {:.1}s for worker rank(s) {workers:?}{also} ({} chunk(s) on this thread)",
                waited.as_secs_f64(),
                idxs.len()
            );
            let first = &self.chunks[idxs[0]];
            let payload = encode_stall(self.cfg.server, self.cfg.thread, waited.as_millis() as u64, &missing);
            let mut h = Header::new(MsgType::Stall);
            h.namespace = self.cfg.namespace;
            h.key = key;
            h.chunk = first.chunk;
            h.round = round;
            h.payload_len = payload.len() as u32;
            let pushed: Vec<u32> = first.round.pushed_ranks().collect();
            let frame = encode_frame(&h, &payload);
            for r in pushed {
                let Some(t) = self.worker_conn[r as usize] else { continue };
                if let Some(c) = self.conns.get_mut(&t) {
                    c.notices.push_back(frame.clone());
                }
                if let Err(why) = self.flush(t) {
                    self.close(t, &why.to_string());
                }
            }
        }
    }
}
