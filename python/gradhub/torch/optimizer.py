"""DistributedOptimizer: Horovod's wrapper, scheduled as Poseidon and P3 prescribe.

- Wait-free backprop: each gradient is handed to push_pull the moment autograd
  has accumulated it (post-accumulate-grad hooks), not at step().
- Priority = forward order (P3): the order in which parameters are first used
  in the forward pass is recorded in the first iteration (a global module
  forward pre-hook); until then, registration order stands in. Earlier layers
  get higher priority, so the first layer's gradient, produced last in
  backward, overtakes the big last layers still in flight.
- Every tensor the optimizer will push is declared in one batched exchange when
  it is built, so no step pays a scheduler round trip.

This module holds what every mode shares (hooks, priorities, synchronize,
skip_synchronize, the Horovod API) and the `DistributedOptimizer` factory,
which picks the mode once: a strategy object (modes.py), the schedule
(`Synchronous`, or overlap.py's `ForwardOverlap` for `overlap_forward`, P3)
holding where updates run (`OnWorkers`, or server_optimizer.py's `OnServers`
for `optimizer_on_server`, PHub). Autotuning (autotune.py) watches step().
"""

from __future__ import annotations

import contextlib
import queue
import warnings
import weakref
from typing import Iterable

import torch

from .. import _env
from .. import api as _api
from . import autotune
from .compression import Compression, NoneCompressor
from .fusion import Fusion
from .modes import ELEMENTWISE, OnWorkers, Synchronous
from .ops import Average, Sum, _reduce_async, _resolve_op, parameter_names
from .process_sets import _resolve, global_process_set
from .sums import start_reduction, wire_spec
from .sufficient_factors import SufficientFactors
from .overlap import ForwardOverlap
from .asynchronous import asynchronous_optimizer
from .server_optimizer import OnServers, server_unsupported


class _DistributedOptimizer:
    """The wrapper every mode shares.

    `DistributedOptimizer(opt)` builds a subclass of opt's class with this
    class in front, so `isinstance(dopt, type(opt))` holds, as in Horovod;
    `opt._gh_base_cls` is the wrapped optimizer's class. What differs between
    the modes is delegated to `_gh_mode`, the strategy chosen at
    construction (modes.py)."""

    def __init__(self, params, named_parameters=None, compression=Compression.none, backward_passes_per_step=1,
                 op=Average, *, base_cls: type, scheduling: str = "auto", predivide: float = 1.0,
                 sparse_as_dense: bool = False, process_set=global_process_set, sfb: str = "off",
                 fusion_threshold: int = 0, partition_bytes: int = 0, schedule: type = Synchronous,
                 where: type = OnWorkers, eager: bool = True):
        super().__init__(params)
        self._gh_ps = process_set
        self._gh_base_cls = base_cls  # the wrapped optimizer's class
        self._gh_compression = compression
        self._gh_op = _resolve_op(None, op)
        if self._gh_op not in (Average, Sum):
            raise ValueError(f"DistributedOptimizer reduces gradients with Average or Sum, not {self._gh_op!r}")
        self._gh_predivide = float(predivide)
        self._gh_sparse_as_dense = sparse_as_dense
        self._gh_sparse: list = []  # sparse gradients reduced dense this step: made sparse again
        if backward_passes_per_step < 1:
            raise ValueError("backward_passes_per_step must be >= 1")
        self._gh_passes = backward_passes_per_step
        all_params = [p for g in self.param_groups for p in g["params"]]
        names = parameter_names(all_params, named_parameters)
        self._gh_names = names
        # Horovod's attribute, which scripts and wrappers read: parameter -> name.
        self._parameter_names = {p: names[id(p)] for p in all_params}
        self._gh_params = all_params
        # Registration order until the first forward pass tells the real order.
        self._gh_rank_of = {id(p): i for i, p in enumerate(all_params)}
        self._gh_forward_seen: dict[int, int] = {}
        self._gh_order_final = False
        self._gh_handles: dict[int, object] = {}
        self._gh_counts = {id(p): 0 for p in all_params}
        self._gh_skip_sync = False
        self._gh_synchronized = False
        # Group index, not the dict: load_state_dict() replaces the group dicts.
        self._gh_group_idx = {id(p): i for i, g in enumerate(self.param_groups) for p in g["params"]}
        self._gh_by_id = {id(p): p for p in all_params}
        self._gh_scheduling = scheduling  # auto, priority (forward order), size (largest first) or fifo
        self._gh_prio: dict[int, int] = {}  # param id -> priority (_gh_reprioritize)
        self._gh_eager = eager  # the synchronous schedule's eager update (modes.py)
        self._gh_own_cache: dict[int, list] = {}
        self._gh_tuner = None  # an autotune.Autotuner while tuning
        # The mode, chosen once: the schedule, holding where updates run.
        self._gh_mode = schedule(self, where(self))
        self._gh_reprioritize()
        self._gh_server = where.on_server
        # Small gradients travel packed (not with a compressor of the user's,
        # nor with the optimizer on the servers, which keep state per tensor).
        plain = isinstance(compression, type) and issubclass(compression, NoneCompressor)
        self._gh_can_fuse = plain and not self._gh_server
        self._gh_fuse_matrices = sfb == "off"
        # Chunk size of the gradients pushed (0: the job's partition); autotune.
        self._gh_partition = partition_bytes
        self._gh_build_fusion(fusion_threshold)
        # Collective: blocks until every worker has built its optimizer.
        # (Over a process set, the workers outside it declare each tensor on
        # its first round instead, when they push zeros for it.)
        if process_set._is_global():
            _api.declare(self._gh_declarations())
            _declared.append(weakref.ref(self))
        self._gh_hooks = []
        self._gh_register_hooks()
        self._gh_fwd_hook = torch.nn.modules.module.register_module_forward_pre_hook(self._gh_forward_pre_hook)
        self._gh_sfb = SufficientFactors(self, sfb) if sfb != "off" and not self._gh_server else None
        self._gh_mode.attach()

    # -------------------------------------------------------------- layout

    def _gh_declarations(self) -> list:
        """[(name, (numel, dtype, partition)), ...] of every tensor this
        optimizer pushes, declared in one exchange at construction."""
        return self._gh_mode.where.declarations()

    def _gh_push_name(self, p, tagged: bool = True) -> str:
        """The name p's gradient is pushed under (`tagged=False`: without
        its chunk size, the base for derived names)."""
        return self._gh_mode.where.push_name(p, tagged)

    def _gh_tag(self) -> str:
        return f"@{self._gh_partition}" if self._gh_partition else ""

    def _gh_register_hooks(self) -> None:
        """A gradient hook on every parameter that requires grad: a fused
        one's only counts it into its bucket (fusion.py)."""
        for h in self._gh_hooks:
            h.remove()
        fused = self._gh_fusion.of if self._gh_fusion is not None else {}
        self._gh_hooks = [p.register_post_accumulate_grad_hook(
            self._gh_fusion.hook(p) if id(p) in fused else self._gh_make_hook(p))
            for p in self._gh_params if p.requires_grad]

    def _gh_build_fusion(self, threshold: int) -> None:
        self._gh_fusion_threshold = threshold
        fusion = Fusion(self, threshold, matrices=self._gh_fuse_matrices) if threshold > 0 and self._gh_can_fuse \
            else None
        self._gh_fusion = fusion if fusion is not None and fusion.buckets else None

    def _gh_relayout(self, fusion_threshold: int, partition_bytes: int) -> None:
        """Autotuning, between steps with nothing in flight: push in buckets of
        `fusion_threshold` and chunks of `partition_bytes` from the next step.
        Collective: declares the new layout's tensors and releases the old's."""
        if self._gh_handles:
            raise RuntimeError("internal: the layout changes with reductions in flight")
        before = {name for name, _ in self._gh_declarations()}
        self._gh_partition = partition_bytes
        self._gh_build_fusion(fusion_threshold)
        self._gh_register_hooks()
        now = self._gh_declarations()
        _api.declare(now)
        gone = before - {name for name, _ in now}
        if gone:
            _api.release(*sorted(gone))

    def _gh_reduce(self, grad, name: str, priority: int):
        """Start reducing `grad` in place under `name` (a gradient, or a fusion bucket)."""
        if self._gh_predivide != 1.0:
            # Horovod's split average: 1/f before the sum, f/size after.
            f = self._gh_predivide
            return _reduce_async(grad, name, Sum, priority, self._gh_compression, grad, 1.0 / f,
                                 f / self._gh_ps.size(), self._gh_ps)
        return start_reduction(grad, name, self._gh_ps, average=self._gh_op is Average, priority=priority,
                               compression=self._gh_compression, target=grad)

    # -------------------------------------------------------------- scheduling

    def _gh_group_of(self, p) -> dict:
        return self.param_groups[self._gh_group_idx[id(p)]]

    def _gh_priority(self, p) -> int:
        """Higher = sooner (see `_gh_reprioritize`)."""
        return self._gh_prio.get(id(p), 0)

    def _gh_schedule(self) -> str:
        """The scheduling in force: GRADHUB_SCHEDULING with `auto` resolved
        (see `_gh_reprioritize`)."""
        if self._gh_scheduling == "auto":
            return "priority" if getattr(self._gh_mode, "on", False) else "fifo"
        return self._gh_scheduling

    def _gh_reprioritize(self) -> None:
        """The priorities of the scheduling in force (GRADHUB_SCHEDULING):
        - `priority`: forward order, earlier = more urgent (P3: the next
          forward pass needs its first layers first);
        - `size`: the largest tensors first, ties in forward order. With the
          synchronous schedule nothing runs before every update is done, so
          the order decides only what is left after the last byte: the
          updates of the last tensors in (eager update, modes.py), the
          smaller the sooner step() returns;
        - `fifo`: all equal, i.e. in order of readiness (the job-wide order
          is then the tensors' keys, first use first: the same on every
          worker whenever each one's gradients arrive);
        - `auto` (default): forward order while forward overlap is on,
          `fifo` otherwise. A priority that differs from readiness lets a
          late gradient (BERT's embedding, the largest and the last in
          backward) preempt the others; workers reach it at different
          times, so for a while each pushes different chunks, and each
          one's windows fill with chunks waiting for the others' pushes
          while its link idles (BERT-base with CPU-only servers, 4 hosts:
          fifo 13 % faster than `size`; docs/benchmarks.md, "Scheduling:
          readiness order").
        Called when built, when the forward order is known, and when
        autotuning switches forward overlap."""
        sched = self._gh_schedule()
        rank = self._gh_rank_of
        if sched == "fifo":
            self._gh_prio = {}
        elif sched == "size":
            order = sorted(self._gh_params, key=lambda p: (p.numel() * p.element_size(), -rank[id(p)]))
            self._gh_prio = {id(p): i + 1 for i, p in enumerate(order)}
        else:
            self._gh_prio = {id(p): len(self._gh_params) - rank[id(p)] for p in self._gh_params}

    def _gh_module_params(self, module):
        """Parameters a module's forward uses directly: its own, those of
        ParameterList/ParameterDict children (containers that are never
        called), and those forward overlap found it uses (`_gh_uses_too`)."""
        own = self._gh_own_cache.get(id(module))
        if own is None:
            ps = list(module._parameters.values())
            stack = [c for c in module.children() if isinstance(c, (torch.nn.ParameterList, torch.nn.ParameterDict))]
            while stack:
                c = stack.pop()
                ps.extend(c._parameters.values())
                stack.extend(x for x in c.children() if isinstance(x, (torch.nn.ParameterList, torch.nn.ParameterDict)))
            own = [p for p in ps if p is not None and id(p) in self._gh_rank_of]
            self._gh_own_cache[id(module)] = own
        return own

    def _gh_uses_too(self, module, params: list) -> None:
        """Forward overlap's discovery found that `module`'s forward uses
        `params` before any module owning them runs (through a custom
        autograd function): its pre-hook updates them too from now on."""
        own = self._gh_module_params(module)
        ids = {id(p) for p in own}
        self._gh_own_cache[id(module)] = own + [p for p in params if id(p) not in ids]

    def _gh_forward_pre_hook(self, module, inputs):
        own = self._gh_module_params(module)
        if not own:
            return
        if not self._gh_order_final:
            for p in own:
                self._gh_forward_seen.setdefault(id(p), len(self._gh_forward_seen))
        self._gh_mode.before_forward(own)

    def _gh_finalize_order(self):
        """After the first forward+backward: fix priorities to forward order
        (parameters never seen in forward keep their relative registration order, after the others)."""
        if self._gh_order_final or not self._gh_forward_seen:
            return
        seen = sorted(self._gh_forward_seen, key=self._gh_forward_seen.get)
        unseen = [id(p) for p in self._gh_params if id(p) not in self._gh_forward_seen]
        self._gh_rank_of = {pid: i for i, pid in enumerate(seen + unseen)}
        self._gh_order_final = True
        self._gh_reprioritize()

    def _gh_make_hook(self, p):
        # Forward overlap checks that no update is pending; the other modes check nothing.
        check = self._gh_mode.check_gradient if self._gh_mode.checks_gradients else None

        def hook(param):
            if check is not None:
                check(id(param))
            self._gh_ready(param)

        return hook

    def _gh_ready(self, p):
        """A backward pass is done with p (its gradient accumulated, or its
        sufficient factors all in): start it on the last pass of the step."""
        pid = id(p)
        if pid in self._gh_handles:
            raise RuntimeError(
                f"gradient of '{self._gh_names[pid]}' was computed twice before step(); "
                f"call optimizer.step() (or use backward_passes_per_step) between backward passes"
            )
        self._gh_counts[pid] += 1
        if self._gh_counts[pid] < self._gh_passes:
            return
        self._gh_counts[pid] = 0
        self._gh_start(p)

    def _gh_start(self, p):
        sfb = self._gh_sfb
        if sfb is not None and sfb.exchanges(p):  # its factors travel, not its gradient
            self._gh_handles[id(p)] = sfb.start(p, self._gh_priority(p))
            return
        grad = p.grad
        if grad is None:
            return
        if grad.is_sparse:
            # Reduced dense (the same values Horovod's sparse allgather sums
            # to), and made sparse again at synchronize().
            sparse_dim = grad.sparse_dim()
            grad = p.grad = grad.to_dense()
            self._gh_sparse.append((p, sparse_dim))
        if self._gh_fusion is not None and id(p) in self._gh_fusion.of:
            self._gh_fusion.fill(p)  # synchronize(): no gradient this step
            return
        if sfb is not None:
            sfb.observe(p)
        self._gh_handles[id(p)] = self._gh_mode.where.push(p, grad)

    # -------------------------------------------------------------- Horovod API

    def synchronize(self, _each=None):
        """Wait until every gradient of this step has been reduced.
        (`_each(ids)`, internal: called on this thread with the ids of
        the parameters whose reductions have finished, as they finish: the
        eager update, modes.py.)"""
        self._gh_finalize_order()
        # As Horovod: a parameter this worker produced no gradient for this
        # step (a branch of the model not taken here) is reduced with a zero
        # gradient, so every worker reduces every parameter and none waits
        # for a reduction another never starts.
        for p in self._gh_params:
            if p.requires_grad and id(p) not in self._gh_handles:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                self._gh_counts[id(p)] = 0
                self._gh_start(p)
        # Once per operation: a fusion bucket is the handle of all its members.
        if _each is None or self._gh_sparse:
            for h in {id(h): h for h in self._gh_handles.values()}.values():
                h.wait()
        else:
            _wait_each(self._gh_handles, _each)
            _each = None
        # As Horovod, a sparse gradient is sparse again after its reduction,
        # also with sparse_as_dense (which only says how it travels).
        for p, sparse_dim in self._gh_sparse:
            p.grad = p.grad.to_sparse(sparse_dim)
        self._gh_sparse.clear()
        if _each is not None:  # sparse gradients: all at once, once they are sparse again
            _each(list(self._gh_handles))
        if self._gh_sfb is not None:
            self._gh_sfb.decide()
        done = list(self._gh_handles)
        self._gh_handles.clear()
        self._gh_synchronized = True
        return done

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside this block step() does not synchronize (call synchronize() yourself first)."""
        self._gh_skip_sync = True
        try:
            yield
        finally:
            self._gh_skip_sync = False

    def step(self, closure=None):
        mode = self._gh_mode
        mode.where.before_step()
        out = mode.step(closure)
        if self._gh_tuner is not None:
            self._gh_tuner.after_step()  # autotune.py: times the steps, switches between them
        return out

    def zero_grad(self, set_to_none: bool = True):
        return self._gh_mode.zero_grad(set_to_none)

    def finish(self):
        """Apply every pending update now (overlap_forward), e.g. before
        evaluation or saving; nothing to do in the other modes."""
        self._gh_mode.finish()

    def state_dict(self):
        self._gh_mode.finish()
        return super().state_dict()

    def _gh_redeclare(self):
        """An elastic job's next generation knows no tensors: declare ours
        again, as a worker new to the job does when it builds its optimizer,
        and decide again which layers go as sufficient factors (a newcomer
        decides at its first step; the rows per worker changed with the size)."""
        if self._gh_server:
            raise RuntimeError("optimizer_on_server=True is not elastic: the optimizer's state lives on the "
                               "servers, and a new generation of the job starts with fresh ones")
        if self._gh_tuner is not None:
            raise RuntimeError("autotuning (GRADHUB_AUTOTUNE) is not elastic: a newcomer would tune from the start "
                               "while the others use the tuned layout; tune first, then run elastically with it")
        _api.declare(self._gh_declarations())
        if self._gh_sfb is not None:
            mode = "force" if self._gh_sfb.force else "auto"
            self._gh_sfb.remove()
            self._gh_sfb = SufficientFactors(self, mode)

    def _gh_abandon(self):
        """The job failed mid-step (an elastic reset): forget the reductions
        in flight and the passes counted, so the next step starts clean."""
        self._gh_handles.clear()
        self._gh_counts = dict.fromkeys(self._gh_counts, 0)
        self._gh_sparse.clear()
        if self._gh_fusion is not None:
            self._gh_fusion.abandon()

    def remove_hooks(self):
        self._gh_mode.remove()
        for h in self._gh_hooks:
            h.remove()
        self._gh_fwd_hook.remove()
        self._gh_hooks = []
        if self._gh_sfb is not None:
            self._gh_sfb.remove()


# The optimizers that declared their tensors over the whole job, in the
# order they did: an elastic reset declares them again in that order.
_declared: list[weakref.ref] = []


def _wait_each(handles: dict, each) -> None:
    """Wait for every operation of `handles` ({param id: handle}, a handle
    shared by the parameters of a fusion bucket), calling `each(ids)` on
    this thread with the parameter ids of the operations finished since
    the last call, as they finish: the synchronous schedule's eager update
    (modes.py). A failed operation raises from its wait(), as with one
    wait() per operation. An operation whose wait() may run a collective of
    its own (`ordered`: sufficient factors that gather in full) is waited
    in the order of `handles`, the same on every worker, as the others of
    its kind: finished out of that order, it waits for those before it."""
    ops: dict[int, tuple] = {}  # id(handle) -> (handle, its parameter ids)
    for pid, h in handles.items():
        ops.setdefault(id(h), (h, []))[1].append(pid)
    ordered = [key for key, (h, _) in ops.items() if getattr(h, "ordered", False)]
    held: set[int] = set()  # finished, ordered, waiting for an earlier ordered one
    finished: queue.SimpleQueue = queue.SimpleQueue()
    for key, (h, _) in ops.items():
        h.add_done_callback(lambda _h, key=key: finished.put(key))  # from a core thread, or at once
    left = set(ops)
    while left:
        try:
            ready = {finished.get(timeout=1.0)}
        except queue.Empty:  # a callback never lost, but a poll costs nothing here
            ready = {key for key in left if ops[key][0].done()}
            if not ready:
                continue
        while True:
            try:
                ready.add(finished.get_nowait())
            except queue.Empty:
                break
        ready &= left
        held |= ready.intersection(ordered)
        go = [key for key in ready if key not in held]
        while ordered and ordered[0] in held:
            held.discard(ordered[0])
            go.append(ordered.pop(0))
        for key in go:
            ops[key][0].wait()
        left.difference_update(go)
        if go:
            each([pid for key in go for pid in ops[key][1]])


def redeclare_all() -> None:
    """After an elastic reset: every live optimizer declares its tensors
    again, in the order they were built (a newcomer builds them so)."""
    _declared[:] = [r for r in _declared if r() is not None]
    for r in list(_declared):
        opt = r()
        if opt is not None:
            opt._gh_redeclare()


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Iterable | None = None,
                         compression=Compression.none, backward_passes_per_step: int = 1, op=Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups=None,
                         sparse_as_dense: bool = False, process_set=None, overlap_forward: bool | str | None = None,
                         optimizer_on_server: bool | None = None, sufficient_factors: str | None = None,
                         fusion_threshold: int | None = None, asynchronous: bool | None = None):
    """Wrap any torch.optim.Optimizer so gradients are reduced across workers.

    Same signature as Horovod's: `gradient_predivide_factor` f splits the
    average (gradients times 1/f before the sum, f/size after; Average only);
    sparse gradients are reduced dense and made sparse again (or left dense
    with `sparse_as_dense`); `num_groups`/`groups` are checked and accepted:
    Horovod fuses a group's gradients into one message, gradhub partitions
    and schedules each gradient on its own, so grouping changes no value.
    With a `process_set`, gradients are averaged over its members only (who
    alone build the optimizer; optimizer_on_server is then not available).
    Plus three gradhub options: `sufficient_factors` ("auto", "force" or
    "off"; default GRADHUB_SFB, else auto) exchanges the weight gradients of
    `nn.Linear` layers as Poseidon's sufficient factors where that moves fewer
    bytes (see torch/sufficient_factors.py), and two scheduling options:
    `overlap_forward=True` lets the next forward pass start before every
    gradient has arrived (SGD, Adam, AdamW; "auto": off, but autotuning may
    try it, which it does only when allowed so); `optimizer_on_server=True`
    runs the update on the summation servers (SGD, AdamW; float32).
    `asynchronous=True` (the job's GRADHUB_ASYNC, the default when left
    unset) is BytePS's asynchronous mode: each worker updates with its own
    gradients and the servers apply every worker's change as it arrives
    (torch/asynchronous.py; float32 parameters). Left
    unset, they come from GRADHUB_OVERLAP_FORWARD (1, 0 or auto) /
    GRADHUB_OPTIMIZER_ON_SERVER, so an unchanged Horovod script can use them;
    GRADHUB_SCHEDULING=fifo turns the forward-order priorities off (for
    comparisons).

    Construction is collective: every tensor the optimizer will push is
    declared with the scheduler in one batched exchange, which returns once
    every worker has built its DistributedOptimizer (as every Horovod script
    does), and raises if the workers' parameters differ in size or dtype."""
    if not _api.is_initialized():
        raise _api.NotInitializedError("gradhub is not initialized: call gradhub.torch.init() before "
                                       "DistributedOptimizer")
    job_async = bool(_env.get("GRADHUB_ASYNC"))
    if asynchronous is None:
        asynchronous = job_async
    if asynchronous:
        if not job_async:
            raise ValueError("asynchronous=True needs an asynchronous job: set GRADHUB_ASYNC=1 on every worker, "
                             "server and the scheduler")
        why = ("a process set" if process_set not in (None, global_process_set) else
               "optimizer_on_server" if optimizer_on_server else
               "gradient compression" if compression is not Compression.none else
               "overlap_forward" if overlap_forward is True else None)
        if why:
            raise ValueError(f"the asynchronous mode does not combine with {why}")
        if _env.get("GRADHUB_MIN_WORKERS") is not None:
            raise RuntimeError("the asynchronous mode is not elastic: the servers' parameters live in one "
                               "generation of the job (docs/torch.md, \"Training modes\")")
        return asynchronous_optimizer(optimizer, named_parameters, backward_passes_per_step)
    ps = _resolve(process_set, members_only=False)
    if not ps.included():
        # As Horovod: a worker outside the set keeps a local optimizer.
        return _outside_set(optimizer, named_parameters)
    if gradient_predivide_factor != 1.0 and _resolve_op(None, op) is not Average:
        raise ValueError("gradient_predivide_factor is only supported with op=Average")
    if gradient_predivide_factor <= 0:
        raise ValueError(f"gradient_predivide_factor must be positive, not {gradient_predivide_factor}")
    _check_groups(optimizer, num_groups, groups)
    env = _env.torch_options()
    tune = _env.autotune_options()
    if overlap_forward is None:
        overlap_forward = env.overlap_forward
    elif isinstance(overlap_forward, str) and overlap_forward != "auto":
        raise ValueError(f"overlap_forward must be True, False or 'auto', not {overlap_forward!r}")
    # "auto": off unless autotuning tries it and finds it faster.
    overlap_auto = overlap_forward == "auto"
    overlap_forward = bool(overlap_forward) and not overlap_auto
    if optimizer_on_server is None:
        optimizer_on_server = env.optimizer_on_server
    base = optimizer.__class__
    if overlap_forward and not issubclass(base, ELEMENTWISE):
        warnings.warn(f"overlap_forward is supported for {', '.join(c.__name__ for c in ELEMENTWISE)}; "
                      f"{base.__name__} falls back to the synchronous schedule", stacklevel=2)
        overlap_forward = False
    if optimizer_on_server and not ps._is_global():
        warnings.warn("optimizer_on_server is not available with a process set; the optimizer runs on the workers",
                      stacklevel=2)
        optimizer_on_server = False
    if optimizer_on_server:
        why = server_unsupported(optimizer, compression)
        if why:
            warnings.warn(f"optimizer_on_server is not available here ({why}); the optimizer runs on the "
                          f"workers", stacklevel=2)
            optimizer_on_server = False
    # Knobs the user set stay as set (autotune.py).
    fixed = set(tune.fixed) | ({"fusion_threshold"} if fusion_threshold is not None else set())
    fusion_threshold = max(0, env.fusion_threshold if fusion_threshold is None else int(fusion_threshold))
    job_partition = _api.partition_bytes()
    start = autotune.Settings(overlap_forward, fusion_threshold, job_partition, _api.credit_bytes())
    tunable: set = set()
    if tune.enabled:
        if not ps._is_global():
            warnings.warn("autotune is not available with a process set; the settings stay as they are",
                          stacklevel=2)
        else:
            params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
            tunable = autotune.tunable(
                fixed, overlap_auto=overlap_auto, elementwise=issubclass(base, ELEMENTWISE),
                on_server=optimizer_on_server,
                plain=isinstance(compression, type) and issubclass(compression, NoneCompressor),
                declared_ahead=all(wire_spec(p, compression) is not None for p in params))
    loaded = None
    if tunable and tune.file:
        loaded = autotune.load(tune.file, autotune.fingerprint_of(optimizer, ps), job_partition)
        if loaded is not None:
            # What the user set wins over the file.
            start = autotune.Settings(*(getattr(loaded if k in tunable else start, k) for k in autotune.KNOBS))
            tunable = set()
    # The mode, chosen once. When overlap is tuned its schedule is there,
    # switched on or off between steps.
    with_overlap = start.overlap_forward or "overlap_forward" in tunable
    cls = type(base.__name__, (_DistributedOptimizer, base), {})
    opt = cls.__new__(cls)
    # Re-create with the same param_groups (hyperparameters included) and defaults.
    opt.defaults = optimizer.defaults
    cls.__init__(opt, optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
                 base_cls=base, scheduling=env.scheduling, predivide=gradient_predivide_factor,
                 sparse_as_dense=sparse_as_dense, process_set=ps,
                 sfb=_check_sfb(env.sfb if sufficient_factors is None else sufficient_factors),
                 fusion_threshold=start.fusion_threshold,
                 partition_bytes=0 if start.partition_bytes == job_partition else start.partition_bytes,
                 schedule=ForwardOverlap if with_overlap else Synchronous,
                 where=OnServers if optimizer_on_server else OnWorkers,
                 eager=env.eager_update)
    opt._gh_mode.switch_overlap(start.overlap_forward)
    opt.defaults = optimizer.defaults
    if optimizer.state:
        opt.load_state_dict(optimizer.state_dict())
    if start.credit_bytes != _api.credit_bytes():
        _api.set_credit(start.credit_bytes)
    if loaded is not None and ps.rank() == 0:
        autotune.say(f"autotune: loaded {start.describe()} from {tune.file}")
    if tunable:
        opt._gh_tuner = autotune.Autotuner(opt, start, tunable, job_partition, warmup=tune.warmup_steps,
                                           steps=tune.steps_per_trial, log=tune.log, file=tune.file)
    return opt


class _OutsideSet:
    """DistributedOptimizer(process_set=s) on a worker outside s, as in
    Horovod: the wrapped optimizer, reducing nothing."""

    def __init__(self, params, named_parameters):
        super().__init__(params)
        all_params = [p for g in self.param_groups for p in g["params"]]
        names = {id(p): n for n, p in (named_parameters or [])}
        self._parameter_names = {p: names.get(id(p), f"param.{i}") for i, p in enumerate(all_params)}

    def synchronize(self):
        return []

    @contextlib.contextmanager
    def skip_synchronize(self):
        yield

    def finish(self):
        pass

    def remove_hooks(self):
        pass


def _outside_set(optimizer, named_parameters):
    cls = type(optimizer.__class__.__name__, (_OutsideSet, optimizer.__class__), {})
    opt = cls.__new__(cls)
    opt.defaults = optimizer.defaults
    cls.__init__(opt, optimizer.param_groups, None if named_parameters is None else list(named_parameters))
    opt._gh_base_cls = optimizer.__class__
    if optimizer.state:
        opt.load_state_dict(optimizer.state_dict())
    return opt


def _check_sfb(mode: str) -> str:
    if mode not in ("auto", "force", "off"):
        raise ValueError(f"sufficient_factors must be 'auto', 'force' or 'off', not {mode!r}")
    return mode


def _check_groups(optimizer, num_groups, groups) -> None:
    """Horovod's grouping arguments, checked as Horovod does."""
    if not isinstance(num_groups, int) or num_groups < 0:
        raise ValueError(f"num_groups must be a non-negative int, not {num_groups!r}")
    if groups is None or isinstance(groups, int):
        if isinstance(groups, int) and groups < 0:
            raise ValueError(f"groups must be a non-negative int or a list of lists of parameters, not {groups!r}")
        return
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, (list, tuple)) for g in groups):
        raise ValueError("groups must be a non-negative int or a list of lists of parameters")
    known = {id(p) for g in optimizer.param_groups for p in g["params"]}
    seen = set()
    for g in groups:
        for p in g:
            if id(p) not in known:
                raise ValueError("groups names a parameter the optimizer does not have")
            if id(p) in seen:
                raise ValueError("a parameter is in more than one of groups")
            seen.add(id(p))
