//! Socket helpers shared by the server and the worker client: nonblocking
//! partial reads/writes, connecting with retry, and byte views of buffers.

use std::io::{self, IoSlice, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// Outcome of one nonblocking read or write attempt.
#[derive(Debug, PartialEq, Eq)]
pub enum Io {
    /// Moved this many bytes (> 0).
    Done(usize),
    /// Nothing to do now; wait for the next readiness event.
    WouldBlock,
    /// Peer closed the connection (reads only).
    Closed,
}

pub fn read_nb<R: Read>(r: &mut R, buf: &mut [u8]) -> io::Result<Io> {
    loop {
        return match r.read(buf) {
            Ok(0) if !buf.is_empty() => Ok(Io::Closed),
            Ok(n) => Ok(Io::Done(n)),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(Io::WouldBlock),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => Err(e),
        };
    }
}

/// Write header (from `sent`) then payload: one vectored syscall, no staging copy.
pub fn write_frame_nb<W: Write>(w: &mut W, header: &[u8], payload: &[u8], sent: usize) -> io::Result<Io> {
    let slices: [IoSlice; 2] = if sent < header.len() {
        [IoSlice::new(&header[sent..]), IoSlice::new(payload)]
    } else {
        [IoSlice::new(&payload[sent - header.len()..]), IoSlice::new(&[])]
    };
    loop {
        return match w.write_vectored(&slices) {
            Ok(0) => Err(io::Error::new(io::ErrorKind::WriteZero, "connection accepts no more data")),
            Ok(n) => Ok(Io::Done(n)),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(Io::WouldBlock),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => Err(e),
        };
    }
}

/// Resolve `host:port`, accepting a bare IPv6 or hostname.
pub fn resolve(addr: &str) -> io::Result<SocketAddr> {
    addr.to_socket_addrs()?
        .next()
        .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("cannot resolve {addr}")))
}

/// Connect, retrying while the peer is not up yet (roles start in any order).
pub fn connect_retry(addr: &str, timeout: Duration) -> io::Result<TcpStream> {
    let deadline = Instant::now() + timeout;
    let mut last_err;
    loop {
        match resolve(addr).and_then(|a| TcpStream::connect_timeout(&a, Duration::from_secs(5))) {
            Ok(s) => {
                s.set_nodelay(true)?;
                return Ok(s);
            }
            Err(e) => last_err = e,
        }
        if Instant::now() >= deadline {
            return Err(io::Error::new(
                last_err.kind(),
                format!("cannot connect to {addr} within {:.0}s: {last_err}", timeout.as_secs_f64()),
            ));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Types whose every bit pattern is valid, so their memory may be filled
/// straight from the network.
pub trait Plain: Copy {}
impl Plain for f32 {}
impl Plain for u16 {}
impl Plain for u32 {}
impl Plain for u8 {}

pub fn bytes<T: Plain>(s: &[T]) -> &[u8] {
    // SAFETY: T is plain old data; the byte view covers exactly the slice.
    unsafe { std::slice::from_raw_parts(s.as_ptr() as *const u8, std::mem::size_of_val(s)) }
}

pub fn bytes_mut<T: Plain>(s: &mut [T]) -> &mut [u8] {
    // SAFETY: as above, and any bytes written form valid T values.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr() as *mut u8, std::mem::size_of_val(s)) }
}
