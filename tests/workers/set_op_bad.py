"""Worker: an announcement of a process-set operation to a worker that is
not in the job (a bug or a hostile client) fails the job with a clear error
instead of being forwarded or ignored."""

import time

import numpy as np

import gradhub

gradhub.init()
x = np.ones(4, dtype=np.float32)
if gradhub.rank() != 0:
    time.sleep(3)  # worker 0's round cannot complete before the scheduler has failed the job
try:
    h = gradhub.push_pull_async(x, name="x")
    if gradhub.rank() == 0:
        gradhub.api.announce("x", [gradhub.size() + 5])
    h.wait(timeout=60)
    print("UNEXPECTED success", flush=True)
except gradhub.GradhubError as e:
    print("FAILED AS EXPECTED:", e, flush=True)
