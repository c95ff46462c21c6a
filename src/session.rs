//! A member's session with the job's scheduler, the same for workers and
//! servers: connect (retrying while the scheduler starts), Register, Welcome,
//! heartbeats from a thread of their own (so slow work never looks like
//! death), and reading the scheduler's messages under the job's peer
//! timeout, which the scheduler tells every member in Welcome: a scheduler
//! silent for that long is reported as lost, whatever the member's role.

use std::io::Write;
use std::net::{IpAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{bounded, RecvTimeoutError, Sender};

use crate::protocol::auth::Secret;
use crate::protocol::{read_control, write_control, Control, MsgType, ReadError, Register, Welcome};
use crate::transport::connect_authenticated;

#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("cannot reach the scheduler at {addr}: {source}")]
    Connect { addr: String, source: std::io::Error },
    #[error("rejected by the scheduler: {0}")]
    Rejected(String),
    #[error("no welcome from the scheduler: {0}")]
    NoWelcome(String),
    #[error("the scheduler sent nothing for {0:.1}s (no heartbeat)")]
    Silent(f64),
    #[error("lost the connection to the scheduler: it closed the connection")]
    Closed,
    #[error("lost the connection to the scheduler: {0}")]
    Lost(ReadError),
    #[error("cannot write to the scheduler: {0}{hint}", hint = closed_hint(.0))]
    Send(std::io::Error),
    #[error("session setup failed: {0}")]
    Setup(std::io::Error),
}

/// Why a scheduler may have closed the connection, for a member that finds
/// it closed when it writes (typically after being frozen).
fn closed_hint(e: &std::io::Error) -> &'static str {
    match e.kind() {
        std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset => {
            " (the scheduler closed the connection: the job is over, or it wrote this member off after hearing \
             nothing from it for the peer timeout)"
        }
        _ => "",
    }
}

/// Connected to the scheduler, not registered yet.
pub struct Joining {
    stream: TcpStream,
    namespace: u32,
}

impl Joining {
    pub fn connect(
        scheduler: &str,
        timeout: Duration,
        namespace: u32,
        secret: &Secret,
    ) -> Result<Joining, SessionError> {
        let stream = connect_authenticated(scheduler, timeout, secret)
            .map_err(|source| SessionError::Connect { addr: scheduler.to_string(), source })?;
        Ok(Joining { stream, namespace })
    }

    /// The local address of the connection: the interface that reaches the
    /// scheduler, which a server advertises by default.
    pub fn local_ip(&self) -> Result<IpAddr, SessionError> {
        self.stream.local_addr().map(|a| a.ip()).map_err(SessionError::Setup)
    }

    /// Register and wait for the Welcome (every member of the job must have
    /// registered by then); starts the heartbeats.
    pub fn register(mut self, reg: Register) -> Result<Session, SessionError> {
        let ns = self.namespace;
        write_control(&mut self.stream, &Control::Register(reg), ns).map_err(SessionError::Send)?;
        let welcome = match read_control(&mut self.stream, ns) {
            Ok(Control::Welcome(w)) => w,
            Ok(Control::Error { message }) => return Err(SessionError::Rejected(message)),
            Ok(other) => return Err(SessionError::NoWelcome(format!("got {:?} instead", other.msg_type()))),
            Err(e) => return Err(SessionError::NoWelcome(e.to_string())),
        };
        let peer_timeout = Duration::from_millis(welcome.peer_timeout_ms.max(1) as u64);
        self.stream.set_read_timeout(Some(peer_timeout)).map_err(SessionError::Setup)?;
        // A scheduler that stops reading must not hang a heartbeat or a goodbye.
        self.stream.set_write_timeout(Some(peer_timeout)).map_err(SessionError::Setup)?;
        let writer = self.stream.try_clone().map_err(SessionError::Setup)?;
        let (stop_tx, stop_rx) = bounded::<()>(0);
        let link = Arc::new(Link {
            writer: Mutex::new(writer),
            later: Mutex::new(Vec::new()),
            namespace: ns,
            closing: AtomicBool::new(false),
            stop: Mutex::new(Some(stop_tx)),
        });
        let period = Duration::from_millis(welcome.heartbeat_ms.max(10) as u64);
        let hb = {
            let link = link.clone();
            std::thread::Builder::new()
                .name("gradhub-heartbeat".into())
                .spawn(move || loop {
                    if link.send(&Control::Heartbeat).is_err() {
                        return;
                    }
                    // Wakes at once when the session closes (the sender is dropped).
                    match stop_rx.recv_timeout(period) {
                        Err(RecvTimeoutError::Timeout) => {}
                        _ => return,
                    }
                })
                .map_err(SessionError::Setup)?
        };
        Ok(Session { welcome, link, reader: self.stream, peer_timeout, heartbeat: Some(hb), close_on_drop: true })
    }
}

/// Bytes of deferred messages (`send_later`) sent at once, without waiting
/// for the next message.
const SEND_LATER_BYTES: usize = 16 << 10;

struct Link {
    writer: Mutex<TcpStream>,
    /// Encoded messages that may wait (`send_later`): written in front of
    /// the next message, in the same write. Locked inside `writer`.
    later: Mutex<Vec<u8>>,
    namespace: u32,
    closing: AtomicBool,
    /// Dropped to stop the heartbeat thread.
    stop: Mutex<Option<Sender<()>>>,
}

impl Link {
    fn send(&self, msg: &Control) -> Result<(), SessionError> {
        let mut w = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        let mut buf = std::mem::take(&mut *self.later.lock().unwrap_or_else(|e| e.into_inner()));
        if buf.is_empty() {
            return write_control(&mut *w, msg, self.namespace).map_err(SessionError::Send);
        }
        buf.extend_from_slice(&msg.encode(self.namespace));
        w.write_all(&buf).map_err(SessionError::Send)
    }
}

/// Sends to the scheduler from any thread.
#[derive(Clone)]
pub struct SessionSender(Arc<Link>);

impl SessionSender {
    pub fn send(&self, msg: &Control) -> Result<(), SessionError> {
        self.0.send(msg)
    }

    /// Send `msg` with the next message (at the latest with the next
    /// heartbeat), in order: one write and one wake-up of the scheduler for
    /// both. For messages nobody waits for, e.g. `Release`.
    pub fn send_later(&self, msg: &Control) -> Result<(), SessionError> {
        let full = {
            let mut later = self.0.later.lock().unwrap_or_else(|e| e.into_inner());
            later.extend_from_slice(&msg.encode(self.0.namespace));
            later.len() >= SEND_LATER_BYTES
        };
        match full {
            true => self.0.send(&Control::Heartbeat),
            false => Ok(()),
        }
    }

    /// Say goodbye (workers) and close: stops the heartbeats and makes a
    /// pending `recv` return. Safe to call more than once.
    pub fn close(&self, goodbye: bool) {
        if self.0.closing.swap(true, Ordering::SeqCst) {
            return;
        }
        if goodbye {
            let _ = self.0.send(&Control::Goodbye);
        }
        self.0.stop.lock().unwrap_or_else(|e| e.into_inner()).take();
        let w = self.0.writer.lock().unwrap_or_else(|e| e.into_inner());
        if goodbye {
            // Bytes left unread when the socket closes make the kernel reset
            // the connection, and a reset can discard the goodbye before the
            // scheduler read it: read to the end (the scheduler closes its
            // side on the goodbye), for a bounded time.
            let _ = w.shutdown(std::net::Shutdown::Write);
            drain(&w, Duration::from_millis(500));
        }
        let _ = w.shutdown(std::net::Shutdown::Both);
    }

    pub fn closing(&self) -> bool {
        self.0.closing.load(Ordering::SeqCst)
    }
}

/// Read and drop whatever arrives on `s` until its end, an error, or `limit`.
fn drain(s: &TcpStream, limit: Duration) {
    let deadline = std::time::Instant::now() + limit;
    let mut buf = [0u8; 4096];
    let mut r = s;
    while let Some(left) = deadline.checked_duration_since(std::time::Instant::now()).filter(|d| !d.is_zero()) {
        if s.set_read_timeout(Some(left)).is_err() {
            return;
        }
        match std::io::Read::read(&mut r, &mut buf) {
            Ok(n) if n > 0 => {}
            _ => return,
        }
    }
}

/// A registered member's session; `recv` is for one thread (the member's
/// control loop), `sender()` for everyone.
pub struct Session {
    pub welcome: Welcome,
    link: Arc<Link>,
    reader: TcpStream,
    peer_timeout: Duration,
    heartbeat: Option<JoinHandle<()>>,
    /// Dropping the session closes it (without a goodbye), unless its
    /// owner closes it itself (`keep_open`).
    close_on_drop: bool,
}

impl Session {
    pub fn sender(&self) -> SessionSender {
        SessionSender(self.link.clone())
    }

    pub fn peer_timeout(&self) -> Duration {
        self.peer_timeout
    }

    /// The reader is done, but whoever holds a sender closes the session
    /// (e.g. with a goodbye): dropping this one must not close it first.
    /// The drop then waits for that close (it joins the heartbeat thread).
    pub fn keep_open(&mut self) {
        self.close_on_drop = false;
    }

    /// The scheduler's next message other than a heartbeat. A scheduler
    /// silent for the peer timeout is an error, as is a closed connection.
    pub fn recv(&mut self) -> Result<Control, SessionError> {
        loop {
            match read_control(&mut self.reader, self.link.namespace) {
                Ok(Control::Heartbeat) => {}
                Ok(msg) => return Ok(msg),
                Err(ReadError::TimedOut) => return Err(SessionError::Silent(self.peer_timeout.as_secs_f64())),
                Err(ReadError::Closed | ReadError::ClosedMidFrame) => return Err(SessionError::Closed),
                Err(e) => return Err(SessionError::Lost(e)),
            }
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if self.close_on_drop {
            self.sender().close(false);
        }
        if let Some(h) = self.heartbeat.take() {
            let _ = h.join();
        }
    }
}

/// Name of a message type for "unexpected X" reports.
pub fn unexpected(msg: &Control) -> String {
    let t: MsgType = msg.msg_type();
    format!("unexpected {t:?} from the scheduler")
}
