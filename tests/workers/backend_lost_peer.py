"""Worker: a peer of a gradhub torch.distributed group dies mid-collective.

Three ranks (torchrun-style start: the group forms its own gradhub job).
Every rank completes one all_reduce; then rank 2 (CONFIG "victim") dies
with os._exit while the others have an all_reduce (async_op=True), a
broadcast and a receive from it pending. The survivors' wait() must raise
DistBackendError naming the lost worker, within the peer timeout, and they
exit cleanly: "LOST <rank> <seconds> <message>", then destroy_process_group()
and exit 0 (a hang is the failure this checks).
"""

import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import gradhub.torch  # noqa: F401 - registers the backend
from common import CONFIG

victim = CONFIG.get("victim", 2)
dist.init_process_group("gradhub", timeout=datetime.timedelta(seconds=60))
r, n = dist.get_rank(), dist.get_world_size()
t = torch.ones(1000)
dist.all_reduce(t)
assert t[0].item() == n, t[0]
# A point-to-point link from the victim to each of the others, used once.
if r == victim:
    for q in range(n):
        if q != r:
            dist.send(torch.ones(2), dst=q)
else:
    dist.recv(torch.zeros(2), src=victim)
dist.barrier()
if r == victim:
    print(f"DYING {r}", flush=True)
    time.sleep(0.3)  # the others have their operations pending by now
    if CONFIG.get("how") == "stop":  # silent (the test kills it later): found by the peer timeout
        os.kill(os.getpid(), signal.SIGSTOP)
    os._exit(3)

x = torch.full((1000,), float(r))
works = [dist.all_reduce(x, async_op=True), dist.broadcast(torch.zeros(10), src=0, async_op=True),
         dist.irecv(torch.zeros(5), src=victim)]
t0 = time.monotonic()
for w in works:
    try:
        w.wait()
    except dist.DistBackendError as e:
        print(f"LOST {r} {time.monotonic() - t0:.2f} {type(e).__name__}: {e}", flush=True)
    else:
        print(f"COMPLETED {r}: a collective completed without rank {victim}", flush=True)
        sys.exit(1)
# A later collective fails at once, the same way.
try:
    dist.all_reduce(torch.ones(3))
    print(f"COMPLETED {r}: a later all_reduce completed", flush=True)
    sys.exit(1)
except dist.DistBackendError as e:
    print(f"LATER {r} {type(e).__name__}: {e}", flush=True)
t1 = time.monotonic()
dist.destroy_process_group()
print(f"DESTROYED {r} {time.monotonic() - t1:.2f}", flush=True)
print(f"EXIT {r}", flush=True)
