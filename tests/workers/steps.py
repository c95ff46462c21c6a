"""Worker: `steps` training-like steps of an exact push_pull (integer-valued
float32 data, several chunks), each checked against the sum of every
rank's; prints `STEP i <wall clock>` after each, so a test can tell when
training stopped and when it went on, then PASS."""

import time

import numpy as np

import gradhub
from common import CONFIG

gradhub.init()
r, n = gradhub.rank(), gradhub.size()
size, steps, pause = CONFIG.get("size", 300_000), CONFIG.get("steps", 100), CONFIG.get("pause", 0.05)
for i in range(steps):
    x = np.full(size, float(r + i), dtype=np.float32)
    gradhub.push_pull(x, name="g", timeout=120)
    want = float(sum(q + i for q in range(n)))
    assert np.all(x == want), f"rank {r} step {i}: {x[:4]} != {want}"
    print(f"STEP {i} {time.time():.3f}", flush=True)
    time.sleep(pause)
print("PASS", r, flush=True)
gradhub.shutdown()
