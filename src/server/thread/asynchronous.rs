//! The server thread's side of asynchronous chunks (`delta`,
//! `GRADHUB_ASYNC`): checking a push against its pusher's count, adding
//! the parameter change to the parameters the chunk holds (its result
//! buffer of parity 0), and answering each pusher with a copy of the
//! parameters as they are when its answer may go. Every push is acked at
//! once, so a worker's credit never waits on another worker; the answer
//! travels as an owned frame (a copy), because the parameters change under
//! a frame that is still being written.

use super::delta::{Admit, Deltas, Refusal};
use super::flush;
use super::sum::{ChunkBuf, Source};
use super::validate::PayloadKind;
use super::{ConnResult, ServerThread};
use crate::kernels;
use crate::protocol::{encode_frame, DType, Header, MsgType, FLAG_ASYNC, FLAG_AVERAGE, FLAG_INIT, FLAG_ZEROS};
use crate::server::replica;
use crate::transport::{cast, ConnError};

impl ServerThread {
    /// Checks of a push of, or to, an asynchronous chunk (a push with
    /// FLAG_ASYNC, or any push of a chunk that is asynchronous).
    pub(super) fn check_async_push(&self, idx: usize, rank: u32, hdr: &Header) -> Result<PayloadKind, ConnError> {
        let ch = &self.chunks[idx];
        let what = format!("tensor '{}' chunk {}", self.name(hdr.key), hdr.chunk);
        let bad = |why: String| Err(ConnError::Invalid(format!("{what}: {why}")));
        if !self.cfg.training.is_asynchronous() {
            return bad("an asynchronous push in a synchronous job: set GRADHUB_ASYNC=1 on every member".into());
        }
        if hdr.flags & FLAG_ASYNC == 0 {
            return bad(format!("worker {rank} pushed it synchronously, but it is asynchronous"));
        }
        if hdr.flags & (FLAG_ZEROS | FLAG_AVERAGE) != 0 {
            return bad("an asynchronous push carries a parameter change: never zeros or an average".into());
        }
        if ch.dtype != DType::F32 || hdr.dtype != DType::F32 {
            return bad(format!("asynchronous tensors are float32 (this one is {})", ch.dtype.name()));
        }
        if ch.round.upstream().is_some() {
            return bad("asynchronous tensors are not reduced within racks (GRADHUB_RACK_REDUCE=off)".into());
        }
        if hdr.flags & FLAG_INIT != 0 && hdr.round != 0 {
            return bad(format!(
                "worker {rank} sent initial parameters in round {} (only its first push may)",
                hdr.round
            ));
        }
        match &ch.deltas {
            Some(d) => {
                if let Err(e) = d.admit(rank, hdr.round) {
                    return bad(refusal(rank, hdr.round, e));
                }
            }
            None if hdr.flags & FLAG_INIT == 0 || hdr.round != 0 || !ch.round.untouched() || ch.round.number() != 0 => {
                return bad(format!(
                    "worker {rank} pushed round {} before the tensor's parameters (an init push of round 0)",
                    hdr.round
                ))
            }
            None => {}
        }
        Ok(PayloadKind::Push)
    }

    /// Apply `rank`'s push (its data at `src`) to the chunk's parameters,
    /// ack it, and send the answers that may go now.
    pub(super) fn add_async(&mut self, t: usize, hdr: Header, idx: usize, src: Source) -> ConnResult {
        let conn = self.conns.get_mut(&t).ok_or("internal: no connection")?;
        let rank = conn.rank.ok_or("internal: no rank")?;
        let staleness = self.cfg.training.staleness();
        let ch = &mut self.chunks[idx];
        let n = ch.elems;
        let pushers = &ch.round.pushers;
        let deltas = ch.deltas.get_or_insert_with(|| Box::new(Deltas::new(pushers, staleness)));
        // Checked when the header came; checked again now that it is
        // applied (a second push of the same round sent meanwhile).
        let by_ref = matches!(src, Source::Shared(_));
        match deltas.admit(rank, hdr.round) {
            Err(e) => return Err(ConnError::Invalid(refusal(rank, hdr.round, e))),
            Ok(Admit::Replay) => {
                deltas.replayed(rank, hdr.round, by_ref);
                flush::ack(&mut conn.acks, self.cfg.namespace, &hdr);
                if let Err(why) = self.flush(t) {
                    self.close(t, &why.to_string());
                }
                self.answer_async(idx);
                return Ok(());
            }
            Ok(Admit::Push) => {}
        }
        let data: &[f32] = match src {
            Source::Scratch if conn.scratch.len() >= n => &cast(&conn.scratch)[..n],
            // SAFETY: the pusher's chunk in the host's segment, n f32s
            // (checked by `parse_push_ref`), left alone until it is answered.
            Source::Shared(p) => unsafe { std::slice::from_raw_parts(p.cast::<f32>(), n) },
            _ => return Err("internal: asynchronous push data missing".into()),
        };
        let ChunkBuf::F32(b) = &mut ch.buf else { return Err("internal: asynchronous chunk not float32".into()) };
        let init = hdr.flags & FLAG_INIT != 0;
        let takes = init && rank == ch.round.init_from;
        match (init, takes) {
            (true, true) => b[0].copy_from_slice(data),
            (true, false) => {}
            (false, _) => kernels::add_f32(&mut b[0], data),
        }
        // The replica applies it too; the answer waits for its ack.
        let replica = ch.round.replica();
        let frame =
            replica.map(|_| replica::async_frame(self.cfg.namespace, (ch.key, ch.chunk, hdr.round), rank, takes, data));
        deltas.applied(rank, hdr.round, by_ref, takes, replica.is_some());
        flush::ack(&mut conn.acks, self.cfg.namespace, &hdr);
        self.cfg.traffic.add((n * 4) as u64, None);
        if let Err(why) = self.flush(t) {
            self.close(t, &why.to_string());
        }
        if let (Some(slot), Some(frame)) = (replica, frame) {
            self.send_to_replica(slot, frame);
        }
        self.answer_async(idx);
        Ok(())
    }

    /// Send every answer of chunk `idx` that may go now: a copy of the
    /// parameters to each pusher owed one (through shared memory to a
    /// pusher that pushed by reference).
    pub(super) fn answer_async(&mut self, idx: usize) {
        let Some(answers) = self.chunks[idx].deltas.as_mut().map(|d| d.answers()) else { return };
        for a in answers {
            crate::metrics::ASYNC_LEAD_MAX.fetch_max(a.lead as u64, std::sync::atomic::Ordering::Relaxed);
            let Some(t) = self.worker_conn[a.rank as usize] else { continue };
            let ch = &self.chunks[idx];
            let params = ch.result_bytes(0);
            let mut h = Header::new(MsgType::Result);
            (h.dtype, h.namespace, h.key, h.chunk, h.round) = (ch.dtype, self.cfg.namespace, ch.key, ch.chunk, a.round);
            let frame = match self.shm.get(&ch.key).filter(|_| a.by_ref) {
                Some(st) => {
                    let (dst, len) = st.result(ch.chunk as usize);
                    // SAFETY: the pusher's result slot of this chunk in the
                    // segment: it waits for this frame before reading it.
                    unsafe { std::ptr::copy_nonoverlapping(params.as_ptr(), dst, len.min(params.len())) };
                    h.msg_type = MsgType::ResultRef;
                    h.encode(&[]).to_vec()
                }
                None => {
                    h.payload_len = params.len() as u32;
                    encode_frame(&h, params)
                }
            };
            self.cfg.traffic.returned(params.len() as u64);
            if let Some(c) = self.conns.get_mut(&t) {
                c.notices.push_back(frame);
            }
            if let Err(why) = self.flush(t) {
                self.close(t, &why.to_string());
            }
        }
    }

    /// Chunk `idx`'s replica is new: send it the whole state (answers
    /// not acked by the old one wait for this ack instead), or, without a
    /// replica, let them go.
    pub(super) fn sync_async_replica(&mut self, idx: usize) {
        let ch = &mut self.chunks[idx];
        let (Some(d), ChunkBuf::F32(b)) = (ch.deltas.as_mut(), &ch.buf) else { return };
        let slot = ch.round.replica();
        let frame = slot
            .map(|_| replica::async_snapshot_frame(self.cfg.namespace, (ch.key, ch.chunk, 0), &d.next_pushes(), &b[0]));
        d.replica_changed(slot.is_some());
        if let (Some(slot), Some(frame)) = (slot, frame) {
            self.send_to_replica(slot, frame);
        }
        self.answer_async(idx);
    }

    /// Worker `rank`'s connection closed: its asynchronous chunks here stop
    /// waiting for it (a staleness bound held others back for it).
    pub(super) fn async_pusher_left(&mut self, rank: u32) {
        if !self.cfg.training.is_asynchronous() {
            return;
        }
        for idx in 0..self.chunks.len() {
            if let Some(d) = self.chunks[idx].deltas.as_mut() {
                d.leave(rank);
                self.answer_async(idx);
            }
        }
    }
}

/// Words for a refused asynchronous push.
fn refusal(rank: u32, round: u32, e: Refusal) -> String {
    match e {
        Refusal::NotAPusher => format!("worker {rank} pushed it, but another worker pushes it for that host"),
        Refusal::Round { want } => format!("worker {rank} pushed round {round}, but its next is {want}"),
        Refusal::Early { owed } => format!("worker {rank} pushed round {round} before it was answered for {owed}"),
    }
}
