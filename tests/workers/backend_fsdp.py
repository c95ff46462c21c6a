"""DDP and FSDP2 (`fully_shard`) over the gradhub backend train as one
process does on the combined batch (20 steps, SGD with momentum): DDP
(`ddp`), FSDP2 on a 1-D mesh and on a 2-D DeviceMesh (hybrid sharding:
replicate x shard) (`check`, `train`), on the CPU or a CUDA device. Run by
backend_collectives.py and backend_cuda.py inside their jobs, or alone."""

import datetime

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import gradhub.torch  # noqa: F401 - registers the backend



def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 3))


def batch(step: int, q: int):
    g = torch.Generator().manual_seed(100 * step + q)
    return torch.randn(8, 10, generator=g), torch.randint(0, 3, (8,), generator=g)


def _steps(model: nn.Module, label: str, device: str, full=lambda p: p) -> None:
    """`model` (wrapped) trains 20 steps on this rank's batches beside one
    process on the combined batches; its parameters (`full`: as whole
    tensors) end equal."""
    r, n = dist.get_rank(), dist.get_world_size()
    single = make()
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, single)]
    for step in range(20):
        x, y = batch(step, r)
        opts[0].zero_grad()
        F.cross_entropy(model(x.to(device)), y.to(device)).backward()
        opts[0].step()
        xs, ys = zip(*(batch(step, q) for q in range(n)))
        opts[1].zero_grad()
        F.cross_entropy(single(torch.cat(xs)), torch.cat(ys)).backward()
        opts[1].step()
    net = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    for (name, a), b in zip(net.named_parameters(), single.parameters()):
        whole = full(a).cpu()
        assert torch.allclose(whole, b, rtol=1e-4, atol=1e-5), (label, name, (whole - b).abs().max())
    print(f"{label}: 20 steps equal one process", flush=True)


def ddp(label: str, device: str = "cpu", bucket_cap_mb: float = 25.0) -> None:
    """DDP on `device` equals one process on the combined batch."""
    _steps(nn.parallel.DistributedDataParallel(make().to(device), bucket_cap_mb=bucket_cap_mb), label, device)


def train(mesh, label, device: str = "cpu"):
    """FSDP2 (every Linear and the whole model sharded over `mesh`) equals one process."""
    m = make().to(device)
    for layer in m:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    _steps(m, label, device, full=lambda p: p.full_tensor())


def check() -> None:
    n = dist.get_world_size()
    train(init_device_mesh("cpu", (n,)), "FSDP2")
    if n % 2 == 0:
        train(init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("replicate", "shard")), f"HSDP 2x{n // 2}")


if __name__ == "__main__":
    dist.init_process_group("gradhub", timeout=datetime.timedelta(seconds=60))
    check()
    dist.destroy_process_group()
    print("PASS", flush=True)
