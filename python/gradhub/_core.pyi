"""Type stub of the compiled core (src/python.rs, built by maturin).

Thin bindings: argument conversion, releasing the GIL around anything that
blocks, and errors mapped to Python exceptions. The user API (gradhub.api)
builds on them; only gradhub.api, gradhub.roles and the benchmarks call them.
tests/test_api_structure.py checks that this stub and the extension define the
same names.
"""

from collections.abc import Callable

DEFAULT_PARTITION_BYTES: int
PROTOCOL_VERSION: int  # the wire protocol this build speaks (frame header byte 2)
DEFAULT_CREDIT_BYTES: int

class GradhubError(RuntimeError):
    """A gradhub job or operation failed."""

class GradhubTimeoutError(TimeoutError):
    """A gradhub operation did not finish in time. It is not cancelled: its
    tensor stays in use until it completes; `gradhub.push_pull` attaches the
    operation as `handle` (a `gradhub.Handle`) to wait on it again."""

def run_scheduler(
    bind: str,
    num_workers: int,
    num_servers: int,
    partition_bytes: int,
    heartbeat_ms: int = 1000,
    peer_timeout_ms: int = 10000,
    stall_ms: int = 30000,
    join_timeout_ms: int = 300000,
    namespace: int = 0,
    host_reduce: bool = True,
    failover: bool = True,
    token: str | None = None,  # the job's secret (protocol::auth); None: no token
    rack_reduce: str = "auto",  # two-level reduction across racks: auto (PHub's model), on or off
    link_gbit: float = 0.0,  # each host's link, Gbit/s, for PHub's model (0: not given, 10 assumed)
    core_gbit: float = 0.0,  # each rack's link to the core, Gbit/s (0: not given, one host link assumed)
) -> None:
    """Run a scheduler until the job ends (blocking, without the GIL)."""

def start_scheduler(
    bind: str,
    num_workers: int,
    num_servers: int,
    partition_bytes: int,
    heartbeat_ms: int = 1000,
    peer_timeout_ms: int = 10000,
    stall_ms: int = 30000,
    join_timeout_ms: int = 300000,
    namespace: int = 0,
    host_reduce: bool = True,
    failover: bool = True,
    token: str | None = None,  # the job's secret (protocol::auth); None: no token
    rack_reduce: str = "auto",  # two-level reduction across racks: auto (PHub's model), on or off
    link_gbit: float = 0.0,  # each host's link, Gbit/s, for PHub's model (0: not given, 10 assumed)
    core_gbit: float = 0.0,  # each rack's link to the core, Gbit/s (0: not given, one host link assumed)
) -> SchedulerHandle:
    """Start a scheduler on a background thread of this process."""

def run_server(
    scheduler: str,
    threads: int = 1,
    colocated: bool = False,
    advertise: str | None = None,
    bind_host: str = "0.0.0.0",
    base_port: int = 0,
    rank: int = -1,
    num_workers: int = 0,
    num_servers: int = 0,
    namespace: int = 0,
    connect_timeout: float = 60.0,
    token: str | None = None,  # the job's secret (protocol::auth); None: no token
    timeline: str | None = None,  # Chrome trace of the chunk rounds ({rank}: the server's rank)
    rack: str = "",  # this server's rack (GRADHUB_RACK); "" none
) -> None:
    """Run a summation server until the job ends (blocking, without the GIL)."""

def run_service_server(
    service: str,
    token: str,  # the service's master token
    threads: int = 1,
    colocated: bool = False,
    advertise: str | None = None,
    bind_host: str = "0.0.0.0",
    connect_timeout: float = 60.0,
    peer_timeout: float = 10.0,
) -> None:
    """Serve every job of the shared service at `service`, one server
    instance per job, until the service goes away (blocking, without the GIL)."""

def run_service(
    bind: str,
    token: str,  # the master token every job's token derives from
    partition_bytes: int,
    heartbeat_ms: int = 1000,
    peer_timeout_ms: int = 10000,
    stall_ms: int = 30000,
    join_timeout_ms: int = 300000,
    host_reduce: bool = True,
    failover: bool = True,
    max_jobs: int = 16,
    max_tensors: int = 0,  # per job; 0: no limit
    max_bytes: int = 0,  # per job; 0: no limit
    max_pending: int = 512,
    max_workers: int = 4096,  # per job
) -> None:
    """Run a shared service hosting many jobs (blocking, without the GIL)."""

def job_token(master: str, job: str) -> str:
    """Job `job`'s token on the service whose master token is `master`;
    ValueError for an invalid job name."""

def service_status(service: str, token: str, timeout: float = 10.0) -> str:
    """The shared service's report, JSON text (`token`: its master token)."""

def kernel_simd_level() -> str:
    """The summation kernels in use: "avx512", "avx2" or "portable"."""

class SchedulerHandle:
    """A scheduler running on a background thread of this process."""

    @property
    def address(self) -> str: ...
    def wait(self) -> None:
        """Wait for the job to end; raises GradhubError if it failed."""

class Handle:
    """A push_pull in flight."""

    def wait(self, timeout: float | None = None) -> None:
        """Block (without the GIL) until done; raises GradhubTimeoutError after
        `timeout` seconds, GradhubError if the operation failed."""
    def done(self) -> bool: ...
    def add_done_callback(self, callback: Callable[[str | None], None]) -> None:
        """Call `callback` once, from gradhub's callback thread, with None on
        success or the error message on failure; at once on the caller's
        thread if already done."""
    @property
    def name(self) -> str: ...

class Client:
    """A worker's connection to the job: joins on construction (blocking)."""

    def __init__(
        self,
        scheduler: str,
        rank: int = -1,
        num_workers: int = 0,
        num_servers: int = 0,
        namespace: int = 0,
        credit_bytes: int = 524288,  # DEFAULT_CREDIT_BYTES
        connect_timeout: float = 60.0,
        local_rank: int = -1,
        local_size: int = -1,
        server_shm: bool = True,
        token: str | None = None,
        job: str | None = None,  # this job's name on a shared service (its namespace derives from it)
        rack: str = "",  # this worker's rack (GRADHUB_RACK); "" none
        spread_bytes: int | None = None,  # GRADHUB_SPREAD_BYTES; None: 4 x the credit, 0: no limit
    ) -> None: ...
    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def local_rank(self) -> int: ...
    @property
    def local_size(self) -> int: ...
    @property
    def local_ranks(self) -> list[int]:
        """Every worker's local rank, by rank."""
    def start_timeline(self, path: str) -> None:
        """Record every chunk this worker pushes in a Chrome trace at `path`:
        queued, on the wire, waiting for its result."""
    def stop_timeline(self) -> None:
        """Stop recording the chunks' timeline (returns once the file is written)."""
    @property
    def credit_bytes(self) -> int:
        """The base credit per connection, in bytes."""
    def set_credit(self, bytes: int) -> None:
        """Change the base credit per connection (from the next chunk sent)."""
    @property
    def num_servers(self) -> int: ...
    @property
    def partition_bytes(self) -> int: ...
    def declare(self, entries: list[tuple[str, int, str, int]]) -> None:
        """Declare [(name, numel, dtype, partition_bytes), ...] in one exchange
        (partition_bytes 0: the job's; at most the job's)."""
    def push_pull_async(
        self,
        ptr: int,
        nbytes: int,
        dtype: str,
        name: str,
        average: bool,
        priority: int,
        owner: object,
        init: bool = False,
        release_after: bool = False,
        live: tuple[int, int] | None = None,
    ) -> Handle:
        """Start an in-place push_pull of raw memory. `owner` is kept alive until done.
        `release_after`: free the tensor once this round completes. `live`: (from, to)
        bytes outside which the memory is zeros (those chunks are pushed as zeros, header only)."""
    def release(self, names: list[str]) -> None:
        """Free named tensors (none in flight): here, and on the servers once every worker released them."""
    def num_tensors(self) -> int:
        """Tensors this worker holds state for (declared, not released)."""
    def set_server_optimizer(
        self,
        name: str,
        numel: int,
        kind: str,
        lr: float,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-8,
    ) -> None:
        """Run an optimizer ("sgd" or "adamw") on the servers for float32 tensor `name`."""
    def announce(self, name: str, to: list[int]) -> None:
        """Tell the workers `to`, outside this operation's process set, to push
        zeros for the operation just started on `name`."""
    def serve_set_ops(self) -> None:
        """From now on, push zeros (a background thread) for the operations of
        process sets this worker is not in."""
    def barrier(self) -> None: ...
    def join(self) -> tuple[int, list[str]]:
        """Horovod's join: push zeros for the others' operations until every
        worker joined; (the rank that joined last, the names pushed)."""
    def shutdown(self) -> None:
        """Leave the job; with operations still in flight this fails the job
        for everyone (naming them) instead of leaving them waiting."""
    def abort(self, reason: str) -> None:
        """Leave the job because this worker failed: every member is told `reason`."""
    def failure(self) -> str | None:
        """The job's failure message, if it has failed."""
