"""Runs jobs across an emulated cluster and summarizes them."""

from __future__ import annotations

import json
import os
import resource
import secrets
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

from .netns import EmulatedCluster

SCHED_PORT = 9000
GLOO_PORT = 29400
# torch.distributed's rendezvous for the systems on the "gradhub" backend
# (torchrun's MASTER_ADDR:MASTER_PORT, on the first worker host).
TORCH_PORT = 29500

# The systems whose workers join a gradhub job the lab starts (scheduler and
# servers), and those whose "gradhub" process group forms its own job from
# torch's store (the scheduler in rank 0, a colocated server in the first
# worker of each host).
LAB_JOB_SYSTEMS = ("gradhub", "ddp-hook")
BACKEND_SYSTEMS = ("ddp-gradhub", "ddp-gradhub-overlap", "fsdp-gradhub")


# gradhub scheduling options, as the environment switches a Horovod-style
# script reads; "a+b" combines them (e.g. "overlap+server").
VARIANTS = {
    "priority": {},
    "fifo": {"GRADHUB_SCHEDULING": "fifo"},
    "size": {"GRADHUB_SCHEDULING": "size"},
    # Forward order (P3's priorities) whatever the schedule; with noeager, one update after every result.
    "fwdorder": {"GRADHUB_SCHEDULING": "priority"},
    "overlap": {"GRADHUB_OVERLAP_FORWARD": "1"},
    "server": {"GRADHUB_OPTIMIZER_ON_SERVER": "1"},
    # The host stage off (read by the scheduler): every worker of a host
    # pushes and pulls everything itself.
    "nohost": {"GRADHUB_HOST_REDUCE": "0"},
    # Host stage on, but the owners push to their own host's server over
    # loopback TCP instead of by reference through shared memory.
    "noshm": {"GRADHUB_SERVER_SHM": "0"},
    # Failover off (read by the scheduler), and with it the replicas of the
    # server optimizer's state: "server" vs "server+nofailover" is their cost.
    "nofailover": {"GRADHUB_FAILOVER": "0"},
    # Timelines on every worker (operations and chunk stages) and server:
    # "priority" vs "priority+timeline" is what recording costs.
    "timeline": {"GRADHUB_TIMELINE": "/tmp/gradhub-bench-timeline/worker.{rank}.json",
                 "GRADHUB_SERVER_TIMELINE": "/tmp/gradhub-bench-timeline-server.{rank}.json"},
    # Tensor fusion off (every gradient its own push_pull), or buckets of 1 MiB (unscaled).
    "nofusion": {"GRADHUB_FUSION_THRESHOLD": "0"},
    # The traffic defaults' alternatives: no spread window; the
    # machine's own congestion control instead of cubic.
    "nospread": {"GRADHUB_SPREAD_BYTES": "0"},
    "syscc": {"GRADHUB_TCP_CONGESTION": "system"},
    # The synchronous step's eager update off: one update after every gradient is in.
    "noeager": {"GRADHUB_EAGER_UPDATE": "0"},
    # Chunks of 64 KiB (read by the scheduler; only without --partition-bytes, i.e. with --unscaled).
    "chunk64k": {"GRADHUB_PARTITION_BYTES": str(64 << 10)},
    # The spread at 2 MiB whatever the placement; the credit at 512 KiB whatever the chunk size.
    "spread2m": {"GRADHUB_SPREAD_BYTES": str(2 << 20)},
    "credit512k": {"GRADHUB_CREDIT_BYTES": str(512 << 10)},
    "fusion1m": {"GRADHUB_FUSION_THRESHOLD": str(1 << 20)},
    # With --racks: one level (every pusher crosses the core itself), or two
    # levels forced (auto, the default, lets PHub's model decide).
    "flat": {"GRADHUB_RACK_REDUCE": "off"},
    "racks": {"GRADHUB_RACK_REDUCE": "on"},
    # Sufficient factors: off, or forced wherever exact (auto is the default).
    "nosfb": {"GRADHUB_SFB": "off"},
    "sfb": {"GRADHUB_SFB": "force"},
    # Autotuning during untimed steps before the timed ones (3 steps a trial).
    # Overlap changes training semantics: autotune tries it only when allowed.
    # Training modes: BytePS's asynchronous mode, unbounded or
    # with a staleness bound of 2; sums in rank order.
    "async": {"GRADHUB_ASYNC": "1"},
    "stale2": {"GRADHUB_ASYNC": "1", "GRADHUB_STALENESS": "2"},
    "deterministic": {"GRADHUB_DETERMINISTIC": "1"},
    "autotune": {"GRADHUB_AUTOTUNE": "1", "GRADHUB_AUTOTUNE_STEPS_PER_TRIAL": "3", "GRADHUB_OVERLAP_FORWARD": "auto"},
}


def variant_env(variant: str) -> dict:
    env = {}
    for part in [p for p in variant.split("+") if p]:
        if part not in VARIANTS:
            raise ValueError(f"unknown gradhub variant {part!r} (choose from {', '.join(VARIANTS)}, joined by +)")
        env.update(VARIANTS[part])
    return env


def _host_bytes(results: list[dict]) -> dict | None:
    """Per worker host: bytes through its link per timed iteration (tx =
    upload, rx = download), from the host's eth0 counters each worker read
    at the start and end of its timed iterations; the median over the
    host's workers."""
    per: dict[str, dict[str, list[float]]] = {}
    for r in results:
        net = r.get("net")
        if not net or not r.get("iter_times"):
            continue
        iters = len(r["iter_times"])
        d = per.setdefault(r.get("host", str(r.get("rank"))), {"tx": [], "rx": []})
        d["tx"].append((net["tx1"] - net["tx0"]) / iters)
        d["rx"].append((net["rx1"] - net["rx0"]) / iters)
    if not per:
        return None
    return {h: {"tx": statistics.median(d["tx"]), "rx": statistics.median(d["rx"])} for h, d in sorted(per.items())}


def summarize(results: list[dict]) -> dict:
    """Combine per-worker RESULT records of one run."""
    if not results:
        raise ValueError("no results")
    per_iter = [statistics.mean(r["iter_times"]) for r in results]
    all_times = sorted(t for r in results for t in r["iter_times"])
    q = lambda f: all_times[min(len(all_times) - 1, int(f * len(all_times)))]
    out = {
        "workers": len(results),
        "iter_time_mean": max(per_iter),   # a synchronous job moves at the pace of its slowest worker
        "iter_time_p50": q(0.5),
        "iter_time_p90": q(0.9),
        "iter_time_max": all_times[-1],
    }
    r0 = results[0]
    if "batch" in r0:
        out["samples_per_s"] = len(results) * r0["batch"] / out["iter_time_mean"]
        if any(r.get("options", {}).get("GRADHUB_ASYNC") == "1" for r in results):
            # Asynchronous: each worker trains at its own pace.
            out["samples_per_s"] = sum(r0["batch"] / t for t in per_iter)
        out["worker_steps_per_s"] = [1 / t for t in per_iter]
        bound = len(results) * r0["batch"] / r0["compute_per_iter"]
        out["compute_bound_samples_per_s"] = bound
        out["scaling_efficiency"] = out["samples_per_s"] / bound
    if "bytes" in r0:
        out["bytes"] = r0["bytes"]
        out["goodput_Bps"] = r0["bytes"] / out["iter_time_mean"]
    if "params_scaled" in r0:
        out["model_bytes"] = r0["params_scaled"] * 4
    if "sleep_late_s" in r0:
        # The emulated compute's sleeps returning late, per iteration (the mean worker).
        out["sleep_late_ms"] = 1e3 * statistics.mean(r["sleep_late_s"] for r in results)
    if "main_cpu_s" in r0:
        # The training thread's CPU per iteration (the mean worker).
        out["main_cpu_ms"] = 1e3 * statistics.mean(r["main_cpu_s"] for r in results)
    if "eager_update" in r0:
        out["eager_update"] = all(r["eager_update"] for r in results)
    if "scheduling" in r0:
        out["scheduling"] = r0["scheduling"]
    if "autotune" in r0:
        out["autotune"] = r0["autotune"]
    if "sfb_layers" in r0:
        out["sfb_layers"] = r0["sfb_layers"]
        out["sfb_rebuild_ms"] = 1e3 * max(r["sfb_rebuild_s"] for r in results)
    errs = [r[k] for r in results for k in ("param_error", "sum_error") if r.get(k) is not None]
    if errs:
        out["result_error"] = max(errs)   # relative deviation of the synchronized values from the exact ones
    hb = _host_bytes(results)
    if hb:
        out["host_bytes"] = hb
        out["host_tx_per_iter"] = statistics.mean(v["tx"] for v in hb.values())
        out["host_rx_per_iter"] = statistics.mean(v["rx"] for v in hb.values())
    return out


@dataclass
class Layout:
    workers: int                # worker hosts
    cpu_servers: int = 0
    colocated: bool = True      # a server on every worker host
    server_threads: int = 1
    workers_per_host: int = 1   # worker processes on each worker host
    racks: int = 1              # worker hosts in this many racks (contiguous), CPU-only servers round-robin

    @property
    def num_servers(self) -> int:
        return self.cpu_servers + (self.workers if self.colocated else 0)

    @property
    def num_workers(self) -> int:
        """Worker processes in the job, ranked host by host (as torchrun does)."""
        return self.workers * self.workers_per_host

    def worker_slots(self) -> list[tuple[int, str, int]]:
        """(rank, host, local rank) of every worker process."""
        w = self.workers_per_host
        return [(h * w + l, f"w{h}", l) for h in range(self.workers) for l in range(w)]

    def host_names(self) -> list[str]:
        return [f"w{i}" for i in range(self.workers)] + [f"s{i}" for i in range(self.cpu_servers)]

    def rack_of(self) -> dict[str, int]:
        """Host name -> rack index (empty with one rack)."""
        if self.racks <= 1:
            return {}
        out = {f"w{i}": i * self.racks // self.workers for i in range(self.workers)}
        out.update({f"s{i}": i % self.racks for i in range(self.cpu_servers)})
        return out


def core_link_bytes(layout: Layout, model_bytes: float, two_level: bool) -> float:
    """Theoretical bytes per iteration through one rack's core link, each
    way, with colocated servers only and the host stage (N pushing hosts per
    rack, R racks): one level, N(R-1)/R of the model out (pushes) plus as
    much in results; two levels (PHub §3.4), the rack's sum out and its
    result in instead: 2(R-1)/R."""
    r = layout.racks
    n = layout.workers / r
    return 2 * (r - 1) / r * model_bytes * (1 if two_level else n)


def ring_core_link_bytes(layout: Layout, model_bytes: float) -> float:
    """DDP's ring in rank order (racks contiguous): one ring edge leaves
    each rack and one enters, each carrying 2(n-1)/n of the model."""
    n = layout.num_workers
    return 2 * (n - 1) / n * model_bytes


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


class CpuSampler:
    """Samples machine-wide CPU use (/proc/stat) so the busy share of the
    measured window, not of process start-up, is reported."""

    def __init__(self, period: float = 0.2, netdevs: dict[str, str] | None = None):
        import threading

        self.samples: list[tuple[float, float, float]] = []  # (time, busy jiffies, total jiffies)
        # Optionally the byte counters of some interfaces in this namespace
        # (name -> device): (time, {name: (rx, tx)}).
        self.netdevs = dict(netdevs or {})
        self.net_samples: list[tuple[float, dict[str, tuple[int, int]]]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, args=(period,), daemon=True)
        self._t.start()

    @staticmethod
    def _read() -> tuple[float, float]:
        with open("/proc/stat") as f:
            v = [float(x) for x in f.readline().split()[1:]]
        idle = v[3] + (v[4] if len(v) > 4 else 0)
        return sum(v) - idle, sum(v)

    def _read_net(self) -> dict[str, tuple[int, int]]:
        out = {}
        for name, dev in self.netdevs.items():
            try:
                out[name] = tuple(int(open(f"/sys/class/net/{dev}/statistics/{c}_bytes").read())
                                  for c in ("rx", "tx"))
            except (OSError, ValueError):
                pass
        return out

    def _run(self, period):
        while not self._stop.is_set():
            b, t = self._read()
            now = time.time()
            self.samples.append((now, b, t))
            if self.netdevs:
                self.net_samples.append((now, self._read_net()))
            self._stop.wait(period)

    def link_bytes(self, name: str, start: float, end: float) -> tuple[float, float] | None:
        """(rx, tx) bytes of a sampled device between two wall-clock times,
        interpolated linearly between samples."""
        pts = [(t, d[name]) for t, d in self.net_samples if name in d]
        if len(pts) < 2 or not pts[0][0] <= start < end <= pts[-1][0]:
            return None

        def at(x):
            for (t0, v0), (t1, v1) in zip(pts, pts[1:]):
                if t0 <= x <= t1:
                    f = (x - t0) / max(t1 - t0, 1e-9)
                    return tuple(a + f * (b - a) for a, b in zip(v0, v1))
            return pts[-1][1]

        a, b = at(start), at(end)
        return b[0] - a[0], b[1] - a[1]

    def stop(self):
        self._stop.set()
        self._t.join()

    def busy_cores(self, start: float, end: float) -> float | None:
        """Average number of busy cores between two wall-clock times."""
        # The samples that bracket the window (the window may be shorter than the period).
        before = [s for s in self.samples if s[0] <= start]
        after = [s for s in self.samples if s[0] >= end]
        if not before or not after:
            return None
        (_, b0, t0), (_, b1, t1) = before[-1], after[0]
        if t1 <= t0:
            return None
        return (b1 - b0) / max(t1 - t0, 1e-9) * (os.cpu_count() or 1)


def run_job(layout: Layout, rate: str | None, module: str, cfg: dict, system: str, env: dict | None = None,
            partition_bytes: int | None = None, timeout: float = 300, cluster: EmulatedCluster | None = None,
            core_rate: str | None = None) -> dict:
    """Start scheduler/servers (gradhub) and one worker process per worker host
    running `python -m <module>`; returns the summary plus raw results. With
    racks, each rack's link to the core is shaped to `core_rate` (default
    `rate`) and gradhub's members name their rack (GRADHUB_RACK)."""
    own = cluster is None
    racks = layout.rack_of()
    if own:
        cluster = EmulatedCluster(layout.host_names(), rate, racks=racks,
                                  core_rate=(core_rate or rate) if racks else None).__enter__()
    procs: list[tuple[str, subprocess.Popen]] = []
    try:
        sched = cluster.hosts["sched"]
        base = {k: v for k, v in os.environ.items() if not k.startswith("GRADHUB_")}
        base.update(env or {})
        base["PYTHONUNBUFFERED"] = "1"
        # Emulated hosts talk across addresses: the job authenticates, as a real one must.
        base["GRADHUB_JOB_TOKEN"] = secrets.token_hex(32)
        base["GLOO_SOCKET_IFNAME"] = "eth0"  # each emulated host talks through its veth
        py = sys.executable
        c0, t0 = _children_cpu(), time.monotonic()
        # CPU-only server hosts' links, from the bridge-side veth (its rx is the host's upload).
        devs = {h.name: h.veth for h in cluster.hosts.values() if h.name.startswith("s") and h.name != "sched"}
        devs.update({f"core{r}": dev for r, dev in cluster.core_links.items()})
        sampler = CpuSampler(period=0.05, netdevs=devs) if devs and cluster.rate_bps else CpuSampler()
        if system in BACKEND_SYSTEMS and racks:
            raise ValueError(f"{system}: the gradhub backend's job has no racks (no --racks)")
        # The backend forms its own job (a colocated server per host) as under
        # torchrun, or joins one the lab starts, as a user with CPU-only
        # server hosts starts it by hand (GRADHUB_SCHEDULER).
        lab_job = system in LAB_JOB_SYSTEMS or (system in BACKEND_SYSTEMS and
                                                (layout.cpu_servers or not layout.colocated))
        if racks and system == "gradhub":
            # What PHub's model needs, from the emulated links (Gbit/s).
            base.setdefault("GRADHUB_LINK_GBIT", str(cluster.rate_bps / 1e9 if cluster.rate_bps else 0))
            base.setdefault("GRADHUB_CORE_GBIT", str(cluster.core_bps / 1e9 if cluster.core_bps else 0))
        if lab_job:
            if layout.num_servers < 1:
                raise ValueError("gradhub needs at least one server (colocated or CPU-only)")
            base.update(GRADHUB_SCHEDULER=f"{sched.ip}:{SCHED_PORT}", GRADHUB_NUM_WORKERS=str(layout.num_workers),
                        GRADHUB_NUM_SERVERS=str(layout.num_servers))
            argv = [py, "-m", "gradhub", "scheduler", "--bind", f"{sched.ip}:{SCHED_PORT}"]
            if partition_bytes:
                argv += ["--partition-bytes", str(partition_bytes)]
            procs.append(("scheduler", subprocess.Popen(sched.cmd(argv), env=base, stdout=subprocess.PIPE,
                                                         stderr=subprocess.STDOUT)))
            server_hosts = [f"s{i}" for i in range(layout.cpu_servers)]
            if layout.colocated:
                server_hosts += [f"w{i}" for i in range(layout.workers)]
            for name in server_hosts:
                argv = [py, "-m", "gradhub", "server"]
                if layout.server_threads:   # 0: the server's own default (one per core)
                    argv += ["--threads", str(layout.server_threads)]
                if name.startswith("w"):
                    argv.append("--colocated")
                if racks:
                    argv += ["--rack", f"r{racks[name]}"]
                procs.append((f"server@{name}", subprocess.Popen(cluster.hosts[name].cmd(argv), env=base,
                                                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)))
        workers = []
        world, local = layout.num_workers, layout.workers_per_host
        for r, hname, lr in layout.worker_slots():
            host = cluster.hosts[hname]
            wcfg = dict(cfg, system=system, rank=r, world=world, host=hname, local_rank=lr, local_size=local,
                        ddp_addr=f"{cluster.hosts['w0'].ip}:{GLOO_PORT}", netdev="eth0")
            # gradhub's and torch.distributed's (torchrun's) local-rank variables.
            wenv = dict(base, GH_BENCH=json.dumps(wcfg), GRADHUB_RANK=str(r), GRADHUB_LOCAL_RANK=str(lr),
                        GRADHUB_LOCAL_SIZE=str(local), RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(lr),
                        LOCAL_WORLD_SIZE=str(local))
            if racks:
                wenv["GRADHUB_RACK"] = f"r{racks[hname]}"
            if system in BACKEND_SYSTEMS:
                # torchrun's rendezvous on the first worker host; rank 0
                # advertises the job's scheduler at MASTER_ADDR, which every
                # emulated host reaches. The chunk size and the server threads
                # the lab's own job would get (read by the scheduler and
                # server the group hosts).
                wenv.update(MASTER_ADDR=cluster.hosts["w0"].ip, MASTER_PORT=str(TORCH_PORT))
                if partition_bytes:
                    wenv.setdefault("GRADHUB_PARTITION_BYTES", str(partition_bytes))
                if layout.server_threads:
                    wenv.setdefault("GRADHUB_SERVER_THREADS", str(layout.server_threads))
            p = subprocess.Popen(host.cmd([py, "-m", module]), env=wenv, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT)
            procs.append((f"worker{r}", p))
            workers.append(p)
        results, logs = [], {}
        deadline = time.monotonic() + timeout
        for name, p in procs:
            if name.startswith("worker"):
                try:
                    out, _ = p.communicate(timeout=max(1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    tails = []
                    for other, q in procs:
                        q.kill()
                        text = (q.communicate()[0] or b"").decode(errors="replace")
                        tails.append(f"--- {other}:\n" + "\n".join(text.splitlines()[-8:]))
                    raise RuntimeError(f"{name} did not finish within {timeout:.0f}s\n" + "\n".join(tails))
                text = out.decode(errors="replace")
                logs[name] = text
                if p.returncode != 0:
                    raise RuntimeError(f"{name} failed (exit {p.returncode}):\n{text[-3000:]}")
                lines = [l for l in text.splitlines() if l.startswith("RESULT ")]
                if not lines:
                    raise RuntimeError(f"{name} printed no RESULT:\n{text[-3000:]}")
                results.append(json.loads(lines[-1][7:]))
        shares, rack_choice = None, None
        for name, p in procs:
            if not name.startswith("worker"):
                try:
                    text = (p.communicate(timeout=30)[0] or b"").decode(errors="replace")
                except subprocess.TimeoutExpired:
                    p.kill()
                    text = (p.communicate()[0] or b"").decode(errors="replace")
                if name == "scheduler":
                    # The placement the scheduler chose (logged by builds that have it).
                    shares = next((l.split("summation shares per server:", 1)[1].strip() for l in text.splitlines()
                                   if "summation shares per server:" in l), None)
                    rack_choice = next((l.split("]: ", 1)[1].strip() for l in text.splitlines()
                                        if "scheduler] racks [" in l), None)
        wall = time.monotonic() - t0
        sampler.stop()
        # The window all workers were measuring; if they never overlapped
        # (a very short run), the span from the first start to the last end.
        start = max(r["t_start"] for r in results)
        end = min(r["t_end"] for r in results)
        if end <= start:
            start, end = min(r["t_start"] for r in results), max(r["t_end"] for r in results)
        summary = summarize(results)
        # CPU-only server hosts: bytes over the common window, per mean iteration.
        servers, core = {}, {}
        for name in sampler.netdevs:
            b = sampler.link_bytes(name, start, end)
            if b is not None and end > start:
                per = summary["iter_time_mean"] / (end - start)
                if name.startswith("core"):
                    core[name] = {"tx": b[1] * per, "rx": b[0] * per}  # the rack's end: tx = its upload
                else:
                    servers[name] = {"tx": b[0] * per, "rx": b[1] * per}   # veth rx = the host's upload
        if servers:
            summary["server_host_bytes"] = servers
        if core:
            summary["core_bytes"] = core
        if rack_choice:
            summary["rack_choice"] = rack_choice
        if shares:
            summary["server_shares"] = shares
        summary.update(system=system, rate=rate, tc_drops=cluster.qdisc_drops(), busy_cores=sampler.busy_cores(start, end),
                       cpu_cores=os.cpu_count(), cpu_seconds_per_s=(_children_cpu() - c0) / wall, wall=wall,
                       layout=layout.__dict__, options=dict(env or {}), raw=results)
        return summary
    finally:
        for _, p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if own:
            cluster.__exit__(None, None, None)
