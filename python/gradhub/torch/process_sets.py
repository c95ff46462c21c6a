"""Horovod's process sets. gradhub runs every collective over all workers,
so only the global set exists; the names are here so that scripts passing
`process_set=hvd.global_process_set` run, and anything else fails clearly."""

from __future__ import annotations

from .. import api as _api


class ProcessSet:
    """Horovod's process set. gradhub runs every collective over all workers:
    only the global set exists."""

    def __init__(self, ranks: list[int] | None = None):
        self.ranks = ranks
        self.process_set_id = 0

    def size(self) -> int:
        return _api.size()

    def rank(self) -> int:
        return _api.rank()

    def included(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "ProcessSet(global)"


global_process_set = ProcessSet()


def _check_set(process_set) -> None:
    if process_set is not None and process_set is not global_process_set:
        raise NotImplementedError("process sets are not supported: every gradhub collective runs over all workers "
                                  "(pass global_process_set or nothing)")


def add_process_set(process_set) -> ProcessSet:
    raise NotImplementedError("process sets are not supported: every gradhub collective runs over all workers")


def remove_process_set(process_set) -> bool:
    raise NotImplementedError("process sets are not supported: every gradhub collective runs over all workers")
