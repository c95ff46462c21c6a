"""Worker under `torchrun --nnodes MIN:MAX` (tests/test_torchrun_elastic.py):
torchrun's documented elastic pattern. Every worker loads the checkpoint at
start (torchrun restarts all workers, with a new world size, whenever a node
leaves or joins), trains with gradhub's DistributedOptimizer, and rank 0
saves a checkpoint after every step: parameters, the optimizer's state, the
next step and the history of committed steps (step, world size), from
which the test computes single-process training over exactly those batches.

Each worker's batch is a function of (step, rank, size); averaged over the
ranks, a step equals one process training on all of them (`reference()`).

Environment: GH_CKPT (the checkpoint file), GH_STEPS, GH_STEP_SLEEP
(seconds after each step, so the test can change the nodes mid-run),
GH_FINAL_SIZE (train on past GH_STEPS until the last 3 steps were at this
world size, at most 400 steps: a node that joins late still finds the job
running, and trains with it), GH_FAIL_AT (in torchrun's first attempt, the
worker of rank GH_FAIL_RANK exits with code 3 after that step; the others
then wait without a collective, so only its node counts a restart: torchrun
restarts the other node's worker as a change of nodes).
"""

import os
import sys
import time

import torch

LR, MOMENTUM, ROWS = 0.05, 0.9, 4


def make():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()


def batch(step: int, rank: int, size: int):
    g = torch.Generator().manual_seed(step * 1000 + rank * 10 + size)
    return (torch.randn(ROWS, 5, generator=g, dtype=torch.float64),
            torch.randn(ROWS, 1, generator=g, dtype=torch.float64))


def flat(model) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def reference(history: list[tuple[int, int]]) -> list[float]:
    """One process, plain SGD, over every committed step's batches (all
    ranks' rows of that step's world size)."""
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step, size in history:
        parts = [batch(step, r, size) for r in range(size)]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return flat(model)


def main() -> None:
    import gradhub.torch as hvd

    torch.set_num_threads(1)
    ckpt, steps = os.environ["GH_CKPT"], int(os.environ["GH_STEPS"])
    pause = float(os.environ.get("GH_STEP_SLEEP", "0"))
    final_size = int(os.environ.get("GH_FINAL_SIZE", "0"))
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    start, history = 0, []
    # Read before the first collective: rank 0 cannot save the next step
    # until every worker has pushed its gradients for it.
    if os.path.exists(ckpt):
        saved = torch.load(ckpt)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        start, history = saved["step"], saved["history"]
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    print(f"START rank {rank} size {size} step {start} attempt {os.environ.get('TORCHELASTIC_RESTART_COUNT')}",
          flush=True)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())

    def done() -> bool:
        # From the committed history: the same on every worker, and across restarts.
        grown = not final_size or all(n == final_size for _, n in history[-3:])
        return len(history) >= steps and grown

    step = start
    while not done():
        assert step < 400, f"the job never reached {final_size} workers"
        x, y = batch(step, rank, size)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        history.append((step, size))
        if rank == 0:
            tmp = f"{ckpt}.tmp"
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1,
                        "history": history}, tmp)
            os.replace(tmp, ckpt)  # a reader sees the old checkpoint or the new one, never half of one
        step += 1
        print(f"STEP {step} size {size}", flush=True)
        if step == int(os.environ.get("GH_FAIL_AT", "-1")) and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            if rank == int(os.environ["GH_FAIL_RANK"]):
                os._exit(3)
            time.sleep(30)  # until torchrun stops this worker
        time.sleep(pause)
    print(f"DONE rank {rank} size {size} params {flat(model)!r}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    sys.exit(main())
