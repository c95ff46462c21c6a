"""DistributedOptimizer(overlap_forward=True) (P3): step() does not wait.

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

    def __init__(self, opt):
        super().__init__()
        self._opt = opt
        self.discover = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        opt = self._opt
        if self.discover:
            for a in _tensor_args(args, kwargs):
                if id(a) in opt._gh_by_id and id(a) not in opt._gh_covered:
                    opt._gh_outside.add(id(a))
        elif opt._gh_pending:
            for a in _tensor_args(args, kwargs):
                if id(a) in opt._gh_pending:
                    opt._gh_apply(a)
        return func(*args, **kwargs)


class OverlapForward:
    """Mode mixin; see optimizer._DistributedOptimizer for the extension points."""

    _gh_overlap = True
    # Autotuning may turn the overlap off (and on again) between steps: off,
    # step() is the synchronous schedule's.
    _gh_overlap_on = True

    def __init__(self, *args, **kwargs):
        self._gh_pending: dict[int, dict] = {}  # param id -> hyperparameters of its pending update
        self._gh_zero_after: set[int] = set()
        self._gh_sub: dict[tuple, torch.optim.Optimizer] = {}  # by the ids of the parameters it updates
        self._gh_first_use = _FirstUse(self)
        self._gh_depth = 0  # module calls under way (the mode is pushed at the outermost)
        self._gh_mode_on = False
        self._gh_discovered = False
        self._gh_covered: set[int] = set()  # discovery: parameters of the modules called so far
        self._gh_outside: set[int] = set()  # parameters used before any module owning them was called
        super().__init__(*args, **kwargs)
        self._gh_call_hooks = [
            torch.nn.modules.module.register_module_forward_pre_hook(self._gh_call_starts),
            torch.nn.modules.module.register_module_forward_hook(self._gh_call_ends, always_call=True),
        ]

    def _gh_call_starts(self, module, inputs):
        self._gh_depth += 1
        mode = self._gh_first_use
        if self._gh_depth == 1 and not self._gh_mode_on:
            mode.discover = not self._gh_discovered
            if mode.discover or (self._gh_outside and not self._gh_outside.isdisjoint(self._gh_pending)):
                mode.__enter__()
                self._gh_mode_on = True
        if mode.discover:
            self._gh_covered.update(id(p) for p in self._gh_module_params(module) if id(p) in self._gh_by_id)

    def _gh_call_ends(self, module, inputs, output):
        self._gh_depth = max(0, self._gh_depth - 1)
        if self._gh_depth == 0 and self._gh_mode_on:
            self._gh_mode_on = False
            self._gh_first_use.__exit__(None, None, None)
            # Discovery ends with the first call that used this optimizer's
            # parameters (not, say, a loss module called first).
            if self._gh_first_use.discover and (self._gh_covered or self._gh_outside):
                self._gh_discovered, self._gh_first_use.discover = True, False
                self._gh_covered = set()

    def remove_hooks(self):
        for h in self._gh_call_hooks:
            h.remove()
        self._gh_call_hooks = []
        super().remove_hooks()

    def _gh_check_gradient(self, pid: int) -> None:
        if pid in self._gh_pending:
            raise RuntimeError(
                f"gradient of '{self._gh_names[pid]}' was accumulated before its pending update was applied: "
                f"with overlap_forward=True a parameter must be used inside the forward() of some module (it "
                f"was used outside every module call, e.g. in the training loop); use overlap_forward=False "
                f"for this model"
            )
        super()._gh_check_gradient(pid)

    def _gh_before_forward(self, own: list) -> None:
        super()._gh_before_forward(own)
        if self._gh_pending:
            due = [p for p in own if id(p) in self._gh_pending]
            if due:
                self._gh_apply_many(due)

    def _gh_sub_optimizer(self, params: list, hyper: dict):
        """An optimizer of the same class over `params` (of one group),
        sharing state with this one, so parameters can be updated a module
        at a time: one optimizer call for a module's parameters, not one
        each. `hyper`: the group's hyperparameters as they were at step()."""
        key = tuple(id(p) for p in params)
        sub = self._gh_sub.get(key)
        if sub is None:
            group = self._gh_group_of(params[0])
            base = self._gh_base_cls
            hyper0 = {k: v for k, v in group.items() if k != "params"}
            sub = base(params, **{k: v for k, v in hyper0.items() if k in base.__init__.__code__.co_varnames})
            sub.state = self.state  # shared: keyed by parameter
            if len(self._gh_sub) >= 4096:  # sets that keep changing (stragglers): bounded
                self._gh_sub.clear()
            self._gh_sub[key] = sub
        sub.param_groups[0].update(hyper)
        return sub

    def _gh_update_many(self, params: list, hyper: dict | None) -> None:
        """Update `params` (of one group) with their reduced gradients."""
        if hyper is None:
            hyper = {k: v for k, v in self._gh_group_of(params[0]).items() if k != "params"}
        with torch.no_grad():
            self._gh_sub_optimizer(params, hyper).step()

    def _gh_apply(self, p):
        """Wait for p's reduced gradient and update p alone."""
        self._gh_apply_many([p])

    def _gh_apply_many(self, params: list):
        """Wait for the reduced gradients of `params` (each with an update
        pending) and update them, one optimizer call per parameter group."""
        handles, pending = self._gh_handles, self._gh_pending
        for h in {id(h): h for h in (handles.pop(id(p), None) for p in params) if h is not None}.values():
            h.wait()
        by_group: dict = {}
        for p in params:
            by_group.setdefault(self._gh_group_idx[id(p)], ([], pending.pop(id(p), None)))[0].append(p)
        for ps, hyper in by_group.values():
            self._gh_update_many(ps, hyper)
        if self._gh_zero_after:
            for p in params:
                if id(p) in self._gh_zero_after:
                    self._gh_zero_after.discard(id(p))
                    p.grad = None

    def _gh_apply_all(self):
        if self._gh_pending:
            self._gh_apply_many([self._gh_by_id[pid] for pid in list(self._gh_pending)])

    def step(self, closure=None):
        if closure is None and not self._gh_skip_sync and self._gh_overlap_on:
            # Previous step's stragglers (parameters unused in forward) first.
            self._gh_apply_all()
            self._gh_finalize_order()
            fusion = self._gh_fusion
            if (any(c != 0 for c in self._gh_counts.values()) or (fusion is not None and fusion.accumulating())) \
                    and not self._gh_handles:
                return None  # accumulating (backward_passes_per_step)
            # As synchronize(): a parameter this worker produced no gradient
            # for (a branch not taken here) is reduced with zeros, or its
            # push would come a step late, into the others' next round.
            for p in self._gh_params:
                pid = id(p)
                if p.requires_grad and pid not in self._gh_handles and (fusion is None or pid not in fusion.of):
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    self._gh_counts[pid] = 0
                    self._gh_start(p)
            if fusion is not None:
                fusion.flush()  # buckets missing a gradient go now, with zeros for it, as synchronize() does
            for pid in list(self._gh_handles):
                # Snapshot the hyperparameters: an LR scheduler may step before the update runs.
                group = self._gh_group_of(self._gh_by_id[pid])
                self._gh_pending[pid] = {k: v for k, v in group.items() if k != "params"}
            if self._gh_sfb is not None:
                self._gh_sfb.decide()
            return None
        # With a closure (or under skip_synchronize): the synchronous schedule.
        if not self._gh_skip_sync:
            self._gh_apply_all()
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True):
        if self._gh_pending:
            # Gradients still needed by pending updates are cleared after them.
            for pid in self._gh_pending:
                self._gh_zero_after.add(pid)
            for p in self._gh_params:
                if id(p) not in self._gh_pending and p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.detach_().zero_()
            return
        # The wrapped optimizer's, not the base's check: reductions still in
        # flight are fine here, they become pending updates at step().
        return self._gh_base_cls.zero_grad(self, set_to_none)

    def finish(self):
        """Apply every pending update now, e.g. before evaluation or saving."""
        self._gh_apply_all()

    def state_dict(self):
        self._gh_apply_all()
        return super().state_dict()
