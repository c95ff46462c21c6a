//! A member's session with the job's scheduler, the same for workers and
//! servers: connect (retrying while the scheduler starts), Register, Welcome,
//! heartbeats from a thread of their own (so slow work never looks like
//! death), and reading the scheduler's messages under the job's peer
//! timeout, which the scheduler tells every member in Welcome.
//!
//! A scheduler lost (its connection closed, or silent past the
//! keep-alive) is dialled again for up to the peer timeout: a scheduler that
//! restarted on the same address is sent a `Rejoin` (what the member's
//! owner reports, `Session::on_rejoin`), and the session goes on. Meanwhile
//! the data plane trains; what is sent to the scheduler waits (a request
//! not answered yet, Declare or Barrier, is sent again); one that does not
//! come back is reported as lost, whatever the member's role.
//!
//! A scheduler that did not restart answers the Rejoin with `Resumed`: the
//! connection had broken (reset, cut mid-frame, a frame changed on the
//! way, or silent past the keep-alive while both ends live: `keep_alive`).
//! Each side numbers what it sends in the session and keeps it until the
//! other's `Ack` heartbeat says it arrived (`transport::replay`); on a
//! resume each sends again what the other had not received, so nothing is
//! lost or taken twice.

use std::io::Write;
use std::net::{IpAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, RecvTimeoutError, Sender};

use crate::protocol::auth::Secret;
use crate::protocol::{
    read_control, write_control, Control, MsgType, ReadError, Register, Rejoin, TensorSpec, Welcome,
};
use crate::transport::replay::{counted, Replay};
use crate::transport::{connect_authenticated, dial_until, Authed, Greeted, SealedReader, SealedWriter};

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
    #[error("lost the scheduler at {addr} ({why}) and it did not come back within {secs:.1}s (the peer timeout)")]
    NotBack { addr: String, why: String, secs: f64 },
    #[error("the scheduler at {addr} came back but refused this member: {why}")]
    RefusedBack { addr: String, why: String },
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
    reader: Reader,
    writer: Writer,
    namespace: u32,
    addr: String,
    secret: Secret,
}

/// What a member knows, for a scheduler that restarted (`Rejoin`).
#[derive(Default)]
pub struct Report {
    pub specs: Vec<TensorSpec>,
    pub keys: Vec<u32>,
    pub left: Vec<u32>,
    pub lost: Vec<u32>,
    pub barriers: u32,
}

type Reporter = Box<dyn Fn() -> Report + Send + Sync>;

/// How a member comes back to a scheduler that restarted.
struct Comeback {
    addr: String,
    secret: Secret,
    register: Register,
    report: Mutex<Option<Reporter>>,
}

impl Joining {
    pub fn connect(
        scheduler: &str,
        timeout: Duration,
        namespace: u32,
        secret: &Secret,
    ) -> Result<Joining, SessionError> {
        let (reader, writer) = connect_authenticated(scheduler, timeout, secret)
            .and_then(Authed::split)
            .map_err(|source| SessionError::Connect { addr: scheduler.to_string(), source })?;
        Ok(Joining { reader, writer, namespace, addr: scheduler.to_string(), secret: secret.clone() })
    }

    /// The local address of the connection: the interface that reaches the
    /// scheduler, which a server advertises by default.
    pub fn local_ip(&self) -> Result<IpAddr, SessionError> {
        self.writer.get_ref().local_addr().map(|a| a.ip()).map_err(SessionError::Setup)
    }

    /// Register and wait for the Welcome (every member of the job must have
    /// registered by then); starts the heartbeats.
    pub fn register(mut self, reg: Register) -> Result<Session, SessionError> {
        let ns = self.namespace;
        write_control(&mut self.writer, &Control::Register(reg.clone()), ns).map_err(SessionError::Send)?;
        let welcome = match read_control(&mut self.reader, ns) {
            Ok(Control::Welcome(w)) => w,
            Ok(Control::Error { message }) => return Err(SessionError::Rejected(message)),
            Ok(other) => return Err(SessionError::NoWelcome(format!("got {:?} instead", other.msg_type()))),
            Err(e) => return Err(SessionError::NoWelcome(e.to_string())),
        };
        let peer_timeout = Duration::from_millis(welcome.peer_timeout_ms.max(1) as u64);
        timed(self.writer.get_ref(), keep_alive(peer_timeout), peer_timeout)?;
        let (stop_tx, stop_rx) = bounded::<()>(0);
        let link = Arc::new(Link {
            writer: Mutex::new(self.writer),
            later: Mutex::new(Later::default()),
            replay: Mutex::new(Replay::new()),
            received: AtomicU64::new(0),
            failed_from: Mutex::new(None),
            namespace: ns,
            closing: AtomicBool::new(false),
            stop: Mutex::new(Some(stop_tx)),
            asked: Mutex::new(Vec::new()),
            away: Mutex::new(None),
            back: Condvar::new(),
            peer_timeout,
            gone: AtomicBool::new(false),
        });
        let comeback = Comeback { addr: self.addr, secret: self.secret, register: reg, report: Mutex::new(None) };
        let period = Duration::from_millis(welcome.heartbeat_ms.max(10) as u64);
        let hb = {
            let link = link.clone();
            std::thread::Builder::new()
                .name("gradhub-heartbeat".into())
                .spawn(move || loop {
                    if link.send(&link.ack()).is_err() {
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
        Ok(Session {
            welcome,
            link,
            reader: self.reader,
            peer_timeout,
            heard: Instant::now(),
            heartbeat: Some(hb),
            close_on_drop: true,
            comeback,
        })
    }
}

/// The halves of the connection to the scheduler (sealed if the job
/// encrypts).
type Reader = SealedReader<TcpStream>;
type Writer = SealedWriter<TcpStream>;

/// A bound on both directions of a scheduler connection (a scheduler
/// that stops reading must not hang a heartbeat or a goodbye).
fn timed(stream: &TcpStream, read: Duration, write: Duration) -> Result<(), SessionError> {
    stream.set_read_timeout(Some(read)).map_err(SessionError::Setup)?;
    stream.set_write_timeout(Some(write)).map_err(SessionError::Setup)
}

/// How long a control connection may be silent (no heartbeat either way:
/// both send one each heartbeat period, at most a quarter of the peer
/// timeout) before a side takes it for broken and it is made again: half
/// the peer timeout, so the new one is there before the other side's peer
/// timeout writes this one off. The scheduler's side shuts it and waits
/// for the member to dial again (`scheduler::job::serve_member`).
pub fn keep_alive(peer_timeout: Duration) -> Duration {
    peer_timeout / 2
}

/// Bytes that may wait for a scheduler that is away (messages nobody
/// waits for; requests wait in `Link::asked`).
const AWAY_BYTES: usize = 16 << 20;

/// Bytes of deferred messages (`send_later`) sent at once, without waiting
/// for the next message.
const SEND_LATER_BYTES: usize = 16 << 10;

/// Whether `msg` is a request the scheduler answers (kept in
/// `Link::asked` until it does).
fn is_request(msg: &Control) -> bool {
    matches!(msg, Control::Declare { .. } | Control::Barrier { .. })
}

/// Whether an encoded message is a request.
fn frame_is_request(frame: &[u8]) -> bool {
    crate::protocol::Header::decode(frame, u32::MAX)
        .is_ok_and(|h| matches!(h.msg_type, MsgType::Declare | MsgType::Barrier))
}

/// Encoded messages not handed to a connection yet: deferred
/// (`send_later`), or sent while the scheduler is away.
#[derive(Default)]
struct Later {
    /// Each message, and whether it is a request (also in `Link::asked`).
    msgs: Vec<(Vec<u8>, bool)>,
    bytes: usize,
}

impl Later {
    /// Add `msg`; the bytes waiting now.
    fn push(&mut self, msg: &Control, ns: u32) -> usize {
        let frame = msg.encode(ns);
        self.bytes += frame.len();
        self.msgs.push((frame, is_request(msg)));
        self.bytes
    }
    fn take(&mut self) -> Vec<(Vec<u8>, bool)> {
        self.bytes = 0;
        std::mem::take(&mut self.msgs)
    }
}

struct Link {
    writer: Mutex<Writer>,
    /// Messages that wait: written in front of the next message, in the
    /// same write. Locked inside `writer`.
    later: Mutex<Later>,
    /// What this session sent, for a resume. Locked inside `writer`.
    replay: Mutex<Replay>,
    /// Messages (heartbeats aside) read from the scheduler in this session.
    received: AtomicU64,
    /// The number of the first message whose write failed (the scheduler
    /// was lost then): sent again to a scheduler that restarted. Locked
    /// inside `writer`.
    failed_from: Mutex<Option<u64>>,
    namespace: u32,
    closing: AtomicBool,
    /// Dropped to stop the heartbeat thread.
    stop: Mutex<Option<Sender<()>>>,
    /// Requests sent and not answered yet (Declare, Barrier): sent again
    /// to a scheduler that restarted. Locked inside `writer`.
    asked: Mutex<Vec<Control>>,
    /// Since when the scheduler is away (lost, not back yet). Locked
    /// inside `writer`; `back` is signalled when it returns.
    away: Mutex<Option<Instant>>,
    back: Condvar,
    peer_timeout: Duration,
    /// The scheduler was lost and did not come back: nothing waits for it.
    gone: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Link {
    fn send(&self, msg: &Control) -> Result<(), SessionError> {
        let mut w = lock(&self.writer);
        if self.gone.load(Ordering::SeqCst) {
            return Err(SessionError::Send(std::io::Error::other("the scheduler was lost and did not come back")));
        }
        if matches!(msg, Control::Error { .. }) {
            // This member fails the job: a scheduler that closes after it
            // is not dialled again.
            self.gone.store(true, Ordering::SeqCst);
        }
        if is_request(msg) {
            lock(&self.asked).push(msg.clone());
        }
        let beat = !counted(msg);
        if lock(&self.away).is_some() {
            // Heartbeats are for a scheduler that is there.
            if !beat {
                self.wait_for_return(msg)?;
            }
            return Ok(());
        }
        let mut frames: Vec<Vec<u8>> = lock(&self.later).take().into_iter().map(|(f, _)| f).collect();
        if !beat {
            frames.push(msg.encode(self.namespace));
        }
        let first = {
            let mut replay = lock(&self.replay);
            let first = replay.sent() + 1;
            for f in &frames {
                replay.push(f.clone());
            }
            first
        };
        let mut buf = frames.concat();
        if beat {
            buf.extend(msg.encode(self.namespace));
        }
        match w.write_all(&buf) {
            Ok(()) => Ok(()),
            // The connection broke: the reader finds out and dials the
            // scheduler again; what was written goes again from `replay`.
            Err(_) if self.comeback_possible() => {
                lock(&self.away).get_or_insert_with(Instant::now);
                if !frames.is_empty() {
                    lock(&self.failed_from).get_or_insert(first);
                }
                Ok(())
            }
            Err(e) => Err(SessionError::Send(e)),
        }
    }

    /// The heartbeat: how much of the scheduler's session arrived.
    fn ack(&self) -> Control {
        Control::Ack { received: self.received.load(Ordering::SeqCst) }
    }

    /// `msg` waits (encoded) for the scheduler to come back.
    fn wait_for_return(&self, msg: &Control) -> Result<(), SessionError> {
        let mut later = lock(&self.later);
        if later.bytes >= AWAY_BYTES {
            return Err(SessionError::Send(std::io::Error::other(format!(
                "over {} MiB of messages wait for the scheduler to come back",
                AWAY_BYTES >> 20
            ))));
        }
        later.push(msg, self.namespace);
        Ok(())
    }

    /// Whether a lost scheduler is dialled again (not while closing, nor
    /// once given up).
    fn comeback_possible(&self) -> bool {
        !self.closing.load(Ordering::SeqCst) && !self.gone.load(Ordering::SeqCst)
    }

    /// The scheduler did not come back: whoever waits for it stops.
    fn give_up(&self) {
        let _away = lock(&self.away);
        self.gone.store(true, Ordering::SeqCst);
        self.back.notify_all();
    }

    /// The scheduler answered a request: it is not sent again.
    fn answered(&self, msg: &Control) {
        let done = |asked: &Control| match (asked, msg) {
            (Control::Declare { req: a, .. }, Control::Declared { req, .. } | Control::DeclareError { req, .. }) => {
                a == req
            }
            (Control::Barrier { id: a }, Control::BarrierDone { id }) => a == id,
            _ => false,
        };
        lock(&self.asked).retain(|a| !done(a));
    }

    /// Wait (bounded) while the scheduler is away; true if it is there.
    fn wait_back(&self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        let mut away = lock(&self.away);
        while away.is_some() && !self.gone.load(Ordering::SeqCst) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            away = self.back.wait_timeout(away, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        away.is_none()
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
        let full = lock(&self.0.later).push(msg, self.0.namespace);
        match full {
            n if n >= AWAY_BYTES => self.0.send(msg).and(Err(SessionError::Send(std::io::Error::other(format!(
                "over {} MiB of messages wait for the scheduler to come back",
                AWAY_BYTES >> 20
            ))))),
            n if n >= SEND_LATER_BYTES => self.0.send(&self.0.ack()),
            _ => Ok(()),
        }
    }

    /// Say goodbye (workers) and close: stops the heartbeats and makes a
    /// pending `recv` return. Safe to call more than once.
    pub fn close(&self, goodbye: bool) {
        if goodbye && !self.closing() && !self.0.gone.load(Ordering::SeqCst) && !self.0.wait_back(self.0.peer_timeout) {
            log::warn!(target: "session", "the scheduler did not come back for this worker's goodbye");
        }
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
            let _ = w.get_ref().shutdown(std::net::Shutdown::Write);
            drain(w.get_ref(), Duration::from_millis(500));
        }
        let _ = w.get_ref().shutdown(std::net::Shutdown::Both);
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
    reader: Reader,
    peer_timeout: Duration,
    /// When the scheduler was last heard from (anything, on any connection).
    heard: Instant,
    heartbeat: Option<JoinHandle<()>>,
    /// Dropping the session closes it (without a goodbye), unless its
    /// owner closes it itself (`keep_open`).
    close_on_drop: bool,
    comeback: Comeback,
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

    /// What to tell a scheduler that restarted (`Rejoin`), asked for when
    /// it is dialled again. Without it, a lost scheduler is not dialled.
    pub fn on_rejoin(&self, report: impl Fn() -> Report + Send + Sync + 'static) {
        *lock(&self.comeback.report) = Some(Box::new(report));
    }

    /// The scheduler's next message other than a heartbeat. A scheduler
    /// lost (a closed connection, or silent past the keep-alive) is dialled
    /// again (`rejoin`); one that does not come back is an error, as is one
    /// silent for the peer timeout if it is not dialled.
    pub fn recv(&mut self) -> Result<Control, SessionError> {
        loop {
            let read = read_control(&mut self.reader, self.link.namespace);
            if read.is_ok() {
                self.heard = Instant::now();
            }
            let can_dial = self.link.comeback_possible() && lock(&self.comeback.report).is_some();
            let lost = match read {
                Ok(Control::Heartbeat) => continue,
                Ok(Control::Ack { received }) => {
                    lock(&self.link.replay).acked(received);
                    continue;
                }
                Ok(msg) => {
                    if counted(&msg) {
                        self.link.received.fetch_add(1, Ordering::SeqCst);
                    }
                    self.link.answered(&msg);
                    return Ok(msg);
                }
                Err(ReadError::TimedOut) if !can_dial && self.heard.elapsed() < self.peer_timeout => continue,
                Err(ReadError::TimedOut) => SessionError::Silent(self.heard.elapsed().as_secs_f64()),
                Err(ReadError::Closed | ReadError::ClosedMidFrame) => SessionError::Closed,
                Err(e) => SessionError::Lost(e),
            };
            if !can_dial {
                return Err(lost);
            }
            if let Err(e) = self.rejoin(lost) {
                self.link.give_up();
                return Err(e);
            }
        }
    }

    /// Dial the scheduler again until the peer timeout has passed since
    /// it was lost; a scheduler that restarted is sent a Rejoin and must
    /// answer with this member's Welcome. Then what waited goes.
    fn rejoin(&mut self, lost: SessionError) -> Result<(), SessionError> {
        let since = *lock(&self.link.away).get_or_insert_with(Instant::now);
        let deadline = since + self.peer_timeout;
        let addr = self.comeback.addr.clone();
        let who = format!("{} {}", self.comeback.register.role.name(), self.welcome.rank);
        log::warn!(target: &who, "{lost}; dialling the scheduler at {addr} again (for up to {:.1}s)", self.peer_timeout.as_secs_f64());
        let greet = |a: Authed| {
            let (mut r, mut w) = match a.split() {
                Ok(halves) => halves,
                Err(e) => return Greeted::Again(e.to_string()),
            };
            match self.introduce(&mut r, &mut w, deadline) {
                Ok(answer) => Greeted::Done((r, w, answer)),
                Err(SessionError::RefusedBack { why, .. }) => Greeted::Refused(why),
                Err(e) => Greeted::Again(e.to_string()),
            }
        };
        let dialled = dial_until(&addr, deadline, &self.comeback.secret, || self.link.comeback_possible(), greet);
        let (reader, writer, answer) = match dialled {
            Ok(halves) => halves,
            Err(f) if f.refused => return Err(SessionError::RefusedBack { addr, why: f.why }),
            Err(_) if !self.link.comeback_possible() => return Err(lost),
            Err(f) => {
                let why = format!("{lost}; dialling again: {}", f.why);
                return Err(SessionError::NotBack { addr, why, secs: self.peer_timeout.as_secs_f64() });
            }
        };
        {
            let mut w = lock(&self.link.writer);
            *w = writer;
            let frames = match answer {
                Answer::Welcomed => self.link.for_a_restarted_scheduler(),
                Answer::Resumed(received) => match self.link.for_a_resumed_session(received) {
                    Some(frames) => frames,
                    None => {
                        let why = format!(
                            "{lost}; the scheduler came back having received {received} of this member's {} \
                             messages, and the ones it missed were not kept",
                            lock(&self.link.replay).sent()
                        );
                        return Err(SessionError::RefusedBack { addr, why });
                    }
                },
            };
            *lock(&self.link.away) = None;
            self.link.back.notify_all();
            if let Err(e) = w.write_all(&frames.concat()) {
                log::warn!(target: &who, "writing to the scheduler that came back: {e}");
            }
        }
        self.reader = reader;
        self.heard = Instant::now();
        let how = match answer {
            Answer::Welcomed => "rejoined",
            Answer::Resumed(_) => "the session resumed",
        };
        log::info!(target: &who, "the scheduler at {addr} is back: {how} after {:.1}s", since.elapsed().as_secs_f64());
        Ok(())
    }

    /// Rejoin on a fresh connection and read the answer: this member's
    /// Welcome of this job again (the scheduler restarted), or Resumed.
    fn introduce(&self, r: &mut Reader, w: &mut Writer, deadline: Instant) -> Result<Answer, SessionError> {
        let report = lock(&self.comeback.report).as_ref().map(|f| f()).unwrap_or_default();
        let msg = Control::Rejoin(Box::new(Rejoin {
            register: self.comeback.register.clone(),
            welcome: self.welcome.clone(),
            specs: report.specs,
            keys: report.keys,
            left: report.left,
            lost: report.lost,
            barriers: report.barriers,
            received: self.link.received.load(Ordering::SeqCst),
        }));
        let ns = self.link.namespace;
        // Within the time left to come back (a scheduler that accepts and
        // never answers must not hold this past the peer timeout).
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(100));
        timed(w.get_ref(), left, left)?;
        write_control(w, &msg, ns).map_err(SessionError::Send)?;
        let refused = |why: String| SessionError::RefusedBack { addr: self.comeback.addr.clone(), why };
        match read_control(r, ns) {
            Ok(Control::Welcome(w)) if w.job_id == self.welcome.job_id && w.rank == self.welcome.rank => {
                timed(r.get_ref(), keep_alive(self.peer_timeout), self.peer_timeout)?;
                Ok(Answer::Welcomed)
            }
            Ok(Control::Resumed { received }) => {
                timed(r.get_ref(), keep_alive(self.peer_timeout), self.peer_timeout)?;
                Ok(Answer::Resumed(received))
            }
            Ok(Control::Welcome(_)) => Err(refused("it welcomed this member to another job".into())),
            Ok(Control::Error { message }) => Err(refused(message)),
            Ok(other) => Err(refused(format!("it answered with {:?}", other.msg_type()))),
            Err(e) => Err(SessionError::NoWelcome(e.to_string())),
        }
    }
}

/// How the scheduler took a member back.
#[derive(Clone, Copy)]
enum Answer {
    /// It restarted: a new session.
    Welcomed,
    /// It lived, and had received this many of the member's messages.
    Resumed(u64),
}

impl Link {
    /// What goes to a scheduler that restarted (writer locked): the
    /// requests not answered, what a failed write took with it (requests
    /// aside: they are in `asked`), what waited; numbered afresh.
    fn for_a_restarted_scheduler(&self) -> Vec<Vec<u8>> {
        let ns = self.namespace;
        let mut frames: Vec<Vec<u8>> = lock(&self.asked).iter().map(|m| m.encode(ns)).collect();
        let mut replay = lock(&self.replay);
        if let Some(failed) = lock(&self.failed_from).take().and_then(|from| replay.after(from - 1)) {
            frames.extend(failed.into_iter().filter(|f| !frame_is_request(f)));
        }
        frames.extend(lock(&self.later).take().into_iter().filter(|(_, request)| !request).map(|(f, _)| f));
        replay.reset();
        self.received.store(0, Ordering::SeqCst);
        for f in &frames {
            replay.push(f.clone());
        }
        frames
    }

    /// What goes to a scheduler whose session resumed, having received
    /// `received` of this session's messages (writer locked): what it
    /// missed, then what waited. None if some of it was not kept.
    fn for_a_resumed_session(&self, received: u64) -> Option<Vec<Vec<u8>>> {
        let mut replay = lock(&self.replay);
        let mut frames = replay.after(received)?;
        replay.acked(received);
        for (f, _) in lock(&self.later).take() {
            replay.push(f.clone());
            frames.push(f);
        }
        *lock(&self.failed_from) = None;
        Some(frames)
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
