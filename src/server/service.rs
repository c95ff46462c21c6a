//! A server process of a shared service (`scheduler::service`): it offers
//! itself to the service once, then runs one ordinary server instance
//! (`run_server`) per job the service starts, each with that job's derived
//! token, namespace, ports and threads. Jobs share nothing but the process:
//! an instance's memory is freed when its job ends, however it ends.

use std::net::TcpStream;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, RecvTimeoutError};

use super::{run_server, ServerConfig, ServerError, Traffic};
use crate::protocol::auth::Secret;
use crate::protocol::{read_control, write_control, Control, JobTraffic, ReadError, ServiceJoin};
use crate::transport::{dial_until, Authed, Greeted, SealedWriter};

#[derive(Debug, Clone)]
pub struct ServiceServerConfig {
    /// What every job's instance is made of: threads, colocation, addresses,
    /// connect timeout. Its scheduler is the service; its port is ignored
    /// (each instance takes free ports, so jobs never collide).
    pub server: ServerConfig,
    /// The service's master secret (`auth::Secret::job_token`).
    pub master: Secret,
    /// The service silent for this long (it heartbeats every second) ends
    /// this process.
    pub peer_timeout: Duration,
}

struct Instance {
    job: String,
    /// Its `ServiceStart` (an elastic job starts again under its name).
    start: u64,
    traffic: Arc<Traffic>,
    join: JoinHandle<Result<(), ServerError>>,
}

/// The link to the service: its reading half on a thread of its own (so
/// the loop can report traffic every second), its writing half here.
struct Link {
    rx: crossbeam_channel::Receiver<Result<Control, ReadError>>,
    writer: SealedWriter<TcpStream>,
    reader: Option<JoinHandle<()>>,
}

impl Link {
    /// Offer this server to the service on `authed` (ServiceJoin).
    fn open(authed: Authed, join: &ServiceJoin, peer_timeout: Duration) -> std::io::Result<Link> {
        authed.stream.set_write_timeout(Some(peer_timeout))?;
        authed.stream.set_read_timeout(Some(peer_timeout))?;
        let (mut stream, mut writer) = authed.split()?;
        write_control(&mut writer, &Control::ServiceJoin(join.clone()), 0)?;
        let (tx, rx) = bounded::<Result<Control, ReadError>>(16);
        let reader = std::thread::Builder::new().name("gradhub-service-link".into()).spawn(move || loop {
            let msg = read_control(&mut stream, 0);
            let end = msg.is_err();
            if tx.send(msg).is_err() || end {
                return;
            }
        })?;
        Ok(Link { rx, writer, reader: Some(reader) })
    }

    fn close(&mut self) {
        let _ = self.writer.get_ref().shutdown(std::net::Shutdown::Both);
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
    }
}

/// Serve the service's jobs until the service goes away. A service lost
/// (closed, silent for the peer timeout) is dialled again for up to the
/// peer timeout: one restarted on its address gets this server again, and
/// the jobs' instances, which run on meanwhile, rejoin it by themselves
/// (`crate::session`).
pub fn run_service_server(cfg: ServiceServerConfig) -> Result<(), ServerError> {
    crate::logging::init();
    let service = cfg.server.scheduler.clone();
    let setup = |what: &str, e: std::io::Error| ServerError::Setup(format!("{what}: {e}"));
    let authed = crate::transport::connect_authenticated(&service, cfg.server.connect_timeout, &cfg.master)
        .map_err(|e| ServerError::Setup(format!("cannot join the service at {service}: {e}")))?;
    let advertise = match &cfg.server.advertise {
        Some(a) => a.clone(),
        None => authed.stream.local_addr().map_err(|e| setup("local address", e))?.ip().to_string(),
    };
    let mut server = cfg.server.clone();
    server.advertise = Some(advertise.clone());
    server.base_port = 0;
    let join = ServiceJoin {
        hostname: server.host.clone().unwrap_or_else(crate::host_id),
        addr: advertise.clone(),
        threads: server.threads.max(1) as u32,
        colocated: server.colocated,
    };
    let mut link = Link::open(authed, &join, cfg.peer_timeout).map_err(|e| setup("cannot join the service", e))?;
    log::info!(target: "server", "serving the jobs of the service at {service} (advertised as {advertise})");

    let mut instances: Vec<Instance> = Vec::new();
    // Instances that could not start or ended with an error: told once.
    let mut failed: Vec<JobTraffic> = Vec::new();
    let mut next_report = Instant::now();
    let result = loop {
        let lost = match link.rx.recv_timeout(Duration::from_millis(200)) {
            Ok(Ok(Control::ServiceStart { job, namespace, start, rank })) => {
                match start_instance(&server, &cfg.master, &job, namespace, start, rank) {
                    Ok(i) => instances.push(i),
                    Err(e) => {
                        log::error!(target: "server", "cannot start a server for job '{job}': {e}");
                        let error = format!("cannot start: {e}");
                        failed.push(JobTraffic { job, start, bytes: 0, rounds: 0, error });
                    }
                }
                None
            }
            Ok(Ok(Control::Heartbeat)) => None,
            Ok(Ok(Control::Error { message })) => break Err(ServerError::JobFailed(format!("the service: {message}"))),
            Ok(Ok(other)) => {
                log::warn!(target: "server", "ignoring {}", crate::session::unexpected(&other));
                None
            }
            Ok(Err(ReadError::TimedOut)) => Some(format!("it sent nothing for {:.1}s", cfg.peer_timeout.as_secs_f64())),
            Ok(Err(ReadError::Closed)) => Some("it closed the connection".to_string()),
            Ok(Err(e)) => Some(e.to_string()),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => Some("the service link ended".to_string()),
        };
        if lost.is_none() && next_report.elapsed() >= Duration::from_secs(1) {
            next_report = Instant::now();
            failed.extend(reap(&mut instances));
            let mut jobs: Vec<JobTraffic> = instances
                .iter()
                .map(|i| {
                    let (bytes, rounds) = i.traffic.get();
                    JobTraffic { job: i.job.clone(), start: i.start, bytes, rounds, error: String::new() }
                })
                .collect();
            let sent = failed.len();
            jobs.extend(failed.iter().cloned());
            match write_control(&mut link.writer, &Control::ServiceStats { jobs }, 0) {
                Ok(()) => drop(failed.drain(..sent)),
                Err(e) => {
                    // Read on: the reader finds the loss and says how.
                    log::debug!(target: "server", "reporting to the service at {service}: {e}");
                }
            }
        }
        let Some(why) = lost else { continue };
        link.close();
        match rejoin_service(&service, &cfg, &join, &why) {
            Ok(again) => link = again,
            Err(e) if idle(&mut instances, &mut failed) => {
                // Stopped with nothing of ours running: its normal end.
                log::info!(target: "server", "the service at {service} is gone ({e}), with no job running here; exiting");
                return Ok(());
            }
            Err(e) => break Err(ServerError::JobFailed(format!("lost the service at {service}: {e}"))),
        }
    };
    // The instances' jobs cannot go on without the service: they end with it.
    link.close();
    for i in instances {
        let _ = i.join.join();
    }
    result
}

/// Dial a lost service again for up to the peer timeout and offer this
/// server again.
fn rejoin_service(service: &str, cfg: &ServiceServerConfig, join: &ServiceJoin, why: &str) -> Result<Link, String> {
    let secs = cfg.peer_timeout.as_secs_f64();
    log::warn!(target: "server", "lost the service at {service}: {why}; dialling it again (for up to {secs:.1}s)");
    let since = Instant::now();
    let greet = |a: Authed| match Link::open(a, join, cfg.peer_timeout) {
        Ok(link) => Greeted::Done(link),
        Err(e) => Greeted::Again(e.to_string()),
    };
    match dial_until(service, since + cfg.peer_timeout, &cfg.master, || true, greet) {
        Ok(link) => {
            log::info!(target: "server", "the service at {service} is back: joined it again after {:.1}s", since.elapsed().as_secs_f64());
            Ok(link)
        }
        Err(f) => Err(format!("{why}, and it did not come back within {secs:.1}s: {}", f.why)),
    }
}

fn start_instance(
    template: &ServerConfig,
    master: &Secret,
    job: &str,
    namespace: u32,
    start: u64,
    rank: u32,
) -> Result<Instance, String> {
    let mut c = template.clone();
    c.rank = i32::try_from(rank).map_err(|_| format!("rank {rank} out of range"))?;
    // The job's derived token, encrypting as the service does.
    c.secret = master.key_for(job).for_job(job).map_err(|e| e.to_string())?;
    c.namespace = namespace;
    c.traffic = Arc::default();
    c.metrics_addr = None; // one instance per job: the service's scheduler reports them
    let traffic = c.traffic.clone();
    let join = std::thread::Builder::new()
        .name(format!("gradhub-job-{job}"))
        .spawn(move || run_server(c))
        .map_err(|e| e.to_string())?;
    log::info!(target: "server", "job '{job}': server started");
    Ok(Instance { job: job.to_string(), start, traffic, join })
}

/// Whether no job runs here (once the instances whose job ended are
/// joined; those that ended with an error join `failed`).
fn idle(instances: &mut Vec<Instance>, failed: &mut Vec<JobTraffic>) -> bool {
    failed.extend(reap(instances));
    instances.is_empty()
}

/// Join the instances whose job ended, logging how; the ones that ended
/// with an error, for the service.
fn reap(instances: &mut Vec<Instance>) -> Vec<JobTraffic> {
    let (done, running): (Vec<Instance>, Vec<Instance>) = instances.drain(..).partition(|i| i.join.is_finished());
    *instances = running;
    let mut failed = Vec::new();
    for i in done {
        let (bytes, rounds) = i.traffic.get();
        let error = match i.join.join() {
            Ok(Ok(())) => {
                log::info!(target: "server", "job '{}': complete, its server's memory is freed", i.job);
                continue;
            }
            Ok(Err(e)) => {
                // Its job's members report the job's end (an elastic job's
                // generation ends so, and the job goes on): the service's
                // side of it is only this.
                let why = match &e {
                    ServerError::JobFailed(why) => why.clone(),
                    other => other.to_string(),
                };
                log::info!(target: "server", "job '{}': its server ended ({why}); its memory is freed", i.job);
                e.to_string()
            }
            Err(_) => {
                log::error!(target: "server", "job '{}': its server panicked", i.job);
                "its server panicked".to_string()
            }
        };
        failed.push(JobTraffic { job: i.job, start: i.start, bytes, rounds, error });
    }
    failed
}
