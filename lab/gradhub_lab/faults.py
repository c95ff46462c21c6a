"""`gradhub-lab faults`: the fault campaign.

Runs many short jobs on loopback, each started role by role (a scheduler, 3
servers and 4 workers as separate processes, the way a multi-host job is
started, not under `gradhub launch`), and injects one fault into each at a
random moment of training:

  kill / stop     SIGKILL, or SIGSTOP for good (resumed only once the job has
                  ended), of a worker, a server or the scheduler;
  pause           SIGSTOP for a fraction of the peer timeout, then SIGCONT;
  stall           SIGSTOP of a server for 0.9 to 1.6 peer timeouts, then
                  SIGCONT: it comes back around the moment the job writes
                  it off, or to a job that has, and must not disturb it;
  raise           an exception in a worker's training loop;
  garbage / slow  a stranger's connection to the scheduler or a server that
                  sends random bytes, or half a frame header and then nothing;
  reset / flip /  on the links of one server, through a proxy between it and
  hold / cut      the workers (`gradhub_lab.proxy`): 1-3 resets of every
                  connection, 1-4 bytes flipped in either direction, nothing
                  forwarded for half the peer timeout (hold), or every
                  connection reset and none through for 1.5-2.5 peer
                  timeouts (cut: longer than a link is mended);
  partition       one worker cut off from one server, the others not (its
                  connections reset, new ones too), for 0.3-0.6 peer
                  timeouts, or (long) for 1.5-2.5;
  reset / flip /  on the control connections: every member reaches the
  freeze control  scheduler through a proxy; 1-3 resets of every connection,
                  1-3 bytes flipped in either direction, or every open
                  connection silent for good (freeze: neither end closes);
  restart service the job runs on a shared service (its scheduler and 3
                  server processes `--service`): the service is killed and
                  started again on its address 0.1-0.6 peer timeouts later.

Half the jobs encrypt every connection (GRADHUB_ENCRYPT=1).

Every worker checks every sum exactly (integer-valued data, summed in
float64 by every worker for every rank). In half the jobs (every job with
--quick) one more tensor has its optimizer on the servers (SGD with
momentum): every worker checks the parameters each round returns against
the same update computed in float32, so a server lost with its optimizer
state (it must move to the chunk's replica) shows as a wrong result. What
each fault must lead to:

  continue        a lost server (killed, stopped for good or stalled: its
                  chunks move to the others), a pause, a stranger's connection,
                  a link reset, changed or held, a partition (the worker
                  connects again and re-sends; the server counts each push
                  once; a server a worker cannot reach past the peer timeout,
                  cut or partitioned, is reported and failed over like a lost
                  one), a control connection reset, changed or frozen (the
                  session resumes), the scheduler or the service restarted (the job
                  is rebuilt): every worker passes, with every sum exact;
  fail            a lost worker or scheduler, an exception: every member still
                  running exits with an error within a bound (3 peer timeouts
                  after the fault), and the error names the member at fault.

A member still running after that bound is a hang; a sum that differs is a
wrong result. Both must be 0, and the command exits non-zero otherwise (or
when a job's outcome is not the one expected)."""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, Sequence, TypeVar

import numpy as np

from gradhub import tools
from gradhub.tools import free_port

from .proxy import Proxy

WORKERS, SERVERS = 4, 3
# (name, elements, dtype): several chunks each at the default partition size, one tiny, one unnamed.
TENSORS = (("big", 200_000, "float32"), ("half", 60_000, "float16"), ("small", 100, "float32"),
           (None, 3_000, "float32"))
# A float32 tensor whose optimizer runs on the servers: SGD, lr 0.5, momentum
# 0.5 (exact binary fractions, so the check can be exact).
OPT_SIZE, OPT_LR, OPT_MOMENTUM = 150_000, 0.5, 0.5


@dataclass(frozen=True)
class Fault:
    name: str
    # worker, server, scheduler, "stranger" (a connection from outside the job), "link" (a server's),
    # "control" (the members' to the scheduler), "service" (the job runs on a shared service)
    role: str
    # kill, stop, pause, stall, raise, garbage, slow, join (a new server starts), reset, flip, hold,
    # cut, partition, partition-long, restart (killed and started again on its address)
    action: str
    expect: str  # continue or fail
    count: int = 1  # members hit at once
    quick: bool = True  # in --quick (the test suite's)

    def describe(self) -> str:
        return f"{self.name:20s} expect: {self.expect}"


FAULTS = (
    Fault("kill server", "server", "kill", "continue"),
    Fault("stop server", "server", "stop", "continue"),
    Fault("pause server", "server", "pause", "continue"),
    Fault("stall server", "server", "stall", "continue"),
    Fault("kill 2 servers", "server", "kill", "continue", count=2),
    Fault("server joins", "server", "join", "continue"),
    Fault("kill worker", "worker", "kill", "fail"),
    Fault("stop worker", "worker", "stop", "fail"),
    Fault("pause worker", "worker", "pause", "continue"),
    Fault("raise in worker", "worker", "raise", "fail"),
    Fault("restart scheduler", "scheduler", "restart", "continue"),
    Fault("stop scheduler", "scheduler", "stop", "fail"),
    Fault("pause scheduler", "scheduler", "pause", "continue"),
    Fault("garbage connection", "stranger", "garbage", "continue"),
    Fault("slow connection", "stranger", "slow", "continue"),
    Fault("reset links", "link", "reset", "continue"),
    Fault("flip bytes", "link", "flip", "continue"),
    Fault("hold links", "link", "hold", "continue"),
    Fault("cut links", "link", "cut", "continue", quick=False),
    Fault("partition", "link", "partition", "continue"),
    Fault("long partition", "link", "partition-long", "continue", quick=False),
    Fault("reset control", "control", "reset", "continue"),
    Fault("flip control", "control", "flip", "continue"),
    Fault("freeze control", "control", "freeze", "continue", quick=False),
    Fault("restart service", "service", "restart", "continue"),
)


def _data(seed: int, step: int, tensor: int, rank: int, size: int, dtype) -> np.ndarray:
    rng = np.random.default_rng([seed, step, tensor, rank])
    return rng.integers(-4, 5, size).astype(dtype)


def _worker(steps: int, seed: int, raise_at: int, server_opt: bool = False) -> None:
    """One worker of a trial (a child process; its job comes from GRADHUB_*):
    prints STEP lines, WRONG and exits 3 on a sum that differs, PASS at the
    end. `raise_at` >= 0 raises an exception at that step (the fault).
    `server_opt`: one more tensor, with its optimizer on the servers."""
    import gradhub

    gradhub.init()
    r, n = gradhub.rank(), gradhub.size()
    opt = len(TENSORS)  # the optimizer tensor's index in the data seeds
    if server_opt:
        tools.set_server_optimizer("opt", OPT_SIZE, "sgd", OPT_LR, momentum=OPT_MOMENTUM)
        params = _data(seed, 0, opt + 1, r, OPT_SIZE, np.float32)
        gradhub.push_pull_async(params, name="opt", init=True).wait(60)  # every worker gets worker 0's
        momentum = None
    lr, mom, avg = np.float32(OPT_LR), np.float32(OPT_MOMENTUM), np.float32(1 / n)
    for s in range(steps):
        if s == raise_at:
            raise RuntimeError(f"fault injected into worker {r} at step {s}")
        handles = []
        for i, (name, size, dtype) in enumerate(TENSORS):
            x = _data(seed, s, i, r, size, dtype)
            handles.append((i, x, gradhub.push_pull_async(x, name=name)))
        if server_opt:
            x = _data(seed, s, opt, r, OPT_SIZE, np.float32)
            handles.append((opt, x, gradhub.push_pull_async(x, name="opt", average=True)))
        for i, x, h in handles:
            h.wait(60)
            if i == opt:
                # The servers' update (server/optimizer.rs), op for op in float32.
                grad = sum(_data(seed, s, opt, q, OPT_SIZE, np.float64) for q in range(n)).astype(np.float32) * avg
                momentum = grad if momentum is None else mom * momentum + np.float32(1) * grad
                params = params + (-lr) * momentum
                got, want = x, params
            else:
                _, size, dtype = TENSORS[i]
                got = x.astype(np.float64)
                want = sum(_data(seed, s, i, q, size, np.float64) for q in range(n))
            if not np.array_equal(got, want):
                bad = np.flatnonzero(got != want)
                print(f"WRONG step {s} tensor {i}: {bad.size} element(s) differ, first at {bad[:5]}", flush=True)
                os._exit(3)
        print(f"STEP {s}", flush=True)
        time.sleep(0.02)
    print("PASS", flush=True)
    gradhub.shutdown()


@dataclass
class Trial:
    """One job and its fault: its processes, logs and what happened."""
    fault: Fault
    seed: int
    peer_timeout: float
    host_stage: bool
    steps: int
    server_opt: bool
    logdir: Path
    encrypt: bool = False
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    exited: dict[str, float] = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    conns: list[socket.socket] = field(default_factory=list)
    # By server, the proxy its workers reach it through (link faults); the
    # one every member reaches the scheduler through (control faults).
    proxies: list[Proxy] = field(default_factory=list)

    argv: dict[str, list[str]] = field(default_factory=dict)

    def spawn(self, name: str, argv: list[str], env: dict, append: bool = False) -> None:
        self.argv[name] = argv
        with open(self.logdir / f"{name}.log", "ab" if append else "wb") as f:
            self.procs[name] = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT,
                                                start_new_session=True)

    def restart(self, name: str) -> None:
        """Kill `name` (SIGKILL) and start it again as it was; its log goes on."""
        _signal(self.procs[name], signal.SIGKILL)
        self.procs[name].wait()
        self.exited.pop(name, None)
        self.spawn(name, self.argv[name], self.env, append=True)

    def log(self, name: str) -> str:
        try:
            return (self.logdir / f"{name}.log").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def poll(self) -> None:
        now = time.monotonic()
        for name, p in self.procs.items():
            if name not in self.exited and p.poll() is not None:
                self.exited[name] = now

    def kill_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait()
        for c in self.conns:
            c.close()
        for px in self.proxies:
            px.close()


def _start(t: Trial, rng: random.Random) -> tuple[int, list[int], int]:
    """Start the job's processes; returns the scheduler's port, the
    servers' ports and the worker that raises (for that fault)."""
    port, sports = free_port(), [free_port() for _ in range(SERVERS)]
    base = {k: v for k, v in os.environ.items() if not k.startswith("GRADHUB_") or k == "GRADHUB_LOG"}
    base.update(PYTHONUNBUFFERED="1", GRADHUB_SCHEDULER=f"127.0.0.1:{port}", GRADHUB_NUM_WORKERS=str(WORKERS),
                GRADHUB_NUM_SERVERS=str(SERVERS), GRADHUB_PEER_TIMEOUT=str(t.peer_timeout),
                GRADHUB_HOST_REDUCE="1" if t.host_stage else "0", GRADHUB_JOB_TOKEN=secrets.token_hex(16),
                GRADHUB_ENCRYPT="1" if t.encrypt else "0")
    py = [sys.executable, "-m", "gradhub"]
    if t.fault.role == "control":
        # Every member reaches the scheduler (on 127.0.0.1) through a proxy on 127.0.0.2.
        t.proxies = [Proxy("127.0.0.2", port, "127.0.0.1", port)]
        base["GRADHUB_SCHEDULER"] = f"127.0.0.2:{port}"
    t.env = base
    if t.fault.role == "service":
        # A shared service and its server processes; the job is one of its tenants.
        master = secrets.token_hex(16)
        job = f"faults{t.seed}"
        svc_env = dict(base, GRADHUB_SERVICE_TOKEN=master)
        svc_env.pop("GRADHUB_JOB_TOKEN")
        t.spawn("scheduler", py + ["scheduler", "--service", "--bind", f"127.0.0.1:{port}"], svc_env)
        for s in range(SERVERS):
            t.spawn(f"server{s}", py + ["server", "--service", "--threads", "1", "--advertise-addr", "127.0.0.1"],
                    dict(svc_env, GRADHUB_HOST_ID=f"faults-server{s}"))
        base.update(GRADHUB_JOB=job, GRADHUB_JOB_TOKEN=tools.job_token(master, job))
        t.env = svc_env  # a restart starts the service as it was
        _wait_for_servers(t, SERVERS)
    # With a link fault the workers reach each server through a proxy: the
    # server listens on 127.0.0.1 and advertises 127.0.0.2, where it is.
    via = "127.0.0.2" if t.fault.role == "link" else "127.0.0.1"
    if via != "127.0.0.1":
        t.proxies = [Proxy(via, p, "127.0.0.1", p) for p in sports]
    if t.fault.role != "service":
        t.spawn("scheduler", py + ["scheduler", "--bind", f"127.0.0.1:{port}"], base)
        for s in range(SERVERS):
            t.spawn(f"server{s}", py + ["server", "--threads", "1", "--rank", str(s), "--advertise-addr", via,
                                        "--bind-host", "127.0.0.1", "--port", str(sports[s])],
                    dict(base, GRADHUB_HOST_ID=f"faults-server{s}"))
    raise_at = rng.randrange(1, t.steps - 1) if t.fault.action == "raise" else -1
    victim = rng.randrange(WORKERS)
    for r in range(WORKERS):
        code = (f"from gradhub_lab.faults import _worker; "
                f"_worker({t.steps}, {t.seed}, {raise_at if r == victim else -1}, {t.server_opt})")
        # Two workers per host with the host stage, so it is under test too.
        host = f"faults-host{r // 2 if t.host_stage else r}"
        t.spawn(f"worker{r}", [sys.executable, "-c", code], dict(base, GRADHUB_RANK=str(r), GRADHUB_HOST_ID=host))
    return port, sports, victim


def _wait_for_servers(t: Trial, n: int, timeout: float = 60) -> None:
    """Until the service's log says `n` server processes joined it."""
    deadline = time.monotonic() + timeout
    while t.log("scheduler").count(" joined from ") < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the service's servers did not join within {timeout}s:\n" + t.log("scheduler"))
        time.sleep(0.05)


def _stranger(addr: tuple[str, int], kind: str, rng: random.Random) -> socket.socket | None:
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect(addr)
        if kind == "garbage":
            s.send(rng.randbytes(rng.randrange(1, 200)))
        else:  # the start of a frame header (gradhub's magic and version), then nothing
            s.send(tools.encode_frame(16)[:4])
        return s
    except OSError:
        s.close()
        return None


def _targets(t: Trial, rng: random.Random) -> list[str]:
    if t.fault.role in ("scheduler", "service", "control"):
        return ["scheduler"]
    n = WORKERS if t.fault.role == "worker" else SERVERS
    return [f"{t.fault.role}{r}" for r in sorted(rng.sample(range(n), t.fault.count))]


def _signal(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass


def _names_targets(t: Trial, targets: list[str]) -> bool:
    """Whether, for each member at fault, some other member's log names it."""
    def named(target: str) -> bool:
        role = target.rstrip("0123456789")
        word = f"{role} {target[len(role):]}" if role != "scheduler" else "scheduler"
        return any(word in t.log(n) for n in t.procs if n not in targets)
    return all(named(x) for x in targets)


def run_trial(fault: Fault, seed: int, peer_timeout: float, steps: int, logroot: Path,
              server_opt: bool | None = None) -> dict:
    """One job and its fault. `server_opt`: whether it has a tensor with its
    optimizer on the servers (default: one job in two, never when two
    servers are lost at once, which may take a chunk's replica too)."""
    rng = random.Random(seed)
    if fault.action == "join":
        steps = max(steps, 100)  # time for the new server to start and join
    logdir = logroot / f"trial{seed}"
    logdir.mkdir(parents=True, exist_ok=True)
    host_stage, coin, encrypt = rng.random() < 0.5, rng.random() < 0.5, rng.random() < 0.5
    server_opt = (coin if server_opt is None else server_opt) and fault.count == 1
    t = Trial(fault, seed, peer_timeout, host_stage=host_stage, steps=steps, logdir=logdir, server_opt=server_opt,
              encrypt=encrypt)
    res: dict = {"fault": fault.name, "seed": seed, "host_stage": t.host_stage, "server_opt": server_opt,
                 "encrypted": encrypt}
    try:
        port, sports, victim = _start(t, rng)
        # The fault lands at a random moment of training (the raise is at a random step).
        deadline = time.monotonic() + 120
        while "STEP 0" not in t.log("worker0"):
            t.poll()
            if time.monotonic() > deadline or "worker0" in t.exited:
                res.update(outcome="did not start", ok=False, hang=False, wrong=False,
                           logs={n: t.log(n)[-2000:] for n in t.procs})
                return res
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.8))
        targets = _targets(t, rng) if fault.role != "stranger" else []
        fault_at = time.monotonic()
        if fault.action in ("kill", "stop", "pause", "stall"):
            for x in targets:
                _signal(t.procs[x], signal.SIGKILL if fault.action == "kill" else signal.SIGSTOP)
        elif fault.action == "restart":
            # Killed; started again on its address at a random moment within
            # the peer timeout (the members dial it that long). A service
            # the same way: its server processes dial it again too.
            _signal(t.procs["scheduler"], signal.SIGKILL)
            t.procs["scheduler"].wait()
            time.sleep(rng.uniform(0.1, 0.6) * peer_timeout)
            t.restart("scheduler")
            fault_at = time.monotonic()  # back to training is counted from its return
        elif fault.role == "stranger":
            where = rng.choice([("scheduler", port)] + [(f"server{s}", p) for s, p in enumerate(sports)])
            targets = [where[0]]
            for _ in range(rng.randrange(1, 5)):
                c = _stranger(("127.0.0.1", where[1]), fault.action, rng)
                if c is not None:
                    t.conns.append(c)
        elif fault.action == "join":
            targets = [f"server{SERVERS}"]
            t.spawn(targets[0], [sys.executable, "-m", "gradhub", "server", "--threads", "1", "--advertise-addr",
                                 "127.0.0.1", "--bind-host", "127.0.0.1"],
                    dict(t.env, GRADHUB_HOST_ID=f"faults-server{SERVERS}"))
        elif fault.role in ("link", "control"):
            s = rng.randrange(SERVERS) if fault.role == "link" else 0
            targets, px = ([f"server{s}"] if fault.role == "link" else ["scheduler"]), t.proxies[s]
            if fault.action == "reset":
                for _ in range(rng.randrange(1, 4)):
                    px.reset()
                    time.sleep(rng.uniform(0.05, 0.3))
            elif fault.action == "freeze":
                # For good: both ends live, and each takes its connection for
                # broken after the keep-alive (half the peer timeout).
                px.freeze()
            elif fault.action == "flip" and fault.role == "control":
                # Control traffic is a few hundred bytes a second: each flip soon, and waited for.
                for _ in range(rng.randrange(1, 4)):
                    done, until = px.flips_done, time.monotonic() + 10 * peer_timeout
                    px.flip(rng.choice(("up", "down")), after=rng.randrange(0, 400), mask=1 << rng.randrange(8))
                    while px.flips_done == done and time.monotonic() < until:
                        time.sleep(0.01)
                    time.sleep(rng.uniform(0.05, 0.3))
            elif fault.action == "flip":
                for _ in range(rng.randrange(1, 5)):
                    px.flip(rng.choice(("up", "down")), after=rng.randrange(0, 1 << 20), mask=1 << rng.randrange(8))
                    time.sleep(rng.uniform(0.05, 0.3))
            elif fault.action == "hold":
                px.down()
                time.sleep(peer_timeout * 0.5)
                px.up()
            elif fault.action == "cut":
                # Every connection lost (reset) and no new one through.
                px.reset()
                px.down()
                time.sleep(rng.uniform(1.5, 2.5) * peer_timeout)
                px.up()
            else:  # one worker cut off from this server only
                w = rng.randrange(WORKERS)
                res["partitioned"] = f"worker{w}"
                px.cut(w)
                long = fault.action == "partition-long"
                time.sleep((rng.uniform(1.5, 2.5) if long else rng.uniform(0.3, 0.6)) * peer_timeout)
                px.restore(w)
            res["flips"] = px.flips_done
            fault_at = time.monotonic()  # back to training is counted from the fault's end
        elif fault.action == "raise":
            targets = [f"worker{victim}"]
            # The exception comes at its step: time the reports from its worker's exit.
            while targets[0] not in t.exited and time.monotonic() < deadline + 60:
                t.poll()
                time.sleep(0.01)
            fault_at = t.exited.get(targets[0], fault_at)
        res["target"] = "+".join(targets)
        # Members out of the job: killed, stopped for good, or raised (they exit with an error).
        # (A server cut off past the peer timeout is written off: it exits with an error.)
        out = ("kill", "stop", "stall", "raise", "cut", "partition-long")
        lost = set(targets) if fault.action in out else set()
        stopped = targets if fault.action == "stop" else []
        # A pause ends well before the peer timeout; a stall around the
        # moment the job writes the member off, or just after.
        resume_at = {"pause": 0.3, "stall": rng.uniform(0.9, 1.6)}.get(fault.action)
        resume_at = None if resume_at is None else fault_at + peer_timeout * resume_at
        # Bound: 3 peer timeouts for the fault to be reported everywhere, plus the rest of the job's run.
        bound = fault_at + 3 * peer_timeout + 30
        report_at = takeover_at = back_at = rejoined_at = None
        lost_server = (fault.role == "server" and fault.action in ("kill", "stop", "stall")) or fault.action in (
            "cut", "partition-long")
        steps_at_fault = t.log("worker0").count("STEP ")
        while True:
            t.poll()
            now = time.monotonic()
            if back_at is None and fault.expect == "continue" and t.log("worker0").count("STEP ") > steps_at_fault:
                back_at = now
            if resume_at is not None and now >= resume_at:
                for x in targets:
                    _signal(t.procs[x], signal.SIGCONT)
                resume_at = None
            running = [n for n in t.procs if n not in t.exited and n not in stopped
                       and not (fault.action in ("kill", "stall") and n in lost)
                       and (fault.role != "service" or n.startswith("worker"))]  # a service outlives its jobs
            if fault.expect == "fail" and report_at is None and any(
                    n in t.exited and t.procs[n].returncode != 0 for n in t.procs if n not in lost):
                report_at = now
            if lost_server and takeover_at is None and t.log("scheduler").count("taken over") >= len(targets):
                takeover_at = now
            if fault.action == "restart" and rejoined_at is None and "job rebuilt" in t.log("scheduler"):
                rejoined_at = now
            if not running or now > bound:
                break
            time.sleep(0.02)
        hung = [n for n in running if n not in t.exited]
        # A member stopped for good, or stalled, must exit once resumed (it
        # finds the job over, or itself out of it).
        for x in stopped + (targets if fault.action == "stall" else []):
            _signal(t.procs[x], signal.SIGCONT)
            try:
                t.procs[x].wait(timeout=3 * peer_timeout + 5)
            except subprocess.TimeoutExpired:
                hung.append(f"{x} (after it was resumed)")
            t.poll()
        wrong = [n for n in t.procs if "WRONG" in t.log(n)]
        passed = [n for n in t.procs if n.startswith("worker") and "PASS" in t.log(n)
                  and t.procs[n].returncode == 0]
        survivors = [n for n in t.procs if n not in lost]
        failed = [n for n in survivors if t.procs[n].returncode not in (0, None)]
        if fault.action == "join":
            # It joined while the job ran (not after: then it is refused).
            res["joined"] = "joined the running job" in t.log("scheduler")
        if fault.expect == "continue":
            if back_at is not None:
                res["back_s"] = back_at - fault_at
            if rejoined_at is not None:
                res["rejoined_s"] = rejoined_at - fault_at
            ok = len(passed) == WORKERS and not failed and not hung and res.get("joined", True)
            outcome = "continued" if ok else "failed" if failed else "incomplete"
        else:
            # Everyone else exits with an error, and some error names the member at fault.
            ok = not hung and len(failed) == len(survivors) and _names_targets(t, targets)
            outcome = "failed, reported" if ok else "not reported as expected"
            if report_at is not None:
                res["first_report_s"] = report_at - fault_at
            ends = [t.exited[n] for n in survivors if n in t.exited]
            if ends and not hung:
                res["all_down_s"] = max(ends) - fault_at
        taken_over = t.log("scheduler").count("taken over") >= len(targets)
        # A stalled server back before the peer timeout was never lost.
        if lost_server and (taken_over or fault.action in ("kill", "stop")):
            res["taken_over"] = taken_over
            if takeover_at is not None:
                res["takeover_s"] = takeover_at - fault_at
        res.update(outcome=outcome, ok=ok and not wrong, hang=bool(hung), hung=hung, wrong=bool(wrong),
                   returncodes={n: p.returncode for n, p in t.procs.items()})
        if not res["ok"]:
            res["logs"] = {n: t.log(n)[-3000:] for n in t.procs}
        return res
    finally:
        t.kill_all()


def summarize(results: list[dict]) -> dict:
    by: dict[str, list[dict]] = {}
    for r in results:
        by.setdefault(r["fault"], []).append(r)
    rows = {}
    for name, rs in by.items():
        down = [r["all_down_s"] for r in rs if "all_down_s" in r]
        first = [r["first_report_s"] for r in rs if "first_report_s" in r]
        over = [r["takeover_s"] for r in rs if "takeover_s" in r]
        back = [r["back_s"] for r in rs if "back_s" in r]
        rows[name] = {"trials": len(rs), "as_expected": sum(r["ok"] for r in rs), "hangs": sum(r["hang"] for r in rs),
                      "wrong": sum(r["wrong"] for r in rs),
                      "continued": sum(r["outcome"] == "continued" for r in rs),
                      "first_report_median_s": statistics.median(first) if first else None,
                      "all_down_median_s": statistics.median(down) if down else None,
                      "all_down_max_s": max(down) if down else None,
                      "takeover_median_s": statistics.median(over) if over else None,
                      "back_median_s": statistics.median(back) if back else None,
                      "back_max_s": max(back) if back else None}
    lost = [r for r in results if "taken_over" in r]
    return {"trials": len(results), "as_expected": sum(r["ok"] for r in results),
            "hangs": sum(r["hang"] for r in results), "wrong": sum(r["wrong"] for r in results),
            "continued_after_server_loss": sum(r["outcome"] == "continued" for r in lost),
            "server_losses": len(lost),
            "continued_with_server_optimizer": sum(r["outcome"] == "continued" for r in lost if r["server_opt"]),
            "server_losses_with_server_optimizer": sum(bool(r["server_opt"]) for r in lost), "by_fault": rows}


def _fmt(x: float | None) -> str:
    return "    -" if x is None else f"{x:5.2f}"


class _Named(Protocol):
    name: str

    def describe(self) -> str: ...


F = TypeVar("F", bound=_Named)


def write_results(path: str, seed0: int, peer_timeout: float, steps: int, summary: dict, results: list) -> None:
    """A campaign's summary and trials (without their logs) as JSON, for docs/bench."""
    with open(path, "w") as f:
        json.dump({"seed": seed0, "peer_timeout": peer_timeout, "steps": steps, "summary": summary,
                   "trials": [{k: v for k, v in r.items() if k != "logs"} for r in results]}, f, indent=1)


def select_faults(faults: Sequence[F], args, prog: str, default: Sequence[F] | None = None) -> list[F] | int:
    """The faults a campaign (this one, `gradhub-lab faults --elastic`)
    injects, from `--list` and `--faults`: with `--list`, each fault's line
    printed and the exit status 0; with `--faults`, those named, in the
    campaign's order (an unknown name, or none: said on stderr, status 2);
    else `default` (all of them)."""
    if args.list:
        for f in faults:
            print(f.describe())
        return 0
    if not args.faults:
        return list(faults if default is None else default)
    wanted = [x.strip() for x in args.faults.split(",") if x.strip()]
    unknown = [w for w in wanted if w not in {f.name for f in faults}]
    if unknown or not wanted:
        print(f"{prog}: unknown fault(s) {unknown or [args.faults]}; see {prog} --list", file=sys.stderr)
        return 2
    return [f for f in faults if f.name in wanted]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--trials", type=int, default=60,
                    help="jobs to run (default 60; faults in turn, each at a random moment)")
    ap.add_argument("--faults", help="comma list of faults to inject (default: all; see --list)")
    ap.add_argument("--list", action="store_true", help="list the faults and exit")
    ap.add_argument("--seed", type=int, default=None, help="first trial's seed (default: random)")
    ap.add_argument("--peer-timeout", type=float, default=2.0, help="the jobs' peer timeout, seconds (default 2)")
    ap.add_argument("--steps", type=int, default=40, help="training steps per job (default 40)")
    ap.add_argument("--quick", action="store_true",
                    help="one trial per fault but 'kill 2 servers', 'cut links', 'long partition' and 'freeze control', "
                         "25 steps each "
                         "(the test suite's)")
    ap.add_argument("--server-optimizer", choices=("half", "always", "never"), default=None,
                    help="jobs with a tensor whose optimizer runs on the servers (default: half, always with "
                         "--quick; never when two servers are lost at once)")
    ap.add_argument("--elastic", action="store_true",
                    help="the elastic campaign instead (gradhub_lab.elastic_faults): elastic jobs on a shared "
                         "service losing or gaining workers (kill, stop, kill 2, add); --trials, --faults, --list, "
                         "--seed, --peer-timeout, --steps (halved), --quick, --json and --keep-logs apply")
    ap.add_argument("--json", help="write every trial's result to this file")
    ap.add_argument("--keep-logs", action="store_true", help="keep every trial's logs (default: failed trials' only)")


def run(args) -> int:
    # Two servers lost at once still ends some jobs with an error (not a hang,
    # not a wrong sum; docs/reliability.md): in the full campaign, not in --quick.
    faults = select_faults(FAULTS, args, "gradhub-lab faults",
                           default=[f for f in FAULTS if not (args.quick and (f.count > 1 or not f.quick))])
    if isinstance(faults, int):
        return faults
    trials = len(faults) if args.quick else args.trials
    steps = 25 if args.quick else args.steps
    if steps < 4:
        print("gradhub-lab faults: --steps must be at least 4", file=sys.stderr)
        return 2
    seed0 = args.seed if args.seed is not None else random.randrange(1 << 30)
    mode = args.server_optimizer or ("always" if args.quick else "half")
    server_opt = {"half": None, "always": True, "never": False}[mode]
    logroot = Path(tempfile.mkdtemp(prefix="gradhub-faults-"))
    print(f"faults  {trials} job(s) of {WORKERS} workers + {SERVERS} servers + scheduler, each started role by role "
          f"on loopback; peer timeout {args.peer_timeout} s, {steps} steps; seeds from {seed0}", flush=True)
    results, t0 = [], time.monotonic()
    for i in range(trials):
        fault = faults[i % len(faults)]
        r = run_trial(fault, seed0 + i, args.peer_timeout, steps, logroot, server_opt)
        results.append(r)
        times = "".join(f" {k}={r[k]:.2f}s" for k in ("first_report_s", "all_down_s", "back_s") if k in r)
        flag = "ok" if r["ok"] else "UNEXPECTED"
        kind = "opt" if r["server_opt"] else "   "
        print(f"  [{i + 1:3d}/{trials}] {fault.name:20s} {kind} -> {r.get('target', '-'):10s} {r['outcome']:26s}{times}  "
              f"{flag}{'  HANG ' + str(r['hung']) if r['hang'] else ''}{'  WRONG' if r['wrong'] else ''}",
              flush=True)
        if not r["ok"]:
            for name, text in r.get("logs", {}).items():
                print(f"    --- {name} (exit {r.get('returncodes', {}).get(name)}) ---")
                print("    " + "\n    ".join(text.strip().splitlines()[-12:]))
    s = summarize(results)
    print(f"\n  {'fault':20s} {'trials':>6s} {'expected':>8s} {'hangs':>5s} {'wrong':>5s} {'went on':>7s}  "
          f"{'1st report':>10s} {'all down':>8s} {'(max)':>6s} {'takeover':>8s} {'back':>6s} {'(max)':>6s}")
    for name, row in s["by_fault"].items():
        print(f"  {name:20s} {row['trials']:6d} {row['as_expected']:8d} {row['hangs']:5d} {row['wrong']:5d} "
              f"{row['continued']:7d}  {_fmt(row['first_report_median_s']):>10s} {_fmt(row['all_down_median_s']):>8s} "
              f"{_fmt(row['all_down_max_s']):>6s} {_fmt(row['takeover_median_s']):>8s} "
              f"{_fmt(row['back_median_s']):>6s} {_fmt(row['back_max_s']):>6s}")
    print(f"\n  trials {s['trials']}   as expected {s['as_expected']}   hangs {s['hangs']}   wrong results {s['wrong']}   "
          f"jobs that went on after a server loss {s['continued_after_server_loss']}/{s['server_losses']} "
          f"(with the optimizer on the servers: {s['continued_with_server_optimizer']}/"
          f"{s['server_losses_with_server_optimizer']})")
    print(f"  (seconds, medians: 1st report = fault to the first other member exiting with an error, all down = "
          f"to the last one, takeover = a lost server's chunks moved, back = from the fault (a link fault: its end) to "
          f"worker 0's next step; campaign wall time {time.monotonic() - t0:.0f} s)")
    if args.json:
        write_results(args.json, seed0, args.peer_timeout, steps, s, results)
    bad = s["hangs"] or s["wrong"] or s["as_expected"] != s["trials"]
    if not args.keep_logs and not bad:
        import shutil

        shutil.rmtree(logroot, ignore_errors=True)
    else:
        print(f"  logs: {logroot}")
    return 1 if bad else 0
