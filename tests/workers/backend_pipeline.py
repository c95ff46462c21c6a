"""Worker: pipeline parallelism (torch.distributed.pipelining) over the
torch.distributed backend "gradhub", started as torchrun starts it: an
MLP of 8 layers cut into one stage per process, trained for a few steps
with GPipe and then 1F1B (4 micro-batches each, SGD), every stage's
parameters checked against one process training the whole model on the
same batches. The schedules move activations and their gradients between
neighbouring stages with batch_isend_irecv (the backend's point-to-point).
On CUDA with GH_PIPE_DEVICE=cuda (the stages share the GPUs there are).
Prints PASS <rank>."""

import datetime
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import gradhub.torch  # noqa: F401 - registers the backend

dist.init_process_group("gradhub", timeout=datetime.timedelta(seconds=60))
r, n = dist.get_rank(), dist.get_world_size()
LAYERS, WIDTH, BATCH, MICRO, STEPS, LR = 8, 16, 32, 4, 3, 0.05
assert LAYERS % n == 0, n
DEV = torch.device(os.environ.get("GH_PIPE_DEVICE", "cpu"))
if DEV.type == "cuda":
    DEV = torch.device("cuda", r % torch.cuda.device_count())
    torch.cuda.set_device(DEV)


def model() -> nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, WIDTH, generator=g).to(DEV), torch.randn(BATCH, WIDTH, generator=g).to(DEV)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


# One process, the whole model and whole batch: the micro-batches' mean
# loss (the schedules scale gradients by the number of micro-batches).
reference = model().to(DEV)
opt = torch.optim.SGD(reference.parameters(), lr=LR)
for schedule in ("gpipe", "1f1b"):
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        loss = sum(loss_fn(reference(xm), ym) for xm, ym in zip(x.chunk(MICRO), y.chunk(MICRO))) / MICRO
        loss.backward()
        opt.step()

# This process's stage: layers [r * per, (r + 1) * per) of the same model.
per = 2 * LAYERS // n
full = model().to(DEV)
part = nn.Sequential(*list(full.children())[r * per:(r + 1) * per])
stage = PipelineStage(part, r, n, DEV)
opt = torch.optim.SGD(part.parameters(), lr=LR)
for name, cls in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
    sched = cls(stage, MICRO, loss_fn=loss_fn, scale_grads=True)
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        if r == 0:
            sched.step(x)
        elif r == n - 1:
            losses = []
            sched.step(target=y, losses=losses)
            assert len(losses) == MICRO, losses
        else:
            sched.step()
        opt.step()
    print(f"rank {r}: {name}, {STEPS} steps", flush=True)

want = list(reference.children())[r * per:(r + 1) * per]
for a, b in zip(part.parameters(), nn.Sequential(*want).parameters()):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
print(f"rank {r}: stage {r} of {n}: GPipe then 1F1B equal one process (on {DEV.type})", flush=True)
dist.barrier()
dist.destroy_process_group()
print(f"PASS {r}", flush=True)
