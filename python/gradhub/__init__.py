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

from ._core import PROTOCOL_VERSION, GradhubError, GradhubTimeoutError  # noqa: F401
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



def _version() -> str:
    """The installed package's version (pyproject.toml's, through its
    metadata); without metadata (the source tree on PYTHONPATH), the
    source tree's pyproject.toml; else "0+unknown"."""
    from importlib import metadata

    try:
        return metadata.version("gradhub")
    except metadata.PackageNotFoundError:
        pass
    try:
        import tomllib
        from pathlib import Path

        with open(Path(__file__).resolve().parents[2] / "pyproject.toml", "rb") as f:
            project = tomllib.load(f)["project"]
        if project.get("name") == "gradhub":
            return str(project["version"])
    except (OSError, ValueError, KeyError):
        pass
    return "0+unknown"


__version__ = _version()
__all__ = [
    "PROTOCOL_VERSION",
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
