"""A DistributedDataParallel communication hook: DDP keeps bucketing and
overlap, gradhub moves the bytes.

    ddp_model.register_comm_hook(None, gradhub.torch.ddp_comm_hook)
"""

import queue
import threading
from dataclasses import dataclass

import torch

from .compression import Compression
from .ops import _push_pull_async


@dataclass
class HookState:
    """Optional state for ddp_comm_hook: compression and priority."""

    compression: type = Compression.none
    priority: int = 0


class _Completer:
    """One thread that waits for push_pulls in order and completes their futures."""

    def __init__(self):
        self.q = queue.Queue(maxsize=4096)
        self.t = threading.Thread(target=self._run, name="gradhub-ddp-completer", daemon=True)
        self.t.start()

    def _run(self):
        while True:
            handle, fut, out = self.q.get()
            try:
                handle.wait()
                fut.set_result(out)
            except Exception as e:  # delivered to DDP, which raises it in backward
                fut.set_exception(e)


_completer = None
_lock = threading.Lock()


def ddp_comm_hook(state, bucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket's gradients across workers through gradhub."""
    global _completer
    with _lock:
        if _completer is None:
            _completer = _Completer()
    st = state if isinstance(state, HookState) else HookState()
    buf = bucket.buffer()
    # DDP may rebuild buckets after the first iteration: the size is part of the name.
    name = f"ddp.bucket.{bucket.index()}.{buf.numel()}"
    h = _push_pull_async(buf, name, True, st.priority, st.compression, buf)
    fut = torch.futures.Future()
    _completer.q.put((h, fut, buf))
    return fut
