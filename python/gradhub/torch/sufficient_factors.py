"""Poseidon's sufficient-factor broadcasting (SFB) for `nn.Linear` weights.

The weight gradient of a fully-connected layer over a batch of K rows is
G^T X, with G (K x M) the gradient at the layer's output and X (K x N) its
input. When the workers' rows times (M + N) is less than M x N, exchanging
the factors moves fewer bytes than the gradient: every worker gathers every
worker's [G | X] (an allgather through the servers) and rebuilds the
averaged gradient locally with one matmul. The bias and every other
parameter go through the servers as before.

The choice per layer (Poseidon's BestScheme, restated for how gradhub moves
bytes): each worker's link carries M x N values each way for the servers'
sum, and (total rows of all workers) x (M + N) each way for the factors'
allgather (built on sums, so every worker receives every row). Factors win
when the second is smaller. `GRADHUB_SFB` (or `DistributedOptimizer(
sufficient_factors=)`): auto (that rule), force (every layer where factors
are exact), off.

How, step by step:
- Module hooks note each call's input and output gradient for every
  `nn.Linear` whose weight the optimizer holds (several calls per forward,
  and several backward passes per step, add rows): a global hook until the
  decision, then hooks on the layers that may use factors only.
- The first step goes through the servers for every layer; meanwhile each
  worker checks that the weight's gradient equals the sum of its factors (it
  does not when the weight is also used elsewhere: tied, a functional call,
  a gradient hook). Then one collective decision: a layer is exchanged as
  factors only if every worker saw it and found it exact, and the rule
  picks it (worker 0 says which, once; each layer's choice and the bytes
  predicted at GRADHUB_LOG=debug).
  A layer left to the servers by the check is reported once.
- Later steps: autograd does not compute the weight's own gradient (its
  requires_grad is off during the layer's call, when the output needs a
  gradient anyway: the factors replace it). The exchange starts as soon as
  the layer's output gradients of the pass are in: one round through the
  servers at the weight's priority, each worker's rows in a slot of fixed
  capacity headed by its row count (a worker with more rows makes every
  worker fall back, that step, to the general allgather, and the capacity
  grows). When waited for, the handle writes the rebuilt average into
  `.grad` with one matmul (added to whatever `.grad` held before the step,
  as the servers' sum would; into a buffer kept from step to step when
  `.grad` is None, so no step allocates and faults in a new gradient).
The decision is made with the first step's batch size, and made again when
the batch changes: every exchange shows every worker's rows, so a layer
whose batch grows past the rule goes back to the servers from the next step
(on every worker at once); and every `RECHECK_STEPS` steps one small
collective sums the last step's rows of the layers on the servers that
could take factors (exact on every worker), so one whose batch shrank
below the rule takes factors again from the next step.
"""

from __future__ import annotations

import sys
import time
import warnings

import torch

from .. import _env

from .ops import Average, Handle, _allgather_impl, _derive
from .sums import start_sum


_HALF = (torch.float16, torch.bfloat16)
# Steps between two looks at whether a layer on the servers should take factors.
RECHECK_STEPS = 10


class _Layer:
    """One weight's factors since its last exchange."""

    __slots__ = ("out_features", "in_features", "xs", "gs", "skips", "local", "prev", "pass_start", "out")

    def __init__(self, weight: torch.Tensor):
        self.out_features, self.in_features = weight.shape
        self.xs: list[torch.Tensor] = []
        self.gs: list[list] = []  # one slot per call, filled by the output's gradient hook
        self.skips: list[bool] = []  # per call: autograd left the weight's own gradient out
        # A call since the last exchange let autograd add its local gradient
        # to .grad; prev is .grad from before that call.
        self.local = False
        self.prev = None
        self.pass_start = 0  # the first call of the current backward pass
        self.out = None  # the rebuilt gradient's buffer when .grad is None, kept across steps

    def pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        # A call whose output got no gradient contributed nothing. Under
        # autocast the layer multiplied its input in the output's 16-bit
        # type: so do the factors.
        return [(g[0], x.to(g[0].dtype) if g[0].dtype in _HALF else x)
                for x, g in zip(self.xs, self.gs) if g[0] is not None]

    def pass_done(self) -> bool:
        """Every call of the current pass has its output's gradient, and
        none let autograd compute the weight's gradient (then the weight's
        own hook says when the pass is done)."""
        calls = range(self.pass_start, len(self.gs))
        return all(self.gs[i][0] is not None for i in calls) and all(self.skips[i] for i in calls)

    def clear(self) -> None:
        self.xs, self.gs, self.skips, self.local, self.prev, self.pass_start = [], [], [], False, None, 0


class SufficientFactors:
    """A DistributedOptimizer's sufficient factors (see the module's doc)."""

    def __init__(self, opt, mode: str):
        self.opt = opt
        self.force = mode == "force"
        self.layers: dict[int, _Layer] = {}
        self.chosen: set[int] = set()
        self.decided = False
        self.inexact: set[int] = set()
        self.rows: dict[int, int] = {}
        # Layers exact on every worker, with (out, in) features; this step's
        # rows of those on the servers; steps since the decision.
        self.eligible: dict[int, tuple[int, int]] = {}
        self.rows_now: dict[int, int] = {}
        self.steps = 0
        # Each chosen weight's slot capacity (rows a worker) in the one-round exchange.
        self.capacity: dict[int, int] = {}
        self.rebuild_seconds = 0.0  # worker CPU time spent rebuilding gradients from factors
        # Every module's call until the decision (the Linear layers are
        # found there); then only the hooks of the layers that can use factors.
        self.hook = torch.nn.modules.module.register_module_forward_hook(self._after_forward)
        self.seen: dict[int, torch.nn.Linear] = {}  # weight id -> its layer, in the first step
        self.module_hooks: list = []
        self.skipping: dict[int, torch.Tensor] = {}  # weights whose requires_grad is off during their call
        self.skipped_calls = 0  # calls whose weight gradient autograd left to the factors

    def remove(self) -> None:
        if self.hook is not None:
            self.hook.remove()
            self.hook = None
        for h in self.module_hooks:
            h.remove()
        self.module_hooks = []
        for w in self.skipping.values():
            w.requires_grad_(True)
        self.skipping.clear()

    def exchanges(self, p) -> bool:
        """Whether p's factors travel instead of its gradient this step."""
        return self.decided and id(p) in self.chosen

    def _narrow_hooks(self) -> None:
        """After the decision: hook only the layers that are eligible (their
        rows are counted, see `_maybe_take`) or use factors, not every module
        call of every step."""
        if self.hook is None:
            return
        self.hook.remove()
        self.hook = None
        for pid, module in self.seen.items():
            if pid in self.eligible or pid in self.chosen:
                self.module_hooks.append(module.register_forward_pre_hook(self._before_forward))
                # always_call: a call that raises still gets its weight's requires_grad back.
                self.module_hooks.append(module.register_forward_hook(self._after_forward, always_call=True))
        self.seen.clear()

    def _before_forward(self, module, inputs):
        """A chosen layer whose output needs a gradient without its weight
        (its input or its bias needs one): autograd leaves the weight's own
        gradient out of this call, since the factors rebuild the whole of it."""
        w = module.weight
        if id(w) not in self.chosen or not torch.is_grad_enabled() or not w.requires_grad or not inputs:
            return
        x, b = inputs[0], module.bias
        if isinstance(x, torch.Tensor) and (x.requires_grad or (b is not None and b.requires_grad)):
            w.requires_grad_(False)
            self.skipping[id(w)] = w
            self.skipped_calls += 1

    def _after_forward(self, module, inputs, output):
        if not isinstance(module, torch.nn.Linear):
            return
        w = module.weight
        skipped = self.skipping.pop(id(w), None) is not None
        if skipped:
            w.requires_grad_(True)
        if not inputs or not torch.is_grad_enabled():
            return
        fused = self.opt._gh_fusion is not None and id(w) in self.opt._gh_fusion.of
        if id(w) not in self.opt._gh_by_id or not w.requires_grad or fused:
            return
        if not self.decided:
            self.seen[id(w)] = module
        if self.decided and id(w) not in self.chosen:
            if id(w) in self.eligible and isinstance(inputs[0], torch.Tensor):  # only counted (see `_maybe_take`)
                self.rows_now[id(w)] = self.rows_now.get(id(w), 0) + inputs[0].numel() // w.shape[1]
            return
        x = inputs[0]
        if not isinstance(output, torch.Tensor) or not output.requires_grad or not isinstance(x, torch.Tensor):
            return
        layer = self.layers.get(id(w))
        if layer is None:
            layer = self.layers[id(w)] = _Layer(w)
        if layer.pass_start < len(layer.gs) and all(s[0] is not None for s in layer.gs[layer.pass_start:]):
            layer.pass_start = len(layer.gs)  # the last pass's backward is over: a new pass
        if not skipped and not layer.local:
            layer.local = True
            layer.prev = None if w.grad is None else w.grad.detach().clone()
        slot = [None]
        layer.xs.append(x.detach().reshape(-1, layer.in_features))
        layer.gs.append(slot)
        layer.skips.append(skipped)
        m = layer.out_features

        def keep(g, slot=slot):
            slot[0] = g.detach().reshape(-1, m)
            # The weight gets no gradient of its own: its pass is done when
            # the last output gradient of the pass is in.
            if skipped and layer.pass_done():
                self.opt._gh_ready(w)

        output.register_hook(keep)

    def observe(self, p) -> None:
        """Before the decision, p's gradient has just been accumulated: check it."""
        layer = self.layers.get(id(p))
        if not self.decided and layer is not None:
            self._check(p, layer)

    def start(self, p, priority: int) -> Handle:
        """The handle exchanging p's factors (p is `exchanges`): one round,
        each worker's rows in a slot of `capacity` rows headed by its count
        plus one (0: a worker in join(), which pushes zeros and so takes
        part with no rows, as Horovod's joined workers give zero gradients)."""
        layer = self.layers[id(p)]
        m, n = layer.out_features, layer.in_features
        pairs = layer.pairs()
        # Exchanged and multiplied in float32, or float64 for a float64 weight (never narrower than it).
        wide = torch.promote_types(p.dtype, torch.float32)
        factors = (torch.cat([torch.cat([g.to(wide), x.to(wide)], 1) for g, x in pairs]) if pairs
                   else torch.zeros(0, m + n, dtype=wide))
        local, prev = layer.local, layer.prev
        layer.clear()
        opt, ps = self.opt, self.opt._gh_ps
        name = f"{opt._gh_push_name(p, tagged=False)}.sfb"
        size, rank = ps.size(), ps.rank()
        cap = self.capacity[id(p)]
        rows = factors.shape[0]
        slot = 1 + cap * (m + n)
        buf = torch.zeros(size * slot, dtype=wide)
        buf[rank * slot] = rows + 1 if rows <= cap else -1.0  # -1: more rows than the slot holds
        if rows <= cap:
            buf[rank * slot + 1:rank * slot + 1 + rows * (m + n)] = factors.reshape(-1)
        h = start_sum(buf, name, ps, priority=priority, live=(rank * slot, (rank + 1) * slot))
        divisor = ps.size() if opt._gh_op is Average else 1

        def rebuild():
            slots = buf.view(size, slot)
            heads = slots[:, 0]
            if bool((heads < 0).any()):
                # A worker had more rows than the slot holds: every worker
                # gathers this step's factors in full, and the slots grow.
                f, counts = _allgather_impl(factors, _derive(name, ".grow"), ps, priority)
                self.capacity[id(p)] = max(counts)
                if ps.rank() == 0 and _env.get("GRADHUB_LOG") in ("debug", "trace"):
                    print(f"[gradhub worker] sufficient factors: '{opt._gh_names[id(p)]}' gathered in full this "
                          f"step; its slots grow from {cap} to {max(counts)} rows a worker", file=sys.stderr,
                          flush=True)
                total = sum(counts)
            else:
                f = slots[:, 1:].reshape(size * cap, m + n)  # rows past a worker's count are zeros
                # A worker in join() pushed zeros: a head of 0, no rows (its
                # gradient is zeros, as any joined worker's).
                total = int((heads - 1).clamp_min(0).sum())
            self._recheck(p, total, m, n)
            t0 = time.perf_counter()
            self._rebuild(p, layer, f, m, divisor, local, prev)
            self.rebuild_seconds += time.perf_counter() - t0
            return p.grad

        handle = Handle(h, rebuild, name)
        handle.ordered = True  # rebuild() may gather in full: waited in the same order on every worker
        return handle

    @staticmethod
    def _rebuild(p, layer: _Layer, f: torch.Tensor, m: int, divisor: int, local: bool, prev) -> None:
        """p.grad = (.grad before the step) + the sum of every worker's
        factors (divided for an average), with one matmul into place."""
        g, x = f[:, :m], f[:, m:]
        if divisor != 1:
            g = g / divisor  # rows x m: cheaper than dividing the m x n product
        g = g.t()
        # A call let autograd add the local gradient: start again from prev.
        base = prev if local else p.grad
        if base is None:
            if p.dtype != f.dtype:
                p.grad = torch.mm(g, x).to(p.dtype)
                return
            if layer.out is None or layer.out.shape != (m, x.shape[1]):
                layer.out = torch.empty(m, x.shape[1], dtype=f.dtype)
            p.grad = torch.mm(g, x, out=layer.out)
        elif base is p.grad and p.grad.dtype == f.dtype:
            p.grad.addmm_(g, x)
        else:
            p.grad.copy_(base.to(f.dtype).addmm(g, x))

    def _recheck(self, p, rows: int, m: int, n: int) -> None:
        """Every worker sees every worker's rows in each exchange: when the
        batch grew so much that the gradient costs less than its factors,
        `auto` moves the layer back to the servers from the next step, on
        every worker at once."""
        if self.force or rows * (m + n) < m * n or id(p) not in self.chosen:
            return
        self.chosen.discard(id(p))
        self.layers.pop(id(p), None)
        if self.opt._gh_ps.rank() == 0:
            print(f"[gradhub worker] sufficient factors: '{self.opt._gh_names[id(p)]}' goes back to the servers: "
                  f"{rows} rows over the workers x ({m} + {n}) >= {m} x {n}", file=sys.stderr, flush=True)

    def _check(self, p, layer: _Layer) -> None:
        """First step: is p's gradient the sum of its factors here?"""
        pairs = layer.pairs()
        wide = torch.promote_types(p.dtype, torch.float32)
        got = p.grad.detach().to(wide)
        if layer.prev is not None:
            got = got - layer.prev.to(wide)
        local = sum((g.to(wide).t() @ x.to(wide) for g, x in pairs), torch.zeros_like(got))
        # 16-bit factors: autograd summed them in 16 bits, this in float32.
        tol = 3e-2 if any(g.dtype in _HALF for g, _ in pairs) else 1e-3
        if not torch.allclose(local, got, rtol=tol, atol=tol * 1e-2 * (1.0 + float(got.abs().max()))):
            self.inexact.add(id(p))
        self.rows[id(p)] = sum(x.shape[0] for _, x in pairs)
        layer.clear()

    def decide(self) -> None:
        """After the first step, on every worker at the same point: choose
        the layers exchanged as factors (one small collective)."""
        if self.decided:
            self._maybe_take()
            return
        self.decided = True
        opt = self.opt
        ps = opt._gh_ps
        params = [p for p in opt._gh_params if p.requires_grad]
        # Per parameter: a veto (not a factor candidate here), and this worker's rows.
        votes = torch.zeros(2 * len(params), dtype=torch.int64)
        for i, p in enumerate(params):
            votes[2 * i] = 0 if id(p) in self.rows and id(p) not in self.inexact else 1
            votes[2 * i + 1] = self.rows.get(id(p), 0)
        start_sum(votes, ps._name(None, "sfb.decide"), ps).wait()
        why: list[str] = []  # each layer's choice and its bytes: at debug only
        for i, p in enumerate(params):
            layer = self.layers.get(id(p))
            if layer is None:
                continue
            name = opt._gh_names[id(p)]
            if int(votes[2 * i]) != 0:
                if id(p) in self.rows:
                    warnings.warn(f"sufficient factors: '{name}' goes through the servers: its gradient is not the "
                                  f"sum of its layer's factors on every worker (a tied weight, a functional use or "
                                  f"a gradient hook)", stacklevel=3)
                continue
            m, n = layer.out_features, layer.in_features
            self.eligible[id(p)] = (m, n)
            rows = int(votes[2 * i + 1])
            factor_values, server_values = rows * (m + n), m * n
            use = self.force or factor_values < server_values
            why.append(f"sufficient factors: '{name}' ({m} x {n}, {rows} rows over the workers): "
                       f"{'factors' if use else 'servers'}{' (forced)' if self.force and use else ''}; per worker "
                       f"and step each way, factors {factor_values * 4 / 1024:.1f} KiB vs servers "
                       f"{server_values * p.element_size() / 1024:.1f} KiB")
            if use:
                self.chosen.add(id(p))
                self.capacity[id(p)] = -(-rows // ps.size())  # equal batches fill their slots exactly
        if ps.rank() == 0:  # the choice is the same everywhere: said once
            self._say(why, [opt._gh_names[pid] for pid in self.eligible if pid in self.chosen])
        for pid in list(self.layers):
            if pid not in self.chosen:
                del self.layers[pid]
        self._narrow_hooks()

    def _say(self, why: list[str], chosen: list[str]) -> None:
        """The decision, once, in words; layer by layer at GRADHUB_LOG=debug."""
        if _env.get("GRADHUB_LOG") in ("debug", "trace"):
            for line in why:
                print(f"[gradhub worker] {line}", file=sys.stderr, flush=True)
        if chosen:
            rest = len(self.eligible) - len(chosen)
            print(f"[gradhub worker] sufficient factors{' (forced)' if self.force else ''}: "
                  f"{', '.join(chosen)} travel as the layer's inputs and output gradients, which is fewer bytes "
                  f"than the gradient itself" + (f"; {rest} other nn.Linear weight(s) through the servers" if rest
                                                 else "") + " (GRADHUB_LOG=debug: layer by layer)",
                  file=sys.stderr, flush=True)

    def _maybe_take(self) -> None:
        """At the end of every step, on every worker alike: every
        RECHECK_STEPS steps, sum the last step's rows of the layers on the
        servers that could take factors, and move those the rule now picks
        to factors from the next step."""
        self.steps += 1
        waiting = [pid for pid in self.eligible if pid not in self.chosen]
        if self.force or self.steps % RECHECK_STEPS or not waiting:
            self.rows_now.clear()
            return
        ps = self.opt._gh_ps
        rows = torch.tensor([self.rows_now.get(pid, 0) for pid in waiting], dtype=torch.int64)
        self.rows_now.clear()
        start_sum(rows, ps._name(None, "sfb.recheck"), ps).wait()
        for pid, r in zip(waiting, rows.tolist()):
            m, n = self.eligible[pid]
            if r == 0 or r * (m + n) >= m * n:
                continue
            self.chosen.add(pid)
            self.capacity[pid] = -(-r // ps.size())
            self.layers[pid] = _Layer(self.opt._gh_by_id[pid])
            if ps.rank() == 0:
                print(f"[gradhub worker] sufficient factors: '{self.opt._gh_names[pid]}' takes factors again: "
                      f"{r} rows over the workers x ({m} + {n}) < {m} x {n}", file=sys.stderr, flush=True)
