"""Train a small CNN on scikit-learn's handwritten digits (real data shipped
inside scikit-learn, no download) with gradhub's Horovod-style API.

    gradhub launch -w 4 -s 2 -- python examples/digits.py --epochs 10
    python examples/digits.py --epochs 10          # single process, same global batch

Rank 0 reports per-epoch loss and accuracy. Because the global batch is the
same, distributed and single-process training reach the same accuracy.
"""

import argparse
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits

try:
    from tqdm import tqdm
except ImportError:  # progress bar is optional
    tqdm = None

import gradhub.torch as hvd


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 2 * 2, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=64, help="global batch size (split across workers)")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args()

    distributed = bool(os.environ.get("GRADHUB_SCHEDULER") or os.environ.get("MASTER_ADDR"))
    if distributed:
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
    else:
        rank, size = 0, 1
    if args.batch_size % size:
        sys.exit(f"--batch-size {args.batch_size} must be divisible by the number of workers ({size})")
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    n_train = 1400
    x_train, y_train, x_test, y_test = x[:n_train], y[:n_train], x[n_train:], y[n_train:]

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if distributed:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)

    local = args.batch_size // size
    steps = n_train // args.batch_size
    for epoch in range(args.epochs):
        model.train()
        order = torch.randperm(n_train, generator=torch.Generator().manual_seed(args.seed + epoch))
        it = range(steps)
        if rank == 0 and tqdm is not None and not args.no_progress:
            it = tqdm(it, desc=f"epoch {epoch + 1}/{args.epochs}", leave=False, file=sys.stdout)
        total = 0.0
        for s in it:
            # Every worker takes its own slice of the same global batch.
            idx = order[s * args.batch_size + rank * local: s * args.batch_size + (rank + 1) * local]
            opt.zero_grad()
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()
            opt.step()
            total += loss.item()
        loss_avg = total / steps
        if distributed:
            loss_avg = hvd.allreduce(torch.tensor(loss_avg), name="epoch_loss").item()
        model.eval()
        with torch.no_grad():
            acc = (model(x_test).argmax(1) == y_test).float().mean().item()
        if rank == 0:
            print(f"epoch {epoch + 1}: train loss {loss_avg:.4f}, test accuracy {acc:.4f}", flush=True)
    if rank == 0:
        print(f"final test accuracy {acc:.4f} ({size} worker{'s' if size > 1 else ''})", flush=True)
    if distributed:
        hvd.shutdown()


if __name__ == "__main__":
    main()
