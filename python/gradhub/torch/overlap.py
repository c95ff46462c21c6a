"""DistributedOptimizer(overlap_forward=True) (P3): the `ForwardOverlap`
schedule (a strategy of modes.py), in which step() does not wait.

Each parameter is updated when its own reduced gradient is needed: just
before the module that owns it runs forward again (a module pre-hook), at its
first use by any torch function during a forward pass (a parameter used
outside its owner's forward(): a tied weight, a functional call, a custom
autograd function; see `_FirstUse`), just before the forward of the module
in whose call autograd first recorded it (a parameter no torch function is
given: passed to a custom autograd function whose forward() computes with
an extension kernel, or not at all; see `_place_graph_uses`), or at the
next step()/synchronize()/finish(). Same arithmetic as the synchronous
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


# The number the next autograd node created on this thread will get (nodes
# are numbered in creation order): what places a node in a module call.
# Private to torch (torch.fx reads it the same way), present since 2.1.
next_node_nr = torch.autograd._get_sequence_nr


def _tensors(out):
    """The tensors in a module's output (nested tuples, lists and dicts)."""
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (list, tuple)):
        for o in out:
            yield from _tensors(o)
    elif isinstance(out, dict):
        for o in out.values():
            yield from _tensors(o)


def graph_uses(outputs, since: int, by_id) -> dict[int, int]:
    """{param id: number of the first node using it} over the part of the
    autograd graph of `outputs` created since node number `since` (this
    forward pass), whether or not a torch function was given the parameter
    (a custom autograd function's inputs are not)."""
    first: dict[int, int] = {}
    todo = [t.grad_fn for t in _tensors(outputs) if t.grad_fn is not None]
    seen = set(todo)
    while todo:
        node = todo.pop()
        nr = node._sequence_nr()
        for nxt, _ in node.next_functions:
            if nxt is None or nxt in seen:
                continue
            var = getattr(nxt, "variable", None)  # an AccumulateGrad: a leaf
            if var is not None:
                pid = id(var)
                if pid in by_id and nr < first.get(pid, nr + 1):
                    first[pid] = nr
            elif nxt._sequence_nr() >= since:  # older nodes: an earlier pass's, not walked
                seen.add(nxt)
                todo.append(nxt)
    return first


def innermost_call(calls: list, nr: int) -> int | None:
    """The index in `calls` ([module, first node number, node number after
    or None], in the order they started) of the innermost call during which
    node `nr` was created, or None. Calls nest and start in order: the last
    one containing the node is the innermost."""
    return max((i for i, (_, start, end) in enumerate(calls) if start <= nr and (end is None or nr < end)),
               default=None)


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
        # Discovery: the module calls of the pass, in the order they started,
        # as [module, first node number, node number after], and those open.
        self.calls: list[list] = []
        self.open: list[int] = []
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
        self.opt._gh_reprioritize()  # GRADHUB_SCHEDULING=auto follows it

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
            self.open.append(len(self.calls))
            self.calls.append([module, next_node_nr(), None])

    def _call_ends(self, module, inputs, output):
        self.depth = max(0, self.depth - 1)
        discover = self.first_use.discover
        if discover and self.open:
            self.calls[self.open.pop()][2] = next_node_nr()
        if self.depth == 0 and self.mode_on:
            self.mode_on = False
            self.first_use.__exit__(None, None, None)
            if discover:
                found = self._place_graph_uses(output)
                # Discovery ends with the first call that used this optimizer's
                # parameters (not, say, a loss module called first), in a
                # pass that records the autograd graph (not an evaluation
                # under no_grad first).
                if (self.covered or self.outside or found) and torch.is_grad_enabled():
                    self.discovered, self.first_use.discover = True, False
                self.covered, self.calls, self.open = set(), [], []

    def _place_graph_uses(self, output) -> bool:
        """Discovery, at the end of the pass: a parameter that autograd
        recorded before any module owning it was called, and that `_FirstUse`
        did not see, joins the parameters of the module in whose call
        (the innermost) it was first recorded, so that module's pre-hook
        updates it: nothing more per step. Says whether the graph reached any
        of this optimizer's parameters."""
        opt = self.opt
        uses = graph_uses(output, self.calls[0][1], opt._gh_by_id) if self.calls else {}
        owner_from: dict[int, int] = {}  # param id -> node number when a module owning it was called
        for module, start, _ in self.calls:
            for p in opt._gh_module_params(module):
                owner_from.setdefault(id(p), start)
        place: dict[int, tuple] = {}  # index of the call -> (its module, [parameters])
        for pid, nr in uses.items():
            if pid in self.outside or owner_from.get(pid, nr + 1) <= nr:
                continue
            at = innermost_call(self.calls, nr)
            if at is not None:
                place.setdefault(at, (self.calls[at][0], []))[1].append(opt._gh_by_id[pid])
        for module, params in place.values():
            opt._gh_uses_too(module, params)
        return bool(uses)

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
