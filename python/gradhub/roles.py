"""The scheduler and server roles, however they are started:

- `gradhub scheduler` / `gradhub server` (cli.py: flags, falling back to the environment);
- GRADHUB_ROLE=scheduler|server (BytePS style: the training script itself,
  started with that variable, runs the role inside `gradhub.init()` and exits
  when the job ends): `run_role()`, built from the environment alone;
- torchrun without GRADHUB_SCHEDULER: rank 0 hosts the scheduler and local
  rank 0 of each node a colocated server, on threads of the worker process
  (`Embedded`).

Servers and the scheduler never import torch.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from . import _core, _env

DEFAULT_SCHEDULER_PORT = 9000


def split_hostport(s: str, default_port: int) -> tuple[str, int]:
    if ":" in s:
        host, _, port = s.rpartition(":")
        return host.strip("[]") or "0.0.0.0", int(port)
    return s, default_port


def _native_sigint() -> None:
    """Blocking in native code: let Ctrl-C terminate the process directly."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    except ValueError:  # not the main thread
        pass


def _bind_address(bind: str | None, scheduler: str | None) -> str:
    """Where a scheduler listens: `bind`, else the port of `scheduler` (or
    9000) on its host if that is loopback, else on 0.0.0.0."""
    if bind is None:
        host, port = "0.0.0.0", DEFAULT_SCHEDULER_PORT
        if scheduler:
            shost, port = split_hostport(scheduler, DEFAULT_SCHEDULER_PORT)
            host = shost if _env.is_loopback(shost) else host
        return f"{host}:{port}"
    return bind if ":" in bind else f"{bind}:{DEFAULT_SCHEDULER_PORT}"


def run_scheduler(bind: str | None, num_workers: int | None, num_servers: int | None,
                  partition_bytes: int | None = None, stall_seconds: float = 30.0, peer_timeout: float = 10.0,
                  namespace: int = 0, scheduler: str | None = None, host_reduce: bool = True,
                  failover: bool = True, token: str | None = None, insecure: bool = False,
                  rack_reduce: str = "auto", link_gbit: float = 0.0, core_gbit: float = 0.0) -> int:
    """Run the job's scheduler until the job ends; returns an exit code
    (0 done, 1 the job failed, 2 bad settings). `bind` defaults to the port of
    `scheduler` (GRADHUB_SCHEDULER), or 9000, on its host if that is loopback,
    else on 0.0.0.0. Listening beyond loopback needs `token` or `insecure`."""
    if num_workers is None or num_servers is None:
        print("gradhub scheduler: --workers and --servers (or GRADHUB_NUM_WORKERS/GRADHUB_NUM_SERVERS) "
              "are required", file=sys.stderr)
        return 2
    bind = _bind_address(bind, scheduler)
    try:
        _env.check_exposure("gradhub scheduler", [split_hostport(bind, 0)[0]], token, insecure)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    _native_sigint()
    try:
        _core.run_scheduler(bind, num_workers, num_servers, partition_bytes or _core.DEFAULT_PARTITION_BYTES,
                            peer_timeout_ms=int(peer_timeout * 1000), stall_ms=int(stall_seconds * 1000),
                            namespace=namespace, host_reduce=host_reduce, failover=failover, token=token,
                            rack_reduce=rack_reduce, link_gbit=link_gbit, core_gbit=core_gbit)
    except _core.GradhubError as e:
        print(f"gradhub scheduler: {e}", file=sys.stderr)
        return 1
    return 0


def run_server(scheduler: str | None, threads: int, colocated: bool = False, advertise: str | None = None,
               bind_host: str | None = None, port: int = 0, rank: int = -1, num_workers: int = 0,
               num_servers: int = 0, namespace: int = 0, connect_timeout: float = 60.0,
               token: str | None = None, insecure: bool = False, timeline: str | None = None,
               rack: str = "") -> int:
    """Run one summation server until the job ends; returns an exit code.
    `bind_host` defaults to loopback when the scheduler is on loopback, else
    0.0.0.0; reaching beyond loopback needs `token` or `insecure`."""
    if not scheduler:
        print("gradhub server: --scheduler (or GRADHUB_SCHEDULER) is required", file=sys.stderr)
        return 2
    shost, _ = split_hostport(scheduler, DEFAULT_SCHEDULER_PORT)
    if bind_host is None:
        bind_host = "127.0.0.1" if _env.is_loopback(shost) else "0.0.0.0"
    try:
        _env.check_exposure("gradhub server", [shost, bind_host], token, insecure)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    _native_sigint()
    try:
        _core.run_server(scheduler, threads=max(1, threads), colocated=colocated, advertise=advertise,
                         bind_host=bind_host, base_port=port, rank=rank, num_workers=num_workers,
                         num_servers=num_servers, namespace=namespace, connect_timeout=connect_timeout,
                         token=token, timeline=timeline, rack=rack)
    except _core.GradhubError as e:
        print(f"gradhub server: {e}", file=sys.stderr)
        return 1
    return 0


def run_service(bind: str | None, partition_bytes: int | None = None, stall_seconds: float = 30.0,
                peer_timeout: float = 10.0, scheduler: str | None = None, host_reduce: bool = True,
                failover: bool = True, max_jobs: int = 16, job_max_tensors: int = 0, job_max_mib: float = 0,
                job_max_workers: int = 4096) -> int:
    """Run a shared service (`gradhub scheduler --service`) until it is
    stopped; returns an exit code. Needs the master token
    (GRADHUB_SERVICE_TOKEN or GRADHUB_SERVICE_TOKEN_FILE)."""
    master = _env.service_token()
    if master is None:
        print("gradhub scheduler --service: set GRADHUB_SERVICE_TOKEN (or GRADHUB_SERVICE_TOKEN_FILE) to the "
              "service's master token: every job's token derives from it (`gradhub token JOB`)", file=sys.stderr)
        return 2
    bind = _bind_address(bind, scheduler)
    _native_sigint()
    try:
        _core.run_service(bind, master, partition_bytes or _core.DEFAULT_PARTITION_BYTES,
                          peer_timeout_ms=int(peer_timeout * 1000), stall_ms=int(stall_seconds * 1000),
                          host_reduce=host_reduce, failover=failover, max_jobs=max_jobs,
                          max_tensors=job_max_tensors, max_bytes=int(job_max_mib * (1 << 20)),
                          max_workers=job_max_workers)
    except _core.GradhubError as e:
        print(f"gradhub scheduler --service: {e}", file=sys.stderr)
        return 1
    return 0


def run_service_server(service: str | None, threads: int, colocated: bool = False, advertise: str | None = None,
                       bind_host: str | None = None, connect_timeout: float = 60.0,
                       peer_timeout: float = 10.0) -> int:
    """Serve a shared service's jobs (`gradhub server --service`) until the
    service goes away; returns an exit code."""
    if not service:
        print("gradhub server --service: --scheduler (or GRADHUB_SCHEDULER), the service's address, is required",
              file=sys.stderr)
        return 2
    master = _env.service_token()
    if master is None:
        print("gradhub server --service: set GRADHUB_SERVICE_TOKEN (or GRADHUB_SERVICE_TOKEN_FILE) to the "
              "service's master token", file=sys.stderr)
        return 2
    shost, _ = split_hostport(service, DEFAULT_SCHEDULER_PORT)
    if bind_host is None:
        bind_host = "127.0.0.1" if _env.is_loopback(shost) else "0.0.0.0"
    _native_sigint()
    try:
        _core.run_service_server(service, master, threads=max(1, threads), colocated=colocated, advertise=advertise,
                                 bind_host=bind_host, connect_timeout=connect_timeout, peer_timeout=peer_timeout)
    except _core.GradhubError as e:
        print(f"gradhub server --service: {e}", file=sys.stderr)
        return 1
    return 0


def default_server_threads() -> int:
    """`gradhub server` without --threads or GRADHUB_SERVER_THREADS: one per core."""
    return os.cpu_count() or 1


def scheduler_from_env() -> int:
    e = _env.scheduler_env()
    return run_scheduler(None, e.num_workers, e.num_servers, e.partition_bytes, e.stall_seconds, e.peer_timeout,
                         e.namespace, scheduler=e.scheduler, host_reduce=e.host_reduce, failover=e.failover,
                         token=_env.job_token(), insecure=_env.insecure(), rack_reduce=e.rack_reduce,
                         link_gbit=e.link_gbit, core_gbit=e.core_gbit)


def server_from_env() -> int:
    e = _env.server_env()
    return run_server(e.scheduler, e.threads if e.threads is not None else default_server_threads(), e.colocated,
                      e.advertise, None, e.port, e.rank, e.num_workers, e.num_servers, e.namespace,
                      e.connect_timeout, token=_env.job_token(), insecure=_env.insecure(), timeline=e.timeline,
                      rack=e.rack)


def run_role(role: str) -> int:
    """Run `role` ("scheduler" or "server") as configured by the environment."""
    if role == "scheduler":
        return scheduler_from_env()
    if role == "server":
        return server_from_env()
    raise ValueError(f"unknown role {role!r}: expected scheduler or server")


class Embedded:
    """The roles a torchrun worker hosts when there is no separate scheduler:
    rank 0 the scheduler, local rank 0 of each node a colocated server
    (GRADHUB_SERVER_THREADS threads, default 1, so training keeps its cores)."""

    def __init__(self, env: _env.WorkerEnv):
        self._scheduler = None
        self._server: threading.Thread | None = None
        # A single-node job (MASTER_ADDR on loopback) listens on loopback only.
        shost, port = split_hostport(env.scheduler, DEFAULT_SCHEDULER_PORT)
        bind_host = shost if _env.is_loopback(shost) else "0.0.0.0"
        if env.rank == 0:
            s = _env.scheduler_env()
            self._scheduler = _core.start_scheduler(
                f"{bind_host}:{port}", env.num_workers, env.num_servers,
                s.partition_bytes or _core.DEFAULT_PARTITION_BYTES,
                peer_timeout_ms=int(s.peer_timeout * 1000), stall_ms=int(s.stall_seconds * 1000),
                namespace=env.namespace, host_reduce=s.host_reduce, failover=s.failover, token=env.token,
                rack_reduce=s.rack_reduce, link_gbit=s.link_gbit, core_gbit=s.core_gbit)
        if (env.local_rank or 0) == 0:
            threads = _env.server_env().threads or 1

            def serve():
                try:
                    _core.run_server(env.scheduler, threads=threads, colocated=True, num_workers=env.num_workers,
                                     num_servers=env.num_servers, namespace=env.namespace, bind_host=bind_host,
                                     token=env.token, timeline=_env.server_env().timeline, rack=env.rack)
                except _core.GradhubError as e:  # reported to workers by the scheduler too
                    print(f"[gradhub] embedded server: {e}", file=sys.stderr)

            self._server = threading.Thread(target=serve, name="gradhub-embedded-server", daemon=True)
            self._server.start()

    def wait(self) -> None:
        """Wait for the hosted roles to finish: they must outlive every worker
        of the job, not just this one."""
        if self._scheduler is not None:
            try:
                self._scheduler.wait()
            except _core.GradhubError as err:
                print(f"[gradhub] embedded scheduler: {err}", file=sys.stderr)
        if self._server is not None:
            self._server.join(timeout=60)
