//! gradhub core: the gradient-synchronization data plane.
//!
//! Modules by role and concern:
//! - `protocol`: frame header, control messages, validation
//! - `transport`: nonblocking socket helpers shared by server and client
//! - `kernels`: vectorized summation (f32, f16, bf16)
//! - `placement`: chunk -> server-thread mapping (BytePS-weighted)
//! - `scheduler`: rendezvous, declarations, liveness
//! - `server`: the summation service (shared-nothing threads)
//! - `client`: the worker's communication service (priority + credit)
//! - `python` (feature "python"): the PyO3 extension `gradhub._core`

pub mod baseline;
pub mod client;
pub mod kernels;
pub mod placement;
pub mod protocol;
pub mod scheduler;
pub mod server;
pub mod transport;

#[cfg(feature = "python")]
mod python;

/// Default chunk size. See docs/benchmarks.md for the measurement behind it.
pub const DEFAULT_PARTITION_BYTES: u32 = 256 << 10;
/// Default per-connection credit (bytes in flight). See docs/benchmarks.md.
pub const DEFAULT_CREDIT_BYTES: usize = 512 << 10;

/// This machine's host name (used to compute local ranks).
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".into())
}
