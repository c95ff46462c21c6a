"""`gradhub-lab backend-latency`: what one small collective costs through
the torch.distributed backend, beside gloo in the same run: N processes on
this machine (torchrun-style: the gradhub group forms its own job, one
colocated server), each calling `dist.all_reduce` (and all_gather_into_tensor,
reduce_scatter_tensor) on a small tensor one after another; prints the
median microseconds per call and the training thread's CPU per call.
The per-collective cost is what FSDP2 pays per layer and DDP per bucket."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

CALLS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")


def worker() -> None:
    import torch
    import torch.distributed as dist

    backend, n, nbytes = os.environ["GH_LAT_BACKEND"], int(os.environ["GH_LAT_ITERS"]), int(os.environ["GH_LAT_BYTES"])
    if backend == "gradhub":
        import gradhub.torch  # noqa: F401 - registers the backend
    torch.set_num_threads(1)
    dist.init_process_group(backend)
    r, w = dist.get_rank(), dist.get_world_size()
    elems = max(1, nbytes // 4)
    x = torch.ones(elems * w)
    out = {}
    for call in CALLS:
        def one():
            if call == "all_reduce":
                dist.all_reduce(x[:elems])
            elif call == "all_gather_into_tensor":
                dist.all_gather_into_tensor(x, x[r * elems:(r + 1) * elems].clone())
            else:
                dist.reduce_scatter_tensor(x[:elems], x.clone())
        for _ in range(50):
            one()
        dist.barrier()
        times, c0 = [], time.thread_time()
        for _ in range(n):
            t0 = time.perf_counter()
            one()
            times.append(time.perf_counter() - t0)
        cpu = (time.thread_time() - c0) / n
        times.sort()
        out[call] = {"median_us": times[len(times) // 2] * 1e6, "cpu_us": cpu * 1e6}
    dist.destroy_process_group()
    if r == 0:
        print("RESULT " + json.dumps(out), flush=True)


def run_group(module: str, procs: int, extra: dict, what: str) -> dict:
    """Start `procs` processes of `module --worker` as torchrun would on this
    machine (no GRADHUB_* from here: a gradhub group forms its own job), with
    `extra` in their environment; rank 0's RESULT line."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ps = []
    for q in range(procs):
        env = {k: v for k, v in os.environ.items() if not k.startswith("GRADHUB_")}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(q), WORLD_SIZE=str(procs),
                   LOCAL_RANK=str(q), LOCAL_WORLD_SIZE=str(procs), **{k: str(v) for k, v in extra.items()})
        ps.append(subprocess.Popen([sys.executable, "-m", module, "--worker"], env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=600)[0] for p in ps]
    if any(p.returncode for p in ps):
        raise RuntimeError(f"{what} failed:\n" + "\n".join(o[-2000:] for o in outs))
    line = next(ln for ln in outs[0].splitlines() if ln.startswith("RESULT "))
    return json.loads(line[7:])


def run(backend: str, procs: int, iters: int, nbytes: int) -> dict:
    return run_group("gradhub_lab.backend_latency", procs, dict(GH_LAT_BACKEND=backend, GH_LAT_ITERS=iters,
                     GH_LAT_BYTES=nbytes, GRADHUB_INSECURE=1), f"backend-latency on {backend}")


def main(procs: int, iters: int, nbytes: int, trials: int) -> int:
    rows: dict[str, dict[str, list]] = {}
    for _ in range(trials):   # interleaved: the machine's noise falls on both
        for backend in ("gloo", "gradhub"):
            for call, v in run(backend, procs, iters, nbytes).items():
                rows.setdefault(backend, {}).setdefault(call, []).append(v)
    print(f"{procs} processes on this machine, {nbytes} bytes per process, {iters} calls, median of {trials} "
          f"trials: microseconds per call (training thread's CPU per call)")
    for call in CALLS:
        cells = []
        for backend in ("gloo", "gradhub"):
            vs = sorted(rows[backend][call], key=lambda v: v["median_us"])
            m = vs[len(vs) // 2]
            cells.append(f"{backend} {m['median_us']:8.1f} ({m['cpu_us']:6.1f})")
        print(f"  {call:24s} " + "   ".join(cells))
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        worker()
