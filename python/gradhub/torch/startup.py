"""`gradhub.torch.init`: join the job (gradhub.init), then register the
process sets and set up the torch local stage. A module of its own so the
torch layer's modules that join again (elastic.py, dist/job.py) import it
without importing the package that re-exports them."""

from __future__ import annotations

from ..api import init as _init
from ..api import is_initialized
from .local_stage import setup as _local_stage_setup
from .process_sets import _setup, reset


def init(*args, process_sets=None, **kwargs):
    """Join the job (see gradhub.init). `process_sets`: as in Horovod, a list
    of ProcessSets (or rank lists) to register at once, on every worker, or
    "dynamic" (accepted; add_process_set always works).

    As Horovod's, a second init() in a running job changes nothing (scripts
    and wrappers such as Lightning call it more than once): the process sets
    registered stay, and of `process_sets` only those not registered yet
    are added."""
    if is_initialized():
        _setup(process_sets, only_new=True)
        return
    _init(*args, **kwargs)
    reset()
    _setup(process_sets)
    _local_stage_setup()
