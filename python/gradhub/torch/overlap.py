"""DistributedOptimizer(overlap_forward=True) (P3): the `ForwardOverlap`
schedule (a strategy of modes.py), in which step() does not wait.

Each parameter is updated when its own reduced gradient is needed: just
before the module that owns it runs forward again (a module pre-hook), at its
first use by any torch function during a forward pass (a parameter used
outside its owner's forward(): a tied weight, a functional call, a custom
autograd function; see `_FirstUse`), or at the next
step()/synchronize()/finish(). Same arithmetic as the synchronous
schedule, hence the same result: the update of some parameters is the
wrapped optimizer's update restricted to them (an optimizer of the same
class over just them, sharing its state), with the hyperparameters as they
were at step() (an LR scheduler may step before the update runs). A
module's parameters due together are updated in one call (one per module,
not one per parameter: a Linear's weight and bias, a norm's scale and shift).
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from .modes import Synchronous

# Optimizers whose update of a parameter depends only on that parameter's
# gradient and state, so parameters can be updated one at a time.
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


def _tensor_args(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):  # torch.cat([...]), torch.stack, ...
            yield from a
        else:
            yield a


class _FirstUse(TorchFunctionMode):
    """Pushed when an outermost module call starts and popped when it ends
    (modes nest with the module calls), in one of two roles:
    - discovery (the first forward pass): note every parameter a torch
      function is given before any module owning it was called in this pass
      (a parameter used outside its owner's forward(): a tied weight, a
      functional call, a custom autograd function);
    - later, only for models that have such parameters and while one of
      them has an update pending: a torch function given it applies the
      update first.
    Models without such parameters run without the mode (it costs ~10 us
    per torch call)."""

    def __init__(self, sched: "ForwardOverlap"):
        super().__init__()
        self._sched = sched
        self.discover = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sched = self._sched
        if self.discover:
            by_id = sched.opt._gh_by_id
            for a in _tensor_args(args, kwargs):
                if id(a) in by_id and id(a) not in sched.covered:
                    sched.outside.add(id(a))
        elif sched.pending:
            for a in _tensor_args(args, kwargs):
                if id(a) in sched.pending:
                    sched.apply_many([a])
        return func(*args, **kwargs)


class ForwardOverlap(Synchronous):
    """The schedule of forward overlap (see the module's doc)."""

    checks_gradients = True

    def __init__(self, opt, where):
        super().__init__(opt, where)
        # Autotuning may turn the overlap off (and on again) between steps:
        # off, step() is the synchronous schedule's.
        self.on = True
        self.pending: dict[int, dict] = {}  # param id -> hyperparameters of its pending update
        self.zero_after: set[int] = set()
        self.first_use = _FirstUse(self)
        self.depth = 0  # module calls under way (the mode is pushed at the outermost)
        self.mode_on = False
        self.discovered = False
        self.covered: set[int] = set()  # discovery: parameters of the modules called so far
        self.outside: set[int] = set()  # parameters used before any module owning them was called
        self.call_hooks: list = []

    def attach(self) -> None:
        self.call_hooks = [
            torch.nn.modules.module.register_module_forward_pre_hook(self._call_starts),
            torch.nn.modules.module.register_module_forward_hook(self._call_ends, always_call=True),
        ]

    def remove(self) -> None:
        for h in self.call_hooks:
            h.remove()
        self.call_hooks = []

    def switch_overlap(self, on: bool) -> None:
        self.on = on

    def _call_starts(self, module, inputs):
        self.depth += 1
        mode = self.first_use
        if self.depth == 1 and not self.mode_on:
            mode.discover = not self.discovered
            if mode.discover or (self.outside and not self.outside.isdisjoint(self.pending)):
                mode.__enter__()
                self.mode_on = True
        if mode.discover:
            by_id = self.opt._gh_by_id
            self.covered.update(id(p) for p in self.opt._gh_module_params(module) if id(p) in by_id)

    def _call_ends(self, module, inputs, output):
        self.depth = max(0, self.depth - 1)
        if self.depth == 0 and self.mode_on:
            self.mode_on = False
            self.first_use.__exit__(None, None, None)
            # Discovery ends with the first call that used this optimizer's
            # parameters (not, say, a loss module called first).
            if self.first_use.discover and (self.covered or self.outside):
                self.discovered, self.first_use.discover = True, False
                self.covered = set()

    def check_gradient(self, pid: int) -> None:
        if pid in self.pending:
            raise RuntimeError(
                f"gradient of '{self.opt._gh_names[pid]}' was accumulated before its pending update was applied: "
                f"with overlap_forward=True a parameter must be used inside the forward() of some module (it "
                f"was used outside every module call, e.g. in the training loop); use overlap_forward=False "
                f"for this model"
            )

    def before_forward(self, own: list) -> None:
        super().before_forward(own)
        if self.pending:
            due = [p for p in own if id(p) in self.pending]
            if due:
                self.apply_many(due)

    def apply_many(self, params: list):
        """Wait for the reduced gradients of `params` (each with an update
        pending) and update them, one update per parameter group."""
        opt, pending = self.opt, self.pending
        handles = opt._gh_handles
        for h in {id(h): h for h in (handles.pop(id(p), None) for p in params) if h is not None}.values():
            h.wait()
        by_group: dict = {}
        for p in params:
            by_group.setdefault(opt._gh_group_idx[id(p)], ([], pending.pop(id(p), None)))[0].append(p)
        for ps, hyper in by_group.values():
            self.where.update_some(ps, hyper)
        if self.zero_after:
            for p in params:
                if id(p) in self.zero_after:
                    self.zero_after.discard(id(p))
                    p.grad = None

    def finish(self) -> None:
        """Apply every pending update now."""
        if self.pending:
            self.apply_many([self.opt._gh_by_id[pid] for pid in list(self.pending)])

    def step(self, closure):
        opt = self.opt
        if closure is not None or opt._gh_skip_sync or not self.on:
            # With a closure (or under skip_synchronize): the synchronous schedule.
            if not opt._gh_skip_sync:
                self.finish()
            return self.step_synchronously(closure)
        # Previous step's stragglers (parameters unused in forward) first.
        self.finish()
        opt._gh_finalize_order()
        fusion = opt._gh_fusion
        if (any(c != 0 for c in opt._gh_counts.values()) or (fusion is not None and fusion.accumulating())) \
                and not opt._gh_handles:
            return None  # accumulating (backward_passes_per_step)
        # As synchronize(): a parameter this worker produced no gradient
        # for (a branch not taken here) is reduced with zeros, or its
        # push would come a step late, into the others' next round.
        for p in opt._gh_params:
            pid = id(p)
            if p.requires_grad and pid not in opt._gh_handles and (fusion is None or pid not in fusion.of):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                opt._gh_counts[pid] = 0
                opt._gh_start(p)
        if fusion is not None:
            fusion.flush()  # buckets missing a gradient go now, with zeros for it, as synchronize() does
        for pid in list(opt._gh_handles):
            # Snapshot the hyperparameters: an LR scheduler may step before the update runs.
            group = opt._gh_group_of(opt._gh_by_id[pid])
            self.pending[pid] = {k: v for k, v in group.items() if k != "params"}
        if opt._gh_sfb is not None:
            opt._gh_sfb.decide()
        return None

    def zero_grad(self, set_to_none: bool):
        opt = self.opt
        if self.pending:
            # Gradients still needed by pending updates are cleared after them.
            self.zero_after.update(self.pending)
            for p in opt._gh_params:
                if id(p) not in self.pending and p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.detach_().zero_()
            return None
        # The wrapped optimizer's, not the synchronous check: reductions still
        # in flight are fine here, they become pending updates at step().
        return opt._gh_base_cls.zero_grad(opt, set_to_none)
