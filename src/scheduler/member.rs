//! A member of the job as the scheduler holds it: its role, rank, address
//! and the writing half of its control connection (the one state type
//! every other scheduler module shares), and how its session resumes on a
//! new connection after the old one broke (`Member::resume`).

use std::io::Write;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use crate::protocol::{write_control, Control, Role};
use crate::transport::replay::{counted, Replay};
use crate::transport::{SealedReader, SealedWriter};

/// The reading half of a member's control connection (opened if the job
/// encrypts).
pub(super) type Reader = SealedReader<TcpStream>;

struct Inner {
    w: SealedWriter<TcpStream>,
    /// What went to the member since its Welcome, for a resume.
    replay: Replay,
}

/// The writing half, shared by whoever may write to it (its registration,
/// then its member): one sealer, so frames are sealed in the order they go.
#[derive(Clone)]
pub(super) struct Writer(Arc<Mutex<Inner>>);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Writer {
    pub fn new(w: SealedWriter<TcpStream>) -> Writer {
        Writer(Arc::new(Mutex::new(Inner { w, replay: Replay::new() })))
    }
    pub fn send(&self, msg: &Control, ns: u32) -> bool {
        self.send_all(std::slice::from_ref(msg), ns)
    }
    /// Several messages in one write (one wake-up of the member), each
    /// kept for a resume until the member acknowledges it.
    pub fn send_all(&self, msgs: &[Control], ns: u32) -> bool {
        let mut inner = lock(&self.0);
        if let [msg] = msgs {
            if !counted(msg) {
                return write_control(&mut inner.w, msg, ns).is_ok();
            }
        }
        let mut buf = Vec::new();
        for m in msgs {
            let encoded = m.encode(ns);
            buf.extend_from_slice(&encoded);
            if counted(m) {
                inner.replay.push(encoded);
            }
        }
        inner.w.write_all(&buf).is_ok()
    }
    /// The member has received `received` of them.
    fn acked(&self, received: u64) {
        lock(&self.0).replay.acked(received);
    }
    pub fn shutdown(&self, how: Shutdown) {
        let _ = lock(&self.0).w.get_ref().shutdown(how);
    }
    /// Another handle to the socket, to watch it (never to write: frames
    /// would go unsealed).
    pub fn socket(&self) -> std::io::Result<TcpStream> {
        lock(&self.0).w.get_ref().try_clone()
    }
}

/// A new connection of a member whose session broke, waiting for the
/// member's thread to take it (`Member::offer`).
pub(super) struct Comeback {
    pub reader: Reader,
    pub writer: Writer,
    /// Messages the member received from the scheduler in its session.
    pub received: u64,
}

pub(super) struct Member {
    pub role: Role,
    pub rank: u32,
    pub peer: SocketAddr,
    writer: Writer,
    /// Messages read from the member in its session (heartbeats aside).
    received: AtomicU64,
    /// When the member was last heard from (anything).
    heard: Mutex<Instant>,
    comeback: Mutex<Option<Comeback>>,
    back: Condvar,
}

impl Member {
    pub fn new(role: Role, rank: u32, peer: SocketAddr, stream: Writer) -> Member {
        Member {
            role,
            rank,
            peer,
            writer: stream,
            received: AtomicU64::new(0),
            heard: Mutex::new(Instant::now()),
            comeback: Mutex::new(None),
            back: Condvar::new(),
        }
    }
    pub fn send(&self, msg: &Control, ns: u32) -> bool {
        self.writer.send(msg, ns)
    }
    /// Several messages in one write (one wake-up of the member).
    pub fn send_all(&self, msgs: &[Control], ns: u32) -> bool {
        self.writer.send_all(msgs, ns)
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

    /// A message read from the member (by its thread only): counted, and
    /// an `Ack` frees what it acknowledges.
    pub fn heard(&self, msg: &Control) {
        *lock(&self.heard) = Instant::now();
        match msg {
            Control::Ack { received } => self.writer.acked(*received),
            m if counted(m) => {
                self.received.fetch_add(1, Ordering::SeqCst);
            }
            _ => {}
        }
    }
    /// What the member is told in each heartbeat: how much of its session
    /// arrived.
    pub fn ack(&self) -> Control {
        Control::Ack { received: self.received.load(Ordering::SeqCst) }
    }
    pub fn heard_at(&self) -> Instant {
        *lock(&self.heard)
    }

    /// The member dialled again (its connection broke) while this
    /// scheduler lives: its thread takes the new connection (`resume`).
    /// The old one is shut, so a thread still reading it stops.
    pub fn offer(&self, comeback: Comeback) {
        // Shut before the offer is seen: once the thread took it, the
        // writer is the new connection's.
        let mut slot = lock(&self.comeback);
        self.writer.shutdown(Shutdown::Both);
        let old = slot.replace(comeback);
        self.back.notify_all();
        drop(slot);
        drop(old);
    }

    /// A new connection offered by then, if any (the member's thread).
    pub fn wait_comeback(&self, until: Instant) -> Option<Comeback> {
        let mut slot = lock(&self.comeback);
        loop {
            if let Some(c) = slot.take() {
                return Some(c);
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            slot = self.back.wait_timeout(slot, left).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// Resume the session on `c` (by the member's thread, which counts
    /// what it read): the member is told how much arrived, then sent again
    /// what it missed; then everyone writes to the new connection. Err: the
    /// messages it missed were not kept (it is lost).
    pub fn resume(&self, c: Comeback, ns: u32) -> Result<Reader, String> {
        let mut mine = lock(&self.writer.0);
        let Some(missed) = mine.replay.after(c.received) else {
            let why = format!(
                "{} came back having received {} of the scheduler's {} messages, and the ones it missed were not kept",
                self.describe(),
                c.received,
                mine.replay.sent()
            );
            c.writer.send(&Control::Error { message: why.clone() }, ns);
            return Err(why);
        };
        {
            let mut new = lock(&c.writer.0);
            std::mem::swap(&mut mine.w, &mut new.w);
        }
        mine.replay.acked(c.received);
        let resumed = Control::Resumed { received: self.received.load(Ordering::SeqCst) };
        let mut buf = resumed.encode(ns);
        buf.extend(missed.concat());
        if let Err(e) = mine.w.write_all(&buf) {
            log::warn!(target: "scheduler", "resuming {}: {e}", self.describe());
        }
        drop(mine);
        // The old connection (now in the offer's writer) goes with it.
        c.writer.shutdown(Shutdown::Both);
        *lock(&self.heard) = Instant::now();
        Ok(c.reader)
    }

    /// An offer nobody will take (the member was written off meanwhile):
    /// told why.
    pub fn refuse_comeback(&self, why: &str, ns: u32) {
        if let Some(c) = lock(&self.comeback).take() {
            c.writer.send(&Control::Error { message: why.to_string() }, ns);
            c.writer.shutdown(Shutdown::Both);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::{SocketAddr, TcpListener, TcpStream};

    use super::{Comeback, Member, Writer};
    use crate::protocol::{read_control, Control, Role};
    use crate::transport::{SealedReader, SealedWriter};

    /// Both ends of a loopback connection: (the scheduler's, the member's).
    fn connection() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let member = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        (l.accept().unwrap().0, member)
    }

    fn comeback(received: u64) -> (Comeback, SealedReader<TcpStream>) {
        let (sched, member) = connection();
        let reader = SealedReader::new(sched.try_clone().unwrap(), None);
        let writer = Writer::new(SealedWriter::new(sched, None));
        (Comeback { reader, writer, received }, SealedReader::new(member, None))
    }

    #[test]
    fn a_member_back_with_a_count_the_scheduler_cannot_answer_is_refused_and_one_it_can_is_resumed() {
        let (sched, _old) = connection();
        let peer: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let me = Member::new(Role::Worker, 1, peer, Writer::new(SealedWriter::new(sched, None)));
        assert!(me.send(&Control::PeerLeft { rank: 3 }, 0) && me.send(&Control::BarrierDone { id: 7 }, 0));
        // It says it received more than was ever sent: refused, and told why.
        let (c, mut member) = comeback(5);
        let Err(why) = me.resume(c, 0) else { panic!("resumed with a count past what was sent") };
        assert!(why.contains("received 5 of the scheduler's 2 messages"), "{why}");
        assert!(matches!(read_control(&mut member, 0), Ok(Control::Error { message }) if message == why));
        // It received the first: it is told what arrived of its own and sent the second again.
        let (c, mut member) = comeback(1);
        assert!(me.resume(c, 0).is_ok());
        assert!(matches!(read_control(&mut member, 0), Ok(Control::Resumed { received: 0 })));
        assert!(matches!(read_control(&mut member, 0), Ok(Control::BarrierDone { id: 7 })));
        // What is sent now goes to the new connection.
        assert!(me.send(&Control::Shutdown, 0));
        assert!(matches!(read_control(&mut member, 0), Ok(Control::Shutdown)));
    }
}
