//! Shared helpers: scheduler/server/client setup in this process, fake members
//! and fake workers on raw sockets, bounded waits.
//!
//! Everything that can block has a deadline (`IO_TIMEOUT`), so a broken build
//! fails a test instead of hanging the binary.

#![allow(dead_code)]

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gradhub::client::{Client, ClientConfig};
use gradhub::protocol::auth::{self, Secret};
use gradhub::protocol::{
    encode_frame, read_control, write_control, Control, DType, DeclEntry, Header, MsgType, ReadError, Register, Role,
    TensorSpec, Welcome, HEADER_LEN,
};
use gradhub::scheduler::{start_scheduler, SchedulerConfig, SchedulerHandle};
use gradhub::server::{run_server, ServerConfig};

/// Upper bound for any single wait in these tests.
pub const IO_TIMEOUT: Duration = Duration::from_secs(10);
/// The job namespace used everywhere (non-zero, so a missing namespace shows).
pub const NS: u32 = 7;

/// The token of every test job: tests run with authentication on.
pub fn token() -> Secret {
    Secret::new(b"integration-test-token")
}

/// The listener's handshake on a test's blocking stream (a fake scheduler or server).
pub fn accept_authenticated(s: &TcpStream, secret: &Secret) {
    auth::listen_blocking(&mut &*s, &mut &*s, &secret.keys()).expect("the connector authenticates");
}

/// The connector's handshake on a test's blocking stream.
pub fn authenticate(s: &TcpStream, secret: &Secret) -> Result<(), auth::AuthError> {
    auth::connect_blocking(&mut &*s, &mut &*s, secret).map(drop)
}
/// Partition size of the test jobs: small, so modest tensors have several chunks.
pub const PARTITION: u32 = 1024;

// ---------------------------------------------------------------- threads

/// A value computed on another thread, awaited with a deadline.
pub struct Pending<T> {
    rx: mpsc::Receiver<T>,
    what: String,
}

pub fn spawn<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> Pending<T> {
    let (tx, rx) = mpsc::channel();
    std::thread::Builder::new()
        .name(format!("itest-{what}"))
        .spawn(move || {
            let _ = tx.send(f());
        })
        .expect("spawn");
    Pending { rx, what: what.to_string() }
}

impl<T> Pending<T> {
    pub fn join(self) -> T {
        self.join_within(IO_TIMEOUT)
    }
    pub fn join_within(self, d: Duration) -> T {
        match self.rx.recv_timeout(d) {
            Ok(v) => v,
            Err(mpsc::RecvTimeoutError::Timeout) => panic!("{} did not finish within {d:?}", self.what),
            Err(mpsc::RecvTimeoutError::Disconnected) => panic!("{} panicked", self.what),
        }
    }
}

// ---------------------------------------------------------------- scheduler

pub fn sched_config(num_workers: u32, num_servers: u32) -> SchedulerConfig {
    SchedulerConfig {
        bind: "127.0.0.1:0".into(),
        num_workers,
        num_servers,
        partition_bytes: PARTITION,
        heartbeat_ms: 100,
        peer_timeout_ms: 10_000,
        stall_ms: 30_000,
        join_timeout_ms: 20_000,
        namespace: NS,
        host_reduce: true,
        failover: true,
        secret: token(),
        ..SchedulerConfig::default()
    }
}

pub fn start(cfg: SchedulerConfig) -> SchedulerHandle {
    start_scheduler(cfg).expect("start_scheduler")
}

/// `SchedulerHandle::wait`, bounded; the error as text.
pub fn wait_scheduler(h: SchedulerHandle) -> Result<(), String> {
    spawn("scheduler wait", move || h.wait().map_err(|e| e.to_string())).join()
}

// ---------------------------------------------------------------- fake members (control plane)

pub fn worker_reg(rank: i32, host: &str, nw: u32, ns: u32) -> Register {
    Register {
        role: Role::Worker,
        requested_rank: rank,
        hostname: host.into(),
        addr: String::new(),
        ports: Vec::new(),
        colocated: false,
        num_workers: nw,
        num_servers: ns,
        local_rank: -1,
        local_size: -1,
        rack: String::new(),
        sum_order: Default::default(),
        training: Default::default(),
        elastic: None,
    }
}

pub fn server_reg(rank: i32, addr: &str, ports: Vec<u16>, colocated: bool, nw: u32, ns: u32) -> Register {
    Register {
        role: Role::Server,
        requested_rank: rank,
        hostname: "server-host".into(),
        addr: addr.into(),
        ports,
        colocated,
        num_workers: nw,
        num_servers: ns,
        local_rank: -1,
        local_size: -1,
        rack: String::new(),
        sum_order: Default::default(),
        training: Default::default(),
        elastic: None,
    }
}

/// A job member played over a raw control connection.
pub struct Member {
    pub reader: TcpStream,
    writer: Arc<Mutex<TcpStream>>,
    /// This end's address: what the scheduler sees as the member's peer address.
    pub local: SocketAddr,
    hb_stop: Option<Arc<AtomicBool>>,
}

fn is_timeout(e: &ReadError) -> bool {
    matches!(e, ReadError::TimedOut)
}

impl Member {
    pub fn connect(addr: SocketAddr) -> Member {
        let m = Member::connect_raw(addr);
        authenticate(&m.reader, &token()).expect("authenticate to the scheduler");
        m
    }

    /// Connected, not authenticated.
    pub fn connect_raw(addr: SocketAddr) -> Member {
        let s = TcpStream::connect_timeout(&addr, IO_TIMEOUT).expect("connect to the scheduler");
        s.set_nodelay(true).unwrap();
        s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
        s.set_write_timeout(Some(IO_TIMEOUT)).unwrap();
        let local = s.local_addr().unwrap();
        let writer = Arc::new(Mutex::new(s.try_clone().unwrap()));
        Member { reader: s, writer, local, hb_stop: None }
    }

    /// Connect and send a Register (does not wait for the Welcome).
    pub fn register(addr: SocketAddr, reg: Register) -> Member {
        let m = Member::connect(addr);
        m.send(&Control::Register(reg)).expect("send Register");
        m
    }

    pub fn send(&self, msg: &Control) -> std::io::Result<()> {
        let mut w = self.writer.lock().unwrap();
        write_control(&mut *w, msg, NS)
    }

    /// The next message other than Heartbeat, or the read error; gives up
    /// (with a timeout error) after `d`.
    pub fn try_recv_within(&mut self, d: Duration) -> Result<Control, ReadError> {
        let deadline = Instant::now() + d;
        loop {
            let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
            self.reader.set_read_timeout(Some(left)).unwrap();
            match read_control(&mut self.reader, NS) {
                Ok(Control::Heartbeat | Control::Ack { .. }) if Instant::now() < deadline => continue,
                Ok(Control::Heartbeat | Control::Ack { .. }) => return Err(ReadError::TimedOut),
                other => return other,
            }
        }
    }

    pub fn try_recv(&mut self) -> Result<Control, ReadError> {
        self.try_recv_within(IO_TIMEOUT)
    }

    /// The next message other than Heartbeat (panics on error or timeout).
    pub fn recv(&mut self) -> Control {
        match self.try_recv() {
            Ok(m) => m,
            Err(e) => panic!("member {}: no message: {e}", self.local),
        }
    }

    /// Nothing but heartbeats arrives for `d` (checks that something does NOT happen).
    pub fn expect_silence(&mut self, d: Duration) {
        match self.try_recv_within(d) {
            Err(e) if is_timeout(&e) => {}
            Ok(m) => panic!("member {}: expected no message, got {m:?}", self.local),
            Err(e) => panic!("member {}: connection failed while expecting silence: {e}", self.local),
        }
    }

    pub fn welcome(&mut self) -> Welcome {
        match self.recv() {
            Control::Welcome(w) => w,
            other => panic!("expected Welcome, got {other:?}"),
        }
    }

    /// The next message must be an Error; returns its text.
    pub fn error(&mut self) -> String {
        match self.recv() {
            Control::Error { message } => message,
            other => panic!("expected Error, got {other:?}"),
        }
    }

    /// After an Error the scheduler closes or stops using the connection:
    /// reading yields end-of-file or further errors, never a Welcome.
    pub fn expect_no_welcome(&mut self) {
        loop {
            match self.try_recv_within(Duration::from_secs(2)) {
                Ok(Control::Welcome(w)) => panic!("rejected member got a Welcome: {w:?}"),
                Ok(Control::Error { .. }) => continue,
                Ok(other) => panic!("rejected member got {other:?}"),
                Err(_) => return,
            }
        }
    }

    /// Send a Heartbeat every `period` from a background thread until dropped.
    pub fn start_heartbeat(&mut self, period: Duration) {
        let stop = Arc::new(AtomicBool::new(false));
        self.hb_stop = Some(stop.clone());
        let w = self.writer.clone();
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                if write_control(&mut *w.lock().unwrap(), &Control::Heartbeat, NS).is_err() {
                    return;
                }
                std::thread::sleep(period);
            }
        });
    }

    pub fn stop_heartbeat(&mut self) {
        if let Some(s) = self.hb_stop.take() {
            s.store(true, Ordering::Relaxed);
        }
    }

    /// Declare and wait for the reply to this request (other messages are returned too).
    pub fn declare(&mut self, req: u32, entries: &[(&str, u64, DType)]) -> Control {
        self.send(&Control::Declare { req, entries: decl_entries(entries) }).expect("send Declare");
        self.recv()
    }

    /// Close the connection abruptly (a crashed process).
    pub fn kill(mut self) {
        self.stop_heartbeat();
        let _ = self.reader.shutdown(Shutdown::Both);
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        self.stop_heartbeat();
    }
}

/// Declarations of every worker's tensors (name, elements, dtype), in the job's chunks.
pub fn decl_entries(e: &[(&str, u64, DType)]) -> Vec<DeclEntry> {
    e.iter()
        .map(|&(n, numel, dtype)| DeclEntry {
            name: n.into(),
            numel,
            dtype,
            partition: 0,
            members: Vec::new(),
            sharded: false,
        })
        .collect()
}

pub fn declared(msg: Control, want_req: u32) -> Vec<TensorSpec> {
    match msg {
        Control::Declared { req, specs } => {
            assert_eq!(req, want_req, "Declared answers the wrong request");
            specs
        }
        other => panic!("expected Declared for request {want_req}, got {other:?}"),
    }
}

/// A job of fake members only: servers get ranks 0..k, workers ranks 0..n.
pub struct FakeJob {
    pub addr: SocketAddr,
    pub sched: Option<SchedulerHandle>,
    pub workers: Vec<Member>,
    pub servers: Vec<Member>,
    pub welcomes: Vec<Welcome>,
}

/// `servers`: (threads, colocated) per server. Fake servers advertise
/// 127.0.0.1 and made-up ports (nobody connects to them). Each fake worker
/// is on a host of its own.
pub fn fake_job(cfg: SchedulerConfig, servers: &[(usize, bool)]) -> FakeJob {
    let hosts: Vec<String> = (0..cfg.num_workers).map(|r| format!("host{r}")).collect();
    fake_job_on(cfg, servers, &hosts)
}

/// `fake_job` with fake worker `r` on host `hosts[r]`.
pub fn fake_job_on(cfg: SchedulerConfig, servers: &[(usize, bool)], hosts: &[String]) -> FakeJob {
    let (nw, ns) = (cfg.num_workers, cfg.num_servers);
    assert_eq!(ns as usize, servers.len());
    let h = start(cfg);
    let addr = h.addr;
    let mut srv: Vec<Member> = servers
        .iter()
        .enumerate()
        .map(|(i, &(threads, colocated))| {
            let ports = (0..threads as u16).map(|t| 40_000 + 10 * i as u16 + t).collect();
            Member::register(addr, server_reg(i as i32, "127.0.0.1", ports, colocated, nw, ns))
        })
        .collect();
    let mut wrk: Vec<Member> =
        (0..nw).map(|r| Member::register(addr, worker_reg(r as i32, &hosts[r as usize], nw, ns))).collect();
    let mut welcomes = Vec::new();
    for (i, m) in wrk.iter_mut().enumerate() {
        let w = m.welcome();
        assert_eq!(w.rank, i as u32);
        welcomes.push(w);
    }
    for (i, m) in srv.iter_mut().enumerate() {
        assert_eq!(m.welcome().rank, i as u32);
    }
    FakeJob { addr, sched: Some(h), workers: wrk, servers: srv, welcomes }
}

impl FakeJob {
    pub fn wait(&mut self) -> Result<(), String> {
        wait_scheduler(self.sched.take().expect("waited twice"))
    }
    /// Every worker says Goodbye; every server must get Shutdown; the job ends Ok.
    pub fn finish(mut self) {
        for w in &self.workers {
            w.send(&Control::Goodbye).unwrap();
        }
        for s in &mut self.servers {
            loop {
                match s.recv() {
                    Control::Shutdown => break,
                    // Workers that said goodbye before the last one.
                    Control::PeerLeft { .. } => {}
                    // Late installs are fine to ack.
                    Control::ServerDeclare { batch, .. } => s.send(&Control::ServerDeclareAck { batch }).unwrap(),
                    other => panic!("server expected Shutdown, got {other:?}"),
                }
            }
        }
        assert_eq!(self.wait(), Ok(()));
    }
}

/// A fake server that acknowledges every ServerDeclare from a background
/// thread and reports what it installed.
pub struct AckServer {
    pub installs: mpsc::Receiver<(u32, Vec<TensorSpec>)>,
    stop: Arc<AtomicBool>,
    join: Option<std::thread::JoinHandle<(Member, Option<Control>)>>,
}

pub fn auto_ack(mut m: Member) -> AckServer {
    let (tx, rx) = mpsc::channel();
    let stop = Arc::new(AtomicBool::new(false));
    let st = stop.clone();
    let join = std::thread::spawn(move || loop {
        match m.try_recv_within(Duration::from_millis(50)) {
            Ok(Control::ServerDeclare { batch, specs }) => {
                let _ = tx.send((batch, specs));
                m.send(&Control::ServerDeclareAck { batch }).expect("ack");
            }
            // Alive, as far as the scheduler can tell.
            Ok(Control::Heartbeat | Control::Ack { .. }) => {}
            Ok(other) => return (m, Some(other)),
            Err(e) if is_timeout(&e) => {
                if st.load(Ordering::Relaxed) {
                    return (m, None);
                }
            }
            Err(_) => return (m, None),
        }
    });
    AckServer { installs: rx, stop, join: Some(join) }
}

impl AckServer {
    /// Stop acking; returns the member and the first non-install message it got (e.g. Shutdown).
    pub fn stop(mut self) -> (Member, Option<Control>) {
        self.stop.store(true, Ordering::Relaxed);
        let j = self.join.take().unwrap();
        let p = spawn("ack server", move || j.join());
        p.join().expect("ack thread panicked")
    }
}

impl Drop for AckServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

// ---------------------------------------------------------------- fake workers (data plane)

/// A raw data connection to one server thread.
pub struct DataConn {
    pub s: TcpStream,
}

impl DataConn {
    pub fn connect(addr: &str, port: u16) -> DataConn {
        let c = DataConn::connect_raw(addr, port);
        authenticate(&c.s, &token()).expect("authenticate to a server thread");
        c
    }

    /// Connected, not authenticated.
    pub fn connect_raw(addr: &str, port: u16) -> DataConn {
        let a: SocketAddr = format!("{addr}:{port}").parse().expect("server address");
        let s = TcpStream::connect_timeout(&a, IO_TIMEOUT).expect("connect to a server thread");
        s.set_nodelay(true).unwrap();
        s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
        s.set_write_timeout(Some(IO_TIMEOUT)).unwrap();
        DataConn { s }
    }

    pub fn send_raw(&mut self, b: &[u8]) {
        self.s.write_all(b).expect("write to the server");
    }

    pub fn send_header(&mut self, h: &Header) {
        self.send_raw(&h.encode(&[]));
    }

    pub fn hello(&mut self, rank: u32) {
        let mut h = Header::new(MsgType::DataHello);
        h.namespace = NS;
        h.key = rank;
        self.send_header(&h);
    }

    pub fn connect_hello(addr: &str, port: u16, rank: u32) -> DataConn {
        let mut c = DataConn::connect(addr, port);
        c.hello(rank);
        c
    }

    /// Push one chunk: header and payload in one write.
    pub fn push(&mut self, spec: &TensorSpec, chunk: usize, round: u32, flags: u16, payload: &[u8]) {
        let h = push_header(spec, chunk, round, flags, payload.len());
        self.send_raw(&encode_frame(&h, payload));
    }

    /// The next frame, both checksums checked (the one frame reader).
    pub fn try_read_frame(&mut self) -> std::io::Result<(Header, Vec<u8>)> {
        gradhub::protocol::read_message(&mut self.s, None, 1 << 30).map_err(|e| match e {
            ReadError::Io(e) => e,
            ReadError::TimedOut => std::io::Error::new(ErrorKind::TimedOut, e),
            e => std::io::Error::new(ErrorKind::InvalidData, e),
        })
    }

    pub fn read_frame(&mut self) -> (Header, Vec<u8>) {
        self.try_read_frame().unwrap_or_else(|e| panic!("no frame from the server: {e}"))
    }

    /// The next frame must be Received for (key, chunk, round).
    pub fn expect_received(&mut self, spec: &TensorSpec, chunk: usize, round: u32) {
        let (h, p) = self.read_frame();
        assert_eq!(h.msg_type, MsgType::Received, "expected Received, got {h:?} {:?}", String::from_utf8_lossy(&p));
        assert_eq!((h.key, h.chunk, h.round, h.payload_len), (spec.key, chunk as u32, round, 0));
        assert_eq!(h.namespace, NS);
    }

    /// The next frame must be the Result of (key, chunk, round); returns its payload.
    pub fn expect_result(&mut self, spec: &TensorSpec, chunk: usize, round: u32) -> Vec<u8> {
        let (h, p) = self.read_frame();
        assert_eq!(h.msg_type, MsgType::Result, "expected Result, got {h:?} {:?}", String::from_utf8_lossy(&p));
        assert_eq!((h.key, h.chunk, h.round), (spec.key, chunk as u32, round));
        assert_eq!(h.dtype, spec.dtype);
        assert_eq!(h.namespace, NS);
        assert_eq!(p.len(), spec.chunk_bytes(chunk));
        p
    }

    /// The server answers with an Error frame whose text contains `needle`,
    /// then closes the connection. Returns the text.
    pub fn expect_error(&mut self, needle: &str) -> String {
        let (h, p) = self.read_frame();
        let text = String::from_utf8_lossy(&p).into_owned();
        assert_eq!(h.msg_type, MsgType::Error, "expected an Error frame, got {h:?} {text:?}");
        assert!(text.contains(needle), "error {text:?} does not mention {needle:?}");
        self.expect_closed();
        text
    }

    /// Close our side and wait until the server has closed its side too (so
    /// the server has forgotten this connection before the next one for the rank).
    pub fn close_and_wait(mut self) {
        self.s.shutdown(Shutdown::Write).unwrap();
        self.expect_closed();
    }

    /// The server closed the connection (EOF or reset), without sending more frames.
    pub fn expect_closed(&mut self) {
        let mut b = [0u8; 64];
        match self.s.read(&mut b) {
            Ok(0) => {}
            Ok(n) => panic!("expected the server to close the connection, got {n} more bytes"),
            Err(e) if e.kind() == ErrorKind::ConnectionReset => {}
            Err(e) => panic!("expected the server to close the connection: {e}"),
        }
    }

    /// The server reset the connection (the link broke: its peer mends it),
    /// without sending more frames: not a clean end.
    pub fn expect_reset(&mut self) {
        let mut b = [0u8; 64];
        match self.s.read(&mut b) {
            Err(e) if e.kind() == ErrorKind::ConnectionReset => {}
            Ok(0) => panic!("expected a reset, the server closed the connection cleanly"),
            Ok(n) => panic!("expected a reset, got {n} more bytes"),
            Err(e) => panic!("expected a reset: {e}"),
        }
    }
}

pub fn push_header(spec: &TensorSpec, chunk: usize, round: u32, flags: u16, len: usize) -> Header {
    let mut h = Header::new(MsgType::Push);
    h.namespace = NS;
    h.key = spec.key;
    h.chunk = chunk as u32;
    h.round = round;
    h.flags = flags;
    h.dtype = spec.dtype;
    h.payload_len = len as u32;
    h
}

// ---------------------------------------------------------------- element conversions

pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn bytes_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

pub fn u16_bytes(v: &[u16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn bytes_u16(b: &[u8]) -> Vec<u16> {
    b.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect()
}

// ---------------------------------------------------------------- real servers and clients

pub fn server_config(sched: SocketAddr, threads: usize, colocated: bool, rank: i32, nw: u32, ns: u32) -> ServerConfig {
    ServerConfig {
        scheduler: sched.to_string(),
        threads,
        colocated,
        advertise: Some("127.0.0.1".into()),
        bind_host: "127.0.0.1".into(),
        base_port: 0,
        rank,
        num_workers: nw,
        num_servers: ns,
        namespace: NS,
        connect_timeout: IO_TIMEOUT,
        host: None,
        secret: token(),
        traffic: Default::default(),
        timeline: None,
        rack: String::new(),
        metrics_addr: None,
        sum_order: Default::default(),
        training: Default::default(),
    }
}

/// `run_server` on its own thread; the result as text.
pub fn spawn_server(cfg: ServerConfig) -> Pending<Result<(), String>> {
    spawn("server", move || run_server(cfg).map_err(|e| e.to_string()))
}

pub fn client_config(sched: SocketAddr, rank: i32, nw: u32, ns: u32) -> ClientConfig {
    ClientConfig {
        scheduler: sched.to_string(),
        rank,
        num_workers: nw,
        num_servers: ns,
        namespace: NS,
        connect_timeout: IO_TIMEOUT,
        secret: token(),
        ..Default::default()
    }
}

pub fn spawn_client(cfg: ClientConfig) -> Pending<Client> {
    spawn("Client::connect", move || match Client::connect(cfg) {
        Ok(c) => c,
        Err(e) => panic!("Client::connect failed: {e}"),
    })
}

/// A scheduler and real servers; `servers`: (threads, colocated) per server.
pub struct RealJob {
    pub addr: SocketAddr,
    pub sched: Option<SchedulerHandle>,
    pub servers: Vec<Pending<Result<(), String>>>,
}

pub fn real_job(cfg: SchedulerConfig, servers: &[(usize, bool)]) -> RealJob {
    real_job_on(cfg, servers, &[])
}

/// `real_job` with server i on host `hosts[i]` (default: this machine's identity).
pub fn real_job_on(cfg: SchedulerConfig, servers: &[(usize, bool)], hosts: &[Option<String>]) -> RealJob {
    let (nw, ns, training) = (cfg.num_workers, cfg.num_servers, cfg.training);
    assert_eq!(ns as usize, servers.len());
    let h = start(cfg);
    let addr = h.addr;
    let servers = servers
        .iter()
        .enumerate()
        .map(|(i, &(t, c))| {
            let mut sc = server_config(addr, t, c, i as i32, nw, ns);
            (sc.host, sc.training) = (hosts.get(i).cloned().flatten(), training);
            spawn_server(sc)
        })
        .collect();
    RealJob { addr, sched: Some(h), servers }
}

impl RealJob {
    /// Connect `n` clients concurrently (ranks assigned by the scheduler); sorted by rank.
    pub fn clients(&self, n: u32, nw: u32, ns: u32) -> Vec<Client> {
        let pending: Vec<_> = (0..n).map(|_| spawn_client(client_config(self.addr, -1, nw, ns))).collect();
        let mut cs: Vec<Client> = pending.into_iter().map(|p| p.join()).collect();
        cs.sort_by_key(|c| c.rank);
        cs
    }

    pub fn wait(&mut self) -> Result<(), String> {
        wait_scheduler(self.sched.take().expect("waited twice"))
    }

    /// Every server's run_server result.
    pub fn server_results(&mut self) -> Vec<Result<(), String>> {
        std::mem::take(&mut self.servers).into_iter().map(|p| p.join()).collect()
    }

    /// After every worker left: servers exit Ok and the job ends Ok.
    pub fn finish_ok(mut self) {
        for r in self.server_results() {
            assert_eq!(r, Ok(()), "server exit");
        }
        assert_eq!(self.wait(), Ok(()));
    }
}

/// In-place push_pull of `buf` (elements of `dtype`, any 2- or 4-byte plain
/// type), waited with a deadline. Returns the buffer with the result.
pub fn push_pull<T: Copy + Send + 'static>(
    c: &Client,
    name: &str,
    mut buf: Vec<T>,
    dtype: DType,
    flags: u16,
    priority: i32,
) -> Result<Vec<T>, String> {
    assert_eq!(std::mem::size_of::<T>(), dtype.size());
    let nbytes = std::mem::size_of_val(&buf[..]);
    // SAFETY: buf lives until the op completes; if the wait times out, it is leaked.
    let op = unsafe { c.push_pull(buf.as_mut_ptr() as *mut u8, nbytes, dtype, name, flags, priority, None) }
        .map_err(|e| e.to_string())?;
    match op.wait(Some(IO_TIMEOUT)) {
        Ok(()) => Ok(buf),
        Err(e) => {
            if !op.done() {
                std::mem::forget(buf);
            }
            Err(e.to_string())
        }
    }
}

/// A listener for a fake server thread on 127.0.0.1.
pub fn listener() -> (TcpListener, u16) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let p = l.local_addr().unwrap().port();
    (l, p)
}

/// Accept one connection within IO_TIMEOUT.
pub fn accept(l: &TcpListener) -> TcpStream {
    l.set_nonblocking(true).unwrap();
    let deadline = Instant::now() + IO_TIMEOUT;
    loop {
        match l.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false).unwrap();
                s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
                return s;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(e) => panic!("no connection to the fake server: {e}"),
        }
    }
}

/// Read one frame header from a raw stream.
pub fn read_header(s: &mut TcpStream) -> Header {
    let mut hb = [0u8; HEADER_LEN];
    s.read_exact(&mut hb).expect("read a frame header");
    Header::decode(&hb, 1 << 30).expect("valid header")
}

pub fn assert_contains(text: &str, needles: &[&str]) {
    for n in needles {
        assert!(text.contains(n), "{text:?} does not mention {n:?}");
    }
}
