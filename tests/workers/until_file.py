"""Worker: exact sums, step after step, until worker 0 sees the file named
by GH_TEST's "stop" (so a test can act while the job is surely running)."""

import os

import numpy as np

import gradhub
from common import CONFIG

gradhub.init()
r, n = gradhub.rank(), gradhub.size()
stop, i = np.zeros(1, np.float32), 0
while True:
    x = np.full(1000, r + 1 + i, np.float32)
    gradhub.push_pull(x, name="x")
    assert (x == sum(q + 1 + i for q in range(n))).all(), (i, x[:3])
    stop[0] = 1.0 if r == 0 and os.path.exists(CONFIG["stop"]) else 0.0
    gradhub.push_pull(stop, name="stop")
    i += 1
    if stop[0] > 0:
        break
print(f"PASS {r} after {i} steps", flush=True)
gradhub.shutdown()
