"""Hugging Face Accelerate with gradhub as its torch.distributed backend.

    python -m torch.distributed.run --nproc-per-node 2 examples/accelerate_train.py
    gradhub launch -w 2 -s 1 -- python examples/accelerate_train.py

Accelerate on CPUs (`Accelerator(cpu=True)`) picks gloo and refuses any
other backend it is given (`InitProcessGroupKwargs(backend=...)`), but it
keeps a process group that already exists: so the script creates it first,
`dist.init_process_group("gradhub")` with no arguments (torch's env://
rendezvous on what torchrun or `gradhub launch` exports), and Accelerate's
DDP, data sharding, gather and barriers then run on gradhub. (Its state
still names gloo as the backend; `dist.get_backend()` says gradhub.)

A small regression on synthetic data made here. At the end every rank
checks that all ranks hold bit-identical parameters (`accelerator.gather`),
that they equal one process training on the same global batches, and that
the loss fell, then prints `PASS rank <r>`.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration
from torch.utils.data import DataLoader, TensorDataset

import gradhub.torch  # noqa: F401  registers the "gradhub" torch.distributed backend

GLOBAL_BATCH = 16   # split evenly over the workers (split_batches)
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


def one_process(steps: int, lr: float) -> nn.Module:
    """The same training in one process on the global batches."""
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    for x, y in DataLoader(dataset(steps), batch_size=GLOBAL_BATCH):
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        opt.step()
    return net


def full_loss(net: nn.Module, steps: int) -> float:
    x, y = dataset(steps).tensors
    with torch.no_grad():
        return F.mse_loss(net(x), y).item()


def main():
    p = argparse.ArgumentParser(description="Accelerate on the gradhub backend")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.05)
    args = p.parse_args()

    dist.init_process_group("gradhub")
    # split_batches: each global batch of the loader is cut into one piece per process.
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=True))
    r, n = accelerator.process_index, accelerator.num_processes
    assert (r, n) == (dist.get_rank(), dist.get_world_size()) and n > 1, (r, n)

    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=args.lr)
    loader = DataLoader(dataset(args.steps), batch_size=GLOBAL_BATCH)
    model, opt, loader = accelerator.prepare(net, opt, loader)
    steps = 0
    for x, y in loader:
        assert len(x) == GLOBAL_BATCH // n, len(x)
        opt.zero_grad()
        accelerator.backward(F.mse_loss(model(x), y))
        opt.step()
        steps += 1
    assert steps == args.steps, steps

    flat = nn.utils.parameters_to_vector(accelerator.unwrap_model(model).parameters()).detach()
    every = accelerator.gather(flat[None])     # (n, parameters): an all_gather on gradhub
    assert every.shape[0] == n and all(torch.equal(e, every[0]) for e in every), "ranks disagree on the parameters"
    ref = nn.utils.parameters_to_vector(one_process(args.steps, args.lr).parameters()).detach()
    torch.testing.assert_close(flat, ref, rtol=1e-4, atol=1e-5)
    before, after = full_loss(make_net(), args.steps), full_loss(net, args.steps)
    assert after < 0.5 * before, (before, after)
    assert dist.get_backend() == "gradhub", dist.get_backend()
    accelerator.wait_for_everyone()
    accelerator.end_training()                 # destroys the process group
    print(f"PASS rank {r}/{n}: Accelerate on gradhub, {steps} steps; parameters identical on every rank "
          f"and equal to one process; loss {before:.3f} -> {after:.3f}", flush=True)


if __name__ == "__main__":
    main()
