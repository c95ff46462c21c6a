"""The strategy a `DistributedOptimizer` delegates its mode to, chosen once
at construction (optimizer.py): a schedule, which says when the update of
each parameter runs, holding the place where it runs.

- Schedules: `Synchronous` here (plain wait-free backprop: step() waits for
  every reduced gradient, then updates) and `ForwardOverlap` (overlap.py:
  each update deferred to just before its module's next forward).
- Places: `OnWorkers` here (the wrapped optimizer updates the parameters
  from their averaged gradients) and `OnServers` (server_optimizer.py: the
  servers run the update; a round returns the new parameters).

The optimizer keeps what every mode shares (gradient hooks, priorities,
fusion, synchronize(), the Horovod API) and calls the strategy at the
points where the modes differ; a strategy reads the optimizer's `_gh_*`
state, as fusion.py and sufficient_factors.py do.
"""

from __future__ import annotations

import warnings

import torch

from .sums import wire_spec

# Optimizers whose update of a parameter depends only on that parameter's
# gradient and state, so parameters can be updated one at a time.
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


class OnWorkers:
    """Updates run on the workers: gradients are reduced under
    `allreduce.<name>`, and the wrapped optimizer applies them."""

    on_server = False

    def __init__(self, opt):
        self.opt = opt
        # ForwardOverlap's and the eager updates of some parameters.
        self.partial = PartialSteps(opt._gh_base_cls)

    def push_name(self, p, tagged: bool = True) -> str:
        """The name p's gradient is pushed under; with a chunk size of its
        own, tagged with it (`tagged=False`: the base, for derived names)."""
        opt = self.opt
        return opt._gh_ps._name(f"allreduce.{opt._gh_names[id(p)]}{opt._gh_tag() if tagged else ''}", "")

    def declarations(self) -> list:
        """[(name, (numel, dtype, partition)), ...] of every tensor pushed,
        declared in one exchange at construction. Reverse registration order
        approximates the order gradients become ready, which is the order the
        tensors used to be declared in on first use (it sets their keys, the
        tie-break between equal priorities)."""
        opt = self.opt
        fused = opt._gh_fusion.of if opt._gh_fusion is not None else {}
        specs = [(self.push_name(p), wire_spec(p, opt._gh_compression))
                 for p in reversed(opt._gh_params) if p.requires_grad and id(p) not in fused]
        buckets = opt._gh_fusion.declarations() if opt._gh_fusion is not None else []
        return [(name, (*spec, opt._gh_partition)) for name, spec in specs + buckets if spec is not None]

    def push(self, p, grad):
        """Start reducing p's gradient; returns a sums.Handle."""
        opt = self.opt
        return opt._gh_reduce(grad, self.push_name(p), opt._gh_priority(p))

    def before_forward(self, own: list) -> None:
        """A module using parameters `own` is about to run forward."""

    def before_step(self) -> None:
        """step() was called."""

    def eager(self, closure):
        """The synchronous schedule's eager update, or None: a function
        that updates the parameters given (ids) as soon as their reduced
        gradients are in, while the others are still in flight, when the
        wrapped optimizer updates each parameter from its own gradient and
        state alone (one of the `ELEMENTWISE` classes itself: a subclass
        may override step(); no closure). The same arithmetic as one step
        over all of them (the update restricted to some parameters is
        `update_some`), finished before step() returns, as Horovod's."""
        opt = self.opt
        if closure is not None or not opt._gh_eager or opt._gh_base_cls not in ELEMENTWISE:
            return None
        return self._update_ids

    def _update_ids(self, pids: list) -> None:
        opt = self.opt
        by_group: dict[int, list] = {}
        for pid in sorted(pids, key=opt._gh_rank_of.__getitem__):  # a stable key for update_some's cache
            by_group.setdefault(opt._gh_group_idx[pid], []).append(opt._gh_by_id[pid])
        for ps in by_group.values():
            self.update_some(ps, None)

    def update(self, closure):
        """The update after synchronize(): the wrapped optimizer's step."""
        opt = self.opt
        return opt._gh_base_cls.step(opt, closure)

    def update_some(self, params: list, hyper: dict | None) -> None:
        """Update `params` (of one group) with their reduced gradients, with
        the group's hyperparameters `hyper` as they were at step() (None:
        as they are)."""
        opt = self.opt
        self.partial.step(opt, params, opt._gh_group_of(params[0]), hyper)


class PartialSteps:
    """The update of some parameters of one group: an optimizer of the
    wrapped class over just them, sharing the wrapped optimizer's state, so
    a module's parameters take one optimizer call; for the `ELEMENTWISE`
    classes the same arithmetic as one step over all of them."""

    def __init__(self, base: type):
        self.base = base
        self.sub: dict[tuple, torch.optim.Optimizer] = {}  # by the ids of the parameters

    def step(self, opt: torch.optim.Optimizer, params: list, group: dict, hyper: dict | None) -> None:
        if hyper is None:
            hyper = {k: v for k, v in group.items() if k != "params"}
        key = tuple(id(p) for p in params)
        sub = self.sub.get(key)
        if sub is None:
            base = self.base
            hyper0 = {k: v for k, v in group.items() if k != "params"}
            sub = base(params, **{k: v for k, v in hyper0.items() if k in base.__init__.__code__.co_varnames})
            if len(self.sub) >= 4096:  # sets that keep changing (stragglers): bounded
                self.sub.clear()
            self.sub[key] = sub
        # Shared, keyed by parameter; set at every call: load_state_dict()
        # (a checkpoint, an elastic rollback) replaces the optimizer's dict.
        sub.state = opt.state
        sub.param_groups[0].update(hyper)
        with torch.no_grad():
            sub.step()


class Synchronous:
    """Plain wait-free backprop: each gradient is pushed as autograd
    produces it, step() waits for them all and then runs the update."""

    # Whether check_gradient does anything: the gradient hooks skip the call when not.
    checks_gradients = False

    def __init__(self, opt, where: OnWorkers):
        self.opt = opt
        self.where = where
        self.eager_steps = 0  # steps that updated eagerly (OnWorkers.eager)

    def attach(self) -> None:
        """Hooks of the schedule's own, registered after the optimizer's."""

    def remove(self) -> None:
        """Remove them (remove_hooks())."""

    def switch_overlap(self, on: bool) -> None:
        """Autotuning: forward overlap on or off from the next step."""
        if on:
            raise RuntimeError("internal: forward overlap switched on for an optimizer built without it")

    def check_gradient(self, pid: int) -> None:
        """A gradient is accumulated, before it is counted."""

    def before_forward(self, own: list) -> None:
        """A module using parameters `own` is about to run forward."""
        self.where.before_forward(own)

    def step(self, closure):
        """The optimizer's step()."""
        return self.step_synchronously(closure)

    def step_synchronously(self, closure):
        """Synchronize (unless under skip_synchronize()), then update. Called
        by each schedule's step() only (see the warning's stack level)."""
        opt = self.opt
        if not opt._gh_skip_sync:
            if opt._gh_synchronized:
                # Horovod's warning: the gradients are synchronized already.
                # Pointing at the caller of step(): this, the schedule's
                # step(), the optimizer's, torch's step hook wrapper, the caller.
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                              "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in "
                              "your code.", stacklevel=5)
            else:
                eager = self.where.eager(closure)
                if eager is not None:
                    opt.synchronize(eager)  # and updated
                    # As the wrapped step would: a frozen parameter that still has a gradient.
                    rest = [id(p) for p in opt._gh_params if not p.requires_grad and p.grad is not None]
                    if rest:
                        eager(rest)
                    self.eager_steps += 1
                    opt._gh_synchronized = False
                    return None
                opt.synchronize()
        opt._gh_synchronized = False
        return self.where.update(closure)

    def zero_grad(self, set_to_none: bool):
        opt = self.opt
        if opt._gh_handles:
            raise RuntimeError("zero_grad() called while gradients are still being reduced; "
                               "call step() or synchronize() first")
        return opt._gh_base_cls.zero_grad(opt, set_to_none)

    def finish(self) -> None:
        """Apply every pending update now; none here."""
