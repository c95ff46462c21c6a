"""`gradhub.torch.elastic`: Horovod's elastic API (`hvd.elastic.run`,
`TorchState`, `ObjectState`, `ElasticSampler`, `HostsUpdatedInterrupt`),
with Horovod's documented semantics.

- The state objects: `commit()` saves and checks for added workers,
  `restore()` rolls back to the last commit, `sync()` gives every worker
  rank 0's state, reset callbacks run after each reset.
- The sampler: each worker its share of what the epoch has not processed
  yet, the processed indices merged across workers at `sync()`.
- `run`: syncs the state and runs the training function; on a lost worker
  every survivor rolls back to the last commit, leaves the ended
  generation and joins the next (`_reset`), with new dense ranks
  (survivors first, in their old order, so rank 0 holds the committed
  state) and the new size, and runs the function again.

The job must be elastic: on a shared service (`GRADHUB_JOB`) with
`GRADHUB_MIN_WORKERS`; the service forms each generation
(`scheduler::elastic`). A job of fixed size rolls back and raises
`ElasticResetError`. A worker that registers while a
generation runs waits; the service tells the running workers, and at
their next `commit()`/`check_host_updates()` every one of them raises
`HostsUpdatedInterrupt` (rank 0's view decides, so all at the same
commit), leaves without a rollback, and the next generation forms with
the newcomer (ranked after the survivors; `sync()` gives it the state).
"""

from __future__ import annotations

import copy
import functools
import math
import random
from typing import Any, Callable

import torch

from .. import _env
from .. import api as _api
from .. import GradhubError, GradhubTimeoutError
from ..api import GradhubMismatchError, NotInitializedError
from . import ops as _ops


class HostsUpdatedInterrupt(RuntimeError):
    """Workers were added or removed: the job re-forms at this commit, with
    no rollback (`skip_sync`: the state needs no sync, no worker is new)."""

    def __init__(self, skip_sync: bool = False):
        super().__init__("the job's workers changed")
        self.skip_sync = skip_sync


class ElasticResetError(GradhubError):
    """The job's membership changed but it cannot re-form (see the module's
    docstring); the state was rolled back to its last commit first."""


def _membership_changed() -> bool:
    """Whether workers wait to join this elastic job (the service told this
    worker; a job of fixed size never changes)."""
    return _api.hosts_updated()


class State:
    """What `run` saves, restores and syncs. Subclasses give `save`,
    `restore` and `sync`."""

    def __init__(self):
        self._reset_callbacks: list[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Call these after every reset (new ranks and size), e.g. to scale
        the learning rate by the new `size()`."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for cb in self._reset_callbacks:
            cb()

    def commit(self) -> None:
        """Save the state (the point a lost worker rolls back to), then check
        for added workers (which interrupts the training function)."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise `HostsUpdatedInterrupt` on every worker if workers were
        added: rank 0's view decides, so all raise at the same commit."""
        if _ops.broadcast_object(_membership_changed(), root_rank=0, name="gradhub.elastic.hosts"):
            raise HostsUpdatedInterrupt(skip_sync=False)

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError


class _Handler:
    """Saves, restores and syncs one value of a state."""

    def __init__(self, value):
        self.value = value
        self.saved = None
        self.save()

    def save(self) -> None:
        self.saved = copy.deepcopy(self.value)

    def restore(self) -> None:
        self.value = copy.deepcopy(self.saved)

    def sync(self) -> None:
        """Rank 0's value (plain values: synced together by `ObjectState.sync`)."""
        raise NotImplementedError


class _StateDictHandler(_Handler):
    """A value with `state_dict()`/`load_state_dict()` (a model, an optimizer,
    a sampler): saved as a copy of its state dict, restored by loading it,
    synced its own way (`_sync_value`) and saved again."""

    def save(self) -> None:
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self.saved)

    def sync(self) -> None:
        self._sync_value()
        self.save()

    def _sync_value(self) -> None:
        raise NotImplementedError


class _ModelHandler(_StateDictHandler):
    def _sync_value(self) -> None:
        _ops.broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_StateDictHandler):
    def restore(self) -> None:
        abandon = getattr(self.value, "_gh_abandon", None)
        if abandon is not None:
            abandon()  # a DistributedOptimizer: the failed step's reductions are gone
        super().restore()

    def _sync_value(self) -> None:
        _ops.broadcast_optimizer_state(self.value, root_rank=0)


class _SamplerHandler(_StateDictHandler):
    def _sync_value(self) -> None:
        self.value.sync()


def _handler(value) -> _Handler:
    if isinstance(value, torch.nn.Module):
        return _ModelHandler(value)
    if isinstance(value, torch.optim.Optimizer):
        return _OptimizerHandler(value)
    if isinstance(value, ElasticSampler):
        return _SamplerHandler(value)
    return _Handler(value)


class ObjectState(State):
    """Picklable values as attributes (`state.epoch`), synced from rank 0 as
    one object. Horovod's signature: `ObjectState(bcast_object, get_rank, **kwargs)`;
    gradhub's broadcast is used when `bcast_object` is None."""

    def __init__(self, bcast_object=None, get_rank=None, **kwargs):
        super().__init__()
        object.__setattr__(self, "_bcast", bcast_object)
        object.__setattr__(self, "_handlers", {k: _handler(v) for k, v in kwargs.items()})

    def __getattr__(self, name: str):
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            return handlers[name].value
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __setattr__(self, name: str, value) -> None:
        handlers = self.__dict__.get("_handlers")
        if handlers is not None and name in handlers:
            handlers[name].value = value
        else:
            object.__setattr__(self, name, value)

    def save(self) -> None:
        for h in self._handlers.values():
            h.save()

    def restore(self) -> None:
        for h in self._handlers.values():
            h.restore()

    def sync(self) -> None:
        """Rank 0's values: the plain ones in one broadcast, then each model,
        optimizer and sampler its own way (in the same order everywhere)."""
        plain = {k: h for k, h in self._handlers.items() if type(h) is _Handler}
        if plain:
            mine = {k: h.value for k, h in plain.items()}
            values = (self._bcast(mine, 0) if self._bcast is not None
                      else _ops.broadcast_object(mine, root_rank=0, name="gradhub.elastic.state"))
            for k, h in plain.items():
                h.value = values[k]
                h.save()
        for k, h in self._handlers.items():
            if k not in plain:
                h.sync()


class TorchState(ObjectState):
    """Horovod's `TorchState(model=, optimizer=, **kwargs)`: the model's and
    optimizer's state dicts, `ElasticSampler`s and any other picklable
    values (`state.epoch`), saved at `commit()`, restored after a lost
    worker, synced from rank 0 after every reset."""

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 **kwargs):
        values = {k: v for k, v in (("model", model), ("optimizer", optimizer)) if v is not None}
        super().__init__(None, None, **values, **kwargs)


class ElasticSampler(torch.utils.data.Sampler):
    """Each worker its share of the epoch's indices not processed yet (by
    any worker, `record_batch`/`record_indices`), so after a reset with a
    new size no sample of the epoch is seen twice or skipped. Shuffled with
    `seed + epoch`, the same on every worker; `set_epoch` starts an epoch."""

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0):
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Batch `batch_idx` (of `batch_size`) of this worker's share was processed."""
        self.record_indices(self.get_indices(batch_idx, batch_size))

    def record_indices(self, indices) -> None:
        self.processed_indices.update(int(i) for i in indices)

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        start = batch_idx * batch_size
        return self.indices[start:min(start + batch_size, len(self.indices))]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_indices": sorted(self.processed_indices)}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = state["epoch"]
        self.processed_indices = set(state["processed_indices"])
        self.reset()

    def sync(self) -> None:
        """Every worker's processed indices, merged; then this worker's new share."""
        mine = (self.epoch, sorted(self.processed_indices))
        everyone = _ops.allgather_object(mine, name="gradhub.elastic.sampler")
        self.epoch = max(e for e, _ in everyone)
        self.processed_indices = {i for e, done in everyone if e == self.epoch for i in done}
        self.reset()

    def reset(self) -> None:
        """This worker's share under the job's current size and rank."""
        self.num_replicas = _api.size() if _api.is_initialized() else 1
        self.rank = _api.rank() if _api.is_initialized() else 0
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        remaining = [i for i in order if i not in self.processed_indices]
        self.num_samples = math.ceil(len(remaining) / self.num_replicas) if remaining else 0
        total = self.num_samples * self.num_replicas
        # Padded by repeating from the start, so every worker gets as many (as torch's DistributedSampler).
        padded = (remaining * math.ceil(total / len(remaining)))[:total] if remaining else []
        self.indices = padded[self.rank:total:self.num_replicas]

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples


# A lost peer fails the collective: Horovod's HorovodInternalError. Not the
# user's errors (workers disagreeing, gradhub not initialized) nor a timeout
# the caller asked for.
_NOT_A_RESET = (GradhubMismatchError, GradhubTimeoutError, NotInitializedError, ElasticResetError)


def _reset(cause: BaseException) -> None:
    """Leave the ended generation and join the next, with the workers that
    remain: new ranks (survivors first, in their old order), new size."""
    if _env.get("GRADHUB_MIN_WORKERS") is None:
        raise ElasticResetError(
            "the job's workers changed, and a job of fixed size cannot re-form (the state was rolled back to its "
            "last commit): run it as an elastic job, on a shared service with GRADHUB_MIN_WORKERS (`gradhub launch "
            f"--min-workers`); the cause: {cause}") from cause
    prev = _api.rank()
    _api.shutdown()
    _api.new_generation()
    from . import agreement, local_stage
    from .startup import init

    local_stage.forget()
    agreement.forget_all()

    from .optimizer import redeclare_all

    try:
        init(_prev_rank=prev)
        # What a newcomer does next, building its optimizer: declare.
        redeclare_all()
    except GradhubError as e:
        raise ElasticResetError(f"the job could not re-form after: {cause}; {e}") from e


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Horovod's `@hvd.elastic.run`: `func(state, ...)` runs after `state.sync()`;
    on a lost peer (`HorovodInternalError`) the state rolls back to its last
    commit, the job re-forms and `func` runs again; on `HostsUpdatedInterrupt`
    the job re-forms without a rollback. Reset callbacks run after each reset."""

    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs):
        skip_sync = False
        while True:
            if not skip_sync:
                state.sync()
            try:
                return func(state, *args, **kwargs)
            except _NOT_A_RESET:
                raise
            except GradhubError as e:
                state.restore()
                skip_sync, cause = False, e
            except HostsUpdatedInterrupt as e:
                skip_sync, cause = e.skip_sync, e
            _reset(cause)
            state.on_reset()

    return wrapper
