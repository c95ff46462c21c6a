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


def _ms(seconds: float | None) -> int | None:
    return None if seconds is None else int(seconds * 1000)


def scheduler_settings(e: _env.SchedulerEnv) -> dict:
    """A job scheduler's settings from the environment, as
    `_core.SchedulerConfig` keywords (None: the core's default)."""
    return dict(partition_bytes=e.partition_bytes, stall_ms=_ms(e.stall_seconds),
                peer_timeout_ms=_ms(e.peer_timeout), join_timeout_ms=_ms(e.join_timeout), namespace=e.namespace,
                host_reduce=e.host_reduce,
                failover=e.failover, rack_reduce=e.rack_reduce, link_gbit=e.link_gbit, core_gbit=e.core_gbit,
                metrics_addr=e.metrics_addr)


def run_scheduler(bind: str | None, num_workers: int | None, num_servers: int | None, *,
                  scheduler: str | None = None, token: str | None = None, insecure: bool = False,
                  **settings) -> int:
    """Run the job's scheduler until the job ends; returns an exit code
    (0 done, 1 the job failed, 2 bad settings). `bind` defaults to the port of
    `scheduler` (GRADHUB_SCHEDULER), or 9000, on its host if that is loopback,
    else on 0.0.0.0. Listening beyond loopback needs `token` or `insecure`.
    `settings`: `_core.SchedulerConfig` keywords (None: the default)."""
    if num_workers is None or num_servers is None:
        print("gradhub scheduler: --workers and --servers (or GRADHUB_NUM_WORKERS/GRADHUB_NUM_SERVERS) "
              "are required", file=sys.stderr)
        return 2
    bind = _bind_address(bind, scheduler)
    try:
        _env.check_exposure("gradhub scheduler", [split_hostport(bind, 0)[0]], token, insecure)
        cfg = _core.SchedulerConfig(bind, num_workers, num_servers, token=token, **settings)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    _native_sigint()
    try:
        _core.run_scheduler(cfg)
    except _core.GradhubError as e:
        print(f"gradhub scheduler: {e}", file=sys.stderr)
        return 1
    return 0


def run_server(scheduler: str | None, threads: int, *, bind_host: str | None = None, token: str | None = None,
               insecure: bool = False, **settings) -> int:
    """Run one summation server until the job ends; returns an exit code.
    `bind_host` defaults to loopback when the scheduler is on loopback, else
    0.0.0.0; reaching beyond loopback needs `token` or `insecure`.
    `settings`: `_core.ServerConfig` keywords (None: the default)."""
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
    cfg = _core.ServerConfig(scheduler, threads=threads, bind_host=bind_host, token=token, **settings)
    _native_sigint()
    try:
        _core.run_server(cfg)
    except _core.GradhubError as e:
        print(f"gradhub server: {e}", file=sys.stderr)
        return 1
    return 0


def run_service(bind: str | None, *, scheduler: str | None = None, stall_seconds: float | None = None,
                peer_timeout: float | None = None, max_jobs: int | None = None, job_max_tensors: int | None = None,
                job_max_mib: float | None = None, job_max_workers: int | None = None,
                metrics_addr: str | None = None, **job) -> int:
    """Run a shared service (`gradhub scheduler --service`) until it is
    stopped; returns an exit code. Needs the master token
    (GRADHUB_SERVICE_TOKEN or GRADHUB_SERVICE_TOKEN_FILE). `job`: the
    `_core.SchedulerConfig` keywords every job gets."""
    master = _env.service_token()
    if master is None:
        print("gradhub scheduler --service: set GRADHUB_SERVICE_TOKEN (or GRADHUB_SERVICE_TOKEN_FILE) to the "
              "service's master token: every job's token derives from it (`gradhub token JOB`)", file=sys.stderr)
        return 2
    bind = _bind_address(bind, scheduler)
    max_bytes = None if job_max_mib is None else int(job_max_mib * (1 << 20))
    # Each job's token and encryption come from the master's (`Secret::key_for`), not from this template.
    each = _core.SchedulerConfig(stall_ms=_ms(stall_seconds), peer_timeout_ms=_ms(peer_timeout),
                                 max_tensors=job_max_tensors, max_bytes=max_bytes, encrypt=False, **job)
    cfg = _core.ServiceConfig(bind, master, each, max_jobs=max_jobs, max_workers=job_max_workers,
                              metrics_addr=metrics_addr)
    _native_sigint()
    try:
        _core.run_service(cfg)
    except _core.GradhubError as e:
        print(f"gradhub scheduler --service: {e}", file=sys.stderr)
        return 1
    return 0


def run_service_server(service: str | None, threads: int, *, bind_host: str | None = None,
                       peer_timeout: float | None = None, **settings) -> int:
    """Serve a shared service's jobs (`gradhub server --service`) until the
    service goes away; returns an exit code. `settings`: the
    `_core.ServerConfig` keywords of each job's instance."""
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
    # Each job's instance takes its token and encryption from the master's (`Secret::key_for`).
    server = _core.ServerConfig(service, threads=threads, bind_host=bind_host, encrypt=False, **settings)
    _native_sigint()
    try:
        _core.run_service_server(_core.ServiceServerConfig(server, master, peer_timeout=peer_timeout))
    except _core.GradhubError as e:
        print(f"gradhub server --service: {e}", file=sys.stderr)
        return 1
    return 0


def default_server_threads() -> int:
    """`gradhub server` without --threads or GRADHUB_SERVER_THREADS: one per core."""
    return os.cpu_count() or 1


def scheduler_from_env() -> int:
    e = _env.scheduler_env()
    return run_scheduler(None, e.num_workers, e.num_servers, scheduler=e.scheduler, token=_env.job_token(),
                         insecure=_env.insecure(), **scheduler_settings(e))


def server_from_env() -> int:
    e = _env.server_env()
    return run_server(e.scheduler, e.threads if e.threads is not None else default_server_threads(),
                      token=_env.job_token(), insecure=_env.insecure(), colocated=e.colocated,
                      advertise=e.advertise, base_port=e.port, rank=e.rank, num_workers=e.num_workers,
                      num_servers=e.num_servers, namespace=e.namespace, connect_timeout=e.connect_timeout,
                      timeline=e.timeline, rack=e.rack, metrics_addr=e.metrics_addr)


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
            settings = {**scheduler_settings(_env.scheduler_env()), "namespace": env.namespace}
            self._scheduler = _core.start_scheduler(_core.SchedulerConfig(
                f"{bind_host}:{port}", env.num_workers, env.num_servers, token=env.token, **settings))
        if (env.local_rank or 0) == 0:
            threads = _env.server_env().threads or 1
            timeline = _env.server_env().timeline

            def serve():
                try:
                    _core.run_server(_core.ServerConfig(
                        env.scheduler, threads=threads, colocated=True, num_workers=env.num_workers,
                        num_servers=env.num_servers, namespace=env.namespace, bind_host=bind_host,
                        token=env.token, timeline=timeline, rack=env.rack))
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
