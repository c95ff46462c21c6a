//! This thread's links to other server threads: as a rack's relay, pushing
//! its rack's sum of a round to the chunk's owner and taking the owner's
//! result as the round's; as an owner, keeping the replica of a chunk's
//! optimizer state in step (`super::super::replica`) and releasing a held
//! round on its ack.

use super::round::{Phase, Reply};
use super::ServerThread;
use crate::server::replica;

use super::flush::TxItem;

impl ServerThread {
    /// Every pusher of a round we relay pushed: push the rack's sum to the
    /// chunk's owner at `slot` (16-bit sums rounded once more, to travel in
    /// the tensor's dtype); its result completes the round (`relayed`).
    pub(super) fn forward(&mut self, idx: usize, slot: u32) {
        let ch = &mut self.chunks[idx];
        ch.narrow_for_owner(ch.round.parity());
        // From now on the round waits for the owner, whose stall reports are its own.
        ch.round.forward();
        self.cfg.traffic.relay();
        let (priority, round) = (ch.round.priority, ch.round.number());
        let (key, chunk) = (ch.key, ch.chunk);
        let Some(&t) = self.uplinks.get(&slot) else {
            let owner = self.owners.get(&slot).cloned().unwrap_or_else(|| format!("server thread slot {slot}"));
            let why = format!(
                "tensor '{}' chunk {chunk}: this rack's sum cannot reach the chunk's owner, {owner}: no link (its server is gone)",
                self.name(key)
            );
            return self.fail_pushers(&[idx], &why);
        };
        self.seq += 1;
        if let Some(c) = self.conns.get_mut(&t) {
            c.results.push(TxItem { priority, seq: self.seq, chunk: idx, round, reply: Reply::Bytes, push: true });
        }
        if let Err(why) = self.flush(t) {
            self.close(t, &why.to_string());
        }
    }

    /// The owner's result of a round we relayed arrived (into the round's
    /// result buffer): it is the round's result here too.
    pub(super) fn relayed(&mut self, idx: usize) {
        self.send_results(idx);
    }

    /// Our link to the owner at `slot` (`peer`) closed (`why`): the rounds
    /// relayed there can never complete, so their pushers are told.
    pub(super) fn uplink_broke(&mut self, slot: u32, peer: &str, why: &str) {
        let stuck: Vec<usize> = (0..self.chunks.len())
            .filter(|&i| {
                let ch = &self.chunks[i];
                ch.round.upstream() == Some(slot) && self.index.contains_key(&(ch.key, ch.chunk))
            })
            .filter(|&i| self.chunks[i].round.in_flight())
            .collect();
        if !stuck.is_empty() {
            let why = format!(
                "the link to {peer}, which owns chunks this rack sums here first, closed{}",
                if why.is_empty() { String::new() } else { format!(": {why}") }
            );
            self.fail_pushers(&stuck, &why);
        }
    }

    /// Close the connections of the workers that pushed these chunks' rounds, telling them why.
    pub(super) fn fail_pushers(&mut self, idxs: &[usize], why: &str) {
        let mut tokens: Vec<usize> = Vec::new();
        for &idx in idxs {
            for r in self.chunks[idx].round.pushed_ranks() {
                tokens.extend(self.worker_conn.get(r as usize).copied().flatten());
            }
        }
        tokens.sort_unstable();
        tokens.dedup();
        for t in tokens {
            self.close(t, why);
        }
    }

    /// Queue `frame` on the link to replica `slot`. Without one (it broke,
    /// or could not be opened) the frame is dropped: the results it would
    /// release stay held until a failover gives the chunk a new replica,
    /// or `check_held` fails the job.
    pub(super) fn send_to_replica(&mut self, slot: u32, frame: Vec<u8>) {
        let Some(&t) = self.links.get(&slot) else { return };
        if let Some(c) = self.conns.get_mut(&t) {
            c.notices.push_back(frame);
        }
        if let Err(why) = self.flush(t) {
            self.close(t, &why.to_string());
        }
    }

    /// Chunk `idx`'s replica is new: send it the optimizer and the whole
    /// state (a held round waits for this ack instead), or, without a
    /// replica, release a held round.
    pub(super) fn sync_replica(&mut self, idx: usize) {
        if self.chunks[idx].deltas.is_some() {
            return self.sync_async_replica(idx);
        }
        let ch = &self.chunks[idx];
        let (key, chunk, ns) = (ch.key, ch.chunk, self.cfg.namespace);
        let (Some(state), Some(slot)) = (ch.opt.as_ref(), ch.round.replica()) else {
            if matches!(ch.round.phase(), Phase::Held { .. }) && ch.round.replica().is_none() {
                self.send_results(idx);
            }
            return;
        };
        // A held round is done already: the new replica acks that one.
        let round = ch.round.done().unwrap_or(ch.round.number().wrapping_sub(1));
        let snapshot = replica::snapshot_frame(ns, (key, chunk, round), state);
        if let Some(cfg) = self.opt_cfg.get(&key) {
            let frame = replica::config_frame(ns, key, cfg);
            self.send_to_replica(slot, frame);
        }
        self.send_to_replica(slot, snapshot);
    }

    /// Our replica acked a round of a chunk: if that round is held, its results go out.
    pub(super) fn on_replica_ack(&mut self, hdr: &crate::protocol::Header) {
        let Some(&idx) = self.index.get(&(hdr.key, hdr.chunk)) else { return };
        if let Some(d) = self.chunks[idx].deltas.as_mut() {
            d.acked();
            return self.answer_async(idx);
        }
        if self.chunks[idx].round.held_for(hdr.round) {
            self.send_results(idx);
        }
    }
}
