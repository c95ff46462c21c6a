"""MNIST training written the way Horovod's PyTorch MNIST example is: the
same calls in the same places (DistributedSampler by rank, learning rate
scaled by the number of workers, parameters and optimizer state broadcast
from rank 0, DistributedOptimizer with compression, predivide factor and
op, metrics averaged with allreduce). Change the import below to
`import horovod.torch as hvd` and it runs under Horovod unchanged.

    gradhub launch -w 2 -s 1 -- python examples/horovod_mnist.py --epochs 2

Without a download (this machine has no internet), --synthetic (the
default when torchvision or the data is missing) trains on a stand-in:
28x28 images whose class is written in them, so accuracy must rise.
"""

import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data
import torch.utils.data.distributed

import gradhub.torch as hvd  # or: import horovod.torch as hvd


def parse_args():
    p = argparse.ArgumentParser(description="PyTorch MNIST, Horovod style")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--test-batch-size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--fp16-allreduce", action="store_true", help="fp16 compression during allreduce")
    p.add_argument("--use-adasum", action="store_true", help="Adasum instead of averaging")
    p.add_argument("--gradient-predivide-factor", type=float, default=1.0)
    p.add_argument("--data-dir", default=os.path.expanduser("~/.cache/mnist"))
    p.add_argument("--synthetic", action="store_true", help="train on a synthetic stand-in for MNIST")
    p.add_argument("--train-size", type=int, default=4096, help="synthetic training images")
    return p.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.flatten(1)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


def synthetic_mnist(n: int, seed: int) -> torch.utils.data.TensorDataset:
    """Noise images with a bright 4x4 block at a position given by the label."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = torch.rand(n, 1, 28, 28, generator=g) * 0.3
    for i, y in enumerate(labels.tolist()):
        r, c = 2 + (y // 5) * 12, 2 + (y % 5) * 5
        images[i, 0, r:r + 4, c:c + 4] += 1.0
    return torch.utils.data.TensorDataset((images - 0.2) / 0.3, labels)


def datasets(args):
    if not args.synthetic:
        try:
            from torchvision import datasets as tvd, transforms

            t = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
            return (tvd.MNIST(args.data_dir, train=True, download=False, transform=t),
                    tvd.MNIST(args.data_dir, train=False, download=False, transform=t))
        except (ImportError, RuntimeError) as e:
            if hvd.rank() == 0:
                print(f"MNIST not available here ({e}); training on the synthetic stand-in", flush=True)
    return synthetic_mnist(args.train_size, args.seed), synthetic_mnist(1024, args.seed + 1)


def metric_average(val, name):
    return hvd.allreduce(torch.tensor(val), name=name).item()


def main():
    args = parse_args()
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    train_dataset, test_dataset = datasets(args)
    # Each worker reads its own share of the data.
    train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset, num_replicas=hvd.size(),
                                                                    rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)
    test_sampler = torch.utils.data.distributed.DistributedSampler(test_dataset, num_replicas=hvd.size(),
                                                                   rank=hvd.rank())
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size, sampler=test_sampler)

    model = Net()
    # Adasum does not scale the learning rate with the number of workers.
    lr_scaler = 1 if args.use_adasum else hvd.size()
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)

    # Every worker starts from rank 0's parameters and optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average,
                                         gradient_predivide_factor=args.gradient_predivide_factor)

    for epoch in range(1, args.epochs + 1):
        model.train()
        train_sampler.set_epoch(epoch)
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
            if batch_idx % args.log_interval == 0 and hvd.rank() == 0:
                print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_sampler)}]\tLoss: {loss.item():.6f}",
                      flush=True)

        model.eval()
        test_loss, correct = 0.0, 0.0
        with torch.no_grad():
            for data, target in test_loader:
                output = model(data)
                test_loss += F.nll_loss(output, target, reduction="sum").item()
                correct += output.argmax(1).eq(target).float().sum().item()
        test_loss = metric_average(test_loss / len(test_sampler), "avg_loss")
        accuracy = metric_average(correct / len(test_sampler), "avg_accuracy")
        if hvd.rank() == 0:
            print(f"Test set (epoch {epoch}): Average loss: {test_loss:.4f}, Accuracy: {100.0 * accuracy:.2f}%",
                  flush=True)

    # A check the original does not have: every worker ends with the same model.
    digest = torch.cat([p.detach().flatten() for p in model.parameters()]).double().sum()
    same = hvd.allreduce(digest, op=hvd.Max, name="digest.max") == hvd.allreduce(digest, op=hvd.Min, name="digest.min")
    if hvd.rank() == 0:
        print(f"workers agree on the parameters: {bool(same)}", flush=True)


if __name__ == "__main__":
    main()
