"""Worker: a model whose branches are taken on some workers only in a step
(each worker's shard goes through one of two heads, a third is never used)
trains to the parameters of one process on the combined batch, as with
Horovod, instead of hanging in step(). Config (GH_TEST): overlap (forward
overlap: step() pushes the fusion buckets some of whose members have no
gradient, with zeros for those)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

import gradhub.torch as hvd
from common import CONFIG

torch.use_deterministic_algorithms(True)
hvd.init()
r, n = hvd.rank(), hvd.size()


def make():
    torch.manual_seed(5)
    return nn.ModuleDict({"trunk": nn.Linear(10, 16), "heads": nn.ModuleList([nn.Linear(16, 3) for _ in range(3)])})


def shard_loss(model, k, step):
    g = torch.Generator().manual_seed(50 + 7 * step + k)
    x, y = torch.randn(6, 10, generator=g), torch.randint(0, 3, (6,), generator=g)
    head = model["heads"][(k + step) % 2]  # heads 0 and 1 alternate; head 2 is never used
    return F.cross_entropy(head(torch.relu(model["trunk"](x))), y)


ref, model = make(), make()
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                               overlap_forward=CONFIG.get("overlap", False))
for step in range(6):
    ref_opt.zero_grad()
    (sum(shard_loss(ref, k, step) for k in range(n)) / n).backward()
    ref_opt.step()
    opt.zero_grad()
    shard_loss(model, r, step).backward()
    opt.step()
opt.finish()
for (name, p), q in zip(model.named_parameters(), ref.parameters()):
    assert torch.allclose(p, q, atol=1e-6), (name, (p - q).abs().max())
print("PASS", r, flush=True)
hvd.shutdown()
