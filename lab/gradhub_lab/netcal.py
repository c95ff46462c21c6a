"""`gradhub-lab calibrate --emulated`: the costs only the emulated cluster
has. First, the CPU its network path costs (veth pairs, the bridge, tc's
token buckets, a second host's TCP stack, the softirqs between them), which
the loopback microbenchmarks of costs.py never see; then a worker's
main-thread CPU per push_pull there (`main_thread`).

Measured with the lab's own emulated cluster (netns.py): clients on
one emulated host, an echo server on another, each of F connections sending
a message of S bytes and waiting for it back (a chunk's push and its result),
at a few rates and connection counts and two message sizes; and the same
programs on one host's loopback. CPU is what the two processes report for
themselves plus the machine's softirq time and ksoftirqd threads over the
run, so other processes on the machine do not count. Per message crossing
the path one way, CPU = per message + bytes x per byte (the two sizes give
both); the emulated path's cost is the emulated figure minus the loopback
one (whose TCP cost the calibration already charges as tcp_cpu_per_byte)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

PORT = 29431
SIZES = (16 << 10, 256 << 10)

# Both ends of one run, as one script: `server IP F S` or `client IP F S SECONDS`.
# Each prints one JSON line: its own CPU seconds and the messages it completed.
_ECHO = r"""
import json, os, socket, sys, threading, time
role, ip, flows, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
done = [0] * flows
def exact(s, buf):
    v, got = memoryview(buf), 0
    while got < len(buf):
        n = s.recv_into(v[got:])
        if not n:
            return False
        got += n
    return True
def serve(s, i):
    buf = bytearray(size)
    while exact(s, buf):
        s.sendall(buf)
        done[i] += 1
def ask(i, until):
    s = socket.create_connection((ip, %d))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(size)
    while time.monotonic() < until:
        s.sendall(buf)
        exact(s, buf)
        done[i] += 1
    s.close()
if role == "server":
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((ip, %d)); ls.listen(flows)
    print("ready", flush=True)
    conns = [ls.accept()[0] for _ in range(flows)]
    for c in conns:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ts = [threading.Thread(target=serve, args=(c, i)) for i, c in enumerate(conns)]
else:
    until = time.monotonic() + float(sys.argv[5])
    ts = [threading.Thread(target=ask, args=(i, until)) for i in range(flows)]
for t in ts: t.start()
for t in ts: t.join()
t = os.times()
print(json.dumps({"cpu": t.user + t.system, "messages": sum(done)}), flush=True)
""" % (PORT, PORT)


def _kernel_cpu() -> float:
    """Seconds of softirq and irq time, machine-wide, plus the ksoftirqd threads' CPU."""
    hz = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    total = v[5] + v[6]   # irq, softirq
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                st = f.read()
        except OSError:
            continue
        if "(ksoftirqd/" in st:
            fields = st.rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])   # utime, stime
    return total / hz


def _echo(server: list[str], client: list[str], ip: str, flows: int, size: int, seconds: float) -> tuple[float, int]:
    """(CPU seconds, messages each way) of one echo run; `server`/`client`
    prefix the command (`ip netns exec NS`)."""
    py = [sys.executable, "-c", _ECHO]
    srv = subprocess.Popen(server + py + ["server", ip, str(flows), str(size)], stdout=subprocess.PIPE, text=True)
    try:
        if srv.stdout.readline().strip() != "ready":
            raise RuntimeError("echo server did not start")
        k0 = _kernel_cpu()
        cli = subprocess.run(client + py + ["client", ip, str(flows), str(size), str(seconds)],
                             capture_output=True, text=True, timeout=seconds + 30, check=True)
        out, _ = srv.communicate(timeout=30)
        k1 = _kernel_cpu()
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()
    c, s = json.loads(cli.stdout.splitlines()[-1]), json.loads(out.splitlines()[-1])
    return c["cpu"] + s["cpu"] + (k1 - k0), c["messages"]


def _fit(points: dict[int, tuple[float, int]]) -> tuple[float, float]:
    """(CPU per message, CPU per byte) through one crossing, from runs at the two sizes."""
    per = {size: cpu / (2 * msgs) for size, (cpu, msgs) in points.items()}   # each message crosses twice
    small, big = SIZES
    per_byte = max(0.0, (per[big] - per[small]) / (big - small))
    return max(0.0, per[small] - small * per_byte), per_byte


def measure(rates=("500mbit", "1gbit"), flows=(1, 4), seconds: float = 2.0, log=print) -> dict:
    """The emulated path's CPU per message and per byte beyond loopback's,
    at each rate and connection count; the medians are what the simulator uses."""
    from .netns import EmulatedCluster

    rows = []
    with EmulatedCluster(["a"], rate=None) as c:
        a = c.hosts["a"].cmd([])
        loop = {f: _fit({s: _echo(a, a, "127.0.0.1", f, s, seconds) for s in SIZES}) for f in flows}
    for rate in rates:
        with EmulatedCluster(["a", "b"], rate=rate) as c:
            a, b = c.hosts["a"], c.hosts["b"]
            for f in flows:
                emu = _fit({s: _echo(b.cmd([]), a.cmd([]), b.ip, f, s, seconds) for s in SIZES})
                row = {"rate": rate, "flows": f, "msg_s": emu[0] - loop[f][0], "byte_s": emu[1] - loop[f][1],
                       "loop_msg_s": loop[f][0], "loop_byte_s": loop[f][1]}
                log(f"  {rate:>8s}, {f} connection(s): {row['msg_s'] * 1e6:6.1f} us per message, "
                    f"{row['byte_s'] * 1e9:.3f} ns per byte beyond loopback "
                    f"(loopback {loop[f][0] * 1e6:.1f} us, {loop[f][1] * 1e9:.3f} ns)")
                rows.append(row)
    return {"path_cpu_per_msg_s": max(0.0, statistics.median(r["msg_s"] for r in rows)),
            "path_cpu_per_byte": max(0.0, statistics.median(r["byte_s"] for r in rows)),
            "path_runs": rows, "path_source": f"gradhub-lab calibrate --emulated, {time.strftime('%Y-%m-%d %H:%M')}"}


def per_push_pull(extra_s: float, own_sends_s: float, push_pulls: int, alone_s: float) -> float:
    """The main thread's CPU per push_pull: what gradhub added to it per
    iteration, less the chunks it sent itself (charged apart), per
    push_pull; never below what one costs alone (`op_cpu_s`)."""
    return max(alone_s, (extra_s - own_sends_s) / max(1, push_pulls))


# The main-thread calibration's run: a model outside the validation set
# (validate.CONFIGS), so the table checks this cost rather than fits it.
MAIN_CONFIG = ("inception_v3", 4, 0, "1gbit")


def main_thread(costs, iters: int = 30, trials: int = 3, log=print) -> dict:
    """A worker's main-thread CPU per push_pull on the emulated cluster.

    `training.train` runs MAIN_CONFIG without synchronization and
    under gradhub; every worker reports its main (training) thread's CPU
    per iteration. What gradhub adds there, less what the simulator already
    charges that thread for the chunks it sends itself, per push_pull, is
    `emu_op_cpu_s`: the hooks, push_pull and the eager update's calls, at
    the cost they have while every host's threads share the cores
    (op_cpu_s is measured alone, on loopback)."""
    from dataclasses import replace as _replace

    from gradhub.plan.sim import GradhubSim

    from .training import train
    from .validate import Config, inputs, ran_with, train_spec

    model, workers, k, rate = MAIN_CONFIG
    c = Config(model, workers, k, rate)
    rc, records = train(train_spec(model, c.scale, workers, k, rate, ["none", "gradhub"], iters, 3, trials=trials))
    recs = {r["system"]: r for r in records}
    if rc != 0 or not {"none", "gradhub"} <= recs.keys():
        raise RuntimeError(f"the main-thread calibration run ({c.label}) failed")
    none, gh = recs["none"], recs["gradhub"]
    extra = (gh["main_cpu_ms"] - none["main_cpu_ms"]) / 1e3   # what gradhub adds to the thread, per iteration
    base = _replace(costs, emu_op_cpu_s=costs.op_cpu_s)
    sim = GradhubSim(*inputs(c, base, base.machine_cores, ran_with(gh), none["iter_time_mean"]), base)
    res = sim.run()
    msgs = len(sim.msgs)
    sends = res.main_sync_cpu_s - msgs * base.op_cpu_s
    per_op = per_push_pull(extra, sends, msgs, costs.op_cpu_s)
    log(f"  {c.label}: main thread {none['main_cpu_ms']:.1f} ms per iteration without synchronization, "
        f"{gh['main_cpu_ms']:.1f} ms with gradhub; {msgs} push_pulls, {sends * 1e3:.1f} ms of the thread's own sends "
        f"(the model's) -> {per_op * 1e6:.0f} us per push_pull (alone: {costs.op_cpu_s * 1e6:.0f} us)")
    return {"emu_op_cpu_s": per_op, "main_run": {"config": c.label, "none_main_cpu_ms": none["main_cpu_ms"],
                                                 "gradhub_main_cpu_ms": gh["main_cpu_ms"], "push_pulls": msgs,
                                                 "own_sends_ms": sends * 1e3}}
