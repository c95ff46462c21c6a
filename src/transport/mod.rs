//! Everything between a role and its sockets: the one framed, nonblocking
//! data connection both the worker and the server use (`conn`), connecting
//! with retry and authenticating (`Authed`, and its sealed halves for the
//! blocking control paths: `sealed`), what a control session keeps to
//! resume on a new connection (`replay`), byte views of numeric buffers, and
//! what colocated processes share (`shm`: memory segments and doorbells).

mod conn;
pub mod replay;
mod sealed;
pub mod shm;

pub use crate::protocol::{Frame, FrameReader};
pub use conn::{ConnError, Connection, Drain, FrameWriter, Outgoing};
pub use sealed::{Authed, SealedReader, SealedWriter};

use std::io;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::protocol::auth::{self, AuthError, Secret};
use crate::protocol::ReadError;

/// Resolve `host:port`, accepting a bare IPv6 or hostname.
pub fn resolve(addr: &str) -> io::Result<SocketAddr> {
    addr.to_socket_addrs()?
        .next()
        .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("cannot resolve {addr}")))
}

/// `host:port` for an advertised address, bracketing IPv6 literals.
pub fn join_host_port(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// What a listener does after `accept` failed (`AcceptErrors::on_error`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AcceptFailure {
    /// Nothing is waiting.
    Drained,
    /// That one connection went away before it was accepted: accept on.
    Skip,
    /// Out of descriptors or memory: the connection stays queued. Retry
    /// after a pause (not in a loop, which would spin), and do retry even
    /// without a new event: an edge-triggered listener gets no new edge for
    /// connections already queued, so they would wait for the next stranger.
    Later,
}

/// A listener's accept errors: classified, and lasting ones warned about at
/// most once a second (a member out of descriptors retries all the while).
#[derive(Debug, Default)]
pub struct AcceptErrors {
    since_warned: u64,
    warned: Option<Instant>,
}

impl AcceptErrors {
    pub fn on_error(&mut self, who: &str, e: &io::Error) -> AcceptFailure {
        match e.kind() {
            io::ErrorKind::WouldBlock => return AcceptFailure::Drained,
            io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset | io::ErrorKind::Interrupted => {
                return AcceptFailure::Skip
            }
            _ => {}
        }
        self.since_warned += 1;
        if self.warned.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
            let hint = match e.raw_os_error() {
                Some(libc::EMFILE | libc::ENFILE) => " (raise the open-file limit, `ulimit -n`)",
                _ => "",
            };
            let count = match self.since_warned {
                1 => String::new(),
                n => format!(" ({n} failures since the last warning)"),
            };
            log::warn!(target: who, "accept failed: {e}{hint}; connections wait queued and are retried{count}");
            (self.since_warned, self.warned) = (0, Some(Instant::now()));
        }
        AcceptFailure::Later
    }
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

/// `connect_retry`, then the connector's side of the authentication
/// handshake (`protocol::auth`), all within `timeout` (at least 5 s for the
/// handshake). A listener that rejects us, or cannot prove it holds the
/// token, is an error of kind PermissionDenied. A connection cut during
/// the handshake (a proxy or balancer in front of a listener that is not up
/// yet accepts and then resets) is dialled again while `timeout` lasts.
pub fn connect_authenticated(addr: &str, timeout: Duration, secret: &Secret) -> io::Result<Authed> {
    let start = Instant::now();
    loop {
        let stream = connect_retry(addr, timeout.saturating_sub(start.elapsed()).max(DIAL_ATTEMPT))?;
        let left = timeout.saturating_sub(start.elapsed());
        match authenticate(stream, addr, left.max(Duration::from_secs(5)), secret) {
            Err(e) if e.kind() != io::ErrorKind::PermissionDenied && left > DIAL_PAUSE => {
                log::debug!(target: "transport", "{addr}: {e}; dialling again");
                std::thread::sleep(DIAL_PAUSE);
            }
            done => return done,
        }
    }
}

/// One attempt: connect within `attempt`, then the handshake within
/// `attempt` or a second, whichever is longer (a listener that accepts and
/// then says nothing, e.g. one frozen, must not hold an attempt long past
/// its time).
fn connect_authenticated_once(addr: &str, attempt: Duration, secret: &Secret) -> io::Result<Authed> {
    let stream = resolve(addr).and_then(|a| TcpStream::connect_timeout(&a, attempt))?;
    stream.set_nodelay(true)?;
    authenticate(stream, addr, attempt.max(Duration::from_secs(1)), secret)
}

/// What `dial_until`'s `greet` made of a connection.
pub enum Greeted<T> {
    Done(T),
    /// Not this time (why): dial again.
    Again(String),
    /// Refused for good (why).
    Refused(String),
}

/// Why `dial_until` stopped without a connection: the last failure, and
/// whether it was a refusal (dialling again would not help).
#[derive(Debug)]
pub struct DialFailed {
    pub why: String,
    pub refused: bool,
}

/// How long one attempt of `dial_until` may take, and the pause between
/// attempts.
const DIAL_ATTEMPT: Duration = Duration::from_millis(300);
const DIAL_PAUSE: Duration = Duration::from_millis(100);

/// Dial a peer that was lost (a broken link mended, a replica linked
/// again, a scheduler rejoined) and authenticate, in short attempts until
/// `until` or until `wanted` says no more: the first attempt after the
/// peer is back gets through, not TCP's backed-off retry. `greet` finishes
/// each connection made (a hello, a rejoin). A refused handshake is final.
pub fn dial_until<T>(
    addr: &str,
    until: Instant,
    secret: &Secret,
    wanted: impl Fn() -> bool,
    mut greet: impl FnMut(Authed) -> Greeted<T>,
) -> Result<T, DialFailed> {
    loop {
        let left = until.saturating_duration_since(Instant::now());
        let why = match connect_authenticated_once(addr, DIAL_ATTEMPT.min(left).max(DIAL_PAUSE), secret) {
            Ok(s) => match greet(s) {
                Greeted::Done(t) => return Ok(t),
                Greeted::Again(why) => why,
                Greeted::Refused(why) => return Err(DialFailed { why, refused: true }),
            },
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
                return Err(DialFailed { why: e.to_string(), refused: true })
            }
            Err(e) => e.to_string(),
        };
        if Instant::now() >= until || !wanted() {
            return Err(DialFailed { why, refused: false });
        }
        std::thread::sleep(DIAL_PAUSE);
    }
}

/// How long a data link may be silent (nothing acknowledged) before its
/// socket fails (`tune_data_socket`).
pub const LINK_SILENCE: Duration = Duration::from_secs(2);

fn authenticate(stream: TcpStream, addr: &str, left: Duration, secret: &Secret) -> io::Result<Authed> {
    let mut r = DeadlineReader::new(&stream, left);
    let _ = stream.set_write_timeout(Some(left));
    let result = auth::connect_blocking(&mut r, &mut &stream, secret);
    stream.set_read_timeout(None)?;
    stream.set_write_timeout(None)?;
    match result {
        Ok(keys) => Ok(Authed { stream, keys }),
        Err(AuthError::Io(e)) => Err(io::Error::new(e.kind(), format!("{addr}: authentication: {e}"))),
        // The connection failed during the handshake (closed, reset, timed
        // out): not a refusal, dialling again may work.
        Err(AuthError::Read(
            e @ (ReadError::Closed | ReadError::ClosedMidFrame | ReadError::Io(_) | ReadError::TimedOut),
        )) => Err(io::Error::new(io::ErrorKind::ConnectionAborted, format!("{addr}: authentication: {e}"))),
        Err(e) => Err(io::Error::new(io::ErrorKind::PermissionDenied, format!("{addr}: {e}"))),
    }
}

/// Reads from a blocking stream until a deadline, however the bytes
/// trickle in: a peer sending one byte a second cannot hold a thread past
/// it (a read timeout alone restarts with every byte).
pub struct DeadlineReader<'a> {
    stream: &'a TcpStream,
    until: Instant,
}

impl<'a> DeadlineReader<'a> {
    pub fn new(stream: &'a TcpStream, within: Duration) -> DeadlineReader<'a> {
        DeadlineReader { stream, until: Instant::now() + within }
    }
}

impl io::Read for DeadlineReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "deadline passed"));
        }
        self.stream.set_read_timeout(Some(left))?;
        io::Read::read(&mut &*self.stream, buf)
    }
}

/// Types whose every bit pattern is valid, so their memory may be filled
/// straight from the network or viewed as another such type.
pub trait Plain: Copy {}
impl Plain for f32 {}
impl Plain for u16 {}
impl Plain for u32 {}
impl Plain for u8 {}
impl Plain for u64 {}

pub fn bytes<T: Plain>(s: &[T]) -> &[u8] {
    cast(s)
}

pub fn bytes_mut<T: Plain>(s: &mut [T]) -> &mut [u8] {
    // SAFETY: T is plain old data; the byte view covers exactly the slice,
    // and any bytes written form valid T values.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr() as *mut u8, std::mem::size_of_val(s)) }
}

/// View a slice of one plain type as another of no stricter alignment (e.g.
/// a u32 scratch buffer as the f32 or u16 values received into it). A
/// trailing partial element is left out.
pub fn cast<T: Plain, U: Plain>(s: &[T]) -> &[U] {
    const { assert!(std::mem::align_of::<U>() <= std::mem::align_of::<T>()) };
    let n = std::mem::size_of_val(s) / std::mem::size_of::<U>();
    // SAFETY: alignment checked at compile time; the view lies within the
    // slice's bytes; every bit pattern is a valid U.
    unsafe { std::slice::from_raw_parts(s.as_ptr() as *const U, n) }
}

/// Congestion control for data connections (`GRADHUB_TCP_CONGESTION`):
/// "cubic" unless set; "system" (or empty) keeps the system's default.
/// Read once per process.
fn congestion_control() -> Option<&'static str> {
    static CC: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    CC.get_or_init(crate::settings::tcp_congestion).as_deref()
}

/// Options every data connection gets, at both ends: no Nagle delay, and
/// the congestion control (`congestion_control`). A job's flows restart
/// every round, app-limited, many into one server at once: measured on the
/// emulated cluster, BBR (a common system default) let a CPU-only server's
/// flows stall for 40-60 ms a few times a second, cubic did not
/// (docs/benchmarks.md). One that cannot be set (not built into the
/// kernel, or not allowed to unprivileged users) is warned about once and
/// the system's default is used.
pub fn tune_data_socket<S: std::os::fd::AsFd>(s: &S) {
    let sock = socket2::SockRef::from(s);
    let _ = sock.set_tcp_nodelay(true);
    // A link that goes silent (down, or a peer's host gone) fails the
    // socket within LINK_SILENCE, whether data waits for an ack (the user
    // timeout) or the link is idle (keep-alive probes), instead of TCP's
    // retransmissions backing off for minutes: the worker then mends it
    // (`client::io::mend`), and a new connection gets through as soon as
    // the link is back.
    let _ = sock.set_tcp_user_timeout(Some(LINK_SILENCE));
    // (The kernel takes whole seconds: a shorter interval is refused, and
    // with it the whole setting.)
    let probes = socket2::TcpKeepalive::new().with_time(LINK_SILENCE / 2).with_interval(Duration::from_secs(1));
    if let Err(e) = sock.set_tcp_keepalive(&probes) {
        log::debug!(target: "tcp", "keep-alive probes cannot be set: {e}");
    }
    if let Some(cc) = congestion_control() {
        if let Err(e) = sock.set_tcp_congestion(cc.as_bytes()) {
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| {
                log::warn!(target: "tcp", "GRADHUB_TCP_CONGESTION={cc:?} cannot be set ({e}); using the system's default")
            });
        }
    }
}

/// Whether a connection whose read saw its end was reset (its TCP state is
/// CLOSE) rather than closed by its peer (a FIN: CLOSE_WAIT). A read can
/// report a reset as a clean end: when another thread's write on the same
/// socket took the reset's error first, the read finds only the shut
/// receive side.
pub fn ended_by_reset(s: &TcpStream) -> bool {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: getsockopt writes at most `len` bytes into `info`, a
        // plain C struct that any bytes are valid for.
        let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
        let ok = unsafe {
            libc::getsockopt(
                s.as_raw_fd(),
                libc::IPPROTO_TCP,
                libc::TCP_INFO,
                (&mut info as *mut libc::tcp_info).cast(),
                &mut len,
            )
        } == 0;
        ok && info.tcpi_state == 7 // TCP_CLOSE
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = s;
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reset_is_told_from_a_close_after_the_read_saw_the_end() {
        use std::io::{Read, Write};
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        for reset in [false, true] {
            let mut ours = TcpStream::connect(l.local_addr().unwrap()).unwrap();
            let (theirs, _) = l.accept().unwrap();
            if reset {
                socket2::SockRef::from(&theirs).set_linger(Some(Duration::ZERO)).unwrap();
            }
            drop(theirs);
            std::thread::sleep(Duration::from_millis(50));
            // A write takes a reset's error first; the read then sees an
            // end. (Written after a FIN, the closed peer would answer with
            // a reset: a member's end is judged when its read sees it.)
            if reset {
                let _ = ours.write_all(b"x");
            }
            let mut buf = [0u8; 8];
            let _ = ours.read(&mut buf);
            assert_eq!(ended_by_reset(&ours), reset, "reset: {reset}");
        }
    }

    #[test]
    fn a_data_socket_fails_after_the_link_is_silent_for_link_silence() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let s = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        tune_data_socket(&s);
        let sock = socket2::SockRef::from(&s);
        assert_eq!(sock.tcp_user_timeout().unwrap(), Some(LINK_SILENCE));
        // Idle links too: probes after LINK_SILENCE / 2, every second.
        assert!(sock.keepalive().unwrap());
        assert_eq!(sock.tcp_keepalive_time().unwrap(), LINK_SILENCE / 2);
        assert_eq!(sock.tcp_keepalive_interval().unwrap(), Duration::from_secs(1));
        assert!(sock.tcp_nodelay().unwrap());
    }

    #[test]
    fn casts_cover_the_same_bytes() {
        let w = [0x3f80_0000u32, 0x4000_0000];
        assert_eq!(cast::<u32, f32>(&w), &[1.0, 2.0]);
        assert_eq!(cast::<u32, u16>(&w), &[0, 0x3f80, 0, 0x4000]);
        assert_eq!(bytes(&w).len(), 8);
        assert_eq!(join_host_port("::1", 5), "[::1]:5");
        assert_eq!(join_host_port("10.0.0.1", 5), "10.0.0.1:5");
    }

    #[test]
    fn accept_errors_are_told_apart() {
        let mut errs = AcceptErrors::default();
        let kind = |k| io::Error::from(k);
        assert_eq!(errs.on_error("t", &kind(io::ErrorKind::WouldBlock)), AcceptFailure::Drained);
        assert_eq!(errs.on_error("t", &kind(io::ErrorKind::ConnectionAborted)), AcceptFailure::Skip);
        let emfile = io::Error::from_raw_os_error(libc::EMFILE);
        assert_eq!(errs.on_error("t", &emfile), AcceptFailure::Later);
        assert!(errs.warned.is_some() && errs.since_warned == 0);
        // Within the second: counted, not warned again.
        assert_eq!(errs.on_error("t", &emfile), AcceptFailure::Later);
        assert_eq!(errs.since_warned, 1);
    }
}
