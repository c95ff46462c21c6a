"""Worker: an announcement of a process-set operation to a worker that is
not in the job (a bug or a hostile client) fails the job with a clear error
instead of being forwarded or ignored."""

import numpy as np

import gradhub

gradhub.init()
x = np.ones(4, dtype=np.float32)
h = gradhub.push_pull_async(x, name="x")
if gradhub.rank() == 0:
    gradhub.api.announce("x", [gradhub.size() + 5])
try:
    h.wait(timeout=60)
    print("UNEXPECTED success", flush=True)
except gradhub.GradhubError as e:
    print("FAILED AS EXPECTED:", e, flush=True)
