"""The elastic training loop that the elastic fault campaign's workers
(`gradhub_lab.elastic_faults`) and the tests' elastic worker
(tests/workers/elastic_train.py) both run, and its check.

A small model trained with `hvd.elastic.run`, committing every step. Each
step's batch is a function of the step alone, split by rank over the
current size, so whatever the membership did, every survivor must end with
the parameters of one process trained on the full batches (`Problem.check`),
and all survivors with the same ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

import gradhub.torch as hvd


@dataclass(frozen=True)
class Problem:
    seed: int  # the initial parameters, and with the step each batch
    inputs: int
    hidden: int
    outputs: int
    rows: int  # per step: divisible by every size the job goes through
    lr: float
    momentum: float = 0.9

    def model(self) -> torch.nn.Module:
        torch.manual_seed(self.seed)
        return torch.nn.Sequential(torch.nn.Linear(self.inputs, self.hidden), torch.nn.Tanh(),
                                   torch.nn.Linear(self.hidden, self.outputs))

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1000 + step)
        return torch.randn(self.rows, self.inputs, generator=g), torch.randn(self.rows, self.outputs, generator=g)

    def optimizer(self, params) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum)

    def check(self, model: torch.nn.Module, steps: int) -> tuple[float, torch.Tensor]:
        """The largest difference from one process trained on the full
        batches of `steps` steps, and the model's parameters, flat."""
        ref = self.model()
        opt = self.optimizer(ref.parameters())
        for s in range(steps):
            x, y = self.batch(s)
            opt.zero_grad()
            torch.nn.functional.mse_loss(ref(x), y).backward()
            opt.step()
        worst = max(float((a - b).detach().abs().max()) for a, b in zip(model.parameters(), ref.parameters()))
        return worst, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@dataclass
class Trained:
    model: torch.nn.Module
    steps: int  # committed
    resets: list[int] = field(default_factory=list)  # the size after each reset
    generation_steps: int = 0  # committed since the last reset (a newcomer's: since it joined)


def train(problem: Problem, done: Callable[[hvd.elastic.TorchState, Trained], bool], *,
          sufficient_factors: str = "off", mid_step: Callable[[int], None] | None = None,
          after_commit: Callable[[int], None] | None = None, **user_state) -> Trained:
    """Join the job (`hvd.init`) and train until `done(state, trained)`, the
    same on every worker (`state.step`, and the caller's `user_state`, kept
    in the elastic state: committed and synced with it); `mid_step(step)`
    runs after the backward pass (a worker can die there, its gradients
    never arriving), `after_commit(step)` after each commit (prints, sleeps)."""
    torch.set_num_threads(1)
    hvd.init()
    out = Trained(problem.model(), 0)
    opt = hvd.DistributedOptimizer(problem.optimizer(out.model.parameters()),
                                   named_parameters=out.model.named_parameters(),
                                   sufficient_factors=sufficient_factors)
    state = hvd.elastic.TorchState(model=out.model, optimizer=opt, step=0, **user_state)

    def on_reset():
        out.resets.append(hvd.size())
        out.generation_steps = 0

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def loop(st):
        while not done(st, out):
            x, y = problem.batch(st.step)
            rows = slice(hvd.rank(), None, hvd.size())
            opt.zero_grad()
            torch.nn.functional.mse_loss(out.model(x[rows]), y[rows]).backward()
            if mid_step is not None:
                mid_step(st.step)
            opt.step()
            st.step += 1
            out.generation_steps += 1
            st.commit()
            if after_commit is not None:
                after_commit(st.step)
        return st.step

    out.steps = loop(state)
    return out
