"""A `torch.distributed` backend named "gradhub": `dist.init_process_group("gradhub")`
(or a device map such as `"cpu:gloo,cuda:gradhub"`) runs the collectives of
DDP, FSDP, DeviceMesh and the frameworks built on them through gradhub's
servers. Registered when `gradhub.torch` is imported.

Modules: `job.py` (the gradhub job: joined or formed from torch's store),
`collectives.py` (`Collectives`: the collectives), `p2p.py` (send and
recv), `classes.py` (the torch class they extend: `GradhubBackend` or
`GradhubProcessGroup`), `work.py` (Work, futures, the watchdog); here:
registration.

Each collective is one or two push_pulls (a sum across workers):

- all_reduce SUM/AVG/PREMUL_SUM: a push_pull (AVG divided by the servers);
  MIN, MAX, PRODUCT and the bitwise ops: every member's tensor gathered,
  then reduced here (the servers only sum);
- all_gather / gather: every member writes its bytes into its own slot of a
  zeroed buffer and pushes only that slot (`live`: the rest goes as
  headers); the sum is everyone's bytes, bit-exact for every dtype (buffers
  travel as int32 words, x + 0 = x);
- broadcast / scatter: the root's push, the others push headers only;
- reduce_scatter: a push_pull of the whole input that pulls only the
  caller's shard (the servers answer the rest with headers), each shard's
  chunks on a server on its member's host (a sharded tensor);
- all_to_all: a gather of every member's input (after a gather of the
  split sizes, unless even), each keeping what was sent to it;
- barrier: a push_pull of one element;
- sparse all_reduce: every member's indices and values gathered, summed here;
- monitored_barrier: through torch's store, rank 0 naming who did not come;
- send / recv / recv from any source (and so batch_isend_irecv and the
  pipeline schedules): straight from worker to worker over the group's
  point-to-point links (the core's `peer`), not through the servers.

The class: a `Backend` subclass where torch lets Python construct one
(2.14 on), else a `ProcessGroup` subclass (`classes.backend_class`).

The job: an existing one if `gradhub.init()` ran (its rank and size must
be torch's); one named by GRADHUB_SCHEDULER (`gradhub launch`, a separate
scheduler, a shared service with GRADHUB_JOB); else the group forms its
own from what torch hands the backend: rank 0 hosts the scheduler on a
free port and publishes its address and a job token made up for the job
in torch's store, the first rank on each host a colocated server (hosts
told apart as the core does: GRADHUB_HOST_ID, else host name and network
namespace), as `gradhub.init()` does under torchrun. Such a job ends with
the default group (`destroy_process_group()`); a new `init_process_group`
forms a new one.

Sub-groups (`new_group`, DeviceMesh dimensions) are process sets (see
`process_sets.py`) whose tensors are their members' alone: only members
declare, push and pull them, and no byte of theirs reaches a host without
a member (torch calls the backend on members only).

Names: operations are named by group, kind, dtype and size (DDP's buckets
under `ddp_forward_overlap`: by bucket), and numbered per such key (every member calls a group's collectives in the same order,
so the numbers agree), and a name is used again once its previous round is
in: DDP's buckets, FSDP's per-layer gathers keep their names, declared
once, from step to step. A group keeps at most `_MAX_NAMES` such names;
operations of further keys are named once and freed after their round.

Work: `wait()` (raises `DistBackendError` naming the lost peer when the job
fails, or the group's timeout), `is_completed()`, `get_future()` (failed
futures raise in DDP's reducer), `async_op=True`.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

from ... import api as _api
from ..process_sets import ProcessSet, global_process_set
from . import job as _job
from .classes import GradhubBackend, GradhubProcessGroup, backend_class
from .collectives import NAME, _GroupSet
from .work import GradhubBackendError, Work

__all__ = ["NAME", "GradhubBackend", "GradhubBackendError", "GradhubProcessGroup", "Work", "backend_class", "register"]


def _create(opts, backend_options=None):
    """torch's constructor call (extended API): one group's backend."""
    timeout = opts.timeout.total_seconds() if isinstance(opts.timeout, datetime.timedelta) else float(opts.timeout)
    ranks = list(opts.global_ranks_in_group)
    rank, size = opts.group_rank, opts.group_size
    default = not ranks or (ranks == list(range(size)) and not dist.is_initialized())
    if default:
        formed = _job.join(opts.store, rank, size, timeout)
        return backend_class()(rank, size, global_process_set, "", timeout, formed, store=opts.store)
    if not _api.is_initialized():
        raise RuntimeError("new_group(backend='gradhub'): the default group is not a gradhub one; create it with "
                           "init_process_group('gradhub') (or a device map naming gradhub), or call gradhub.init() "
                           "first")
    if ranks == list(range(_api.size())):
        ps: ProcessSet = global_process_set
    else:
        ps = _GroupSet(ranks, str(opts.group_id))
    prefix = f"g{opts.group_id}." if ps is not global_process_set else f"g{opts.group_id}."
    return backend_class()(rank, size, ps, prefix, timeout, False, store=opts.store)


def _patch_is_completed() -> None:
    """torch hands a Python backend's Work to the caller inside a holder that
    forwards `wait()` and `get_future()` only, so the holder's
    `is_completed()` stays False. Ask the future when the Work itself says
    no (any backend's: a completed future is a completed Work)."""
    from torch._C._distributed_c10d import Work as _CWork

    orig = _CWork.is_completed
    if getattr(orig, "_gradhub", False):
        return

    def is_completed(self) -> bool:
        if orig(self):
            return True
        try:
            return self.get_future().done()
        except Exception:  # noqa: BLE001 - a Work without a future
            return False

    is_completed._gradhub = True
    is_completed.__doc__ = orig.__doc__
    _CWork.is_completed = is_completed


def register() -> bool:
    """Register the backend with torch (once). False if this torch cannot."""
    if not dist.is_available():
        return False
    if NAME.upper() in getattr(dist.Backend, "_plugins", {}):
        return True
    dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu", "cuda"])
    _patch_is_completed()
    return True
