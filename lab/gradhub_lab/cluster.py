"""`gradhub-lab cluster`: run any job across an emulated cluster.

Builds the hosts (network namespaces, rate-limited veths), starts the
scheduler on its own unshaped host, one server per server host (CPU-only
hosts, plus the worker hosts unless --no-colocated), and the given command
once per worker process (--workers-per-host of them on each worker host,
ranked host by host, with LOCAL_RANK/GRADHUB_LOCAL_RANK set), supervised
like `gradhub launch`: output is prefixed with role@host, the first failure
stops the job, and the emulated cluster is removed afterwards, also on Ctrl-C.

The worker environment carries both gradhub's variables and torch.distributed's
(RANK, WORLD_SIZE, MASTER_ADDR/PORT on worker 0's host, GLOO_SOCKET_IFNAME), so
the same script can be run as a DDP baseline with --no-servers.
"""

from __future__ import annotations

import os
import secrets
import sys

from gradhub.launch import Proc, supervise

from .netns import EmulatedCluster
from .runner import GLOO_PORT, SCHED_PORT, Layout


def layout_summary(layout: Layout) -> str:
    """PHub/BytePS vocabulary for a layout (printed so a run says what it was)."""
    if layout.num_servers == 0:
        return "no gradhub servers"
    if not layout.colocated:
        kind = "centralized" if layout.cpu_servers == 1 else f"non-colocated sharded ({layout.cpu_servers} servers)"
    elif layout.cpu_servers == 0:
        kind = "colocated sharded"
    else:
        kind = f"colocated + {layout.cpu_servers} CPU-only servers (BytePS k={layout.cpu_servers})"
    return f"{layout.workers} worker hosts, {kind}"


def run_cluster(layout: Layout, rate: str | None, command: list[str], partition_bytes: int | None = None,
                extra_env: dict[str, str] | None = None, host_reduce: bool = True, core_rate: str | None = None) -> int:
    if layout.workers < 1:
        print("gradhub-lab cluster: need at least one worker host", file=sys.stderr)
        return 2
    racks = layout.rack_of()
    with EmulatedCluster(layout.host_names(), rate, racks=racks,
                         core_rate=(core_rate or rate) if racks else None) as cluster:
        sched = cluster.hosts["sched"]
        print(f"gradhub-lab cluster: {layout_summary(layout)}, {rate or 'unshaped'} per host"
              + (f", {layout.workers_per_host} workers per host" if layout.workers_per_host > 1 else "")
              + ("" if host_reduce or not layout.num_servers else ", host stage off") + "; "
              + ", ".join(f"{h.name}={h.ip}" for h in cluster.hosts.values()), flush=True)
        py = [sys.executable, "-m", "gradhub"]
        base = {k: v for k, v in os.environ.items() if not k.startswith("GRADHUB_")}
        # Emulated hosts talk across addresses: the job authenticates, as a real one must.
        base["GRADHUB_JOB_TOKEN"] = secrets.token_hex(32)
        base.update(extra_env or {})
        base["PYTHONUNBUFFERED"] = "1"
        procs: list[Proc] = []
        if layout.num_servers:
            base.update(GRADHUB_SCHEDULER=f"{sched.ip}:{SCHED_PORT}", GRADHUB_NUM_WORKERS=str(layout.num_workers),
                        GRADHUB_NUM_SERVERS=str(layout.num_servers))
            argv = py + ["scheduler", "--bind", f"{sched.ip}:{SCHED_PORT}"]
            if not host_reduce:
                argv.append("--no-host-reduce")
            if partition_bytes:
                argv += ["--partition-bytes", str(partition_bytes)]
            procs.append(Proc("scheduler@sched", sched.cmd(argv), {**base, "GRADHUB_ROLE": "scheduler"}))
            hosts = [f"s{i}" for i in range(layout.cpu_servers)]
            hosts += [f"w{i}" for i in range(layout.workers)] if layout.colocated else []
            for name in hosts:
                # No --advertise-addr: each server finds the address that
                # reaches the scheduler from its own namespace, as on real hosts.
                argv = py + ["server"]
                if layout.server_threads:   # 0: the server's own default (one per core)
                    argv += ["--threads", str(layout.server_threads)]
                if name.startswith("w"):
                    argv.append("--colocated")
                if racks:
                    argv += ["--rack", f"r{racks[name]}"]
                procs.append(Proc(f"server@{name}", cluster.hosts[name].cmd(argv), {**base, "GRADHUB_ROLE": "server"}))
        workers = []
        master = cluster.hosts["w0"].ip
        W = layout.workers_per_host
        for r, host, lr in layout.worker_slots():
            env = {**base, "GRADHUB_ROLE": "worker", "GRADHUB_RANK": str(r), "RANK": str(r),
                   "WORLD_SIZE": str(layout.num_workers), "LOCAL_RANK": str(lr), "LOCAL_WORLD_SIZE": str(W),
                   "GRADHUB_LOCAL_RANK": str(lr), "GRADHUB_LOCAL_SIZE": str(W),
                   "MASTER_ADDR": master, "MASTER_PORT": str(GLOO_PORT), "GLOO_SOCKET_IFNAME": "eth0"}
            if racks:
                env["GRADHUB_RACK"] = f"r{racks[host]}"
            workers.append(Proc(f"worker {r}@{host}", cluster.hosts[host].cmd(command), env))
        procs += workers
        return supervise(procs, workers, "gradhub-lab cluster")
