"""The worker-side API: init, push_pull, broadcast, declare, barrier, shutdown."""

from __future__ import annotations

import atexit
import itertools
import os
import sys
import threading
from typing import Any, Iterable

from . import _core
from ._env import worker_env
from .buffers import describe, get_buffer, is_torch_tensor

_lock = threading.Lock()
_client: _core.Client | None = None
_local_rank: int | None = None
_local_size: int | None = None
_embedded: list[Any] = []  # in-process scheduler / server threads (torchrun mode)
_noname = itertools.count()


def _require() -> _core.Client:
    c = _client
    if c is None:
        raise RuntimeError("gradhub is not initialized: call gradhub.init() first")
    return c


def _run_role_and_exit(role: str) -> None:
    """BytePS-style: the same script started with GRADHUB_ROLE=server or
    scheduler runs that role inside init() and exits when the job ends."""
    from . import cli

    rc = cli.main([role])
    sys.exit(rc)


def _start_embedded(env) -> None:
    """torchrun without a separate scheduler: rank 0 hosts the scheduler and
    local rank 0 of each node hosts a colocated summation server."""
    if env.rank == 0:
        host, _, port = env.scheduler.rpartition(":")
        h = _core.start_scheduler(
            f"0.0.0.0:{port}",
            env.num_workers,
            env.num_servers,
            int(os.environ.get("GRADHUB_PARTITION_BYTES", _core.DEFAULT_PARTITION_BYTES)),
        )
        _embedded.append(h)
    if (env.local_rank or 0) == 0:
        threads = int(os.environ.get("GRADHUB_SERVER_THREADS", "1"))

        def serve():
            try:
                _core.run_server(env.scheduler, threads=threads, colocated=True, num_workers=env.num_workers,
                                 num_servers=env.num_servers, namespace=env.namespace)
            except _core.GradhubError as e:  # reported to workers by the scheduler too
                print(f"[gradhub] embedded server: {e}", file=sys.stderr)

        t = threading.Thread(target=serve, name="gradhub-embedded-server", daemon=True)
        t.start()
        _embedded.append(t)


def init(scheduler: str | None = None, rank: int | None = None, num_workers: int | None = None,
         num_servers: int | None = None) -> None:
    """Join the job. Arguments override the environment (GRADHUB_SCHEDULER,
    GRADHUB_RANK, GRADHUB_NUM_WORKERS, GRADHUB_NUM_SERVERS, or torchrun's RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR)."""
    global _client, _local_rank, _local_size
    role = os.environ.get("GRADHUB_ROLE", "worker").strip().lower()
    if role in ("server", "scheduler"):
        _run_role_and_exit(role)
    elif role != "worker":
        raise ValueError(f"GRADHUB_ROLE={role!r}: expected worker, server or scheduler")
    with _lock:
        if _client is not None:
            return
        env = worker_env()
        if scheduler is not None:
            env.scheduler = scheduler
        if rank is not None:
            env.rank = rank
        if num_workers is not None:
            env.num_workers = num_workers
        if num_servers is not None:
            env.num_servers = num_servers
        if not env.scheduler:
            raise RuntimeError(
                "gradhub.init(): no scheduler address. Start the job with `gradhub launch`, "
                "set GRADHUB_SCHEDULER=host:port, or run under torchrun (MASTER_ADDR)."
            )
        if env.torchrun and "GRADHUB_SCHEDULER" not in os.environ and scheduler is None:
            _start_embedded(env)
        kwargs = {}
        if env.credit_bytes is not None:
            kwargs["credit_bytes"] = env.credit_bytes
        _client = _core.Client(env.scheduler, rank=env.rank, num_workers=env.num_workers,
                               num_servers=env.num_servers, namespace=env.namespace,
                               connect_timeout=env.connect_timeout, **kwargs)
        _local_rank = env.local_rank
        _local_size = env.local_size
    atexit.register(shutdown)


def is_initialized() -> bool:
    return _client is not None


def shutdown() -> None:
    """Leave the job. Safe to call twice."""
    global _client
    with _lock:
        c, _client = _client, None
    if c is None:
        return
    c.shutdown()
    # Embedded roles must outlive every worker of the job, not just this one.
    for e in _embedded:
        if isinstance(e, threading.Thread):
            e.join(timeout=60)
        else:
            try:
                e.wait()
            except _core.GradhubError as err:
                print(f"[gradhub] embedded scheduler: {err}", file=sys.stderr)
    _embedded.clear()


def rank() -> int:
    return _require().rank


def size() -> int:
    return _require().size


def local_rank() -> int:
    c = _require()
    return c.local_rank if _local_rank is None else _local_rank


def local_size() -> int:
    c = _require()
    return c.local_size if _local_size is None else _local_size


class Handle:
    """A push_pull in flight. `wait()` returns the (in-place updated) tensor."""

    __slots__ = ("_h", "tensor")

    def __init__(self, h: _core.Handle, tensor: Any):
        self._h = h
        self.tensor = tensor

    def wait(self, timeout: float | None = None):
        """Block until the result is in the tensor. Raises GradhubTimeoutError
        after `timeout` seconds (naming stalled ranks if a server reported
        them), GradhubError if a peer died or the job failed."""
        self._h.wait(timeout)
        return self.tensor

    def done(self) -> bool:
        return self._h.done()

    @property
    def name(self) -> str:
        return self._h.name

    def __repr__(self) -> str:
        return f"<gradhub.Handle {self.name!r} {'done' if self.done() else 'pending'}>"


def _auto_name(prefix: str) -> str:
    return f"{prefix}.noname.{next(_noname)}"


def push_pull_async(tensor: Any, name: str | None = None, average: bool = False, priority: int = 0,
                    dtype: str | None = None) -> Handle:
    """Start summing `tensor` (in place) across all workers.

    `name` identifies the tensor across workers; without one, names are
    generated from the call order, which must then be the same on every worker.
    Higher `priority` is sent first. `average=True` divides by the number of
    workers. `dtype="bfloat16"` lets a uint16 numpy array carry bfloat16 bits.
    """
    c = _require()
    buf = get_buffer(tensor, dtype)
    if name is None:
        name = _auto_name("push_pull")
    h = c.push_pull_async(buf.ptr, buf.nbytes, buf.dtype, name, bool(average), int(priority), buf.obj)
    return Handle(h, tensor)


def push_pull(tensor: Any, name: str | None = None, average: bool = False, priority: int = 0,
              dtype: str | None = None, timeout: float | None = None):
    """Sum (or average) `tensor` across all workers, in place; returns it."""
    return push_pull_async(tensor, name=name, average=average, priority=priority, dtype=dtype).wait(timeout)


def broadcast(tensor: Any, root_rank: int, name: str | None = None, dtype: str | None = None):
    """Replace `tensor` on every worker with root_rank's values (in place).

    Implemented as a push_pull in which every other rank contributes zeros;
    x + 0 is exact in floating point, so the result is bit-identical to the
    root's tensor (except that -0.0 becomes +0.0)."""
    c = _require()
    if not 0 <= root_rank < c.size:
        raise ValueError(f"root_rank {root_rank} out of range for {c.size} workers")
    if name is None:
        name = _auto_name("broadcast")
    if c.rank != root_rank:
        if is_torch_tensor(tensor):
            tensor.zero_()
        else:
            tensor[...] = 0
    return push_pull(tensor, name=name, average=False, dtype=dtype)


def declare(tensors: Iterable[tuple[str, Any]] | dict) -> None:
    """Declare tensors ahead of their first push_pull, in one exchange with the
    scheduler: [(name, tensor_or_array), ...] or {name: tensor}. Checks that
    every worker declares the same sizes and dtypes (raises otherwise)."""
    c = _require()
    items = tensors.items() if isinstance(tensors, dict) else tensors
    entries = []
    for name, t in items:
        if isinstance(t, tuple):
            numel, dt = t
            entries.append((name, int(numel), str(dt)))
        else:
            entries.append((name, *describe(t)))
    c.declare(entries)


def barrier() -> None:
    """Block until every worker reaches the barrier."""
    _require().barrier()
