"""Asynchronous-mode training (GRADHUB_ASYNC=1) of a small regression model
with DistributedOptimizer, each worker on its own emulated host (so each
pushes for itself) unless `hosts` says otherwise.

Config: `steps`; `sleep` {rank: seconds per step} (a straggler); `seconds`:
stop after this long instead of after `steps` (each worker on its own
clock); `exact`: check the final parameters against single-process SGD on the
combined batch (true only when the workers keep in step: GRADHUB_STALENESS=0);
`progress`: print `STEP <n>` after each step.
Prints `STEPS <n>`, then PASS.
"""

import os
import time

import torch

from common import CONFIG

ME = int(os.environ["GRADHUB_RANK"])
# Emulated hosts (`hosts`: by rank; default one each): a host's workers
# combine their changes in its shared memory and push once.
HOSTS = CONFIG.get("hosts") or list(range(ME + 1))
os.environ["GRADHUB_HOST_ID"] = f"async-{HOSTS[ME]}"
os.environ["GRADHUB_LOCAL_RANK"] = str(HOSTS[:ME].count(HOSTS[ME]))
os.environ["GRADHUB_LOCAL_SIZE"] = str(HOSTS.count(HOSTS[ME]))

import gradhub.torch as hvd  # noqa: E402

LR = 0.1


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 6, generator=g)
    return x, x.sum(1, keepdim=True) * 0.5 + 1.0


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))


def main():
    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    m = model()
    if rank != 0:  # the servers start every worker from worker 0's values
        with torch.no_grad():
            for p in m.parameters():
                p.add_(1.0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=LR), named_parameters=m.named_parameters())
    ref = model()
    for a, b in zip(m.parameters(), ref.parameters()):
        assert torch.equal(a, b), f"not started from worker 0's parameters: {(a - b).flatten()[:4].tolist()}"
    pause = float(CONFIG.get("sleep", {}).get(str(rank), 0.0))
    end = time.monotonic() + CONFIG["seconds"] if "seconds" in CONFIG else None
    steps = 0
    while (end is None and steps < CONFIG["steps"]) or (end is not None and time.monotonic() < end):
        x, y = batch(steps, rank)
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        time.sleep(pause)
        opt.step()
        steps += 1
        if CONFIG.get("progress"):
            print(f"STEP {steps}", flush=True)
    print(f"STEPS {steps}", flush=True)
    if CONFIG.get("exact"):
        ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
        for s in range(steps):
            ref_opt.zero_grad()
            loss = sum(torch.nn.functional.mse_loss(ref(x), y) for x, y in (batch(s, r) for r in range(size)))
            (loss / size).backward()
            ref_opt.step()
        for (name, a), b in zip(m.named_parameters(), ref.parameters()):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (name, (a - b).abs().max().item())
    hvd.shutdown()
    print("PASS", flush=True)


if __name__ == "__main__":
    main()
