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

Wait-free: with an elementwise optimizer (SGD, Adam, AdamW) each parameter is
updated, and its change pushed, as soon as autograd has accumulated its
gradient (the last of `backward_passes_per_step` backward passes), so the
exchange overlaps the rest of backward, as the synchronous mode's does;
step() pushes a zero change for a parameter that got no gradient (its count
must advance, or a staleness bound would wait for it), waits for the
answers and puts them in place. Other optimizers update in step(), then push.

Each change is pushed divided by the number of workers, so that one step of
every worker moves the parameters as one synchronous step with the same
learning rate would (exactly so for SGD when the workers keep in step); the
optimizer's own state (momentum, Adam's moments) stays on each worker, built
from its own gradients. `synchronize()` has nothing to wait for (step()
returns with the parameters in place); `broadcast_parameters` still works
(the construction already started every worker from worker 0's values).
"""

from __future__ import annotations

import contextlib

import torch

from .. import api as _api
from .ops import parameter_names
from .modes import ELEMENTWISE


class _AsynchronousOptimizer:
    """Put in front of the wrapped optimizer's class (see the module's doc)."""

    def __init__(self, params, named_parameters=None, *, base_cls: type, backward_passes_per_step: int = 1):
        super().__init__(params)
        self._gh_base_cls = base_cls
        all_params = [p for g in self.param_groups for p in g["params"]]
        bad = [p.dtype for p in all_params if p.dtype != torch.float32]
        if bad:
            raise ValueError(f"the asynchronous mode needs float32 parameters (the servers add float32 changes); "
                             f"found {bad[0]}")
        if backward_passes_per_step < 1:
            raise ValueError("backward_passes_per_step must be >= 1")
        names = parameter_names(all_params, named_parameters)
        self._parameter_names = {p: names[id(p)] for p in all_params}
        self._gh_params = all_params
        self._gh_index = {id(p): i for i, p in enumerate(all_params)}
        # Group index, not the dict: load_state_dict() replaces the group dicts.
        self._gh_group_idx = {id(p): i for i, g in enumerate(self.param_groups) for p in g["params"]}
        self._gh_push_names = {id(p): f"async.{names[id(p)]}" for p in all_params}
        self._gh_scale = 1.0 / _api.size()
        self._gh_passes = backward_passes_per_step
        self._gh_counts = {id(p): 0 for p in all_params}
        self._gh_pending: dict[int, tuple] = {}  # param id -> (handle, buffer): pushed, not yet answered
        # Collective: every worker builds its optimizer; sizes are checked.
        _api.declare([(self._gh_push_names[id(p)], (p.numel(), "float32")) for p in all_params])
        for p in all_params:
            self._gh_push(p, p.detach().contiguous().clone(), init=True)
        self._gh_wait()
        self._gh_subs: dict[int, torch.optim.Optimizer] = {}
        self._gh_hooks = []
        if issubclass(base_cls, ELEMENTWISE):
            self._gh_hooks = [p.register_post_accumulate_grad_hook(self._gh_on_gradient)
                              for p in all_params if p.requires_grad]

    # -------------------------------------------------------------- pushes

    def _gh_push(self, p, buf, init: bool = False) -> None:
        h = _api.push_pull_async(buf, name=self._gh_push_names[id(p)], priority=-self._gh_index[id(p)],
                                 init=init, asynchronous=True)
        self._gh_pending[id(p)] = (h, buf)

    def _gh_wait(self) -> None:
        """Every answer in place."""
        pending, self._gh_pending = self._gh_pending, {}
        by_id = {id(p): p for p in self._gh_params}
        with torch.no_grad():
            for pid, (h, buf) in pending.items():
                h.wait()
                by_id[pid].copy_(buf.view_as(by_id[pid]))

    def _gh_change(self, p, before) -> torch.Tensor:
        return (p.detach() - before).mul_(self._gh_scale)

    # -------------------------------------------------------------- wait-free updates

    def _gh_on_gradient(self, p) -> None:
        """p's gradient is complete: update p alone and push its change."""
        self._gh_counts[id(p)] += 1
        if self._gh_counts[id(p)] < self._gh_passes or id(p) in self._gh_pending:
            return
        before = p.detach().clone()
        hyper = {k: v for k, v in self.param_groups[self._gh_group_idx[id(p)]].items() if k != "params"}
        sub = self._gh_subs.get(id(p))
        if sub is None:
            base = self._gh_base_cls
            sub = base([p], **{k: v for k, v in hyper.items() if k in base.__init__.__code__.co_varnames})
            sub.state = self.state  # shared: keyed by parameter
            self._gh_subs[id(p)] = sub
        sub.param_groups[0].update(hyper)
        with torch.no_grad():
            sub.step()
        self._gh_push(p, self._gh_change(p, before))

    def step(self, closure=None):
        """Update (what the gradient hooks have not), push the changes, and
        put the servers' parameters in place."""
        loss = None
        if self._gh_hooks:
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            # A parameter that got no gradient this step still pushes (zeros).
            for p in self._gh_params:
                if id(p) not in self._gh_pending:
                    self._gh_push(p, torch.zeros(p.numel(), dtype=torch.float32))
        else:
            before = [p.detach().clone() for p in self._gh_params]
            loss = super().step(closure)
            for p, b in zip(self._gh_params, before):
                self._gh_push(p, self._gh_change(p, b))
        self._gh_wait()
        for k in self._gh_counts:
            self._gh_counts[k] = 0
        return loss

    def synchronize(self) -> None:
        """Nothing to wait for: step() returns with the parameters in place."""

    def skip_synchronize(self):
        return contextlib.nullcontext()


def asynchronous_optimizer(optimizer: torch.optim.Optimizer, named_parameters,
                           backward_passes_per_step: int = 1) -> torch.optim.Optimizer:
    """The asynchronous DistributedOptimizer around `optimizer` (a subclass
    of its class, so isinstance holds, with the same groups and state)."""
    base = optimizer.__class__
    cls = type(base.__name__, (_AsynchronousOptimizer, base), {})
    opt = cls.__new__(cls)
    opt.defaults = optimizer.defaults
    cls.__init__(opt, optimizer.param_groups, named_parameters, base_cls=base,
                 backward_passes_per_step=backward_passes_per_step)
    opt.defaults = optimizer.defaults
    if optimizer.state:
        opt.load_state_dict(optimizer.state_dict())
    return opt
