"""Worker: CPU torch tensors of every dtype, average, and broadcast from every root."""

import numpy as np
import torch

import gradhub
from common import check, data

gradhub.init()
r, n = gradhub.rank(), gradhub.size()
tdt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

for dt, t_dtype in tdt.items():
    for size in (1, 999, 300_001):
        for average in (False, True):
            x = data(r, size, dt, 5, True)
            t = torch.from_numpy(x.view(np.int16) if dt == "bfloat16" else x).clone()
            if dt == "bfloat16":
                t = t.view(torch.bfloat16)
            out = gradhub.push_pull(t, name=f"{dt}.{size}.{average}", average=average, timeout=60)
            assert out is t
            got = t.view(torch.int16).numpy().view(np.uint16) if dt == "bfloat16" else t.numpy()
            check(got, n, size, dt, 5, True, average, f"torch {dt} {size} avg={average}")

for root in range(n):
    for dt, t_dtype in tdt.items():
        t = torch.arange(1000, dtype=torch.float32).to(t_dtype) * (r + 1) - 7
        gradhub.broadcast(t, root_rank=root, name=f"bcast.{root}.{dt}")
        want = torch.arange(1000, dtype=torch.float32).to(t_dtype) * (root + 1) - 7
        assert torch.equal(t, want), (root, dt, t[:5], want[:5])

p = torch.nn.Parameter(torch.ones(3))
try:
    gradhub.push_pull(p, name="param")
    raise AssertionError("a tensor that requires grad must be refused")
except ValueError as e:
    assert "requires grad" in str(e)
print("PASS", r, flush=True)
gradhub.shutdown()
