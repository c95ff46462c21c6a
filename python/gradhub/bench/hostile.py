"""`gradhub bench core hostile`: a running job (scheduler, one server, two
workers) while hostile connections hit the scheduler and the server (idle,
half a header, garbage, a header claiming 64 MiB): its sums, rate, threads
and memory before, during and after, and how many of them it closed."""

from __future__ import annotations

import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time

import numpy as np

from .. import _core
from .._ports import free_port
from .procs import proc_threads, rss_mb


def _hostile_worker(port: int, rank: int, seconds: float) -> None:
    """One worker of `bench_hostile` (a child process): `seconds` blocks of
    named push_pulls of 256 KiB (as many per block as fitted in a second
    before the attack; the same count on both workers, which must run the
    same collectives), checking every sum; prints calls per second in each
    block and the number of wrong sums."""
    import gradhub

    os.environ.update(GRADHUB_SCHEDULER=f"127.0.0.1:{port}", GRADHUB_NUM_WORKERS="2",
                      GRADHUB_NUM_SERVERS="1", GRADHUB_RANK=str(rank))
    gradhub.init()
    a = np.zeros(1 << 16, np.float32)
    wrong, rates, per_block = 0, [], 0
    for block in range(seconds):
        t0 = time.monotonic()
        n = 0
        while n < (per_block if block else 50):
            a.fill(rank + 1)
            gradhub.push_pull(a, name="x", timeout=30)
            wrong += int(not np.all(a == 3.0))
            n += 1
        if block == 0:  # both workers use rank 0's count from now on
            count = np.full(1, n / (time.monotonic() - t0) if rank == 0 else 0.0, np.float32)
            per_block = int(gradhub.push_pull(count, name="count")[0])
        rates.append(n / (time.monotonic() - t0))
        if rank == 0:
            print(json.dumps({"rate": rates[-1]}), flush=True)
    gradhub.barrier()
    print(json.dumps({"done": True, "wrong": wrong}), flush=True)
    # The job stays up until the bench has counted what it closed (the end
    # of the job would close the rest).
    sys.stdin.readline()
    gradhub.shutdown()


def _attack(addr: tuple[str, int], kind: str, rng) -> socket.socket | None:
    """Open one hostile connection of `kind`; returns it (kept open) or None."""
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect(addr)
        s.setblocking(False)
        if kind == "garbage":
            s.send(rng.bytes(64))
        elif kind == "oversize":  # a frame header claiming a 64 MiB payload
            s.send(_core.encode_frame(16, payload_len=64 << 20))  # a Register
        elif kind == "slow":  # half a header, the rest never comes
            s.send(_core.encode_frame(16)[:4])
        return s
    except OSError:
        s.close()
        return None


def bench_hostile(args, out):
    """The benchmark (module docstring): 1,000 connections, 200 with `--quick`."""

    n_conns = 200 if args.quick else 1000
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4 * n_conns + 256)), hard))
    port, sport = free_port(), free_port()
    timeout_s = 3
    seconds = 12 if args.quick else 20
    env = {**os.environ, "GRADHUB_LOG": "warn", "GRADHUB_PEER_TIMEOUT": str(timeout_s)}
    logs = {name: open(f"/tmp/gradhub-hostile-{name}.log", "w+") for name in ("scheduler", "server")}
    sched = subprocess.Popen([sys.executable, "-m", "gradhub", "scheduler", "--bind", f"127.0.0.1:{port}",
                              "--workers", "2", "--servers", "1", "--peer-timeout", str(timeout_s)],
                             stderr=logs["scheduler"], env=env)
    server = subprocess.Popen([sys.executable, "-m", "gradhub", "server", "--scheduler", f"127.0.0.1:{port}",
                               "--threads", "1", "--advertise-addr", "127.0.0.1", "--bind-host", "127.0.0.1",
                               "--port", str(sport)], stderr=logs["server"], env=env)
    code = f"from gradhub.bench.hostile import _hostile_worker; _hostile_worker({port}, {{r}}, {seconds})"
    procs = [subprocess.Popen([sys.executable, "-c", code.format(r=r)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, stderr=open(f"/tmp/gradhub-hostile-worker{r}.log", "w"), env=env)
             for r in range(2)]
    rng = np.random.default_rng(0)
    kinds = ("idle", "slow", "garbage", "oversize")
    conns: list[socket.socket] = []
    samples, rates = [], []

    def sample(phase: str):
        samples.append({"phase": phase, "scheduler_threads": proc_threads(sched.pid),
                        "scheduler_mb": rss_mb(sched.pid), "server_threads": proc_threads(server.pid),
                        "server_mb": rss_mb(server.pid), "open": len(conns)})

    try:
        line = procs[0].stdout.readline()  # the first second of training: the job runs
        rates.append(("before", json.loads(line)["rate"]))
        rates.append(("before", json.loads(procs[0].stdout.readline())["rate"]))
        sample("before")
        t0 = time.monotonic()
        for i in range(n_conns):
            target = ("127.0.0.1", port if i % 2 == 0 else sport)
            c = _attack(target, kinds[(i // 2) % len(kinds)], rng)
            if c is not None:
                conns.append(c)
        opened = time.monotonic() - t0
        sample("flood sent")
        rates.append(("during", json.loads(procs[0].stdout.readline())["rate"]))
        sample("+1 s")
        while True:
            line = procs[0].stdout.readline()
            rec = json.loads(line)
            if "done" in rec:
                done0 = rec
                break
            rates.append(("after", rec["rate"]))
            if len(samples) == 3 and time.monotonic() - t0 > timeout_s + 2:
                sample(f"+{timeout_s + 2} s (peer timeout {timeout_s} s)")
        done1 = json.loads(procs[1].stdout.readline())
        # How many hostile connections the job closed (a closed socket reads
        # EOF or an error), while it still runs, once the last one opened has
        # had its peer timeout (a loaded machine opens them slowly).
        time.sleep(max(0.0, t0 + opened + timeout_s + 2 - time.monotonic()))
        closed = 0
        for c in conns:
            try:
                while c.recv(1 << 16):  # an error message may come first
                    pass
                closed += 1
            except BlockingIOError:
                pass
            except OSError:
                closed += 1
        for p in procs:
            p.stdin.write("\n")
            p.stdin.flush()
        for p in procs:
            p.wait(timeout=60)
        server.wait(timeout=30)
        sched.wait(timeout=30)
    finally:
        for c in conns:
            c.close()
        for p in [*procs, server, sched]:
            if p.poll() is None:
                p.kill()
    log_lines = {}
    for name, f in logs.items():
        f.seek(0)
        text = f.read()
        log_lines[name] = {"warnings": text.count("warning"), "refused": text.count("refused"),
                           "closing": text.count("closing connection")}
        f.close()
    wrong = done0["wrong"] + done1["wrong"]
    print(f"hostile  {n_conns} connections (idle, half header, garbage, 64 MiB header; half to the scheduler, "
          f"half to the server) against a running 2-worker job; peer timeout {timeout_s} s")
    print(f"  opened {len(conns)} in {opened:.2f} s; closed by the job by the end: {closed}; wrong sums: {wrong}")
    for s in samples:
        print(f"  {s['phase']:<28} scheduler {s['scheduler_threads']:4d} threads {s['scheduler_mb']:6.1f} MB   "
              f"server {s['server_threads']:3d} threads {s['server_mb']:6.1f} MB")
    for phase in ("before", "during", "after"):
        r = [x for p, x in rates if p == phase]
        if r:
            print(f"  push_pulls/s {phase:<7} {statistics.median(r):7.0f}  (median of {len(r)} s)")
    print(f"  log lines: {log_lines}")
    out["hostile"] = {"connections": n_conns, "opened": len(conns), "closed": closed, "wrong": wrong,
                      "samples": samples, "rates": rates, "logs": log_lines}
