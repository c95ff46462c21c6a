"""Worker of an elastic job (GRADHUB_MIN_WORKERS, on a shared service):
train with hvd.elastic.run and commit every step (the loop of
gradhub_lab.elastic_loop, shared with the elastic fault campaign); the
worker started with GH_VICTIM=1 (or launched as rank `victim`) dies
mid-step at step `lose_at`. The survivors roll back to that step's commit,
form the next generation (new ranks and size), and finish with the
parameters of full-batch training on one process: each step's batch is the
same whatever the size, split by rank.

Config: steps, lose_at, victim (a launched rank, GRADHUB_RANK), sfb
(DistributedOptimizer's sufficient_factors), step_sleep (seconds after each
commit, which prints STEP k AT SIZE n), final_size (train on past `steps`
until the job has this many workers: a worker started meanwhile joins at a
commit; a list: until it has had each size in turn; at most 600 steps).
"""

import os
import time

import torch

import gradhub.torch as hvd
from common import CONFIG
from gradhub_lab.elastic_loop import Problem, train

steps, lose_at = CONFIG.get("steps", 12), CONFIG.get("lose_at", 5)
# The victim: started with GH_VICTIM=1, or (under `gradhub launch`) the
# worker the launcher gave GRADHUB_RANK == victim.
victim = os.environ.get("GH_VICTIM") == "1" or os.environ.get("GRADHUB_RANK") == str(CONFIG.get("victim"))
final_size = CONFIG.get("final_size")
sizes = final_size if isinstance(final_size, list) else [] if final_size is None else [final_size]
problem = Problem(seed=1, inputs=4, hidden=3, outputs=1, rows=12, lr=0.1)


def done(st, _trained) -> bool:
    # The same on every worker: the step, stage (how many of `sizes` the job
    # has been through, kept in the elastic state) and size are the job's.
    if st.step >= 600:
        raise AssertionError(f"the job never went through sizes {sizes}")
    if st.stage < len(sizes) and hvd.size() == sizes[st.stage]:
        st.stage += 1
    return st.step >= steps and st.stage == len(sizes) and (not sizes or hvd.size() == sizes[-1])


def mid_step(step) -> None:
    if victim and step == lose_at:
        os._exit(9)  # lost mid-step: its gradients never arrive


def after_commit(step) -> None:
    print(f"STEP {step} AT SIZE {hvd.size()}", flush=True)
    time.sleep(CONFIG.get("step_sleep", 0))


trained = train(problem, done, sufficient_factors=CONFIG.get("sfb", "off"), mid_step=mid_step,
                after_commit=after_commit, stage=0)
assert trained.steps >= steps
# Full-batch training on one process, over exactly the committed steps.
worst, flat = problem.check(trained.model, trained.steps)
assert worst < 1e-5, f"parameters differ from one process's by {worst:.3g}"
assert all(torch.equal(flat, f) for f in hvd.allgather_object(flat, name=None)), "survivors disagree"
print(f"SIZE {hvd.size()} RANK {hvd.rank()} RESETS {trained.resets}", flush=True)
print("PASS", flush=True)
hvd.shutdown()
