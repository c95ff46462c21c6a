"""The torch local stage (GRADHUB_LOCAL_STAGE=torch, or auto for CUDA
tensors): the workers of one host sum a tensor with torch.distributed
collectives instead of the core's shared-memory host stage (BytePS §4.2 on
GPUs: NCCL's reduce-scatter, the network, NCCL's all-gather).

For a tensor (or a fusion bucket) of n elements, on a host of W workers:

1. reduce-scatter over the host's group: local rank j ends with the host's
   sum of share j (n split into W equal shares, the last padded);
2. `copies.py` copies share j into the tensor's host buffer (zeros elsewhere)
   and the core push_pulls the whole buffer under the tensor's name with
   `live` = share j, so only the share's chunks leave with data (the rest
   are zeros, pushed as a header); the sum over every worker of every host
   is the job's sum, whatever each host's W (uneven hosts need no rule);
3. share j of the result is copied back and the group all-gathers it.

So each worker copies 1/W of the tensor to the host and back. With the
core's host stage also on (GRADHUB_HOST_REDUCE=1, the default) the shares
meet in shared memory as any contribution does, and the host still pushes
each chunk once; that sum adds zeros, the price of leaving the core as it
is (docs/architecture.md, "GPU data path").

The group is made once, at `gradhub.torch.init()`, from the host's workers
only: local rank 0 opens a torch TCPStore on a free loopback port, and one
gradhub round tells every worker its host's port. Two process groups share
that store: one for the reduce-scatters (issued by the caller, in call
order), one for the all-gathers (issued by a thread, in the same order),
so neither collective can overtake the other's sequence on some worker.
Like NCCL's, they need every worker of a host to start its reductions in
the same order (DistributedOptimizer, fusion and the DDP hook do).

A job whose workers are all on one host needs no network: its host's sum
is the job's, so each operation is one all-reduce of the host's group
(NCCL's on GPUs), with nothing staged and no server round.

Only the global process set goes through this stage; a process set's
operations, and everything under `join()`, take the core's path.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import queue
import socket
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from .. import GradhubError, GradhubTimeoutError
from .. import _env
from .. import api as _api
from . import copies as _copies

_TIMEOUT = datetime.timedelta(seconds=600)
# A host mate that dies or freezes never finishes a local collective, and
# torch's own timeout (_TIMEOUT) is long: the stage's threads wait in slices
# of _POLL seconds and give up once the core says the job failed (it finds a
# lost worker within the peer timeout and names it).
_POLL = 0.05
# A local collective that failed by itself (a killed host mate's sockets
# closed): how long to wait for the core to name who is gone before saying
# only what torch said.
_NAME_GRACE = 5.0


def check_job(what: str) -> None:
    """Raise if the job failed: `what` (the local step waiting) cannot complete."""
    why = _api.job_failure()
    if why is not None:
        raise GradhubError(f"{what} with this host's workers cannot complete: the job failed: {why}")


class _Waiter:
    """Waits on a stage thread's CPU (gloo) collectives for it, in order:
    gloo's `wait()` takes no timeout and `is_completed()` stays False until
    it is waited on, so a thread of its own blocks there and the stage
    thread waits on that in slices, free to give up when the job fails (the
    blocked thread is abandoned with the job). NCCL's `wait()` only orders
    the caller's stream: it needs none (the copy's event is polled)."""

    def __init__(self, name: str):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, name=f"gradhub-local-{name}-wait", daemon=True).start()

    def _loop(self) -> None:
        while True:
            work, done, failed = self._q.get()
            try:
                work.wait()
            except BaseException as e:  # noqa: BLE001 - handed to the stage thread
                failed.append(e)
            done.set()

    def wait(self, work, what: str, device: torch.device) -> None:
        """Wait for `work` while the job stands; its own failure is reported
        with the core's reason once the core has one."""
        if device.type == "cuda":
            work.wait()
            return
        done, failed = threading.Event(), []
        self._q.put((work, done, failed))
        while not done.wait(_POLL):
            check_job(what)
        if failed:
            deadline = time.monotonic() + _NAME_GRACE
            while time.monotonic() < deadline:
                check_job(what)
                time.sleep(_POLL)
            raise GradhubError(f"{what} with this host's workers failed: {failed[0]}") from failed[0]


_cpu_copies = _copies.CpuCopies()
_cuda_copies = None


def _copies_for(t: torch.Tensor):
    """The copy layer of `t`'s device (copies.py; CUDA's, cuda_copies.py,
    made on first use)."""
    global _cuda_copies
    if t.device.type != "cuda":
        return _cpu_copies
    if _cuda_copies is None:
        from .cuda_copies import CudaCopies

        _cuda_copies = CudaCopies()
    return _cuda_copies


def host_key() -> int:
    """This worker's host identity as the core sees it (GRADHUB_HOST_ID, else
    the host name and network namespace), as a positive int64."""
    hid = _env.get("GRADHUB_HOST_ID")
    if not hid:
        try:
            ns = os.readlink("/proc/self/ns/net")
        except OSError:
            ns = ""
        hid = f"{socket.gethostname()} {ns}"
    return int.from_bytes(hashlib.blake2b(hid.encode(), digest_size=7).digest(), "little")


class LocalGroup:
    """The host's workers as torch process groups (gloo for CPU tensors,
    NCCL for CUDA ones), and the two threads that carry an operation after
    its reduce-scatter. `size == 1`: no group, the stage only stages."""

    def __init__(self, rank: int, size: int, store, whole_job: bool = False):
        self.rank, self.size = rank, size
        # Every worker of the job is on this host: the host's sum is the
        # job's, so an operation is one all-reduce of the host's group (NCCL
        # on the GPUs), with no copy to the host and no server round.
        self.whole_job = whole_job
        self._store = store
        self._groups: dict[str, tuple] = {}
        self._groups_lock = threading.Lock()  # made by the caller's thread or the gather thread, whichever is first
        self._staged: queue.SimpleQueue = queue.SimpleQueue()    # after the reduce-scatter
        self._gathered: queue.SimpleQueue = queue.SimpleQueue()  # after the core's round
        self._work: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name: (padded, share), reused
        self._waiters = {"stage": _Waiter("stage"), "gather": _Waiter("gather")}
        for target, name in ((self._stage_loop, "stage"), (self._gather_loop, "gather")):
            threading.Thread(target=target, name=f"gradhub-local-{name}", daemon=True).start()

    def groups(self, device: torch.device) -> tuple:
        """(reduce-scatter group, all-gather group) for tensors on `device`."""
        kind = device.type
        with self._groups_lock:
            g = self._groups.get(kind)
            if g is None:
                if kind == "cuda":
                    from .cuda_copies import nccl_group as make
                else:
                    def make(store, rank, size):
                        return dist.ProcessGroupGloo(store, rank, size, _TIMEOUT)
                g = tuple(make(dist.PrefixStore(f"{kind}.{part}", self._store), self.rank, self.size)
                          for part in ("rs", "ag"))
                self._groups[kind] = g
            return g

    def _buffers(self, name: str, flat: torch.Tensor, share: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The padded work buffer (the tensor itself when it splits evenly)
        and the share buffer: made once per name."""
        padded = share * self.size
        w = self._work.get(name)
        if w is None or w[1].numel() != share or w[1].dtype != flat.dtype or w[1].device != flat.device:
            pad = None if padded == flat.numel() else torch.zeros(padded, dtype=flat.dtype, device=flat.device)
            w = (pad, torch.empty(share, dtype=flat.dtype, device=flat.device))
            if not isinstance(name, _api.AutoName):
                self._work[name] = w
        pad, share_t = w
        if pad is None:
            return flat, share_t
        pad[:flat.numel()].copy_(flat)
        return pad, share_t

    def push_pull_async(self, buf: torch.Tensor, name: str, average: bool, priority: int) -> "Handle":
        flat = buf.view(-1)
        n = flat.numel()
        st = _copies_for(buf)
        op = _Op(buf, name, st)
        if self.whole_job:
            op.whole = True
            op.rs = self.groups(buf.device)[0].allreduce([flat]) if self.size > 1 and n else None
            op.args = (average, priority)
            self._staged.put(op)
            return Handle(op)
        share = -(-n // self.size) if n else 0
        op.start = min(self.rank * share, n)
        op.stop = min(op.start + share, n)
        if self.size == 1:
            op.work, op.share, op.rs = flat, flat, None
        else:
            op.work, op.share = self._buffers(name, flat, share)
            rs = self.groups(buf.device)[0]
            op.rs = rs.reduce_scatter([op.share], [list(op.work.split(share))]) if share else None
        op.args = (average, priority)
        self._staged.put(op)
        return Handle(op)

    def _stage_loop(self) -> None:
        while True:
            op = self._staged.get()
            if op.whole:
                self._finish_whole(op)
                continue
            try:
                if op.rs is not None:
                    self._waiters["stage"].wait(op.rs, f"the reduce-scatter of '{op.name}'", op.buf.device)
                valid = op.share[:op.stop - op.start]
                host = op.copies.buffers.get(op.name, op.buf.numel(), op.buf.dtype)
                op.copies.to_host(valid, host, op.start, check=lambda: check_job(f"the reduce-scatter of '{op.name}'"))
                op.host = host
                op.core = _api.push_pull_async(host, name=op.name, average=op.args[0], priority=op.args[1],
                                               live=(op.start, op.stop))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits
                op.error = e
            self._gathered.put(op)

    def _finish_whole(self, op: "_Op") -> None:
        """The all-reduce of an operation of a job on one host: its result."""
        try:
            if op.rs is not None:
                self._waiters["stage"].wait(op.rs, f"the all-reduce of '{op.name}'", op.buf.device)
            if op.args[0]:
                op.buf.div_(self.size)  # the servers' average: over every worker, all of them here
            op.ready = op.copies.record(op.buf)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            op.error = e
        op.finish()

    def _gather_loop(self) -> None:
        while True:
            op = self._gathered.get()
            try:
                if op.error is None:
                    op.core.wait()
                    op.copies.from_host(op.host, op.start, op.share[:op.stop - op.start])
                    if self.size > 1 and op.share.numel():
                        ag = self.groups(op.buf.device)[1]
                        self._waiters["gather"].wait(ag.allgather([list(op.work.split(op.share.numel()))], [op.share]),
                                                     f"the all-gather of '{op.name}'", op.buf.device)
                    flat = op.buf.view(-1)
                    if op.work.data_ptr() != flat.data_ptr():
                        flat.copy_(op.work[:flat.numel()])
                    op.ready = op.copies.record(op.buf)
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits
                op.error = e
            if isinstance(op.name, _api.AutoName):
                op.copies.buffers.drop(op.name)
            op.finish()


class _Op:
    """One operation through the stage, from reduce-scatter to all-gather."""

    def __init__(self, buf: torch.Tensor, name: str, copies):
        self.buf, self.name, self.copies = buf, name, copies
        self.start = self.stop = 0
        self.work = self.share = self.rs = self.host = self.core = self.ready = None
        self.whole = False  # the job is on one host: one all-reduce (`LocalGroup.whole_job`)
        self.args: tuple = ()
        self.error: BaseException | None = None
        self.event = threading.Event()
        self.callbacks: list[Callable] = []
        self.lock = threading.Lock()

    def finish(self) -> None:
        with self.lock:
            self.event.set()
            callbacks, self.callbacks = self.callbacks, []
        for cb in callbacks:
            cb()


class Handle:
    """An operation of the torch stage (quacks like `gradhub.api.Handle`)."""

    __slots__ = ("_op",)

    def __init__(self, op: _Op):
        self._op = op

    @property
    def name(self) -> str:
        return self._op.name

    @property
    def tensor(self) -> torch.Tensor:
        return self._op.buf

    def done(self) -> bool:
        return self._op.event.is_set()

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        op = self._op
        if not op.event.wait(timeout):
            raise GradhubTimeoutError(f"'{op.name}' did not complete within {timeout}s (torch local stage)")
        if op.error is not None:
            raise op.error
        op.copies.wait(op.ready)  # the caller's stream waits for the result (CUDA); nothing on CPU
        return op.buf

    def add_done_callback(self, fn: Callable[["Handle"], None]) -> None:
        op = self._op
        with op.lock:
            if not op.event.is_set():
                op.callbacks.append(lambda: fn(self))
                return
        fn(self)


_group: LocalGroup | None = None
_mode: str = _env.get("GRADHUB_LOCAL_STAGE")  # read again by setup()


def setup() -> None:
    """`gradhub.torch.init()`: read GRADHUB_LOCAL_STAGE and, if the torch
    stage may be used (torch; auto with CUDA present, the same on every
    worker), make the host's group. A collective of every worker."""
    global _group, _mode
    _mode = _env.get("GRADHUB_LOCAL_STAGE")
    if _env.get("GRADHUB_DETERMINISTIC"):
        # NCCL's and gloo's reductions add in their own order, not the ranks'.
        if _mode == "torch":
            raise RuntimeError("GRADHUB_DETERMINISTIC=1 sums in rank order, which the torch local stage (NCCL, gloo) "
                               "does not promise: use GRADHUB_LOCAL_STAGE=shm or auto")
        _mode = "shm"
    if _group is not None or _mode == "shm" or (_mode == "auto" and not torch.cuda.is_available()):
        return
    n, r = _api.size(), _api.rank()
    lrank, lsize = _api.local_rank(), _api.local_size()
    store = None
    if lrank == 0 and lsize > 1:
        store = dist.TCPStore("127.0.0.1", 0, lsize, True, timeout=_TIMEOUT, wait_for_workers=False)
    table = torch.zeros((n, 3), dtype=torch.int64)
    table[r, 0] = host_key()
    table[r, 1] = store.port if store is not None else 0
    table[r, 2] = lrank
    _api.push_pull(table, name="local_stage.init")
    _api.release("local_stage.init")
    mine = [q for q in range(n) if int(table[q, 0]) == int(table[r, 0])]
    lranks = table[:, 2].tolist()
    if sorted(lranks[q] for q in mine) != list(range(lsize)):
        raise RuntimeError(
            f"GRADHUB_LOCAL_STAGE={_mode}: worker {r} finds workers {mine} on its host (by GRADHUB_HOST_ID, or host "
            f"name and network namespace), with local ranks {[lranks[q] for q in mine]}, but gradhub placed "
            f"{lsize} workers there: give every worker of a host the same GRADHUB_HOST_ID, or use "
            "GRADHUB_LOCAL_STAGE=shm")
    if store is None and lsize > 1:
        root = next(q for q in mine if lranks[q] == 0)
        store = dist.TCPStore("127.0.0.1", int(table[root, 1]), lsize, False, timeout=_TIMEOUT)
    _group = LocalGroup(lrank, lsize, store, whole_job=lsize == n)
    if _mode == "torch" and lsize > 1:
        _group.groups(torch.device("cpu"))  # gloo's groups now, at init (NCCL's at their first use: the device is set)


def uses(buf: torch.Tensor) -> bool:
    """Whether a reduction of `buf` over the global set takes the torch stage."""
    if _mode == "shm" or (_mode == "auto" and buf.device.type != "cuda"):
        return False
    if _group is None:
        if _mode == "auto":
            return False  # gradhub.init() without gradhub.torch.init(): the core's path
        raise RuntimeError("GRADHUB_LOCAL_STAGE=torch needs the host's group, made by gradhub.torch.init(): call "
                           "it instead of gradhub.init()")
    return True


def push_pull_async(buf: torch.Tensor, name: str, average: bool, priority: int) -> Handle:
    """Sum contiguous `buf` in place across every worker through the torch stage."""
    return _group.push_pull_async(buf, name, average, priority)


def forget() -> None:
    """The job's membership changed (an elastic reset): the host's group is
    made again at the next `setup()`; the old one's threads are abandoned."""
    global _group
    _group = None
