"""The torch class the backend extends: a `Backend` (c10d's per-device
layer) where this torch lets Python construct one (2.14 on), else a whole
`ProcessGroup` (`backend_class` picks; the collectives are `Collectives`,
the same for both)."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _C10dBackend

from ..process_sets import ProcessSet
from .collectives import Collectives


class GradhubBackend(Collectives, _C10dBackend):
    """The backend as torch ≥ 2.14 takes it: a `Backend` (c10d's per-device
    layer), registered under its process group by torch."""


class GradhubProcessGroup(Collectives, dist.ProcessGroup):
    """The backend where torch's `Backend` has no constructor Python can
    call (2.13 and before: "No constructor defined!"): a whole
    `ProcessGroup`, which torch installs as the group itself. torch keeps a
    group's name on its per-device backends, so a group without one has no
    name (DeviceMesh, FSDP2 and DTensor read it): a gloo backend is
    registered for the CPU (and CUDA) to hold it. torch's Python calls and DDP's
    reducer reach this class's collectives; the C++ paths that dispatch
    per device (functional collectives) reach gloo: slower there, never
    wrong."""

    def __init__(self, rank: int, size: int, ps: ProcessSet, prefix: str, timeout: float, owns_job: bool,
                 store=None):
        super().__init__(rank, size, ps, prefix, timeout, owns_job, store)
        if self._keys is not None:
            # Under this creation's prefix: a member must not read a previous gloo's addresses.
            gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo", self._keys), rank, size,
                                         datetime.timedelta(seconds=timeout))
            for dev in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
                self._register_backend(torch.device(dev), dist.ProcessGroup.BackendType.GLOO, gloo)
            # (torch sets the default backend type on the group it made, which this one replaces)
            self._set_default_backend(dist.ProcessGroup.BackendType.GLOO)


_chosen: type | None = None


def backend_class() -> type:
    """The class this torch can construct from Python: the `Backend`
    subclass where it can be made, else the `ProcessGroup` one. Also the
    `ProcessGroup` one under TORCH_DISTRIBUTED_DEBUG=DETAIL: torch then
    wraps a plug-in `Backend` in a checker that asks its C++ side for the
    backend's name, which a Python backend cannot answer ("getBackendName
    is not implemented"); a `ProcessGroup` is not wrapped."""
    global _chosen
    if _chosen is None:
        class _Probe(_C10dBackend):
            pass

        try:
            _Probe(0, 1)
            _chosen = GradhubBackend
        except TypeError:
            _chosen = GradhubProcessGroup
    if _chosen is GradhubBackend and dist.get_debug_level() == dist.DebugLevel.DETAIL:
        return GradhubProcessGroup
    return _chosen
