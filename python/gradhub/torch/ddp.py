"""A DistributedDataParallel communication hook: DDP keeps bucketing and
overlap, gradhub moves the bytes.

    ddp_model.register_comm_hook(None, gradhub.torch.ddp_comm_hook)

Each bucket's future is completed by the core's completion callback when its
push_pull finishes (no Python thread waits on handles in turn).
"""

from dataclasses import dataclass

import torch

from .compression import Compression
from .sums import start_reduction


@dataclass
class HookState:
    """Optional state for ddp_comm_hook: compression and priority."""

    compression: type = Compression.none
    priority: int = 0


def ddp_comm_hook(state, bucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket's gradients across workers through gradhub."""
    st = state if isinstance(state, HookState) else HookState()
    buf = bucket.buffer()
    # DDP may rebuild buckets after the first iteration: the size is part of the name.
    name = f"ddp.bucket.{bucket.index()}.{buf.numel()}"
    fut = torch.futures.Future()

    def done(handle):
        try:
            fut.set_result(handle.wait())  # returns at once: the op is complete
        except Exception as e:  # delivered to DDP, which raises it in backward
            fut.set_exception(e)

    start_reduction(buf, name, average=True, priority=st.priority, compression=st.compression,
                    target=buf).add_done_callback(done)
    return fut
