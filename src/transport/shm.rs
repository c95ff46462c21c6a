//! What colocated processes share: memory segments (a file in /dev/shm
//! mapped by each) and doorbells (a datagram to a peer's abstract Unix
//! socket, which wakes the peer's event loop like any other socket).
//!
//! Segments are created by whoever comes first: every process opens the
//! same name with the same length, so creation order does not matter and a
//! new segment reads as zeros. Their pages are reserved up front, so a full
//! /dev/shm is an error at open, not a SIGBUS at first touch.

use std::fs::OpenOptions;
use std::io;
use std::os::fd::AsRawFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::path::PathBuf;
use std::sync::atomic::AtomicU32;

/// Where segments live (a tmpfs on Linux).
pub const SHM_DIR: &str = "/dev/shm";

/// A shared mapping of a file in `SHM_DIR`.
pub struct Segment {
    ptr: *mut u8,
    len: usize,
    pub path: PathBuf,
}
// SAFETY: the mapping is plain memory; what is stored in it is synchronized
// by its users (atomics and locks inside the segment).
unsafe impl Send for Segment {}
unsafe impl Sync for Segment {}

impl Segment {
    /// Open (or create) segment `name` of exactly `len` bytes (> 0).
    pub fn open(name: &str, len: usize) -> io::Result<Segment> {
        let path = PathBuf::from(SHM_DIR).join(name);
        let ctx = |e: io::Error| io::Error::new(e.kind(), format!("shared memory {}: {e}", path.display()));
        // Never truncate: another process may be using it already.
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&path)
            .map_err(ctx)?;
        let have = f.metadata().map_err(ctx)?.len();
        if have != len as u64 {
            if have != 0 {
                return Err(ctx(io::Error::other(format!("has {have} bytes, expected {len}"))));
            }
            f.set_len(len as u64).map_err(ctx)?;
        }
        // SAFETY: a valid descriptor; reserving pages of our own file.
        let r = unsafe { libc::posix_fallocate(f.as_raw_fd(), 0, len as libc::off_t) };
        if r != 0 {
            let e = io::Error::from_raw_os_error(r);
            return Err(ctx(io::Error::new(
                e.kind(),
                format!("cannot reserve {len} bytes ({e}); enlarge {SHM_DIR} (e.g. docker --shm-size)"),
            )));
        }
        // SAFETY: mapping `len` bytes of a file that has `len` bytes.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(ctx(io::Error::last_os_error()));
        }
        Ok(Segment { ptr: ptr.cast(), len, path })
    }

    /// Start of the mapping plus `offset` (`offset` <= len).
    pub fn at(&self, offset: usize) -> *mut u8 {
        assert!(offset <= self.len, "segment offset {offset} beyond {}", self.len);
        // SAFETY: within the mapping.
        unsafe { self.ptr.add(offset) }
    }

    /// The 4-byte word at `offset` as an atomic (aligned, in bounds).
    pub fn word(&self, offset: usize) -> &AtomicU32 {
        assert!(offset.is_multiple_of(4) && offset + 4 <= self.len, "bad word offset {offset}");
        // SAFETY: aligned and inside the mapping, which lives as long as self.
        unsafe { AtomicU32::from_ptr(self.ptr.add(offset).cast()) }
    }

    /// Remove the name: existing mappings stay valid, nobody new can join.
    pub fn unlink(&self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: unmapping what `open` mapped; no reference outlives self.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// The abstract socket name of a member's doorbell. Abstract names belong to
/// the network namespace and vanish with the socket: nothing to clean up.
fn doorbell_addr(job_id: u64, member: u32) -> io::Result<SocketAddr> {
    SocketAddr::from_abstract_name(format!("gradhub-{job_id:016x}-{member}"))
}

/// The receiving side of a doorbell: readable when a peer rang.
pub struct Doorbell {
    pub sock: mio::net::UnixDatagram,
}

impl Doorbell {
    pub fn bind(job_id: u64, member: u32) -> io::Result<Doorbell> {
        let s = UnixDatagram::bind_addr(&doorbell_addr(job_id, member)?)?;
        s.set_nonblocking(true)?;
        Ok(Doorbell { sock: mio::net::UnixDatagram::from_std(s) })
    }

    /// Consume every pending ring (they carry no data).
    pub fn drain(&self) {
        let mut b = [0u8; 16];
        while self.sock.recv(&mut b).is_ok() {}
    }
}

/// The ringing side: wakes the doorbells of a fixed set of members.
pub struct Bells {
    sock: UnixDatagram,
    peers: Vec<SocketAddr>,
}

impl Bells {
    pub fn new(job_id: u64, members: &[u32]) -> io::Result<Bells> {
        let sock = UnixDatagram::unbound()?;
        sock.set_nonblocking(true)?;
        let peers = members.iter().map(|&m| doorbell_addr(job_id, m)).collect::<io::Result<_>>()?;
        Ok(Bells { sock, peers })
    }

    /// Ring member `i` (an index into `members`). A full queue means rings
    /// are already pending, and a gone peer is reported by the scheduler,
    /// so neither is an error here.
    pub fn ring(&self, i: usize) {
        if let Some(a) = self.peers.get(i) {
            let _ = self.sock.send_to_addr(&[1], a);
        }
    }

    /// Ring every member whose bit is set in `mask`.
    pub fn ring_mask(&self, mut mask: u64) {
        while mask != 0 {
            let i = mask.trailing_zeros() as usize;
            self.ring(i);
            mask &= mask - 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    #[test]
    fn processes_opening_one_name_share_it_and_a_wrong_size_is_refused() {
        let name = format!("gradhub-test-{}-seg", std::process::id());
        let a = Segment::open(&name, 4096).unwrap();
        let b = Segment::open(&name, 4096).unwrap();
        // A new segment reads as zeros; a store through one mapping shows in the other.
        assert_eq!(b.word(64).load(Ordering::Acquire), 0);
        a.word(64).store(7, Ordering::Release);
        assert_eq!(b.word(64).load(Ordering::Acquire), 7);
        let err = Segment::open(&name, 8192).err().unwrap().to_string();
        assert!(err.contains("has 4096 bytes, expected 8192"), "{err}");
        a.unlink();
        assert!(!a.path.exists());
        // Unlinked: the mappings still work, a new open gets a fresh segment.
        assert_eq!(b.word(64).load(Ordering::Acquire), 7);
        let c = Segment::open(&name, 4096).unwrap();
        assert_eq!(c.word(64).load(Ordering::Acquire), 0);
        c.unlink();
    }

    #[test]
    fn a_ring_reaches_the_doorbell_and_a_gone_peer_is_not_an_error() {
        let job = 0x5eed_0000_0000_0000 | std::process::id() as u64;
        let bell = Doorbell::bind(job, 1).unwrap();
        // Member 2 never bound its doorbell: ringing it is silently a no-op.
        let bells = Bells::new(job, &[1, 2]).unwrap();
        bells.ring_mask(0b11);
        let mut b = [0u8; 4];
        assert_eq!(bell.sock.recv(&mut b).unwrap(), 1);
        bell.drain();
        assert!(bell.sock.recv(&mut b).is_err(), "drain leaves nothing pending");
    }
}
