//! What a worker is configured with (`ClientConfig`) and the errors its
//! entry points return (`ClientError`).

use std::time::Duration;

use crate::protocol::auth::Secret;
use crate::session::SessionError;
use crate::settings::defaults;
use crate::sum_order::SumOrder;

#[derive(Debug, Clone)]
pub struct ClientConfig {
    pub scheduler: String,
    pub rank: i32,
    pub num_workers: u32,
    pub num_servers: u32,
    pub namespace: u32,
    /// Max bytes in flight per server-thread connection; None:
    /// `crate::default_credit_bytes` of the job's chunk size.
    pub credit_bytes: Option<usize>,
    /// How many bytes, in the job-wide order, may stand between the next
    /// chunk this worker sends and its oldest one not yet received by its
    /// server (`io::Spread`). None: 2 MiB where the shares placed on the
    /// connections are uneven, else no limit (`io::admission::uneven`);
    /// Some(0): no limit.
    pub spread_bytes: Option<usize>,
    pub connect_timeout: Duration,
    /// This worker's local rank and the number of workers on its host, as
    /// the launcher says (-1: not given, the scheduler assigns them by rank
    /// order among workers with the same `crate::host_id`).
    pub local_rank: i32,
    pub local_size: i32,
    /// This worker's host identity (default `crate::host_id()`): workers
    /// with the same one share memory and sum there first.
    pub host: Option<String>,
    /// Push the host's sums to a server on this host by reference, through
    /// shared memory (host stage only), instead of over loopback TCP.
    pub server_shm: bool,
    /// The job's token: every connection proves it (`protocol::auth`).
    pub secret: Secret,
    /// This worker's rack (`GRADHUB_RACK`), if racks are used.
    pub rack: String,
    /// The order the host stage adds contributions in (`GRADHUB_DETERMINISTIC`):
    /// the same on every member (the scheduler checks).
    pub sum_order: SumOrder,
    /// Synchronous or asynchronous (`crate::training`): the same on every member.
    pub training: crate::training::Training,
    /// A worker of an elastic job on a shared service: its bounds and its
    /// rank in the previous generation (`scheduler::elastic`).
    pub elastic: Option<crate::protocol::ElasticReg>,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            scheduler: "127.0.0.1:9000".into(),
            rank: -1,
            num_workers: 0,
            num_servers: 0,
            namespace: defaults::NAMESPACE,
            credit_bytes: None,
            spread_bytes: None,
            connect_timeout: Duration::from_secs(defaults::CONNECT_TIMEOUT_SECS),
            local_rank: -1,
            local_size: -1,
            host: None,
            server_shm: defaults::SERVER_SHM,
            secret: Secret::none(),
            rack: defaults::RACK.into(),
            sum_order: SumOrder::deterministic(defaults::DETERMINISTIC),
            training: crate::training::Training::default_mode(),
            elastic: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot join the job: {0}")]
    Setup(String),
    #[error("cannot join the job: {0}")]
    Session(#[from] SessionError),
    #[error("{0}")]
    Usage(String),
    #[error("{0}")]
    Failed(String),
}
