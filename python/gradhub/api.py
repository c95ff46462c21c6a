"""The worker-side API: init, push_pull, broadcast, declare, barrier, shutdown.

This module is the only door into the core's worker client (`_core.Client`):
gradhub.torch and every other layer go through the functions below.
`push_pull_async` is the one place tensors reach host memory: numpy arrays and CPU tensors are
summed in place (zero-copy), CUDA tensors through a pinned host copy that is
copied back when the operation completes.
"""

from __future__ import annotations

import atexit
import itertools
import sys
import threading
from typing import Any, Callable, Iterable

import numpy as np

from . import _core, _env, timeline
from ._core import GradhubError, GradhubTimeoutError
from .buffers import INTEGER_DTYPES, describe, get_buffer, host_memory, is_torch_tensor, raw_buffer, validate

_lock = threading.Lock()
# Completion callbacks run on a core thread, which must not take the GIL
# once the interpreter finalizes: stop them at exit (those not started are
# dropped). Registered at import, so it runs after the shutdown that init()
# registers (atexit is LIFO).
atexit.register(_core.close_callbacks)

_client: _core.Client | None = None
_embedded = None  # roles.Embedded: in-process scheduler / server (torchrun mode)
_exit_error: str | None = None  # an unhandled exception, seen on the way out
_hook_installed = False
_joined: str | None = None  # the scheduler of the job this process is in
_ended: str | None = None  # the scheduler of a job this process shut down
_names = itertools.count()
_names_lock = threading.Lock()


class NotInitializedError(RuntimeError, ValueError):
    """gradhub is not initialized. A RuntimeError (gradhub's type for it) and
    a ValueError (Horovod's "Horovod has not been initialized"), so handlers
    written for either keep working."""


class GradhubMismatchError(GradhubError, ValueError):
    """Workers disagree on an operation (its root rank, shape or dtype); every
    worker raises it. A GradhubError, so a RuntimeError as Horovod's
    HorovodInternalError for the same cases, and a ValueError (gradhub's
    type for it before)."""


def _require() -> _core.Client:
    c = _client
    if c is None:
        raise NotInitializedError("gradhub is not initialized: call gradhub.init() first")
    return c


def new_generation() -> None:
    """An elastic job's next generation (after `shutdown()`): automatic
    names count from 0 again, as on a worker new to the job."""
    global _names
    with _names_lock:
        _names = itertools.count()


def _check_elastic(env) -> None:
    """An elastic job (GRADHUB_MIN_WORKERS) runs on a shared service, which
    forms its generations; ranks are the service's to give."""
    if env.job is None or env.embedded:
        raise RuntimeError("gradhub.init(): GRADHUB_MIN_WORKERS (an elastic job) needs a shared service: set "
                           "GRADHUB_SCHEDULER to `gradhub scheduler --service`'s address and GRADHUB_JOB (and its "
                           "GRADHUB_JOB_TOKEN)")
    most = env.max_workers if env.max_workers is not None else env.num_workers
    if not 1 <= env.min_workers <= env.num_workers <= most:
        raise RuntimeError(f"gradhub.init(): an elastic job needs 1 <= GRADHUB_MIN_WORKERS ({env.min_workers}) <= "
                           f"GRADHUB_NUM_WORKERS ({env.num_workers}) <= GRADHUB_MAX_WORKERS ({most})")
    # A generation's ranks are the service's choice: survivors first, in
    # their old order, then newcomers in the order of the ranks they asked
    # for (GRADHUB_RANK: the launcher's numbering), so the first generation
    # numbers the workers as their launcher does.


def _elastic_reg(env, prev_rank: int):
    """(min, max, initial size, rank in the previous generation) for the core, or None."""
    if env.min_workers is None:
        return None
    most = env.max_workers if env.max_workers is not None else env.num_workers
    return (env.min_workers, most, env.num_workers, prev_rank)


def hosts_updated() -> bool:
    """Whether workers wait to join this elastic job (`gradhub.torch.elastic`)."""
    c = _client
    return c is not None and c.hosts_updated()


def job_failure() -> str | None:
    """Why this worker's job failed (a lost peer, named), or None while it
    stands or before init: for waits outside the core, which must not outlive it."""
    c = _client
    return None if c is None else c.failure()


def init(scheduler: str | None = None, rank: int | None = None, num_workers: int | None = None,
         num_servers: int | None = None, *, _prev_rank: int = -1, _worker_env: _env.WorkerEnv | None = None) -> None:
    """Join the job. Arguments override the environment (GRADHUB_SCHEDULER,
    GRADHUB_RANK, GRADHUB_NUM_WORKERS, GRADHUB_NUM_SERVERS, or torchrun's RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR).

    BytePS style: started with GRADHUB_ROLE=server or scheduler, the same
    script runs that role here and exits when the job ends.

    `_worker_env`: the settings to join with instead of the environment's
    (the torch.distributed backend forms its job from what torch gives it)."""
    global _client, _embedded, _joined
    role = _env.role()
    if role != "worker":
        from . import roles

        sys.exit(roles.run_role(role))
    with _lock:
        if _client is not None:
            return
        env = _env.worker_env() if _worker_env is None else _worker_env
        if scheduler is not None:
            env.scheduler = scheduler
            env.embedded = False
        if rank is not None:
            env.rank = rank
        if num_workers is not None:
            env.num_workers = num_workers
        if num_servers is not None:
            env.num_servers = num_servers
        if env.min_workers is not None:
            _check_elastic(env)
        elif env.scheduler is not None and env.scheduler == _ended:
            raise RuntimeError(
                f"gradhub.init() after shutdown(): the job at {env.scheduler} ended when its workers shut down "
                "(its scheduler and servers exit then), so it cannot be joined again. Horovod can initialize "
                "twice in one process; gradhub cannot yet: call shutdown() once, at the end, or start a new job "
                "(another scheduler) to join")
        if not env.scheduler:
            raise RuntimeError(
                "gradhub.init(): no scheduler address. Start the job with `gradhub launch`, "
                "set GRADHUB_SCHEDULER=host:port, or run under torchrun (MASTER_ADDR)."
            )
        from .roles import DEFAULT_SCHEDULER_PORT, split_hostport

        if env.job is not None:
            if env.embedded:
                raise RuntimeError(f"gradhub.init(): GRADHUB_JOB={env.job!r} names a job of a shared service: set "
                                   "GRADHUB_SCHEDULER to the service's address")
            if env.num_workers <= 0:
                raise RuntimeError(f"gradhub.init(): GRADHUB_JOB={env.job!r}: a job on a shared service needs its "
                                   "size: set GRADHUB_NUM_WORKERS (or run under torchrun)")
            if env.token is None:
                raise RuntimeError(f"gradhub.init(): GRADHUB_JOB={env.job!r} needs the job's token: set "
                                   "GRADHUB_JOB_TOKEN to what the service's operator gave you (`gradhub token "
                                   f"{env.job}` on the service)")
        shared = None
        if env.embedded and env.token is None:
            shared = _env.torchrun_token(env.rank, env.connect_timeout)
            if shared is not None:
                env.token = shared.token
                if env.rank == 0:
                    print("[gradhub] job token: made up by rank 0, shared through torchrun's store", file=sys.stderr)
        _env.check_exposure("gradhub.init()", [split_hostport(env.scheduler, DEFAULT_SCHEDULER_PORT)[0]],
                            env.token, env.insecure)
        if env.embedded:
            from .roles import Embedded

            _embedded = Embedded(env)
        # A local rank/size the launcher gave is checked by the scheduler
        # against the hosts that registered (a wrong one fails init()).
        # None (not set): the core's default.
        config = _core.ClientConfig(env.scheduler, rank=env.rank, num_workers=env.num_workers,
                                    num_servers=env.num_servers, namespace=env.namespace,
                                    credit_bytes=env.credit_bytes, spread_bytes=env.spread_bytes,
                                    connect_timeout=env.connect_timeout, server_shm=env.server_shm,
                                    local_rank=env.local_rank, local_size=env.local_size,
                                    token=env.token, job=env.job, rack=env.rack,
                                    elastic=_elastic_reg(env, _prev_rank))
        _install_exit_hook()
        _client = _core.Client(config)
        if shared is not None:
            shared.formed()
        _joined = env.scheduler
        if env.timeline:
            timeline.start(env.timeline, _client.rank, _client)
    atexit.register(shutdown)


def _install_exit_hook() -> None:
    """Remember an unhandled exception (Ctrl-C included): the exit-time
    shutdown then fails the job for everyone, naming it, instead of saying a
    clean goodbye that would leave the other workers waiting for this one."""
    global _hook_installed
    if _hook_installed:
        return
    previous = sys.excepthook

    def hook(tp, value, tb):
        global _exit_error
        _exit_error = f"exited on an unhandled {tp.__name__}: {value}"
        previous(tp, value, tb)

    sys.excepthook = hook
    _hook_installed = True


def is_initialized() -> bool:
    return _client is not None


def shutdown() -> None:
    """Leave the job. Safe to call twice. Leaving with operations in flight,
    or after an unhandled exception, fails the job for every worker (naming
    this one and why) rather than leaving them waiting for its pushes."""
    global _client, _embedded, _ended
    with _lock:
        c, _client = _client, None
        emb, _embedded = _embedded, None
        if c is not None:
            _ended = _joined
    if c is None:
        return
    if _exit_error is not None:
        c.abort(_exit_error)
    else:
        c.shutdown()
    timeline.stop()  # after the shutdown: operations it failed are recorded too
    if emb is not None:
        emb.wait()


def rank() -> int:
    return _require().rank


def size() -> int:
    return _require().size


def local_rank() -> int:
    """This worker's rank among the workers on its host (checked by the scheduler)."""
    return _require().local_rank


def local_size() -> int:
    """The number of workers on this worker's host."""
    return _require().local_size


def _cross_group() -> list[int]:
    """The workers with this worker's local rank, one per host, by rank."""
    c = _require()
    mine = c.local_rank
    return [q for q, lr in enumerate(c.local_ranks) if lr == mine]


def cross_rank() -> int:
    """This worker's rank among the workers with its local rank (Horovod's
    cross rank: the index of its host, when every host has as many workers)."""
    return _cross_group().index(rank())


def cross_size() -> int:
    """The number of workers with this worker's local rank (Horovod's cross
    size: the number of hosts, when every host has as many workers)."""
    return len(_cross_group())


def is_homogeneous() -> bool:
    """Whether every host has the same number of workers."""
    lrs = _require().local_ranks
    counts = [lrs.count(lr) for lr in set(lrs)]
    # Local ranks are 0..size-1 per host: equal counts of each value means equal sizes.
    return len(set(counts)) <= 1


class Handle:
    """A push_pull in flight. `wait()` returns the (in-place updated) tensor."""

    __slots__ = ("_h", "tensor", "_host", "_copy_lock")

    def __init__(self, h: _core.Handle, tensor: Any, host: Any = None):
        self._h = h
        self.tensor = tensor
        self._host = host  # pinned host copy of a CUDA tensor, copied back once done
        self._copy_lock = threading.Lock() if host is not None else None

    def _copy_back(self) -> None:
        if self._copy_lock is None:
            return
        with self._copy_lock:
            host, self._host = self._host, None
            if host is not None:
                self.tensor.copy_(host)

    def wait(self, timeout: float | None = None):
        """Block until the result is in the tensor. Raises GradhubTimeoutError
        after `timeout` seconds (naming stalled ranks if a server reported
        them), GradhubError if a peer died or the job failed."""
        self._h.wait(timeout)
        self._copy_back()
        return self.tensor

    def done(self) -> bool:
        return self._h.done()

    def add_done_callback(self, fn: Callable[[Handle], None]) -> None:
        """Call `fn(handle)` once the operation has finished: from a core
        thread, or at once on this thread if it is already done. Inside `fn`,
        `handle.wait()` returns the tensor at once or raises the failure.
        `fn` should be quick and must not raise."""
        self._h.add_done_callback(lambda _error: fn(self))

    @property
    def name(self) -> str:
        return self._h.name

    def __repr__(self) -> str:
        return f"<gradhub.Handle {self.name!r} {'done' if self.done() else 'pending'}>"


AUTO_MARK = ".noname."


class AutoName(str):
    """A name gradhub generated for an unnamed operation (`auto_name`), or
    one derived from such a name (`derive_name`): the explicit mark, carried
    from where the name is made to the push, that the tensor is freed once
    its round completes (nobody uses the name again). Any other name,
    whatever it reads, is kept until released."""

    __slots__ = ()


def derive_name(name: str, suffix: str) -> str:
    """`name` + `suffix`, the name of a part of `name`'s operation (a
    broadcast's root check, an allgather's sizes, a gradient): generated
    (freed after its round) if `name` was."""
    out = f"{name}{suffix}"
    return AutoName(out) if isinstance(name, AutoName) else out


def _advance_names(at_least: int) -> None:
    """Make the next automatic name's number at least `at_least`."""
    global _names
    with _names_lock:
        nxt = next(_names)
        _names = itertools.count(max(nxt, at_least))


def auto_name(kind: str, persistent: bool = False) -> str:
    """A name for an unnamed operation: `<kind>.noname.<n>`, numbered in call
    order by one counter shared by every layer (gradhub and gradhub.torch), so
    unnamed calls never collide. The call order must be the same on every worker.

    The name is an `AutoName`: a push_pull under it (or a name derived from
    it with `derive_name`) frees its tensor once its round completes, since
    the name is never used again, so nothing accumulates over many unnamed
    calls. `persistent=True` gives a plain name for state reused across
    calls instead (`<kind>.auto.<n>`)."""
    with _names_lock:
        n = next(_names)
    return f"{kind}.auto.{n}" if persistent else AutoName(f"{kind}{AUTO_MARK}{n}")


_ELEM_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int32": 4, "int64": 8}


def push_pull_async(tensor: Any, name: str | None = None, average: bool = False, priority: int = 0,
                    dtype: str | None = None, init: bool = False, live: tuple[int, int] | None = None,
                    want: tuple[int, int] | None = None, members: list[int] | None = None,
                    sharded: bool = False, asynchronous: bool = False, live_is_own: bool = False) -> Handle:
    """Start summing `tensor` (in place) across all workers.

    `tensor`: a numpy array or a contiguous torch tensor (float32, float16,
    bfloat16, float64, int32, int64; float64 and the integers are summed
    exactly in their own type, integers wrapping as torch's do). CPU memory
    is used in place; a CUDA tensor is staged through pinned host memory and
    the result copied back by `wait()`.
    `name` identifies the tensor across workers; without one, names are
    generated from the call order, which must then be the same on every worker,
    and the tensor's state is freed once the call completes. A name used again
    with another shape or dtype is a new tensor (once the previous round of it
    completed).
    Higher `priority` is sent first. `average=True` divides by the number of
    workers (floating-point types only). `dtype="bfloat16"` lets a uint16 numpy array carry bfloat16 bits.
    `init=True` (float32 only) gives the servers the initial values of a tensor
    whose optimizer runs on the servers (`set_server_optimizer`); the round
    returns worker 0's values.
    `live=(start, stop)`: the tensor is zeros outside elements start..stop
    (this worker's rows of an allgather, a broadcast from another worker),
    so the chunks wholly outside them are pushed as a header saying "zeros"
    instead of their bytes. The caller must make sure they are zeros.
    `want=(start, stop)`: only elements start..stop of the result are needed
    (a reduce-scatter's shard), so the chunks wholly outside them come back
    as a header saying the round is complete, and keep what this worker
    pushed, instead of the sum (under the host stage every chunk comes back).
    `live_is_own=True`: no other worker's bytes fall in `live` (this
    worker's slot of an all-gather), so the sum of the chunks wholly inside
    it is what this worker pushed: they are pushed asking for no result, as
    those outside `want` (under the host stage every chunk comes back).
    `members`: the ranks that sum this tensor (a process set, a torch
    sub-group), this worker among them; only they push it, each for itself
    (not through the host stage), and no other worker takes part. Every
    member must give the same list for a name. None: every worker.
    `sharded=True`: the tensor is as many equal shards as it has members
    (or workers), the q-th this job's q-th member's (a reduce-scatter's
    result, an all-gather's slots): each shard is placed on a server on its
    member's host where there is one, so that shard's push or result stays
    on the host. Given on the name's first use.
    `asynchronous=True` (float32, a job with GRADHUB_ASYNC=1): `tensor` is this
    worker's change of a parameter (with `init=True`, its initial value); the
    servers add it to the parameter they hold as soon as it arrives and the
    call returns that parameter, without waiting for other workers
    (torch/asynchronous.py builds on this).
    """
    c = _require()
    host = host_memory(tensor, dtype)
    buf = get_buffer(host, dtype)
    if average and buf.dtype in INTEGER_DTYPES:
        raise ValueError("average=True needs a floating-point tensor: integers are summed exactly; "
                         "divide the sum yourself")
    if name is None:
        name = auto_name("push_pull")
    tl = timeline.active()
    end = tl.start(name, buf.nbytes, buf.dtype, int(priority)) if tl is not None else None
    es = _ELEM_BYTES[buf.dtype]

    def _bytes(r):
        return None if r is None else (max(0, int(r[0])) * es, max(0, int(r[1])) * es)

    h = c.push_pull_async(buf.ptr, buf.nbytes, buf.dtype, name, bool(average), int(priority), buf.obj,
                          init=bool(init), release_after=isinstance(name, AutoName), live=_bytes(live),
                          want=_bytes(want), live_is_own=bool(live_is_own), members=None if members is None else sorted(int(r) for r in members),
                          sharded=bool(sharded), asynchronous=bool(asynchronous))
    if end is not None:
        h.add_done_callback(end)
    return Handle(h, tensor, host if host is not tensor else None)


class PeerLinks:
    """Point-to-point links among the members of a group of workers (the
    torch backend's send and recv): opened by `open_peer_links`, on this
    worker's job, authenticated with its token. Messages are the bytes of
    contiguous host memory (a numpy array or a CPU tensor, any dtype)."""

    def __init__(self, links):
        self._links = links

    @property
    def address(self) -> str:
        """`host:port` where the group's other members reach this one."""
        return self._links.address

    def send(self, dst: int, addr: str, tag: int, data: Any) -> None:
        """Send `data`'s bytes to member `dst` (listening at `addr`) with
        `tag`; blocks, without the GIL, until they are written."""
        b = raw_buffer(data)
        self._links.send(dst, addr, tag, b.ptr, b.nbytes, b.obj)

    def post_recv(self, src: int | None, tag: int, out: Any, callback) -> int | None:
        """Post a receive into `out` from member `src` (None: any) with `tag`;
        `callback(sender, error)` runs on gradhub's callback thread once it
        is filled or failed. The ticket to `cancel` it by while it waits."""
        b = raw_buffer(out)
        return self._links.post_recv(src, tag, b.ptr, b.nbytes, b.obj, callback)

    def cancel(self, ticket: int) -> bool:
        """Withdraw a waiting receive: True if it was still waiting (its
        callback then never runs, and the next message goes to the next receive)."""
        return self._links.cancel(ticket)

    def close(self, why: str) -> None:
        self._links.close(why)


def open_peer_links(rank: int, size: int, group: str, timeout: float) -> PeerLinks:
    """Listen for point-to-point messages as member `rank` of the group
    named `group` (the same name on every member) of `size` workers, on
    GRADHUB_ADVERTISE_ADDR or else this host's address on the route to the
    job's scheduler; `timeout` bounds connecting and a send held back."""
    c = _require()
    host = _env.get("GRADHUB_ADVERTISE_ADDR") or _route_to(_joined or "127.0.0.1:1")
    return PeerLinks(c.peer_links(rank, size, group, host, timeout))


def _route_to(addr: str) -> str:
    """This host's address on the route to `addr` (host:port)."""
    import socket

    host = addr.rsplit(":", 1)[0].strip("[]")
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 1))   # (no packet is sent: this only picks the route)
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record every push_pull of this job in a Chrome trace at `file_path`
    (written by worker 0, as Horovod's timeline; `mark_cycles` is ignored)."""
    c = _require()
    timeline.start(file_path, c.rank, c)


def stop_timeline() -> None:
    """Stop recording the timeline (the file stays readable)."""
    timeline.stop()


def push_pull(tensor: Any, name: str | None = None, average: bool = False, priority: int = 0,
              dtype: str | None = None, timeout: float | None = None):
    """Sum (or average) `tensor` across all workers, in place; returns it.

    A `timeout` does not cancel the operation (the other workers' sums are
    built from this worker's pushes): the GradhubTimeoutError carries the
    operation as `.handle`, and the tensor stays in use, read and then
    written by gradhub, until `handle.wait()` returns. Do not write to it
    before then."""
    h = push_pull_async(tensor, name=name, average=average, priority=priority, dtype=dtype)
    try:
        return h.wait(timeout)
    except GradhubTimeoutError as e:
        e.handle = h
        raise


def broadcast(tensor: Any, root_rank: int, name: str | None = None, dtype: str | None = None):
    """Replace `tensor` on every worker with root_rank's values (in place).

    Implemented as a push_pull in which every other rank contributes zeros;
    x + 0 is exact in floating point, so the result is bit-identical to the
    root's tensor (except that -0.0 becomes +0.0)."""
    c = _require()
    if not 0 <= root_rank < c.size:
        raise ValueError(f"root_rank {root_rank} out of range for {c.size} workers")
    if name is None:
        name = auto_name("broadcast")
    validate(tensor, dtype)  # reject bad input before touching the caller's data
    # Every worker's root first: with different ones the data would be a sum.
    roots = np.zeros(c.size, dtype=np.int64)
    roots[c.rank] = root_rank + 1  # plus one: a worker in join() adds zeros
    push_pull(roots, name=derive_name(name, ".root"))
    if ((roots != root_rank + 1) & (roots != 0)).any():
        raise GradhubMismatchError(f"broadcast '{name}': workers disagree on the root rank: "
                         + ", ".join(f"worker {q} says {int(x) - 1}" for q, x in enumerate(roots) if x != 0))
    if c.rank != root_rank:
        if is_torch_tensor(tensor):
            tensor.zero_()
        else:
            tensor[...] = 0
    return push_pull(tensor, name=name, average=False, dtype=dtype)


def declare(tensors: Iterable[tuple[str, Any]] | dict) -> None:
    """Declare tensors ahead of their first push_pull, in one exchange with the
    scheduler: [(name, tensor_or_array), ...], [(name, (numel, dtype)), ...]
    or {name: tensor}. A spec may name its chunk size, (numel, dtype,
    partition_bytes), at most the job's partition size (the default). Blocks
    until every worker has declared them; checks that every worker declares
    the same sizes, dtypes and chunk sizes (raises otherwise)."""
    c = _require()
    items = tensors.items() if isinstance(tensors, dict) else tensors
    entries = []
    for name, t in items:
        if isinstance(t, tuple):
            numel, dt, *part = t
            entries.append((name, int(numel), str(dt), int(part[0]) if part else 0))
        else:
            entries.append((name, *describe(t), 0))
    c.declare(entries)


def partition_bytes() -> int:
    """The job's partition size: bytes per chunk of a tensor (at most)."""
    return _require().partition_bytes


def credit_bytes() -> int:
    """This worker's base credit per server connection, in bytes."""
    return _require().credit_bytes


def set_credit(nbytes: int) -> None:
    """Change this worker's base credit per server connection (bytes a
    connection may have pushed and not yet received whole by its server),
    from the next chunk it sends; autotuning tries several."""
    _require().set_credit(int(nbytes))


def release(*names: str) -> None:
    """Free the state of named tensors this job no longer uses: at once on
    this worker, on the servers and scheduler once every worker released
    them. Like any collective, every worker must release the same names;
    none may be in flight. Using a name again later declares a new tensor.
    (Unnamed operations free theirs by themselves.)"""
    _require().release([str(n) for n in names])


def set_server_optimizer(name: str, numel: int, kind: str, lr: float, momentum: float = 0.0,
                         dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False,
                         beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8) -> None:
    """Have the servers run an optimizer ("sgd" or "adamw") on float32 tensor
    `name` of `numel` elements: its push_pulls then return updated parameters
    (gradhub.torch.DistributedOptimizer(optimizer_on_server=True)). Call again
    to change hyperparameters; it takes effect from the tensor's next round."""
    _require().set_server_optimizer(name, int(numel), kind, float(lr), momentum=float(momentum),
                                    dampening=float(dampening), weight_decay=float(weight_decay),
                                    nesterov=bool(nesterov), beta1=float(beta1), beta2=float(beta2),
                                    eps=float(eps))


def barrier() -> None:
    """Block until every worker reaches the barrier."""
    _require().barrier()


def join() -> int:
    """Horovod's join, for uneven data: this worker has no more batches.
    Until every worker has joined, it takes part in the others' push_pulls
    (allreduce, allgather, broadcast, the optimizer's gradients) with zeros,
    so theirs complete; an average still divides by every worker, as in
    Horovod. Returns the rank that joined last; then every worker goes on.
    Nothing of this worker's may be in flight. Barriers are not taken part
    in: a worker must not enter one while another has joined."""
    last, names = _require().join()
    # Unnamed operations pushed meanwhile: this worker's name counter moves
    # past them, as if it had made those calls itself.
    top = -1
    for n in names:
        for mark in (AUTO_MARK, ".auto."):
            if mark in n:
                tail = n.rsplit(mark, 1)[1].split(".", 1)[0]
                if tail.isdigit():
                    top = max(top, int(tail))
    if top >= 0:
        _advance_names(top + 1)
    return last
