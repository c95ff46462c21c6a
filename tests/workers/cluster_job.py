"""Run by `gradhub-lab cluster` on every emulated worker host: checks the
host's own address, a gradhub push_pull (when servers run) and a gloo
all_reduce through the torch.distributed variables the command sets."""

import os
import subprocess

import numpy as np

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
ip = subprocess.run(["ip", "-4", "-o", "addr", "show", "eth0"], capture_output=True, text=True).stdout.split()[3]
expected = float(sum(range(1, world + 1)))
if os.environ.get("GRADHUB_SCHEDULER"):
    import gradhub

    gradhub.init()
    assert gradhub.rank() == rank
    # Each emulated host is its own network namespace: one worker per host.
    assert (gradhub.local_rank(), gradhub.local_size()) == (0, 1), (gradhub.local_rank(), gradhub.local_size())
    a = np.full(100_000, float(rank + 1), dtype=np.float32)
    gradhub.push_pull(a, name="x")
    assert np.all(a == expected), a[:4]
    gradhub.shutdown()
import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method="env://")
t = torch.full((1000,), float(rank + 1))
dist.all_reduce(t)
assert torch.all(t == expected)
dist.destroy_process_group()
print(f"OK rank={rank} ip={ip}", flush=True)
