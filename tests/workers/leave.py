"""Worker for the "a worker left" tests: every rank runs `steps` rounds of
`what`, except `leave_rank`, which runs `leave_steps` and then leaves
cleanly (`how`: "shutdown", or "exit1": sys.exit(1) with nothing in flight).

Prints STEP <i> per completed round, RAISED with the exception text, LEFT
before leaving.
"""

import sys

import numpy as np

import gradhub
from common import CONFIG

gradhub.init()
r, n = gradhub.rank(), gradhub.size()
what = CONFIG["what"]  # "named", "unnamed" or "barrier"
leave_rank = CONFIG.get("leave_rank", 1)
steps = CONFIG["leave_steps"] if r == leave_rank else CONFIG["steps"]

try:
    for i in range(steps):
        x = np.full(50_000, float(r + 1), dtype=np.float32)
        if what == "barrier" and i == steps - 1 and r != leave_rank:
            gradhub.barrier()
        else:
            gradhub.push_pull(x, name=None if what == "unnamed" else "g", timeout=60)
            assert np.all(x == n * (n + 1) / 2), x[:4]
        print("STEP", i, flush=True)
except gradhub.GradhubError as e:
    print("RAISED:", e, flush=True)
    sys.exit(3)
print("LEFT", flush=True)
if r == leave_rank and CONFIG.get("how") == "exit1":
    sys.exit(1)
gradhub.shutdown()
