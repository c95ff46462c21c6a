//! The first half of handling a frame: its header checked against the
//! connection and the chunk it names, and turned into a typed `Command`
//! (what to receive, and where), or refused with the reason. Nothing here
//! changes a chunk; `apply` carries the command out.

use super::round::{Admit, Origin, Refusal};
use super::sum::Chunk;
use super::ServerThread;
use crate::protocol::auth;
use crate::protocol::{
    DType, Header, MsgType, ProtocolError, ReadError, FLAG_ASYNC, FLAG_AVERAGE, FLAG_INIT, FLAG_NO_RESULT, FLAG_RESENT,
    FLAG_ZEROS, PUSH_OWN_FLAGS,
};
use crate::transport::ConnError;

/// Where an incoming payload goes.
#[derive(Clone, Copy)]
pub(super) struct Dest {
    pub chunk: usize,
    /// Straight into the accumulator of round parity `parity`, else into the
    /// connection's scratch buffer.
    pub direct: bool,
    pub parity: usize,
    pub len: usize,
    /// What the payload is, if not a contribution to the chunk's round.
    pub kind: PayloadKind,
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum PayloadKind {
    Push,
    /// A push of a round already complete (adopted chunks, or re-sent over
    /// a mended link): answered with its result.
    Replay,
    /// A push re-sent over a mended link, already counted: acknowledged
    /// once received, its payload dropped.
    Counted,
    /// A restored result (`MsgType::Restore`).
    Restore,
    /// Dropped, unanswered: a restored result of a tensor released here
    /// since, or a push re-sent on a mended link its result went out on.
    Discard,
    /// A push of a chunk given up here (moved to a server that joined):
    /// dropped and acknowledged; the worker re-sends it to the new server.
    Moved,
    /// The owner's result of a round we relayed, into the result buffer.
    Upstream,
}

/// What a frame's header asks for, once checked.
pub(super) enum Command {
    /// A frame to receive whole: the handshake, an optimizer config, a
    /// replica's state, a stall notice from an owner.
    Whole,
    /// Another server thread (its slot) replicates its chunks here.
    ServerHello(u32),
    /// The worker (or relay) of this rank.
    DataHello(u32),
    /// A frame for a chunk given up here (`drop_moved`).
    Moved,
    /// A push or a replay by value, or a restored result, into `Dest`.
    Receive(Dest),
    /// A push (or a replay) by reference: the data is in the host's shared
    /// segment at `at`.
    PushRef { chunk: usize, at: *const u8, kind: PayloadKind },
    /// Our replica acknowledged a round.
    ReplicaAck,
    /// The owner received a push of ours: nothing to do (no credit here).
    Nothing,
}

fn invalid(why: String) -> ConnError {
    ConnError::Invalid(why)
}

impl ServerThread {
    /// Check a frame's header and say what to do with it.
    pub(super) fn parse(&self, t: usize, hdr: &Header) -> Result<Command, ConnError> {
        let conn = self.conns.get(&t).ok_or("internal: no connection")?;
        if !conn.auth.is_done() {
            if !matches!(hdr.msg_type, MsgType::AuthHello | MsgType::AuthProof) {
                return Err(super::conns::auth_failed(auth::AuthError::Failed(
                    "a frame before the authentication handshake",
                )));
            }
            return Ok(Command::Whole);
        }
        if hdr.namespace != self.cfg.namespace {
            return Err(ProtocolError::WrongNamespace { got: hdr.namespace }.into());
        }
        if conn.server.is_some() {
            return self.parse_from_server(t, hdr);
        }
        match hdr.msg_type {
            MsgType::ServerHello => {
                if hdr.payload_len != 0 || conn.rank.is_some() {
                    return Err("a ServerHello with a payload, or after DataHello".into());
                }
                Ok(Command::ServerHello(hdr.key))
            }
            MsgType::DataHello => {
                let r = hdr.key;
                if hdr.payload_len != 0 {
                    return Err(format!("DataHello with a {}-byte payload", hdr.payload_len).into());
                }
                if conn.rank.is_some() {
                    return Err("second DataHello on one connection".into());
                }
                // Ranks after the workers' are other racks' relays (`HostLayout::relay_id`).
                if r >= self.cfg.num_workers + self.cfg.relays {
                    return Err(invalid(format!(
                        "worker rank {r} out of range (job has {} workers)",
                        self.cfg.num_workers
                    )));
                }
                // A mended link replaces the old connection, which may not
                // have seen its end yet (`apply`).
                if self.worker_conn[r as usize].is_some() && hdr.flags & FLAG_RESENT == 0 {
                    return Err(invalid(format!("worker rank {r} is already connected")));
                }
                Ok(Command::DataHello(r))
            }
            MsgType::Push | MsgType::PushRef | MsgType::Restore if self.moved_away.contains(&(hdr.key, hdr.chunk)) => {
                conn.rank.ok_or("a data frame before DataHello")?;
                Ok(Command::Moved)
            }
            MsgType::Push => self.parse_push(t, hdr),
            MsgType::Restore => {
                let gone = self.freed_set.contains(&hdr.key) && !self.index.contains_key(&(hdr.key, hdr.chunk));
                let (chunk, kind) = match gone {
                    true => (0, PayloadKind::Discard),
                    false => (self.check_restore(t, hdr)?, PayloadKind::Restore),
                };
                let (parity, len) = ((hdr.round & 1) as usize, hdr.payload_len as usize);
                Ok(Command::Receive(Dest { chunk, direct: false, parity, len, kind }))
            }
            MsgType::PushRef => self.parse_push_ref(t, hdr),
            MsgType::OptConfig => {
                conn.rank.ok_or("OptConfig before DataHello")?;
                match self.keys_here.get(&hdr.key).map(|k| k.0) {
                    // Every chunk of it here moved away: the worker sends the
                    // config to the new servers too.
                    None if self.moved_away.iter().any(|&(k, _)| k == hdr.key) => return Ok(Command::Moved),
                    None => {
                        return Err(invalid(format!("OptConfig for key {} which has no chunk on this thread", hdr.key)))
                    }
                    Some(DType::F32) => {}
                    Some(d) => {
                        return Err(invalid(format!(
                            "a server-side optimizer needs float32 tensors, key {} is {}",
                            hdr.key,
                            d.name()
                        )))
                    }
                }
                check_opt_config(hdr)?;
                Ok(Command::Whole)
            }
            other => Err(format!("unexpected {other:?} frame on a data connection").into()),
        }
    }

    /// A push by value: where its payload goes.
    fn parse_push(&self, t: usize, hdr: &Header) -> Result<Command, ConnError> {
        let (idx, rank, kind) = self.check_push(t, hdr)?;
        let ch = &self.chunks[idx];
        let zeros = hdr.flags & FLAG_ZEROS != 0;
        if zeros && hdr.flags & FLAG_INIT != 0 {
            return Err(invalid(format!(
                "tensor '{}' chunk {}: a push of zeros cannot carry initial parameters",
                self.name(hdr.key),
                hdr.chunk
            )));
        }
        let want = if zeros { 0 } else { ch.bytes() };
        if hdr.payload_len as usize != want {
            return Err(invalid(format!(
                "tensor '{}' chunk {}: payload of {} bytes, expected {want}",
                self.name(hdr.key),
                hdr.chunk,
                hdr.payload_len
            )));
        }
        // Init rounds keep only one push (rank 0's), so nothing goes
        // straight in; nor into an adopted chunk, which a restored
        // result may complete at any time; in rank order, only the first
        // pusher's (the others' wait for their turn).
        let init = hdr.flags & FLAG_INIT != 0;
        let direct = ch.round.untouched()
            && ch.dtype == DType::F32
            && !ch.direct_in_progress
            && !init
            && !zeros
            && ch.deltas.is_none()
            && hdr.flags & FLAG_ASYNC == 0
            && ch.round.origin() == Origin::Installed
            && kind == PayloadKind::Push
            && ch.order.direct_for(rank);
        let parity = (hdr.round & 1) as usize;
        Ok(Command::Receive(Dest { chunk: idx, direct, parity, len: want, kind }))
    }

    /// A push by reference: its data in the host's shared segment.
    fn parse_push_ref(&self, t: usize, hdr: &Header) -> Result<Command, ConnError> {
        let (idx, rank, kind) = self.check_push(t, hdr)?;
        if hdr.payload_len != 0 {
            return Err(format!("PushRef with a {}-byte payload", hdr.payload_len).into());
        }
        if hdr.flags & FLAG_ZEROS != 0 {
            return Err("PushRef flagged as zeros (only a Push may be)".into());
        }
        let local = self.cfg.local.get(rank as usize).copied().unwrap_or(false);
        let Some(st) = self.shm.get(&hdr.key).filter(|_| local) else {
            return Err(invalid(format!(
                "worker {rank} pushed tensor '{}' by reference, but does not share memory with this server",
                self.name(hdr.key)
            )));
        };
        let (ptr, len) = st.wire(hdr.chunk as usize, hdr.round);
        let ch = &self.chunks[idx];
        if len != ch.bytes() || !(ptr as usize).is_multiple_of(ch.dtype.size()) {
            return Err(format!("internal: shared chunk of {len} bytes at {ptr:?} for {} elements", ch.elems).into());
        }
        // The owner's chunk of this round in the segment, which it leaves
        // alone until our result comes back.
        Ok(Command::PushRef { chunk: idx, at: ptr.cast_const(), kind })
    }

    /// A frame from another server thread: on a link of ours, the replica's
    /// acks or the owner's results; on one it opened, what it replicates here.
    fn parse_from_server(&self, t: usize, hdr: &Header) -> Result<Command, ConnError> {
        let conn = self.conns.get(&t).ok_or("internal: no connection")?;
        let ours = conn.server.is_some_and(|s| self.links.get(&s) == Some(&t));
        let up = conn.server.filter(|s| self.uplinks.get(s) == Some(&t));
        match hdr.msg_type {
            MsgType::Received if ours && hdr.payload_len == 0 => Ok(Command::ReplicaAck),
            MsgType::Received if up.is_some() && hdr.payload_len == 0 => Ok(Command::Nothing),
            MsgType::Result if up.is_some() => {
                let idx = self.index.get(&(hdr.key, hdr.chunk)).copied();
                let ch = idx
                    .map(|i| &self.chunks[i])
                    .filter(|c| c.round.upstream() == up && c.round.phase() == super::round::Phase::Forwarded);
                let Some(ch) = ch.filter(|c| c.round.number() == hdr.round && c.dtype == hdr.dtype) else {
                    return Err(invalid(format!(
                        "a result for key {} chunk {} round {} that this thread did not push there",
                        hdr.key, hdr.chunk, hdr.round
                    )));
                };
                let want = ch.bytes();
                if hdr.payload_len as usize != want {
                    return Err(format!("a result of {} bytes, expected {want}", hdr.payload_len).into());
                }
                let (chunk, parity) = (idx.unwrap_or(0), (hdr.round & 1) as usize);
                Ok(Command::Receive(Dest { chunk, direct: false, parity, len: want, kind: PayloadKind::Upstream }))
            }
            // The owner waits for other racks: it says so in its own log.
            MsgType::Stall if up.is_some() => Ok(Command::Whole),
            MsgType::OptConfig | MsgType::Replicate | MsgType::Snapshot if !ours && up.is_none() => {
                if hdr.msg_type == MsgType::OptConfig {
                    check_opt_config(hdr)?;
                }
                Ok(Command::Whole)
            }
            // Its last words as it closes (the job ended or failed): it says why itself.
            MsgType::Error => Err(ConnError::Read(ReadError::Closed)),
            other => Err(format!("unexpected {other:?} frame from another server thread").into()),
        }
    }

    /// Checks common to both kinds of push; returns the chunk's index, the
    /// pusher, and whether it is a contribution or a replay (adopted chunks).
    fn check_push(&self, t: usize, hdr: &Header) -> Result<(usize, u32, PayloadKind), ConnError> {
        let (idx, rank) = self.chunk_of(t, hdr)?;
        let ch = &self.chunks[idx];
        if hdr.flags & FLAG_ASYNC != 0 || ch.deltas.is_some() {
            if hdr.flags & FLAG_NO_RESULT != 0 {
                // An asynchronous push is answered with the parameters it changed.
                return Err(invalid(format!(
                    "tensor '{}' chunk {}: an asynchronous push cannot decline its answer",
                    self.name(hdr.key),
                    hdr.chunk
                )));
            }
            return Ok((idx, rank, self.check_async_push(idx, rank, hdr)?));
        }
        let name = self.name(hdr.key);
        // A replay is checked by the round alone (an adopted chunk's round
        // already complete here); everything else must fit the round.
        let admit = match hdr.flags & FLAG_RESENT {
            0 => ch.round.admit(rank, hdr.round),
            _ => ch.round.admit_again(rank, hdr.round),
        };
        match admit {
            // Re-sent on a mended link that its result went out on already
            // (the round completed after the link was made again): the
            // result answers it, and the worker expects nothing more.
            Ok(Admit::Replay)
                if hdr.flags & FLAG_RESENT != 0 && self.conns.get(&t).is_some_and(|c| c.answered(idx, hdr.round)) =>
            {
                return Ok((idx, rank, PayloadKind::Discard))
            }
            Ok(Admit::Replay) => return Ok((idx, rank, PayloadKind::Replay)),
            Ok(Admit::Counted) => return Ok((idx, rank, PayloadKind::Counted)),
            _ => {}
        }
        if hdr.dtype != ch.dtype {
            return Err(invalid(format!(
                "tensor '{name}' chunk {}: dtype {} but it was declared {}",
                hdr.chunk,
                hdr.dtype.name(),
                ch.dtype.name()
            )));
        }
        if let Err(why) = admit {
            return Err(self.refused(hdr, rank, why));
        }
        if let Some(why) = self.never_completes(ch) {
            return Err(invalid(why));
        }
        // (Zeros or data is each pusher's own business.)
        if !ch.round.untouched() && hdr.flags & !PUSH_OWN_FLAGS != ch.round.flags {
            return Err(invalid(format!(
                "tensor '{name}': workers disagree on the round's flags (average/init) in round {}",
                hdr.round
            )));
        }
        if hdr.flags & FLAG_INIT != 0 && ch.dtype != DType::F32 {
            return Err(invalid(format!("tensor '{name}': parameter initialization needs float32")));
        }
        if hdr.flags & FLAG_AVERAGE != 0 && ch.dtype.is_integer() {
            return Err(invalid(format!(
                "tensor '{name}': {} is summed exactly; workers average integers themselves",
                ch.dtype.name()
            )));
        }
        // A relay has no optimizer state: the owner applies the optimizer.
        if hdr.flags & FLAG_INIT == 0
            && ch.opt.is_none()
            && ch.round.upstream().is_none()
            && self.opt_cfg.contains_key(&ch.key)
        {
            return Err(invalid(self.no_parameters(ch)));
        }
        Ok((idx, rank, PayloadKind::Push))
    }

    /// A push admitted at its header, its payload now arrived in scratch:
    /// admitted again, since a restored result may have completed its
    /// round meanwhile (an adopted chunk, `Round::restore`), which makes it
    /// a replay of that round, not a push to the next one.
    pub(super) fn on_arrival(&self, t: usize, hdr: &Header, idx: usize) -> Result<PayloadKind, ConnError> {
        let conn = self.conns.get(&t).ok_or("internal: no connection")?;
        let rank = conn.rank.ok_or("internal: no rank")?;
        match self.chunks[idx].round.admit(rank, hdr.round) {
            Ok(Admit::Push) => Ok(PayloadKind::Push),
            // (As at the header: a result sent on this link answers it.)
            Ok(Admit::Replay) if hdr.flags & FLAG_RESENT != 0 && conn.answered(idx, hdr.round) => {
                Ok(PayloadKind::Discard)
            }
            Ok(Admit::Replay) => Ok(PayloadKind::Replay),
            Ok(Admit::Counted) => Ok(PayloadKind::Counted),
            Err(why) => Err(self.refused(hdr, rank, why)),
        }
    }

    /// Why rank's push `hdr` does not fit its chunk's round, in words.
    fn refused(&self, hdr: &Header, rank: u32, why: Refusal) -> ConnError {
        let (name, c, round) = (self.name(hdr.key), hdr.chunk, hdr.round);
        invalid(match why {
            Refusal::Retired => format!("tensor '{name}' chunk {c}: no longer summed here (the job is failing)"),
            Refusal::Round { at } => {
                format!("tensor '{name}' chunk {c}: push for round {round} but the chunk is at round {at}")
            }
            Refusal::NotAPusher => format!(
                "tensor '{name}' chunk {c}: worker {rank} pushed, but worker {} pushes it for that host",
                self.cfg.layout.owner(rank, hdr.key, hdr.chunk)
            ),
            Refusal::Twice => format!("tensor '{name}' chunk {c}: worker {rank} pushed twice in round {round}"),
        })
    }

    /// The chunk a data frame names (owned by this thread), and its sender.
    fn chunk_of(&self, t: usize, hdr: &Header) -> Result<(usize, u32), ConnError> {
        let conn = self.conns.get(&t).ok_or("internal: no connection")?;
        let rank = conn.rank.ok_or("Push before DataHello")?;
        let &idx = self.index.get(&(hdr.key, hdr.chunk)).ok_or_else(|| {
            format!("key {} chunk {} is not owned by this server thread (undeclared or misrouted)", hdr.key, hdr.chunk)
        })?;
        Ok((idx, rank))
    }

    /// Checks on a restored result; returns the chunk's index.
    fn check_restore(&self, t: usize, hdr: &Header) -> Result<usize, ConnError> {
        let (idx, rank) = self.chunk_of(t, hdr)?;
        let ch = &self.chunks[idx];
        let name = self.name(hdr.key);
        let want = ch.bytes();
        let known = ch.round.phase() != super::round::Phase::Unknown;
        if ch.round.origin() != Origin::Adopted {
            return Err(ConnError::Invalid(format!(
                "tensor '{name}' chunk {}: a restored result for a chunk this server did not take over",
                hdr.chunk
            )));
        }
        if !ch.round.pushers.contains(&rank) || hdr.dtype != ch.dtype || hdr.payload_len as usize != want {
            return Err(ConnError::Invalid(format!(
                "tensor '{name}' chunk {}: restored result from worker {rank} of {} bytes of {}, expected \
                 {want} bytes of {} from one of workers {:?}",
                hdr.chunk,
                hdr.payload_len,
                hdr.dtype.name(),
                ch.dtype.name(),
                ch.round.pushers
            )));
        }
        if known && hdr.round > ch.round.number() {
            return Err(ConnError::Invalid(format!(
                "tensor '{name}' chunk {}: restored result of round {} but the chunk is at round {}",
                hdr.chunk,
                hdr.round,
                ch.round.number()
            )));
        }
        if self.opt_cfg.contains_key(&ch.key) {
            // New parameters cannot stand in for the optimizer state that made them.
            if ch.opt.is_none() {
                return Err(ConnError::Invalid(self.no_parameters(ch)));
            }
            if known && hdr.round == ch.round.number() {
                return Err(ConnError::Invalid(format!(
                    "tensor '{name}' chunk {}: worker {rank} restored round {} of a server-side optimizer, which \
                     its replica never had",
                    hdr.chunk, hdr.round
                )));
            }
        }
        Ok(idx)
    }

    /// Why a chunk's current round can never complete: a pusher that has
    /// not pushed it left the job. (A worker leaves with nothing in flight,
    /// so every round it took part in is complete.)
    pub(super) fn never_completes(&self, ch: &Chunk) -> Option<String> {
        let gone = ch.round.missing().find(|&p| self.left[p as usize])?;
        let then = format!("so tensor '{}' round {} can never complete", self.name(ch.key), ch.round.number());
        Some(crate::waits::left_message(&format!("worker {gone}"), &then))
    }

    /// Why a chunk of a tensor with a server-side optimizer has no state here.
    fn no_parameters(&self, ch: &Chunk) -> String {
        let why = match ch.round.origin() {
            Origin::Adopted => {
                "its server was lost and the state had no replica (failover off, no other server, or the \
                     replica was lost too)"
            }
            Origin::Installed => "no initial parameters were pushed (an init round) before the first gradient",
        };
        format!(
            "tensor '{}' chunk {}: its server-side optimizer has no parameters on server {}: {why}",
            self.name(ch.key),
            ch.chunk,
            self.cfg.server
        )
    }
}

/// An optimizer config is of one size.
fn check_opt_config(hdr: &Header) -> Result<(), ConnError> {
    match hdr.payload_len as usize == crate::protocol::optim::OPT_CONFIG_LEN {
        true => Ok(()),
        false => Err(invalid(format!("OptConfig payload of {} bytes", hdr.payload_len))),
    }
}
