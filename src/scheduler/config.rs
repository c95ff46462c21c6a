//! The scheduler's configuration (`SchedulerConfig`), its check, and the
//! errors of a job as a whole (`SchedulerError`).

use super::racks::RackMode;
use crate::protocol::auth::Secret;
use crate::settings::defaults;
use crate::sum_order::SumOrder;

#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Address to listen on, e.g. "0.0.0.0:9000".
    pub bind: String,
    pub num_workers: u32,
    pub num_servers: u32,
    pub partition_bytes: u32,
    /// Heartbeat period of every member (at most a quarter of the peer timeout).
    pub heartbeat_ms: u32,
    /// A member silent for this long is declared dead.
    pub peer_timeout_ms: u32,
    /// Servers report rounds that waited longer than this.
    pub stall_ms: u32,
    /// Registration must complete within this time.
    pub join_timeout_ms: u32,
    pub namespace: u32,
    /// Workers on one host sum there first (see `placement::HostLayout`);
    /// off: every worker pushes everything itself, as with one per host.
    pub host_reduce: bool,
    /// A lost server's chunks move to the other servers and training goes
    /// on (`failover`); off: losing a server fails the job.
    pub failover: bool,
    /// Reduce within racks before the core (`racks`): PHub's model decides
    /// from the bandwidths (Gbit/s, 0: not given), or forced.
    pub rack_reduce: RackMode,
    pub link_gbit: f64,
    pub core_gbit: f64,
    /// The job's token: every connection proves it (`protocol::auth`).
    pub secret: Secret,
    /// Limits of a job on a shared service (0: none): tensors declared at
    /// once, and their bytes (what the servers hold for it).
    pub max_tensors: u32,
    pub max_bytes: u64,
    /// Serve Prometheus metrics on this address (`--metrics-addr`); not for a service's jobs.
    pub metrics_addr: Option<String>,
    /// The order every sum of the job adds its contributions in
    /// (`GRADHUB_DETERMINISTIC`): a member registering with another is refused.
    pub sum_order: SumOrder,
    /// Synchronous or asynchronous (`crate::training`): a member registering
    /// with another mode is refused.
    pub training: crate::training::Training,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            bind: "0.0.0.0:0".into(),
            num_workers: 1,
            num_servers: 1,
            partition_bytes: defaults::PARTITION_BYTES,
            heartbeat_ms: 1000,
            peer_timeout_ms: defaults::PEER_TIMEOUT_MS,
            stall_ms: defaults::STALL_MS,
            join_timeout_ms: defaults::JOIN_TIMEOUT_MS,
            namespace: defaults::NAMESPACE,
            // GRADHUB_HOST_REDUCE: on; off by default in the asynchronous mode (`src/python/config.rs`).
            host_reduce: true,
            failover: defaults::FAILOVER,
            rack_reduce: RackMode::parse(defaults::RACK_REDUCE).expect("GRADHUB_RACK_REDUCE's default is a mode"),
            link_gbit: defaults::LINK_GBIT,
            core_gbit: defaults::CORE_GBIT,
            secret: Secret::none(),
            max_tensors: 0,
            max_bytes: 0,
            metrics_addr: None,
            sum_order: SumOrder::deterministic(defaults::DETERMINISTIC),
            training: crate::training::Training::default_mode(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SchedulerError {
    #[error("scheduler cannot listen on {addr}: {err}")]
    Bind { addr: String, err: std::io::Error },
    #[error("invalid scheduler configuration: {0}")]
    Config(String),
    #[error("job failed: {0}")]
    JobFailed(String),
}

/// The configuration, checked, with the heartbeat fitted to the timeout.
pub(super) fn checked(cfg: SchedulerConfig) -> Result<SchedulerConfig, SchedulerError> {
    if cfg.num_workers == 0 || cfg.num_servers == 0 {
        return Err(SchedulerError::Config("need at least one worker and one server".into()));
    }
    if cfg.partition_bytes < 4 {
        return Err(SchedulerError::Config("partition size must be at least 4 bytes".into()));
    }
    // Every member waits this long for a heartbeat: it must span a few of them.
    if cfg.peer_timeout_ms < cfg.heartbeat_ms.max(10).saturating_mul(2) {
        return Err(SchedulerError::Config(format!(
            "peer timeout ({} ms) must be at least twice the heartbeat period ({} ms)",
            cfg.peer_timeout_ms, cfg.heartbeat_ms
        )));
    }
    // At least four heartbeats per peer timeout, so that one late heartbeat
    // (a busy machine) does not look like a death.
    let mut cfg = cfg;
    cfg.heartbeat_ms = cfg.heartbeat_ms.min(cfg.peer_timeout_ms / 4).max(10);
    Ok(cfg)
}
