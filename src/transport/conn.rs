//! The one framed, nonblocking connection of the data plane, used by the
//! worker's I/O thread and by every server thread.
//!
//! - Reading: `protocol::FrameReader`, the one frame reader (header, then
//!   payload into the caller's memory or a buffer of its own), on the socket.
//! - Writing: `FrameWriter` holds the frame being written (header and payload
//!   in one vectored write, no staging copy) and applies the writability
//!   rule: the socket is watched for writability only while a write would
//!   block, because with the interest always on every ACK wakes the thread
//!   for nothing.
//!
//! - Sealing (`protocol::seal`, when the job encrypts): the connection
//!   holds its two keys; a frame is sealed into the writer's buffer when its
//!   first byte is written (one copy, where the plain path copies nothing)
//!   and opened by the reader in place, where the checksum would be checked.
//!
//! All methods take `&self`, so a connection can be shared between threads
//! (the worker sends from callers' threads and receives on its I/O thread);
//! the read and write states live wherever their owner keeps them, and each
//! key behind a lock only its direction's user takes.

use std::io::{self, IoSlice, Write};
use std::os::fd::AsRawFd;
use std::sync::{Mutex, OnceLock};

use mio::net::TcpStream;
use mio::unix::SourceFd;
use mio::{Interest, Registry, Token};

use crate::protocol::seal::{Keys, Opener, Sealer};
use crate::protocol::{Frame, FrameReader, Header, ProtocolError, ReadError, HEADER_LEN};

#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    #[error(transparent)]
    Read(#[from] ReadError),
    #[error("connection lost: {0}")]
    Io(#[from] io::Error),
    /// A well-formed frame that breaks the protocol's rules here (wrong
    /// round, unknown key, ...): the message says which.
    #[error("{0}")]
    Invalid(String),
}

impl ConnError {
    /// A frame changed on the way (`ProtocolError::changed_on_the_way`).
    pub fn changed_on_the_way(&self) -> bool {
        matches!(self, ConnError::Read(ReadError::Protocol(p)) if p.changed_on_the_way())
    }
}

impl From<ProtocolError> for ConnError {
    fn from(e: ProtocolError) -> ConnError {
        ConnError::Read(ReadError::Protocol(e))
    }
}
impl From<String> for ConnError {
    fn from(s: String) -> ConnError {
        ConnError::Invalid(s)
    }
}
impl From<&str> for ConnError {
    fn from(s: &str) -> ConnError {
        ConnError::Invalid(s.to_string())
    }
}

/// How far `Connection::read_frame` reads before it reports "nothing more
/// for now". The socket is watched edge-triggered, so a short read normally
/// means drained: anything arriving later raises a new edge. But an event that
/// already reported the peer's close (or an error) raises no further edge, and
/// the EOF may sit right behind the data of that same event: then the reader
/// must go on until `WouldBlock` or EOF, or the close is never seen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Drain {
    /// Stop at a short read.
    Short,
    /// Stop only at `WouldBlock` or EOF.
    Full,
}

impl Drain {
    /// What an event from the poller asks for.
    pub fn of(ev: &mio::event::Event) -> Drain {
        if ev.is_read_closed() || ev.is_error() {
            Drain::Full
        } else {
            Drain::Short
        }
    }
}

/// Outcome of one nonblocking write attempt.
enum Wrote {
    Moved(usize),
    WouldBlock,
}

fn write_nb<W: Write>(mut w: W, head: &[u8], payload: &[u8]) -> io::Result<Wrote> {
    let slices = [IoSlice::new(head), IoSlice::new(payload)];
    loop {
        return match w.write_vectored(&slices) {
            Ok(0) => Err(io::Error::new(io::ErrorKind::WriteZero, "connection accepts no more data")),
            Ok(n) => Ok(Wrote::Moved(n)),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(Wrote::WouldBlock),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => Err(e),
        };
    }
}

/// A frame to write: its header (or a pre-encoded run of frames) and an
/// item from which the payload is looked up when it is written.
pub struct Outgoing<I> {
    pub item: I,
    head: Head,
    sent: usize,
}

/// A header inline (no allocation per chunk on the hot path), or whole frames.
enum Head {
    /// Not encoded yet: its payload checksum is computed when the frame's
    /// first byte is written, over the payload about to be copied into the
    /// socket (so it is in cache for that copy).
    Pending(Header),
    Header([u8; HEADER_LEN]),
    Bytes(Vec<u8>),
    /// Sealed, whole, into the writer's buffer (`FrameWriter::sealed`).
    Sealed,
}

impl Head {
    fn bytes(&mut self, payload: &[u8]) -> &[u8] {
        if let Head::Pending(h) = self {
            *self = Head::Header(h.encode(payload));
        }
        match self {
            Head::Header(h) => h,
            Head::Bytes(b) => b,
            Head::Pending(_) => unreachable!("encoded above"),
            Head::Sealed => &[],
        }
    }

    /// Seal the frame(s) with `payload` into `out`, once (the first write).
    fn seal(&mut self, payload: &[u8], key: &Mutex<Sealer>, out: &mut Vec<u8>) -> Result<(), ConnError> {
        if matches!(self, Head::Sealed) {
            return Ok(()); // sealed when it started: the rest of it goes on
        }
        let mut key = key.lock().unwrap_or_else(|e| e.into_inner());
        match std::mem::replace(self, Head::Sealed) {
            Head::Pending(h) => {
                let head = h.encode(payload);
                out.clear();
                out.extend_from_slice(&head);
                out.extend_from_slice(payload);
                let tag = key.seal(&head, &mut out[HEADER_LEN..])?;
                out.extend_from_slice(&tag);
            }
            Head::Bytes(b) => key.seal_frames(&b, out)?,
            Head::Sealed => {}
            Head::Header(_) => return Err(ConnError::Invalid("internal: a frame half-written in clear".into())),
        }
        Ok(())
    }
}

impl<I> Outgoing<I> {
    /// A frame whose payload is the item's (see `Connection::pump`).
    pub fn frame(item: I, hdr: &Header) -> Self {
        Outgoing { item, head: Head::Pending(*hdr), sent: 0 }
    }
    /// Frames encoded in full, header(s) and payload(s) (batched acks,
    /// notices, control frames); the item's payload must be empty.
    pub fn encoded(item: I, bytes: Vec<u8>) -> Self {
        Outgoing { item, head: Head::Bytes(bytes), sent: 0 }
    }
}

/// Write state of one connection.
pub struct FrameWriter<I> {
    cur: Option<Outgoing<I>>,
    /// The current frame sealed (encrypted connections only).
    sealed: Vec<u8>,
    /// Registered for writability (only while a write would block).
    watching_writable: bool,
    /// Not registered for readability (`Connection::quiet`).
    quiet: bool,
}

impl<I> Default for FrameWriter<I> {
    fn default() -> Self {
        FrameWriter { cur: None, sealed: Vec::new(), watching_writable: false, quiet: false }
    }
}

impl<I> FrameWriter<I> {
    /// No frame is half-written (a new frame may be written out of band).
    pub fn idle(&self) -> bool {
        self.cur.is_none()
    }
    /// The item of the frame being written, if one is half-written.
    pub fn current(&self) -> Option<&I> {
        self.cur.as_ref().map(|o| &o.item)
    }
    pub fn current_mut(&mut self) -> Option<&mut I> {
        self.cur.as_mut().map(|o| &mut o.item)
    }
    /// Drop the frame being written (the connection is being torn down).
    pub fn clear(&mut self) {
        self.cur = None;
    }
}

/// One data connection: a nonblocking socket registered with a poller under `token`.
pub struct Connection {
    stream: TcpStream,
    token: Token,
    /// Who is at the other end, for messages.
    pub peer: String,
    /// In the poller's set (not after `deregister`, or while quiet with
    /// nothing to watch).
    registered: std::sync::atomic::AtomicBool,
    /// The keys, once the handshake set them (`seal_with`): every frame
    /// after it is sealed.
    seal: OnceLock<Mutex<Sealer>>,
    open: OnceLock<Mutex<Opener>>,
}

impl Connection {
    /// Registers `stream` for readability under `token`.
    pub fn new(registry: &Registry, mut stream: TcpStream, token: Token, peer: String) -> io::Result<Connection> {
        registry.register(&mut stream, token, Interest::READABLE)?;
        Ok(Connection {
            stream,
            token,
            peer,
            registered: std::sync::atomic::AtomicBool::new(true),
            seal: OnceLock::new(),
            open: OnceLock::new(),
        })
    }

    /// Seal and open every frame from now on with `keys` (the handshake's,
    /// `protocol::seal`). Between frames only, once.
    pub fn seal_with(&self, keys: Keys) -> Result<(), ConnError> {
        let twice = || ConnError::Invalid("internal: a connection's keys set twice".into());
        self.seal.set(Mutex::new(keys.seal)).map_err(|_| twice())?;
        self.open.set(Mutex::new(keys.open)).map_err(|_| twice())
    }

    /// The keys of a connection whose handshake ran before it was one
    /// (dialled and greeted blocking): `seal` has sealed what was written.
    pub fn seal_with_parts(&self, seal: Option<Sealer>, open: Option<Opener>) -> Result<(), ConnError> {
        match (seal, open) {
            (Some(seal), Some(open)) => self.seal_with(Keys { seal, open }),
            (None, None) => Ok(()),
            _ => Err(ConnError::Invalid("internal: one key of a connection without the other".into())),
        }
    }

    pub fn stream(&self) -> &TcpStream {
        &self.stream
    }

    pub fn deregister(&self, registry: &Registry) {
        if self.registered.swap(false, std::sync::atomic::Ordering::Relaxed) {
            let _ = registry.deregister(&mut SourceFd(&self.stream.as_raw_fd()));
        }
    }

    /// Read until one frame event is complete (`Ok(Some)`) or the socket has
    /// nothing more for now (`Ok(None)`, as far as `drain` says); see
    /// `FrameReader::read_from`.
    pub fn read_frame<'d, T: Copy>(
        &self,
        rx: &mut FrameReader<T>,
        max_payload: u32,
        dst: impl FnOnce(T) -> &'d mut [u8],
        drain: Drain,
    ) -> Result<Option<Frame<T>>, ConnError> {
        let mut key = self.open.get().map(|k| k.lock().unwrap_or_else(|e| e.into_inner()));
        let open = key.as_deref_mut();
        Ok(match drain {
            Drain::Short => rx.read_edge(&self.stream, max_payload, dst, open)?,
            Drain::Full => rx.read_from(&self.stream, max_payload, dst, open)?,
        })
    }

    /// Write frames until `next` has none left or the socket is full, then
    /// watch for writability exactly in the latter case. `payload` gives the
    /// payload bytes of an item (empty for `Outgoing::encoded` frames).
    pub fn pump<'p, I>(
        &self,
        registry: &Registry,
        tx: &mut FrameWriter<I>,
        mut next: impl FnMut() -> Option<Outgoing<I>>,
        payload: impl Fn(&I) -> &'p [u8],
    ) -> Result<(), ConnError> {
        let blocked = loop {
            if tx.cur.is_none() {
                match next() {
                    Some(o) => tx.cur = Some(o),
                    None => break false,
                }
            }
            let Some(cur) = tx.cur.as_mut() else { break false };
            let mut body = payload(&cur.item);
            if let Some(key) = self.seal.get() {
                cur.head.seal(body, key, &mut tx.sealed)?;
                body = &tx.sealed;
            }
            let head = cur.head.bytes(body);
            let total = head.len() + body.len();
            let (head, body) = if cur.sent < head.len() {
                (&head[cur.sent..], body)
            } else {
                (&[][..], &body[cur.sent - head.len()..])
            };
            match write_nb(&self.stream, head, body)? {
                Wrote::Moved(n) => {
                    cur.sent += n;
                    if cur.sent == total {
                        tx.cur = None;
                    }
                }
                Wrote::WouldBlock => break true,
            }
        };
        if blocked != tx.watching_writable {
            self.watch(registry, !tx.quiet, blocked)?;
            tx.watching_writable = blocked;
        }
        Ok(())
    }

    /// Stop (or resume) waking the poller when data arrives, while someone
    /// else reads this connection (a caller waiting for a small result:
    /// one wake-up fewer per round trip). `tx` is the connection's writer,
    /// whose lock serializes every change of what is watched.
    pub fn quiet<I>(&self, registry: &Registry, tx: &mut FrameWriter<I>, on: bool) -> io::Result<()> {
        if tx.quiet != on {
            // Resuming re-checks readiness: data that came meanwhile raises an event.
            self.watch(registry, !on, tx.watching_writable)?;
            tx.quiet = on;
        }
        Ok(())
    }

    fn watch(&self, registry: &Registry, readable: bool, writable: bool) -> io::Result<()> {
        let fd = &mut SourceFd(&self.stream.as_raw_fd());
        let interest = match (readable, writable) {
            (true, true) => Interest::READABLE | Interest::WRITABLE,
            (true, false) => Interest::READABLE,
            (false, true) => Interest::WRITABLE,
            (false, false) => {
                // Nothing to watch (mio cannot express it): out of the set.
                self.registered.store(false, std::sync::atomic::Ordering::Relaxed);
                return registry.deregister(fd);
            }
        };
        // EPOLL_CTL_MOD re-checks readiness, so no wakeup is lost in between.
        if self.registered.swap(true, std::sync::atomic::Ordering::Relaxed) {
            registry.reregister(fd, self.token, interest)
        } else {
            registry.register(fd, self.token, interest)
        }
    }

    /// Closing sends a reset, not a clean end: the peer takes the link for
    /// broken (and mends it) rather than closed by a peer that is done.
    pub fn reset_on_close(&self) {
        let _ = socket2::SockRef::from(&self.stream).set_linger(Some(std::time::Duration::ZERO));
    }

    /// Best effort, nonblocking: e.g. an Error frame before closing, written
    /// only when no frame is half-written (a full socket drops it).
    pub fn write_last_words(&self, bytes: &[u8]) {
        match self.seal.get() {
            Some(key) => {
                let mut sealed = Vec::new();
                if key.lock().unwrap_or_else(|e| e.into_inner()).seal_frames(bytes, &mut sealed).is_ok() {
                    let _ = (&self.stream).write_all(&sealed);
                }
            }
            None => {
                let _ = (&self.stream).write_all(bytes);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{encode_frame, MsgType};
    use std::time::{Duration, Instant};

    /// A registered nonblocking connection and the blocking std peer writing to it.
    fn pair() -> (mio::Poll, Connection, std::net::TcpStream) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let peer = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        s.set_nonblocking(true).unwrap();
        let poll = mio::Poll::new().unwrap();
        let c = Connection::new(poll.registry(), TcpStream::from_std(s), Token(7), "peer".into()).unwrap();
        (poll, c, peer)
    }

    fn header(t: MsgType, len: u32) -> Header {
        let mut h = Header::new(t);
        h.key = 3;
        h.payload_len = len;
        h
    }

    /// Read until a frame arrives (bounded), the way an event loop would.
    fn next<T: Copy>(c: &Connection, rx: &mut FrameReader<T>, dst: &mut [u8]) -> Result<Frame<T>, ConnError> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if let Some(f) = c.read_frame(rx, 1 << 20, |_| &mut *dst, Drain::Short)? {
                return Ok(f);
            }
            assert!(Instant::now() < deadline, "no frame within 5 s");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn frames_arrive_whole_whatever_the_segmentation() {
        let (_poll, c, mut peer) = pair();
        let payload: Vec<u8> = (0..100u8).collect();
        let mut wire = encode_frame(&header(MsgType::Push, 100), &payload);
        wire.extend_from_slice(&encode_frame(&header(MsgType::Stall, 5), b"hello"));
        wire.extend_from_slice(&header(MsgType::Received, 0).encode(&[]));
        // One byte at a time: every partial state of header and payload.
        let writer = std::thread::spawn(move || {
            for b in wire {
                peer.write_all(&[b]).unwrap();
                peer.flush().unwrap();
            }
            peer
        });
        let mut rx = FrameReader::<u32>::default();
        let mut dst = vec![0u8; 100];
        let Frame::Header(h) = next(&c, &mut rx, &mut dst).unwrap() else { panic!("expected a header") };
        assert_eq!((h.msg_type, h.key, h.payload_len), (MsgType::Push, 3, 100));
        rx.receive_into(h, 42);
        let Frame::Payload(h2, target) = next(&c, &mut rx, &mut dst).unwrap() else { panic!("expected a payload") };
        assert_eq!((h2, target), (h, 42));
        assert_eq!(dst, payload, "payload lands in the caller's memory");
        let Frame::Header(h) = next(&c, &mut rx, &mut dst).unwrap() else { panic!("expected a header") };
        rx.receive_owned(h);
        let Frame::Message(h, buf) = next(&c, &mut rx, &mut dst).unwrap() else { panic!("expected a message") };
        assert_eq!((h.msg_type, buf.as_slice()), (MsgType::Stall, &b"hello"[..]));
        // A header-only frame, received "into" nothing: completes at once.
        let Frame::Header(h) = next(&c, &mut rx, &mut dst).unwrap() else { panic!("expected a header") };
        rx.receive_into(h, 9);
        let Frame::Payload(_, 9) = next(&c, &mut rx, &mut []).unwrap() else { panic!("expected an empty payload") };
        drop(writer.join().unwrap());
        // Closed between frames: a clean close.
        assert!(matches!(next(&c, &mut rx, &mut dst), Err(ConnError::Read(ReadError::Closed))));
    }

    /// The way an event loop reads: only when the poller reports an event,
    /// each time until `read_frame` says "nothing more for now".
    fn on_events(poll: &mut mio::Poll, c: &Connection, rx: &mut FrameReader<()>) -> Result<(), ConnError> {
        let mut events = mio::Events::with_capacity(8);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            poll.poll(&mut events, Some(Duration::from_millis(200)))?;
            for ev in events.iter() {
                if let Some(f) = c.read_frame(rx, 1 << 20, |_| &mut [], Drain::of(ev))? {
                    panic!("no whole frame was sent, got {f:?}");
                }
            }
        }
        Ok(())
    }

    #[test]
    fn a_close_behind_the_data_of_the_same_event_is_seen() {
        // Part of a header, then the close, both queued before the first
        // event is read: a short read of the data must not end the attempt,
        // or no later edge ever reports the close (a frame "stalled" forever).
        let (mut poll, c, mut peer) = pair();
        peer.write_all(&header(MsgType::Push, 10).encode(&[])[..20]).unwrap();
        drop(peer);
        std::thread::sleep(Duration::from_millis(50));
        let mut rx = FrameReader::<()>::default();
        let res = on_events(&mut poll, &c, &mut rx);
        assert!(matches!(res, Err(ConnError::Read(ReadError::ClosedMidFrame))), "{res:?}");

        // Without a close, a short read does end the attempt.
        let (_poll, c, mut peer) = pair();
        peer.write_all(&header(MsgType::Push, 10).encode(&[])[..20]).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let mut rx = FrameReader::<()>::default();
        assert!(matches!(c.read_frame(&mut rx, 1 << 20, |_| &mut [], Drain::Short), Ok(None)));
        assert!(matches!(c.read_frame(&mut rx, 1 << 20, |_| &mut [], Drain::Full), Ok(None)));
        drop(peer);
    }

    #[test]
    fn closing_mid_frame_and_bad_headers_are_errors() {
        let (_poll, c, mut peer) = pair();
        peer.write_all(&header(MsgType::Push, 10).encode(&[])[..20]).unwrap();
        drop(peer);
        let mut rx = FrameReader::<()>::default();
        assert!(matches!(next(&c, &mut rx, &mut []), Err(ConnError::Read(ReadError::ClosedMidFrame))));

        let (_poll, c, mut peer) = pair();
        // A stranger's bytes (a flipped bit of ours is a checksum mismatch).
        let bad = [0u8; crate::protocol::HEADER_LEN];
        peer.write_all(&bad).unwrap();
        let mut rx = FrameReader::<()>::default();
        let err = next(&c, &mut rx, &mut []).unwrap_err();
        assert!(matches!(err, ConnError::Read(ReadError::Protocol(ProtocolError::BadMagic(_)))), "{err}");

        // A payload longer than the caller's limit is refused at the header.
        let (_poll, c, mut peer) = pair();
        peer.write_all(&header(MsgType::Push, 2 << 20).encode(&[])).unwrap();
        let mut rx = FrameReader::<()>::default();
        assert!(matches!(
            next(&c, &mut rx, &mut []),
            Err(ConnError::Read(ReadError::Protocol(ProtocolError::PayloadTooLarge { .. })))
        ));
    }

    #[test]
    fn a_payload_corrupted_on_the_way_is_refused_once_whole() {
        // Received into caller memory piece by piece (the checksum taken in
        // as it arrives): the frame is an error, never a payload to use.
        let (_poll, c, mut peer) = pair();
        let payload: Vec<u8> = (0..5000u32).map(|i| i as u8).collect();
        let mut wire = encode_frame(&header(MsgType::Push, 5000), &payload);
        wire[HEADER_LEN + 4321] ^= 0x80;
        let writer = std::thread::spawn(move || {
            for piece in wire.chunks(999) {
                peer.write_all(piece).unwrap();
                std::thread::sleep(Duration::from_millis(2));
            }
            peer
        });
        let mut rx = FrameReader::<u8>::default();
        let mut dst = vec![0u8; 5000];
        let Frame::Header(h) = next(&c, &mut rx, &mut dst).unwrap() else { panic!("expected a header") };
        rx.receive_into(h, 1);
        let err = next(&c, &mut rx, &mut dst).unwrap_err();
        assert!(matches!(&err, ConnError::Read(ReadError::Protocol(ProtocolError::BadChecksum(_)))), "{err}");
        assert!(err.to_string().contains("payload of a Push frame (key 3, chunk 0, round 0)"), "{err}");
        drop(writer.join().unwrap());
    }

    #[test]
    fn frames_written_by_pump_carry_their_payload_checksum() {
        let (poll, c, peer) = pair();
        let body: Vec<u8> = (0..70_000u32).map(|i| (i % 251) as u8).collect();
        let mut queue = vec![Outgoing::frame(0usize, &header(MsgType::Result, body.len() as u32))];
        let mut tx = FrameWriter::<usize>::default();
        let reader = std::thread::spawn(move || {
            let mut peer = peer;
            crate::protocol::read_message(&mut peer, None, 1 << 20)
        });
        let deadline = Instant::now() + Duration::from_secs(10);
        while !(tx.idle() && queue.is_empty()) {
            assert!(Instant::now() < deadline, "pump made no progress");
            c.pump(poll.registry(), &mut tx, || queue.pop(), |_| &body[..]).unwrap();
        }
        let (h, got) = reader.join().unwrap().expect("a frame whose checksums hold");
        assert_eq!((h.msg_type, got), (MsgType::Result, body));
    }

    /// The bytes `c` writes for `queue` with `pump` (read back by its peer).
    fn pumped(
        poll: &mio::Poll,
        c: &Connection,
        peer: std::net::TcpStream,
        mut queue: Vec<Outgoing<usize>>,
        bodies: &[Vec<u8>],
    ) -> Vec<u8> {
        queue.reverse();
        let mut tx = FrameWriter::<usize>::default();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !(tx.idle() && queue.is_empty()) {
            assert!(Instant::now() < deadline, "pump made no progress");
            c.pump(poll.registry(), &mut tx, || queue.pop(), |&i| &bodies[i][..]).unwrap();
        }
        peer.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
        let mut all = Vec::new();
        let mut peer = peer;
        let mut buf = [0u8; 1 << 16];
        while let Ok(n) = std::io::Read::read(&mut peer, &mut buf) {
            if n == 0 {
                break;
            }
            all.extend_from_slice(&buf[..n]);
        }
        all
    }

    #[test]
    fn sealed_frames_cross_whole_and_a_changed_byte_is_never_used() {
        use crate::protocol::seal::{Keys, Side};
        let keys = |side| Keys::derive(b"tok", &[1; 32], &[2; 32], side);
        let bodies = vec![(0..5000u32).map(|i| (i % 251) as u8).collect::<Vec<u8>>(), Vec::new()];
        let (poll, w, peer) = pair();
        w.seal_with(keys(Side::Connector)).unwrap();
        let mut run = encode_frame(&header(MsgType::Stall, 5), b"hello");
        run.extend_from_slice(&header(MsgType::Received, 0).encode(&[]));
        let queue = vec![Outgoing::frame(0, &header(MsgType::Push, 5000)), Outgoing::encoded(1, run)];
        let wire = pumped(&poll, &w, peer, queue, &bodies);
        assert_eq!(wire.len(), 3 * HEADER_LEN + 5000 + 5 + 3 * 16, "each frame carries its tag");
        assert!(!wire.windows(64).any(|b| b == &bodies[0][..64]), "the payload is not in clear");

        // Read back one byte at a time: every partial state, tags included.
        type ReadBack = Result<(Vec<u8>, Vec<(MsgType, Vec<u8>)>), ConnError>;
        let read_back = |wire: Vec<u8>| -> ReadBack {
            let (_poll, r, mut peer) = pair();
            r.seal_with(keys(Side::Listener)).unwrap();
            let writer = std::thread::spawn(move || {
                for b in wire {
                    if peer.write_all(&[b]).is_err() {
                        break;
                    }
                }
                peer
            });
            let mut rx = FrameReader::<u32>::default();
            let mut dst = vec![0u8; 5000];
            let mut got = Vec::new();
            let result = (|| {
                let Frame::Header(h) = next(&r, &mut rx, &mut dst)? else { panic!("expected a header") };
                rx.receive_into(h, 1);
                let Frame::Payload(..) = next(&r, &mut rx, &mut dst)? else { panic!("expected a payload") };
                let Frame::Header(h) = next(&r, &mut rx, &mut dst)? else { panic!("expected a header") };
                rx.receive_owned(h);
                let Frame::Message(h, b) = next(&r, &mut rx, &mut dst)? else { panic!("expected a message") };
                got.push((h.msg_type, b));
                let Frame::Header(h) = next(&r, &mut rx, &mut dst)? else { panic!("expected a header") };
                got.push((h.msg_type, Vec::new()));
                Ok(())
            })();
            drop(writer.join().unwrap());
            result.map(|()| (dst, got))
        };
        let (dst, got) = read_back(wire.clone()).unwrap();
        assert_eq!(dst, bodies[0]);
        assert_eq!(got, vec![(MsgType::Stall, b"hello".to_vec()), (MsgType::Received, Vec::new())]);
        // A byte changed in the payload, its tag, a header or a header-only
        // frame's tag: an error where the checksum's would be.
        for at in [HEADER_LEN + 10, HEADER_LEN + 5000 + 3, HEADER_LEN + 5000 + 16 + 12, wire.len() - 1] {
            let mut bad = wire.clone();
            bad[at] ^= 0x20;
            let err = read_back(bad).unwrap_err();
            let ok = err.changed_on_the_way()
                || matches!(err, ConnError::Read(ReadError::Protocol(ProtocolError::BadChecksum(_))));
            assert!(ok, "byte {at}: {err}");
        }
    }

    #[test]
    fn a_destination_of_the_wrong_size_is_refused() {
        let (_poll, c, mut peer) = pair();
        peer.write_all(&header(MsgType::Push, 8).encode(&[])).unwrap();
        peer.write_all(&[1; 8]).unwrap();
        let mut rx = FrameReader::<u8>::default();
        let Frame::Header(h) = next(&c, &mut rx, &mut []).unwrap() else { panic!("expected a header") };
        rx.receive_into(h, 0);
        assert!(next(&c, &mut rx, &mut [0u8; 4]).is_err());
    }

    #[test]
    fn pump_writes_everything_and_watches_writability_only_while_blocked() {
        let (poll, c, peer) = pair();
        let big = vec![7u8; 8 << 20];
        let mut queue: Vec<Outgoing<usize>> =
            (0..4).map(|i| Outgoing::frame(i, &header(MsgType::Result, big.len() as u32))).collect();
        queue.push(Outgoing::encoded(99, header(MsgType::Received, 0).encode(&[]).to_vec()));
        queue.reverse();
        let mut tx = FrameWriter::<usize>::default();
        let payload = |i: &usize| if *i == 99 { &[][..] } else { &big[..] };
        // Nobody reads yet: 32 MiB cannot fit in the socket buffers.
        c.pump(poll.registry(), &mut tx, || queue.pop(), payload).unwrap();
        assert!(tx.watching_writable && !tx.idle(), "a blocked write watches for writability");
        let reader = std::thread::spawn(move || {
            let mut peer = peer;
            let mut all = Vec::new();
            std::io::Read::read_to_end(&mut peer, &mut all).unwrap();
            all
        });
        let deadline = Instant::now() + Duration::from_secs(10);
        while !(tx.idle() && queue.is_empty()) {
            assert!(Instant::now() < deadline, "pump made no progress");
            c.pump(poll.registry(), &mut tx, || queue.pop(), payload).unwrap();
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(!tx.watching_writable, "an idle writer stops watching");
        drop(c);
        let all = reader.join().unwrap();
        assert_eq!(all.len(), 4 * (HEADER_LEN + big.len()) + HEADER_LEN);
        let last = Header::decode(all[all.len() - HEADER_LEN..].try_into().unwrap(), 0).unwrap();
        assert_eq!(last.msg_type, MsgType::Received);
    }
}
