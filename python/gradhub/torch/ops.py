"""Collective operations on torch tensors, with Horovod's names and semantics,
built on gradhub's push_pull (a sum across workers).

- float32/float16/bfloat16 travel natively; float64 and integer tensors are
  carried as float32 (exact for integers below 2^24, a float32 rounding for
  float64) in allreduce, and as raw bytes (exact) in broadcast and allgather.
- Every sum starts in `sums` (`start_reduction`, `start_sum`), the path the
  DDP hook and the torch.distributed backend take too. CUDA tensors are
  staged through pinned host memory with PyTorch's copies (by
  gradhub.api.push_pull_async, the one door into the core), or, with the
  torch local stage (GRADHUB_LOCAL_STAGE), reduce-scattered over the host's
  GPUs first and staged 1/W each (`local_stage`).
"""

from __future__ import annotations

import pickle
import threading
import weakref
import zlib
from typing import Any

import numpy as np
import torch

from .. import api as _api
from ..api import GradhubMismatchError
from . import agreement as _agree
from .compression import Compression
from .process_sets import ProcessSet, _resolve, global_process_set
from .sums import Handle, finish_with, scaled, start_reduction, start_sum


class ReduceOp:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self):
        return f"gradhub.torch.{self.name}"


Average = ReduceOp("Average")
Sum = ReduceOp("Sum")
# Reduced by gathering every worker's tensor and reducing locally (the
# servers sum only): one allgather's traffic, exact for every dtype.
Min = ReduceOp("Min")
Max = ReduceOp("Max")
Product = ReduceOp("Product")
Adasum = ReduceOp("Adasum")
_GATHERED = {Min: lambda t: t.amin(0), Max: lambda t: t.amax(0), Product: lambda t: t.prod(0)}

_NATIVE = (torch.float32, torch.float16, torch.bfloat16)
_auto_name = _api.auto_name
_derive = _api.derive_name  # a part of an operation's name: freed after its round if the name was generated


def _resolve_op(average, op):
    if op is not None and average is not None:
        raise ValueError("pass either average= or op=, not both")
    if op is None:
        op = Average if average in (None, True) else Sum
    if op is Adasum:
        raise NotImplementedError(
            "gradhub.torch.Adasum is not implemented: gradhub's servers sum (or average); use Average or Sum")
    if op not in (Average, Sum) and op not in _GATHERED:
        raise ValueError(f"unsupported reduce op {op!r}: use gradhub.torch.Average, Sum, Min, Max or Product")
    return op


# The operations the user started asynchronously and may not have waited
# for: `barrier()` lets them finish first, as Horovod's does. (Public async
# calls only: the optimizer's gradients never reach a barrier in flight.)
_started: "weakref.WeakSet[Handle]" = weakref.WeakSet()


def _track(h: Handle) -> Handle:
    _started.add(h)
    return h


def _settle_started() -> None:
    """Wait for every operation this worker started asynchronously (barrier)."""
    for h in list(_started):
        h._settle()


def parameter_names(params: list, named_parameters) -> dict[int, str]:
    """By id, the name each parameter is pushed under: from
    `named_parameters` ((name, parameter) pairs covering `params`, names
    unique), else `param.<i>`. What every DistributedOptimizer mode names."""
    if named_parameters is None:
        return {id(p): f"param.{i}" for i, p in enumerate(params)}
    named = list(named_parameters)
    if named and not isinstance(named[0], tuple):
        raise ValueError("named_parameters should be a sequence of (name, parameter) tuples, "
                         "e.g. model.named_parameters()")
    names = {id(p): n for n, p in named}
    if len(names) != len({n for n, _ in named}):
        raise ValueError("parameter names in named_parameters must be unique")
    missing = [p for p in params if id(p) not in names]
    if missing:
        raise ValueError(f"named_parameters does not cover {len(missing)} of the optimizer's parameters")
    return names


def _check_inplace(tensor: torch.Tensor, what: str):
    if tensor.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            f"{what} modifies its argument in place, but this tensor requires grad; "
            f"use the out-of-place version, or call it on tensor.data / under torch.no_grad()"
        )


# ---------------------------------------------------------------- allreduce


def push_pull_async(tensor, average=True, name=None, priority=0, compression=Compression.none) -> Handle:
    """Start summing (average=True: averaging) `tensor` across workers; out of place."""
    return start_reduction(tensor, name or _auto_name("push_pull"), average=bool(average), priority=priority,
                           compression=compression)


def push_pull(tensor, average=True, name=None, priority=0, compression=Compression.none):
    """BytePS's name for allreduce: returns the reduced tensor (out of place)."""
    return push_pull_async(tensor, average, name, priority, compression).wait()


def _reduce_async(tensor, name: str, op, priority, compression, inplace_target, prescale: float,
                  postscale: float, ps: ProcessSet = global_process_set, check: bool = False) -> Handle:
    """allreduce(_async)(_)'s one path: summed (averaged) on the servers, or
    gathered and reduced here (Min, Max, Product), scaled before and after.
    `check` (public collectives): the name is held while in flight, and
    Horovod's shape check across workers runs beside the data."""
    token = _agree.claim(name) if check else None
    try:
        shape = _agree.start_shape_check([tensor], name, ps) if check else None
    except BaseException:
        _agree.release(name, token)
        raise
    check, shape_h = shape if shape is not None else (None, None)
    if op in _GATHERED:
        try:
            t = scaled(tensor.detach(), prescale).reshape(1, -1)
            gathered = _allgather_impl(t, name, ps)[0]
            if check is not None:
                check()
        finally:
            _agree.release(name, token)
        out = scaled(_GATHERED[op](gathered).to(tensor.dtype), postscale).view_as(tensor)
        if inplace_target is not None:
            inplace_target.copy_(out)
            out = inplace_target
        return Handle(None, lambda: out, name)
    if op is Average and not tensor.dtype.is_floating_point:
        # As Horovod: an integer average is the sum times postscale/size,
        # truncated once (not rounded, then scaled again).
        op, postscale = Sum, postscale / ps.size()
    if prescale != 1.0:
        tensor = scaled(tensor.detach(), prescale)
        if inplace_target is not None:
            inplace_target.copy_(tensor)
            tensor = inplace_target
    try:
        h = _agree.after(start_reduction(tensor, name, ps, average=op is Average, priority=priority,
                                         compression=compression, target=inplace_target), check)
    except BaseException:
        _agree.release(name, token)
        raise

    def finished(finish):
        try:
            out = finish()
            if postscale == 1.0:
                return out
            if inplace_target is not None:
                out.copy_(scaled(out, postscale))
                return out
            return scaled(out, postscale)
        finally:
            _agree.release(name, token)  # every round is in: the name is free for the caller's next operation

    if token is None and postscale == 1.0:
        return h  # nothing to add (the optimizer's gradients with a predivide factor come this way)
    finish_with(h, finished)
    _agree.release_when_done(name, token, [h] if shape_h is None else [h, shape_h])
    return h


def allreduce_async(tensor, average=None, name=None, compression=Compression.none, op=None, priority=0,
                    prescale_factor=1.0, postscale_factor=1.0, process_set=None) -> Handle:
    ps = _resolve(process_set)
    op = _resolve_op(average, op)
    return _track(_reduce_async(tensor, ps._name(name, "allreduce"), op, priority, compression, None,
                                prescale_factor, postscale_factor, ps, check=True))


class _AllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, compression, prescale, postscale, ps):
        ctx.op, ctx.compression, ctx.name, ctx.scale, ctx.ps = op, compression, name, (prescale, postscale), ps
        return _reduce_async(tensor, name, op, 0, compression, None, prescale, postscale, ps, check=True).wait()

    @staticmethod
    def backward(ctx, grad):
        g = _reduce_async(grad.contiguous(), _derive(ctx.name, ".grad"), ctx.op, 0, ctx.compression, None, ctx.scale[0],
                          ctx.scale[1], ctx.ps)
        return g.wait(), None, None, None, None, None, None


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=None):
    """Reduce `tensor` across workers (default: average); returns a new tensor.
    `op`: Average, Sum, Min, Max or Product; `prescale_factor` multiplies the
    input, `postscale_factor` the result. Differentiable for Average and Sum:
    the gradient is reduced the same way."""
    ps = _resolve(process_set)
    op = _resolve_op(average, op)
    return _allreduce(tensor, ps._name(name, "allreduce"), op, compression, prescale_factor, postscale_factor, ps)


def _allreduce(tensor, name, op, compression, prescale, postscale, ps):
    """allreduce under its final name: through autograd when it is differentiable."""
    if tensor.requires_grad and torch.is_grad_enabled() and op not in _GATHERED:
        return _AllreduceFn.apply(tensor, name, op, compression, prescale, postscale, ps)
    return _reduce_async(tensor, name, op, 0, compression, None, prescale, postscale, ps, check=True).wait()


def allreduce_async_(tensor, average=None, name=None, op=None, priority=0, compression=Compression.none,
                     prescale_factor=1.0, postscale_factor=1.0, process_set=None) -> Handle:
    """In-place allreduce; `synchronize(handle)` returns `tensor` itself."""
    ps = _resolve(process_set)
    _check_inplace(tensor, "allreduce_")
    op = _resolve_op(average, op)
    return _track(_reduce_async(tensor, ps._name(name, "allreduce"), op, priority, compression, tensor,
                                prescale_factor, postscale_factor, ps, check=True))


def allreduce_(tensor, average=None, name=None, op=None, compression=Compression.none, prescale_factor=1.0,
               postscale_factor=1.0, process_set=None):
    return allreduce_async_(tensor, average, name, op, compression=compression, prescale_factor=prescale_factor,
                            postscale_factor=postscale_factor, process_set=process_set).wait()


class _GroupHandle(Handle):
    """A grouped operation: done when every member is; `wait()` returns the list of outputs."""

    def __init__(self, handles: list[Handle], name: str):
        super().__init__(None, lambda: [h.wait() for h in handles], name)
        self._members = handles

    def done(self) -> bool:
        return self._done or all(h.done() for h in self._members)

    def _settle(self) -> None:
        for h in self._members:
            h._settle()

    def add_done_callback(self, fn) -> None:
        left = [len(self._members)]
        lock = threading.Lock()

        def one(_h):
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                fn(self)

        if not self._members:
            fn(self)
        for h in self._members:
            h.add_done_callback(one)


def _group_names(tensors, name, kind, ps):
    """The group's name and its members' (`<group>.<i>`)."""
    base = ps._name(name, kind)
    return base, [_derive(base, f".{i}") for i in range(len(tensors))]


def _group(base: str, name: str, starts) -> _GroupHandle:
    """A grouped operation under `base`: held as one name from the call
    until every member is in, so a second group under it raises before any
    of its members starts (a member whose predecessor completed could
    otherwise start alone and wait forever for the other workers)."""
    token = _agree.claim(base)
    try:
        g = _GroupHandle([start() for start in starts], name)
    except BaseException:
        _agree.release(base, token)
        raise

    def finished(finish):
        try:
            return finish()
        finally:
            _agree.release(base, token)

    finish_with(g, finished)
    _agree.release_when_done(base, token, [g])
    return g


def _held(base: str, run):
    """`run()` with the name `base` held (a synchronous grouped operation)."""
    token = _agree.claim(base)
    try:
        return run()
    finally:
        _agree.release(base, token)


def grouped_allreduce_async(tensors, average=None, name=None, compression=Compression.none, op=None,
                            prescale_factor=1.0, postscale_factor=1.0, priority=0, process_set=None) -> Handle:
    """Reduce a list of tensors together; `synchronize` returns the list of results."""
    ps = _resolve(process_set)
    op = _resolve_op(average, op)
    base, names = _group_names(tensors, name, "grouped_allreduce", ps)
    return _track(_group(base, names[0] if names else "grouped_allreduce",
                         [lambda t=t, n=n: _reduce_async(t, n, op, priority, compression, None, prescale_factor,
                                                         postscale_factor, ps, check=True)
                          for t, n in zip(tensors, names)]))


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=None):
    """allreduce of each of `tensors`, started together; returns the list of results
    (differentiable like allreduce)."""
    ps = _resolve(process_set)
    op = _resolve_op(average, op)
    base, names = _group_names(tensors, name, "grouped_allreduce", ps)
    if any(t.requires_grad for t in tensors) and torch.is_grad_enabled():
        return _held(base, lambda: [_allreduce(t, n, op, compression, prescale_factor, postscale_factor, ps)
                                    for t, n in zip(tensors, names)])
    return _group(base, base, [lambda t=t, n=n: _reduce_async(t, n, op, 0, compression, None, prescale_factor,
                                                              postscale_factor, ps, check=True)
                               for t, n in zip(tensors, names)]).wait()


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                             priority=0, compression=Compression.none, process_set=None) -> Handle:
    """In place; `synchronize` returns the tensors themselves."""
    ps = _resolve(process_set)
    op = _resolve_op(average, op)
    for t in tensors:
        _check_inplace(t, "grouped_allreduce_")
    base, names = _group_names(tensors, name, "grouped_allreduce", ps)
    return _track(_group(base, names[0] if names else "grouped_allreduce",
                         [lambda t=t, n=n: _reduce_async(t, n, op, priority, compression, t, prescale_factor,
                                                         postscale_factor, ps, check=True)
                          for t, n in zip(tensors, names)]))


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       compression=Compression.none, process_set=None):
    return grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                    compression=compression, process_set=process_set).wait()


def synchronize(handle: Handle):
    """Wait for an async operation; returns its output tensor."""
    if not isinstance(handle, Handle):
        raise TypeError(f"synchronize() takes a handle returned by an *_async function, not {type(handle).__name__}")
    return handle.wait()


def poll(handle: Handle) -> bool:
    """True if the async operation has finished (synchronize will not block)."""
    return handle.done()


# ---------------------------------------------------------------- broadcast


def _bytes_as_f32(t: torch.Tensor) -> torch.Tensor:
    """Each byte of t as one float32 (exact: only values 0..255 are summed with zeros)."""
    raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    return raw.to(torch.float32)


def broadcast_async(tensor, root_rank, name=None, process_set=None) -> Handle:
    """Start replacing `tensor`'s value with root_rank's; out of place."""
    ps = _resolve(process_set)
    return _track(_broadcast_async(tensor, root_rank, ps._name(name, "broadcast"), None, ps))


def _broadcast_async(tensor, root_rank, name, target, ps: ProcessSet = global_process_set) -> Handle:
    """Broadcast from `root_rank` (a worker's rank in the job, as in Horovod,
    also with a process set) to the members of `ps`."""
    members = ps._members()
    if root_rank not in members:
        raise ValueError(f"root_rank {root_rank} is out of range for {_api.size()} workers" if ps._is_global() else
                         f"root_rank {root_rank} is not in {ps!r}")
    n, me = len(members), ps.rank()
    token = _agree.claim(name)
    src = tensor.detach()
    if src.dtype in _NATIVE:
        buf = src.contiguous().clone()
        exact_bytes = False
    else:
        buf = _bytes_as_f32(src)
        exact_bytes = True
    if _api.rank() != root_rank:
        buf.zero_()
    # Every member's root (plus one: a worker in join() adds zeros), to tell
    # a disagreement (the data would be a sum), and its shape and dtype, which
    # Horovod checks too (the core compares sizes only).
    roots = torch.zeros((n, 2), dtype=torch.int64)
    roots[me, 0] = root_rank + 1
    roots[me, 1] = zlib.crc32(f"{tuple(src.shape)} {src.dtype}".encode())
    try:
        roots_h = start_sum(roots, _derive(name, ".root"), ps)
        # Only the root's bytes travel: the others push zeros, header only.
        h = start_sum(buf, name, ps, live=None if _api.rank() == root_rank else (0, 0))
    except BaseException:
        _agree.release(name, token)
        raise
    _agree.release_when_done(name, token, [roots_h, h])

    def finish():
        roots_h.wait()
        _agree.release(name, token)
        _agree.check_none_joined(roots[:, 0] != 0, "broadcast", name, members)
        if bool((roots[:, 0] != root_rank + 1).any()):
            raise GradhubMismatchError(f"broadcast '{name}': workers disagree on the root rank: "
                                       + ", ".join(f"worker {members[q]} says {int(x) - 1}"
                                                   for q, x in enumerate(roots[:, 0].tolist())))
        if bool((roots[:, 1] != roots[me, 1]).any()):
            raise GradhubMismatchError(f"broadcast '{name}': workers broadcast different shapes or dtypes (worker "
                                       f"{_api.rank()}: {tuple(src.shape)} {src.dtype}); as in Horovod, every worker "
                                       "must give the same")
        if exact_bytes:
            out = buf.to(torch.uint8).view(src.dtype).reshape(src.shape)
        else:
            out = buf.view_as(src)
        if target is not None:
            target.copy_(out)
            return target
        return out.to(tensor.device)

    return Handle(h, finish, name)


class _BroadcastFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, ps):
        ctx.root_rank, ctx.name, ctx.ps = root_rank, name, ps
        return _broadcast_async(tensor, root_rank, name, None, ps).wait()

    @staticmethod
    def backward(ctx, grad):
        # As Horovod: every worker's gradient, averaged, flows to the root's input only.
        g = _reduce_async(grad.contiguous(), _derive(ctx.name, ".grad"), Average, 0, Compression.none, None, 1.0, 1.0,
                          ctx.ps).wait()
        if _api.rank() != ctx.root_rank:
            g = torch.zeros_like(g)
        return g, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=None):
    """Return root_rank's value of `tensor` on every worker (out of place).
    Differentiable: the root's input gets the workers' averaged gradient, the others zero."""
    ps = _resolve(process_set)
    name = ps._name(name, "broadcast")
    if tensor.requires_grad and torch.is_grad_enabled():
        return _BroadcastFn.apply(tensor, root_rank, name, ps)
    return _broadcast_async(tensor, root_rank, name, None, ps).wait()


def broadcast_async_(tensor, root_rank, name=None, process_set=None) -> Handle:
    ps = _resolve(process_set)
    _check_inplace(tensor, "broadcast_")
    return _track(_broadcast_async(tensor, root_rank, ps._name(name, "broadcast"), tensor, ps))


def broadcast_(tensor, root_rank, name=None, process_set=None):
    """Overwrite `tensor` with root_rank's value, in place."""
    return broadcast_async_(tensor, root_rank, name, process_set).wait()


# ---------------------------------------------------------------- allgather


def _allgather_impl(tensor: torch.Tensor, name: str, ps: ProcessSet = global_process_set,
                    priority: int = 0) -> tuple[torch.Tensor, list[int]]:
    """Every member's `tensor` concatenated in rank order (of the set), and
    each member's first dimension."""
    n, r = ps.size(), ps.rank()
    t = tensor.detach().contiguous()
    if t.dim() == 0:
        raise ValueError("allgather needs a tensor with at least one dimension")
    row = int(np.prod(t.shape[1:], dtype=np.int64))
    # Every worker's first dimension, and what must agree: the rest of the
    # shape and the dtype (a row count, and a checksum of both).
    meta = torch.zeros((n, 3), dtype=torch.int64)
    meta[r] = torch.tensor([t.shape[0], row, zlib.crc32(f"{tuple(t.shape[1:])} {t.dtype}".encode()) + 1])
    start_sum(meta, _derive(name, ".counts"), ps, priority=priority).wait()
    # A worker in join() adds a row of zeros (the checksum, plus one, is
    # never 0): as in Horovod, the others raise.
    _agree.check_none_joined(meta.ne(0).any(1), "allgather", name, ps._members())
    if not bool((meta[:, 1:] == meta[r, 1:]).all()):
        qi = int((meta[:, 1:] != meta[r, 1:]).any(1).nonzero()[0])
        q = ps._members()[qi]
        what = (f"rows of {int(meta[qi, 1])} elements, worker {r} of {row} ({tuple(t.shape[1:])})"
                if int(meta[qi, 1]) != row else f"the same row size, but worker {r}'s {tuple(t.shape[1:])} {t.dtype} "
                                                "differs in shape or dtype")
        raise GradhubMismatchError(f"allgather '{name}': workers disagree on everything but the first "
                                   f"dimension: worker {q} gives {what}")
    counts_l = [int(x) for x in meta[:, 0].tolist()]
    total = sum(counts_l)
    start = sum(counts_l[:r])
    native = t.dtype in _NATIVE
    if native:
        buf = torch.zeros(total * row, dtype=t.dtype)
        buf[start * row:(start + t.shape[0]) * row] = t.reshape(-1)  # copies from any device
    else:
        width = t.element_size()
        buf = torch.zeros(total * row * width, dtype=torch.float32)
        buf[start * row * width:(start + t.shape[0]) * row * width] = _bytes_as_f32(t)
    # The size may differ from the last call's: then the name is a new tensor.
    # Only this worker's rows travel from it: the chunks of the others' go as zeros, header only.
    width = 1 if native else t.element_size()
    live = (start * row * width, (start + t.shape[0]) * row * width)
    start_sum(buf, _derive(name, ".data"), ps, priority=priority, live=live).wait()
    if native:
        out = buf.reshape(total, *t.shape[1:])
    else:
        out = buf.to(torch.uint8).view(t.dtype).reshape(total, *t.shape[1:])
    return out.to(tensor.device), counts_l


class _AllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, ps):
        out, counts = _allgather_impl(tensor, name, ps)
        ctx.counts, ctx.name, ctx.ps = counts, name, ps
        return out

    @staticmethod
    def backward(ctx, grad):
        # As Horovod: the workers' gradients of the whole output, averaged; each takes its rows.
        r = ctx.ps.rank()
        g = _reduce_async(grad.contiguous(), _derive(ctx.name, ".grad"), Average, 0, Compression.none, None, 1.0, 1.0,
                          ctx.ps).wait()
        start = sum(ctx.counts[:r])
        return g[start:start + ctx.counts[r]], None, None


def allgather(tensor, name=None, process_set=None):
    """Concatenate every worker's `tensor` along dim 0 (first dims may differ)."""
    ps = _resolve(process_set)
    name = ps._name(name, "allgather")
    if tensor.requires_grad and torch.is_grad_enabled():
        return _held(name, lambda: _AllgatherFn.apply(tensor, name, ps))
    return _held(name, lambda: _allgather_impl(tensor, name, ps)[0])


# ---------------------------------------------------------------- objects and models


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None, process_set=None):
    """Pickle `obj` on root_rank and return it on every worker."""
    ps = _resolve(process_set)
    name = ps._name(name, "broadcast_object")
    # The pickle travels as int64 words (summed exactly with the others'
    # zeros), 8 bytes a word.
    if _api.rank() == root_rank:
        raw = pickle.dumps(obj)
        size = torch.tensor([len(raw)], dtype=torch.int64)  # exact: a float32 rounds above 2^24
        payload = torch.frombuffer(bytearray(raw + bytes(-len(raw) % 8)), dtype=torch.int64)
    else:
        payload = None
        size = torch.zeros(1, dtype=torch.int64)
    size = _broadcast_async(size, root_rank, _derive(name, ".size"), None, ps).wait()
    n = int(size.item())
    if payload is None:
        payload = torch.zeros((n + 7) // 8, dtype=torch.int64)
    data = _broadcast_async(payload, root_rank, _derive(name, ".data"), None, ps).wait()
    return pickle.loads(data.numpy().tobytes()[:n])


def allgather_object(obj: Any, name: str | None = None, process_set=None) -> list:
    """Every worker's `obj` (pickled), as a list by rank (in the set)."""
    ps = _resolve(process_set)
    name = ps._name(name, "allgather_object")
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = _allgather_impl(torch.tensor([payload.numel()], dtype=torch.int64), _derive(name, ".sizes"), ps)[0].tolist()
    data = _allgather_impl(payload, _derive(name, ".data"), ps)[0].numpy().tobytes()
    out, at = [], 0
    for s in sizes:
        out.append(pickle.loads(data[at:at + s]))
        at += s
    return out


def broadcast_parameters(params, root_rank: int = 0, process_set=None):
    """Overwrite parameters/buffers with root_rank's: a state_dict, a module's
    named_parameters(), or a list of (name, tensor)."""
    ps = _resolve(process_set)
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, (list, tuple)) or hasattr(params, "__iter__"):
        items = list(params)
        if items and not isinstance(items[0], tuple):
            raise ValueError("broadcast_parameters takes a state_dict or (name, tensor) pairs")
    else:
        raise ValueError(f"invalid params of type {type(params).__name__}")
    handles = []
    for pname, p in items:
        if p is None:
            continue
        t = p.data if isinstance(p, torch.nn.Parameter) else p
        handles.append(_broadcast_async(t, root_rank, ps._name(f"broadcast.param.{pname}", ""), t, ps))
    for h in handles:
        h.wait()


def _make_state(optimizer: torch.optim.Optimizer) -> None:
    """As Horovod: an optimizer that has not stepped yet gets its state
    (momentum buffers, Adam's moments and step count, ...) from one step with
    zero gradients, so every worker holds the same state afterwards. With
    weight decay that step moves the parameters, as in Horovod (identically
    on every worker). The gradients are put back; a parameter that had none
    keeps its zeros, as in Horovod (sparse ones for SparseAdam)."""
    if optimizer.state_dict()["state"] or getattr(optimizer, "_gh_server", False):
        return  # stepped already, or the state lives on the servers
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("broadcast_optimizer_state does not support torch.optim.LBFGS (as in Horovod)")
    saved = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                if p.grad is not None:
                    saved.append((p, p.grad))
                p.grad = torch.zeros_like(p)
                if isinstance(optimizer, torch.optim.SparseAdam):
                    p.grad = p.grad.to_sparse()
    # The wrapped optimizer's own step: a DistributedOptimizer's would reduce.
    getattr(optimizer, "_gh_base_cls", type(optimizer)).step(optimizer)
    for p, g in saved:
        p.grad = g


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0, process_set=None):
    """Make every worker's optimizer state (hyperparameters, momentum, ...)
    root_rank's; an optimizer that has not stepped yet gets its state first,
    as in Horovod."""
    _resolve(process_set)
    _make_state(optimizer)
    state = broadcast_object(optimizer.state_dict(), root_rank, name="broadcast.optimizer_state",
                             process_set=process_set)
    optimizer.load_state_dict(state)
