//! A member of the job as the scheduler holds it: its role, rank, address
//! and the writing half of its control connection (the one state type
//! every other scheduler module shares).

use std::io::Write;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};

use crate::protocol::{write_control, Control, Role};
use crate::transport::{SealedReader, SealedWriter};

/// The reading half of a member's control connection (opened if the job
/// encrypts).
pub(super) type Reader = SealedReader<TcpStream>;

/// The writing half, shared by whoever may write to it (its registration,
/// then its member): one sealer, so frames are sealed in the order they go.
#[derive(Clone)]
pub(super) struct Writer(Arc<Mutex<SealedWriter<TcpStream>>>);

impl Writer {
    pub fn new(w: SealedWriter<TcpStream>) -> Writer {
        Writer(Arc::new(Mutex::new(w)))
    }
    pub fn send(&self, msg: &Control, ns: u32) -> bool {
        match self.0.lock() {
            Ok(mut w) => write_control(&mut *w, msg, ns).is_ok(),
            Err(_) => false,
        }
    }
    /// Encoded frames, whole, in one write.
    pub fn send_bytes(&self, buf: &[u8]) -> bool {
        match self.0.lock() {
            Ok(mut w) => w.write_all(buf).is_ok(),
            Err(_) => false,
        }
    }
    pub fn shutdown(&self, how: Shutdown) {
        if let Ok(w) = self.0.lock() {
            let _ = w.get_ref().shutdown(how);
        }
    }
    /// Another handle to the socket, to watch it (never to write: frames
    /// would go unsealed).
    pub fn socket(&self) -> std::io::Result<TcpStream> {
        self.0.lock().map_err(|_| std::io::Error::other("a writer's lock poisoned"))?.get_ref().try_clone()
    }
}

pub(super) struct Member {
    pub role: Role,
    pub rank: u32,
    pub peer: SocketAddr,
    writer: Writer,
}

impl Member {
    pub fn new(role: Role, rank: u32, peer: SocketAddr, stream: Writer) -> Member {
        Member { role, rank, peer, writer: stream }
    }
    pub fn send(&self, msg: &Control, ns: u32) -> bool {
        self.writer.send(msg, ns)
    }
    /// Several messages in one write (one wake-up of the member).
    pub fn send_all(&self, msgs: &[Control], ns: u32) -> bool {
        let buf: Vec<u8> = msgs.iter().flat_map(|m| m.encode(ns)).collect();
        self.writer.send_bytes(&buf)
    }
    pub fn describe(&self) -> String {
        format!("{} {} ({})", self.role.name(), self.rank, self.peer)
    }
    /// Nothing more will be sent to the member (it said goodbye).
    pub fn finish_writing(&self) {
        self.writer.shutdown(Shutdown::Write);
    }
    /// Cut the member off (a lost server that may come back to life).
    pub fn disconnect(&self) {
        self.writer.shutdown(Shutdown::Both);
    }
}
