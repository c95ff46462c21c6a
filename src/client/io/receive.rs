//! The receive side: what other threads wake and steer the I/O thread
//! with (`RecvSide`), and what servers send this worker, frame by frame
//! (the I/O thread's `IoCore`): results (into the caller's buffer, a kept
//! copy or the host's segment), `Received` acks (credit back), stall
//! reports and errors; completing ops.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use mio::Waker;

use super::item::{ResultDest, Route};
use super::link::LinkState;
use super::thread::IoCore;
use crate::protocol::{decode_stall, Header, MsgType, ReadError, FLAG_LEAVING, FLAG_NO_RESULT};
use crate::transport::{ConnError, Drain, Frame};

/// The receive side as the other threads see it: how to wake the I/O
/// thread, what they ask of it (stop, fail everything), the largest frame
/// it reads, and the poller a waiting caller reads with.
pub(super) struct RecvSide {
    pub(super) max_payload: u32,
    waker: Waker,
    stop: AtomicBool,
    fail_requested: Mutex<Option<String>>,
    /// Reads a connection on a waiting caller's thread, once the I/O thread
    /// runs (see `IoCore::poll_for`).
    pub(super) poller: OnceLock<crate::client::op::Poller>,
}

impl RecvSide {
    pub(super) fn new(waker: Waker, max_payload: u32) -> RecvSide {
        RecvSide {
            max_payload,
            waker,
            stop: AtomicBool::new(false),
            fail_requested: Mutex::new(None),
            poller: OnceLock::new(),
        }
    }

    pub(super) fn wake(&self) {
        let _ = self.waker.wake();
    }

    pub(super) fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        self.wake();
    }

    pub(super) fn stopped(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    /// The first failure asked for wins; the I/O thread takes it.
    pub(super) fn request_fail(&self, msg: String) {
        self.fail_requested.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(msg);
        self.wake();
    }

    pub(super) fn take_fail_request(&self) -> Option<String> {
        self.fail_requested.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

impl IoCore {
    pub(super) fn on_readable(&mut self, i: usize, drain: Drain) -> Result<(), ConnError> {
        let io = self.io.clone();
        let conn = &io.send.conns[i];
        let link = conn.link();
        loop {
            if conn.state() >= LinkState::WrittenOff {
                return Ok(()); // its server was lost; the failover closes it
            }
            // SAFETY: the destination is this chunk's range in an active op's
            // buffer, which stays alive until this thread completes the op.
            let dst = |d: ResultDest| unsafe { std::slice::from_raw_parts_mut(d.dst, d.len) };
            let frame = link.read_frame(&mut self.rx[i], io.recv.max_payload, dst, drain)?;
            if frame.is_some() && conn.doubtful.load(std::sync::atomic::Ordering::Relaxed) {
                conn.doubtful.store(false, std::sync::atomic::Ordering::Relaxed);
                // the mended link works
            }
            match frame {
                None => return Ok(()),
                Some(Frame::Header(hdr)) => self.on_header(i, hdr)?,
                Some(Frame::Payload(_, d)) => self.chunk_done(i, d.key, d.chunk, true)?,
                Some(Frame::Message(hdr, buf)) => self.on_small(i, hdr, buf)?,
            }
        }
    }

    pub(super) fn on_header(&mut self, i: usize, hdr: Header) -> Result<(), ConnError> {
        let io = &self.io;
        if hdr.namespace != io.namespace {
            return Err(ConnError::Invalid(format!(
                "frame for namespace {} (this job is {})",
                hdr.namespace, io.namespace
            )));
        }
        let stale = !self.moved_off[i].is_empty()
            && matches!(hdr.msg_type, MsgType::Result | MsgType::ResultRef | MsgType::Received)
            && self.moved_off[i].contains(&(hdr.key, hdr.chunk));
        if stale {
            // Of a chunk moved off this server (`failover::detach`): read and dropped.
            self.rx[i].receive_owned(hdr);
            return Ok(());
        }
        match hdr.msg_type {
            MsgType::Result | MsgType::ResultRef => {
                let by_ref = hdr.msg_type == MsgType::ResultRef;
                let mut guard = io.ops();
                let ops = &mut *guard;
                let a = ops
                    .active
                    .get(&hdr.key)
                    .ok_or_else(|| format!("result for key {} which has no push_pull in flight", hdr.key))?;
                let c = hdr.chunk as usize;
                if c >= a.spec.num_chunks() || a.spec.slots[c] as usize != i {
                    return Err(ConnError::Invalid(format!(
                        "result for tensor '{}' chunk {c} on the wrong connection",
                        a.spec.name
                    )));
                }
                if hdr.round != a.round || a.got[c] {
                    return Err(ConnError::Invalid(format!(
                        "unexpected result for tensor '{}' chunk {c} round {} (expected round {})",
                        a.spec.name, hdr.round, a.round
                    )));
                }
                let len = a.spec.chunk_bytes(c);
                // Only the word that the round is complete, for a push that
                // asked for no result.
                let word_only = hdr.flags & FLAG_NO_RESULT != 0;
                if word_only && (by_ref || a.wants_result(c)) {
                    return Err(ConnError::Invalid(format!(
                        "result without its bytes for tensor '{}' chunk {c}, whose result this worker asked for",
                        a.spec.name
                    )));
                }
                let sent = if by_ref || word_only { 0 } else { len };
                let route = a.route(c);
                if by_ref && !(io.send.conns[i].by_ref && route == Route::HostOwner) {
                    return Err(ConnError::Invalid(format!(
                        "result by reference for tensor '{}' chunk {c}, which this worker did not push by reference",
                        a.spec.name
                    )));
                }
                if hdr.payload_len as usize != sent || hdr.dtype != a.spec.dtype {
                    return Err(ConnError::Invalid(format!(
                        "result for tensor '{}' chunk {c}: {} bytes of {}, expected {sent} bytes of {}",
                        a.spec.name,
                        hdr.payload_len,
                        hdr.dtype.name(),
                        a.spec.dtype.name()
                    )));
                }
                let dst = match (route, &a.host, ops.kept.get_mut(&hdr.key)) {
                    (Route::HostOwner, Some(h), _) => h.shared.result(c).0,
                    (Route::Kept, _, Some(k)) => {
                        let (start, _) = a.spec.chunk_range(c);
                        k.buf[start * a.spec.dtype.size()..].as_mut_ptr()
                    }
                    (Route::Caller, _, _) => a.caller_chunk(c).0,
                    _ => {
                        return Err(ConnError::Invalid(format!(
                            "result for tensor '{}' chunk {c}, which another worker of this host pushes",
                            a.spec.name
                        )))
                    }
                };
                drop(guard);
                if by_ref || word_only {
                    // Already in the shared buffer, or not wanted.
                    return self.chunk_done(i, hdr.key, c, !word_only);
                }
                self.rx[i].receive_into(hdr, ResultDest { key: hdr.key, chunk: c, dst, len });
                Ok(())
            }
            MsgType::Received => {
                // The push is off the wire: its bytes no longer stand between
                // an urgent chunk and the server, so they leave the credit now,
                // not when the result (which waits for every worker) returns.
                if hdr.payload_len != 0 {
                    return Err(ConnError::Invalid(format!("Received frame with a {}-byte payload", hdr.payload_len)));
                }
                if !io.chunk_received(i, hdr.key, hdr.chunk) {
                    // On a mended link, a late ack of a push re-sent (the
                    // server answers none after the result, but a stale
                    // one only returns credit already returned): ignored.
                    if io.send.conns[i].send().mends > 0 {
                        log::debug!(target: &format!("worker {}", io.rank), "{}: a late Received for key {} chunk {} round {}", io.send.conns[i].desc(), hdr.key, hdr.chunk, hdr.round);
                        return io.pump(i);
                    }
                    return Err(ConnError::Invalid(format!(
                        "Received for key {} chunk {}, which is not in flight here",
                        hdr.key, hdr.chunk
                    )));
                }
                io.pump(i)
            }
            MsgType::Stall | MsgType::Error => {
                self.rx[i].receive_owned(hdr);
                Ok(())
            }
            other => Err(ConnError::Invalid(format!("unexpected {other:?} frame from the server"))),
        }
    }

    pub(super) fn on_small(&mut self, i: usize, hdr: Header, buf: Vec<u8>) -> Result<(), ConnError> {
        if matches!(hdr.msg_type, MsgType::Result | MsgType::ResultRef | MsgType::Received) {
            return Ok(()); // stale: see `on_header`
        }
        if hdr.msg_type == MsgType::Error {
            let msg = format!("server reported an error: {}", String::from_utf8_lossy(&buf));
            if hdr.flags & FLAG_LEAVING != 0 && self.io.failover.on {
                // The server leaves (written off, the job failed, its
                // scheduler lost): what next is the scheduler's word (a
                // failover, or the failure); till then, a link that broke.
                log::warn!(target: &format!("worker {}", self.io.rank), "{}: {msg}", self.io.send.conns[i].desc());
                return Err(ConnError::Read(ReadError::Closed));
            }
            // The server refused this worker (e.g. a round that can never
            // complete): the scheduler may not know, so tell it.
            let io = &self.io;
            self.owner.fail_job(format!("worker {}: {}: {msg}", io.rank, io.send.conns[i].desc()));
            return Err(ConnError::Invalid(msg));
        }
        let s = decode_stall(&buf).map_err(|e| format!("bad stall report: {e}"))?;
        let io = &self.io;
        if let Some(a) = io.ops().active.get(&hdr.key) {
            let msg = format!(
                "server {} thread {} ({}) reports tensor '{}' round {} has waited {:.1}s for worker rank(s) {:?}",
                s.server,
                s.thread,
                io.send.conns[i].desc(),
                a.spec.name,
                hdr.round,
                s.waited_ms as f64 / 1000.0,
                s.missing
            );
            a.op.set_stall(msg);
        }
        Ok(())
    }

    /// Chunk `chunk`'s result is in (`landed`: its bytes; else only the
    /// word that its round completed, for a push that wanted no result).
    pub(super) fn chunk_done(&mut self, i: usize, key: u32, chunk: usize, landed: bool) -> Result<(), ConnError> {
        let io = &self.io;
        // Before the op can complete: its caller may queue the chunk's next
        // round at once, which must not find this one still counted.
        let stamp = io.chunk_returned(i, key, chunk as u32);
        // Stamps exist only while a timeline is recorded: no lock otherwise.
        if let Some((s, trace)) = stamp.and_then(|s| Some((s, io.trace.current()?))) {
            let name = io.ops().active.get(&key).map(|a| a.spec.name.clone()).unwrap_or_default();
            trace.chunk(&crate::timeline::ChunkStages {
                tensor: &name,
                chunk: chunk as u32,
                round: s.round,
                bytes: s.len,
                server: io.send.conns[i].server,
                queued: s.queued,
                sent: s.sent,
                received: s.received,
                result: Instant::now(),
            });
        }
        self.land(key, chunk, landed);
        // Outstanding room came back: keep the connection busy.
        self.io.pump(i)
    }

    /// Chunk `chunk`'s result is whole where its route put it: bring it to
    /// the caller's buffer (`Route`), and complete the op with its last chunk.
    /// Not `landed` (no result wanted): the caller's bytes stay as pushed.
    pub(super) fn land(&mut self, key: u32, chunk: usize, landed: bool) {
        let io = self.io.clone();
        let done = {
            let mut guard = io.ops();
            let ops = &mut *guard;
            let Some(a) = ops.active.get_mut(&key) else { return };
            let (dst, len) = a.caller_chunk(chunk);
            match (a.route(chunk), &a.host, ops.kept.get_mut(&key)) {
                _ if !landed => {}
                (Route::Caller, ..) => {}
                (Route::Kept, _, Some(k)) => {
                    // The whole result is in: now it may replace this worker's push.
                    let (start, _) = a.spec.chunk_range(chunk);
                    let at = start * a.spec.dtype.size();
                    // SAFETY: the chunk's range in the caller's buffer of an active op.
                    unsafe { std::ptr::copy_nonoverlapping(k.buf[at..at + len].as_ptr(), dst, len) };
                    k.round[chunk] = a.round;
                }
                (Route::HostOwner, Some(hr), _) => {
                    // In the shared buffer: take a copy, let the others take theirs.
                    let (src, _) = hr.shared.result(chunk);
                    // SAFETY: both ranges are this chunk's; the op is active and
                    // only this thread completes it.
                    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
                    hr.shared.publish(chunk, a.round);
                    if let Some(h) = &io.host.stage {
                        self.bells |= ((1u64 << h.workers.len()) - 1) & !(1 << h.local);
                    }
                }
                (Route::HostPeer, Some(hr), _) => {
                    // Published by the worker of this host that pushed it.
                    let (src, _) = hr.shared.result(chunk);
                    // SAFETY: as above.
                    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
                }
                (route, ..) => {
                    // Not reachable: a route is fixed with what it needs.
                    log::error!(target: &format!("worker {}", io.rank), "chunk {chunk} of key {key}: no place for its {route:?} result");
                }
            }
            a.got[chunk] = true;
            a.remaining -= 1;
            let finished = if a.remaining == 0 { ops.active.remove(&key) } else { None };
            if let Some(a) = &finished {
                ops.rounds.insert(key, a.round.wrapping_add(1));
            }
            finished
        };
        if let Some(a) = done {
            if a.host.as_ref().is_some_and(|h| h.stall.reported()) {
                log::info!(target: &format!("worker {}", io.rank), "stall resolved: tensor '{}' round {} complete", a.spec.name, a.round);
            }
            self.owner.finish_op(&a.op, None);
        }
    }
}
