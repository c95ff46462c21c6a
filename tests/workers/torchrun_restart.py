"""Worker under `torchrun --max-restarts 1`: in the first attempt rank
GH_VICTIM_RANK (0: the one hosting the job's scheduler) dies mid-training; torchrun restarts every worker, and the restarted
group must form a fresh job (no stale scheduler, names or state) and
finish with exact sums."""

import os

import torch

import gradhub.torch as hvd

attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
hvd.init()
t = torch.ones(10, dtype=torch.float64) * (hvd.rank() + 1)
for step in range(5):
    hvd.allreduce_(t, op=hvd.Sum, name="t")
    if attempt == 0 and hvd.rank() == int(os.environ["GH_VICTIM_RANK"]) and step == 2:
        os._exit(3)
# Starting from ranks + 1 = 1 and 2: 3 after one round, doubling after each.
assert torch.equal(t, torch.full((10,), 3.0 * 2 ** 4, dtype=torch.float64)), t
print(f"RESTARTED {attempt} PASS {hvd.rank()}", flush=True)
hvd.shutdown()
