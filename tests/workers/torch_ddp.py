"""Worker: DDP with gradhub's comm hook gives the same gradients as DDP's
default gloo all-reduce."""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import gradhub.torch as hvd
from common import CONFIG

hvd.init()
r, n = hvd.rank(), hvd.size()
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{CONFIG['port']}", rank=r, world_size=n)


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 300), nn.ReLU(), nn.Linear(300, 200), nn.ReLU(), nn.Linear(200, 3))


# Small buckets so several buckets (and a bucket rebuild) are exercised.
ref = nn.parallel.DistributedDataParallel(model(), bucket_cap_mb=0.1)
gh = nn.parallel.DistributedDataParallel(model(), bucket_cap_mb=0.1)
gh.register_comm_hook(None, hvd.ddp_comm_hook)
for step in range(3):
    g = torch.Generator().manual_seed(step * 10 + r)
    x, y = torch.randn(16, 10, generator=g), torch.randint(0, 3, (16,), generator=g)
    for m in (ref, gh):
        m.zero_grad()
        F.cross_entropy(m(x), y).backward()
    for (name, a), b in zip(ref.named_parameters(), gh.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7), (step, name, (a.grad - b.grad).abs().max())
    with torch.no_grad():
        for a, b in zip(ref.parameters(), gh.parameters()):
            a -= 0.1 * a.grad
            b -= 0.1 * b.grad
print("PASS", r, flush=True)
dist.destroy_process_group()
hvd.shutdown()
