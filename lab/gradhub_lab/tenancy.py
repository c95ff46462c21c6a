"""`gradhub-lab tenancy`: many jobs on one shared service, on the emulated
cluster (one network namespace per host, every host's link shaped).

One service (`gradhub scheduler --service` on its own host) and S server
processes (`gradhub server --service`, one per host) serve J = 1, 2, ... jobs
at once, each with W workers on hosts of their own. Every worker pushes and
pulls the same model-sized tensors in a loop; all jobs measure over the same
wall-clock window, so the figures are what each job got while all ran.
Printed per J: each job's goodput (model bytes synchronized per second), the
aggregate against the one-job figure of the same run, and Jain's fairness
index over the jobs (1.0: perfectly even).

`--auth-cost` also runs one ordinary job (its own scheduler and servers, same
hosts) with a job token and without one (GRADHUB_INSECURE): the time
`gradhub.init()` takes to connect, and the steady-state goodput.
"""

from __future__ import annotations

import json
import os
import secrets
import statistics
import subprocess
import sys
import time

SERVICE_PORT = 9700


def jain(xs: list[float]) -> float:
    """Jain's fairness index: (sum x)^2 / (n sum x^2), 1/n to 1."""
    s2 = sum(x * x for x in xs)
    return (sum(xs) ** 2) / (len(xs) * s2) if s2 > 0 else 0.0


def add_arguments(p) -> None:
    p.add_argument("--jobs", default="1,2,3,4", help="numbers of concurrent jobs to run, comma-separated "
                   "(default 1,2,3,4)")
    p.add_argument("--workers-per-job", type=int, default=2, help="workers of each job, one per host (default 2)")
    p.add_argument("--servers", type=int, default=2, help="server processes (hosts) of the service (default 2)")
    p.add_argument("--rate", default="1gbit", help="per-host rate in each direction (default 1gbit)")
    p.add_argument("--mib", type=float, default=8.0, help="model size in MiB, as 4 float32 tensors (default 8)")
    p.add_argument("--duration", type=float, default=15.0, help="measured seconds per run (default 15)")
    p.add_argument("--auth-cost", action="store_true",
                   help="also measure one ordinary job with and without a job token")
    p.add_argument("--trials", type=int, default=1, help="runs of each configuration, interleaved (default 1)")
    p.add_argument("--json", help="append the results to this JSON-lines file")


def _spawn(host, argv: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(host.cmd(argv), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _collect(workers: list[tuple[str, subprocess.Popen]], timeout: float) -> list[dict]:
    results, deadline = [], time.monotonic() + timeout
    for name, p in workers:
        try:
            out = p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0].decode(errors="replace")
        except subprocess.TimeoutExpired:
            for _, q in workers:
                q.kill()
            raise RuntimeError(f"{name} did not finish within {timeout:.0f}s") from None
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        if p.returncode != 0 or not lines:
            raise RuntimeError(f"{name} failed (exit {p.returncode}):\n{out[-3000:]}")
        results.append(json.loads(lines[-1][7:]))
    return results


def _worker_cfg(args, start_at: float) -> dict:
    elems = int(args.mib * (1 << 20) / 4 / 4)
    return {"tensors": 4, "elems": elems, "start_at": start_at, "duration": args.duration}


def run_jobs(cluster, args, jobs: int, master: str) -> dict:
    """J concurrent jobs on the service already running in `cluster`."""
    from gradhub.tools import job_token

    py = sys.executable
    base = {k: v for k, v in os.environ.items() if not k.startswith("GRADHUB_")}
    base.update(PYTHONUNBUFFERED="1", GRADHUB_SCHEDULER=f"{cluster.hosts['sched'].ip}:{SERVICE_PORT}")
    w = args.workers_per_job
    start_at = time.time() + 8 + 1.0 * jobs * w
    cfg = _worker_cfg(args, start_at)
    workers = []
    for j in range(jobs):
        name = f"job{j}"
        token = job_token(master, name)
        for r in range(w):
            env = dict(base, GRADHUB_JOB=name, GRADHUB_JOB_TOKEN=token, GRADHUB_NUM_WORKERS=str(w),
                       GRADHUB_RANK=str(r), GH_TENANCY=json.dumps(dict(cfg, job=name, rank=r)))
            workers.append((f"{name}/w{r}", _spawn(cluster.hosts[f"j{j}w{r}"], [py, "-m", __name__], env)))
    results = _collect(workers, timeout=start_at - time.time() + args.duration + 120)
    per_job = {}
    for r in results:
        if r["rank"] == 0:
            per_job[r["job"]] = r["bytes"] / (r["t_end"] - r["t_start"])
    return {"jobs": jobs, "goodput": per_job, "init_s": statistics.median(r["init_s"] for r in results)}


def run_plain(cluster, args, token: str | None) -> dict:
    """One ordinary job on the same hosts: its own scheduler and servers."""
    py = sys.executable
    base = {k: v for k, v in os.environ.items() if not k.startswith("GRADHUB_")}
    sched = f"{cluster.hosts['sched'].ip}:{SERVICE_PORT + 1}"
    w = args.workers_per_job
    base.update(PYTHONUNBUFFERED="1", GRADHUB_SCHEDULER=sched, GRADHUB_NUM_WORKERS=str(w),
                GRADHUB_NUM_SERVERS=str(args.servers))
    if token:
        base["GRADHUB_JOB_TOKEN"] = token
    else:
        base["GRADHUB_INSECURE"] = "1"
    procs = [_spawn(cluster.hosts["sched"], [py, "-m", "gradhub", "scheduler", "--bind", sched], base)]
    procs += [_spawn(cluster.hosts[f"s{i}"], [py, "-m", "gradhub", "server", "--threads", "1"], base)
              for i in range(args.servers)]
    try:
        start_at = time.time() + 8 + w
        cfg = _worker_cfg(args, start_at)
        workers = [(f"w{r}", _spawn(cluster.hosts[f"j0w{r}"], [py, "-m", __name__],
                                    dict(base, GRADHUB_RANK=str(r),
                                         GH_TENANCY=json.dumps(dict(cfg, job="plain", rank=r)))))
                   for r in range(w)]
        results = _collect(workers, timeout=start_at - time.time() + args.duration + 120)
    finally:
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    r0 = next(r for r in results if r["rank"] == 0)
    return {"token": bool(token), "goodput": r0["bytes"] / (r0["t_end"] - r0["t_start"]),
            "init_s": statistics.median(r["init_s"] for r in results)}


def main(args) -> int:
    from .netns import EmulatedCluster

    counts = [int(x) for x in args.jobs.split(",") if x.strip()]
    if not counts or min(counts) < 1:
        print("gradhub-lab tenancy: --jobs needs positive counts", file=sys.stderr)
        return 2
    names = [f"s{i}" for i in range(args.servers)]
    names += [f"j{j}w{r}" for j in range(max(counts)) for r in range(args.workers_per_job)]
    master = secrets.token_hex(32)
    rows, plain = [], []
    with EmulatedCluster(names, args.rate) as cluster:
        py = sys.executable
        env = {k: v for k, v in os.environ.items() if not k.startswith("GRADHUB_")}
        env.update(PYTHONUNBUFFERED="1", GRADHUB_SERVICE_TOKEN=master,
                   GRADHUB_SCHEDULER=f"{cluster.hosts['sched'].ip}:{SERVICE_PORT}")
        service = [_spawn(cluster.hosts["sched"], [py, "-m", "gradhub", "scheduler", "--service", "--bind",
                                                     f"{cluster.hosts['sched'].ip}:{SERVICE_PORT}"], env)]
        service += [_spawn(cluster.hosts[f"s{i}"], [py, "-m", "gradhub", "server", "--service", "--threads", "1"],
                           env) for i in range(args.servers)]
        try:
            time.sleep(2)
            for t in range(args.trials):
                for j in counts:
                    row = run_jobs(cluster, args, j, master)
                    row["trial"] = t
                    rows.append(row)
                    g = list(row["goodput"].values())
                    print(f"  trial {t}: {j} job(s): " + ", ".join(f"{x * 8 / 1e9:.3f}" for x in g)
                          + f" Gbit/s each, aggregate {sum(g) * 8 / 1e9:.3f}, Jain {jain(g):.3f}", flush=True)
        finally:
            for p in service:
                p.kill()
                p.wait()
        if args.auth_cost:
            for t in range(args.trials):
                for token in (secrets.token_hex(32), None):
                    r = run_plain(cluster, args, token)
                    r["trial"] = t
                    plain.append(r)
                    print(f"  trial {t}: ordinary job {'with' if token else 'without'} a token: "
                          f"init {r['init_s'] * 1000:.0f} ms, {r['goodput'] * 8 / 1e9:.3f} Gbit/s", flush=True)
    one = statistics.median(sum(r["goodput"].values()) for r in rows if r["jobs"] == min(counts))
    print(f"\nservice: {args.servers} servers, {args.workers_per_job} workers per job, {args.rate} per host, "
          f"{args.mib:g} MiB model, {args.duration:g} s windows, {args.trials} trial(s); medians")
    print(f"{'jobs':>4} {'per job (Gbit/s)':>28} {'aggregate':>10} {'vs 1 job':>9} {'Jain':>6} {'init (ms)':>10}")
    summary = []
    for j in counts:
        rs = [r for r in rows if r["jobs"] == j]
        agg = statistics.median(sum(r["goodput"].values()) for r in rs)
        fair = statistics.median(jain(list(r["goodput"].values())) for r in rs)
        per = [statistics.median(r["goodput"][f"job{k}"] for r in rs) for k in range(j)]
        init = statistics.median(r["init_s"] for r in rs)
        summary.append({"jobs": j, "per_job_bytes_per_s": per, "aggregate_bytes_per_s": agg,
                        "vs_one_job": agg / one, "jain": fair, "init_s": init})
        print(f"{j:>4} {' '.join(f'{x * 8 / 1e9:.3f}' for x in per):>28} {agg * 8 / 1e9:>10.3f} "
              f"{agg / one:>9.2f} {fair:>6.3f} {init * 1000:>10.0f}")
    auth = None
    if plain:
        on = [r for r in plain if r["token"]]
        off = [r for r in plain if not r["token"]]
        auth = {k: {"init_s": statistics.median(r["init_s"] for r in rs),
                    "goodput_bytes_per_s": statistics.median(r["goodput"] for r in rs)}
                for k, rs in (("token", on), ("no_token", off))}
        print(f"ordinary job, token vs none: init {auth['token']['init_s'] * 1000:.0f} vs "
              f"{auth['no_token']['init_s'] * 1000:.0f} ms; goodput "
              f"{auth['token']['goodput_bytes_per_s'] * 8 / 1e9:.3f} vs "
              f"{auth['no_token']['goodput_bytes_per_s'] * 8 / 1e9:.3f} Gbit/s "
              f"({auth['token']['goodput_bytes_per_s'] / auth['no_token']['goodput_bytes_per_s']:.3f}x)")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({"bench": "tenancy", "args": vars(args), "summary": summary, "auth": auth,
                                "raw": rows, "raw_plain": plain}) + "\n")
    return 0


def worker() -> None:
    """One worker of one job (GH_TENANCY): push_pull the model in a loop over
    the common window; rank 0 decides when the window is over."""
    import numpy as np

    import gradhub

    cfg = json.loads(os.environ["GH_TENANCY"])
    t0 = time.perf_counter()
    gradhub.init()
    init_s = time.perf_counter() - t0
    xs = [np.ones(cfg["elems"], np.float32) for _ in range(cfg["tensors"])]
    stop = np.zeros(1, np.float32)

    def step():
        hs = [gradhub.push_pull_async(x, name=f"t{k}") for k, x in enumerate(xs)]
        for h in hs:
            h.wait()

    for _ in range(3):
        step()
    while time.time() < cfg["start_at"]:
        time.sleep(0.005)
    steps, t_start = 0, time.time()
    while True:
        step()
        steps += 1
        stop[0] = 1.0 if gradhub.rank() == 0 and time.time() - t_start >= cfg["duration"] else 0.0
        gradhub.push_pull(stop, name="stop")
        if stop[0] > 0:
            break
    t_end = time.time()
    print("RESULT " + json.dumps({"job": cfg["job"], "rank": cfg["rank"], "steps": steps, "t_start": t_start,
                                  "t_end": t_end, "init_s": init_s,
                                  "bytes": steps * cfg["tensors"] * cfg["elems"] * 4}), flush=True)
    gradhub.shutdown()


if __name__ == "__main__":
    worker()
