"""DistributedOptimizer in the asynchronous mode (BytePS's, `GRADHUB_ASYNC=1`):
one optimizer class for the mode, as Horovod keeps one per mode.

Each worker runs the wrapped optimizer on its own gradients, then pushes the
change of every parameter (`async.<name>`, float32); the servers add each
change to the parameters they hold as soon as it has arrived and answer that
worker alone with the parameters as they are then, which replace the
worker's. No worker waits for another, unless `GRADHUB_STALENESS=s` bounds
how far the fastest may run ahead of the slowest (the servers hold its
answer). The servers' parameters start as worker 0's: each worker's first
push of a parameter (at construction) carries its values, and the servers
keep worker 0's and answer every worker with them.

Each change is pushed divided by the number of workers, so that one step of
every worker moves the parameters as one synchronous step with the same
learning rate would (exactly so for SGD when the workers keep in step); the
optimizer's own state (momentum, Adam's moments) stays on each worker, built
from its own gradients. `synchronize()` has nothing to wait for (step() returns with the
parameters in place); `broadcast_parameters` still works (the construction
already started every worker from worker 0's values).
"""

from __future__ import annotations

import torch

from .. import api as _api


class _AsynchronousOptimizer:
    """Put in front of the wrapped optimizer's class (see the module's doc)."""

    def __init__(self, params, named_parameters=None, *, base_cls: type):
        super().__init__(params)
        self._gh_base_cls = base_cls
        all_params = [p for g in self.param_groups for p in g["params"]]
        bad = [p.dtype for p in all_params if p.dtype != torch.float32]
        if bad:
            raise ValueError(f"the asynchronous mode needs float32 parameters (the servers add float32 changes); "
                             f"found {bad[0]}")
        if named_parameters is not None:
            names = {id(p): n for n, p in named_parameters}
            if len(set(names.values())) != len(names):
                raise ValueError("parameter names in named_parameters must be unique")
            missing = [p for p in all_params if id(p) not in names]
            if missing:
                raise ValueError(f"named_parameters does not cover {len(missing)} of the optimizer's parameters")
        else:
            names = {id(p): f"param.{i}" for i, p in enumerate(all_params)}
        self._parameter_names = {p: names[id(p)] for p in all_params}
        self._gh_params = all_params
        self._gh_push_names = {id(p): f"async.{names[id(p)]}" for p in all_params}
        # Collective: every worker builds its optimizer; sizes are checked.
        _api.declare([(self._gh_push_names[id(p)], (p.numel(), "float32")) for p in all_params])
        self._gh_exchange(init=True)

    def _gh_exchange(self, init: bool, before: list | None = None) -> None:
        """Push every parameter's change since `before` (init: its values)
        and put the servers' answers in place."""
        pending = []
        scale = 1.0 / _api.size()
        with torch.no_grad():
            for i, p in enumerate(self._gh_params):
                buf = p.detach().contiguous().clone() if init else (p.detach() - before[i]).mul_(scale)
                h = _api.push_pull_async(buf, name=self._gh_push_names[id(p)], priority=-i, init=init,
                                         asynchronous=True)
                pending.append((p, h, buf))
            for p, h, buf in pending:
                h.wait()
                p.copy_(buf.view_as(p))

    def step(self, closure=None):
        """The wrapped optimizer's step on this worker's gradients, then the
        change pushed and the servers' parameters put in place."""
        before = [p.detach().clone() for p in self._gh_params]
        loss = super().step(closure)
        self._gh_exchange(init=False, before=before)
        return loss

    def synchronize(self) -> None:
        """Nothing to wait for: step() returns with the parameters in place."""

    def skip_synchronize(self):
        import contextlib

        return contextlib.nullcontext()


def asynchronous_optimizer(optimizer: torch.optim.Optimizer, named_parameters) -> torch.optim.Optimizer:
    """The asynchronous DistributedOptimizer around `optimizer` (a subclass
    of its class, so isinstance holds, with the same groups and state)."""
    base = optimizer.__class__
    cls = type(base.__name__, (_AsynchronousOptimizer, base), {})
    opt = cls.__new__(cls)
    opt.defaults = optimizer.defaults
    cls.__init__(opt, optimizer.param_groups, named_parameters, base_cls=base)
    opt.defaults = optimizer.defaults
    if optimizer.state:
        opt.load_state_dict(optimizer.state_dict())
    return opt
