"""Horovod's process sets: collectives over a subset of the workers.

A set's tensors are its members' alone (`gradhub.api.push_pull_async`'s
`members`): the scheduler places one once every member declared it, the
servers sum the members' pushes, and no worker outside the set takes part
or moves a byte for it. Each member pushes for itself (the host stage, which
sums a whole host's workers first, is for tensors of every worker). The
members get the set's sum; averages divide by the set's size.

As in Horovod, every worker registers the same sets in the same order
(`init(process_sets=[...])` or `add_process_set`), and only members call a
set's collectives. A set's operation names get the prefix `ps<id>.`, and its
unnamed operations are numbered per set, so the global call order is the
same on every worker whatever sets it is in.
"""

from __future__ import annotations

import itertools
import threading
import zlib

from .. import api as _api


class ProcessSet:
    """A subset of the workers (Horovod's `hvd.ProcessSet(ranks)`). Usable
    once registered (`add_process_set`, or `init(process_sets=...)`)."""

    def __init__(self, ranks=None):
        self.ranks = None if ranks is None else sorted(int(r) for r in ranks)
        if self.ranks is not None and len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"process set {ranks} lists a rank twice")
        self.process_set_id: int | None = None
        self._names = itertools.count()
        self._lock = threading.Lock()

    def _members(self) -> list[int]:
        return list(range(_api.size())) if self.ranks is None else self.ranks

    def size(self) -> int | None:
        """The number of workers in the set (None if not registered)."""
        return None if self.process_set_id is None else len(self._members())

    def rank(self) -> int | None:
        """This worker's rank in the set: -1 outside it, None if not registered."""
        if self.process_set_id is None:
            return None
        m = self._members()
        return m.index(_api.rank()) if _api.rank() in m else -1

    def included(self) -> bool | None:
        """Whether this worker is in the set (None if not registered)."""
        return None if self.process_set_id is None else _api.rank() in self._members()

    def __repr__(self) -> str:
        if self is global_process_set:
            return "ProcessSet(global)"
        return f"ProcessSet(id={self.process_set_id}, ranks={self.ranks})"

    # The collectives' view of the set (gradhub.torch's internals; its sums
    # start in `sums.start_sum`).

    def _is_global(self) -> bool:
        return self.process_set_id == 0 or self.ranks is None

    def _name(self, name: str | None, kind: str) -> str:
        """The wire name of an operation: the user's, or the next unnamed one
        (numbered per set), prefixed with the set for a set's operation."""
        if self._is_global():
            return name or _api.auto_name(kind)
        if name is None:
            with self._lock:
                name = _api.AutoName(f"{kind}{_api.AUTO_MARK}{next(self._names)}")
        prefixed = f"ps{self.process_set_id}.{name}"
        # Generated (freed after its round) if the name was.
        return _api.AutoName(prefixed) if isinstance(name, _api.AutoName) else prefixed


global_process_set = ProcessSet()
global_process_set.process_set_id = 0

# Registered sets by id (0: the global set); ids are given in registration order.
_sets: dict[int, ProcessSet] = {0: global_process_set}
_next_id = itertools.count(1)
_registry_lock = threading.Lock()


def _resolve(process_set, members_only: bool = True) -> ProcessSet:
    """The set a collective runs over (None: the global set); this worker
    must be in it (unless not `members_only`)."""
    if process_set is None or process_set is global_process_set:
        return global_process_set
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a gradhub.torch.ProcessSet, not {type(process_set).__name__}")
    if _sets.get(process_set.process_set_id) is not process_set:
        raise ValueError(f"{process_set!r} is not registered: call add_process_set() on every worker first")
    if members_only and not process_set.included():
        raise ValueError(f"worker {_api.rank()} is not in {process_set!r}: only its members call its collectives")
    return process_set


def add_process_set(process_set) -> ProcessSet:
    """Register a process set (a ProcessSet or a list of ranks). As in
    Horovod, every worker registers the same sets in the same order; a set
    whose ranks differ between workers is an error on every worker."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.ranks is None or ps is global_process_set:
        raise ValueError("the global process set is always registered")
    if ps.process_set_id is not None:
        raise ValueError(f"{ps!r} is already registered")
    n = _api.size()
    if not ps.ranks or ps.ranks[0] < 0 or ps.ranks[-1] >= n:
        raise ValueError(f"process set ranks {ps.ranks} must be non-empty and within 0..{n - 1}")
    for other in _sets.values():
        if other.ranks == ps.ranks:
            raise ValueError(f"a process set with ranks {ps.ranks} is already registered ({other!r})")
    with _registry_lock:
        set_id = next(_next_id)
    # Every worker must register the same set under this id: compare.
    import torch

    mine = zlib.crc32(repr((set_id, ps.ranks)).encode())
    seen = torch.zeros(n, dtype=torch.int64)
    seen[_api.rank()] = mine
    _api.push_pull(seen, name=f"process_set.add.{set_id}")
    _api.release(f"process_set.add.{set_id}")
    if bool((seen != mine).any()):
        raise ValueError(f"add_process_set: workers registered different sets as set {set_id} "
                         f"(this worker: ranks {ps.ranks}); every worker must add the same sets in the same order")
    ps.process_set_id = set_id
    _sets[set_id] = ps
    return ps


def remove_process_set(process_set) -> bool:
    """Unregister a set (every worker, as in Horovod); False if it was not registered."""
    if process_set is global_process_set:
        return False
    if not isinstance(process_set, ProcessSet) or _sets.get(process_set.process_set_id) is not process_set:
        return False
    del _sets[process_set.process_set_id]
    process_set.process_set_id = None
    return True


def _setup(process_sets, only_new: bool = False) -> None:
    """`init(process_sets=...)`: a list of sets (or rank lists) to register
    now, or "dynamic" (Horovod's switch for add_process_set; always on here).
    `only_new` (a second init()): skip the sets registered already."""
    if process_sets is None or process_sets == "dynamic":
        return
    for ps in process_sets:
        if only_new and _registered(ps):
            continue
        add_process_set(ps)


def _registered(process_set) -> bool:
    """Whether `process_set` (a ProcessSet or a rank list) is registered."""
    if isinstance(process_set, ProcessSet):
        return _sets.get(process_set.process_set_id) is process_set
    ranks = sorted(int(r) for r in process_set)
    return any(ps.ranks == ranks for ps in _sets.values())


def reset() -> None:
    """After shutdown: a new job starts with the global set only (`init`,
    and the torch.distributed backend's `end_job`)."""
    global _next_id
    for set_id, ps in list(_sets.items()):
        if set_id != 0:
            ps.process_set_id = None
            del _sets[set_id]
    _next_id = itertools.count(1)


