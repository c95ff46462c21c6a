"""`gradhub bench gpu`: the GPU check anyone can run.

On whatever GPUs the machine has (one worker per GPU, `gradhub launch` on
this machine):

1. exact sums of every dtype through each local stage (`shm`: whole pinned
   copies and the shared-memory host stage; `torch` on this one host: one
   NCCL all-reduce; `torch-2hosts`, the workers split into two emulated
   hosts: NCCL reduce-scatter, 1/W staged through the servers, all-gather),
   with the bytes each worker staged;
2. training equivalence: a small CNN (float64) trained through the torch
   stage by the workers on their shards against one process on the
   combined batch;
3. the copy layer's device-to-host bandwidth against a plain pinned copy
   of the same bytes (one GPU, in this process);
4. images/s of a synthetic ResNet-50 under DDP/NCCL and under gradhub
   (DistributedOptimizer, GRADHUB_LOCAL_STAGE=auto), side by side.

Without a GPU it says so, runs parts 1 and 2 on CPU tensors (gloo, two
workers) and exits 0 if they pass. Writes `gpu.json` and `gpu.md` (the
README-style table) to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

TIMEOUT = 600
DTYPES = ["float32", "float16", "bfloat16", "float64", "int32", "int64", "uint8"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="bench-results/gpu", help="folder for gpu.json and gpu.md "
                                                              "(default bench-results/gpu)")
    p.add_argument("--workers", type=int, default=0,
                   help="workers (default: one per GPU; without a GPU, 2 on CPU tensors)")
    p.add_argument("--steps", type=int, default=20, help="ResNet-50 steps timed per system (default 20, after 5 "
                                                         "warm-up steps)")
    p.add_argument("--batch", type=int, default=32, help="ResNet-50 batch per GPU (default 32)")


# ---------------------------------------------------------------- workers (one per GPU)


def _resnet50(torch):
    """ResNet-50 (bottleneck blocks 3, 4, 6, 3; torchvision's layout) without torchvision."""
    nn = torch.nn

    class Bottleneck(nn.Module):
        def __init__(self, cin, width, stride):
            super().__init__()
            cout = width * 4
            self.body = nn.Sequential(
                nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))
            self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else nn.Identity())

        def forward(self, x):
            return torch.relu(self.body(x) + self.skip(x))

    layers, cin = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                   nn.MaxPool2d(3, 2, 1)], 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for b in range(blocks):
            layers.append(Bottleneck(cin, width, stride if b == 0 else 1))
            cin = width * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 1000)]
    return nn.Sequential(*layers)


def _device(torch, local_rank: int):
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _sums(torch, hvd, dev) -> dict:
    from ..torch import copies

    r, n = hvd.rank(), hvd.size()
    before = copies.counters.snapshot()[0]
    checked, tensor_bytes = 0, 0
    for dt_name in DTYPES:
        dt = getattr(torch, dt_name)
        for s in (1, 1000, 65_537):
            t = ((torch.arange(s, device=dev) % 7) + r % 5).to(dt)
            got = hvd.allreduce(t, op=hvd.Sum, name=f"gpu.sums.{dt_name}.{s}")
            ref = sum(((torch.arange(s, device=dev) % 7) + q % 5).double() for q in range(n))
            if not torch.equal(got.double(), ref.to(dt).double()):
                raise AssertionError(f"{dt_name} x {s}: {got[:5].tolist()} != {ref[:5].tolist()}")
            checked += 1
            tensor_bytes += s * t.element_size() * (8 if dt == torch.uint8 else 1)  # uint8 travels as int64
    return {"checked": checked, "staged_bytes": copies.counters.snapshot()[0] - before, "tensor_bytes": tensor_bytes}


def _train(torch, hvd, dev) -> dict:
    r, n = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    nn = torch.nn

    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 16, 3),
                             nn.ReLU(), nn.Flatten(), nn.Linear(16 * 6 * 6, 10)).to(dev).double()

    model, ref = net(), net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), sufficient_factors="off")
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for _ in range(8):
        xs = torch.randn(n * 4, 3, 16, 16, generator=g, dtype=torch.float64).to(dev)
        ys = torch.randint(0, 10, (n * 4,), generator=g).to(dev)
        opt.zero_grad()
        nn.functional.cross_entropy(model(xs[r * 4:(r + 1) * 4]), ys[r * 4:(r + 1) * 4]).backward()
        opt.step()
        ref_opt.zero_grad()
        nn.functional.cross_entropy(ref(xs), ys).backward()
        ref_opt.step()
    with torch.no_grad():
        diff = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))
                   for a, b in zip(model.parameters(), ref.parameters()))
    if diff > 1e-9:
        raise AssertionError(f"parameters differ from one process's by {diff:.3g} (relative)")
    return {"max_rel_diff": diff}


def _resnet(torch, rank: int, local_rank: int, world: int, system: str, steps: int, batch: int) -> dict:
    dev = _device(torch, local_rank)
    model = _resnet50(torch).to(dev)
    base = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if system == "ddp":
        import torch.distributed as dist

        dist.init_process_group("nccl", rank=rank, world_size=world)
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
        opt = base
    else:
        import gradhub.torch as hvd

        opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict())
    x = torch.randn(batch, 3, 224, 224, device=dev)
    y = torch.randint(0, 1000, (batch,), device=dev)
    for i in range(5 + steps):
        if i == 5:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    torch.cuda.synchronize()
    return {"images_per_s": world * batch * steps / (time.perf_counter() - t0)}


def worker() -> None:
    """One worker of a job (GH_BENCH: part, steps, batch)."""
    import torch

    cfg = json.loads(os.environ["GH_BENCH"])
    part = cfg["part"]
    if part == "resnet-ddp":
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        out = _resnet(torch, rank, int(os.environ["LOCAL_RANK"]), world, "ddp", cfg["steps"], cfg["batch"])
        if rank == 0:
            print("RESULT " + json.dumps(out), flush=True)
        return
    import gradhub.torch as hvd

    if cfg.get("hosts", 1) > 1:
        # Hosts emulated on this machine (each a group of its own), so the
        # torch stage stages each host's shares and crosses the servers; the
        # devices follow the job's rank, as local ranks restart per host.
        rank, hosts = int(os.environ["GRADHUB_RANK"]), cfg["hosts"]
        world = int(os.environ["LOCAL_WORLD_SIZE"])  # `gradhub launch`: every worker of the job
        os.environ.update(GRADHUB_HOST_ID=f"bench-gpu-host{rank % hosts}", LOCAL_RANK=str(rank // hosts),
                          LOCAL_WORLD_SIZE=str(len(range(rank % hosts, world, hosts))))
    hvd.init()
    dev = _device(torch, hvd.rank() if cfg.get("hosts", 1) > 1 else hvd.local_rank())
    if part == "sums":
        out = _sums(torch, hvd, dev)
    elif part == "train":
        out = _train(torch, hvd, dev)
    else:
        out = _resnet(torch, hvd.rank(), hvd.local_rank(), hvd.size(), "gradhub", cfg["steps"], cfg["batch"])
    print(f"RESULT{hvd.rank()} " + json.dumps(out), flush=True)
    hvd.shutdown()


# ---------------------------------------------------------------- the check


def _code() -> list[str]:
    return [sys.executable, "-c", "from gradhub.bench.gpu import worker; worker()"]


def _job(part: str, workers: int, stage: str, steps: int = 0, batch: int = 0, hosts: int = 1) -> list[dict]:
    """A `gradhub launch` job of `workers` (on `hosts` emulated hosts); every worker's RESULT."""
    env = dict(os.environ, GH_BENCH=json.dumps({"part": part, "steps": steps, "batch": batch, "hosts": hosts}),
               GRADHUB_LOCAL_STAGE=stage)
    argv = [sys.executable, "-m", "gradhub", "launch", "-w", str(workers), "-s", "1", "--", *_code()]
    p = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT)
    got = {}
    for line in p.stdout.splitlines():
        if "RESULT" in line:
            head, body = line.split("RESULT", 1)[1].split(" ", 1)
            got[int(head or 0)] = json.loads(body)
    if p.returncode != 0 or len(got) != workers:
        raise RuntimeError(f"{part} job ({stage}) failed (exit {p.returncode}):\n{p.stdout[-3000:]}")
    return [got[r] for r in range(workers)]


def _ddp_job(workers: int, steps: int, batch: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(workers):
        env = dict(os.environ, GH_BENCH=json.dumps({"part": "resnet-ddp", "steps": steps, "batch": batch}),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), LOCAL_RANK=str(r),
                   WORLD_SIZE=str(workers))
        procs.append(subprocess.Popen(_code(), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=TIMEOUT)[0] for p in procs]
    lines = [line for line in outs[0].splitlines() if line.startswith("RESULT ")]
    if any(p.returncode for p in procs) or not lines:
        raise RuntimeError("DDP job failed:\n" + "\n".join(o[-1500:] for o in outs))
    return json.loads(lines[-1].split(" ", 1)[1])


def _bandwidth(torch) -> dict:
    """Device-to-host GB/s of a 256 MiB tensor: a plain pinned copy, and the copy layer's."""
    from ..torch.cuda_copies import CudaCopies

    t = torch.randn(64 << 20, device="cuda")
    pinned = torch.empty(t.numel(), pin_memory=True)
    st = CudaCopies()
    host = st.buffers.get("bench", t.numel(), t.dtype)

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        return 5 * t.numel() * 4 / (time.perf_counter() - t0) / 1e9

    plain = timed(lambda: pinned.copy_(t, non_blocking=True))
    staged = timed(lambda: st.to_host(t, host, 0))
    return {"pinned_gbs": plain, "staging_gbs": staged, "ratio": staged / plain}


def _table(report: dict) -> str:
    rows = ["| part | result |", "|---|---|"]
    for stage, s in report.get("sums", {}).items():
        # The shm stage's CUDA tensors go whole through the core's pinned copy (buffers.host_memory), which
        # the copy layer's counters do not see; on CPU it copies nothing.
        how = {"shm": " (CUDA tensors copied whole by the core's path)" if report.get("gpus") else "",
               "torch": " (one host: one all-reduce, no server round)"}.get(stage, "")
        rows.append(f"| exact sums, {stage} stage | {s['checked']} tensors x {s['workers']} workers on {s['hosts']} "
                    f"host(s) exact; worker 0 staged {s['staged_bytes']} of {s['tensor_bytes']} bytes{how} |")
    if "train" in report:
        rows.append(f"| small CNN vs one process | max relative difference {report['train']['max_rel_diff']:.2g} |")
    if "bandwidth" in report:
        b = report["bandwidth"]
        rows.append(f"| device->host copies | staging {b['staging_gbs']:.1f} GB/s vs pinned {b['pinned_gbs']:.1f} "
                    f"GB/s ({b['ratio']:.2f}x) |")
    if "resnet50" in report:
        rn = report["resnet50"]
        rows.append(f"| ResNet-50 images/s | DDP/NCCL {rn['ddp']:.1f}, gradhub {rn['gradhub']:.1f} "
                    f"({rn['gradhub'] / rn['ddp']:.2f}x) |")
    return "\n".join(rows) + "\n"


def run(args) -> int:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    workers = args.workers or (gpus if gpus else 2)
    if gpus:
        print(f"{gpus} GPU(s): {torch.cuda.get_device_name(0)}; {workers} workers, one per GPU", flush=True)
    else:
        print("no GPU (torch.cuda.is_available() is False): running the CPU parts only (exact sums and training "
              f"equivalence on CPU tensors, gloo, {workers} workers)", flush=True)
    report: dict = {"gpus": gpus, "workers": workers, "sums": {}}
    failed = []
    # The torch stage on one host is one all-reduce (nothing staged); on two
    # emulated hosts each worker stages its host's share (needs 2 workers).
    runs = [("shm", "shm", 1), ("torch", "torch", 1)] + ([("torch-2hosts", "torch", 2)] if workers >= 2 else [])
    for label, stage, hosts in runs:
        try:
            res = _job("sums", workers, stage, hosts=hosts)
            report["sums"][label] = dict(res[0], workers=workers, hosts=hosts)
            print(f"exact sums, {label} stage: {res[0]['checked']} tensors exact on every worker; worker 0 staged "
                  f"{res[0]['staged_bytes']} of {res[0]['tensor_bytes']} bytes", flush=True)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            failed.append(f"sums ({label}): {e}")
    try:
        report["train"] = _job("train", workers, "torch")[0]
        print(f"small CNN: max relative difference to one process {report['train']['max_rel_diff']:.2g}", flush=True)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        failed.append(f"train: {e}")
    if gpus:
        report["bandwidth"] = _bandwidth(torch)
        print(f"device->host: {report['bandwidth']}", flush=True)
        try:
            report["resnet50"] = {"ddp": _ddp_job(workers, args.steps, args.batch)["images_per_s"],
                                  "gradhub": _job("resnet", workers, "auto", args.steps, args.batch)[0][
                                      "images_per_s"]}
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            failed.append(f"resnet50: {e}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report["failed"] = failed
    (out / "gpu.json").write_text(json.dumps(report, indent=2) + "\n")
    table = _table(report)
    (out / "gpu.md").write_text(table)
    print(table, end="")
    for f in failed:
        print(f"FAILED {f}", file=sys.stderr)
    return 1 if failed else 0
