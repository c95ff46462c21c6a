"""Core data-plane benchmarks (issue: transport, latency, priority, defaults).

Each figure is printed next to its baseline measured in the same run:
  transport  push_pull of a large f32 tensor, 1 worker + 1 server on loopback,
             vs a plain TCP echo of the same bytes between two processes
  latency    round trip of a small push_pull vs a raw TCP ping-pong
  priority   a small high-priority push_pull issued after a big low-priority
             one: completion time of each
  sweep      goodput over partition size x credit (how the defaults were chosen)

CPU use (user+sys seconds per wall second, summed over all processes of the
run; 2.0 = both cores of this machine busy) is printed beside every figure.

Usage: python benchmarks/bench_core.py [transport|latency|priority|sweep|all] [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

import gradhub
from gradhub import _core

ECHO_SERVER = r"""
import socket, sys, threading
ls = socket.socket(); ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind(("127.0.0.1", 0)); ls.listen(1)
print(ls.getsockname()[1], flush=True)
c, _ = ls.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buf = bytearray(1 << 20); mv = memoryview(buf)
while True:
    n = c.recv_into(mv)
    if n == 0:
        break
    c.sendall(mv[:n])
"""


def cpu_seconds() -> float:
    s = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def proc_cpu(pid: int) -> float:
    """CPU seconds of a live child (RUSAGE_CHILDREN only counts reaped ones)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            parts = f.read().rsplit(")", 1)[1].split()
        tick = os.sysconf("SC_CLK_TCK")
        return (int(parts[11]) + int(parts[12])) / tick
    except OSError:
        return 0.0


def self_cpu() -> float:
    s = resource.getrusage(resource.RUSAGE_SELF)
    return s.ru_utime + s.ru_stime


class Job:
    """A 1-server job: scheduler thread in this process, server as a child
    process, this process as the (only or first) worker."""

    def __init__(self, partition: int, credit: int, threads: int = 1, workers: int = 1):
        port = _free_port()
        self.sched = _core.start_scheduler(f"127.0.0.1:{port}", workers, 1, partition)
        self.server = subprocess.Popen([sys.executable, "-m", "gradhub", "server", "--scheduler",
                                        f"127.0.0.1:{port}", "--threads", str(threads), "--advertise-addr",
                                        "127.0.0.1"], stderr=subprocess.DEVNULL)
        self.client = _core.Client(f"127.0.0.1:{port}", rank=0, num_workers=workers, num_servers=1,
                                   credit_bytes=credit)

    def push_pull(self, a: np.ndarray, name: str, priority: int = 0):
        return self.client.push_pull_async(a.ctypes.data, a.nbytes, "float32", name, False, priority, a)

    def cpu(self) -> float:
        return self_cpu() + proc_cpu(self.server.pid)

    def close(self):
        self.client.shutdown()
        self.sched.wait()
        self.server.wait(timeout=30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tcp_echo_goodput(nbytes: int, reps: int) -> tuple[float, float]:
    """GB/s of tensor bytes (sent and received back once) through a TCP echo."""
    p = subprocess.Popen([sys.executable, "-c", ECHO_SERVER], stdout=subprocess.PIPE)
    port = int(p.stdout.readline())
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    src = np.ones(nbytes, dtype=np.uint8)
    dst = bytearray(nbytes)
    best, cpu_ratio = 0.0, 0.0
    for _ in range(reps):
        c0, t0 = self_cpu() + proc_cpu(p.pid), time.perf_counter()
        sender = threading.Thread(target=s.sendall, args=(memoryview(src),))
        sender.start()
        mv, got = memoryview(dst), 0
        while got < nbytes:
            got += s.recv_into(mv[got:], min(nbytes - got, 1 << 22))
        sender.join()
        dt = time.perf_counter() - t0
        if nbytes / dt / 1e9 > best:
            best = nbytes / dt / 1e9
            cpu_ratio = (self_cpu() + proc_cpu(p.pid) - c0) / dt
    s.close()
    p.wait()
    return best, cpu_ratio


def push_pull_goodput(nbytes: int, reps: int, partition: int, credit: int) -> tuple[float, float]:
    job = Job(partition, credit)
    try:
        a = np.ones(nbytes // 4, dtype=np.float32)
        job.push_pull(a, "t").wait()  # declare + warm up
        best, cpu_ratio = 0.0, 0.0
        for _ in range(reps):
            c0, t0 = job.cpu(), time.perf_counter()
            job.push_pull(a, "t").wait()
            dt = time.perf_counter() - t0
            if nbytes / dt / 1e9 > best:
                best, cpu_ratio = nbytes / dt / 1e9, (job.cpu() - c0) / dt
        return best, cpu_ratio
    finally:
        job.close()


def bench_transport(args, out):
    nbytes = 64 << 20
    reps = 3 if args.quick else 8
    echo, echo_cpu = tcp_echo_goodput(nbytes, reps)
    pp, pp_cpu = push_pull_goodput(nbytes, reps, _core.DEFAULT_PARTITION_BYTES, _core.DEFAULT_CREDIT_BYTES)
    print(f"transport  64 MiB f32, 1 worker + 1 server, loopback (best of {reps})")
    print(f"  TCP echo (baseline)   {echo:6.2f} GB/s   cpu {echo_cpu:4.2f}")
    print(f"  gradhub push_pull     {pp:6.2f} GB/s   cpu {pp_cpu:4.2f}   ratio {pp / echo:5.2f}  (target >= 0.80)")
    out["transport"] = {"bytes": nbytes, "echo_GBps": echo, "echo_cpu": echo_cpu, "push_pull_GBps": pp,
                        "push_pull_cpu": pp_cpu, "ratio": pp / echo}


def bench_latency(args, out):
    n = 4096
    iters = 300 if args.quick else 2000
    p = subprocess.Popen([sys.executable, "-c", ECHO_SERVER], stdout=subprocess.PIPE)
    port = int(p.stdout.readline())
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf, mv = bytearray(n), None
    mv = memoryview(buf)
    payload = bytes(n)
    times = []
    for i in range(iters + 50):
        t0 = time.perf_counter()
        s.sendall(payload)
        got = 0
        while got < n:
            got += s.recv_into(mv[got:])
        if i >= 50:
            times.append(time.perf_counter() - t0)
    s.close()
    p.wait()
    tcp = statistics.median(times)
    job = Job(_core.DEFAULT_PARTITION_BYTES, _core.DEFAULT_CREDIT_BYTES)
    try:
        a = np.ones(n // 4, dtype=np.float32)
        times = []
        for i in range(iters + 50):
            t0 = time.perf_counter()
            job.push_pull(a, "small").wait()
            if i >= 50:
                times.append(time.perf_counter() - t0)
    finally:
        job.close()
    pp = statistics.median(times)
    print(f"latency    4 KiB round trip, median of {iters}")
    print(f"  TCP ping-pong (baseline, Python client)  {tcp * 1e6:7.1f} us")
    print(f"  gradhub push_pull (Python call to done)  {pp * 1e6:7.1f} us   ratio {pp / tcp:5.2f}  (target < 2)")
    out["latency"] = {"bytes": n, "tcp_us": tcp * 1e6, "push_pull_us": pp * 1e6, "ratio": pp / tcp}


def bench_priority(args, out):
    reps = 3 if args.quick else 7
    rows = []
    for credit in ([_core.DEFAULT_CREDIT_BYTES, 1 << 30]):
        job = Job(_core.DEFAULT_PARTITION_BYTES, credit)
        try:
            big = np.ones(16 << 20, dtype=np.float32)  # 64 MiB
            small = np.ones(64 << 10, dtype=np.float32)  # 256 KiB
            job.push_pull(big, "big").wait()
            job.push_pull(small, "small").wait()
            ratios = []
            for _ in range(reps):
                t0 = time.perf_counter()
                hb = job.push_pull(big, "big", priority=0)
                time.sleep(0.002)  # the big tensor is queued and streaming
                t1 = time.perf_counter()
                hs = job.push_pull(small, "small", priority=10)
                hs.wait()
                t_small = time.perf_counter() - t1
                hb.wait()
                t_big = time.perf_counter() - t0
                ratios.append((t_small, t_big))
            t_small, t_big = sorted(ratios, key=lambda r: r[0] / r[1])[len(ratios) // 2]
            rows.append((credit, t_small, t_big))
        finally:
            job.close()
    print(f"priority   256 KiB priority-10 push_pull issued 2 ms after a 64 MiB priority-0 one (median of {reps})")
    for credit, ts, tb in rows:
        label = "default credit" if credit == _core.DEFAULT_CREDIT_BYTES else "no credit    "
        print(f"  {label} {credit >> 20:5d} MiB: small {ts * 1e3:7.2f} ms, big {tb * 1e3:7.2f} ms, "
              f"small/big {ts / tb:5.3f}  (target < 0.10)")
    out["priority"] = [{"credit": c, "small_ms": ts * 1e3, "big_ms": tb * 1e3, "ratio": ts / tb} for c, ts, tb in rows]


def bench_sweep(args, out):
    nbytes = 64 << 20
    reps = 2 if args.quick else 4
    parts = [64 << 10, 256 << 10, 1 << 20, 4 << 20]
    credits = [1 << 20, 4 << 20, 16 << 20]
    print(f"sweep      push_pull goodput (GB/s) of 64 MiB, 1 worker + 1 server; rows partition, columns credit")
    print("  partition " + "".join(f"{c >> 20:>8d}M" for c in credits))
    res = []
    for p in parts:
        row = []
        for c in credits:
            if c < p:
                row.append(float("nan"))
                continue
            g, cpu = push_pull_goodput(nbytes, reps, p, c)
            row.append(g)
            res.append({"partition": p, "credit": c, "GBps": g, "cpu": cpu})
        print(f"  {p >> 10:7d}K " + "".join(f"{g:9.2f}" for g in row))
    out["sweep"] = res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("which", nargs="*", default=["all"])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--json", help="write raw results to this file")
    args = ap.parse_args()
    which = args.which if "all" not in args.which else ["transport", "latency", "priority", "sweep"]
    out = {"simd": _core.kernel_simd_level(), "cpus": os.cpu_count()}
    for w in which:
        globals()[f"bench_{w}"](args, out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
