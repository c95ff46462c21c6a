"""`gradhub-lab faults --elastic`: the elastic fault campaign.

Runs many short elastic jobs (GRADHUB_MIN_WORKERS) on one shared service
on loopback (`gradhub scheduler --service` and two `gradhub server
--service`, started once), each worker training with `hvd.elastic.run`
and committing every step, and injects one membership fault into each at
a random step:

  kill worker      SIGKILL of one of 4 workers (at least 2);
  stop worker      SIGSTOP of one of 4 for good (found by the peer timeout;
                   killed once the job has ended);
  kill 2 workers   SIGKILL of two of 4 at once (at least 2);
  add worker       a fifth worker started while 4 train (at most 5).

Each step's batch is a function of the step alone, split by rank over
the current size, so whatever the membership every survivor must end
with the parameters of one process trained on the full batches, and all
survivors with the same ones. What each trial must lead to: every worker
not hit exits 0 within a bound (a member still running then is a hang)
with the single-process parameters (else a wrong result) and the
expected final size, all in agreement (else a disagreement). The time
from the fault to training again (the first step committed by the next
generation) is reported per fault.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from gradhub.tools import free_port

from .faults import select_faults, write_results

GRADHUB = [sys.executable, "-m", "gradhub"]
MASTER = "elastic-fault-campaign"
BATCH = 60  # rows per step: divisible by every size a trial goes through (2 to 5 workers)


@dataclass(frozen=True)
class Fault:
    name: str
    kind: str       # kill | stop | add
    count: int      # workers hit (or added)
    workers: int    # at the start
    min_workers: int
    max_workers: int

    def describe(self) -> str:
        return (f"{self.name:16s} {self.workers} workers (min {self.min_workers}, max {self.max_workers}), "
                f"{self.kind} {self.count}")


FAULTS = [
    Fault("kill worker", "kill", 1, 4, 2, 4),
    Fault("stop worker", "stop", 1, 4, 2, 4),
    Fault("kill 2 workers", "kill", 2, 4, 2, 4),
    Fault("add worker", "add", 1, 4, 2, 5),
]


# ---------------------------------------------------------------- the worker


def worker() -> None:
    """One elastic worker (GH_ELASTIC: steps, seed, sleep, size): train,
    commit every step (printing STEP <step> <size> <time>), past `steps`
    until the job has `size` workers (a worker added joins at a commit; at
    most 200x the steps), and check the result."""
    import gradhub.torch as hvd

    from .elastic_loop import Problem, train

    cfg = json.loads(os.environ["GH_ELASTIC"])
    problem = Problem(seed=cfg["seed"], inputs=8, hidden=16, outputs=2, rows=BATCH, lr=0.05)

    def done(st, trained) -> bool:
        # The same on every worker: the step, the size and the steps since
        # the last reset (a newcomer's 0 is the others' after their reset)
        # are the job's. Two steps in the last generation time its start.
        step = st.step
        return step >= 200 * cfg["steps"] or (step >= cfg["steps"] and hvd.size() == cfg["size"]
                                               and trained.generation_steps >= 2)

    def after_commit(step) -> None:
        print(f"STEP {step} {hvd.size()} {time.time():.6f}", flush=True)
        time.sleep(cfg["sleep"])

    trained = train(problem, done, after_commit=after_commit)
    worst, flat = problem.check(trained.model, trained.steps)
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]
    print(f"DONE size={hvd.size()} resets={trained.resets} worst={worst:.3g} digest={digest}", flush=True)
    hvd.shutdown()


# ---------------------------------------------------------------- the campaign


class Service:
    """The shared service the trials run on: its scheduler and two servers."""

    def __init__(self, logroot: Path, peer_timeout: float):
        self.addr = f"127.0.0.1:{free_port()}"
        self.env = dict(os.environ, GRADHUB_SERVICE_TOKEN=MASTER, GRADHUB_SCHEDULER=self.addr,
                        GRADHUB_PEER_TIMEOUT=str(peer_timeout), PYTHONUNBUFFERED="1")
        self.env.pop("GRADHUB_JOB_TOKEN", None)
        self.procs = [subprocess.Popen([*GRADHUB, "scheduler", "--service", "--bind", self.addr,
                                        "--peer-timeout", str(peer_timeout)], env=self.env,
                                       stdout=open(logroot / "service.log", "wb"), stderr=subprocess.STDOUT)]
        for s in range(2):
            self.procs.append(subprocess.Popen([*GRADHUB, "server", "--service", "--threads", "1"], env=self.env,
                                               stdout=open(logroot / f"server{s}.log", "wb"),
                                               stderr=subprocess.STDOUT))

    def token(self, job: str) -> str:
        out = subprocess.run([*GRADHUB, "token", job], env=self.env, capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"gradhub token failed: {out.stderr}")
        return out.stdout.strip()

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def _steps(log: str) -> list[tuple[int, int, float]]:
    out = []
    for line in log.splitlines():
        if line.startswith("STEP "):
            _, step, size, at = line.split()
            out.append((int(step), int(size), float(at)))
    return out


def run_trial(svc: Service, fault: Fault, seed: int, steps: int, sleep: float, peer_timeout: float,
              logroot: Path) -> dict:
    rng = random.Random(seed)
    job = f"elastic-{seed}"
    token = svc.token(job)
    tdir = logroot / job
    tdir.mkdir()
    hit_n = 0 if fault.kind == "add" else fault.count
    expect_size = fault.workers - hit_n + (fault.count if fault.kind == "add" else 0)
    env = dict(svc.env, GRADHUB_JOB=job, GRADHUB_JOB_TOKEN=token, GRADHUB_NUM_WORKERS=str(fault.workers),
               GRADHUB_MIN_WORKERS=str(fault.min_workers), GRADHUB_MAX_WORKERS=str(fault.max_workers),
               GH_ELASTIC=json.dumps({"steps": steps, "seed": seed, "sleep": sleep, "size": expect_size}))
    env.pop("GRADHUB_SERVICE_TOKEN")
    procs: dict[str, subprocess.Popen] = {}

    def spawn(name: str) -> None:
        procs[name] = subprocess.Popen([sys.executable, "-c", "from gradhub_lab.elastic_faults import worker; "
                                        "worker()"], env=env, stdout=open(tdir / f"{name}.log", "wb"),
                                       stderr=subprocess.STDOUT)

    def log(name: str) -> str:
        return (tdir / f"{name}.log").read_text(errors="replace")

    for w in range(fault.workers):
        spawn(f"w{w}")
    at_step = rng.randrange(2, max(3, steps // 2))
    deadline = time.monotonic() + 120
    while not any(s >= at_step for s, _, _ in _steps(log("w0"))):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs.values()):
            break
        time.sleep(0.01)
    hit = rng.sample(sorted(procs), hit_n)
    fault_at = time.time()
    for name in hit:
        procs[name].send_signal(signal.SIGKILL if fault.kind == "kill" else signal.SIGSTOP)
    if fault.kind == "add":
        spawn("added")
    # Bound: the join timeout is not reached when all goes well; a stop is found within the peer timeout.
    bound = time.monotonic() + 90 + 4 * peer_timeout + steps * (sleep + 0.2)
    codes, hung = {}, []
    for name, p in procs.items():
        if name in hit:
            continue
        try:
            codes[name] = p.wait(timeout=max(0.1, bound - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung.append(name)
    for name, p in procs.items():
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait()
    survivors = [n for n in procs if n not in hit]
    done = {n: next((line for line in log(n).splitlines() if line.startswith("DONE ")), "") for n in survivors}
    digests = {d.split("digest=")[1] for d in done.values() if "digest=" in d}
    sizes_ok = all(f"size={expect_size} " in d for d in done.values())
    wrong = [n for n, d in done.items() if d and float(d.split("worst=")[1].split()[0]) >= 1e-5]
    # Training again: the first step any survivor committed after the fault in a generation of the new size.
    after = [at for n in survivors for _, size, at in _steps(log(n)) if at > fault_at and size == expect_size]
    r = {"fault": fault.name, "seed": seed, "at_step": at_step, "hit": hit, "hang": bool(hung), "hung": hung,
         "wrong": bool(wrong), "disagree": len(digests) > 1,
         "ok": not hung and not wrong and len(digests) == 1 and sizes_ok
         and all(codes.get(n) == 0 for n in survivors)}
    if after:
        r["recovery_s"] = min(after) - fault_at
    if not r["ok"]:
        r["logs"] = {n: log(n)[-3000:] for n in procs}
        r["returncodes"] = {n: codes.get(n) for n in procs}
    return r


def summarize(results: list[dict]) -> dict:
    by: dict[str, dict] = {}
    for f in FAULTS:
        rs = [r for r in results if r["fault"] == f.name]
        if not rs:
            continue
        rec = [r["recovery_s"] for r in rs if "recovery_s" in r]
        by[f.name] = {"trials": len(rs), "ok": sum(r["ok"] for r in rs), "hangs": sum(r["hang"] for r in rs),
                      "wrong": sum(r["wrong"] for r in rs), "disagree": sum(r["disagree"] for r in rs),
                      "recovery_median_s": statistics.median(rec) if rec else None,
                      "recovery_max_s": max(rec) if rec else None}
    return {"trials": len(results), "ok": sum(r["ok"] for r in results), "hangs": sum(r["hang"] for r in results),
            "wrong": sum(r["wrong"] for r in results), "disagree": sum(r["disagree"] for r in results),
            "by_fault": by}


def run(args) -> int:
    faults = select_faults(FAULTS, args, "gradhub-lab faults --elastic")
    if isinstance(faults, int):
        return faults
    trials = len(faults) if args.quick else args.trials
    steps = 12 if args.quick else max(args.steps // 2, 8)
    sleep = 0.02
    seed0 = args.seed if args.seed is not None else random.randrange(1 << 20)
    logroot = Path(tempfile.mkdtemp(prefix="gradhub-elastic-faults-"))
    print(f"elastic faults  {trials} elastic job(s) on one shared service (2 servers) on loopback; peer timeout "
          f"{args.peer_timeout} s, {steps} steps each, a commit every step; seeds from {seed0}", flush=True)
    svc = Service(logroot, args.peer_timeout)
    results, t0 = [], time.monotonic()
    try:
        for i in range(trials):
            fault = faults[i % len(faults)]
            r = run_trial(svc, fault, seed0 + i, steps, sleep, args.peer_timeout, logroot)
            results.append(r)
            rec = f" back training in {r['recovery_s']:.2f}s" if "recovery_s" in r else ""
            flag = "ok" if r["ok"] else "UNEXPECTED"
            print(f"  [{i + 1:3d}/{trials}] {fault.name:16s} at step {r['at_step']:2d} -> {','.join(r['hit']) or '-':6s}"
                  f"{rec}  {flag}{'  HANG ' + str(r['hung']) if r['hang'] else ''}{'  WRONG' if r['wrong'] else ''}"
                  f"{'  DISAGREE' if r['disagree'] else ''}", flush=True)
            if not r["ok"]:
                for name, text in r.get("logs", {}).items():
                    print(f"    --- {name} (exit {r.get('returncodes', {}).get(name)}) ---")
                    print("    " + "\n    ".join(text.strip().splitlines()[-12:]))
    finally:
        svc.close()
    s = summarize(results)
    print(f"\n  {'fault':16s} {'trials':>6s} {'ok':>4s} {'hangs':>5s} {'wrong':>5s} {'disagree':>8s}  "
          f"{'back training (median, max)':>28s}")
    for name, row in s["by_fault"].items():
        med, most = row["recovery_median_s"], row["recovery_max_s"]
        times = "-" if med is None else f"{med:.2f} s, {most:.2f} s"
        print(f"  {name:16s} {row['trials']:6d} {row['ok']:4d} {row['hangs']:5d} {row['wrong']:5d} "
              f"{row['disagree']:8d}  {times:>28s}")
    print(f"\n  trials {s['trials']}   ok {s['ok']}   hangs {s['hangs']}   wrong results {s['wrong']}   disagreements "
          f"{s['disagree']}   (campaign wall time {time.monotonic() - t0:.0f} s)")
    if args.json:
        write_results(args.json, seed0, args.peer_timeout, steps, s, results)
    bad = s["hangs"] or s["wrong"] or s["disagree"] or s["ok"] != s["trials"]
    if not args.keep_logs and not bad:
        import shutil

        shutil.rmtree(logroot, ignore_errors=True)
    else:
        print(f"  logs: {logroot}")
    return 1 if bad else 0
