//! Point-to-point between the workers of one group (torch's send, recv and
//! recv from any source, which pipeline schedules are built on): each
//! worker listens, and sends to a peer over a connection of its own to the
//! peer's listener, so a message takes one hop and no server's CPU. The
//! path was chosen by measurement against relaying through a server
//! (docs/benchmarks.md, "Point-to-point").
//!
//! Each connection is authenticated with the job's token as every other
//! one is (`protocol::auth`), sealed when the job encrypts, and opens with
//! a `PeerHello` each way that names the sender's rank and the group, so a
//! connection reaches the member it meant to. Messages go as `PeerData`
//! frames (`message`), checked in sequence on arrival. A receive is posted
//! with its buffer and matched in the order torch requires (`matching`):
//! the message is copied into the buffer and the caller told by callback.
//!
//! Threads: one accepts; one per connected peer reads (and stops reading,
//! so TCP holds the sender back, while more than `buffer_bytes` from that
//! peer waits unreceived); sends run on the caller's thread, one at a time
//! per destination. A peer whose connection ends or fails is lost: the
//! receives only it could match fail, naming it; a send to it fails too.

mod inbound;
mod matching;
mod message;

pub use matching::Tag;

use std::any::Any;
use std::collections::HashMap;
use std::io::{self, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::protocol::auth::{self, Secret};
use crate::protocol::{encode_frame, read_message, Header, MsgType};
use crate::transport::{
    connect_authenticated, join_host_port, tune_data_socket, DeadlineReader, SealedReader, SealedWriter,
};
use matching::{Matcher, Message, Posted};
use message::FRAME_BYTES;

/// Bytes one peer may have waiting unreceived before its reader pauses
/// (a pipeline's activations for a few micro-batches fit).
pub const BUFFER_BYTES: usize = 256 << 20;
/// The largest hello (a group's name).
const MAX_HELLO: u32 = 4096;
/// The most connections in their handshake at once.
const MAX_GREETING: usize = 64;
/// The most a stranger's handshake and hello may take.
const HELLO_WITHIN: Duration = Duration::from_secs(30);

/// One group's point-to-point links, as its member `rank` sees them.
#[derive(Clone, Debug)]
pub struct PeerConfig {
    pub rank: u32,
    pub size: u32,
    /// The group's name: a connection for another group is refused.
    pub group: String,
    pub namespace: u32,
    pub secret: Secret,
    /// The address to listen on and to give the others (not 0.0.0.0).
    pub host: String,
    /// How long a connection, or a send held back by its receiver, may take.
    pub timeout: Duration,
    /// Bytes one peer may have waiting unreceived before its reader pauses.
    pub buffer_bytes: usize,
}

/// A posted receive: where the message goes, what keeps that memory alive,
/// and whom to tell (the sender's rank, or why it failed).
pub struct Receive {
    ptr: usize,
    len: usize,
    _keep: Box<dyn Any + Send>,
    done: Box<dyn FnOnce(Result<u32, String>) + Send>,
}

impl Receive {
    /// # Safety
    /// `ptr..ptr + len` must be writable, and stay valid and unused by
    /// anyone else while `keep` lives (the receive holds it until done).
    pub unsafe fn new(
        ptr: *mut u8,
        len: usize,
        keep: Box<dyn Any + Send>,
        done: Box<dyn FnOnce(Result<u32, String>) + Send>,
    ) -> Receive {
        Receive { ptr: ptr as usize, len, _keep: keep, done }
    }

    fn deliver(self, msg: Message) {
        if msg.data.len() != self.len {
            let why = wrong_size(msg.src, msg.data.len(), msg.tag, self.len);
            return (self.done)(Err(why));
        }
        // SAFETY: `new`'s contract; the length was checked just above.
        unsafe { std::ptr::copy_nonoverlapping(msg.data.as_ptr(), self.ptr as *mut u8, self.len) };
        (self.done)(Ok(msg.src))
    }

    fn fail(self, why: String) {
        (self.done)(Err(why))
    }

    /// Filled in place (`window`) with a whole message from member `src`.
    fn complete(self, src: u32) {
        (self.done)(Ok(src))
    }

    /// Its bytes `at..at + len` (within its length), to land a payload in.
    fn window(&mut self, at: usize, len: usize) -> Option<&mut [u8]> {
        if at.checked_add(len)? > self.len {
            return None;
        }
        // SAFETY: `new`'s contract, and the range is within the buffer.
        Some(unsafe { std::slice::from_raw_parts_mut((self.ptr as *mut u8).add(at), len) })
    }
}

fn wrong_size(src: u32, got: usize, tag: Tag, want: usize) -> String {
    format!("member {src} sent a message of {got} bytes (tag {tag}) to a receive of {want} bytes")
}

/// A connection to one peer's listener, made at the first send to it.
#[derive(Default)]
struct Outbound {
    conn: Option<(SealedWriter<TcpStream>, bool)>,
    seq: u32,
    broken: Option<String>,
}

struct Links {
    cfg: PeerConfig,
    addr: String,
    matcher: Mutex<Matcher<Receive>>,
    /// A paused reader waits here for its peer's backlog to shrink.
    room: Condvar,
    out: Mutex<HashMap<u32, Arc<Mutex<Outbound>>>>,
    /// The connected peers' sockets, to end their readers on close.
    inbound: Mutex<HashMap<u32, TcpStream>>,
    closing: AtomicBool,
    /// Connections in their handshake (each holds a thread for at most
    /// `HELLO_WITHIN`): past `MAX_GREETING`, new ones are closed at once.
    greeting: AtomicUsize,
}

/// A group member's point-to-point endpoint.
pub struct PeerLinks {
    links: Arc<Links>,
    accept: Mutex<Option<JoinHandle<()>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl PeerLinks {
    /// Listen on `cfg.host` (a port of the system's choosing).
    pub fn open(cfg: PeerConfig) -> io::Result<PeerLinks> {
        let listener = TcpListener::bind((cfg.host.as_str(), 0))?;
        let addr = join_host_port(&cfg.host, listener.local_addr()?.port());
        let links = Arc::new(Links {
            cfg,
            addr,
            matcher: Mutex::new(Matcher::default()),
            room: Condvar::new(),
            out: Mutex::new(HashMap::new()),
            inbound: Mutex::new(HashMap::new()),
            closing: AtomicBool::new(false),
            greeting: AtomicUsize::new(0),
        });
        let l = links.clone();
        let accept = std::thread::Builder::new().name("gradhub-p2p-accept".into()).spawn(move || l.accept(listener))?;
        Ok(PeerLinks { links, accept: Mutex::new(Some(accept)) })
    }

    /// Where the others reach this member (`host:port`).
    pub fn address(&self) -> &str {
        &self.links.addr
    }

    /// Send `data` to member `dst`, whose listener is at `addr`, with
    /// `tag`; blocks until it is written to the connection (made at the
    /// first send). Sends to one member go one at a time, in call order.
    pub fn send(&self, dst: u32, addr: &str, tag: Tag, data: &[u8]) -> Result<(), String> {
        self.links.send(dst, addr, tag, data)
    }

    /// Post a receive from `src` (None: any member) with `tag`: `recv` is
    /// filled and told when a message matches, or told why none will. The
    /// ticket to cancel it by, if it waits.
    pub fn post(&self, src: Option<u32>, tag: Tag, recv: Receive) -> Option<u64> {
        self.links.post(src, tag, recv)
    }

    /// Withdraw a waiting receive (its caller gave up on it): true if it
    /// was still waiting; it is then neither filled nor told.
    pub fn cancel(&self, ticket: u64) -> bool {
        let gone = lock(&self.links.matcher).cancel(ticket);
        gone.is_some()
    }

    /// Stop listening, end every connection and fail every waiting
    /// receive (why).
    pub fn close(&self, why: &str) {
        let l = &self.links;
        if l.closing.swap(true, Ordering::SeqCst) {
            return;
        }
        // Wake the accepting thread with a connection of our own.
        let _ = TcpStream::connect_timeout(
            &match crate::transport::resolve(&l.addr) {
                Ok(a) => a,
                Err(_) => return,
            },
            Duration::from_secs(1),
        );
        if let Some(t) = lock(&self.accept).take() {
            let _ = t.join();
        }
        for s in lock(&l.inbound).values() {
            let _ = s.shutdown(Shutdown::Both);
        }
        for o in lock(&l.out).values() {
            if let Some((w, _)) = &lock(o).conn {
                let _ = w.get_ref().shutdown(Shutdown::Both);
            }
        }
        let failed = lock(&l.matcher).close(why.to_string());
        l.room.notify_all();
        for (_, r, why) in failed {
            r.fail(why);
        }
    }
}

impl Drop for PeerLinks {
    fn drop(&mut self) {
        self.close("the group's point-to-point links were closed");
    }
}

impl Links {
    fn hello(&self) -> Vec<u8> {
        let mut h = Header::new(MsgType::PeerHello);
        h.namespace = self.cfg.namespace;
        h.key = self.cfg.rank;
        h.payload_len = self.cfg.group.len() as u32;
        encode_frame(&h, self.cfg.group.as_bytes())
    }

    fn refusal(&self, why: &str) -> Vec<u8> {
        let mut h = Header::new(MsgType::Error);
        h.namespace = self.cfg.namespace;
        h.payload_len = why.len() as u32;
        encode_frame(&h, why.as_bytes())
    }

    /// Whether a hello is one from member `from` of this group (else why not).
    fn check_hello(&self, h: &Header, payload: &[u8], from: Option<u32>) -> Result<u32, String> {
        if h.msg_type == MsgType::Error {
            return Err(format!("refused: {}", String::from_utf8_lossy(payload)));
        }
        if h.msg_type != MsgType::PeerHello {
            return Err(format!("a {:?} frame instead of a point-to-point hello", h.msg_type));
        }
        if payload != self.cfg.group.as_bytes() {
            return Err(format!(
                "the hello is for group {:?}, not this member's group {:?}",
                String::from_utf8_lossy(payload),
                self.cfg.group
            ));
        }
        match from {
            Some(want) if h.key != want => Err(format!("member {} answered where member {want} was expected", h.key)),
            _ if h.key >= self.cfg.size || h.key == self.cfg.rank => {
                Err(format!("member {} in a group of {} (this is member {})", h.key, self.cfg.size, self.cfg.rank))
            }
            _ => Ok(h.key),
        }
    }

    fn accept(self: Arc<Self>, listener: TcpListener) {
        for stream in listener.incoming() {
            if self.closing.load(Ordering::SeqCst) {
                return;
            }
            match stream {
                Ok(s) => {
                    if self.greeting.fetch_add(1, Ordering::SeqCst) >= MAX_GREETING {
                        self.greeting.fetch_sub(1, Ordering::SeqCst);
                        log::warn!(target: "p2p", "closing a connection from {:?}: {MAX_GREETING} others are in their handshake", s.peer_addr());
                        continue;
                    }
                    let l = self.clone();
                    let spawned = std::thread::Builder::new().name("gradhub-p2p-in".into()).spawn(move || l.serve(s));
                    if let Err(e) = spawned {
                        self.greeting.fetch_sub(1, Ordering::SeqCst);
                        log::warn!(target: "p2p", "cannot start a thread for a new connection: {e}");
                    }
                }
                Err(e) => {
                    log::warn!(target: "p2p", "accepting on {}: {e}", self.addr);
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
    }

    fn post(&self, src: Option<u32>, tag: Tag, recv: Receive) -> Option<u64> {
        if let Some(s) = src.filter(|&s| s >= self.cfg.size || s == self.cfg.rank) {
            recv.fail(format!(
                "a receive from member {s} in a group of {} (this is member {})",
                self.cfg.size, self.cfg.rank
            ));
            return None;
        }
        let posted = lock(&self.matcher).post(src, tag, recv);
        match posted {
            Posted::Waiting(t) => Some(t),
            Posted::Matched(r, msg) => {
                self.room.notify_all();
                r.deliver(msg);
                None
            }
            Posted::Failed(r, why) => {
                r.fail(why);
                None
            }
        }
    }

    fn send(&self, dst: u32, addr: &str, tag: Tag, data: &[u8]) -> Result<(), String> {
        let (rank, size) = (self.cfg.rank, self.cfg.size);
        if dst >= size || dst == rank {
            return Err(format!("a send to member {dst} in a group of {size} (this is member {rank})"));
        }
        if !message::fits(data.len()) {
            return Err(format!(
                "a message of {} bytes (at most {} fit one message)",
                data.len(),
                message::MAX_FRAMES as usize * FRAME_BYTES
            ));
        }
        let out = lock(&self.out).entry(dst).or_default().clone();
        let mut out = lock(&out);
        if self.closing.load(Ordering::SeqCst) {
            return Err("the group's point-to-point links were closed".into());
        }
        if let Some(why) = &out.broken {
            return Err(why.clone());
        }
        if out.conn.is_none() {
            match self.dial(dst, addr) {
                Ok(c) => out.conn = Some(c),
                Err(why) => {
                    let why = format!("cannot reach member {dst} ({addr}): {why}");
                    out.broken = Some(why.clone());
                    return Err(why);
                }
            }
        }
        let seq = out.seq;
        let ns = self.cfg.namespace;
        let Some((w, sealed)) = out.conn.as_mut() else { return Err("internal: no connection".into()) };
        let written = message::frames(ns, seq, tag, data).try_for_each(|(h, part)| {
            if *sealed {
                w.write_all(&encode_frame(&h, part))
            } else {
                w.write_all(&h.encode(part))?;
                w.write_all(part)
            }
        });
        match written {
            Ok(()) => {
                out.seq = seq.wrapping_add(1);
                Ok(())
            }
            Err(e) => {
                let why = match e.kind() {
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => format!(
                        "member {dst} ({addr}) took nothing for {:.0} s (the group's timeout): it is not receiving",
                        self.cfg.timeout.as_secs_f64()
                    ),
                    _ => format!("the connection to member {dst} ({addr}) failed: {e}"),
                };
                if let Some((w, _)) = out.conn.take() {
                    let _ = w.get_ref().shutdown(Shutdown::Both);
                }
                out.broken = Some(why.clone());
                Err(why)
            }
        }
    }

    /// Connect to member `dst`'s listener, authenticate, and exchange hellos.
    fn dial(&self, dst: u32, addr: &str) -> Result<(SealedWriter<TcpStream>, bool), String> {
        let authed = connect_authenticated(addr, self.cfg.timeout, &self.cfg.secret).map_err(|e| e.to_string())?;
        let (stream, seal, open) = authed.into_parts();
        let sealed = seal.is_some();
        let within = self.cfg.timeout.min(HELLO_WITHIN);
        let _ = stream.set_write_timeout(Some(within));
        let mut w = SealedWriter::new(stream.try_clone().map_err(|e| e.to_string())?, seal);
        w.write_all(&self.hello()).map_err(|e| format!("sending the hello: {e}"))?;
        let mut r = SealedReader::new(DeadlineReader::new(&stream, within), open).limit(MAX_HELLO);
        let (h, p) =
            read_message(&mut r, Some(self.cfg.namespace), MAX_HELLO).map_err(|e| format!("its hello: {e}"))?;
        self.check_hello(&h, &p, Some(dst))?;
        let _ = stream.set_read_timeout(None);
        let _ = stream.set_write_timeout(Some(self.cfg.timeout));
        tune_data_socket(&stream);
        Ok((w, sealed))
    }
}

#[cfg(test)]
mod tests;
