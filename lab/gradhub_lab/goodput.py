"""Communication only: each worker synchronizes `mbytes` of float32 gradients
per iteration, as one tensor (gradhub push_pull, or gloo all_reduce for the
DDP baseline). Config (JSON in GH_BENCH): system, mbytes, iters, warmup,
rank, world, ddp_addr, and optionally host, local_rank, netdev (whose byte
counters are read at the start and end of the timed iterations). Prints
`RESULT {json}` with per-iteration times."""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from .netns import link_counters


def main():
    cfg = json.loads(os.environ["GH_BENCH"])
    n = int(cfg["mbytes"] * 1e6) // 4
    system = cfg["system"]
    times = []
    t_start = time.time()
    dev = cfg.get("netdev")
    net0 = net1 = None
    if system == "gradhub":
        import gradhub

        gradhub.init()
        a = np.ones(n, dtype=np.float32)
        for i in range(cfg.get("warmup", 2) + cfg["iters"]):
            if i == cfg.get("warmup", 2):
                net0 = link_counters(dev)
                t_start = time.time()
            t0 = time.perf_counter()
            gradhub.push_pull(a, name="grad")
            times.append(time.perf_counter() - t0)
        t_end, net1 = time.time(), link_counters(dev)
        rank, world = gradhub.rank(), gradhub.size()
        gradhub.shutdown()
        result = a
    else:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        rank, world = cfg["rank"], cfg["world"]
        dist.init_process_group("gloo", init_method=f"tcp://{cfg['ddp_addr']}", rank=rank, world_size=world)
        t = torch.ones(n)
        for i in range(cfg.get("warmup", 2) + cfg["iters"]):
            if i == cfg.get("warmup", 2):
                net0 = link_counters(dev)
                t_start = time.time()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        t_end, net1 = time.time(), link_counters(dev)
        dist.destroy_process_group()
        result = t.numpy()
    times = times[cfg.get("warmup", 2):]
    res = {"rank": rank, "world": world, "system": system, "bytes": n * 4, "iter_times": times,
           "t_start": t_start, "t_end": t_end, "host": cfg.get("host"), "local_rank": cfg.get("local_rank", 0)}
    if net0 and net1:
        res["net"] = {"tx0": net0[0], "rx0": net0[1], "tx1": net1[0], "rx1": net1[1]}
    # Summed in place every round from ones: world ** rounds everywhere.
    rounds = cfg.get("warmup", 2) + cfg["iters"]
    want = float(world) ** rounds
    if np.isfinite(want) and want < 1e30:
        lo, hi = float(result.min()), float(result.max())
        res["sum_error"] = max(abs(lo - want), abs(hi - want)) / want
        if res["sum_error"] > 1e-4:
            print(f"WRONG SUM: rank {rank} expected {want:g} everywhere after {rounds} rounds, "
                  f"found values from {lo:g} to {hi:g}", flush=True)
            print("RESULT " + json.dumps(res), flush=True)
            sys.exit(3)
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
