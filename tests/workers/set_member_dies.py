"""Worker: a member of a process set dies while the set runs operations
(worker 1 is killed by the test once READY). Worker 0, its fellow member,
and worker 2, outside the set (pushing zeros for it, then waiting in a
global barrier), both get an error naming worker 1 instead of hanging."""

import sys

import torch

import gradhub.torch as hvd

hvd.init()
r = hvd.rank()
ps = hvd.add_process_set([0, 1])
try:
    if r == 2:
        print("WAITING", flush=True)
        hvd.barrier()
    else:
        hvd.allreduce(torch.ones(4), name="warm", process_set=ps)
        print("READY", flush=True)
        for _ in range(100_000):
            hvd.allreduce(torch.ones(1000), name="loop", process_set=ps)
    print("UNEXPECTED: no error", flush=True)
except hvd.GradhubError as e:
    print("RAISED", e, flush=True)
    sys.exit(3)
