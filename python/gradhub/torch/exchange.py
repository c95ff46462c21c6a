"""Horovod's exchange collectives on gradhub's push_pull: reducescatter,
alltoall, grouped allgather and reducescatter, sparse allreduce.

The servers only sum, so each of these is built from sums: reducescatter is
an allreduce of which each worker keeps its rows; alltoall and allgather
place each worker's rows at its offset in a zero buffer and sum it. That
moves more bytes than a dedicated implementation (every worker receives the
whole buffer), which is fine for the metadata-sized exchanges these are used
for, and exact for every dtype. Operations that need several rounds (a size
exchange, then the data) run on a thread of their own when started
asynchronously, so `poll()` is honest.
"""

from __future__ import annotations

import numbers
import threading
from typing import Any, Callable

import torch

from .. import GradhubTimeoutError
from ..api import derive_name as _derive
from . import agreement as _agree
from .compression import Compression
from .exit_gate import exit_gate
from .ops import Adasum, Average, Handle, Sum, _allgather_impl, _group, _held, _reduce_async, _resolve_op, _track
from .process_sets import ProcessSet, _resolve, global_process_set
from .sums import finish_with


# ---------------------------------------------------------------- handles


class _ThreadHandle(Handle):
    """An operation of several rounds, run on a thread of its own: done when
    the thread is; `wait()` returns its result or raises its error. As in
    Horovod, starting one under an explicit name while another of that name
    is in flight here is a ValueError (generated names never collide)."""

    def __init__(self, fn: Callable[[], Any], name: str):
        super().__init__(None, lambda: None, name)
        token = _agree.claim(name)
        self._event = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable] = []
        self._cb_lock = threading.Lock()

        def run():
            if not exit_gate.enter():
                return   # (the interpreter is ending: nobody waits)
            try:
                try:
                    self._value = fn()
                except BaseException as e:  # handed to whoever waits
                    self._error = e
                _agree.release(name, token)
                with self._cb_lock:
                    self._event.set()
                    callbacks, self._callbacks = self._callbacks, []
                for cb in callbacks:
                    cb(self)
            finally:
                exit_gate.leave()

        threading.Thread(target=run, name=f"gradhub-{name}", daemon=True).start()

    def done(self) -> bool:
        return self._event.is_set()

    def _settle(self) -> None:
        self._event.wait()

    def wait(self, timeout: float | None = None):
        if not self._event.wait(timeout):
            raise GradhubTimeoutError(f"'{self.name}' did not complete within {timeout}s")
        if self._error is not None:
            raise self._error
        return self._value

    def add_done_callback(self, fn) -> None:
        with self._cb_lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)


# ---------------------------------------------------------------- reducescatter


def _rows(n_rows: int, size: int) -> list[int]:
    """Horovod's split of a first dimension: the first (n_rows % size) workers get one row more."""
    return [n_rows // size + (1 if q < n_rows % size else 0) for q in range(size)]


def _my_rows(t: torch.Tensor, counts: list[int], r: int) -> torch.Tensor:
    start = sum(counts[:r])
    return t[start:start + counts[r]]


def _check_scatter_op(op) -> Any:
    if op is Adasum:  # a RuntimeError, as Horovod's
        raise NotImplementedError("reducescatter does not support Adasum (nor does Horovod's): use Average or Sum")
    if op is not Average and op is not Sum:
        raise ValueError("reducescatter supports op=Average or op=Sum")
    return op


def reducescatter_async(tensor, op=Average, name=None, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0) -> Handle:
    """Reduce `tensor` across workers and keep this worker's rows of the
    result (dim 0 split evenly, the first workers taking one more)."""
    ps = _resolve(process_set)
    return _track(_reducescatter_async(tensor, op, ps._name(name, "reducescatter"), ps, prescale_factor,
                                       postscale_factor))


def _reducescatter_async(tensor, op, name: str, ps: ProcessSet, prescale: float, postscale: float) -> Handle:
    _check_scatter_op(op)
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension")
    counts, r = _rows(tensor.shape[0], ps.size()), ps.rank()
    h = _reduce_async(tensor, name, op, 0, Compression.none, None, prescale, postscale, ps, check=True)
    return finish_with(h, lambda finish: _my_rows(finish(), counts, r).clone())


class _ReducescatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, name, prescale, postscale, ps):
        # As Horovod: the allgather of the output gradients, times the size
        # for Sum (once for Average), and the scaling.
        ctx.scale = prescale * postscale * (ps.size() if op is Sum else 1)
        ctx.name, ctx.ps = name, ps
        return _reducescatter_async(tensor, op, name, ps, prescale, postscale).wait()

    @staticmethod
    def backward(ctx, grad):
        # d(my rows)/d(every worker's input rows): each worker's rows of the
        # output came from everyone's same rows, scaled.
        g = _allgather_impl(grad.contiguous(), _derive(ctx.name, ".grad"), ctx.ps)[0]
        return g * ctx.scale, None, None, None, None, None


def reducescatter(tensor, op=Average, name=None, process_set=global_process_set, prescale_factor=1.0,
                  postscale_factor=1.0):
    ps = _resolve(process_set)
    name = ps._name(name, "reducescatter")
    if tensor.requires_grad and torch.is_grad_enabled():
        return _ReducescatterFn.apply(tensor, _check_scatter_op(op), name, prescale_factor, postscale_factor, ps)
    return _reducescatter_async(tensor, op, name, ps, prescale_factor, postscale_factor).wait()


def grouped_reducescatter_async(tensors, op=Average, name=None, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0) -> Handle:
    ps = _resolve(process_set)
    base = ps._name(name, "grouped_reducescatter")
    return _track(_group(base, base, [lambda i=i, t=t: _reducescatter_async(t, op, _derive(base, f".{i}"), ps,
                                                                            prescale_factor, postscale_factor)
                                      for i, t in enumerate(tensors)]))


def grouped_reducescatter(tensors, op=Average, name=None, process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0) -> list:
    ps = _resolve(process_set)
    base = ps._name(name, "grouped_reducescatter")

    def run():
        out = []
        for i, t in enumerate(tensors):
            n = _derive(base, f".{i}")
            out.append(_ReducescatterFn.apply(t, _check_scatter_op(op), n, prescale_factor, postscale_factor, ps)
                       if t.requires_grad and torch.is_grad_enabled() else
                       _reducescatter_async(t, op, n, ps, prescale_factor, postscale_factor).wait())
        return out

    return _held(base, run)


# ---------------------------------------------------------------- allgather (grouped, async)


def allgather_async(tensor, name=None, process_set=global_process_set) -> Handle:
    """allgather started in the background (a size exchange, then the data)."""
    ps = _resolve(process_set)
    name = ps._name(name, "allgather")
    t = tensor.detach()
    return _track(_ThreadHandle(lambda: _allgather_impl(t, name, ps)[0], name))


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> Handle:
    ps = _resolve(process_set)
    base = ps._name(name, "grouped_allgather")
    ts = [t.detach() for t in tensors]
    return _track(_ThreadHandle(lambda: [_allgather_impl(t, _derive(base, f".{i}"), ps)[0] for i, t in enumerate(ts)],
                                base))


def grouped_allgather(tensors, name=None, process_set=global_process_set) -> list:
    from .ops import _AllgatherFn

    ps = _resolve(process_set)
    base = ps._name(name, "grouped_allgather")
    return _held(base, lambda: [_AllgatherFn.apply(t, _derive(base, f".{i}"), ps)
                                if t.requires_grad and torch.is_grad_enabled()
                                else _allgather_impl(t, _derive(base, f".{i}"), ps)[0] for i, t in enumerate(tensors)])


# ---------------------------------------------------------------- alltoall


def _send_counts(tensor: torch.Tensor, splits, n: int) -> list[int]:
    """The rows of `tensor` for each of the `n` members, checked before
    anything is sent (so alltoall_async raises at the call, as Horovod's):
    an even split of dim 0, or `splits`, integers only (Horovod's are int32;
    a floating or bool tensor is its ValueError)."""
    if tensor.dim() == 0:
        raise ValueError("alltoall needs a tensor with at least one dimension")
    if splits is None:
        if tensor.shape[0] % n:
            raise ValueError(f"alltoall without splits needs a first dimension divisible by the {n} workers, "
                             f"not {tensor.shape[0]}")
        return [tensor.shape[0] // n] * n
    if isinstance(splits, torch.Tensor):
        if splits.dtype.is_floating_point or splits.dtype.is_complex or splits.dtype == torch.bool:
            raise ValueError(f"alltoall splits must be integers (int32, as in Horovod), not {splits.dtype}")
        send = [int(x) for x in splits.reshape(-1).tolist()]
    elif all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in splits):
        send = [int(x) for x in splits]
    else:
        raise ValueError(f"alltoall splits must be integers, not {list(splits)}")
    if len(send) != n or any(x < 0 for x in send) or sum(send) != tensor.shape[0]:
        raise ValueError(f"alltoall splits {send} must be {n} non-negative row counts summing to the first "
                         f"dimension, {tensor.shape[0]}")
    return send


def _alltoall_impl(tensor: torch.Tensor, send: list[int], name: str, ps: ProcessSet) -> tuple[torch.Tensor,
                                                                                               torch.Tensor]:
    """`send`: this member's row counts for each member (`_send_counts`)."""
    n, r = ps.size(), ps.rank()
    t = tensor.detach().contiguous()
    # Every worker's splits (row q: what worker q sends to each), then every
    # worker's rows, concatenated in rank order.
    matrix = _allgather_impl(torch.tensor([send], dtype=torch.int64), _derive(name, ".splits"), ps)[0]
    rows, _ = _allgather_impl(t, _derive(name, ".data"), ps)
    out, base = [], 0
    for q in range(n):
        sent = matrix[q].tolist()
        start = base + sum(sent[:r])
        out.append(rows[start:start + sent[r]])
        base += sum(sent)
    received = matrix[:, r].to(torch.int32)
    return torch.cat(out).to(tensor.device), received


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> Handle:
    """alltoall in the background; `synchronize` returns (output, received splits)."""
    ps = _resolve(process_set)
    name = ps._name(name, "alltoall")
    send = _send_counts(tensor, splits, ps.size())
    return _track(_ThreadHandle(lambda: _alltoall_impl(tensor, send, name, ps), name))


class _AlltoallFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, ps):
        out, received = _alltoall_impl(tensor, _send_counts(tensor, splits, ps.size()), name, ps)
        ctx.received, ctx.name, ctx.ps = received, name, ps
        if splits is None:
            return out
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, *_):
        # The rows go back where they came from.
        g, _ = _alltoall_impl(grad.contiguous(), ctx.received.tolist(), _derive(ctx.name, ".grad"), ctx.ps)
        return g, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Send `splits[q]` rows of `tensor` (dim 0, in order) to worker q and
    return what every worker sent here, in rank order; with `splits`, also
    the rows received from each worker. Without `splits` the first dimension
    is split evenly."""
    ps = _resolve(process_set)
    name = ps._name(name, "alltoall")
    if tensor.requires_grad and torch.is_grad_enabled():
        return _held(name, lambda: _AlltoallFn.apply(tensor, splits, name, ps))
    out, received = _held(name, lambda: _alltoall_impl(tensor, _send_counts(tensor, splits, ps.size()), name, ps))
    return out if splits is None else (out, received)


# ---------------------------------------------------------------- sparse


class _SparseHandle(_ThreadHandle):
    """Horovod's sparse_allreduce_async returns a function that gives the
    result: this handle is one too (`handle()`), and works with `synchronize`."""

    def __call__(self):
        return self.wait()


def sparse_allreduce_async(tensor, name=None, op=Average, process_set=global_process_set) -> Handle:
    """Horovod's sparse allreduce: every worker's indices and values,
    gathered; `handle()` (or `synchronize(handle)`) returns the sparse sum
    (or average), uncoalesced."""
    ps = _resolve(process_set)
    op = _resolve_op(None, op)
    if op is not Average and op is not Sum:
        raise ValueError("sparse_allreduce_async supports op=Average or op=Sum")
    if not tensor.is_sparse:
        raise ValueError("sparse_allreduce_async takes a sparse COO tensor")
    name = ps._name(name, "sparse_allreduce")
    t = tensor.detach().coalesce()
    n = ps.size()

    def run():
        idx = _allgather_impl(t.indices().t().contiguous(), _derive(name, ".indices"), ps)[0].t()
        vals = _allgather_impl(t.values().contiguous(), _derive(name, ".values"), ps)[0]
        if op is Average:
            vals = vals / n
        return torch.sparse_coo_tensor(idx, vals, t.shape).to(tensor.device)

    return _track(_SparseHandle(run, name))
