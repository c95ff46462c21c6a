//! The summation server process: registers with the scheduler, starts one
//! shared-nothing thread per configured core (each with its own listening
//! port), installs tensor specs on its threads when the scheduler says so,
//! and exits when the job ends.

mod optimizer;
mod thread;

use std::io::ErrorKind;
use std::net::TcpStream;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crossbeam_channel::bounded;
use mio::{Poll, Waker};

use crate::protocol::{read_control, write_control, Control, ReadError, Register, Role, Welcome};
use crate::transport::connect_retry;
use thread::{ServerThread, ThreadCmd, ThreadConfig};

#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Scheduler address, host:port.
    pub scheduler: String,
    pub threads: usize,
    pub colocated: bool,
    /// Address to advertise to workers; default: the local address of the
    /// connection to the scheduler (the interface that reaches it).
    pub advertise: Option<String>,
    /// Host to bind the per-thread listeners to.
    pub bind_host: String,
    /// First port; thread t listens on base_port + t. 0 = any free ports.
    pub base_port: u16,
    pub rank: i32,
    pub num_workers: u32,
    pub num_servers: u32,
    pub namespace: u32,
    pub connect_timeout: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            scheduler: "127.0.0.1:9000".into(),
            threads: 1,
            colocated: false,
            advertise: None,
            bind_host: "0.0.0.0".into(),
            base_port: 0,
            rank: -1,
            num_workers: 0,
            num_servers: 0,
            namespace: 0,
            connect_timeout: Duration::from_secs(60),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("server setup failed: {0}")]
    Setup(String),
    #[error("rejected by the scheduler: {0}")]
    Rejected(String),
    #[error("job failed: {0}")]
    JobFailed(String),
}

fn log(rank: Option<u32>, msg: &str) {
    match rank {
        Some(r) => eprintln!("[gradhub server {r}] {msg}"),
        None => eprintln!("[gradhub server] {msg}"),
    }
}

pub fn run_server(cfg: ServerConfig) -> Result<(), ServerError> {
    let setup = |what: &str, e: std::io::Error| ServerError::Setup(format!("{what}: {e}"));
    let threads = cfg.threads.max(1);

    // Bind every thread's listener first, so the ports we advertise exist.
    let mut listeners = Vec::with_capacity(threads);
    for t in 0..threads {
        let port = if cfg.base_port == 0 { 0 } else { cfg.base_port + t as u16 };
        let addr = format!("{}:{port}", cfg.bind_host);
        let l = std::net::TcpListener::bind(&addr).map_err(|e| setup(&format!("cannot listen on {addr}"), e))?;

        l.set_nonblocking(true).map_err(|e| setup("listener", e))?;
        listeners.push(l);
    }
    let ports: Vec<u16> = listeners.iter().map(|l| l.local_addr().map(|a| a.port()).unwrap_or(0)).collect();

    let mut ctrl = connect_retry(&cfg.scheduler, cfg.connect_timeout)
        .map_err(|e| setup(&format!("cannot reach the scheduler at {}", cfg.scheduler), e))?;
    let advertise = match &cfg.advertise {
        Some(a) => a.clone(),
        None => ctrl.local_addr().map_err(|e| setup("local address", e))?.ip().to_string(),
    };
    let hostname = crate::hostname();
    let ns = cfg.namespace;
    let reg = Register {
        role: Role::Server,
        requested_rank: cfg.rank,
        hostname,
        addr: advertise.clone(),
        ports: ports.clone(),
        colocated: cfg.colocated,
        num_workers: cfg.num_workers,
        num_servers: cfg.num_servers,
    };
    write_control(&mut ctrl, &Control::Register(reg), ns).map_err(|e| setup("register", e))?;
    let welcome: Welcome = match read_control(&mut ctrl, ns) {
        Ok(Control::Welcome(w)) => w,
        Ok(Control::Error { message }) => return Err(ServerError::Rejected(message)),
        Ok(other) => return Err(ServerError::Setup(format!("expected Welcome, got {:?}", other.msg_type()))),
        Err(e) => return Err(ServerError::Setup(format!("no welcome from the scheduler: {e}"))),
    };
    let rank = welcome.rank;
    let first_slot: u32 = welcome.servers.iter().filter(|s| s.rank < rank).map(|s| s.ports.len() as u32).sum();
    log(
        Some(rank),
        &format!(
            "serving {} workers on {advertise} ports {ports:?} ({}), {} thread(s)",
            welcome.num_workers,
            if cfg.colocated { "colocated" } else { "CPU-only" },
            threads
        ),
    );

    // Spawn the shared-nothing threads.
    let mut cmd_txs = Vec::with_capacity(threads);
    let mut wakers: Vec<Waker> = Vec::with_capacity(threads);
    let mut joins = Vec::with_capacity(threads);
    for (t, l) in listeners.into_iter().enumerate() {
        let poll = Poll::new().map_err(|e| setup("poll", e))?;
        let mut listener = mio::net::TcpListener::from_std(l);
        let waker = ServerThread::setup(&poll, &mut listener).map_err(|e| setup("poll registration", e))?;
        // Bounded: the control thread waits for each Declare's ack anyway.
        let (tx, rx) = bounded(16);
        let tc = ThreadConfig {
            server: rank,
            thread: t as u32,
            slot: first_slot + t as u32,
            num_workers: welcome.num_workers,
            namespace: ns,
            partition_bytes: welcome.partition_bytes,
            stall: Duration::from_millis(welcome.stall_ms as u64),
        };
        let st = ServerThread::new(tc, poll, listener, rx);
        let j = std::thread::Builder::new()
            .name(format!("gradhub-server-t{t}"))
            .spawn(move || st.run())
            .map_err(|e| setup("spawn", e))?;
        cmd_txs.push(tx);
        wakers.push(waker);
        joins.push(j);
    }

    // Heartbeats go out from their own thread so a slow install never looks like death.
    let writer = Arc::new(Mutex::new(ctrl.try_clone().map_err(|e| setup("clone", e))?));
    let hb_period = Duration::from_millis(welcome.heartbeat_ms.max(10) as u64);
    let peer_timeout = (hb_period * 10).max(Duration::from_secs(10));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    {
        let writer = writer.clone();
        let stop = stop.clone();
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if let Ok(mut w) = writer.lock() {
                    if write_control(&mut *w, &Control::Heartbeat, ns).is_err() {
                        return;
                    }
                }
                std::thread::sleep(hb_period);
            }
        });
    }
    let _ = ctrl.set_read_timeout(Some(peer_timeout));
    let result = control_loop(rank, &mut ctrl, &writer, &cmd_txs, &wakers, ns, peer_timeout);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for (tx, w) in cmd_txs.iter().zip(&wakers) {
        let _ = tx.send(match &result {
            Ok(()) => ThreadCmd::Stop,
            Err(e) => ThreadCmd::Abort(e.to_string()),
        });
        let _ = w.wake();
    }
    for j in joins {
        let _ = j.join();
    }
    match &result {
        Ok(()) => log(Some(rank), "job complete, exiting"),
        Err(e) => log(Some(rank), &format!("{e}")),
    }
    result
}

fn control_loop(
    rank: u32,
    ctrl: &mut TcpStream,
    writer: &Mutex<TcpStream>,
    cmd_txs: &[crossbeam_channel::Sender<ThreadCmd>],
    wakers: &[Waker],
    ns: u32,
    peer_timeout: Duration,
) -> Result<(), ServerError> {
    loop {
        match read_control(ctrl, ns) {
            Ok(Control::Heartbeat) => {}
            Ok(Control::ServerDeclare { batch, specs }) => {
                let (ack_tx, ack_rx) = bounded(cmd_txs.len());
                for (tx, w) in cmd_txs.iter().zip(wakers) {
                    tx.send(ThreadCmd::Declare(specs.clone(), ack_tx.clone()))
                        .map_err(|_| ServerError::JobFailed("a server thread exited".into()))?;
                    let _ = w.wake();
                }
                for _ in cmd_txs {
                    ack_rx.recv().map_err(|_| ServerError::JobFailed("a server thread exited".into()))?;
                }
                let mut w = writer.lock().map_err(|_| ServerError::JobFailed("control writer poisoned".into()))?;
                write_control(&mut *w, &Control::ServerDeclareAck { batch }, ns)
                    .map_err(|e| ServerError::JobFailed(format!("lost the scheduler: {e}")))?;
            }
            Ok(Control::Shutdown) => return Ok(()),
            Ok(Control::PeerLost { role, rank: r, reason }) => {
                return Err(ServerError::JobFailed(format!("{} {r} lost: {reason}", role.name())))
            }
            Ok(Control::Error { message }) => return Err(ServerError::JobFailed(message)),
            Ok(other) => {
                log(Some(rank), &format!("ignoring unexpected {:?} from the scheduler", other.msg_type()));
            }
            Err(ReadError::Io(e)) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Err(ServerError::JobFailed(format!(
                    "scheduler silent for {:.0}s (no heartbeat)",
                    peer_timeout.as_secs_f64()
                )))
            }
            Err(e) => return Err(ServerError::JobFailed(format!("lost the scheduler: {e}"))),
        }
    }
}
