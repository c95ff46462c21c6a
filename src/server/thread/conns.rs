//! A thread's connections: accepting them, the links it opens to other
//! server threads, reading frames (handing headers to `validate`/`apply`
//! and complete payloads to `apply`), and closing them: with the reason, and
//! after the handshake timeout for a peer that never authenticates or says
//! who it is, or that stops in the middle of a frame.

use std::collections::{BinaryHeap, VecDeque};
use std::time::{Duration, Instant};

use super::flush::{Carry, TxItem};
use super::validate::{Dest, PayloadKind};
use super::LinkTo;
use super::{ConnResult, ServerThread};
use crate::protocol::auth;
use crate::protocol::{encode_frame, Header, MsgType};
use crate::transport::{bytes_mut, AcceptFailure, ConnError, Connection, Drain, Frame, FrameReader, FrameWriter};
use mio::Token;

pub(super) struct Conn {
    pub link: Connection,
    /// The authentication handshake (`protocol::auth`): nothing else is
    /// accepted before it is done.
    pub auth: auth::Listener,
    pub rank: Option<u32>,
    /// The slot of the server thread at the other end: one replicating
    /// its chunks here (it said ServerHello), or our link to a replica.
    pub server: Option<u32>,
    pub rx: FrameReader<Dest>,
    pub tx: FrameWriter<Carry>,
    pub scratch: Vec<u32>,
    pub results: BinaryHeap<TxItem>,
    /// Advisory frames (stall notices), sent between results.
    pub notices: VecDeque<Vec<u8>>,
    /// When the connection was accepted, and when its last frame (or frame
    /// part) arrived whole: see `ThreadConfig::peer_timeout`.
    pub accepted: Instant,
    pub last_frame: Instant,
    /// Received frames (headers) not yet written: sent before anything else,
    /// batched into one write per readable event. Bounded by the pushes a
    /// worker may have unacknowledged (its credit plus preempting chunks).
    pub acks: Vec<u8>,
    /// On a mended link (a resent DataHello): per chunk index, 1 + the
    /// round whose result was last queued here (0: none). A push re-sent
    /// for a round answered here already is not answered again.
    pub answered: Option<Vec<u32>>,
}

impl Conn {
    /// The result of `round` of chunk `idx` was queued on this connection.
    pub fn note_answer(&mut self, idx: usize, round: u32) {
        if let Some(a) = &mut self.answered {
            if a.len() <= idx {
                a.resize(idx + 1, 0);
            }
            a[idx] = round.wrapping_add(1);
        }
    }

    /// Whether the result of `round` of chunk `idx` was queued here.
    pub fn answered(&self, idx: usize, round: u32) -> bool {
        self.answered.as_ref().is_some_and(|a| a.get(idx) == Some(&round.wrapping_add(1)))
    }

    /// Room for a `want`-byte payload in the scratch buffer (at least a
    /// whole chunk's, so it is sized once), from the pool if it has none.
    pub fn scratch_for(&mut self, want: usize, chunk: usize, pool: &mut Vec<Vec<u32>>) {
        if self.scratch.len() * 4 < want {
            if self.scratch.is_empty() {
                self.scratch = pool.pop().unwrap_or_default();
            }
            self.scratch.resize(chunk.div_ceil(4).max(want.div_ceil(4)), 0);
        }
    }
    /// Who is at the other end, for messages.
    pub fn describe(&self) -> String {
        match self.rank {
            Some(r) => format!("worker {r} ({})", self.link.peer),
            None => self.link.peer.clone(),
        }
    }
}

/// A failed handshake closes the connection; the peer is told only that
/// authentication failed (`close` adds nothing about the job), the log says why.
pub(super) fn auth_failed(e: auth::AuthError) -> ConnError {
    ConnError::Invalid(match e {
        auth::AuthError::Failed(why) => format!("authentication failed: {why}"),
        other => format!("authentication failed: {other}"),
    })
}

/// Unsent bytes the kernel may hold per data connection before the socket
/// stops being writable (TCP_NOTSENT_LOWAT): results queue in our priority
/// heap instead, so an urgent result never waits behind a deep socket
/// buffer. 256 KiB keeps a 25 Gbit/s link busy for ~80 µs between wake-ups.
const NOTSENT_LOWAT: u32 = 256 << 10;

/// The pause before accepting again after running out of descriptors.
const ACCEPT_RETRY: Duration = Duration::from_millis(50);

impl ServerThread {
    pub(super) fn accept(&mut self) {
        self.accept_retry = None;
        loop {
            match self.listener.accept() {
                Ok((stream, peer)) => {
                    crate::transport::tune_data_socket(&stream);
                    // Best effort: without it results are still ordered, only less strictly.
                    let _ = socket2::SockRef::from(&stream).set_tcp_notsent_lowat(NOTSENT_LOWAT);
                    if let Err(e) = self.add_conn(stream, peer.to_string(), auth::Listener::default()) {
                        log::warn!(target: &self.who(), "cannot register connection from {peer}: {e}");
                    }
                }
                Err(e) => match self.accept_errors.on_error(&self.who(), &e) {
                    AcceptFailure::Skip => {}
                    AcceptFailure::Drained => return,
                    AcceptFailure::Later => {
                        self.accept_retry = Some(Instant::now() + ACCEPT_RETRY);
                        return;
                    }
                },
            }
        }
    }

    fn add_conn(&mut self, stream: mio::net::TcpStream, peer: String, auth: auth::Listener) -> std::io::Result<usize> {
        let t = self.next_token;
        self.next_token += 1;
        let link = Connection::new(self.poll.registry(), stream, Token(t), peer)?;
        let now = Instant::now();
        let conn = Conn {
            link,
            auth,
            rank: None,
            server: None,
            rx: FrameReader::default(),
            tx: FrameWriter::default(),
            scratch: Vec::new(),
            results: BinaryHeap::new(),
            notices: VecDeque::new(),
            acks: Vec::new(),
            answered: None,
            accepted: now,
            last_frame: now,
        };
        self.conns.insert(t, conn);
        Ok(t)
    }

    /// Our link to the thread at `slot`, which replicates chunks of ours
    /// or owns chunks we relay (authenticated and introduced by the control
    /// loop).
    pub(super) fn add_link(&mut self, slot: u32, authed: crate::transport::Authed, to: LinkTo, name: &str) {
        let (stream, seal, open) = authed.into_parts();
        let peer = stream.peer_addr().map(|a| a.to_string()).unwrap_or_default();
        let what = match to {
            LinkTo::Replica => "replica",
            LinkTo::Owner => "owner",
        };
        let registered = stream.set_nonblocking(true).and_then(|()| {
            crate::transport::tune_data_socket(&stream);
            // As on accepted sockets: the relay's pushes queue in priority order here.
            let _ = socket2::SockRef::from(&stream).set_tcp_notsent_lowat(NOTSENT_LOWAT);
            self.add_conn(
                mio::net::TcpStream::from_std(stream),
                format!("{what} {name} ({peer})"),
                auth::Listener::Done { job: String::new(), keys: None },
            )
        });
        let registered = registered.and_then(|t| match self.conns.get(&t) {
            Some(c) => c.link.seal_with_parts(seal, open).map(|()| t).map_err(std::io::Error::other),
            None => Ok(t),
        });
        match registered {
            Ok(t) => {
                if let Some(c) = self.conns.get_mut(&t) {
                    c.server = Some(slot);
                }
                let links = match to {
                    LinkTo::Replica => &mut self.links,
                    LinkTo::Owner => &mut self.uplinks,
                };
                if let Some(old) = links.insert(slot, t) {
                    self.close(old, "replaced by a new link");
                }
            }
            Err(e) => log::warn!(target: &self.who(), "cannot register the link to {what} {name}: {e}"),
        }
    }

    /// Close connection `t`, telling the peer `why` (nothing: a clean close).
    pub(super) fn close(&mut self, t: usize, why: &str) {
        self.close_as(t, why, !why.is_empty());
    }

    /// Close connection `t`, which broke (`why`: a frame changed on the
    /// way), without last words: a link of ours is mended as broken.
    pub(super) fn close_broken(&mut self, t: usize, why: &str) {
        self.close_as(t, why, false);
    }

    /// Close connection `t`: the peer is told `why` if `tell`; a link of
    /// ours that closed for a reason (`why` not empty) is dialled again.
    fn close_as(&mut self, t: usize, why: &str, tell: bool) {
        let who = self.who();
        let Some(mut c) = self.conns.remove(&t) else { return };
        c.auth.hung_up();
        if let Some(Dest { chunk, direct: true, parity, .. }) = c.rx.reset() {
            // The accumulator holds a partial push.
            self.chunks[chunk].abort_direct(parity, &mut self.pool);
        }
        let peer = c.describe();
        if tell {
            log::warn!(target: &who, "closing connection from {peer}: {why}");
            // Best effort: tell the peer why, unless a frame is half-written.
            if c.tx.idle() {
                // A peer that has not authenticated learns nothing of the job.
                let authed = c.auth.is_done();
                let msg = match authed {
                    true => format!("server {} thread {}: {why}", self.cfg.server, self.cfg.thread),
                    false => why.to_string(),
                };
                let mut h = Header::new(MsgType::Error);
                h.namespace = if authed { self.cfg.namespace } else { 0 };
                h.flags = self.farewell;
                h.payload_len = msg.len() as u32;
                c.link.write_last_words(&encode_frame(&h, msg.as_bytes()));
            }
        }
        c.tx.clear();
        c.link.deregister(self.poll.registry());
        if let Some(slot) = c.server {
            if self.links.get(&slot) == Some(&t) {
                self.links.remove(&slot);
                // Broken, not closed by the replica at the job's end.
                if !why.is_empty() {
                    self.relink(slot, why);
                }
            }
            if self.uplinks.get(&slot) == Some(&t) {
                self.uplinks.remove(&slot);
                self.uplink_broke(slot, &c.link.peer, why);
            }
        }
        if let Some(r) = c.rank {
            if self.worker_conn[r as usize] == Some(t) {
                self.worker_conn[r as usize] = None;
                self.async_pusher_left(r);
            }
        }
    }

    pub(super) fn on_readable(&mut self, t: usize, drain: Drain) -> ConnResult {
        loop {
            let Some(conn) = self.conns.get_mut(&t) else { return Ok(()) };
            let chunks = &mut self.chunks;
            let scratch = &mut conn.scratch;
            let data = crate::protocol::data_payload_limit(self.cfg.partition_bytes);
            let limit = match (conn.auth.is_done(), conn.server) {
                // A snapshot: parameters and up to two moments.
                (true, Some(_)) => data.saturating_mul(3).saturating_add(8),
                (true, None) => data,
                (false, _) => auth::MAX_AUTH_PAYLOAD,
            };
            let frame = conn.link.read_frame(
                &mut conn.rx,
                limit,
                |d| {
                    if d.kind == PayloadKind::Upstream {
                        chunks[d.chunk].result_mut(d.parity, d.len)
                    } else if d.direct {
                        chunks[d.chunk].direct_mut(d.parity, d.len)
                    } else {
                        &mut bytes_mut(scratch)[..d.len]
                    }
                },
                drain,
            )?;
            if frame.is_some() {
                conn.last_frame = Instant::now();
            }
            match frame {
                None => return Ok(()),
                Some(Frame::Header(hdr)) => {
                    let cmd = self.parse(t, &hdr)?;
                    self.apply(t, hdr, cmd)?
                }
                Some(Frame::Payload(hdr, d)) => self.on_payload(t, hdr, d)?,
                Some(Frame::Message(hdr, buf)) if !conn.auth.is_done() => {
                    let reply = conn.auth.on_frame(&self.cfg.secret.keys(), &hdr, &buf).map_err(auth_failed)?;
                    if let Some(r) = reply {
                        conn.acks.extend_from_slice(&r); // written by the flush after this read
                    }
                    if let auth::Listener::Done { keys: keys @ Some(_), .. } = &mut conn.auth {
                        // The next frame is the first sealed one (the
                        // challenge went before the connector could prove).
                        conn.link.seal_with(keys.take().expect("matched Some"))?;
                    }
                }
                Some(Frame::Message(hdr, buf)) => self.on_message(t, hdr, &buf)?,
            }
        }
    }

    /// Close connections that never authenticated or said who they are, or
    /// stopped in the middle of a frame, for longer than the peer timeout
    /// (the scheduler's handshake timeout too: one setting, from Welcome).
    pub(super) fn close_idle(&mut self) {
        let limit = self.cfg.peer_timeout;
        let late: Vec<(usize, String)> = self
            .conns
            .iter()
            .filter_map(|(&t, c)| {
                let secs = limit.as_secs_f64();
                if !c.auth.is_done() && c.accepted.elapsed() > limit {
                    Some((t, format!("no authentication handshake within {secs:.1}s")))
                } else if c.rank.is_none() && c.server.is_none() && c.accepted.elapsed() > limit {
                    Some((t, format!("no DataHello within {secs:.1}s")))
                } else if c.rx.in_frame() && c.last_frame.elapsed() > limit {
                    Some((t, format!("a frame stalled half-received for over {secs:.1}s")))
                } else {
                    None
                }
            })
            .collect();
        for (t, why) in late {
            self.close(t, &why);
        }
    }
}
