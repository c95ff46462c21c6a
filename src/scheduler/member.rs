//! A member of the job as the scheduler holds it: its role, rank, address
//! and the writing half of its control connection (the one state type
//! every other scheduler module shares).

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::sync::Mutex;

use crate::protocol::{write_control, Control, Role};

pub(super) struct Member {
    pub role: Role,
    pub rank: u32,
    pub peer: SocketAddr,
    writer: Mutex<TcpStream>,
}

impl Member {
    pub fn new(role: Role, rank: u32, peer: SocketAddr, stream: TcpStream) -> Member {
        Member { role, rank, peer, writer: Mutex::new(stream) }
    }
    pub fn send(&self, msg: &Control, ns: u32) -> bool {
        match self.writer.lock() {
            Ok(mut w) => write_control(&mut *w, msg, ns).is_ok(),
            Err(_) => false,
        }
    }
    /// Several messages in one write (one wake-up of the member).
    pub fn send_all(&self, msgs: &[Control], ns: u32) -> bool {
        let buf: Vec<u8> = msgs.iter().flat_map(|m| m.encode(ns)).collect();
        match self.writer.lock() {
            Ok(mut w) => w.write_all(&buf).is_ok(),
            Err(_) => false,
        }
    }
    pub fn describe(&self) -> String {
        format!("{} {} ({})", self.role.name(), self.rank, self.peer)
    }
    /// Nothing more will be sent to the member (it said goodbye).
    pub fn finish_writing(&self) {
        if let Ok(w) = self.writer.lock() {
            let _ = w.shutdown(std::net::Shutdown::Write);
        }
    }
    /// Cut the member off (a lost server that may come back to life).
    pub fn disconnect(&self) {
        if let Ok(w) = self.writer.lock() {
            let _ = w.shutdown(std::net::Shutdown::Both);
        }
    }
}
