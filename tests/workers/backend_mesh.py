"""Worker: a 2-D DeviceMesh (hosts x workers per host) on the gradhub
backend, each emulated host in a network namespace of its own, the job's
servers on a host of their own. Every group's collectives are checked
against values computed here; then the first host's group works alone
while the other hosts' workers wait, and each worker prints the bytes its
host's link moved meanwhile (`eth0` of its namespace):
"LINK <rank> <tx+rx bytes>". Env: the job (GRADHUB_SCHEDULER), torch's
(MASTER_ADDR, RANK, WORLD_SIZE), GH_TEST={"hosts": H} (default 2)."""

import json
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import gradhub.torch  # noqa: F401  (registers the backend)


def link_bytes() -> int:
    base = "/sys/class/net/eth0/statistics"
    return sum(int(open(f"{base}/{k}_bytes").read()) for k in ("tx", "rx"))


def main() -> None:
    cfg = json.loads(os.environ.get("GH_TEST") or "{}")
    dist.init_process_group("gradhub")
    r, n = dist.get_rank(), dist.get_world_size()
    hosts = int(cfg.get("hosts", 2))
    per = n // hosts
    mesh = init_device_mesh("cpu", (hosts, per), mesh_dim_names=("host", "local"))
    local, across = mesh.get_group("local"), mesh.get_group("host")
    h, q = divmod(r, per)
    row = [h * per + i for i in range(per)]            # this host's workers
    col = [j * per + q for j in range(hosts)]          # this local rank on every host

    # Every group's sums and shards, against values computed here.
    def val(rank: int, k: int = 0) -> torch.Tensor:
        return torch.arange(4096, dtype=torch.float32) * (rank + 1) + k

    for k in range(3):
        x = val(r, k)
        dist.all_reduce(x, group=local)
        assert torch.equal(x, sum(val(p, k) for p in row)), ("local all_reduce", r, k)
        y = val(r, k)
        dist.all_reduce(y, group=across)
        assert torch.equal(y, sum(val(p, k) for p in col)), ("across all_reduce", r, k)
        shard = torch.zeros(4096 // per)
        dist.reduce_scatter_tensor(shard, val(r, k), group=local)
        whole = sum(val(p, k) for p in row)
        assert torch.equal(shard, whole[q * shard.numel():(q + 1) * shard.numel()]), ("reduce_scatter", r, k)
        out = torch.zeros(hosts * 4096)
        dist.all_gather_into_tensor(out, val(r, k), group=across)
        assert torch.equal(out, torch.cat([val(p, k) for p in col])), ("all_gather", r, k)

    # The first host's group works alone: 4 MiB sums and reduce-scatters.
    dist.barrier()
    before = link_bytes()
    if h == 0:
        big = torch.ones(1 << 20)
        for _ in range(10):
            dist.all_reduce(big, group=local)
            dist.reduce_scatter_tensor(torch.zeros((1 << 20) // per), torch.ones(1 << 20), group=local)
        assert torch.equal(big, torch.full((1 << 20,), float(per) ** 10))
    dist.barrier()
    print(f"LINK {r} {link_bytes() - before}", flush=True)
    dist.destroy_process_group()
    print(f"PASS {r}", flush=True)


if __name__ == "__main__":
    main()
