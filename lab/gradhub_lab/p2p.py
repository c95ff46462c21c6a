"""`gradhub-lab p2p`: what point-to-point costs through the torch.distributed
backend, by path, beside gloo in the same run: 2 processes on this machine
(torchrun-style: the gradhub group forms its own job, one colocated server).
Each path moves the same messages from rank 0 to rank 1:
- "gradhub": the backend's send/recv, straight from worker to worker (the
  core's `peer` links);
- "gradhub relay": the same bytes through the job's server, as a relay would
  carry them (a broadcast from rank 0 of the 2-member group: rank 0 pushes,
  the server returns the bytes to both);
- "gloo": gloo's send/recv.
Latency: half the median round trip of a small message (ping-pong).
Throughput: a large message sent `--count` times one way, then one small
reply, in GB/s; and both processes' CPU seconds per GB moved."""

from __future__ import annotations

import json
import os
import sys
import time

PATHS = ("gradhub", "gradhub relay", "gloo")


def worker() -> None:
    import torch
    import torch.distributed as dist

    path = os.environ["GH_P2P_PATH"]
    iters, small, large, count = (int(os.environ[k]) for k in ("GH_P2P_ITERS", "GH_P2P_SMALL", "GH_P2P_LARGE",
                                                                "GH_P2P_COUNT"))
    if path.startswith("gradhub"):
        import gradhub.torch  # noqa: F401 - registers the backend
    torch.set_num_threads(1)
    dist.init_process_group("gloo" if path == "gloo" else "gradhub")
    r = dist.get_rank()
    relay = path == "gradhub relay"

    def move(t, src: int) -> None:
        """`t` from rank `src` to the other rank."""
        if relay:
            dist.broadcast(t, src=src)
        elif r == src:
            dist.send(t, dst=1 - src)
        else:
            dist.recv(t, src=src)

    ping = torch.ones(max(1, small // 4))
    for _ in range(50):
        move(ping, 0)
        move(ping, 1)
    dist.barrier()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        move(ping, 0)
        move(ping, 1)
        times.append(time.perf_counter() - t0)
    times.sort()
    big = torch.ones(large // 4)
    for _ in range(2):
        move(big, 0)
    move(ping, 1)
    dist.barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(count):
        move(big, 0)
    move(ping, 1)   # rank 0 stops the clock once rank 1 has everything
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    cpus = [torch.zeros(1) for _ in range(2)]
    dist.all_gather(cpus, torch.tensor([cpu]))
    dist.destroy_process_group()
    if r == 0:
        gb = count * large / 1e9
        print("RESULT " + json.dumps({"latency_us": times[len(times) // 2] / 2 * 1e6, "gb_per_s": gb / wall,
                                      "cpu_s_per_gb": sum(c.item() for c in cpus) / gb}), flush=True)


def run(path: str, iters: int, small: int, large: int, count: int) -> dict:
    from .backend_latency import run_group

    return run_group("gradhub_lab.p2p", 2, dict(GH_P2P_PATH=path, GH_P2P_ITERS=iters, GH_P2P_SMALL=small,
                     GH_P2P_LARGE=large, GH_P2P_COUNT=count), f"p2p over {path}")


def main(iters: int, small: int, large: int, count: int, trials: int, out: str | None = None) -> int:
    rows: dict[str, list[dict]] = {}
    for _ in range(trials):   # interleaved: the machine's noise falls on every path
        for path in PATHS:
            rows.setdefault(path, []).append(run(path, iters, small, large, count))
    med = lambda vs: sorted(vs)[len(vs) // 2]  # noqa: E731
    table = {p: {k: med([v[k] for v in vs]) for k in vs[0]} for p, vs in rows.items()}
    print(f"2 processes on this machine, median of {trials} trials: latency of a {small}-byte message (half a "
          f"round trip of {iters}), throughput of {count} messages of {large / 2**20:g} MiB one way")
    print(f"  {'path':14s} {'latency us':>10s} {'GB/s':>7s} {'CPU s/GB':>9s}")
    for p in PATHS:
        t = table[p]
        print(f"  {p:14s} {t['latency_us']:10.1f} {t['gb_per_s']:7.2f} {t['cpu_s_per_gb']:9.2f}")
    if out:
        with open(out, "w") as f:
            json.dump({"small": small, "large": large, "count": count, "iters": iters, "trials": trials,
                       "paths": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        worker()
