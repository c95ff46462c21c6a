"""PyTorch Lightning's DDP with gradhub as its torch.distributed backend:
the only gradhub-specific lines are the import that registers the backend
and `DDPStrategy(process_group_backend="gradhub")`.

    python -m torch.distributed.run --nproc-per-node 2 examples/lightning_ddp.py
    gradhub launch -w 2 -s 1 -- python examples/lightning_ddp.py

Under torchrun Lightning reads torchrun's variables (its TorchElastic
environment) and the group forms a gradhub job of its own from torch's
store; under `gradhub launch` Lightning's default environment reads the
MASTER_ADDR/MASTER_PORT and LOCAL_RANK the launcher exports, and the group
joins the launcher's job. `devices` is the number of workers on each host
(LOCAL_WORLD_SIZE, which both export) and `num_nodes` the hosts; across
hosts (`gradhub launch -H a:2,b:2`) Lightning takes each worker's node from
NODE_RANK, which both export too.

A small regression on synthetic data made here. At the end every rank
checks that all ranks hold bit-identical parameters (gathered through the
process group), that they equal one process training on the combined
batches, and that the loss fell, then prints `PASS rank <r>`.
"""

import argparse
import os

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import disable_possible_user_warnings
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import gradhub.torch  # noqa: F401  registers the "gradhub" torch.distributed backend

# Lightning's advice for speed ("does not have many workers", ...) is noise for a model this small.
disable_possible_user_warnings()

GLOBAL_BATCH = 16   # split evenly over the workers
FEATURES = 16


def dataset(steps: int) -> TensorDataset:
    """y = x @ w + noise, exactly `steps` global batches."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(GLOBAL_BATCH * steps, FEATURES, generator=g)
    w = torch.randn(FEATURES, 1, generator=g)
    return TensorDataset(x, x @ w + 0.01 * torch.randn(len(x), 1, generator=g))


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 1))


class Regression(pl.LightningModule):
    def __init__(self, steps: int, lr: float):
        super().__init__()
        self.net, self.steps, self.lr = make_net(), steps, lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        # Lightning replaces the sampler with a shuffling DistributedSampler (seed 0).
        return DataLoader(dataset(self.steps), batch_size=GLOBAL_BATCH // self.trainer.world_size)


def one_process(steps: int, lr: float) -> nn.Module:
    """The same training in one process on the global batches: the shuffle
    Lightning's sampler makes, on one replica (rank r of n gets positions
    r, r + n, ... of the permutation, so one step's batches together are
    the permutation's next GLOBAL_BATCH samples)."""
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    ds = dataset(steps)
    for x, y in DataLoader(ds, batch_size=GLOBAL_BATCH, sampler=DistributedSampler(ds, num_replicas=1, rank=0)):
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        opt.step()
    return net


def full_loss(net: nn.Module, steps: int) -> float:
    x, y = dataset(steps).tensors
    with torch.no_grad():
        return F.mse_loss(net(x), y).item()


def main():
    p = argparse.ArgumentParser(description="Lightning DDP on the gradhub backend")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.05)
    args = p.parse_args()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    nodes = int(os.environ.get("WORLD_SIZE", local)) // local

    model = Regression(args.steps, args.lr)
    trainer = pl.Trainer(accelerator="cpu", devices=local, num_nodes=nodes,
                         strategy=DDPStrategy(process_group_backend="gradhub"), max_steps=args.steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, log_every_n_steps=1)
    trainer.fit(model)

    # The checks, through the group Lightning made (still up after fit).
    r, n = dist.get_rank(), dist.get_world_size()
    assert dist.get_backend() == "gradhub", dist.get_backend()
    assert trainer.global_step == args.steps, trainer.global_step
    flat = nn.utils.parameters_to_vector(model.net.parameters()).detach()
    every = [torch.empty_like(flat) for _ in range(n)]
    dist.all_gather(every, flat)
    assert all(torch.equal(e, every[0]) for e in every), "ranks disagree on the parameters"
    ref = nn.utils.parameters_to_vector(one_process(args.steps, args.lr).parameters()).detach()
    torch.testing.assert_close(flat, ref, rtol=1e-4, atol=1e-5)
    before, after = full_loss(make_net(), args.steps), full_loss(model.net, args.steps)
    assert after < 0.5 * before, (before, after)
    dist.destroy_process_group()
    print(f"PASS rank {r}/{n}: Lightning DDP on gradhub, {args.steps} steps; parameters identical on every rank "
          f"and equal to one process; loss {before:.3f} -> {after:.3f}", flush=True)


if __name__ == "__main__":
    main()
