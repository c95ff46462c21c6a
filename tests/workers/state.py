"""Worker: unnamed operations and names reused with other shapes keep no
state behind (bounded state), and give the right results."""

import numpy as np
import torch

import gradhub
import gradhub.torch as hvd
from gradhub import api

hvd.init()
r, n = hvd.rank(), hvd.size()
core = api._require()
tri = n * (n + 1) / 2

for step in range(25):
    # Unnamed, every layer: numpy push_pull (sync and async), torch
    # allreduce, broadcast, allgather of sizes varying per step and rank,
    # broadcast_object.
    a = np.full(100 + step, r + 1.0, np.float32)
    gradhub.push_pull(a)
    assert np.all(a == tri), a[:3]
    hs = [gradhub.push_pull_async(np.full(64, float(r + 1), np.float16)) for _ in range(3)]
    for h in hs:
        assert np.all(h.wait(30) == tri)
    assert torch.equal(hvd.allreduce(torch.full((7, 3), float(r + 1)), op=hvd.Sum), torch.full((7, 3), tri))
    assert torch.equal(hvd.broadcast(torch.full((5,), float(r)), root_rank=n - 1), torch.full((5,), float(n - 1)))
    rows = 1 + (step + r) % 4
    g = hvd.allgather(torch.full((rows, 2), float(r)))
    want = torch.cat([torch.full((1 + (step + k) % 4, 2), float(k)) for k in range(n)])
    assert torch.equal(g, want), (g, want)
    assert hvd.broadcast_object({"step": step, "from": r}, root_rank=0) == {"step": step, "from": 0}
    # Named: the same names every step, an allgather whose size changes.
    g = hvd.allgather(torch.full((rows, 2), float(r)), name="metric")
    assert torch.equal(g, want)
    # Unnamed state is gone once each call returned: only the named
    # allgather's two tensors (sizes, data) remain.
    assert core.num_tensors() == 2, core.num_tensors()

# A name used with another shape is a new tensor; release frees named ones.
for k, size in enumerate([1000, 10, 1000, 3]):
    x = torch.full((size,), float(k + 1))
    assert torch.equal(hvd.allreduce(x, name="reshaped", op=hvd.Sum), torch.full((size,), float(n * (k + 1))))
# (A named allreduce's shape check, as Horovod's, is a tensor of its own.)
assert core.num_tensors() == 4
gradhub.release("reshaped", "reshaped.shape", "metric.counts", "metric.data")
assert core.num_tensors() == 0
gradhub.barrier()
print("PASS", r, flush=True)
gradhub.shutdown()
