//! Blocking connections after the handshake: the socket with its keys
//! (`Authed`), and the reading and writing halves that open and seal its
//! frames when the job encrypts (`protocol::seal`), so the control paths
//! read and write whole frames as they do unencrypted (`read_control`,
//! `write_control`, any `Read`/`Write` user).

use std::io::{self, Read, Write};
use std::net::TcpStream;

use crate::protocol::seal::{Keys, Opener, Sealer};
use crate::protocol::{Frame, FrameReader, ReadError, MAX_CONTROL_PAYLOAD};

/// An authenticated connection: the socket and, if the job encrypts, the
/// connection's keys.
#[derive(Debug)]
pub struct Authed {
    pub stream: TcpStream,
    pub keys: Option<Keys>,
}

impl Authed {
    /// The socket and each direction's key.
    pub fn into_parts(self) -> (TcpStream, Option<Sealer>, Option<Opener>) {
        match self.keys {
            Some(k) => (self.stream, Some(k.seal), Some(k.open)),
            None => (self.stream, None, None),
        }
    }

    /// Write whole encoded frames (a hello before the connection becomes
    /// a data connection), sealed if it is encrypted.
    pub fn write_frames(&mut self, frames: &[u8]) -> io::Result<()> {
        let seal = self.keys.as_mut().map(|k| &mut k.seal);
        write_sealed(&mut &self.stream, seal, frames, &mut Vec::new())
    }

    /// A reading and a writing half (the socket cloned).
    pub fn split(self) -> io::Result<(SealedReader<TcpStream>, SealedWriter<TcpStream>)> {
        let (stream, seal, open) = self.into_parts();
        Ok((SealedReader::new(stream.try_clone()?, open), SealedWriter::new(stream, seal)))
    }
}

/// Reads a blocking stream, opening sealed frames: a frame is handed on
/// (its header and its payload in clear) only once its tag is checked.
/// Without a key it reads the stream as it is.
pub struct SealedReader<R> {
    inner: R,
    open: Option<Opener>,
    rx: FrameReader<()>,
    /// The frame being handed on, and how much of it was.
    out: Vec<u8>,
    at: usize,
    /// The largest payload it opens (`limit`).
    max_payload: u32,
}

impl<R> SealedReader<R> {
    pub fn new(inner: R, open: Option<Opener>) -> SealedReader<R> {
        SealedReader {
            inner,
            open,
            rx: FrameReader::default(),
            out: Vec::new(),
            at: 0,
            max_payload: MAX_CONTROL_PAYLOAD,
        }
    }
    /// Open no payload larger than `max_payload` (default: the largest
    /// control payload), so a sealed frame is refused at its header as the
    /// reader above would refuse it, before anything of it is buffered.
    pub fn limit(mut self, max_payload: u32) -> SealedReader<R> {
        self.max_payload = max_payload;
        self
    }
    pub fn get_ref(&self) -> &R {
        &self.inner
    }
    /// The stream and the key, to go on reading the same connection
    /// through another handle (between frames only: a frame half read or
    /// half handed on is lost).
    pub fn into_parts(self) -> (R, Option<Opener>) {
        (self.inner, self.open)
    }
}

impl<R: Read> Read for SealedReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let Some(open) = self.open.as_mut() else { return self.inner.read(buf) };
        if self.at == self.out.len() {
            // The buffer grows only with bytes received (from a peer that
            // proved the token), up to the limit.
            let frame = loop {
                match self.rx.read_from(&mut self.inner, self.max_payload, |()| &mut [], Some(&mut *open)) {
                    Ok(None) => return Err(io::Error::from(io::ErrorKind::WouldBlock)),
                    Ok(Some(Frame::Header(h))) if h.payload_len > 0 => self.rx.receive_owned(h),
                    Ok(Some(Frame::Header(_))) => break Vec::new(),
                    Ok(Some(Frame::Message(_, payload))) => break payload,
                    Ok(Some(Frame::Payload(..))) => {
                        return Err(io::Error::other("internal: a payload in caller memory"))
                    }
                    // The end of the stream, to the reader above: it tells
                    // a clean close from one mid-frame.
                    Err(ReadError::Closed | ReadError::ClosedMidFrame) => return Ok(0),
                    Err(ReadError::Io(e)) => return Err(e),
                    Err(e) => return Err(io::Error::new(io::ErrorKind::InvalidData, e.to_string())),
                }
            };
            self.out.clear();
            self.out.extend_from_slice(self.rx.header_bytes());
            self.out.extend_from_slice(&frame);
            self.at = 0;
        }
        let n = buf.len().min(self.out.len() - self.at);
        buf[..n].copy_from_slice(&self.out[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

/// Writes whole frames to a blocking stream, sealing each. Without a key
/// it writes the bytes as they are. Every `write` must be whole frames
/// (`write_control`, or encoded frames end to end): one that is not is an
/// error, and nothing of it is written.
pub struct SealedWriter<W> {
    inner: W,
    seal: Option<Sealer>,
    buf: Vec<u8>,
}

impl<W> SealedWriter<W> {
    pub fn new(inner: W, seal: Option<Sealer>) -> SealedWriter<W> {
        SealedWriter { inner, seal, buf: Vec::new() }
    }
    pub fn get_ref(&self) -> &W {
        &self.inner
    }
}

impl<W: Write> Write for SealedWriter<W> {
    fn write(&mut self, frames: &[u8]) -> io::Result<usize> {
        if self.seal.is_none() {
            return self.inner.write(frames);
        }
        write_sealed(&mut self.inner, self.seal.as_mut(), frames, &mut self.buf)?;
        Ok(frames.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Write whole frames to `w`, sealed with `seal` if given (in `buf`).
fn write_sealed<W: Write>(w: &mut W, seal: Option<&mut Sealer>, frames: &[u8], buf: &mut Vec<u8>) -> io::Result<()> {
    let Some(seal) = seal else { return w.write_all(frames) };
    seal.seal_frames(frames, buf).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("internal: {e}")))?;
    w.write_all(buf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::seal::Side;
    use crate::protocol::{read_control, write_control, Control};

    fn keys() -> (Keys, Keys) {
        let (nc, ns) = ([5u8; 32], [6u8; 32]);
        (Keys::derive(b"t", &nc, &ns, Side::Connector), Keys::derive(b"t", &nc, &ns, Side::Listener))
    }

    #[test]
    fn control_messages_cross_sealed_and_come_out_whole() {
        let (c, l) = keys();
        let mut w = SealedWriter::new(Vec::new(), Some(c.seal));
        let msgs = [Control::Heartbeat, Control::Error { message: "x".repeat(70_000) }, Control::Barrier { id: 3 }];
        write_control(&mut w, &msgs[0], 7).unwrap();
        // Two frames in one write, as `Member::send_all` does.
        let two: Vec<u8> = msgs[1..].iter().flat_map(|m| m.encode(7)).collect();
        w.write_all(&two).unwrap();
        let wire = w.get_ref().clone();
        assert!(!wire.windows(5).any(|b| b == b"xxxxx"), "the payload is not in clear");
        let mut r = SealedReader::new(&wire[..], Some(l.open));
        for m in &msgs {
            assert_eq!(&read_control(&mut r, 7).unwrap(), m);
        }
        // The end of the stream is a clean close.
        assert!(matches!(read_control(&mut r, 7), Err(ReadError::Closed)));
        // A byte changed anywhere: an error, never a message.
        for at in [3, 45, 100, wire.len() - 1] {
            let mut bad = wire.clone();
            bad[at] ^= 4;
            let mut r = SealedReader::new(&bad[..], Some(keys().1.open));
            let got: Vec<_> = (0..3).map(|_| read_control(&mut r, 7)).collect();
            assert!(got.iter().any(|g| g.is_err()), "byte {at}: {got:?}");
            let good = got.iter().take_while(|g| g.is_ok()).count();
            assert!(got[..good].iter().zip(&msgs).all(|(g, m)| g.as_ref().ok() == Some(m)));
        }
        // A frame over the reader's limit is refused at its header.
        let mut r = SealedReader::new(&wire[..], Some(keys().1.open)).limit(1000);
        assert_eq!(read_control(&mut r, 7).unwrap(), msgs[0]);
        assert!(read_control(&mut r, 7).unwrap_err().to_string().contains("exceeds the limit"));
        // A partial frame is refused and nothing is written.
        let mut w = SealedWriter::new(Vec::new(), Some(keys().0.seal));
        assert!(w.write(&two[..two.len() - 1]).is_err());
        assert!(w.get_ref().is_empty());
    }

    #[test]
    fn without_keys_bytes_pass_as_they_are() {
        let mut w = SealedWriter::new(Vec::new(), None);
        write_control(&mut w, &Control::Heartbeat, 1).unwrap();
        assert_eq!(w.get_ref(), &Control::Heartbeat.encode(1));
        let mut r = SealedReader::new(&w.get_ref()[..], None);
        assert_eq!(read_control(&mut r, 1).unwrap(), Control::Heartbeat);
    }
}
