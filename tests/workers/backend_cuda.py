"""Worker (CUDA): the "gradhub" backend on CUDA tensors, under `gradhub
launch` (GH_TEST "port": the group's tcp:// store), any number of
processes on one GPU or one each: collectives on CUDA tensors against the
computed result, point-to-point between every pair, DDP on a CUDA model and FSDP2 (`fully_shard` on a CUDA
mesh) each equal one process training on the combined batch."""

import datetime
import os

import torch
import torch.distributed as dist

import gradhub.torch  # noqa: F401 - registers the backend
from common import CONFIG

rank, world = int(os.environ["GRADHUB_RANK"]), int(os.environ["GRADHUB_NUM_WORKERS"])
local = int(os.environ.get("GRADHUB_LOCAL_RANK", "0"))
torch.cuda.set_device(local % torch.cuda.device_count())
dev = f"cuda:{torch.cuda.current_device()}"
dist.init_process_group("gradhub", init_method=f"tcp://127.0.0.1:{CONFIG['port']}", rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=120))
r, n = dist.get_rank(), dist.get_world_size()
print("backend class", type(dist.group.WORLD).__name__, "torch", torch.__version__, flush=True)

# collectives on CUDA tensors
for dtype in (torch.float32, torch.bfloat16, torch.int64):
    t = torch.full((1000,), r + 1, dtype=dtype, device=dev)
    dist.all_reduce(t)
    assert t.device.type == "cuda" and torch.equal(t.cpu(), torch.full((1000,), n * (n + 1) // 2, dtype=dtype)), t[:3]
    out = torch.zeros(n * 5, dtype=dtype, device=dev)
    dist.all_gather_into_tensor(out, torch.full((5,), r, dtype=dtype, device=dev))
    assert torch.equal(out.cpu(), torch.arange(n, dtype=dtype).repeat_interleave(5)), out
    shard = torch.zeros(3, dtype=dtype, device=dev)
    dist.reduce_scatter_tensor(shard, torch.arange(3 * n, dtype=dtype, device=dev))
    assert torch.equal(shard.cpu(), (torch.arange(3 * n, dtype=dtype) * n)[3 * r:3 * r + 3]), shard
    b = torch.full((7,), r, dtype=dtype, device=dev)
    dist.broadcast(b, n - 1)
    assert torch.equal(b.cpu(), torch.full((7,), n - 1, dtype=dtype)), b
print("collectives on CUDA tensors: exact", flush=True)

# point-to-point on CUDA tensors (through host memory), every pair, a large message and a small one
for numel in (3, 3_000_000):
    works, got = [], {}
    for q in range(n):
        if q != r:
            works.append(dist.isend(torch.full((numel,), 100.0 * r + q, device=dev), dst=q))
            got[q] = torch.zeros(numel, device=dev)
            works.append(dist.irecv(got[q], src=q))
    for w in works:
        w.wait()
    for q, t in got.items():
        assert t.device.type == "cuda" and torch.equal(t.cpu(), torch.full((numel,), 100.0 * q + r)), (q, t[:3])
print("point-to-point on CUDA tensors: exact", flush=True)

import backend_fsdp  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

backend_fsdp.ddp("DDP on CUDA", device=dev)
backend_fsdp.train(init_device_mesh("cuda", (n,)), "FSDP2 on CUDA", device=dev)
dist.destroy_process_group()
print("PASS", rank, flush=True)
