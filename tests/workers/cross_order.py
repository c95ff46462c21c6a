"""Worker: ranks submit the same tensors in opposite orders and priorities
(as wait-free backprop does when layers finish at different times). The
credit must never let one rank's queue wait on chunks another rank has not
sent yet (a cycle that would deadlock)."""

import time

import numpy as np

import gradhub

gradhub.init()
r, n = gradhub.rank(), gradhub.size()
names = [("big", 4 << 20, 0), ("a", 2 << 20, 10), ("b", 2 << 20, 20)]
for rnd in range(3):
    arrays = {nm: np.full(size, r + 1.0, dtype=np.float32) for nm, size, _ in names}
    order = names if r % 2 == 0 else list(reversed(names))
    handles = []
    for nm, size, prio in order:
        handles.append(gradhub.push_pull_async(arrays[nm], name=nm, priority=prio))
        time.sleep(0.01)
    for h in handles:
        h.wait(timeout=60)
    for nm, a in arrays.items():
        assert np.all(a == n * (n + 1) / 2), (nm, a[:3])
print("PASS", r, flush=True)
gradhub.shutdown()
