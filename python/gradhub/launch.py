"""`gradhub launch`: a whole job on this machine, supervised.

Starts the scheduler, the servers and the workers as child processes, prefixes
every output line with the role and rank, and stops everything as soon as one
process fails, returning its exit code. When all workers succeed, the
scheduler tells the servers to exit; stragglers are terminated after a grace
period.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
import time

from . import _env
from ._ports import free_port


class Proc:
    def __init__(self, label: str, argv: list[str], env: dict[str, str]):
        self.label = label
        self.p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True)
        self.pump = threading.Thread(target=self._pump, daemon=True)
        self.pump.start()

    def _pump(self) -> None:
        assert self.p.stdout is not None
        prefix = f"[{self.label}] ".encode()
        for line in iter(self.p.stdout.readline, b""):
            sys.stdout.buffer.write(prefix + line)
            sys.stdout.buffer.flush()

    def poll(self) -> int | None:
        return self.p.poll()

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _stop(procs: list[Proc], grace: float = 5.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        while p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if p.poll() is None:
            p.signal(signal.SIGKILL)
            p.p.wait()
    for p in procs:
        p.pump.join(timeout=2)


def launch(args, command: list[str]) -> int:
    if args.workers < 1 or args.servers < 1:
        print("gradhub launch: need at least one worker and one server", file=sys.stderr)
        return 2
    port = args.port or free_port()
    sched = f"127.0.0.1:{port}"
    base = dict(os.environ)
    # Every member proves this job's secret on every connection; one is made
    # up unless the user gave one. (The job is on loopback anyway.)
    if _env.job_token() is None:
        base["GRADHUB_JOB_TOKEN"] = secrets.token_hex(32)
    base.update({
        "GRADHUB_SCHEDULER": sched,
        "GRADHUB_NUM_WORKERS": str(args.workers),
        "GRADHUB_NUM_SERVERS": str(args.servers),
        "PYTHONUNBUFFERED": "1",
    })
    if args.partition_bytes:
        base["GRADHUB_PARTITION_BYTES"] = str(args.partition_bytes)
    py = [sys.executable, "-m", "gradhub"]
    timing = ["--stall-seconds", str(args.stall_seconds), "--peer-timeout", str(args.peer_timeout)]
    if args.partition_bytes:
        timing += ["--partition-bytes", str(args.partition_bytes)]
    if not args.host_reduce:
        timing.append("--no-host-reduce")
    if not args.failover:
        timing.append("--no-failover")
    timing += ["--rack-reduce", args.rack_reduce, "--link-gbit", str(args.link_gbit),
               "--core-gbit", str(args.core_gbit)]
    procs: list[Proc] = []
    procs.append(Proc("scheduler", py + ["scheduler", "--bind", f"127.0.0.1:{port}"] + timing,
                      {**base, "GRADHUB_ROLE": "scheduler"}))
    servers = []
    for s in range(args.servers):
        colocated = args.colocated or s < args.colocated_servers
        argv = py + ["server", "--threads", str(args.server_threads), "--rank", str(s),
                     "--advertise-addr", "127.0.0.1", "--bind-host", "127.0.0.1"]
        if colocated:
            argv.append("--colocated")
        servers.append(Proc(f"server {s}", argv, {**base, "GRADHUB_ROLE": "server"}))
    procs += servers
    workers = []
    for w in range(args.workers):
        env = {**base, "GRADHUB_ROLE": "worker", "GRADHUB_RANK": str(w),
               "LOCAL_RANK": str(w), "LOCAL_WORLD_SIZE": str(args.workers)}
        workers.append(Proc(f"worker {w}", command, env))
    procs += workers

    return supervise(procs, workers, "gradhub launch")


def supervise(procs: list[Proc], workers: list[Proc], tool: str) -> int:
    """Wait for the workers; stop everything as soon as one process fails (or
    on Ctrl-C/SIGTERM) and return the first failure's exit code, else 0."""

    def on_signal(signum, _frame):
        _stop(procs)
        sys.exit(128 + signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            for p in procs:
                rc = p.poll()
                if rc is not None and rc != 0:
                    print(f"{tool}: {p.label} exited with code {rc}; stopping the job", file=sys.stderr)
                    _stop(procs)
                    return rc if rc > 0 else 128 - rc
            if all(w.poll() == 0 for w in workers):
                break
            time.sleep(0.05)
        # Workers are done; the scheduler shuts the servers down.
        deadline = time.monotonic() + 30
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        rest = [p for p in procs if p.poll() is None]
        if rest:
            print(f"{tool}: " + ", ".join(p.label for p in rest) + " did not exit; terminating", file=sys.stderr)
        _stop(procs)
        bad = [p for p in procs if p.poll() not in (0, None) and p not in rest]
        return next((p.poll() for p in bad), 0)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
