"""Synthetic training throughput (images/sec), the benchmark Horovod ships,
written against Horovod's names: change the import below to
`import horovod.torch as hvd` and it runs unchanged under Horovod.

    gradhub launch -w 4 -s 2 -- python examples/synthetic_benchmark.py --model resnet18
    GRADHUB_OVERLAP_FORWARD=1 gradhub launch -w 4 -s 2 -- python examples/synthetic_benchmark.py

gradhub's scheduling options come from the environment so the script stays
Horovod-clean: GRADHUB_OVERLAP_FORWARD=1, GRADHUB_OPTIMIZER_ON_SERVER=1,
GRADHUB_SCHEDULING=fifo (default: priority by forward order).
Without torchvision, built-in models are used (--model mlp | convnet).
"""

import argparse
import timeit

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import gradhub.torch as hvd  # or: import horovod.torch as hvd


def builtin_model(name: str, num_classes: int = 1000) -> nn.Module:
    if name == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                             nn.Linear(2048, num_classes))
    if name == "convnet":
        return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
                             nn.Linear(128 * 16, 1024), nn.ReLU(), nn.Linear(1024, num_classes))
    raise ValueError(f"unknown built-in model {name!r} (mlp, convnet)")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fp16-allreduce", action="store_true", default=False, help="use fp16 compression during allreduce")
    p.add_argument("--model", type=str, default="resnet50", help="torchvision model, or mlp / convnet")
    p.add_argument("--batch-size", type=int, default=32, help="input batch size")
    p.add_argument("--image-size", type=int, default=None, help="input resolution (default 224 torchvision, 32 built-in)")
    p.add_argument("--num-warmup-batches", type=int, default=10, help="number of warm-up batches that don't count")
    p.add_argument("--num-batches-per-iter", type=int, default=10, help="number of batches per benchmark iteration")
    p.add_argument("--num-iters", type=int, default=10, help="number of benchmark iterations")
    p.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA training")
    args = p.parse_args()
    args.cuda = not args.no_cuda and torch.cuda.is_available()

    hvd.init()
    torch.manual_seed(42)
    if args.cuda:
        torch.cuda.set_device(hvd.local_rank())
    else:
        torch.set_num_threads(1)

    try:
        from torchvision import models

        model = getattr(models, args.model)()
        size = args.image_size or 224
    except (ImportError, AttributeError):
        if args.model not in ("mlp", "convnet"):
            if hvd.rank() == 0:
                print(f"torchvision model {args.model!r} unavailable; using the built-in convnet")
            args.model = "convnet"
        model = builtin_model(args.model)
        size = args.image_size or 32
    if args.cuda:
        model.cuda()

    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    data = torch.randn(args.batch_size, 3, size, size)
    target = torch.LongTensor(args.batch_size).random_() % 1000
    if args.cuda:
        data, target = data.cuda(), target.cuda()

    def benchmark_step():
        optimizer.zero_grad()
        output = model(data)
        loss = F.cross_entropy(output, target)
        loss.backward()
        optimizer.step()

    def log(s):
        if hvd.rank() == 0:
            print(s, flush=True)

    log(f"Model: {args.model}")
    log(f"Batch size: {args.batch_size}")
    device = "GPU" if args.cuda else "CPU"
    log(f"Number of {device}s: {hvd.size()}")
    log("Running warmup...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    log("Running benchmark...")
    img_secs = []
    for x in range(args.num_iters):
        t = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / t
        log(f"Iter #{x}: {img_sec:.1f} img/sec per {device}")
        img_secs.append(img_sec)
    img_sec_mean = np.mean(img_secs)
    img_sec_conf = 1.96 * np.std(img_secs)
    log(f"Img/sec per {device}: {img_sec_mean:.1f} +-{img_sec_conf:.1f}")
    log(f"Total img/sec on {hvd.size()} {device}(s): {hvd.size() * img_sec_mean:.1f} +-{hvd.size() * img_sec_conf:.1f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
