"""Worker: completion callbacks meet the end of the script.

mode "running": a callback is still running (in Python, the GIL released
in time.sleep) when the script ends. mode "in_flight": rank 0 ends with an
operation in flight, whose failure (shutdown fails the job) calls its
callback while the interpreter exits; rank 1 never pushes.

CPython ends a thread that takes the GIL once finalization has begun; for
gradhub's callback thread that was an unwind through Rust frames, and the
process could abort (SIGABRT) after its work was done. Each script must
exit with its own status; "running" prints CALLBACK DONE first."""

import sys
import threading
import time

import numpy as np

import gradhub
from common import CONFIG

gradhub.init()
mode = CONFIG.get("mode", "running")
started = threading.Event()


def slow(_h):
    started.set()
    time.sleep(0.5)
    print("CALLBACK DONE", flush=True)


x = np.ones(1000, dtype=np.float32)
if mode == "in_flight":
    # Both in the job before rank 0 fails it (else rank 1, still joining
    # under load, fails first and the launch reports its exit instead). A
    # barrier, not a push_pull: the scheduler tells both it is done before
    # it can tell rank 1 that rank 0 failed (one connection, in order),
    # while a result may reach rank 1 after rank 0 has failed the job. A
    # server may still tell rank 1 of the failure before the scheduler's
    # reply comes (another connection): rank 1 then goes on as if it had
    # passed, so that the launch reports rank 0's exit, the one tested.
    try:
        gradhub.barrier()
    except gradhub.GradhubError as e:
        if gradhub.rank() == 0:
            raise
        print(f"barrier: the job failed first ({e})", flush=True)
if mode == "running":
    h = gradhub.push_pull_async(x, name="x")
    h.add_done_callback(slow)
    h.wait()
    if not started.wait(30):
        sys.exit("the callback did not start")
elif gradhub.rank() == 0:
    for i in range(20):
        gradhub.push_pull_async(x.copy(), name=f"x{i}").add_done_callback(lambda _h: time.sleep(0.01))
else:
    time.sleep(5)
print("EXITING", flush=True)
sys.exit(CONFIG.get("status", 0))
