"""gradhub for PyTorch, with Horovod's API: change `import horovod.torch as hvd`
to `import gradhub.torch as hvd`.

Three ways to use it:
- Horovod style: `opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())`
- DDP: `ddp_model.register_comm_hook(None, gradhub.torch.ddp_comm_hook)`
- low level: `hvd.allreduce(t)`, `hvd.push_pull(t)`, `hvd.broadcast(t, 0)`, ...
"""

from __future__ import annotations

from .. import GradhubError, GradhubTimeoutError
from ..api import init as _init
from ..api import is_initialized, local_rank, local_size, rank, shutdown, size
from .compression import Compression, Compressor
from .ddp import HookState, ddp_comm_hook
from .ops import (
    Average,
    Handle,
    Sum,
    allgather,
    allgather_async,
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
    poll,
    push_pull,
    push_pull_async,
    synchronize,
)
from .optimizer import DistributedOptimizer
from .sync_batch_norm import SyncBatchNorm


def init(*args, **kwargs):
    """Join the job (see gradhub.init)."""
    _init(*args, **kwargs)


__all__ = [
    "Average", "Compression", "Compressor", "DistributedOptimizer", "GradhubError", "GradhubTimeoutError", "Handle",
    "HookState", "Sum", "SyncBatchNorm", "allgather", "allgather_async", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object",
    "broadcast_optimizer_state", "broadcast_parameters", "ddp_comm_hook", "init", "is_initialized", "local_rank",
    "local_size", "poll", "push_pull", "push_pull_async", "rank", "shutdown", "size", "synchronize",
]
