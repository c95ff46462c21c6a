"""Worker of an elastic job (GRADHUB_MIN_WORKERS, on a shared service):
train with hvd.elastic.run and commit every step; the worker started with
GH_VICTIM=1 (or launched as rank `victim`) dies mid-step at step `lose_at`.
The survivors roll back to that step's commit, form the next generation
(new ranks and size), and finish with the parameters of full-batch training
on one process: each step's batch is the same whatever the size, split by
rank.

Config: steps, lose_at, victim (a launched rank, GRADHUB_RANK), sfb (DistributedOptimizer's sufficient_factors), step_sleep (seconds after each commit, which
prints STEP k AT SIZE n), final_size (train on past `steps` until the job
has this many workers: a worker started meanwhile joins at a commit; a
list: until it has had each size in turn; at most 600 steps).
"""

import os
import time

import torch

import gradhub.torch as hvd
from common import CONFIG

torch.set_num_threads(1)
steps, lose_at = CONFIG.get("steps", 12), CONFIG.get("lose_at", 5)
# The victim: started with GH_VICTIM=1, or (under `gradhub launch`) the
# worker the launcher gave GRADHUB_RANK == victim.
victim = os.environ.get("GH_VICTIM") == "1" or os.environ.get("GRADHUB_RANK") == str(CONFIG.get("victim"))


def make():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(12, 4, generator=g), torch.randn(12, 1, generator=g)


hvd.init()
model = make()
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               named_parameters=model.named_parameters(),
                               sufficient_factors=CONFIG.get("sfb", "off"))
# stage: how many of final_size's sizes the job has been through (synced with the state).
state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0, stage=0)
resets = []
state.register_reset_callbacks([lambda: resets.append(hvd.size())])


final_size = CONFIG.get("final_size")
sizes = final_size if isinstance(final_size, list) else [] if final_size is None else [final_size]


def done(st) -> bool:
    # The same on every worker: the step, stage and size are the job's.
    if st.step >= 600:
        raise AssertionError(f"the job never went through sizes {sizes}")
    if st.stage < len(sizes) and hvd.size() == sizes[st.stage]:
        st.stage += 1
    return st.step >= steps and st.stage == len(sizes) and (not sizes or hvd.size() == sizes[-1])


@hvd.elastic.run
def train(st):
    while not done(st):
        x, y = batch(st.step)
        rows = slice(hvd.rank(), None, hvd.size())
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        if victim and st.step == lose_at:
            os._exit(9)  # lost mid-step: its gradients never arrive
        opt.step()
        st.step += 1
        st.commit()
        print(f"STEP {st.step} AT SIZE {hvd.size()}", flush=True)
        time.sleep(CONFIG.get("step_sleep", 0))
    return st.step


trained = train(state)
assert trained >= steps
# Full-batch training on one process, over exactly the committed steps.
ref = make()
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
for s in range(trained):
    x, y = batch(s)
    ref_opt.zero_grad()
    torch.nn.functional.mse_loss(ref(x), y).backward()
    ref_opt.step()
worst = max(float((a - b).detach().abs().max()) for a, b in zip(model.parameters(), ref.parameters()))
assert worst < 1e-5, f"parameters differ from one process's by {worst:.3g}"
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
assert all(torch.equal(flat, f) for f in hvd.allgather_object(flat, name=None)), "survivors disagree"
print(f"SIZE {hvd.size()} RANK {hvd.rank()} RESETS {resets}", flush=True)
print("PASS", flush=True)
hvd.shutdown()
