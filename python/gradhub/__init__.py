"""gradhub: gradient synchronization for data-parallel training.

Low-level API (the PyTorch integration builds on it)::

    import gradhub
    gradhub.init()                       # reads GRADHUB_* or torchrun's variables
    gradhub.push_pull(grad, name="w1", average=True)   # in place, blocking
    h = gradhub.push_pull_async(grad, name="w2", priority=5)
    h.wait()
    gradhub.shutdown()
"""

from __future__ import annotations

from ._core import GradhubError, GradhubTimeoutError  # noqa: F401
from .api import (  # noqa: F401
    Handle,
    barrier,
    broadcast,
    declare,
    init,
    is_initialized,
    join,
    local_rank,
    local_size,
    push_pull,
    push_pull_async,
    rank,
    release,
    start_timeline,
    stop_timeline,
    shutdown,
    size,
)

__version__ = "0.1.0"
__all__ = [
    "GradhubError",
    "GradhubTimeoutError",
    "Handle",
    "barrier",
    "broadcast",
    "declare",
    "init",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "push_pull",
    "push_pull_async",
    "rank",
    "release",
    "start_timeline",
    "stop_timeline",
    "shutdown",
    "size",
]
