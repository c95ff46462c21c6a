"""Worker: `dist.init_process_group("gradhub")` with no arguments under
`gradhub launch` (torch's env:// rendezvous: the launcher exports
MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE). The group joins the launcher's
gradhub job (not one of its own); an all_reduce and 5 DDP steps (SGD) match
one process training on the combined batch."""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import gradhub.api
import gradhub.torch as hvd

dist.init_process_group("gradhub")
r, n = dist.get_rank(), dist.get_world_size()
assert (r, n) == (hvd.rank(), hvd.size()), (r, n, hvd.rank(), hvd.size())
assert gradhub.api._embedded is None, "the group formed a job of its own instead of joining the launcher's"
t = torch.arange(6, dtype=torch.float32) * (r + 1)
dist.all_reduce(t)
assert torch.equal(t, torch.arange(6, dtype=torch.float32) * sum(range(1, n + 1))), t

torch.manual_seed(0)
ref = nn.Linear(8, 3)
model = nn.Linear(8, 3)
model.load_state_dict(ref.state_dict())
ddp = nn.parallel.DistributedDataParallel(model)
opt, ref_opt = torch.optim.SGD(ddp.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
g = torch.Generator().manual_seed(1)
for step in range(5):
    xs, ys = torch.randn(n, 4, 8, generator=g), torch.randn(n, 4, 3, generator=g)
    opt.zero_grad()
    F.mse_loss(ddp(xs[r]), ys[r]).backward()
    opt.step()
    ref_opt.zero_grad()
    F.mse_loss(ref(xs.reshape(-1, 8)), ys.reshape(-1, 3)).backward()
    ref_opt.step()
for p, q in zip(model.parameters(), ref.parameters()):
    torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
dist.destroy_process_group()
print(f"PASS {r}: env:// init, 5 DDP steps equal one process", flush=True)
