"""What Horovod checks before a collective's result is given: on this
worker, that a name is not reused while an operation under it is in flight;
across the workers, that they reduce the same shapes and dtypes under a name
(the core compares element counts and dtypes only) and that none of them is
in join() for an operation join does not take part in. (gradhub.torch's
internals: ops.py and exchange.py call these.)"""

from __future__ import annotations

import threading
import zlib

import torch

from .. import _env
from .. import api as _api
from ..api import GradhubError, GradhubMismatchError
from .process_sets import ProcessSet
from .sums import finish_with, start_sum

# ---------------------------------------------------------------- names in flight

# Explicit names of the public operations now running on this worker, each
# with the token of the operation that holds it. Claimed before any round
# starts, so a second operation under a name in flight raises before it
# sends anything (had it started one of its rounds, e.g. a shape check,
# that round would wait forever for the other workers, who never start it).
_in_flight: dict[str, object] = {}
_in_flight_lock = threading.Lock()


def claim(name: str) -> object | None:
    """Hold `name` for an operation about to start; a token for `release`.
    As in Horovod, a name in flight here is a ValueError. Generated names
    never collide: not held (None)."""
    if isinstance(name, _api.AutoName):
        return None
    with _in_flight_lock:
        if name in _in_flight:
            raise ValueError(f"'{name}' is already in flight on this worker: as in Horovod, an operation's name "
                             "must not be reused before the previous one completed")
        token = _in_flight[name] = object()
    return token


def release(name: str, token: object | None) -> None:
    """Free `name` if the operation of `token` still holds it (idempotent)."""
    if token is None:
        return
    with _in_flight_lock:
        if _in_flight.get(name) is token:
            del _in_flight[name]


def forget_all() -> None:
    """A new job (an elastic job's next generation): nothing is in flight
    in it, whatever the failed generation left held."""
    with _in_flight_lock:
        _in_flight.clear()


def release_when_done(name: str, token: object | None, handles: list) -> None:
    """Free `name` once every round in `handles` (objects with
    `add_done_callback`) has finished, also when nobody waits for them.
    Whoever waits should `release` too: the callbacks may run after the
    waiter has its result and starts the next operation under the name."""
    if token is None:
        return
    left = [len(handles)]
    lock = threading.Lock()

    def one(_h) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            release(name, token)

    for h in handles:
        h.add_done_callback(one)


# ---------------------------------------------------------------- shapes and dtypes

# GRADHUB_SHAPE_CHECK=0 (the same on every worker) drops the check below,
# for scripts of many small allreduces that need the latency (docs/torch.md);
# read at each call, as every setting is once the job has started.


def start_shape_check(tensors, name: str, ps: ProcessSet):
    """Horovod's check that every worker reduces the same shapes and dtypes
    under a name: the core compares element counts only. One more round of
    `size` int64s (each worker's signature in its slot), started beside the
    data; returns (what to call once the data is in, which raises on every
    worker alike; the round's handle), or None without a check. Public
    collectives only: DistributedOptimizer's gradients were declared, sizes
    and dtypes, at its construction."""
    n, r = ps.size(), ps.rank()
    if n == 1 or not _env.get("GRADHUB_SHAPE_CHECK"):
        return None
    mine = repr([(tuple(t.shape), str(t.dtype)) for t in tensors])
    sig = torch.zeros(n, dtype=torch.int64)
    sig[r] = zlib.crc32(mine.encode()) + 1  # never 0: a worker in join() adds zeros
    # Named as its operation's part: freed after its round if the name was
    # generated, held like the data tensor (until released) if not.
    h = start_sum(sig, _api.derive_name(name, ".shape"), ps)

    def check():
        h.wait()
        odd = ((sig != sig[r]) & (sig != 0)).nonzero().flatten().tolist()
        if odd:
            raise GradhubMismatchError(
                f"'{name}': workers reduce different shapes or dtypes under one name: worker {_api.rank()} has "
                f"{mine[1:-1]}, worker{'s' if len(odd) > 1 else ''} {', '.join(str(ps._members()[q]) for q in odd)} "
                "another (as in Horovod, every worker must give the same shape and dtype)")

    return check, h


def after(h, check):
    """`h` (a gradhub.torch Handle), whose result is given only once
    `check()` passed."""
    if check is not None:

        def checked(finish):
            check()
            return finish()

        finish_with(h, checked)
    return h


# ---------------------------------------------------------------- join


def check_none_joined(present: torch.Tensor, what: str, name: str, members: list[int]) -> None:
    """As Horovod: a broadcast or allgather while a worker is in join() is an
    error on the others (a worker in join() pushed zeros: not `present`)."""
    if not bool(present.all()):
        gone = [members[q] for q in (~present).nonzero().flatten().tolist()]
        raise GradhubError(f"{what} '{name}': worker{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} "
                           "joined (join()): as in Horovod, only allreduce (and the optimizer's gradients) take part "
                           "in join; call join() on this worker too")
