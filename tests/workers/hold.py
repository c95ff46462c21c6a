"""Worker for failure tests: warm up, then every rank except `hold_rank` starts
push_pull('x') while hold_rank waits for a go-file before pushing.

Prints READY after warm-up, WAITING before blocking, RAISED/TIMEOUT with the
exception text, PASS when everything completed.
"""

import os
import sys
import time

import numpy as np

import gradhub
from common import CONFIG

gradhub.init()
r, n = gradhub.rank(), gradhub.size()
size = CONFIG.get("size", 1_000_000)
hold_rank = CONFIG.get("hold_rank", 1)
go_file = CONFIG.get("go_file")
timeout = CONFIG.get("timeout")

w = np.ones(1000, dtype=np.float32)
gradhub.push_pull(w, name="warmup", timeout=60)
assert np.all(w == n)
x = np.full(size, r + 1, dtype=np.float32)
if CONFIG.get("declare"):
    gradhub.declare([("x", x)])
print("READY", r, flush=True)
try:
    if r == hold_rank and CONFIG.get("hold_exits") == "exception":
        raise ZeroDivisionError("a bug in the training script")
    if r == hold_rank and CONFIG.get("hold_exits") == "shutdown":
        h = gradhub.push_pull_async(np.ones(10, np.float32), name="never_matched")
        gradhub.shutdown()
        sys.exit(0)
    if r == hold_rank:
        deadline = time.monotonic() + 120
        while go_file and not os.path.exists(go_file) and time.monotonic() < deadline:
            time.sleep(0.05)
        gradhub.push_pull(x, name="x", timeout=60)
    else:
        print("WAITING", r, flush=True)
        try:
            gradhub.push_pull(x, name="x", timeout=timeout)
        except gradhub.GradhubTimeoutError as e:
            # Not cancelled: the error carries the operation, still running.
            print("TIMEOUT:", e, flush=True)
            assert not e.handle.done() and e.handle.name == "x"
            assert e.handle.wait(60) is x
except gradhub.GradhubError as e:
    print("RAISED:", e, flush=True)
    sys.exit(3)
assert np.all(x == n * (n + 1) / 2), x[:4]
for i in range(CONFIG.get("extra_rounds", 0)):
    y = np.full(50_000, float(i), dtype=np.float32)
    gradhub.push_pull(y, name="extra", timeout=60)
    assert np.all(y == i * n)
print("PASS", r, flush=True)
gradhub.shutdown()
