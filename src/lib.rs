//! gradhub core: the gradient-synchronization data plane.
//!
//! Modules by role and concern:
//! - `protocol`: frame header, control messages, the one frame reader, the
//!   authentication handshake
//! - `transport`: the framed nonblocking data connection shared by server and
//!   client, connect-with-retry, byte views
//! - `session`: a member's membership in a job (join, heartbeats, liveness),
//!   shared by workers and servers
//! - `kernels`: vectorized summation (f32, f16, bf16)
//! - `placement`: chunk -> server-thread mapping (BytePS-weighted)
//! - `scheduler`: rendezvous, declarations, liveness
//! - `server`: the summation service (shared-nothing threads)
//! - `client`: the worker's communication service (priority + credit)
//! - `peer`: point-to-point between workers (torch's send and recv)
//! - `host`: what a host's workers and its server share (host-stage sums,
//!   pushes by reference)
//! - `sum_order`: deterministic sums (`GRADHUB_DETERMINISTIC`): rank-order adds
//! - `training`: the training mode (`GRADHUB_ASYNC`, `GRADHUB_STALENESS`)
//! - `timeline`: servers' and workers' chunk timelines (Chrome traces)
//! - `metrics`: Prometheus metrics of the scheduler, servers and the service
//! - `waits`: stall watches and the message when a needed worker left
//! - `error`: the one error type of the entry points (for the bindings)
//! - `logging`: one log format for every role (`GRADHUB_LOG`)
//! - `settings`: every `GRADHUB_*` setting, declared once; the only reader
//!   of the environment, and a leaf (it uses no other module)
//! - `python` (feature "python"): the PyO3 extension `gradhub._core`

pub mod client;
pub mod error;
pub(crate) mod host;
pub mod kernels;
pub mod logging;
pub mod metrics;
pub mod peer;
pub mod placement;
pub mod protocol;
pub mod scheduler;
pub mod server;
pub mod session;
pub mod settings;
pub mod sum_order;
pub mod timeline;
pub mod training;
pub mod transport;
pub mod waits;

#[cfg(feature = "python")]
mod python;

/// Default chunk size (`settings::defaults`). See docs/benchmarks.md for the
/// measurement behind it.
pub use settings::defaults::PARTITION_BYTES as DEFAULT_PARTITION_BYTES;
/// Least per-connection credit (bytes in flight). See docs/benchmarks.md.
pub const DEFAULT_CREDIT_BYTES: usize = 512 << 10;
/// The default credit holds at least this many chunks: credit comes back
/// only when a chunk has arrived whole, so a window of one or two large
/// chunks sends in bursts and idles the link for a round trip between them
/// (256 KiB chunks under 512 KiB of credit cost up to 8 % in training;
/// docs/benchmarks.md, "Chunk size and credit").
pub const CREDIT_CHUNKS: usize = 4;

/// The credit per connection when `GRADHUB_CREDIT_BYTES` is not set: the
/// larger of `DEFAULT_CREDIT_BYTES` and `CREDIT_CHUNKS` of the job's chunks.
pub fn default_credit_bytes(partition_bytes: u32) -> usize {
    DEFAULT_CREDIT_BYTES.max(CREDIT_CHUNKS * partition_bytes as usize)
}
/// Default spread (`client::io::Spread`), in least credits: 2 MiB. Only where
/// a worker's placed shares differ across its connections (see
/// `client::io::admission::uneven`). See docs/benchmarks.md.
pub const SPREAD_CREDITS: usize = 4;

/// This member's host identity: which workers share a machine (and its
/// memory). `GRADHUB_HOST_ID` if set; else the host name and the network
/// namespace, so hosts emulated as namespaces on one machine count as
/// separate hosts, as they are for the network.
pub fn host_id() -> String {
    if let Some(id) = settings::host_id() {
        return id;
    }
    match std::fs::read_link("/proc/self/ns/net") {
        Ok(ns) => format!("{} {}", hostname(), ns.display()),
        Err(_) => hostname(),
    }
}

/// This machine's host name.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(settings::hostname_var)
        .unwrap_or_else(|| "localhost".into())
}
