"""DistributedOptimizer(optimizer_on_server=True) (PHub): `OnServers`, the
place of the update in the optimizer's strategy (modes.py). The servers keep the
parameters and optimizer state and run the update fused per chunk; a round
returns new parameters, which are copied into the model. SGD (momentum,
dampening, Nesterov, weight decay) and AdamW (and Adam without weight decay),
float32 parameters.

Protocol per parameter p (float32 tensor `server_opt.<name>`, declared with the
others when the optimizer is built):
- before p's first round: its group's hyperparameters (`set_server_optimizer`)
  and its initial values (an `init` round: worker 0's values are kept and
  returned), sent just before the first forward pass that uses p;
- each step: p's gradient is pushed, the round returns p's new value.
A group's hyperparameters are read once per step; when they changed (an LR
schedule), each of its parameters gets the new config before its next round.
"""

from __future__ import annotations

import torch

from .. import api as _api
from .compression import Compression
from .modes import OnWorkers
from .ops import Average, Handle


def server_unsupported(optimizer: torch.optim.Optimizer, compression) -> str | None:
    """Why `optimizer` cannot run on the servers, or None if it can."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if compression is not Compression.none:
        return "gradient compression"
    if any(p.dtype != torch.float32 for p in params):
        return "non-float32 parameters"
    for g in optimizer.param_groups:
        if g.get("maximize") or g.get("amsgrad"):
            return "maximize/amsgrad"
    if isinstance(optimizer, (torch.optim.SGD, torch.optim.AdamW)):
        return None
    if isinstance(optimizer, torch.optim.Adam):
        if any(g.get("weight_decay", 0) for g in optimizer.param_groups):
            return "Adam with L2 weight decay (use AdamW)"
        return None
    return f"{type(optimizer).__name__} is not one of SGD, Adam, AdamW"


class OnServers(OnWorkers):
    """Updates run on the servers (see the module's doc)."""

    on_server = True

    def __init__(self, opt):
        super().__init__(opt)
        self.inited: set[int] = set()
        self.init_handles: dict[int, tuple] = {}
        self.steps = 0                          # step() calls: group configs are read once per step
        self.group_cfg: dict[int, list] = {}    # group index -> [step read, config, version]
        self.cfg_sent: dict[int, int] = {}      # param id -> config version sent

    def push_name(self, p, tagged: bool = True) -> str:
        return f"server_opt.{self.opt._gh_names[id(p)]}"

    def declarations(self) -> list:
        # Every parameter: each one is initialized on the servers, also those
        # without gradients. Registration order approximates the first forward
        # pass, where the tensors used to be declared on first use.
        return [(self.push_name(p), (p.numel(), "float32")) for p in self.opt._gh_params]

    # -------------------------------------------------------------- configuration

    def _config(self, g: dict) -> tuple:
        if isinstance(self.opt, torch.optim.SGD):
            return ("sgd", float(g["lr"]), float(g.get("momentum", 0.0)), float(g.get("dampening", 0.0)),
                    float(g.get("weight_decay", 0.0)), bool(g.get("nesterov", False)), 0.9, 0.999, 1e-8)
        b1, b2 = g["betas"]
        return ("adamw", float(g["lr"]), 0.0, 0.0, float(g.get("weight_decay", 0.0)), False, float(b1), float(b2),
                float(g["eps"]))

    def _send_config(self, p):
        """Tell the servers p's hyperparameters, if its group's changed since
        they were last sent for p (LR schedules)."""
        gi = self.opt._gh_group_idx[id(p)]
        st = self.group_cfg.get(gi)
        if st is None or st[0] != self.steps:
            cfg = self._config(self.opt.param_groups[gi])
            if st is None:
                st = self.group_cfg[gi] = [self.steps, cfg, 0]
            elif cfg != st[1]:
                st[1], st[2] = cfg, st[2] + 1
            st[0] = self.steps
        _, cfg, version = st
        if self.cfg_sent.get(id(p)) == version:
            return
        kind, lr, mom, damp, wd, nest, b1, b2, eps = cfg
        _api.set_server_optimizer(self.push_name(p), p.numel(), kind, lr, momentum=mom, dampening=damp,
                                  weight_decay=wd, nesterov=nest, beta1=b1, beta2=b2, eps=eps)
        self.cfg_sent[id(p)] = version

    # -------------------------------------------------------------- initial values

    def _init(self, p):
        """Give the servers p's initial values (worker 0's), asynchronously."""
        if id(p) in self.inited:
            return
        self.inited.add(id(p))
        self._send_config(p)
        buf = p.detach().float().contiguous().clone()
        h = _api.push_pull_async(buf, name=self.push_name(p), average=False, priority=self.opt._gh_priority(p),
                                 init=True)
        self.init_handles[id(p)] = (h, buf)

    def _init_wait(self, p):
        self._init(p)
        pending = self.init_handles.pop(id(p), None)
        if pending is not None:
            h, buf = pending
            h.wait()
            with torch.no_grad():
                p.copy_(buf.view_as(p))

    # -------------------------------------------------------------- the strategy's points

    def before_forward(self, own: list) -> None:
        for p in own:
            self._init(p)

    def before_step(self) -> None:
        self.steps += 1

    def push(self, p, grad):
        """Push p's gradient; the round returns p's new value."""
        self._init_wait(p)
        self._send_config(p)
        buf = grad.detach().float().contiguous().clone()
        name = self.push_name(p)
        h = _api.push_pull_async(buf, name=name, average=self.opt._gh_op is Average,
                                 priority=self.opt._gh_priority(p))

        def finish():
            with torch.no_grad():
                p.copy_(buf.view_as(p))
            return p

        return Handle(h, finish, name)

    def eager(self, closure):
        """No eager update: the servers run the updates (synchronize() copies the new values in)."""
        return None

    def update(self, closure):
        # The servers ran the update; synchronize() copied the new values in.
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        return loss

    def update_some(self, params: list, hyper: dict | None) -> None:
        """Forward overlap: the servers ran the updates; the handles copied the new values in."""
