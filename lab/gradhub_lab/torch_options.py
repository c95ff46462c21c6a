"""`gradhub-lab torch-options`: throughput of examples/synthetic_benchmark.py
under each DistributedOptimizer scheduling option, same machine, same run
(a `gradhub launch` job per option; needs the source checkout)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from gradhub.bench.checkout import checkout_root

# Environment switches, as an unchanged Horovod script would get them.
# With 2+ servers, GRADHUB_FAILOVER=0 shows what replicating the server
# optimizer's state costs (failover on keeps a replica of it).
OPTIONS = ["GRADHUB_SCHEDULING=fifo", "GRADHUB_SCHEDULING=priority", "GRADHUB_OVERLAP_FORWARD=1",
           "GRADHUB_OPTIMIZER_ON_SERVER=1", "GRADHUB_OPTIMIZER_ON_SERVER=1 GRADHUB_FAILOVER=0",
           "GRADHUB_OPTIMIZER_ON_SERVER=1 GRADHUB_OVERLAP_FORWARD=1"]
TIMEOUT = 600


def run(model: str, workers: int, servers: int) -> int:
    script = checkout_root() / "examples" / "synthetic_benchmark.py"
    for opts in OPTIONS:
        env = dict(os.environ)
        env.update(kv.split("=", 1) for kv in opts.split())
        argv = [sys.executable, "-m", "gradhub", "launch", "-w", str(workers), "-s", str(servers), "--",
                sys.executable, str(script), "--model", model, "--batch-size", "16", "--num-warmup-batches", "5",
                "--num-batches-per-iter", "10", "--num-iters", "5"]
        p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            out, _ = p.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            p.terminate()  # gradhub launch stops its job
            out, _ = p.communicate()
        found = [re.sub(r".*Total", "Total", line) for line in out.splitlines() if "Total img/sec" in line]
        print(f"{opts:<60s} {' '.join(found)}", flush=True)
    return 0
