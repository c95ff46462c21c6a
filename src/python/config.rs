//! The typed config objects Python builds and passes into the extension
//! (`gradhub._core.ClientConfig`, `SchedulerConfig`, `ServerConfig`,
//! `ServiceConfig`, `ServiceServerConfig`), wrapping the Rust configs, and
//! the settings registry as Python sees it (`settings()`). Every keyword is
//! optional: None takes the Rust `Default` impl's value, so each default
//! exists once.

use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::client::ClientConfig;
use crate::protocol::auth::Secret;
use crate::scheduler::{RackMode, SchedulerConfig, ServiceConfig};
use crate::server::{ServerConfig, ServiceServerConfig};
use crate::settings::{Setting, SETTINGS};
use crate::sum_order::SumOrder;

/// The job's token (`None` or empty: no token, see `protocol::auth`),
/// encrypting every connection if `encrypt` says so (None:
/// `GRADHUB_ENCRYPT`, read by every role so that a process started without
/// the argument still agrees).
pub(super) fn secret_of(token: Option<String>, encrypt: Option<bool>) -> PyResult<Secret> {
    let encrypt = match encrypt {
        Some(on) => on,
        None => crate::settings::read_flag("GRADHUB_ENCRYPT").map_err(PyValueError::new_err)?.unwrap_or(false),
    };
    let secret = token.map(|t| Secret::new(t.as_bytes())).unwrap_or_else(Secret::none);
    secret.encrypted(encrypt).map_err(|e| PyValueError::new_err(e.to_string()))
}

/// A member's token, announced as job `job` of a shared service if given,
/// and the namespace its frames carry (a service job's is derived from its
/// name).
fn member_secret(
    token: Option<String>,
    encrypt: Option<bool>,
    job: Option<String>,
    namespace: u32,
) -> PyResult<(Secret, u32)> {
    match job.filter(|j| !j.is_empty()) {
        None => Ok((secret_of(token, encrypt)?, namespace)),
        Some(j) => {
            let s = secret_of(token, encrypt)?.for_job(&j).map_err(|e| PyValueError::new_err(e.to_string()))?;
            // On a shared service the name decides the namespace.
            Ok((s, crate::protocol::auth::job_namespace(&j)))
        }
    }
}

/// Seconds from Python as a Duration (negative: zero).
fn seconds(s: f64) -> Duration {
    Duration::from_secs_f64(s.max(0.0))
}

/// The job's sum order: as given, else `GRADHUB_DETERMINISTIC` (every
/// role reads it, so a process started without the argument still agrees).
fn sum_order(deterministic: Option<bool>) -> SumOrder {
    deterministic.map_or_else(SumOrder::from_env, SumOrder::deterministic)
}

/// The job's training mode: as given, else `GRADHUB_ASYNC` and
/// `GRADHUB_STALENESS` (read by every role, as the sum order is).
fn training(asynchronous: Option<bool>, staleness: Option<u32>) -> PyResult<crate::training::Training> {
    let t = match asynchronous {
        Some(on) => crate::training::Training::from_env()
            .and_then(|env| crate::training::Training::new(on, staleness.or(env.staleness()))),
        None => crate::training::Training::from_env().and_then(|t| match staleness {
            Some(s) => crate::training::Training::new(t.is_asynchronous(), Some(s)),
            None => Ok(t),
        }),
    };
    t.map_err(PyValueError::new_err)
}

/// A worker's config (`client::ClientConfig`).
#[pyclass(module = "gradhub._core", name = "ClientConfig", frozen)]
pub(super) struct PyClientConfig {
    pub(super) cfg: ClientConfig,
}

#[pymethods]
impl PyClientConfig {
    #[new]
    #[pyo3(signature = (scheduler, rank=None, num_workers=None, num_servers=None, namespace=None, credit_bytes=None, spread_bytes=None, connect_timeout=None, local_rank=None, local_size=None, server_shm=None, token=None, job=None, rack=None, deterministic=None, elastic=None, asynchronous=None, staleness=None, encrypt=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        scheduler: String,
        rank: Option<i32>,
        num_workers: Option<u32>,
        num_servers: Option<u32>,
        namespace: Option<u32>,
        credit_bytes: Option<usize>,
        spread_bytes: Option<usize>,
        connect_timeout: Option<f64>,
        local_rank: Option<i32>,
        local_size: Option<i32>,
        server_shm: Option<bool>,
        token: Option<String>,
        job: Option<String>,
        rack: Option<String>,
        deterministic: Option<bool>,
        elastic: Option<(u32, u32, u32, i32)>,
        asynchronous: Option<bool>,
        staleness: Option<u32>,
        encrypt: Option<bool>,
    ) -> PyResult<Self> {
        let d = ClientConfig::default();
        let (secret, namespace) = member_secret(token, encrypt, job, namespace.unwrap_or(d.namespace))?;
        let cfg = ClientConfig {
            scheduler,
            rank: rank.unwrap_or(d.rank),
            num_workers: num_workers.unwrap_or(d.num_workers),
            num_servers: num_servers.unwrap_or(d.num_servers),
            namespace,
            credit_bytes: credit_bytes.or(d.credit_bytes),
            spread_bytes: spread_bytes.or(d.spread_bytes),
            connect_timeout: connect_timeout.map(seconds).unwrap_or(d.connect_timeout),
            local_rank: local_rank.unwrap_or(d.local_rank),
            local_size: local_size.unwrap_or(d.local_size),
            // GRADHUB_HOST_ID, read by crate::host_id.
            host: d.host,
            server_shm: server_shm.unwrap_or(d.server_shm),
            secret,
            rack: rack.unwrap_or(d.rack),
            sum_order: sum_order(deterministic),
            training: training(asynchronous, staleness)?,
            elastic: elastic.map(|(min_workers, max_workers, initial, prev_rank)| crate::protocol::ElasticReg {
                min_workers,
                max_workers,
                initial,
                prev_rank,
            }),
        };
        Ok(PyClientConfig { cfg })
    }
    fn __repr__(&self) -> String {
        format!("{:?}", self.cfg)
    }
}

/// A job's scheduler config (`scheduler::SchedulerConfig`); a shared
/// service's per-job part too (`ServiceConfig(job=...)`).
#[pyclass(module = "gradhub._core", name = "SchedulerConfig", frozen)]
pub(super) struct PySchedulerConfig {
    pub(super) cfg: SchedulerConfig,
}

#[pymethods]
impl PySchedulerConfig {
    #[new]
    #[pyo3(signature = (bind=None, num_workers=None, num_servers=None, partition_bytes=None, heartbeat_ms=None, peer_timeout_ms=None, stall_ms=None, join_timeout_ms=None, namespace=None, host_reduce=None, failover=None, token=None, rack_reduce=None, link_gbit=None, core_gbit=None, max_tensors=None, max_bytes=None, metrics_addr=None, deterministic=None, asynchronous=None, staleness=None, encrypt=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        bind: Option<String>,
        num_workers: Option<u32>,
        num_servers: Option<u32>,
        partition_bytes: Option<u32>,
        heartbeat_ms: Option<u32>,
        peer_timeout_ms: Option<u32>,
        stall_ms: Option<u32>,
        join_timeout_ms: Option<u32>,
        namespace: Option<u32>,
        host_reduce: Option<bool>,
        failover: Option<bool>,
        token: Option<String>,
        rack_reduce: Option<String>,
        link_gbit: Option<f64>,
        core_gbit: Option<f64>,
        max_tensors: Option<u32>,
        max_bytes: Option<u64>,
        metrics_addr: Option<String>,
        deterministic: Option<bool>,
        asynchronous: Option<bool>,
        staleness: Option<u32>,
        encrypt: Option<bool>,
    ) -> PyResult<Self> {
        let d = SchedulerConfig::default();
        let rack_reduce = match rack_reduce {
            None => d.rack_reduce,
            Some(mode) => RackMode::parse(&mode)
                .ok_or_else(|| PyValueError::new_err(format!("rack_reduce must be auto, on or off, not '{mode}'")))?,
        };
        let (link_gbit, core_gbit) = (link_gbit.unwrap_or(d.link_gbit), core_gbit.unwrap_or(d.core_gbit));
        if !(link_gbit >= 0.0 && core_gbit >= 0.0 && link_gbit.is_finite() && core_gbit.is_finite()) {
            return Err(PyValueError::new_err("bandwidths must be finite and not negative"));
        }
        let training = training(asynchronous, staleness)?;
        let cfg = SchedulerConfig {
            bind: bind.unwrap_or(d.bind),
            num_workers: num_workers.unwrap_or(d.num_workers),
            num_servers: num_servers.unwrap_or(d.num_servers),
            partition_bytes: partition_bytes.unwrap_or(d.partition_bytes),
            heartbeat_ms: heartbeat_ms.unwrap_or(d.heartbeat_ms),
            peer_timeout_ms: peer_timeout_ms.unwrap_or(d.peer_timeout_ms),
            stall_ms: stall_ms.unwrap_or(d.stall_ms),
            join_timeout_ms: join_timeout_ms.unwrap_or(d.join_timeout_ms),
            namespace: namespace.unwrap_or(d.namespace),
            // Unset: the host stage would make host mates wait for each
            // other, so the asynchronous mode turns it off.
            host_reduce: host_reduce.unwrap_or(d.host_reduce && !training.is_asynchronous()),
            failover: failover.unwrap_or(d.failover),
            rack_reduce,
            link_gbit,
            core_gbit,
            secret: secret_of(token, encrypt)?,
            max_tensors: max_tensors.unwrap_or(d.max_tensors),
            max_bytes: max_bytes.unwrap_or(d.max_bytes),
            metrics_addr: metrics_addr.or(d.metrics_addr),
            sum_order: sum_order(deterministic),
            training,
        };
        Ok(PySchedulerConfig { cfg })
    }
    fn __repr__(&self) -> String {
        format!("{:?}", self.cfg)
    }
}

/// A summation server's config (`server::ServerConfig`); a service
/// server's per-job instances too (`ServiceServerConfig(server=...)`).
#[pyclass(module = "gradhub._core", name = "ServerConfig", frozen)]
pub(super) struct PyServerConfig {
    pub(super) cfg: ServerConfig,
}

#[pymethods]
impl PyServerConfig {
    #[new]
    #[pyo3(signature = (scheduler, threads=None, colocated=None, advertise=None, bind_host=None, base_port=None, rank=None, num_workers=None, num_servers=None, namespace=None, connect_timeout=None, token=None, timeline=None, rack=None, metrics_addr=None, deterministic=None, asynchronous=None, staleness=None, encrypt=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        scheduler: String,
        threads: Option<usize>,
        colocated: Option<bool>,
        advertise: Option<String>,
        bind_host: Option<String>,
        base_port: Option<u16>,
        rank: Option<i32>,
        num_workers: Option<u32>,
        num_servers: Option<u32>,
        namespace: Option<u32>,
        connect_timeout: Option<f64>,
        token: Option<String>,
        timeline: Option<String>,
        rack: Option<String>,
        metrics_addr: Option<String>,
        deterministic: Option<bool>,
        asynchronous: Option<bool>,
        staleness: Option<u32>,
        encrypt: Option<bool>,
    ) -> PyResult<Self> {
        let d = ServerConfig::default();
        let cfg = ServerConfig {
            scheduler,
            threads: threads.unwrap_or(d.threads).max(1),
            colocated: colocated.unwrap_or(d.colocated),
            advertise: advertise.or(d.advertise),
            bind_host: bind_host.unwrap_or(d.bind_host),
            base_port: base_port.unwrap_or(d.base_port),
            rank: rank.unwrap_or(d.rank),
            num_workers: num_workers.unwrap_or(d.num_workers),
            num_servers: num_servers.unwrap_or(d.num_servers),
            namespace: namespace.unwrap_or(d.namespace),
            connect_timeout: connect_timeout.map(seconds).unwrap_or(d.connect_timeout),
            // GRADHUB_HOST_ID, read by crate::host_id.
            host: d.host,
            secret: secret_of(token, encrypt)?,
            traffic: d.traffic,
            timeline: timeline.or(d.timeline),
            rack: rack.unwrap_or(d.rack),
            metrics_addr: metrics_addr.or(d.metrics_addr),
            sum_order: sum_order(deterministic),
            training: training(asynchronous, staleness)?,
        };
        Ok(PyServerConfig { cfg })
    }
    fn __repr__(&self) -> String {
        format!("{:?}", self.cfg)
    }
}

/// A shared service's config (`scheduler::ServiceConfig`): `token` is the
/// master every job's token derives from; `job` what each job gets.
#[pyclass(module = "gradhub._core", name = "ServiceConfig", frozen)]
pub(super) struct PyServiceConfig {
    pub(super) cfg: ServiceConfig,
}

#[pymethods]
impl PyServiceConfig {
    #[new]
    #[pyo3(signature = (bind, token, job=None, max_jobs=None, max_workers=None, max_pending=None, metrics_addr=None, encrypt=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        bind: String,
        token: String,
        job: Option<PyRef<'_, PySchedulerConfig>>,
        max_jobs: Option<u32>,
        max_workers: Option<u32>,
        max_pending: Option<usize>,
        metrics_addr: Option<String>,
        encrypt: Option<bool>,
    ) -> PyResult<Self> {
        let d = ServiceConfig::default();
        let cfg = ServiceConfig {
            bind,
            master: secret_of(Some(token), encrypt)?,
            job: job.map(|j| j.cfg.clone()).unwrap_or(d.job),
            max_jobs: max_jobs.unwrap_or(d.max_jobs),
            max_workers: max_workers.unwrap_or(d.max_workers),
            max_pending: max_pending.unwrap_or(d.max_pending),
            metrics_addr: metrics_addr.or(d.metrics_addr),
        };
        Ok(PyServiceConfig { cfg })
    }
    #[getter]
    fn max_jobs(&self) -> u32 {
        self.cfg.max_jobs
    }
    #[getter]
    fn max_workers(&self) -> u32 {
        self.cfg.max_workers
    }
    fn __repr__(&self) -> String {
        format!("{:?}", self.cfg)
    }
}

/// A server of a shared service (`server::ServiceServerConfig`): `server`
/// is what each job's instance is made of, `token` the service's master.
#[pyclass(module = "gradhub._core", name = "ServiceServerConfig", frozen)]
pub(super) struct PyServiceServerConfig {
    pub(super) cfg: ServiceServerConfig,
}

#[pymethods]
impl PyServiceServerConfig {
    #[new]
    #[pyo3(signature = (server, token, peer_timeout=None, encrypt=None))]
    fn new(
        server: PyRef<'_, PyServerConfig>,
        token: String,
        peer_timeout: Option<f64>,
        encrypt: Option<bool>,
    ) -> PyResult<Self> {
        // The service's own peer timeout is a job's default one.
        let d = Duration::from_millis(u64::from(SchedulerConfig::default().peer_timeout_ms));
        let cfg = ServiceServerConfig {
            server: server.cfg.clone(),
            master: secret_of(Some(token), encrypt)?,
            peer_timeout: peer_timeout.map(|s| Duration::from_secs_f64(s.max(0.1))).unwrap_or(d),
        };
        Ok(PyServiceServerConfig { cfg })
    }
    fn __repr__(&self) -> String {
        format!("{:?}", self.cfg)
    }
}

/// One row of the settings registry: (name, kind, default as written or
/// None, the default as the docs show it, roles, help, choices, aliases,
/// tier: user, advanced or internal).
type SettingRow = (
    &'static str,
    &'static str,
    Option<String>,
    String,
    Vec<&'static str>,
    &'static str,
    Vec<&'static str>,
    Vec<&'static str>,
    &'static str,
);

fn row(s: &Setting) -> SettingRow {
    let choices = match s.kind {
        crate::settings::Kind::Choice(c) => c.to_vec(),
        _ => Vec::new(),
    };
    (
        s.name,
        s.kind.name(),
        s.default_value(),
        s.default_doc(),
        s.roles.iter().map(|r| r.name()).collect(),
        s.help,
        choices,
        s.aliases.to_vec(),
        s.tier.name(),
    )
}

/// Every GRADHUB_* setting (`crate::settings::SETTINGS`), for `_env.py`.
#[pyfunction]
pub(super) fn settings() -> Vec<SettingRow> {
    SETTINGS.iter().map(row).collect()
}
