"""A shared service: one scheduler and one set of servers hosting many jobs
at once (`gradhub scheduler --service`, `gradhub server --service`), each
job known by its name and opened only by its own derived token."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import free_port, job_env, restart_process, worker_argv
from test_multihost import hosts  # noqa: F401  (the emulated-hosts fixture)

MASTER = "service-master-token-for-tests"


def gh(*args: str, env: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gradhub", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


class Service:
    """The service's scheduler and servers as processes (role by role), and
    jobs started on it."""

    def __init__(self, tmp: Path, servers: int = 2, args: tuple[str, ...] = (), bind_host: str = "127.0.0.1",
                 prefix: tuple[str, ...] = (), server_prefix: tuple[str, ...] = (), encrypt: bool = False):
        """`encrypt`: every connection of the service and its jobs (GRADHUB_ENCRYPT=1)."""
        self.tmp, self.procs, self.logs = tmp, {}, {}
        self.addr = f"{bind_host}:{free_port()}"
        self.encrypt = {"GRADHUB_ENCRYPT": "1"} if encrypt else {}
        self.env = job_env(GRADHUB_SERVICE_TOKEN=MASTER, GRADHUB_SCHEDULER=self.addr, **self.encrypt)
        self.env.pop("GRADHUB_JOB_TOKEN")
        py = [sys.executable, "-m", "gradhub"]
        self.service_argv = [*prefix, *py, "scheduler", "--service", "--bind", self.addr, *args]
        self.spawn("service", self.service_argv, self.env)
        for s in range(servers):
            self.spawn(f"server{s}", [*server_prefix, *py, "server", "--service", "--threads", "1"], self.env)
        self.wait_until(lambda st: len(st["servers"]) == servers, "the servers to join")

    def spawn(self, name: str, argv: list[str], env: dict) -> subprocess.Popen:
        self.logs[name] = self.tmp / f"{name}.log"
        self.procs[name] = subprocess.Popen(argv, env=env, stdout=open(self.logs[name], "wb"),
                                            stderr=subprocess.STDOUT)
        return self.procs[name]

    def restart_service(self) -> None:
        """Kill the service (SIGKILL) and start it again on its address; its
        log goes on in the same file."""
        self.procs["service"] = restart_process(self.procs["service"], self.service_argv, self.env,
                                                self.logs["service"])

    def log(self, name: str) -> str:
        return self.logs[name].read_text(errors="replace")

    def token(self, job: str) -> str:
        out = gh("token", job, env=self.env)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    def worker_env(self, job: str, workers: int, rank: int, token: str | None = None, **cfg) -> dict:
        env = job_env(GRADHUB_SCHEDULER=self.addr, GRADHUB_JOB=job, GRADHUB_NUM_WORKERS=workers,
                      GRADHUB_RANK=rank, GH_TEST=json.dumps(cfg), **self.encrypt)
        env["GRADHUB_JOB_TOKEN"] = token if token is not None else self.token(job)
        return env

    def start_job(self, job: str, workers: int, prefix: tuple[str, ...] = (), token: str | None = None,
                  **cfg) -> list[str]:
        token = token if token is not None else self.token(job)
        names = []
        for r in range(workers):
            name = f"{job}-w{r}"
            self.spawn(name, [*prefix, *worker_argv("service_job.py")],
                       self.worker_env(job, workers, r, token, **cfg))
            names.append(name)
        return names

    def wait(self, names: list[str], timeout: float = 120) -> dict[str, int]:
        deadline = time.monotonic() + timeout
        codes = {}
        for n in names:
            try:
                codes[n] = self.procs[n].wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{n} still running after {timeout}s:\n{self.log(n)}") from None
        return codes

    def status(self) -> dict:
        out = gh("status", "--json", env=self.env)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def wait_until(self, pred, what: str, timeout: float = 30) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            st = self.status()
            if pred(st):
                return st
            if time.monotonic() > deadline:
                raise AssertionError(f"waited {timeout}s for {what}; status: {json.dumps(st, indent=1)}\n"
                                     + self.log("service"))
            time.sleep(0.2)

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
            p.wait()


@pytest.fixture
def service(tmp_path):
    made: list[Service] = []

    def make(*args, **kwargs) -> Service:
        s = Service(tmp_path, *args, **kwargs)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def test_three_concurrent_jobs_get_exact_sums_and_are_reported(service):
    svc = service(servers=2)
    jobs = {"alpha": (2, "float32"), "beta": (3, "float16"), "gamma": (2, "int64")}
    tokens = {j: svc.token(j) for j in jobs}  # first, so the jobs start together
    names = {j: svc.start_job(j, w, token=tokens[j], dtype=d, steps=25, size=30_000, sleep=0.1)
             for j, (w, d) in jobs.items()}
    # While they run: three jobs, each with its own members, servers and namespace.
    st = svc.wait_until(lambda st: sum(j["state"] == "running" for j in st["jobs"]) == 3, "three running jobs")
    by_name = {j["name"]: j for j in st["jobs"]}
    for j, (w, _) in jobs.items():
        assert by_name[j]["workers"] == w and by_name[j]["servers"] == 2
        assert sorted(m["role"] for m in by_name[j]["members"]) == ["server"] * 2 + ["worker"] * w
    assert len({j["namespace"] for j in st["jobs"]}) == 3
    st = svc.wait_until(lambda st: all(j["pushed_bytes"] > 0 for j in st["jobs"]) and len(st["jobs"]) == 3,
                        "traffic reports for every job")
    for j, (w, _) in jobs.items():
        codes = svc.wait(names[j])
        assert all(c == 0 for c in codes.values()), "\n".join(svc.log(n) for n in names[j])
        for r in range(w):
            assert f"[{j} worker {r}] PASS" in svc.log(f"{j}-w{r}")
    # Ended jobs leave nothing behind, on the service or on its servers.
    svc.wait_until(lambda st: not st["jobs"] and all(not s["jobs"] for s in st["servers"]), "the jobs to be gone")
    for s in ("server0", "server1"):
        for j in jobs:
            assert f"job '{j}': complete, its server's memory is freed" in svc.log(s)
    # Human-readable status too.
    out = gh("status", env=svc.env)
    assert out.returncode == 0 and "2 server(s)" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("encrypt", [False, True], ids=["plain", "encrypted"])
def test_a_restarted_service_takes_its_jobs_back_and_they_end_exact(service, encrypt):
    svc = service(servers=2, encrypt=encrypt)
    jobs = ("alpha", "beta")
    tokens = {j: svc.token(j) for j in jobs}
    # Each job declares two more tensors at its end (after the restart):
    # what needs the service waits for it.
    names = {j: svc.start_job(j, 2, token=tokens[j], steps=60, size=30_000, sleep=0.05, extra_tensors=2)
             for j in jobs}
    for j in jobs:
        deadline = time.monotonic() + 60
        while "STEP 5" not in svc.log(f"{j}-w0"):
            assert time.monotonic() < deadline, svc.log(f"{j}-w0")
            time.sleep(0.05)
    svc.procs["service"].kill()
    svc.procs["service"].wait()
    steps = {j: svc.log(f"{j}-w0").count("STEP ") for j in jobs}
    time.sleep(1.0)
    # The jobs trained on meanwhile (nothing of a step needs the service).
    assert all(svc.log(f"{j}-w0").count("STEP ") > steps[j] for j in jobs), steps
    svc.restart_service()
    for j in jobs:
        codes = svc.wait(names[j])
        assert all(c == 0 for c in codes.values()), "\n".join(svc.log(n) for n in names[j]) + svc.log("service")
        for r in range(2):
            assert f"[{j} worker {r}] PASS" in svc.log(f"{j}-w{r}")
    # Its server processes joined it again; the jobs ended there.
    svc.wait_until(lambda st: len(st["servers"]) == 2 and not st["jobs"], "the servers back and the jobs gone")
    log = svc.log("service")
    for j in jobs:
        assert f"job '{j}': its worker rejoins a service that restarted: rebuilding the job" in log \
            or f"job '{j}': its server rejoins a service that restarted: rebuilding the job" in log, log
        assert f"job '{j}': complete" in log.split("--- restarted ---")[1], log
    for s in ("server0", "server1"):
        assert "the service at" in svc.log(s) and "is back: joined it again" in svc.log(s), svc.log(s)
    again = svc.start_job("after", 2, steps=5)
    assert all(c == 0 for c in svc.wait(again).values())


def test_a_job_killed_mid_step_is_cleaned_up_while_another_finishes(service):
    svc = service(servers=2)
    victim = svc.start_job("victim", 2, steps=1000, sleep=0.05)
    survivor = svc.start_job("survivor", 2, steps=40, sleep=0.05)
    deadline = time.monotonic() + 60
    while "STEP 3" not in svc.log("victim-w1"):
        assert time.monotonic() < deadline, svc.log("victim-w1")
        time.sleep(0.05)
    svc.procs["victim-w1"].send_signal(signal.SIGKILL)
    codes = svc.wait(survivor)
    assert all(c == 0 for c in codes.values()), "\n".join(svc.log(n) for n in survivor)
    # The victim's other worker is told who was lost; it does not hang.
    assert svc.wait(["victim-w0"], timeout=60)["victim-w0"] != 0
    assert "worker 1" in svc.log("victim-w0"), svc.log("victim-w0")
    # Its state is gone from the service and its server instances ended.
    svc.wait_until(lambda st: all(j["name"] != "victim" for j in st["jobs"])
                   and all("victim" not in s["jobs"] for s in st["servers"]), "the victim's cleanup")
    for s in ("server0", "server1"):
        assert "job 'victim': its server ended" in svc.log(s) and "its memory is freed" in svc.log(s), svc.log(s)
    # The service and its servers keep serving: a new job runs.
    again = svc.start_job("after", 2, steps=5)
    assert all(c == 0 for c in svc.wait(again).values())


def test_a_token_opens_its_own_job_and_nothing_else(service):
    svc = service(servers=1)
    alpha = svc.token("alpha")
    assert alpha != svc.token("beta") and len(alpha) == 64
    script = worker_argv("service_job.py")
    # alpha's token, announced as beta; a made-up token; no token at all.
    for token, expect in ((alpha, "authentication failed"), ("0" * 64, "authentication failed"),
                          ("", "needs the job's token")):
        env = svc.worker_env("beta", 1, 0, token)
        if not token:
            env.pop("GRADHUB_JOB_TOKEN")
        p = subprocess.run(script, env=env, capture_output=True, text=True, timeout=60)
        assert p.returncode != 0 and expect in p.stderr, p.stdout + p.stderr
        # The refusal reveals nothing of the service's jobs.
        assert "alpha" not in p.stderr, p.stderr
    # A job's token cannot pose as the service: not as a server (which would
    # receive every job's gradients), nor as its operator.
    env = dict(svc.env, GRADHUB_SERVICE_TOKEN=alpha)
    p = subprocess.run([sys.executable, "-m", "gradhub", "server", "--service", "--connect-timeout", "5"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "authentication failed" in p.stderr, p.stdout + p.stderr
    out = gh("status", env=env)
    assert out.returncode != 0 and "authentication failed" in out.stderr, out.stdout + out.stderr
    assert len(svc.status()["servers"]) == 1
    # A bad job name is refused before anything is sent.
    env = svc.worker_env("bad/name", 1, 0, alpha)
    p = subprocess.run(script, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "invalid job name" in p.stderr, p.stderr
    # The right token works.
    assert all(c == 0 for c in svc.wait(svc.start_job("beta", 1, steps=3)).values())


def test_per_job_limits_and_the_job_limit_are_clear_errors(service):
    svc = service(servers=1, args=("--max-jobs", "1", "--job-max-tensors", "3"))
    script = worker_argv("service_job.py")
    # A first worker the job would refuse does not start it (no phantom job
    # holding a slot and server instances until the join timeout).
    p = subprocess.run(script, env=svc.worker_env("typo", 2, 5), capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "requested worker rank 5 but the job has 2" in p.stderr, p.stderr
    env = svc.worker_env("nosize", 1, 0)
    env.pop("GRADHUB_NUM_WORKERS")
    p = subprocess.run(script, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "needs its size" in p.stderr, p.stderr
    st = svc.status()
    assert not st["jobs"] and not any(s["jobs"] for s in st["servers"]), st
    first = svc.start_job("first", 1, steps=400, sleep=0.05)
    svc.wait_until(lambda st: any(j["state"] == "running" for j in st["jobs"]), "the first job")
    p = subprocess.run(worker_argv("service_job.py"), env=svc.worker_env("second", 1, 0),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "runs its limit of 1 jobs" in p.stderr, p.stderr
    svc.procs[first[0]].kill()
    svc.wait_until(lambda st: not st["jobs"], "the first job to end")
    # g, count and extra0 fit in 3 tensors; extra1 does not.
    [w] = svc.start_job("third", 1, steps=2, extra_tensors=2)
    assert svc.wait([w])[w] != 0
    assert "would hold 4 tensors on the service, over its limit of 3 per job" in svc.log(w), svc.log(w)


def test_service_across_emulated_hosts(hosts, tmp_path):
    """Service, servers and each job's workers in network namespaces of their
    own: the servers advertise addresses the jobs can reach."""
    svc_ns, svc_ip = hosts(0)
    server_hosts = [hosts(1), hosts(2)]
    job_hosts = {"east": hosts(3), "west": hosts(4)}
    svc = Service.__new__(Service)
    svc.tmp, svc.procs, svc.logs, svc.encrypt = tmp_path, {}, {}, {}
    svc.addr = f"{svc_ip}:9600"
    svc.env = job_env(GRADHUB_SERVICE_TOKEN=MASTER, GRADHUB_SCHEDULER=svc.addr)
    svc.env.pop("GRADHUB_JOB_TOKEN")
    py = [sys.executable, "-m", "gradhub"]
    try:
        svc.spawn("service", ["ip", "netns", "exec", svc_ns, *py, "scheduler", "--service", "--bind", svc.addr],
                  svc.env)
        for i, (ns, _) in enumerate(server_hosts):
            svc.spawn(f"server{i}", ["ip", "netns", "exec", ns, *py, "server", "--service", "--threads", "1"],
                      svc.env)
        # The operator asks from the service's own host.
        deadline = time.monotonic() + 30
        while True:
            out = subprocess.run(["ip", "netns", "exec", svc_ns, *py, "status", "--json"], env=svc.env,
                                 capture_output=True, text=True, timeout=30)
            if out.returncode == 0 and len(json.loads(out.stdout)["servers"]) == 2:
                break
            assert time.monotonic() < deadline, out.stdout + out.stderr + svc.log("service")
            time.sleep(0.3)
        addrs = sorted(s["addr"] for s in json.loads(out.stdout)["servers"])
        assert addrs == sorted(ip for _, ip in server_hosts), addrs
        names = []
        for job, (ns, _) in job_hosts.items():
            names += svc.start_job(job, 2, prefix=("ip", "netns", "exec", ns), steps=10)
        codes = svc.wait(names)
        assert all(c == 0 for c in codes.values()), "\n".join(svc.log(n) for n in names) + svc.log("service")
        for job in job_hosts:
            for r in range(2):
                assert f"[{job} worker {r}] PASS" in svc.log(f"{job}-w{r}")
    finally:
        svc.close()



def test_a_server_that_cannot_serve_a_job_fails_it_at_once(service, tmp_path):
    """A server process whose instance for a job cannot start (here: it is
    told to listen on an address this machine does not have) fails that job
    with the reason within a report interval, not at the join timeout."""
    svc = service(servers=1)
    svc.procs["server0"].kill()
    svc.procs["server0"].wait()
    svc.wait_until(lambda st: not st["servers"], "the good server to leave", timeout=30)
    svc.spawn("bad", [sys.executable, "-m", "gradhub", "server", "--service", "--threads", "1",
                      "--bind-host", "10.255.255.1"], svc.env)
    svc.wait_until(lambda st: len(st["servers"]) == 1, "the bad server to join")
    start = time.monotonic()
    p = subprocess.run(worker_argv("service_job.py"), env=svc.worker_env("doomed", 1, 0),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "could not serve it" in p.stderr and "10.255.255.1" in p.stderr, p.stderr
    assert time.monotonic() - start < 30, "the job failed only at its join timeout"
