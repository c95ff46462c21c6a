//! The second half of handling a frame: carrying out the `Command` that
//! `validate` made of its header, and what its payload (or a frame
//! received whole) then does. Pushes are added to their round here; a
//! complete round goes on to `relay::forward` or `flush::finish_round`.

use std::time::Instant;

use super::flush;
use super::round::Reply;
use super::sum::Source;
use super::validate::{Command, Dest, PayloadKind};
use super::{ConnResult, ServerThread};
use crate::protocol::{Header, MsgType, OptConfig, FLAG_ASYNC, FLAG_INIT, FLAG_RESENT, FLAG_ZEROS, PUSH_OWN_FLAGS};
use crate::server::replica;
use crate::transport::ConnError;

impl ServerThread {
    /// Carry out what a frame's header asked for (see `parse`).
    pub(super) fn apply(&mut self, t: usize, hdr: Header, cmd: Command) -> ConnResult {
        match cmd {
            Command::Receive(d) => self.receive(t, hdr, d),
            Command::PushRef { chunk, at, kind } => {
                self.chunks[chunk].round.learn(hdr.round);
                match kind {
                    PayloadKind::Replay => self.replay(t, hdr, chunk, Reply::to(hdr.flags, true)),
                    PayloadKind::Counted => {
                        let conn = self.conns.get_mut(&t).ok_or("internal: no connection")?;
                        flush::ack(&mut conn.acks, self.cfg.namespace, &hdr);
                        Ok(())
                    }
                    PayloadKind::Discard => Ok(()),
                    _ => self.add_push(t, hdr, chunk, Source::Shared(at)),
                }
            }
            Command::Moved => self.drop_moved(t, hdr),
            Command::ReplicaAck => {
                self.on_replica_ack(&hdr);
                Ok(())
            }
            Command::Nothing => Ok(()),
            Command::Whole | Command::ServerHello(_) | Command::DataHello(_) => {
                let conn = self.conns.get_mut(&t).ok_or("internal: no connection")?;
                match cmd {
                    Command::ServerHello(slot) => conn.server = Some(slot),
                    Command::DataHello(rank) => {
                        conn.rank = Some(rank);
                        if hdr.flags & FLAG_RESENT != 0 {
                            conn.answered = Some(Vec::new());
                        }
                        if let Some(old) = self.worker_conn[rank as usize].replace(t).filter(|&o| o != t) {
                            // (Set first, so closing the old one is no pusher leaving.)
                            log::info!(target: &self.who(), "worker {rank} mended its link: a new connection replaces the old one");
                            self.close(old, "");
                        }
                    }
                    _ => conn.rx.receive_owned(hdr),
                }
                Ok(())
            }
        }
    }

    /// Start receiving a payload into `d` (or, without one, act on it now).
    fn receive(&mut self, t: usize, hdr: Header, d: Dest) -> ConnResult {
        let conn = self.conns.get_mut(&t).ok_or("internal: no connection")?;
        let partition = self.cfg.partition_bytes as usize;
        match d.kind {
            PayloadKind::Counted => {
                conn.scratch_for(d.len, partition, &mut self.pool);
                if d.len == 0 {
                    flush::ack(&mut conn.acks, self.cfg.namespace, &hdr);
                    return Ok(());
                }
            }
            PayloadKind::Push | PayloadKind::Replay => {
                self.chunks[d.chunk].round.learn(hdr.round);
                if d.direct {
                    self.chunks[d.chunk].direct_in_progress = true;
                } else {
                    conn.scratch_for(d.len, partition, &mut self.pool);
                }
                if d.len == 0 {
                    let zeros = hdr.flags & FLAG_ZEROS != 0;
                    return match d.kind {
                        PayloadKind::Replay => self.replay(t, hdr, d.chunk, Reply::to(hdr.flags, false)),
                        _ => self.add_push(t, hdr, d.chunk, if zeros { Source::Zeros } else { Source::Scratch }),
                    };
                }
            }
            // (`drop_moved` receives the payloads of moved chunks itself.)
            PayloadKind::Restore | PayloadKind::Discard | PayloadKind::Moved => {
                conn.scratch_for(d.len, partition, &mut self.pool);
                if d.len == 0 {
                    return match d.kind {
                        PayloadKind::Restore => self.restore(t, hdr, d.chunk),
                        _ => Ok(()),
                    };
                }
            }
            PayloadKind::Upstream if d.len == 0 => {
                self.relayed(d.chunk);
                return Ok(());
            }
            PayloadKind::Upstream => {}
        }
        conn.rx.receive_into(hdr, d);
        Ok(())
    }

    /// A payload arrived whole into `d`.
    pub(super) fn on_payload(&mut self, t: usize, hdr: Header, d: Dest) -> ConnResult {
        // A chunk given up while its payload was being read: as if the
        // frame had come after (`drop_moved`).
        if d.kind != PayloadKind::Discard
            && self.index.get(&(hdr.key, hdr.chunk)) != Some(&d.chunk)
            && self.moved_away.contains(&(hdr.key, hdr.chunk))
        {
            if matches!(d.kind, PayloadKind::Push | PayloadKind::Replay | PayloadKind::Moved) {
                self.ack_moved(t, &hdr);
            }
            return Ok(());
        }
        match d.kind {
            PayloadKind::Push if d.direct => self.add_push(t, hdr, d.chunk, Source::Direct),
            // (Asynchronous chunks count pushes their own way: `delta`.)
            PayloadKind::Push if hdr.flags & FLAG_ASYNC != 0 || self.chunks[d.chunk].deltas.is_some() => {
                self.add_push(t, hdr, d.chunk, Source::Scratch)
            }
            PayloadKind::Push => match self.on_arrival(t, &hdr, d.chunk)? {
                PayloadKind::Push => self.add_push(t, hdr, d.chunk, Source::Scratch),
                PayloadKind::Replay => self.replay(t, hdr, d.chunk, Reply::to(hdr.flags, false)),
                _ => Ok(()),
            },
            PayloadKind::Replay => self.replay(t, hdr, d.chunk, Reply::to(hdr.flags, false)),
            PayloadKind::Restore => self.restore(t, hdr, d.chunk),
            PayloadKind::Counted => {
                // Its round may have completed while this payload arrived,
                // the result sent here first: that answers it.
                if let Some(c) = self.conns.get_mut(&t).filter(|c| !c.answered(d.chunk, hdr.round)) {
                    flush::ack(&mut c.acks, self.cfg.namespace, &hdr);
                }
                Ok(())
            }
            PayloadKind::Moved => {
                self.ack_moved(t, &hdr);
                Ok(())
            }
            PayloadKind::Upstream => {
                self.relayed(d.chunk);
                Ok(())
            }
            PayloadKind::Discard => Ok(()),
        }
    }

    /// Add a push to its chunk's round: its data from `src`. The last push
    /// completes the round; the others are acknowledged.
    fn add_push(&mut self, t: usize, hdr: Header, idx: usize, src: Source) -> ConnResult {
        if hdr.flags & FLAG_ASYNC != 0 {
            return self.add_async(t, hdr, idx, src);
        }
        let conn = self.conns.get_mut(&t).ok_or("internal: no connection")?;
        let rank = conn.rank.ok_or("internal: no rank")?;
        let ch = &mut self.chunks[idx];
        if matches!(src, Source::Scratch) && conn.scratch.len() * 4 < ch.bytes() {
            return Err("internal: push data missing".into());
        }
        let (parity, first, init) = ((hdr.round & 1) as usize, ch.round.untouched(), hdr.flags & FLAG_INIT != 0);
        ch.accumulate(parity, rank, first, init, src, &mut conn.scratch, &mut self.pool);
        let reply = Reply::to(hdr.flags, matches!(src, Source::Shared(_)));
        if !ch.round.add(rank, hdr.flags & !PUSH_OWN_FLAGS, hdr.priority, reply, Instant::now) {
            // The last push of a round is answered by the result itself
            // (one frame and one wake-up fewer on a small round trip).
            flush::ack(&mut conn.acks, self.cfg.namespace, &hdr);
            return Ok(());
        }
        let waited = ch.round.since().map(|t| (t, Instant::now(), ch.round.number()));
        match ch.round.upstream() {
            Some(slot) => self.forward(idx, slot),
            None => self.finish_round(idx),
        }
        if let (Some(tl), Some((first_push, last_push, round))) = (&self.cfg.timeline, waited) {
            let ch = &self.chunks[idx];
            tl.round(&crate::timeline::Round {
                thread: self.cfg.thread,
                tensor: self.names.get(&ch.key).map_or("?", String::as_str),
                chunk: ch.chunk,
                round,
                bytes: ch.bytes(),
                first_push,
                last_push,
                first: ch.round.first,
                last: rank,
                finished: Instant::now(),
            });
        }
        Ok(())
    }

    /// A frame received whole (see `parse`): an optimizer config, or
    /// replication from the server thread that owns the chunk.
    pub(super) fn on_message(&mut self, t: usize, hdr: Header, buf: &[u8]) -> ConnResult {
        let from = self.conns.get(&t).and_then(|c| c.server);
        match hdr.msg_type {
            MsgType::OptConfig => {
                let cfg = OptConfig::decode(buf)?;
                let changed = self.opt_cfg.insert(hdr.key, cfg) != Some(cfg);
                if changed && from.is_none() {
                    self.pass_on_opt_config(hdr.key, &cfg);
                }
                Ok(())
            }
            MsgType::Replicate | MsgType::Snapshot => {
                let r = match hdr.msg_type {
                    MsgType::Replicate => self.replicas.apply(&hdr, buf, self.opt_cfg.get(&hdr.key)),
                    _ => self.replicas.restore(&hdr, buf),
                };
                r.map_err(|e| ConnError::Invalid(format!("replication from server thread slot {from:?}: {e}")))?;
                if let Some(c) = self.conns.get_mut(&t) {
                    flush::ack(&mut c.acks, self.cfg.namespace, &hdr);
                }
                Ok(())
            }
            MsgType::Stall => Ok(()),
            other => Err(format!("internal: {other:?} received whole").into()),
        }
    }

    /// A worker's optimizer config for `key`: our replicas of the key's
    /// chunks need it too, and the owners of the chunks we relay apply it.
    fn pass_on_opt_config(&mut self, key: u32, cfg: &OptConfig) {
        let idxs = self.keys_here.get(&key).map(|k| k.1.clone()).unwrap_or_default();
        let ns = self.cfg.namespace;
        let mut slots: Vec<u32> = idxs.iter().filter_map(|&i| self.chunks[i].round.replica()).collect();
        slots.sort_unstable();
        slots.dedup();
        for slot in slots {
            self.send_to_replica(slot, replica::config_frame(ns, key, cfg));
        }
        let mut owners: Vec<u32> = idxs.iter().filter_map(|&i| self.chunks[i].round.upstream()).collect();
        owners.sort_unstable();
        owners.dedup();
        for slot in owners {
            let Some(&ut) = self.uplinks.get(&slot) else { continue };
            if let Some(c) = self.conns.get_mut(&ut) {
                c.notices.push_back(replica::config_frame(ns, key, cfg));
            }
            if let Err(why) = self.flush(ut) {
                self.close(ut, &why.to_string());
            }
        }
    }
}
