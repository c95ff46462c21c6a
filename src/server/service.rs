//! A server process of a shared service (`scheduler::service`): it offers
//! itself to the service once, then runs one ordinary server instance
//! (`run_server`) per job the service starts, each with that job's derived
//! token, namespace, ports and threads. Jobs share nothing but the process:
//! an instance's memory is freed when its job ends, however it ends.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, RecvTimeoutError};

use super::{run_server, ServerConfig, ServerError, Traffic};
use crate::protocol::auth::Secret;
use crate::protocol::{read_control, write_control, Control, JobTraffic, ReadError, ServiceJoin};

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

/// Serve the service's jobs until the service goes away.
pub fn run_service_server(cfg: ServiceServerConfig) -> Result<(), ServerError> {
    crate::logging::init();
    let service = cfg.server.scheduler.clone();
    let setup = |what: &str, e: std::io::Error| ServerError::Setup(format!("{what}: {e}"));
    let stream = crate::transport::connect_authenticated(&service, cfg.server.connect_timeout, &cfg.master)
        .map_err(|e| ServerError::Setup(format!("cannot join the service at {service}: {e}")))?;
    let advertise = match &cfg.server.advertise {
        Some(a) => a.clone(),
        None => stream.stream.local_addr().map_err(|e| setup("local address", e))?.ip().to_string(),
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
    stream.stream.set_write_timeout(Some(cfg.peer_timeout)).map_err(|e| setup("socket", e))?;
    stream.stream.set_read_timeout(Some(cfg.peer_timeout)).map_err(|e| setup("socket", e))?;
    let (mut stream, mut writer) = stream.split().map_err(|e| setup("socket", e))?;
    write_control(&mut writer, &Control::ServiceJoin(join), 0).map_err(|e| setup("cannot join the service", e))?;
    log::info!(target: "server", "serving the jobs of the service at {service} (advertised as {advertise})");

    // A reader thread, so this loop can report traffic every second.
    let (tx, rx) = bounded::<Result<Control, ReadError>>(16);
    let reader = {
        std::thread::Builder::new()
            .name("gradhub-service-link".into())
            .spawn(move || loop {
                let msg = read_control(&mut stream, 0);
                let end = msg.is_err();
                if tx.send(msg).is_err() || end {
                    return;
                }
            })
            .map_err(|e| setup("spawn", e))?
    };
    let mut instances: Vec<Instance> = Vec::new();
    // Instances that could not start or ended with an error: told once.
    let mut failed: Vec<JobTraffic> = Vec::new();
    let mut next_report = Instant::now();
    let result = loop {
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(Ok(Control::ServiceStart { job, namespace, start, rank })) => {
                match start_instance(&server, &cfg.master, &job, namespace, start, rank) {
                    Ok(i) => instances.push(i),
                    Err(e) => {
                        log::error!(target: "server", "cannot start a server for job '{job}': {e}");
                        let error = format!("cannot start: {e}");
                        failed.push(JobTraffic { job, start, bytes: 0, rounds: 0, error });
                    }
                }
            }
            Ok(Ok(Control::Heartbeat)) => {}
            Ok(Ok(Control::Error { message })) => break Err(ServerError::JobFailed(format!("the service: {message}"))),
            Ok(Ok(other)) => log::warn!(target: "server", "ignoring {}", crate::session::unexpected(&other)),
            Ok(Err(ReadError::TimedOut)) => {
                break Err(ServerError::JobFailed(format!(
                    "the service at {service} sent nothing for {:.1}s",
                    cfg.peer_timeout.as_secs_f64()
                )))
            }
            Ok(Err(ReadError::Closed)) if idle(&mut instances, &mut failed) => {
                // Stopped with nothing of ours running: its normal end.
                log::info!(target: "server", "the service at {service} closed, with no job running here; exiting");
                break Ok(());
            }
            Ok(Err(e)) => break Err(ServerError::JobFailed(format!("lost the service at {service}: {e}"))),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => break Err(ServerError::JobFailed("the service link ended".into())),
        }
        if next_report.elapsed() >= Duration::from_secs(1) {
            next_report = Instant::now();
            failed.extend(reap(&mut instances));
            let mut jobs: Vec<JobTraffic> = instances
                .iter()
                .map(|i| {
                    let (bytes, rounds) = i.traffic.get();
                    JobTraffic { job: i.job.clone(), start: i.start, bytes, rounds, error: String::new() }
                })
                .collect();
            jobs.append(&mut failed);
            if let Err(e) = write_control(&mut writer, &Control::ServiceStats { jobs }, 0) {
                break Err(ServerError::JobFailed(format!("lost the service at {service}: {e}")));
            }
        }
    };
    // The instances' jobs cannot go on without the service: they end with it.
    let _ = writer.get_ref().shutdown(std::net::Shutdown::Both);
    let _ = reader.join();
    for i in instances {
        let _ = i.join.join();
    }
    result
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
