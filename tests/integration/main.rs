//! In-process integration tests of the Rust core: a scheduler, servers and
//! clients (real ones, or fake ones on raw sockets) in one process.
//!
//! - `auth`: the token handshake: wrong tokens, replays, rogue members and servers
//! - `encryption`: an encrypted job's sums, and members whose setting differs
//! - `membership`: registration, ranks, Welcome, liveness, end of job
//! - `declarations`: tensor specs, installation on servers, conflicts, stalls, placement
//! - `server`: the server thread's data plane, driven by fake workers
//! - `client`: `Client` setup, push_pull, declare, barrier, failures, shutdown
//! - `extents`: live and wanted bytes, an all-gather's own slot, member tensors
//! - `session`: the member session: peer timeout from Welcome, lost scheduler
//! - `host`: several workers per host: sums through shared memory, failures
//! - `fuzz`: a short random run of the fuzz targets' checks
//!
//! Every wait is bounded (see `support::IO_TIMEOUT`); tests only use the
//! crate's public API.

mod support;

mod auth;
mod client;
mod declarations;
mod encryption;
mod extents;
mod fuzz;
mod host;
mod membership;
mod server;
mod session;
