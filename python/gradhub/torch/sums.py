"""Named sums on process sets: the one path from each of gradhub.torch's
doors to the core. The Horovod-style API (`ops.py`, `exchange.py`,
`optimizer.py`, ...), the DDP comm hook (`ddp.py`) and the torch.distributed
backend (`dist/`) start their reductions here, none through another's
private functions:

- `start_sum(buf, name, ps)`: sum a buffer in place over a process set's
  members (every worker, or a set: its first member tells the workers
  outside it to push zeros); `live` marks the part this worker fills, the
  rest is zeros and travels as a header only. Returns the core's handle
  (`gradhub.api.Handle`). CPU or CUDA buffers (CUDA staged through pinned
  host memory by `gradhub.api.push_pull_async`).
- `start_reduction(tensor, name, ps, average=...)`: a tensor's sum or
  average in any dtype (the wire dtype below, compression, integer averages
  scaled here, a set's average divided here, the torch local stage for the
  global set's CUDA tensors), into `target` or a new tensor. Returns a
  `Handle`.
- `Handle`: an operation in flight (`gradhub.torch.Handle`); `finish_with`
  adds to what its `wait()` does.
- `wire_dtype`, `wire_spec`: what a reduction of a dtype sends; `scaled`:
  Horovod's pre/postscale.

Dtypes: float32/float16/bfloat16, float64, int32 and int64 are summed as
they are (exactly, for float64 and the integers); int8, int16, uint8 and
bool as int64; other floating types as float32.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

from .. import api as _api
from . import local_stage as _local_stage
from .compression import Compression
from .process_sets import ProcessSet, global_process_set

__all__ = ["Handle", "finish_with", "scaled", "start_reduction", "start_sum", "wire_dtype", "wire_spec"]


class Handle:
    """An operation in flight. `synchronize(handle)` (or `handle.wait()`)
    returns its output tensor; `poll(handle)` tells whether it is done."""

    def __init__(self, handle, finish, name: str):
        self._h = handle  # a gradhub.api.Handle, or None if the result is ready
        self._finish = finish
        self._result = None
        self._done = False
        self._lock = threading.Lock()  # finish() runs once, also with a done callback racing wait()
        self.name = name

    def done(self) -> bool:
        return self._done or self._h is None or self._h.done()

    def wait(self, timeout: float | None = None):
        if not self._done:
            if self._h is not None:
                self._h.wait(timeout)
            with self._lock:
                if not self._done:
                    self._result = self._finish()
                    self._done = True
        return self._result

    def _settle(self) -> None:
        """Wait until the operation has finished, without taking its result
        or failure (for `barrier()`; `wait()` still gives them)."""
        if self._h is not None:
            try:
                self._h.wait()
            except Exception:  # noqa: BLE001 - the caller's wait() raises it
                pass

    def add_done_callback(self, fn: Callable[["Handle"], None]) -> None:
        """Call `fn(handle)` once the operation has finished: from a core
        thread, or at once if it is already done. Inside `fn`,
        `handle.wait()` returns the output at once or raises the failure.
        `fn` should be quick and must not raise."""
        if self._h is None:
            fn(self)
        else:
            self._h.add_done_callback(lambda _h: fn(self))


def finish_with(h: Handle, wrap: Callable[[Callable[[], object]], object]) -> Handle:
    """`h`, whose `wait()` now gives `wrap(finish)`: `finish()` gives what it
    gave before (its result, or its failure raised), so `wrap` can check
    first, reshape after, or release a name either way. Before any `wait()`."""
    finish = h._finish
    h._finish = lambda: wrap(finish)
    return h


# ---------------------------------------------------------------- dtypes on the wire

_WIRE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
               torch.float64: "float64", torch.int32: "int32", torch.int64: "int64"}
# Summed exactly as int64, then cast back (wrapping as torch's sums do; a
# bool comes back True where any worker's was).
_VIA_INT64 = (torch.int8, torch.int16, torch.uint8, torch.bool)


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a reduction of `dtype` travels in: itself if the servers sum
    it (exactly, for float64 and the integers), int64 for the small
    integers and bool, else float32 (other floating types)."""
    if dtype in _WIRE_NAMES:
        return dtype
    if dtype in _VIA_INT64:
        return torch.int64
    if dtype.is_floating_point:
        return torch.float32
    raise TypeError(f"cannot reduce tensors of dtype {dtype}")


def wire_spec(tensor: torch.Tensor, compression=Compression.none) -> tuple[int, str] | None:
    """(numel, dtype name) that `start_reduction(tensor, ..., compression=...)`
    sends, for declaring it ahead of its first reduction; None when only
    running the compressor would tell (a user-defined one: it is not called
    here, so it sees exactly the tensors it compresses)."""
    from .compression import NoneCompressor, _CastCompressor

    if isinstance(compression, type) and issubclass(compression, NoneCompressor):
        dtype = tensor.dtype
    elif isinstance(compression, type) and issubclass(compression, _CastCompressor):
        dtype = compression.wire_dtype if tensor.dtype.is_floating_point else tensor.dtype
    else:
        return None
    return tensor.numel(), _WIRE_NAMES[wire_dtype(dtype)]


def scaled(t: torch.Tensor, factor: float) -> torch.Tensor:
    """`t` times `factor` (Horovod's pre/postscale): in its own dtype for
    floating types; integers in float64, truncated toward zero, as Horovod."""
    if factor == 1.0:
        return t
    return (t.double() * factor).to(t.dtype) if not t.dtype.is_floating_point else t * factor


# ---------------------------------------------------------------- sums


def start_sum(buf: torch.Tensor, name: str, ps: ProcessSet = global_process_set, *, average: bool = False,
              priority: int = 0, live=None, want=None, sharded: bool = False, live_is_own: bool = False):
    """Start summing `buf` in place over the members of `ps` under `name`:
    the core's handle. `average`: the global set only (the servers divide;
    a set's average is divided by its caller). A set's tensor is its
    members' alone: nobody outside the set takes part. `live`: see
    `gradhub.api.push_pull_async` (buf is zeros outside it); `want`: the
    elements whose sum is needed (the rest keep what was pushed);
    `sharded`: `buf` is one equal shard per member, the q-th member's
    placed on its host; `live_is_own`: no other member's bytes fall in
    `live` (see `gradhub.api.push_pull_async`)."""
    if ps._is_global():
        return _api.push_pull_async(buf, name=name, average=average, priority=priority, live=live, want=want,
                                    sharded=sharded, live_is_own=live_is_own)
    if average:
        raise AssertionError("a process set's average is divided by the caller")
    return _api.push_pull_async(buf, name=name, average=False, priority=priority, live=live, want=want,
                                members=ps.ranks, sharded=sharded, live_is_own=live_is_own)


def start_reduction(tensor: torch.Tensor, name: str, ps: ProcessSet = global_process_set, *, average: bool,
                    priority: int = 0, compression=Compression.none, target: torch.Tensor | None = None,
                    want: tuple[int, int] | None = None, sharded: bool = False) -> Handle:
    """Start reducing (summing; `average`: averaging) `tensor` over the
    members of `ps` under `name`; the result is written into `target` if
    given, else returned as a new tensor on the tensor's device. `want`:
    the elements (start, stop) of the flattened result the caller reads;
    outside them the result is undefined (a reduce-scatter's other shards);
    `sharded`: as `start_sum`'s."""
    src = tensor.detach()
    comp, ctx = compression.compress(src)
    wire_cast = None
    wire = wire_dtype(comp.dtype)
    if wire is not comp.dtype:
        wire_cast = comp.dtype
        comp = comp.to(wire)
    buf = comp
    # The buffer is summed in place: never the caller's own memory unless asked.
    if buf.data_ptr() == src.data_ptr() or not buf.is_contiguous():
        buf = buf.contiguous().clone() if target is None else buf.contiguous()
    # Integers are summed exactly; their average is scaled here, as Horovod
    # does (times 1/n in float64, truncated toward zero). The
    # servers average over every worker: a process set's is divided here.
    int_average = average and not wire.is_floating_point
    server_average = average and wire.is_floating_point and ps._is_global()
    local_average = average and wire.is_floating_point and not server_average
    # The torch local stage (GRADHUB_LOCAL_STAGE) takes the global set's reductions it applies to.
    if ps._is_global() and _local_stage.uses(buf):
        h = _local_stage.push_pull_async(buf, name, server_average, priority)
    else:
        h = start_sum(buf, name, ps, average=server_average, priority=priority, want=want, sharded=sharded)
    n = ps.size()

    def finish():
        out = buf
        if int_average:
            out = scaled(out, 1.0 / n)
        elif local_average:
            out.div_(n)
        if wire_cast is not None:
            out = out.round().to(wire_cast) if out.is_floating_point() and not wire_cast.is_floating_point \
                else out.to(wire_cast)
        out = compression.decompress(out, ctx)
        if target is not None:
            if out.data_ptr() != target.data_ptr():
                target.copy_(out.view_as(target))
            return target
        return out.to(tensor.device).view_as(tensor) if out.device != tensor.device else out.view_as(tensor)

    return Handle(h, finish, name)
