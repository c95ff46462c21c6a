"""gradhub for PyTorch, with Horovod's API: change `import horovod.torch as hvd`
to `import gradhub.torch as hvd`.

Ways to use it:
- the torch.distributed backend: `dist.init_process_group("gradhub")` (dist/),
  with DDP's exchange overlapping the next forward pass if asked:
  `gradhub.torch.ddp_forward_overlap(ddp_model, optimizer)` (ddp_overlap.py)
- Horovod style: `opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())`
- DDP over another backend: `ddp_model.register_comm_hook(None, gradhub.torch.ddp_comm_hook)`
- low level: `hvd.allreduce(t)`, `hvd.push_pull(t)`, `hvd.broadcast(t, 0)`, ...
"""

from __future__ import annotations

import torch

from .. import GradhubError, GradhubTimeoutError
from ..api import GradhubMismatchError, NotInitializedError
from ..api import barrier as _barrier
from ..api import cross_rank, cross_size, is_homogeneous, is_initialized, local_rank, local_size, rank, shutdown, size
from ..api import join as _join
from ..api import start_timeline, stop_timeline
from .compression import Compression, Compressor
from .ddp import HookState, ddp_comm_hook
from .ddp_overlap import DDPForwardOverlap, ddp_forward_overlap
from .ops import _settle_started
from .ops import (
    Adasum,
    Average,
    Handle,
    Max,
    Min,
    Product,
    Sum,
    allgather,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    poll,
    push_pull,
    push_pull_async,
    synchronize,
)
from .exchange import (
    allgather_async,
    alltoall,
    alltoall_async,
    grouped_allgather,
    grouped_allgather_async,
    grouped_reducescatter,
    grouped_reducescatter_async,
    reducescatter,
    reducescatter_async,
    sparse_allreduce_async,
)
from .optimizer import DistributedOptimizer
from .process_sets import ProcessSet, _resolve, add_process_set, global_process_set, remove_process_set
from .startup import init
from .sums import start_sum as _start_sum
from .sync_batch_norm import SyncBatchNorm


def join(device: int = -1) -> int:
    """Horovod's join: this worker has no more data; until every worker has
    joined it takes part in the others' operations with zeros. Returns the
    rank that joined last. (`device` is accepted for Horovod's signature.)"""
    return _join()


def barrier(process_set=None):
    """Block until every worker (of `process_set`) has entered the barrier,
    and the operations this worker started before it (async ones) have
    completed: the barrier returns after them, as Horovod's. They are waited
    for after the barrier, not before it, so one that another worker starts
    only after the barrier does not hang it."""
    ps = _resolve(process_set)
    if ps._is_global():
        _barrier()
    else:
        # A set's barrier: a sum of one element over its members.
        _start_sum(torch.zeros(1), ps._name(None, "barrier"), ps).wait()
    _settle_started()


# Horovod raises HorovodInternalError (a RuntimeError) when a collective
# fails: a peer was lost (gradhub: GradhubError, naming it and why), or the
# workers disagree on it (GradhubMismatchError, a GradhubError and a
# ValueError, gradhub's type for it before).
HorovodInternalError = GradhubError


# What this build has, as Horovod's queries: no MPI, Gloo, NCCL, DDL, oneCCL
# or GPU kernels (CUDA tensors are staged through host memory by PyTorch).
def _absent(name: str):
    def query() -> bool:
        return False

    query.__name__ = query.__qualname__ = name
    query.__doc__ = f"Horovod's {name}(): False, gradhub has none of it."
    return query


mpi_built, mpi_enabled, mpi_threads_supported = _absent("mpi_built"), _absent("mpi_enabled"), \
    _absent("mpi_threads_supported")
gloo_built, gloo_enabled, nccl_built = _absent("gloo_built"), _absent("gloo_enabled"), _absent("nccl_built")
ddl_built, ccl_built = _absent("ddl_built"), _absent("ccl_built")
cuda_built, rocm_built = _absent("cuda_built"), _absent("rocm_built")


from . import elastic  # noqa: E402 - Horovod's elastic API (membership changes not yet: see its docstring)


def _register_backend() -> None:
    """`dist.init_process_group("gradhub")`: the torch.distributed backend
    (torch/dist/). Importing gradhub.torch never fails for it: a torch
    without run-time backends only warns."""
    try:
        from .dist import register

        register()
    except Exception as e:  # noqa: BLE001
        import warnings

        warnings.warn(f"gradhub: the torch.distributed backend 'gradhub' is not available: {e}", stacklevel=2)


_register_backend()


__all__ = [
    "Adasum", "Average", "Compression", "Compressor", "DistributedOptimizer", "GradhubError", "GradhubTimeoutError",
    "GradhubMismatchError", "Handle", "HookState", "HorovodInternalError", "NotInitializedError", "Max", "Min",
    "Product", "Sum", "SyncBatchNorm", "allgather",
    "ProcessSet", "add_process_set", "global_process_set", "remove_process_set", "alltoall", "alltoall_async",
    "grouped_allgather", "grouped_allgather_async", "grouped_reducescatter", "grouped_reducescatter_async",
    "reducescatter", "reducescatter_async", "sparse_allreduce_async", "start_timeline", "stop_timeline", "join",
    "allgather_async", "allgather_object", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "barrier", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object",
    "broadcast_optimizer_state", "broadcast_parameters", "ccl_built", "cross_rank", "cross_size", "cuda_built",
    "DDPForwardOverlap", "ddl_built", "ddp_comm_hook", "ddp_forward_overlap", "elastic", "gloo_built", "gloo_enabled", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "init", "is_homogeneous", "is_initialized", "local_rank",
    "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "poll", "push_pull",
    "push_pull_async", "rank", "rocm_built", "shutdown", "size", "synchronize",
]
