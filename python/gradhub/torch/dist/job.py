"""The gradhub job a default group of the gradhub backend runs in: the
job `gradhub.init()` joined, the one GRADHUB_* names (`gradhub launch`, a
separate scheduler, a shared service), or one formed from torch's store
(rank 0 hosts the scheduler, the first rank on each host a colocated
server), ended with the group if formed here."""

from __future__ import annotations

import datetime
import os
import secrets
import socket
import threading

from ... import _env
from ... import api as _api

_job_lock = threading.Lock()
_owned = False        # this backend started the gradhub job the default group uses


def _host_id() -> str:
    """This process's host, as the core tells hosts apart (`crate::host_id`)."""
    hid = _env.get("GRADHUB_HOST_ID")
    if hid:
        return hid
    try:
        with open("/proc/sys/kernel/hostname") as f:
            name = f.read().strip() or socket.gethostname()
    except OSError:
        name = socket.gethostname()
    try:
        return f"{name} {os.readlink('/proc/self/ns/net')}"
    except OSError:
        return name


def _advertised_host() -> str:
    """Where the others reach rank 0's scheduler."""
    v = _env.get("GRADHUB_ADVERTISE_ADDR") or _env.torchrun_master()
    if v:
        return v
    try:
        return socket.gethostbyname(socket.getfqdn())
    except OSError:
        return "127.0.0.1"


def _form_job(store, rank: int, size: int, timeout: float) -> bool:
    """Join (or form) the gradhub job of the default group. True if this
    backend formed it (and ends it with the group)."""
    if _api.is_initialized():
        if _api.rank() != rank or _api.size() != size:
            raise RuntimeError(f"init_process_group('gradhub'): this process is worker {_api.rank()} of "
                               f"{_api.size()} in its gradhub job, but rank {rank} of {size} in torch's group")
        return False
    from ..startup import init as _gh_init

    env = _env.worker_env()
    if env.scheduler is not None and not env.embedded:
        # A job named by the environment: `gradhub launch`, a separate scheduler, a shared service.
        env.rank, env.num_workers = rank, size
        env.connect_timeout = min(env.connect_timeout, timeout) if env.connect_timeout else timeout
        _gh_init(_worker_env=env)
        return False  # the launcher's (or service's) job: it outlives the group, a new group joins it again
    # Form one from torch's store. Arrivals count across re-initialisations
    # in one store: the k-th `size` arrivals are generation k.
    gen = (store.add("gradhub/arrivals", 1) - 1) // size
    key = f"gradhub/{gen}"
    store.set(f"{key}/host/{rank}", _host_id())
    if rank == 0:
        from ..._ports import free_port

        host = _advertised_host()
        bind = host if _env.is_loopback(host) else "0.0.0.0"
        port = free_port(bind if bind != "0.0.0.0" else "127.0.0.1")
        token = env.token or secrets.token_hex(32)
        store.set(f"{key}/job", f"{host}:{port} {token}")
    store.wait([f"{key}/job"] + [f"{key}/host/{q}" for q in range(size)], datetime.timedelta(seconds=timeout))
    addr, token = store.get(f"{key}/job").decode().split(" ", 1)
    hosts = [store.get(f"{key}/host/{q}").decode() for q in range(size)]
    mine = _host_id()
    same = [q for q, h in enumerate(hosts) if h == mine]
    env.scheduler = addr
    env.embedded = True
    env.rank, env.num_workers = rank, size
    env.local_rank, env.local_size = same.index(rank), len(same)
    if not _env.is_set("GRADHUB_NUM_SERVERS") and env.job is None:
        env.num_servers = len(set(hosts))   # one colocated server per host
    env.token = token
    env.connect_timeout = timeout
    _gh_init(_worker_env=env)
    return True


def end_job() -> None:
    global _owned
    with _job_lock:
        if not _owned:
            return
        _owned = False
    from ...api import shutdown
    from ..process_sets import reset

    shutdown()
    reset()


def explain(message: str) -> str:
    """A failure's message, naming rank 0 where it hosted the job's
    scheduler (a job formed here): the core only knows it lost the scheduler."""
    if _owned and "connection to the scheduler" in message:
        return message + " (the job's scheduler ran in rank 0 of the default group: rank 0 was lost)"
    return message


def join(store, rank: int, size: int, timeout: float) -> bool:
    """The default group's job (see `_form_job`): True if formed here (the
    group ends it)."""
    global _owned
    with _job_lock:
        formed = _form_job(store, rank, size, timeout)
        _owned = _owned or formed
    return formed
