"""DistributedOptimizer: Horovod's wrapper, scheduled as Poseidon and P3 prescribe.

- Wait-free backprop: each gradient is handed to push_pull the moment autograd
  has accumulated it (post-accumulate-grad hooks), not at step().
- Priority = forward order (P3): the order in which parameters are first used
  in the forward pass is recorded in the first iteration (a global module
  forward pre-hook); until then, registration order stands in. Earlier layers
  get higher priority, so the first layer's gradient, produced last in
  backward, overtakes the big last layers still in flight.
- overlap_forward (P3): step() does not wait; each parameter is updated when
  its own reduced gradient is needed, just before its module's next forward
  (or at the next step()/synchronize()). Same arithmetic, same result.
- optimizer_on_server (PHub): the servers keep the parameters and optimizer
  state and run the update fused per chunk; a round returns new parameters,
  which are copied into the model. SGD (momentum, dampening, Nesterov, weight
  decay) and AdamW (and Adam without weight decay), float32 parameters.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Iterable

import torch

from .. import api as _api
from .compression import Compression
from .ops import Average, Sum, _push_pull_async, _resolve_op

# Optimizers whose update of a parameter depends only on that parameter's
# gradient and state, so parameters can be updated one at a time.
_ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, named_parameters=None, compression=Compression.none, backward_passes_per_step=1,
                 op=Average, overlap_forward=False, optimizer_on_server=False):
        super(self.__class__, self).__init__(params)
        self._gh_compression = compression
        self._gh_op = _resolve_op(None, op)
        if backward_passes_per_step < 1:
            raise ValueError("backward_passes_per_step must be >= 1")
        self._gh_passes = backward_passes_per_step
        all_params = [p for g in self.param_groups for p in g["params"]]
        if named_parameters is not None:
            named = list(named_parameters)
            if named and not isinstance(named[0], tuple):
                raise ValueError("named_parameters should be a sequence of (name, parameter) tuples, "
                                 "e.g. model.named_parameters()")
            names = {id(p): n for n, p in named}
            dup = len(names) != len({n for n, _ in named})
            if dup:
                raise ValueError("parameter names in named_parameters must be unique")
            missing = [p for p in all_params if id(p) not in names]
            if missing:
                raise ValueError(f"named_parameters does not cover {len(missing)} of the optimizer's parameters")
        else:
            names = {id(p): f"param.{i}" for i, p in enumerate(all_params)}
        self._gh_names = names
        self._gh_params = all_params
        # Registration order until the first forward pass tells the real order.
        self._gh_rank_of = {id(p): i for i, p in enumerate(all_params)}
        self._gh_forward_seen: dict[int, int] = {}
        self._gh_order_final = False
        self._gh_handles: dict[int, object] = {}
        self._gh_counts = {id(p): 0 for p in all_params}
        self._gh_pending: dict[int, dict] = {}  # overlap: param id -> hyperparameters of its pending update
        self._gh_zero_after: set[int] = set()
        self._gh_skip_sync = False
        self._gh_synchronized = False
        # Group index, not the dict: load_state_dict() replaces the group dicts.
        self._gh_group_idx = {id(p): i for i, g in enumerate(self.param_groups) for p in g["params"]}
        self._gh_by_id = {id(p): p for p in all_params}
        self._gh_overlap = bool(overlap_forward)
        sched = os.environ.get("GRADHUB_SCHEDULING", "priority").strip().lower()
        if sched not in ("priority", "fifo"):
            raise ValueError(f"GRADHUB_SCHEDULING={sched!r}: expected priority or fifo")
        self._gh_fifo = sched == "fifo"
        if self._gh_overlap and not isinstance(self, _ELEMENTWISE):
            warnings.warn(f"overlap_forward is supported for {', '.join(c.__name__ for c in _ELEMENTWISE)}; "
                          f"{type(self).__mro__[1].__name__} falls back to the synchronous schedule", stacklevel=3)
            self._gh_overlap = False
        self._gh_sub: dict[int, torch.optim.Optimizer] = {}
        self._gh_own_cache: dict[int, list] = {}
        self._gh_server = bool(optimizer_on_server)
        if self._gh_server:
            why = self._gh_server_unsupported(all_params, compression)
            if why:
                warnings.warn(f"optimizer_on_server is not available here ({why}); the optimizer runs on the "
                              f"workers", stacklevel=3)
                self._gh_server = False
        self._gh_server_cfg: dict[int, tuple] = {}   # last optimizer config sent, per parameter
        self._gh_inited: set[int] = set()
        self._gh_init_handles: dict[int, object] = {}
        self._gh_hooks = []
        if _api._client is None:
            raise RuntimeError("gradhub is not initialized: call gradhub.torch.init() before DistributedOptimizer")
        for p in all_params:
            if p.requires_grad:
                self._gh_hooks.append(p.register_post_accumulate_grad_hook(self._gh_make_hook(p)))
        self._gh_fwd_hook = torch.nn.modules.module.register_module_forward_pre_hook(self._gh_forward_pre_hook)

    # -------------------------------------------------------------- server-side optimizer

    def _gh_group_of(self, p) -> dict:
        return self.param_groups[self._gh_group_idx[id(p)]]

    def _gh_server_unsupported(self, params, compression):
        if compression is not Compression.none:
            return "gradient compression"
        if any(p.dtype != torch.float32 for p in params):
            return "non-float32 parameters"
        for g in self.param_groups:
            if g.get("maximize") or g.get("amsgrad"):
                return "maximize/amsgrad"
        if isinstance(self, torch.optim.SGD):
            return None
        if isinstance(self, torch.optim.AdamW):
            return None
        if isinstance(self, torch.optim.Adam):
            if any(g.get("weight_decay", 0) for g in self.param_groups):
                return "Adam with L2 weight decay (use AdamW)"
            return None
        return f"{type(self).__mro__[1].__name__} is not one of SGD, Adam, AdamW"

    def _gh_server_name(self, p) -> str:
        return f"server_opt.{self._gh_names[id(p)]}"

    def _gh_send_server_config(self, p):
        """Tell the servers p's hyperparameters, if they changed (LR schedules)."""
        g = self._gh_group_of(p)
        if isinstance(self, torch.optim.SGD):
            cfg = ("sgd", float(g["lr"]), float(g.get("momentum", 0.0)), float(g.get("dampening", 0.0)),
                   float(g.get("weight_decay", 0.0)), bool(g.get("nesterov", False)), 0.9, 0.999, 1e-8)
        else:
            b1, b2 = g["betas"]
            cfg = ("adamw", float(g["lr"]), 0.0, 0.0, float(g.get("weight_decay", 0.0)), False, float(b1), float(b2),
                   float(g["eps"]))
        if self._gh_server_cfg.get(id(p)) == cfg:
            return
        kind, lr, mom, damp, wd, nest, b1, b2, eps = cfg
        _api._require().set_server_optimizer(self._gh_server_name(p), p.numel(), kind, lr, momentum=mom,
                                             dampening=damp, weight_decay=wd, nesterov=nest, beta1=b1, beta2=b2,
                                             eps=eps)
        self._gh_server_cfg[id(p)] = cfg

    def _gh_server_init(self, p):
        """Give the servers p's initial values (worker 0's), asynchronously."""
        if id(p) in self._gh_inited:
            return
        self._gh_inited.add(id(p))
        self._gh_send_server_config(p)
        buf = p.detach().float().contiguous().clone()
        c = _api._require()
        h = c.push_pull_async(buf.data_ptr(), buf.numel() * 4, "float32", self._gh_server_name(p), False,
                              self._gh_priority(p), buf, init=True)
        self._gh_init_handles[id(p)] = (h, buf)

    def _gh_server_init_wait(self, p):
        self._gh_server_init(p)
        pending = self._gh_init_handles.pop(id(p), None)
        if pending is not None:
            h, buf = pending
            h.wait()
            with torch.no_grad():
                p.copy_(buf.view_as(p))

    def _gh_server_start(self, p):
        """Push p's gradient; the round returns p's new value."""
        from .ops import Handle

        self._gh_server_init_wait(p)
        self._gh_send_server_config(p)
        buf = p.grad.detach().float().contiguous().clone()
        c = _api._require()
        h = c.push_pull_async(buf.data_ptr(), buf.numel() * 4, "float32", self._gh_server_name(p),
                              self._gh_op is Average, self._gh_priority(p), buf)

        def finish():
            with torch.no_grad():
                p.copy_(buf.view_as(p))
            return p

        self._gh_handles[id(p)] = Handle(h, finish, self._gh_server_name(p))

    # -------------------------------------------------------------- scheduling

    def _gh_priority(self, p) -> int:
        """Higher = sooner. Earlier in the forward pass = more urgent.
        (GRADHUB_SCHEDULING=fifo: all equal, i.e. in order of readiness.)"""
        if self._gh_fifo:
            return 0
        return len(self._gh_params) - self._gh_rank_of[id(p)]

    def _gh_module_params(self, module):
        """Parameters a module's forward uses directly: its own, and those of
        ParameterList/ParameterDict children (containers that are never called)."""
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

    def _gh_forward_pre_hook(self, module, inputs):
        own = self._gh_module_params(module)
        if not own:
            return
        if not self._gh_order_final:
            for p in own:
                self._gh_forward_seen.setdefault(id(p), len(self._gh_forward_seen))
        if self._gh_server:
            for p in own:
                self._gh_server_init(p)
        if self._gh_pending:
            for p in own:
                if id(p) in self._gh_pending:
                    self._gh_apply(p)

    def _gh_finalize_order(self):
        """After the first forward+backward: fix priorities to forward order
        (parameters never seen in forward keep their relative registration order, after the others)."""
        if self._gh_order_final or not self._gh_forward_seen:
            return
        seen = sorted(self._gh_forward_seen, key=self._gh_forward_seen.get)
        unseen = [id(p) for p in self._gh_params if id(p) not in self._gh_forward_seen]
        self._gh_rank_of = {pid: i for i, pid in enumerate(seen + unseen)}
        self._gh_order_final = True

    def _gh_make_hook(self, p):
        def hook(param):
            pid = id(param)
            if pid in self._gh_pending:
                raise RuntimeError(
                    f"gradient of '{self._gh_names[pid]}' was accumulated before its pending update was applied: "
                    f"with overlap_forward=True a parameter must be used inside the forward() of the module that "
                    f"owns it; use overlap_forward=False for this model"
                )
            if pid in self._gh_handles:
                raise RuntimeError(
                    f"gradient of '{self._gh_names[pid]}' was computed twice before step(); "
                    f"call optimizer.step() (or use backward_passes_per_step) between backward passes"
                )
            self._gh_counts[pid] += 1
            if self._gh_counts[pid] < self._gh_passes:
                return
            self._gh_counts[pid] = 0
            self._gh_start(param)

        return hook

    def _gh_start(self, p):
        grad = p.grad
        if grad is None:
            return
        if self._gh_server:
            return self._gh_server_start(p)
        name = f"allreduce.{self._gh_names[id(p)]}"
        self._gh_handles[id(p)] = _push_pull_async(grad, name, self._gh_op is Average, self._gh_priority(p),
                                                   self._gh_compression, grad)

    def synchronize(self):
        """Wait until every gradient of this step has been reduced."""
        self._gh_finalize_order()
        # Only gradients whose hook fired are reduced: every worker must
        # produce the same set of gradients each step (as with Horovod).
        for pid, h in list(self._gh_handles.items()):
            h.wait()
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

    # -------------------------------------------------------------- updates

    def _gh_sub_optimizer(self, p, hyper: dict):
        """An optimizer of the same class over one parameter, sharing state with
        this one, so parameters can be updated one at a time (overlap mode).
        `hyper`: the group's hyperparameters as they were at step()."""
        sub = self._gh_sub.get(id(p))
        if sub is None:
            group = self._gh_group_of(p)
            base = type(self).__mro__[1]
            hyper = {k: v for k, v in group.items() if k != "params"}
            sub = base([p], **{k: v for k, v in hyper.items() if k in base.__init__.__code__.co_varnames})
            sub.state = self.state  # shared: keyed by parameter
            self._gh_sub[id(p)] = sub
        sub.param_groups[0].update(hyper)
        return sub

    def _gh_apply(self, p):
        """Overlap mode: wait for p's reduced gradient and update p alone."""
        h = self._gh_handles.pop(id(p), None)
        if h is not None:
            h.wait()
        hyper = self._gh_pending.pop(id(p), None)
        if not self._gh_server:  # server mode: the handle copied the new value in
            if hyper is None:
                hyper = {k: v for k, v in self._gh_group_of(p).items() if k != "params"}
            with torch.no_grad():
                self._gh_sub_optimizer(p, hyper).step()
        if id(p) in self._gh_zero_after:
            self._gh_zero_after.discard(id(p))
            p.grad = None

    def _gh_apply_all(self):
        for pid in list(self._gh_pending):
            self._gh_apply(self._gh_by_id[pid])

    def step(self, closure=None):
        if self._gh_overlap and closure is None and not self._gh_skip_sync:
            # Previous step's stragglers (parameters unused in forward) first.
            self._gh_apply_all()
            self._gh_finalize_order()
            if any(c != 0 for c in self._gh_counts.values()) and not self._gh_handles:
                return None  # accumulating (backward_passes_per_step)
            for pid in list(self._gh_handles):
                # Snapshot the hyperparameters: an LR scheduler may step before the update runs.
                group = self._gh_group_of(self._gh_by_id[pid])
                self._gh_pending[pid] = {k: v for k, v in group.items() if k != "params"}
            return None
        if not self._gh_skip_sync:
            self._gh_apply_all()
            if not self._gh_synchronized:
                self.synchronize()
        self._gh_synchronized = False
        if self._gh_server:
            # The servers ran the update; synchronize() copied the new values in.
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            return loss
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True):
        if self._gh_handles and not self._gh_overlap:
            raise RuntimeError("zero_grad() called while gradients are still being reduced; "
                               "call step() or synchronize() first")
        if self._gh_overlap and self._gh_pending:
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
        return super(self.__class__, self).zero_grad(set_to_none)

    def finish(self):
        """Apply every pending update now (overlap mode), e.g. before evaluation or saving."""
        self._gh_apply_all()

    def state_dict(self):
        self._gh_apply_all()
        return super(self.__class__, self).state_dict()

    def remove_hooks(self):
        for h in self._gh_hooks:
            h.remove()
        self._gh_fwd_hook.remove()
        self._gh_hooks = []


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Iterable | None = None,
                         compression=Compression.none, backward_passes_per_step: int = 1, op=Average,
                         overlap_forward: bool | None = None, optimizer_on_server: bool | None = None):
    """Wrap any torch.optim.Optimizer so gradients are reduced across workers.

    Same signature as Horovod's, plus two scheduling options:
    `overlap_forward=True` lets the next forward pass start before every
    gradient has arrived (SGD, Adam, AdamW); `optimizer_on_server=True` runs
    the update on the summation servers (SGD, AdamW; float32). Left unset,
    they come from GRADHUB_OVERLAP_FORWARD / GRADHUB_OPTIMIZER_ON_SERVER, so an
    unchanged Horovod script can use them; GRADHUB_SCHEDULING=fifo turns the
    forward-order priorities off (for comparisons)."""
    if overlap_forward is None:
        overlap_forward = _env_flag("GRADHUB_OVERLAP_FORWARD")
    if optimizer_on_server is None:
        optimizer_on_server = _env_flag("GRADHUB_OPTIMIZER_ON_SERVER")
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    opt = cls.__new__(cls)
    # Re-create with the same param_groups (hyperparameters included) and defaults.
    opt.defaults = optimizer.defaults
    cls.__init__(opt, optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
                 overlap_forward, optimizer_on_server)
    opt.defaults = optimizer.defaults
    if optimizer.state:
        opt.load_state_dict(optimizer.state_dict())
    return opt
