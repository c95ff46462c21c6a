"""`gradhub bench core`: data-plane benchmarks on loopback, each figure next
to its baseline measured in the same run:

  transport  push_pull of a large f32 tensor, 1 worker + 1 server on loopback,
             vs a plain TCP echo of the same bytes between two processes
  latency    round trip of a small push_pull vs a raw TCP ping-pong
  priority   a small high-priority push_pull issued after a big low-priority
             one: completion time of each
  sweep      goodput over partition size x credit (how the defaults were chosen)
  host       push_pull of a large f32 tensor by W worker processes and one
             colocated server on this host: host stage off, on with the
             server over loopback TCP, on with pushes by reference
  state      memory and time over many unnamed, named and unique-name calls
  hostile    1,000 hostile connections against a running job
  failover   push_pull with 3 servers, failover off vs on (its cost while no
             server is lost), then with a server killed mid-run

CPU use (user+sys seconds per wall second, summed over all processes of the
run; 2.0 = both cores of this machine busy) is printed beside every figure.

The TCP baselines of transport and latency are a compiled program
(examples/tcp_baseline.rs), so the comparison is about protocol, not
interpreter: it is built from the source checkout with cargo on first use.
Without the checkout or cargo those two print gradhub's figures alone (and
say why); every other benchmark needs neither.

Usage: gradhub bench core [BENCH ...] [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import secrets
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from .. import _core, _env
from .._ports import free_port
from .checkout import CheckoutError, tcp_baseline
from .hostile import bench_hostile  # noqa: F401  (run() finds each bench_* by name)
from .procs import rss_mb


def _echo_server(exe: Path) -> tuple[subprocess.Popen, str]:
    """The compiled echo peer on a free port: (process, address)."""
    p = subprocess.Popen([str(exe), "echo-serve", "127.0.0.1:0"], stdout=subprocess.PIPE, text=True)
    return p, f"127.0.0.1:{int(p.stdout.readline())}"


def _baseline_times(exe: Path, *args) -> list[float]:
    """Run a baseline client (echo-goodput or ping-pong): seconds per repetition."""
    out = subprocess.run([str(exe), *map(str, args)], stdout=subprocess.PIPE, text=True, check=True).stdout
    return [float(x) for x in out.split()]


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
    process, this process as the (only or first) worker. It drives the core's
    client directly (not gradhub.api), so the figures are the core's.
    `encrypt`: every connection sealed (GRADHUB_ENCRYPT), with a token made
    up if none is set."""

    def __init__(self, partition: int, credit: int, threads: int = 1, workers: int = 1, encrypt: bool = False):
        port = free_port()
        token = _env.job_token() or (secrets.token_hex(16) if encrypt else None)
        env = dict(os.environ, GRADHUB_ENCRYPT="1" if encrypt else "0")
        if token:
            env["GRADHUB_JOB_TOKEN"] = token
        self.sched = _core.start_scheduler(_core.SchedulerConfig(f"127.0.0.1:{port}", workers, 1, partition,
                                                                token=token, encrypt=encrypt))
        self.server = subprocess.Popen([sys.executable, "-m", "gradhub", "server", "--scheduler",
                                        f"127.0.0.1:{port}", "--threads", str(threads), "--advertise-addr",
                                        "127.0.0.1"], stderr=subprocess.DEVNULL, env=env)
        self.client = _core.Client(_core.ClientConfig(f"127.0.0.1:{port}", rank=0, num_workers=workers, num_servers=1,
                                                      credit_bytes=credit, token=token, encrypt=encrypt))

    def push_pull(self, a: np.ndarray, name: str, priority: int = 0):
        return self.client.push_pull_async(a.ctypes.data, a.nbytes, "float32", name, False, priority, a)

    def cpu(self) -> float:
        return self_cpu() + proc_cpu(self.server.pid)

    def close(self):
        self.client.shutdown()
        self.sched.wait()
        self.server.wait(timeout=30)


def tcp_echo_goodput(exe: Path, nbytes: int, reps: int) -> tuple[float, float]:
    """GB/s of bytes sent and received back once through a TCP echo (both ends compiled)."""
    p, addr = _echo_server(exe)
    # cpu_seconds() counts the client once it has exited (RUSAGE_CHILDREN), proc_cpu the live echo server.
    c0, t0 = cpu_seconds() + proc_cpu(p.pid), time.perf_counter()
    times = _baseline_times(exe, "echo-goodput", addr, nbytes, reps)
    cpu_ratio = (cpu_seconds() + proc_cpu(p.pid) - c0) / (time.perf_counter() - t0)
    p.wait()
    return nbytes / min(times) / 1e9, cpu_ratio


def push_pull_goodput(nbytes: int, reps: int, partition: int, credit: int,
                      encrypt: bool = False) -> tuple[float, float]:
    job = Job(partition, credit, encrypt=encrypt)
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
    trials = 1 if args.quick else 3
    echo = pp = sealed = 0.0
    echo_cpu = pp_cpu = sealed_cpu = 0.0
    exe = args.tcp_baseline
    for _ in range(trials):  # interleaved, so drift on a shared machine hits each alike
        e, ec = tcp_echo_goodput(exe, nbytes, reps) if exe else (0.0, 0.0)
        g, gc = push_pull_goodput(nbytes, reps, _core.DEFAULT_PARTITION_BYTES, _core.DEFAULT_CREDIT_BYTES)
        x, xc = push_pull_goodput(nbytes, reps, _core.DEFAULT_PARTITION_BYTES, _core.DEFAULT_CREDIT_BYTES, True)
        if e > echo:
            echo, echo_cpu = e, ec
        if g > pp:
            pp, pp_cpu = g, gc
        if x > sealed:
            sealed, sealed_cpu = x, xc
    print(f"transport  64 MiB f32, 1 worker + 1 server, loopback (best of {trials}x{reps})")
    out["transport"] = {"bytes": nbytes, "push_pull_GBps": pp, "push_pull_cpu": pp_cpu,
                        "encrypted_GBps": sealed, "encrypted_cpu": sealed_cpu}
    if exe:
        print(f"  TCP echo (baseline)   {echo:6.2f} GB/s   cpu {echo_cpu:4.2f}")
        print(f"  gradhub push_pull     {pp:6.2f} GB/s   cpu {pp_cpu:4.2f}   ratio {pp / echo:5.2f}  (target >= 0.80)")
        out["transport"].update(echo_GBps=echo, echo_cpu=echo_cpu, ratio=pp / echo)
    else:
        print(f"  TCP echo (baseline)   not run: {args.no_baseline}")
        print(f"  gradhub push_pull     {pp:6.2f} GB/s   cpu {pp_cpu:4.2f}")
    print(f"  encrypted push_pull   {sealed:6.2f} GB/s   cpu {sealed_cpu:4.2f}   {sealed / pp:5.2f} of unencrypted "
          "(GRADHUB_ENCRYPT=1: AES-256-GCM on every frame)")


def _python_ping_pong(addr: str, n: int, iters: int) -> list[float]:
    host, port = addr.rsplit(":", 1)
    s = socket.create_connection((host, int(port)))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    mv = memoryview(bytearray(n))
    payload = bytes(n)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        s.sendall(payload)
        got = 0
        while got < n:
            got += s.recv_into(mv[got:])
        times.append(time.perf_counter() - t0)
    s.close()
    return times


def bench_latency(args, out):
    n = 4096
    iters = 300 if args.quick else 2000
    trials = 1 if args.quick else 3
    best = {"rust": float("inf"), "python": float("inf"), "gradhub": float("inf")}
    exe = args.tcp_baseline
    for _ in range(trials):
        for kind in ("rust", "python") if exe else ():
            p, addr = _echo_server(exe)
            if kind == "rust":
                times = _baseline_times(exe, "ping-pong", addr, n, iters + 50)[50:]
            else:
                times = _python_ping_pong(addr, n, iters + 50)[50:]
            p.wait()
            best[kind] = min(best[kind], statistics.median(times))
        for kind, encrypt in (("gradhub", False), ("encrypted", True)):
            job = Job(_core.DEFAULT_PARTITION_BYTES, _core.DEFAULT_CREDIT_BYTES, encrypt=encrypt)
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
            best[kind] = min(best.get(kind, float("inf")), statistics.median(times))
    tr, tp, pp, sealed = best["rust"], best["python"], best["gradhub"], best["encrypted"]
    print(f"latency    4 KiB round trip, median of {iters} (best of {trials} trials)")
    if not exe:
        print(f"  TCP ping-pong (baselines)                  not run: {args.no_baseline}")
        print(f"  gradhub push_pull, Python call to done     {pp * 1e6:7.1f} us")
        print(f"  the same, encrypted (GRADHUB_ENCRYPT=1)    {sealed * 1e6:7.1f} us")
        out["latency"] = {"bytes": n, "push_pull_us": pp * 1e6, "encrypted_us": sealed * 1e6}
        return
    print(f"  TCP ping-pong, compiled client (baseline)  {tr * 1e6:7.1f} us")
    print(f"  TCP ping-pong, Python socket client        {tp * 1e6:7.1f} us")
    print(f"  gradhub push_pull, Python call to done     {pp * 1e6:7.1f} us   ratio {pp / tr:5.2f} vs compiled, "
          f"{pp / tp:5.2f} vs Python  (target < 2)")
    print(f"  the same, encrypted (GRADHUB_ENCRYPT=1)    {sealed * 1e6:7.1f} us   +{(sealed - pp) * 1e6:.1f} us")
    out["latency"] = {"bytes": n, "tcp_rust_us": tr * 1e6, "tcp_python_us": tp * 1e6, "push_pull_us": pp * 1e6,
                      "ratio": pp / tr, "encrypted_us": sealed * 1e6}


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


def priority_ratio(partition: int, credit: int, reps: int) -> tuple[float, float, float]:
    """(small ms, big ms, small/big) for a 256 KiB priority-10 push_pull issued
    2 ms after a 64 MiB priority-0 one; median over reps."""
    job = Job(partition, credit)
    try:
        big = np.ones(16 << 20, dtype=np.float32)
        small = np.ones(64 << 10, dtype=np.float32)
        job.push_pull(big, "big").wait()
        job.push_pull(small, "small").wait()
        res = []
        for _ in range(reps):
            t0 = time.perf_counter()
            hb = job.push_pull(big, "big", priority=0)
            time.sleep(0.002)
            t1 = time.perf_counter()
            job.push_pull(small, "small", priority=10).wait()
            ts = time.perf_counter() - t1
            hb.wait()
            res.append((ts, time.perf_counter() - t0))
        ts, tb = sorted(res, key=lambda r: r[0] / r[1])[len(res) // 2]
        return ts * 1e3, tb * 1e3, ts / tb
    finally:
        job.close()


def bench_sweep(args, out):
    nbytes = 64 << 20
    reps = 3 if args.quick else 6
    parts = [64 << 10, 256 << 10, 1 << 20, 4 << 20]
    credits = [1 << 19, 1 << 20, 2 << 20, 4 << 20, 8 << 20]
    print("sweep      64 MiB push_pull, 1 worker + 1 server: goodput GB/s (best of %d) / priority small:big ratio" % reps)
    print("  partition " + "".join(f"{'credit ' + str(c >> 20) + 'M':>16s}" for c in credits))
    res = []
    for p in parts:
        cells = []
        for c in credits:
            if c < p:
                cells.append(f"{'-':>16s}")
                continue
            g, cpu = push_pull_goodput(nbytes, reps, p, c)
            ts, tb, r = priority_ratio(p, c, 3 if args.quick else 5)
            cells.append(f"{g:9.2f} / {r:4.2f}")
            res.append({"partition": p, "credit": c, "GBps": g, "cpu": cpu, "small_ms": ts, "big_ms": tb,
                        "priority_ratio": r})
        print(f"  {p >> 10:7d}K " + "".join(cells), flush=True)
    out["sweep"] = res


def _timed_push_pulls(c, rank: int, workers: int, nbytes: int, reps: int) -> None:
    """A benchmark worker's loop (in a child process): prints "go" before
    its timed push_pulls, then their times, its CPU and whether every sum
    was right."""
    a = np.empty(nbytes // 4, dtype=np.float32)
    want = workers * (workers + 1) / 2
    for _ in range(2):  # declare + warm up (first touch of every buffer)
        a.fill(rank + 1)
        c.push_pull_async(a.ctypes.data, a.nbytes, "float32", "t", False, 0, a).wait(60)
    print("go", flush=True)
    times, ok, c0 = [], True, self_cpu()
    for _ in range(reps):
        a.fill(rank + 1)
        t0 = time.perf_counter()
        c.push_pull_async(a.ctypes.data, a.nbytes, "float32", "t", False, 0, a).wait(60)
        times.append(time.perf_counter() - t0)
        ok = ok and bool(np.all(a == want))
    print(json.dumps({"times": times, "cpu": self_cpu() - c0, "ok": ok}), flush=True)
    c.shutdown()


def _start_workers(bench: str, call: str, workers: int) -> list[subprocess.Popen]:
    """Start `workers` processes running `call` (a function of this module,
    `{r}` standing for the rank) and wait until each said "go"."""
    code = f"import gradhub.bench.core as bench; bench.{call}"
    procs = [subprocess.Popen([sys.executable, "-c", code.format(r=r)], stdout=subprocess.PIPE, text=True,
                              stderr=subprocess.DEVNULL) for r in range(workers)]
    lines = [p.stdout.readline().strip() for p in procs]
    if any(line != "go" for line in lines):
        for p in procs:
            p.kill()
        raise RuntimeError(f"bench {bench}: a worker failed to start ({lines})")
    return procs


def _host_worker(port: int, rank: int, workers: int, nbytes: int, reps: int, server_shm: bool) -> None:
    """One worker of `bench_host`."""
    c = _core.Client(_core.ClientConfig(f"127.0.0.1:{port}", rank=rank, num_workers=workers, num_servers=1,
                                        server_shm=server_shm, token=_env.job_token()))
    _timed_push_pulls(c, rank, workers, nbytes, reps)


def host_push_pull(workers: int, nbytes: int, reps: int, reduce: bool, server_shm: bool) -> dict:
    """W worker processes and one colocated server on this host: the best
    time per push_pull (rank 0's), CPU per wall second over every process."""
    port = free_port()
    sched = _core.start_scheduler(_core.SchedulerConfig(f"127.0.0.1:{port}", workers, 1, host_reduce=reduce,
                                                        token=_env.job_token()))
    server = subprocess.Popen([sys.executable, "-m", "gradhub", "server", "--scheduler", f"127.0.0.1:{port}",
                               "--threads", "1", "--colocated", "--advertise-addr", "127.0.0.1"],
                              stderr=subprocess.DEVNULL)
    procs: list[subprocess.Popen] = []
    try:
        procs = _start_workers("host", f"_host_worker({port}, {{r}}, {workers}, {nbytes}, {reps}, {server_shm})",
                               workers)
        server0 = proc_cpu(server.pid)
        res = [json.loads(p.stdout.readline()) for p in procs]
        server_cpu = proc_cpu(server.pid) - server0
        for p in procs:
            p.wait(timeout=60)
        sched.wait()
        server.wait(timeout=30)
    finally:
        for p in [*procs, server]:
            if p.poll() is None:
                p.kill()
    wall = sum(res[0]["times"])
    # Each worker measures its own loop; the server is sampled from /proc around them.
    cpu = (sum(r["cpu"] for r in res) + server_cpu) / wall
    return {"best_s": min(res[0]["times"]), "median_s": statistics.median(res[0]["times"]), "cpu": cpu,
            "ok": all(r["ok"] for r in res)}


def bench_host(args, out):
    workers, nbytes = 4, 32 << 20
    reps = 5 if args.quick else 12
    trials = 1 if args.quick else 3
    modes = {"stage off": (False, False), "stage, server over TCP": (True, False),
             "stage, server by reference": (True, True)}
    best: dict[str, dict] = {}
    for _ in range(trials):  # interleaved, so drift on a shared machine hits every mode
        for name, (reduce, shm) in modes.items():
            r = host_push_pull(workers, nbytes, reps, reduce, shm)
            if name not in best or r["best_s"] < best[name]["best_s"]:
                best[name] = r
            if not r["ok"]:
                raise RuntimeError(f"bench host: wrong sum with {name}")
    # What the data must cross at least: every worker's tensor added once into the host's sum
    # and the result copied back into every worker, at this machine's memory bandwidth.
    a = np.ones(nbytes // 4, dtype=np.float32)
    b = np.empty_like(a)
    t0 = time.perf_counter()
    for _ in range(5):
        np.copyto(b, a)
    copy_gbps = 5 * nbytes / (time.perf_counter() - t0) / 1e9
    print(f"host  32 MiB f32, {workers} workers + 1 colocated server on one host (best of {trials}x{reps})")
    print(f"  memcpy (numpy, one core)            {copy_gbps:6.2f} GB/s")
    base = best["stage off"]["best_s"]
    for name, r in best.items():
        print(f"  {name:<30}  {r['best_s'] * 1e3:7.1f} ms  (median {r['median_s'] * 1e3:6.1f})   "
              f"cpu {r['cpu']:4.2f}   vs stage off {base / r['best_s']:5.2f}x")
    out["host"] = {"workers": workers, "bytes": nbytes, "memcpy_GBps": copy_gbps, **best}


def _failover_worker(port: int, rank: int, workers: int, servers: int, nbytes: int, reps: int) -> None:
    """One worker of `bench_failover` (a child process, a host of its own):
    prints "go" before its timed loop, then the times and its CPU."""
    os.environ["GRADHUB_HOST_ID"] = f"failover-bench-{rank}"
    c = _core.Client(_core.ClientConfig(f"127.0.0.1:{port}", rank=rank, num_workers=workers, num_servers=servers,
                                        token=_env.job_token()))
    _timed_push_pulls(c, rank, workers, nbytes, reps)


def failover_run(nbytes: int, reps: int, failover: bool, kill_after: float | None) -> dict:
    """2 workers and 3 servers on loopback: rank 0's time per push_pull, CPU
    per wall second over every process; with `kill_after`, server 1 is
    killed that many seconds into the timed loop."""
    workers, servers = 2, 3
    port = free_port()
    sched = _core.start_scheduler(_core.SchedulerConfig(f"127.0.0.1:{port}", workers, servers, peer_timeout_ms=2000,
                                                        failover=failover, token=_env.job_token()))
    srv = [subprocess.Popen([sys.executable, "-m", "gradhub", "server", "--scheduler", f"127.0.0.1:{port}",
                             "--threads", "1", "--rank", str(s), "--advertise-addr", "127.0.0.1"],
                            stderr=subprocess.DEVNULL) for s in range(servers)]
    call = f"_failover_worker({port}, {{r}}, {workers}, {servers}, {nbytes}, {reps})"
    procs: list[subprocess.Popen] = []
    try:
        procs = _start_workers("failover", call, workers)
        cpu0 = [proc_cpu(s.pid) for s in srv]
        killed = None
        if kill_after is not None:
            time.sleep(kill_after)
            srv[1].kill()
            killed = time.perf_counter()
        res = [json.loads(p.stdout.readline()) for p in procs]
        server_cpu = sum(proc_cpu(s.pid) - c for s, c in zip(srv, cpu0) if s.poll() is None)
        for p in procs:
            p.wait(timeout=60)
        sched.wait()
    finally:
        for p in [*procs, *srv]:
            if p.poll() is None:
                p.kill()
            p.wait()
    t = res[0]["times"]
    return {"best_s": min(t), "median_s": statistics.median(t), "worst_s": max(t), "killed": killed is not None,
            "cpu": (sum(r["cpu"] for r in res) + server_cpu) / sum(t), "ok": all(r["ok"] for r in res)}


def bench_failover(args, out):
    """What surviving a lost server costs while none is lost (results kept
    apart and copied once whole), and what losing one costs."""
    nbytes = 32 << 20
    reps = 6 if args.quick else 15
    trials = 1 if args.quick else 3
    best: dict[str, dict] = {}
    for _ in range(trials):
        for name, on in (("failover off", False), ("failover on", True)):
            r = failover_run(nbytes, reps, on, None)
            if not r["ok"]:
                raise RuntimeError(f"bench failover: wrong sum with {name}")
            if name not in best or r["best_s"] < best[name]["best_s"]:
                best[name] = r
    lost = failover_run(nbytes, reps, True, 0.1)  # a few push_pulls into the timed loop
    if not lost["ok"]:
        raise RuntimeError("bench failover: wrong sum after losing a server")
    print(f"failover  32 MiB f32, 2 workers + 3 servers on loopback (best of {trials}x{reps})")
    base = best["failover off"]["best_s"]
    for name, r in best.items():
        print(f"  {name:<14}  {r['best_s'] * 1e3:7.1f} ms  (median {r['median_s'] * 1e3:6.1f})   "
              f"cpu {r['cpu']:4.2f}   vs off {base / r['best_s']:5.2f}x")
    print(f"  server 1 killed mid-run: every sum exact; slowest push_pull {lost['worst_s'] * 1e3:7.1f} ms "
          f"(median {lost['median_s'] * 1e3:6.1f}, with 2 servers left)")
    out["failover"] = {"bytes": nbytes, **best, "lost": lost}


def _state_worker(port: int, rank: int, workers: int, mode: str, calls: int, every: int) -> None:
    """One worker of `bench_state` (a child process): `calls` push_pulls of
    mixed small sizes, printing its progress (and its own memory) every
    `every` calls, then its time per call."""
    import gradhub
    from gradhub import api

    os.environ.update(GRADHUB_SCHEDULER=f"127.0.0.1:{port}", GRADHUB_NUM_WORKERS=str(workers),
                      GRADHUB_NUM_SERVERS="1", GRADHUB_RANK=str(rank))
    gradhub.init()
    sizes = (1024, 256, 4096, 1000)  # 4 KiB, 1 KiB, 16 KiB, 4000 B
    bufs = [np.zeros(n, np.float32) for n in sizes]
    ok, t0 = True, time.perf_counter()
    for i in range(calls):
        a = bufs[i % len(sizes)]
        a.fill(rank + 1)
        if mode == "named":
            gradhub.push_pull(a, name=f"metric.{i % len(sizes)}")
        elif mode == "unnamed":
            gradhub.push_pull(a)
        else:  # "unique": what unnamed calls did before they freed their state
            gradhub.push_pull(a, name=f"unique.{i}")
        ok &= bool(a[0] == workers * (workers + 1) / 2)
        if (i + 1) % every == 0:
            print(json.dumps({"calls": i + 1, "rss": rss_mb(os.getpid()), "tensors": api._require().num_tensors()}),
                  flush=True)
    print(json.dumps({"per_call_s": (time.perf_counter() - t0) / calls, "ok": ok}), flush=True)
    gradhub.shutdown()


def state_run(mode: str, calls: int, every: int, workers: int = 2) -> dict:
    """A scheduler, one server and `workers` worker processes on this host;
    memory of each role as the calls go on."""
    port = free_port()
    env = {**os.environ, "GRADHUB_LOG": "warn"}
    sched = subprocess.Popen([sys.executable, "-m", "gradhub", "scheduler", "--bind", f"127.0.0.1:{port}",
                              "--workers", str(workers), "--servers", "1"], stderr=subprocess.DEVNULL, env=env)
    server = subprocess.Popen([sys.executable, "-m", "gradhub", "server", "--scheduler", f"127.0.0.1:{port}",
                               "--threads", "1", "--advertise-addr", "127.0.0.1"], stderr=subprocess.DEVNULL,
                              env=env)
    code = (f"from gradhub.bench.core import _state_worker; "
            f"_state_worker({port}, {{r}}, {workers}, {mode!r}, {calls}, {every})")
    procs = [subprocess.Popen([sys.executable, "-c", code.format(r=r)], stdout=subprocess.PIPE, text=True,
                              stderr=subprocess.DEVNULL, env=env) for r in range(workers)]
    samples = []
    try:
        while True:
            lines = [p.stdout.readline() for p in procs]
            if any(not line for line in lines):
                raise RuntimeError(f"bench state: a worker exited early ({mode})")
            recs = [json.loads(line) for line in lines]
            if "per_call_s" in recs[0]:
                break
            samples.append({"calls": recs[0]["calls"], "worker_mb": recs[0]["rss"],
                            "worker_tensors": recs[0]["tensors"], "server_mb": rss_mb(server.pid),
                            "scheduler_mb": rss_mb(sched.pid)})
        for p in procs:
            p.wait(timeout=60)
        server.wait(timeout=30)
        sched.wait(timeout=30)
    finally:
        for p in [*procs, server, sched]:
            if p.poll() is None:
                p.kill()
    return {"mode": mode, "calls": calls, "samples": samples, "per_call_s": max(r["per_call_s"] for r in recs),
            "ok": all(r["ok"] for r in recs)}


def bench_state(args, out):
    """Memory of every role over many small push_pulls (bounded state):
    unnamed calls free their tensors; the "unique" mode gives every
    call a new name that is never released (what unnamed calls would cost
    without their release); "named" reuses four names."""
    calls = 2_000 if args.quick else args.calls
    every = max(calls // 10, 1)
    res = []
    print(f"state  2 workers (one host) + 1 server, {calls} push_pulls of 1-16 KiB each; RSS in MB")
    print(f"  {'mode':<8} {'calls':>8} {'worker':>8} {'tensors':>8} {'server':>8} {'scheduler':>9}")
    for mode in ("named", "unnamed", "unique"):
        n = min(calls, args.unique_calls) if mode == "unique" else calls
        r = state_run(mode, n, max(n // 10, 1))
        if not r["ok"]:
            raise RuntimeError(f"bench state: wrong sum ({mode})")
        for s in r["samples"]:
            print(f"  {mode:<8} {s['calls']:8d} {s['worker_mb']:8.1f} {s['worker_tensors']:8d} "
                  f"{s['server_mb']:8.1f} {s['scheduler_mb']:9.1f}", flush=True)
        print(f"  {mode:<8} {r['per_call_s'] * 1e6:8.0f} us per call", flush=True)
        res.append(r)
    out["state"] = res


BENCHMARKS = ("transport", "latency", "priority", "sweep", "host", "state", "hostile", "failover")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("which", nargs="*", default=["all"], metavar="BENCH",
                    help="transport, latency, priority, sweep, host, state, hostile, failover or all (default all)")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--calls", type=int, default=100_000, help="state: push_pulls per mode (default 100000)")
    ap.add_argument("--unique-calls", type=int, default=20_000,
                    help="state: calls of the never-released mode, whose memory grows (default 20000)")
    ap.add_argument("--json", help="write raw results to this file")


def run(args) -> int:
    unknown = [w for w in args.which if w not in (*BENCHMARKS, "all")]
    if unknown:
        print(f"gradhub bench core: unknown benchmark {', '.join(unknown)} (choose from {', '.join(BENCHMARKS)}, all)",
              file=sys.stderr)
        return 2
    which = list(BENCHMARKS) if "all" in args.which else args.which
    args.tcp_baseline, args.no_baseline = None, ""
    if {"transport", "latency"} & set(which):
        try:
            args.tcp_baseline = tcp_baseline()  # before anything runs: build it, or say why not
        except CheckoutError as e:
            args.no_baseline = str(e)
            print(f"gradhub bench core: without the raw-TCP baseline, transport and latency print gradhub's "
                  f"figures alone: {e}", file=sys.stderr)
    out = {"simd": _core.kernel_simd_level(), "cpus": os.cpu_count()}
    for w in which:
        globals()[f"bench_{w}"](args, out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0
