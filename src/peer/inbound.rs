//! One connected peer's side of the links: the handshake and hello of a
//! connection from it, then its messages, read as they come. A message for
//! which a receive is posted when it begins lands in that receive's buffer
//! frame by frame (no copy); one nobody asked for yet goes to the inbox,
//! and the reader pauses while too much from this peer waits there.

use std::io::Write;
use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::protocol::seal::Opener;
use crate::protocol::{read_message, Frame, FrameReader, ReadError};
use crate::transport::{tune_data_socket, DeadlineReader, SealedReader, SealedWriter};

use super::matching::Message;
use super::message::{Sequence, FRAME_BYTES};
use super::{auth, lock, wrong_size, Links, Receive, HELLO_WITHIN, MAX_HELLO};

/// The most an inbox message reserves before its bytes arrive.
const RESERVE: usize = 64 << 20;

/// Where the message being read goes.
enum Landing {
    /// A posted receive's buffer: bytes landed so far; whether the message
    /// outgrew it (its bytes then go nowhere, and the receive fails).
    Posted { recv: Receive, at: usize, over: bool },
    /// The inbox, once whole.
    Inbox(Vec<u8>),
}

impl Links {
    /// A connection from a peer: its handshake and hello, then its messages
    /// until it ends.
    pub(super) fn serve(self: Arc<Self>, stream: TcpStream) {
        let greeted = self.greet(&stream);
        self.greeting.fetch_sub(1, Ordering::SeqCst);
        let Some((src, open, peer)) = greeted else { return };
        let mut landing = None;
        let why = self.read_messages(&stream, open, src, &peer, &mut landing);
        lock(&self.inbound).remove(&src);
        if let Some(Landing::Posted { recv, .. }) = landing {
            recv.fail(why.clone());
        }
        if self.closing.load(Ordering::SeqCst) {
            return;
        }
        log::info!(target: "p2p", "{why}");
        let failed = lock(&self.matcher).lose(src, why);
        for (_, r, why) in failed {
            r.fail(why);
        }
    }

    /// A new connection's handshake and hello, each way: the member it is
    /// from, the key that opens its frames, and its address; None (logged)
    /// if refused.
    fn greet(&self, stream: &TcpStream) -> Option<(u32, Option<Opener>, String)> {
        let peer = stream.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into());
        let within = self.cfg.timeout.min(HELLO_WITHIN);
        let _ = stream.set_write_timeout(Some(within));
        let mut r = DeadlineReader::new(stream, within);
        let keys = match auth::listen_blocking(&mut r, &mut &*stream, &self.cfg.secret.keys()) {
            Ok((_, keys)) => keys,
            Err(e) => {
                if !self.closing.load(Ordering::SeqCst) {
                    log::warn!(target: "p2p", "refusing a connection from {peer}: {e}");
                }
                return None;
            }
        };
        let (seal, open) = keys.map(|k| (k.seal, k.open)).unzip();
        let mut r = SealedReader::new(r, open).limit(MAX_HELLO);
        let greeted = read_message(&mut r, Some(self.cfg.namespace), MAX_HELLO)
            .map_err(|e| e.to_string())
            .and_then(|(h, p)| self.check_hello(&h, &p, None));
        let open = r.into_parts().1;
        let mut w = SealedWriter::new(stream, seal);
        let src = match greeted.and_then(|src| self.register(src, stream).map(|()| src)) {
            Ok(src) => src,
            Err(why) => {
                log::warn!(target: "p2p", "refusing a connection from {peer}: {why}");
                let _ = w.write_all(&self.refusal(&why));
                return None;
            }
        };
        if let Err(e) = w.write_all(&self.hello()) {
            lock(&self.inbound).remove(&src);
            log::warn!(target: "p2p", "the connection from member {src} ({peer}) failed: {e}");
            return None;
        }
        let _ = stream.set_read_timeout(None);
        tune_data_socket(stream);
        Some((src, open, peer))
    }

    fn register(&self, src: u32, stream: &TcpStream) -> Result<(), String> {
        let mut inbound = lock(&self.inbound);
        if inbound.contains_key(&src) {
            return Err(format!("member {src} is connected already"));
        }
        inbound.insert(src, stream.try_clone().map_err(|e| e.to_string())?);
        Ok(())
    }

    /// Read member `src`'s messages until its connection ends: why it did
    /// (`landing`: the message it ended in, if any).
    fn read_messages(
        &self,
        stream: &TcpStream,
        mut open: Option<Opener>,
        src: u32,
        peer: &str,
        landing: &mut Option<Landing>,
    ) -> String {
        let mut rx = FrameReader::<()>::default();
        let mut seq = Sequence::default();
        let mut scratch = Vec::new();
        let ended = |e: ReadError| match e {
            ReadError::Closed => format!("member {src} ({peer}) closed its connection (it ended, or left the group)"),
            e => format!("the connection from member {src} ({peer}) failed: {e}"),
        };
        let limit = FRAME_BYTES as u32;
        loop {
            if self.closing.load(Ordering::SeqCst) {
                return "the links were closed".into();
            }
            let h = match rx.read_from(stream, limit, |()| &mut [], open.as_mut()) {
                Ok(Some(Frame::Header(h))) => h,
                Ok(_) => continue,
                Err(e) => return ended(e),
            };
            let checked = if h.namespace != self.cfg.namespace {
                Err(format!("a frame of namespace {} (this job's is {})", h.namespace, self.cfg.namespace))
            } else {
                seq.check(&h)
            };
            let step = match checked {
                Ok(step) => step,
                Err(why) => return format!("member {src} ({peer}) sent a frame out of place: {why}"),
            };
            if step.first {
                let claimed = lock(&self.matcher).claim(src, step.tag);
                *landing = Some(match claimed {
                    Some((_, recv)) => Landing::Posted { recv, at: 0, over: false },
                    None => Landing::Inbox(Vec::with_capacity((step.count as usize * FRAME_BYTES).min(RESERVE))),
                });
            }
            let len = h.payload_len as usize;
            if len > 0 {
                let target: &mut [u8] = match landing.as_mut() {
                    Some(Landing::Posted { recv, at, over }) => {
                        let w = if *over { None } else { recv.window(*at, len) };
                        match w {
                            Some(w) => {
                                *at += len;
                                w
                            }
                            None => {
                                *over = true;
                                scratch.resize(len, 0);
                                &mut scratch[..]
                            }
                        }
                    }
                    Some(Landing::Inbox(v)) => {
                        let n = v.len();
                        v.resize(n + len, 0);
                        &mut v[n..]
                    }
                    None => return "internal: a payload outside a message".into(),
                };
                rx.receive_into(h, ());
                match rx.read_from(stream, limit, |()| target, open.as_mut()) {
                    Ok(Some(Frame::Payload(..))) => {}
                    Ok(_) => return "internal: the payload did not follow its header".into(),
                    Err(e) => return ended(e),
                }
            }
            if step.last {
                match landing.take() {
                    Some(Landing::Posted { recv, at, over }) if !over && at == recv.len => recv.complete(src),
                    Some(Landing::Posted { recv, .. }) => {
                        let got = (step.count as usize - 1) * FRAME_BYTES + len;
                        let want = recv.len;
                        recv.fail(wrong_size(src, got, step.tag, want))
                    }
                    Some(Landing::Inbox(data)) => self.arrive(Message { src, tag: step.tag, data }),
                    None => return "internal: a message's end outside a message".into(),
                }
            }
        }
    }

    /// A whole message nobody had asked for when it began: to the receive
    /// posted since, if any, else the inbox; then wait while too much from
    /// this peer waits unreceived.
    fn arrive(&self, msg: Message) {
        let src = msg.src;
        let matched = lock(&self.matcher).arrive(msg);
        if let Some((_, r, msg)) = matched {
            r.deliver(msg);
        }
        let mut m = lock(&self.matcher);
        while m.backlog(src) > self.cfg.buffer_bytes && !m.is_closed() {
            m = self.room.wait(m).unwrap_or_else(|e| e.into_inner());
        }
    }
}
