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

class SchedulerConfig:
    """A job scheduler's config (a shared service's per-job part too). Every
    keyword is optional: None takes the core's default (src/scheduler's
    `SchedulerConfig::default`)."""

    def __init__(
        self,
        bind: str | None = None,  # host:port to listen on
        num_workers: int | None = None,
        num_servers: int | None = None,
        partition_bytes: int | None = None,
        heartbeat_ms: int | None = None,
        peer_timeout_ms: int | None = None,
        stall_ms: int | None = None,
        join_timeout_ms: int | None = None,
        namespace: int | None = None,
        host_reduce: bool | None = None,
        failover: bool | None = None,
        token: str | None = None,  # the job's secret (protocol::auth); None: no token
        rack_reduce: str | None = None,  # two-level reduction across racks: auto (PHub's model), on or off
        link_gbit: float | None = None,  # each host's link, Gbit/s, for PHub's model (0: not given, 10 assumed)
        core_gbit: float | None = None,  # each rack's link to the core, Gbit/s (0: not given, one host link assumed)
        max_tensors: int | None = None,  # a service job's limit; 0: none
        max_bytes: int | None = None,  # a service job's limit; 0: none
        metrics_addr: str | None = None,  # serve Prometheus metrics at http://HOST:PORT/metrics
        deterministic: bool | None = None,  # sums in rank order (GRADHUB_DETERMINISTIC, read when None)
        asynchronous: bool | None = None,  # the asynchronous mode (GRADHUB_ASYNC, read when None)
        staleness: int | None = None,  # its staleness bound (GRADHUB_STALENESS, read when None)
        encrypt: bool | None = None,  # encrypt every connection (GRADHUB_ENCRYPT, read when None); needs a token
    ) -> None:
        """ValueError for a bad rack_reduce or bandwidth."""

class ServerConfig:
    """A summation server's config (a service server's per-job instances
    too). None takes the core's default (`ServerConfig::default`)."""

    def __init__(
        self,
        scheduler: str,
        threads: int | None = None,
        colocated: bool | None = None,
        advertise: str | None = None,  # None: the address of the interface that reaches the scheduler
        bind_host: str | None = None,
        base_port: int | None = None,  # thread t listens on base_port + t; 0: free ports
        rank: int | None = None,  # -1: assigned
        num_workers: int | None = None,
        num_servers: int | None = None,
        namespace: int | None = None,
        connect_timeout: float | None = None,  # seconds
        token: str | None = None,  # the job's secret (protocol::auth); None: no token
        timeline: str | None = None,  # Chrome trace of the chunk rounds ({rank}: the server's rank)
        rack: str | None = None,  # this server's rack (GRADHUB_RACK); "" none
        metrics_addr: str | None = None,  # serve Prometheus metrics at http://HOST:PORT/metrics
        deterministic: bool | None = None,  # sums in rank order (GRADHUB_DETERMINISTIC, read when None)
        asynchronous: bool | None = None,  # the asynchronous mode (GRADHUB_ASYNC, read when None)
        staleness: int | None = None,  # its staleness bound (GRADHUB_STALENESS, read when None)
        encrypt: bool | None = None,  # encrypt every connection (GRADHUB_ENCRYPT, read when None); needs a token
    ) -> None: ...

class ServiceConfig:
    """A shared service's config: `token` is the master every job's token
    derives from, `job` what each job gets (None: the defaults)."""

    def __init__(
        self,
        bind: str,
        token: str,
        job: SchedulerConfig | None = None,
        max_jobs: int | None = None,
        max_workers: int | None = None,  # per job
        max_pending: int | None = None,  # connections authenticating at once
        metrics_addr: str | None = None,  # serve Prometheus metrics at http://HOST:PORT/metrics
        encrypt: bool | None = None,  # encrypt every connection (GRADHUB_ENCRYPT, read when None)
    ) -> None: ...
    @property
    def max_jobs(self) -> int: ...
    @property
    def max_workers(self) -> int: ...

class ServiceServerConfig:
    """A server of a shared service: `server` is what each job's instance is
    made of, `token` the service's master token."""

    def __init__(self, server: ServerConfig, token: str, peer_timeout: float | None = None,
                 encrypt: bool | None = None) -> None: ...

class ClientConfig:
    """A worker's config. None takes the core's default (`ClientConfig::default`)."""

    def __init__(
        self,
        scheduler: str,
        rank: int | None = None,  # -1: assigned
        num_workers: int | None = None,
        num_servers: int | None = None,
        namespace: int | None = None,
        credit_bytes: int | None = None,  # DEFAULT_CREDIT_BYTES
        spread_bytes: int | None = None,  # GRADHUB_SPREAD_BYTES; None: 4 x the credit, 0: no limit
        connect_timeout: float | None = None,  # seconds
        local_rank: int | None = None,  # -1: assigned by the scheduler
        local_size: int | None = None,
        server_shm: bool | None = None,
        token: str | None = None,
        job: str | None = None,  # this job's name on a shared service (its namespace derives from it)
        rack: str | None = None,  # this worker's rack (GRADHUB_RACK); "" none
        deterministic: bool | None = None,  # sums in rank order (GRADHUB_DETERMINISTIC, read when None)
        elastic: tuple[int, int, int, int] | None = None,  # an elastic job's (min, max, initial size, previous rank)
        asynchronous: bool | None = None,  # the asynchronous mode (GRADHUB_ASYNC, read when None)
        staleness: int | None = None,  # its staleness bound (GRADHUB_STALENESS, read when None)
        encrypt: bool | None = None,  # encrypt every connection (GRADHUB_ENCRYPT, read when None); needs a token
    ) -> None:
        """ValueError for an invalid job name."""

def settings() -> list[tuple[str, str, str | None, str, list[str], str, list[str], list[str], str]]:
    """Every GRADHUB_* setting (src/settings.rs): (name, kind, default as
    written or None, default as documented, roles, help, choices, aliases,
    tier: "user", "advanced" or "internal")."""

def close_callbacks() -> None:
    """Stop running completion callbacks before the interpreter exits
    (registered with atexit by gradhub; waits up to 5 s for running ones)."""

def run_scheduler(config: SchedulerConfig) -> None:
    """Run a scheduler until the job ends (blocking, without the GIL)."""

def start_scheduler(config: SchedulerConfig) -> SchedulerHandle:
    """Start a scheduler on a background thread of this process."""

def run_server(config: ServerConfig) -> None:
    """Run a summation server until the job ends (blocking, without the GIL)."""

def run_service_server(config: ServiceServerConfig) -> None:
    """Serve every job of the shared service at `config.server`'s scheduler,
    one server instance per job, until the service goes away (blocking,
    without the GIL)."""

def run_service(config: ServiceConfig) -> None:
    """Run a shared service hosting many jobs (blocking, without the GIL)."""

def job_token(master: str, job: str) -> str:
    """Job `job`'s token on the service whose master token is `master`;
    ValueError for an invalid job name."""

def service_status(service: str, token: str, timeout: float = 10.0, encrypt: bool | None = None) -> str:
    """The shared service's report, JSON text (`token`: its master token;
    `encrypt`: as the service, GRADHUB_ENCRYPT when None)."""

def kernel_simd_level() -> str:
    """The summation kernels in use: "avx512", "avx2" or "portable"."""

def encode_frame(msg_type: int, payload: bytes = b"", key: int = 0, chunk: int = 0, round: int = 0,
                 dtype: int = 0, flags: int = 0, namespace: int = 0, payload_len: int | None = None) -> bytes:
    """One frame as the wire carries it, checksums filled in (for tests and
    tools that talk to members byte by byte); `payload_len` overrides the
    payload's length (a header that lies). ValueError for an unknown
    message type or dtype."""

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

class PeerLinks:
    """A group's point-to-point links (the torch backend's send and recv)."""

    @property
    def address(self) -> str: ...
    def send(self, dst: int, addr: str, tag: int, ptr: int, nbytes: int, owner: Any) -> None:
        """Send `nbytes` at `ptr` to member `dst` listening at `addr`; blocks, without the GIL, until written."""
    def post_recv(self, src: int | None, tag: int, ptr: int, nbytes: int, owner: Any,
                  callback: Callable[[int | None, str | None], None]) -> int | None:
        """Post a receive; `callback(sender, error)` runs once it is filled or failed. The ticket while it waits."""
    def cancel(self, ticket: int) -> bool:
        """Withdraw a waiting receive: True if it was still waiting."""
    def close(self, why: str) -> None:
        """Close every link; waiting receives fail with `why`."""

class Client:
    """A worker's connection to the job: joins on construction (blocking)."""

    def __init__(self, config: ClientConfig) -> None:
        """Join the job (blocking, without the GIL)."""
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
        want: tuple[int, int] | None = None,
        live_is_own: bool = False,
        members: list[int] | None = None,
        sharded: bool = False,
        asynchronous: bool = False,
    ) -> Handle:
        """Start an in-place push_pull of raw memory. `owner` is kept alive until done.
        `release_after`: free the tensor once this round completes. `live`: (from, to)
        bytes outside which the memory is zeros (those chunks are pushed as zeros, header only).
        `want`: (from, to) bytes whose result is needed (the chunks wholly outside keep what
        was pushed; their results come back as a header only). `live_is_own`: no other
        worker's bytes fall in `live` (an all-gather's slot): its chunks keep what was
        pushed, as unwanted ones. `members`: the ranks
        (ascending) that sum this tensor, each pushing for itself; None: every worker.
        `sharded`: member q reads the q-th of as many equal shards (placed on its host).
        `asynchronous`: a parameter change of an asynchronous tensor (GRADHUB_ASYNC), answered
        with the parameters the servers hold."""
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
    def hosts_updated(self) -> bool:
        """Whether workers wait to join this elastic job (it re-forms at the next commit)."""
    def peer_links(self, rank: int, size: int, group: str, host: str, timeout: float) -> PeerLinks:
        """Point-to-point links for member `rank` of the group `group` of
        `size` members, listening on `host` (`crate::peer`)."""
