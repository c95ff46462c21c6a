"""Worker for the failover tests: rounds of several tensors (float32,
float16, bfloat16, one of them unnamed) with integer data, every sum checked
exactly, while the test kills (or stops) a server in the middle.

Config: steps, sleep (seconds between steps), timeout (per wait).
Prints STEP k after step k, PASS at the end.
"""

import time

import numpy as np

import gradhub
from common import CONFIG, as_f32, data, reference

gradhub.init()
r, n = gradhub.rank(), gradhub.size()
steps = CONFIG.get("steps", 30)
sleep = CONFIG.get("sleep", 0.05)
timeout = CONFIG.get("timeout", 60)
# (name, elements, dtype): several chunks each with the default 256 KiB partitions.
tensors = [("big", 300_000, "float32"), ("half", 200_000, "float16"), ("brain", 70_000, "bfloat16"),
           ("small", 100, "float32"), (None, 5_000, "float32")]

for s in range(steps):
    handles = []
    for name, size, dtype in tensors:
        x = data(r, size, dtype, seed=s, integer=True)
        kw = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
        handles.append((x, size, dtype, gradhub.push_pull_async(x, name=name, **kw)))
    for x, size, dtype, h in handles:
        h.wait(timeout)
        want = reference(n, size, dtype, seed=s, integer=True, average=False)
        got = as_f32(x, dtype).astype(np.float64)
        assert np.array_equal(got, want), f"step {s} {dtype} {size}: {np.flatnonzero(got != want)[:5]}"
    print("STEP", s, flush=True)
    time.sleep(sleep)
print("PASS", r, flush=True)
gradhub.shutdown()
