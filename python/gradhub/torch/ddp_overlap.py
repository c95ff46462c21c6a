"""`ddp_forward_overlap(ddp_model, optimizer)`: P3's forward overlap for a
torch `DistributedDataParallel` model, through the extension points torch
documents (a comm hook, module hooks), without forking DDP.

Why: DDP's reducer waits for every bucket before backward() returns, so a
step lasts at least the forward pass, the backward pass up to the first full
bucket, and the whole exchange (docs/bench/details.md, "DDP's bound"). Here
each wait moves to where its values are needed:

- the comm hook starts each bucket's average in place, in the bucket's own
  buffer, at the bucket's index as its priority (DDP numbers buckets in the
  order gradients become ready, so the highest holds the first layers, which
  the next forward pass needs first), and hands DDP a future that is
  complete already: backward() returns without waiting;
- over the "gradhub" backend a large bucket is averaged in parts (whole
  parameters, at most `parts` of them, none under `part_bytes`: a pure
  function of the bucket's layout, so the same names on every rank), each
  waited for by its own parameters, and with `gradient_as_bucket_view=True`
  a part starts as soon as its last gradient is in the bucket, before DDP
  hands the bucket over (a hook after each gradient's accumulation): DDP's
  default 25 MB buckets would otherwise hold a small model's whole exchange
  until the end of the backward pass;
- optimizer.step() updates nothing: it notes each group's hyperparameters;
- the next forward pass updates each parameter just before the module call
  that first uses it (found once, by walking the first pass's autograd
  graph, as `DistributedOptimizer(overlap_forward=True)` does), waiting for
  its bucket's average there: the optimizer's class over just those
  parameters, sharing its state, so the same arithmetic as one step.

Over the "gradhub" backend a bucket's average is the backend's, with its
priority; over any other backend it is the group's all_reduce, one per
bucket when DDP hands it over (a collective's order must be the same on
every rank there; the backend's operations have names instead).

Limits, each refused or documented (docs/torch.md): SGD, Adam or AdamW
only (an update per parameter); nothing may read the gradients between
backward() and step() (gradient clipping would read them mid-average); an LR
scheduler must be made after this (it wraps step()); parameters read
outside a forward pass need `finish()` first (the model's and the
optimizer's state_dict() call it). A parameter used in a forward pass
before the module call it was placed in is an error, not a stale value.
Parts start early only without `find_unused_parameters` and `static_graph`
(where a gradient may be final only after its last hook), and then
`zero_grad()` zeroes the bucket views in place instead of setting them to
None, so that the next gradients accumulate into the bucket again.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .dist.collectives import BUCKET_PARTS
from .modes import ELEMENTWISE, PartialSteps
from .overlap import graph_uses, innermost_call, next_node_nr


def _gradhub_backend(group):
    """The group's gradhub backend (a `Collectives`), or None for any other."""
    from .dist.collectives import Collectives

    if isinstance(group, Collectives):
        return group
    try:
        b = group._get_backend(torch.device("cpu"))
    except Exception:  # noqa: BLE001 - no CPU backend, or a torch without the call
        return None
    return b if isinstance(b, Collectives) else None


def bucket_parts(nbytes: list[int], parts: int, part_bytes: int) -> list[tuple[int, int]]:
    """Split a bucket whose parameters take `nbytes` into at most `parts`
    runs of whole parameters, `(first, end)` indexes, each at least
    `part_bytes` and the bucket's share (but the last): a function of the
    layout alone, so every rank averages the same parts under the same
    names."""
    total = sum(nbytes)
    target = max(part_bytes, -(-total // max(parts, 1)), 1)
    runs, first, size = [], 0, 0
    for i, b in enumerate(nbytes):
        size += b
        if size >= target:
            runs.append((first, i + 1))
            first, size = i + 1, 0
    if first < len(nbytes):
        runs.append((first, len(nbytes)))
    return runs


class _Layout:
    """One DDP bucket as the comm hook last saw it: its buffer, where each
    parameter's gradient sits in it, and its parts."""

    __slots__ = ("index", "buf", "params", "ptr", "runs", "part_of")

    def __init__(self, index: int, buf: torch.Tensor, params: list, grads: list, parts: int, part_bytes: int):
        # `grads`: the bucket's views of its buffer (GradBucket.gradients()), one per parameter.
        self.index, self.buf, self.params = index, buf, params
        self.ptr = {id(p): g.data_ptr() for p, g in zip(params, grads)}
        self.runs = bucket_parts([g.numel() * g.element_size() for g in grads], parts, part_bytes)
        self.part_of = {id(params[i]): k for k, (a, b) in enumerate(self.runs) for i in range(a, b)}

    def same(self, buf: torch.Tensor, params: list) -> bool:
        return (buf.data_ptr() == self.buf.data_ptr() and buf.numel() == self.buf.numel()
                and len(params) == len(self.params) and all(a is b for a, b in zip(params, self.params)))

    def view(self, part: int) -> torch.Tensor:
        """Part `part` of the buffer: from its first gradient to the end of its last."""
        a, b = self.runs[part]
        size = self.buf.element_size()
        start = (self.ptr[id(self.params[a])] - self.buf.data_ptr()) // size
        end = (self.ptr[id(self.params[b - 1])] - self.buf.data_ptr()) // size + self.params[b - 1].numel()
        return self.buf[start:end]


class _Bucket:
    """One bucket's average started by the comm hook."""

    __slots__ = ("work", "params", "views", "done")

    def __init__(self, work, params: list, views: list | None):
        self.work, self.params, self.views, self.done = work, params, views, False

    def wait(self) -> None:
        if self.done:
            return
        self.work.wait()
        self.done = True
        if self.views is not None:
            # gradient_as_bucket_view=False: DDP copied the bucket into the
            # gradients when the hook returned, before the average was in.
            with torch.no_grad():
                for p, v in zip(self.params, self.views):
                    if p.grad is not None:
                        p.grad.copy_(v.view_as(p.grad))


def _average_bucket(state, bucket):  # (no annotation: DDP checks it, and this module postpones them)
    """The comm hook (DDP calls it with the registered state)."""
    return state._start(bucket)


class DDPForwardOverlap:
    """What `ddp_forward_overlap` returns; see the module's doc."""

    def __init__(self, model: DistributedDataParallel, optimizer: torch.optim.Optimizer, parts: int = 8,
                 part_bytes: int = 1 << 20):
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(f"ddp_forward_overlap: the model must be a DistributedDataParallel, not "
                            f"{type(model).__name__}")
        base = type(optimizer)
        if base not in ELEMENTWISE:
            raise TypeError(f"ddp_forward_overlap: {base.__name__} is not supported: the update of a parameter "
                            f"must depend on its own gradient and state alone (SGD, Adam, AdamW); use "
                            f"gradhub.torch.DistributedOptimizer(overlap_forward=True) or plain DDP")
        if "step" in vars(optimizer):
            raise TypeError("ddp_forward_overlap: this optimizer's step() is wrapped already (an LR scheduler "
                            "made before?); make the scheduler after ddp_forward_overlap(...)")
        if not 1 <= parts <= BUCKET_PARTS or part_bytes < 1:
            raise ValueError(f"ddp_forward_overlap: parts must be in 1..{BUCKET_PARTS} and part_bytes at least 1, "
                             f"not {parts} and {part_bytes}")
        self.model, self.opt = model, optimizer
        self._group = model.process_group
        self._backend = _gradhub_backend(self._group)
        self._parts, self._part_bytes = parts, part_bytes
        self._layouts: dict[int, _Layout] = {}    # bucket index -> its layout, as the comm hook last saw it
        self._where: dict[int, _Layout] = {}      # param id -> its bucket's layout
        self._ready: dict[tuple, set] = {}        # (bucket, part) -> ids of its parameters whose gradient is in
        self._early: dict[tuple, _Bucket] = {}    # (bucket, part) -> its average, started before the bucket came
        self._armed = False                       # this backward pass may start parts early
        # Early parts need the gradients to be the buckets' views, each final after its one hook.
        self._early_ok = self._backend is not None and model.gradient_as_bucket_view
        self._size = dist.get_world_size(self._group)
        self._partial = PartialSteps(base)
        self._by_id = {id(p): p for g in optimizer.param_groups for p in g["params"]}
        self._group_idx = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self._started: dict[int, _Bucket] = {}    # param id -> its bucket's average, started since step()
        self._pending: dict[int, tuple] = {}      # param id -> (the hyperparameters at step(), its _Bucket)
        self._zero_after: dict[int, bool] = {}    # param id -> set_to_none of a zero_grad() deferred
        self._placed = False
        self._first: list = []                    # parameters no module call was found to use first
        self._calls: list | None = None           # discovery: [module, first node number, node after]
        self._open: list[int] = []
        self._global_hooks: list = []
        self._start_nr = 0
        self.overlapped = 0   # forward passes that ran updates of the step before (the rest ran them at once)
        self.early = 0        # bucket parts whose average started before DDP handed their bucket over
        if self._early_ok:
            for p in model.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._grad_ready)
        model.register_forward_pre_hook(self._model_starts)
        model.register_forward_hook(self._model_ends)
        model.register_comm_hook(self, _average_bucket)
        model.module.register_state_dict_pre_hook(lambda *_: self.finish())
        optimizer.register_state_dict_pre_hook(lambda _: self.finish())
        optimizer.register_load_state_dict_pre_hook(lambda *_: self.finish())
        optimizer._gh_ddp_overlap = self
        optimizer.__class__ = type(f"ForwardOverlap{base.__name__}", (base,),
                                   {"step": _step, "zero_grad": _zero_grad, "__module__": __name__})

    # -- the comm hook

    def _start(self, bucket) -> torch.futures.Future:
        buf = bucket.buffer()
        params = bucket.parameters()
        late = [p for p in params if id(p) in self._pending]
        if late:
            raise RuntimeError(f"ddp_forward_overlap: a gradient was made for {len(late)} parameter(s) whose "
                               f"update was still pending (used outside the forward pass of the model?)")
        views = None if self.model.gradient_as_bucket_view else bucket.gradients()
        if self._backend is None:
            buf.div_(self._size)
            rec = _Bucket(dist.all_reduce(buf, group=self._group, async_op=True), params, views)
            for p in params:
                self._started[id(p)] = rec
        else:
            index = bucket.index()
            lay = self._layouts.get(index)
            if lay is None or not lay.same(buf, params):
                if any(k[0] == index for k in self._early):
                    raise RuntimeError(f"ddp_forward_overlap: DDP's bucket {index} changed while parts of it were "
                                       f"being averaged")
                lay = self._layouts[index] = _Layout(index, buf, params, bucket.gradients(), self._parts,
                                                     self._part_bytes)
                self._where.update((id(p), lay) for p in params)
            for part, (a, b) in enumerate(lay.runs):
                self._ready.pop((index, part), None)
                rec = self._early.pop((index, part), None) or self._start_part(lay, part, views)
                for p in params[a:b]:
                    self._started[id(p)] = rec
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(buf)
        return fut

    def _start_part(self, lay: _Layout, part: int, views: list | None = None) -> _Bucket:
        a, b = lay.runs[part]
        work = self._backend.average_bucket(lay.view(part), lay.index, part)
        return _Bucket(work, lay.params[a:b], None if views is None else views[a:b])

    def _grad_ready(self, p) -> None:
        """After `p`'s gradient accumulated (autograd's hook): its bucket's
        part starts once all its gradients are in the bucket."""
        if not self._armed:
            return
        lay = self._where.get(id(p))
        if lay is None or p.grad is None or p.grad.data_ptr() != lay.ptr[id(p)]:
            return   # not a view of its bucket (yet): the part starts with the bucket
        key = (lay.index, lay.part_of[id(p)])
        if key in self._early:
            return
        ready = self._ready.setdefault(key, set())
        ready.add(id(p))
        a, b = lay.runs[key[1]]
        if len(ready) == b - a:
            del self._ready[key]
            self._early[key] = self._start_part(lay, key[1])
            self.early += 1

    # -- the model's forward pass

    def _early_mode(self) -> bool:
        """Whether parts may start early: the gradients are the buckets'
        views, each final after its one hook (not so with
        find_unused_parameters or static_graph, which DDP may set later)."""
        m = self.model
        return self._early_ok and not m.find_unused_parameters and not m.static_graph

    def _may_rebuild(self) -> bool:
        """Whether DDP may rebuild its buckets in this forward pass (it
        copies each gradient into a new bucket then)."""
        m = self.model
        return (m.static_graph or not m.find_unused_parameters) and not m._has_rebuilt_buckets

    def _model_starts(self, module, args) -> None:
        if self._early:
            # A backward pass that stopped before DDP handed its buckets over
            # (an error caught?): what it started lands, and is dropped.
            for rec in self._early.values():
                rec.wait()
            self._early.clear()
        self._ready.clear()
        self._armed = (self._early_mode() and torch.is_grad_enabled() and self._placed and not self._may_rebuild()
                       and self.model.require_backward_grad_sync)
        if not torch.is_grad_enabled() or not self._placed or self._may_rebuild():
            self.finish()   # an evaluation, the pass that places the updates, a rebuild
        else:
            self._wait_started()   # a second backward() before step() accumulates onto averaged gradients
            if self._pending:
                self.overlapped += 1
            if self._first and self._pending:
                self._apply(self._first)
        self._start_nr = next_node_nr()
        for h in self._global_hooks:   # a first pass that raised
            h.remove()
        self._global_hooks = []
        if not self._placed and torch.is_grad_enabled():
            self._calls, self._open = [], []
            self._global_hooks = [
                nn.modules.module.register_module_forward_pre_hook(self._call_starts),
                nn.modules.module.register_module_forward_hook(self._call_ends, always_call=True),
            ]

    def _call_starts(self, module, args) -> None:
        if module is not self.model:
            self._open.append(len(self._calls))
            self._calls.append([module, next_node_nr(), None])

    def _call_ends(self, module, args, output) -> None:
        if module is not self.model and self._open:
            self._calls[self._open.pop()][2] = next_node_nr()

    def _model_ends(self, module, args, output) -> None:
        if self._calls is not None:
            self._place(output)
        elif self._pending:
            # Not updated by any call of this pass: unused in it (updated now),
            # or used outside the call it was placed in (refused).
            left = {pid: self._by_id[pid] for pid in self._pending}
            used = graph_uses(output, self._start_nr, left)
            if used:
                names = self._names(used)
                raise RuntimeError(f"ddp_forward_overlap: parameter(s) {names} were used before their update, "
                                   f"outside the module call that first used them in the first forward pass; "
                                   f"use plain DDP or DistributedOptimizer(overlap_forward=True) for this model")
            self._apply(list(left.values()))

    def _place(self, output) -> None:
        """The end of the first pass: each parameter is updated just before
        the innermost module call whose autograd nodes first used it."""
        for h in self._global_hooks:
            h.remove()
        calls, self._calls, self._global_hooks = self._calls, None, []
        uses = graph_uses(output, self._start_nr, self._by_id)
        due: dict[int, tuple] = {}
        for pid, p in self._by_id.items():
            at = innermost_call(calls, uses[pid]) if pid in uses else None
            if at is None:
                self._first.append(p)
            else:
                due.setdefault(at, (calls[at][0], []))[1].append(p)
        for module, params in due.values():
            module.register_forward_pre_hook(lambda _m, _a, ps=params: self._apply(ps) if self._pending else None)
        self._placed = True

    def _names(self, pids) -> str:
        named = {id(p): n for n, p in self.model.module.named_parameters()}
        return ", ".join(sorted(named.get(pid, "?") for pid in pids)[:5])

    # -- updates

    def _apply(self, params: list) -> None:
        """Update those of `params` with an update pending, once their
        buckets' averages are in: one call per parameter group."""
        due = [p for p in params if id(p) in self._pending]
        if not due:
            return
        by_group: dict[int, tuple] = {}
        for p in due:
            hyper, rec = self._pending.pop(id(p))
            rec.wait()
            by_group.setdefault(self._group_idx[id(p)], ([], hyper))[0].append(p)
        for gi, (ps, hyper) in by_group.items():
            self._partial.step(self.opt, ps, self.opt.param_groups[gi], hyper)
        if self._zero_after:
            for p in due:
                to_none = self._zero_after.pop(id(p), None)
                if to_none is not None:
                    self._zero(p, to_none)

    def finish(self) -> None:
        """Wait for every average started and apply every update pending:
        the parameters and gradients are then those of plain DDP."""
        self._wait_started()
        if self._pending:
            self._apply([self._by_id[pid] for pid in list(self._pending)])

    def _wait_started(self) -> None:
        if self._started:
            for rec in {id(r): r for r in self._started.values()}.values():
                rec.wait()

    def step(self, closure=None):
        loss = None
        if closure is not None:
            # Evaluated here, and updated synchronously (below).
            self.finish()
            with torch.enable_grad():
                loss = closure()
        if self._pending:   # a second step() with no forward pass since the last one
            self._apply([self._by_id[pid] for pid in list(self._pending)])
        now: dict[int, list] = {}
        for gi, group in enumerate(self.opt.param_groups):
            hyper = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                rec = self._started.pop(id(p), None)
                if rec is not None:
                    self._pending[id(p)] = (hyper, rec)
                elif p.grad is not None:
                    now.setdefault(gi, []).append(p)   # no average this step (no_sync()): as the optimizer would
        self._started.clear()   # (parameters outside the optimizer)
        for gi, ps in now.items():
            self._partial.step(self.opt, ps, self.opt.param_groups[gi], None)
        if closure is not None:
            self.finish()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.opt.param_groups:
            for p in group["params"]:
                if id(p) in self._pending:
                    self._zero_after[id(p)] = set_to_none   # its update still needs it
                elif p.grad is not None:
                    rec = self._started.get(id(p))
                    if rec is not None:
                        rec.wait()
                    self._zero(p, set_to_none)

    def _zero(self, p, set_to_none: bool) -> None:
        """As torch's zero_grad(), but a gradient that is its bucket's view
        stays one (zeroed) where parts may start early: the next gradient
        then accumulates into the bucket, where its part can start at once."""
        if set_to_none and self._early_mode():
            lay = self._where.get(id(p))
            if lay is not None and p.grad is not None and p.grad.data_ptr() == lay.ptr[id(p)]:
                set_to_none = False
        _zero(p, set_to_none)


def _zero(p, set_to_none: bool) -> None:
    """As torch's zero_grad() (a gradient may be a view of a DDP bucket)."""
    if set_to_none:
        p.grad = None
    elif p.grad is not None:
        if p.grad.grad_fn is not None:
            p.grad.detach_()
        else:
            p.grad.requires_grad_(False)
        p.grad.zero_()


def _step(opt, closure=None):
    return opt._gh_ddp_overlap.step(closure)


def _zero_grad(opt, set_to_none: bool = True):
    return opt._gh_ddp_overlap.zero_grad(set_to_none)


def ddp_forward_overlap(model: DistributedDataParallel, optimizer: torch.optim.Optimizer, parts: int = 8,
                        part_bytes: int = 1 << 20) -> DDPForwardOverlap:
    """Overlap DDP's gradient exchange with the next forward pass (P3):
    backward() no longer waits for DDP's buckets; each parameter's update
    runs just before the module that uses it runs forward again. Call once,
    before the first forward pass, with the optimizer over the model's
    parameters (SGD, Adam or AdamW), and before making an LR scheduler:

        model = DistributedDataParallel(net, gradient_as_bucket_view=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        overlap = gradhub.torch.ddp_forward_overlap(model, opt)
        ...                       # the training loop, unchanged
        overlap.finish()          # before reading the parameters outside a forward pass

    The same parameters as plain DDP, step for step. Over the "gradhub"
    backend each bucket's average goes at its priority (the first layers'
    first), a bucket over `part_bytes` in up to `parts` parts, each started
    as soon as its gradients are in (with gradient_as_bucket_view=True);
    see the module's doc for the limits."""
    return DDPForwardOverlap(model, optimizer, parts, part_bytes)
