"""A worker of one job on a shared service (GRADHUB_JOB): exact sums of a
tensor of the configured dtype and of an int64 counter, every step.

Config: dtype, size, steps, sleep (seconds after each step), extra_tensors;
`until`: a path: after `steps`, go on until it exists (every worker stops at
the same step: a flag is summed each step)."""

import json
import os
import sys
import time

import numpy as np

import gradhub

cfg = json.loads(os.environ.get("GH_TEST", "{}"))
job = os.environ["GRADHUB_JOB"]
gradhub.init()
r, n = gradhub.rank(), gradhub.size()
tag = f"[{job} worker {r}]"
dtype = np.dtype(cfg.get("dtype", "float32"))
size = cfg.get("size", 50_000)
until = cfg.get("until")
i = 0
while True:
    if i >= cfg.get("steps", 20):
        if until is None:
            break
        flag = np.array([os.path.exists(until) or i >= 3000], np.float32)
        gradhub.push_pull(flag, name="stop")
        if flag[0] > 0:
            break
    x = np.full(size, (r + 1) * (i % 7 + 1), dtype)
    gradhub.push_pull(x, name="g")
    want = sum((q + 1) * (i % 7 + 1) for q in range(n))
    assert (x == want).all(), f"{tag} step {i}: {x[:4]} != {want}"
    c = np.array([2**40 + r + i], np.int64)  # exact only if summed as int64
    gradhub.push_pull(c, name="count")
    assert c[0] == n * (2**40 + i) + n * (n - 1) // 2, f"{tag} step {i}: count {c[0]}"
    print(f"{tag} STEP {i}", flush=True)
    time.sleep(cfg.get("sleep", 0))
    i += 1
for k in range(cfg.get("extra_tensors", 0)):
    gradhub.push_pull(np.ones(10, np.float32), name=f"extra{k}")
print(f"{tag} PASS", flush=True)
gradhub.shutdown()
sys.exit(0)
