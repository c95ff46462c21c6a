"""Helpers for integration tests that run real gradhub jobs on loopback."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradhub._ports import free_port

HERE = Path(__file__).parent
WORKERS = HERE / "workers"
ZYGOTE = HERE / "zygote.py"


def worker_argv(script: str, fresh: bool = False) -> list[str]:
    """The command that runs tests/workers/`script`: through the session's
    zygote (tests/zygote.py: torch already imported; the same process
    semantics), or, `fresh`, in an interpreter of its own (a test of
    interpreter start-up or exit)."""
    if fresh:
        return [sys.executable, str(WORKERS / script)]
    return [sys.executable, str(ZYGOTE), str(WORKERS / script)]


# Tests of the lab's emulated clusters (gradhub_lab.netns: shaped links,
# timed or byte-counted, each checking that no cluster of the lab's is left
# behind) or that start machine-wide daemons (sshd on emulated hosts, Slurm):
# under pytest-xdist they run one after another in one worker process, as
# their resources are the machine's, not the test's. Such a test is in one
# of these files or is marked `machine_wide`.
MACHINE_WIDE = {"test_launch_ssh.py", "test_launch_elastic_ssh.py", "test_launch_slurm.py", "test_plan_emulated.py"}
# Tests of emulated hosts made by the `hosts` fixture (tests/test_multihost.py:
# namespaces and a bridge named by the test process's id, their own subnet
# behind that bridge): one after another in one worker process too, but
# beside the machine-wide ones, with which they share no name or address.
EMULATED_HOSTS = {"test_multihost.py"}


def pytest_configure(config):
    config.addinivalue_line("markers", "machine_wide: uses the machine's network namespaces or daemons "
                                       "(runs one at a time with the others)")


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in MACHINE_WIDE or item.get_closest_marker("machine_wide"):
            item.add_marker(pytest.mark.xdist_group("machine-wide"))
        elif item.path.name in EMULATED_HOSTS or "hosts" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("emulated-hosts"))


@pytest.fixture(scope="session", autouse=True)
def zygote(tmp_path_factory):
    """One process per session that imports torch and gradhub once and
    forks each worker script run through `worker_argv` (GH_ZYGOTE names it;
    without it, or from another network namespace, workers run as usual)."""
    if os.environ.get("GH_NO_ZYGOTE"):
        yield None
        return
    path = tmp_path_factory.mktemp("zygote") / "sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADHUB_")}
    p = subprocess.Popen([sys.executable, str(ZYGOTE), "--serve", str(path)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    assert p.stdout is not None and p.stdout.readline() == b"ready\n", "the test zygote did not start"
    os.environ["GH_ZYGOTE"] = f"{path}|{os.readlink('/proc/self/ns/net')}"
    yield p
    os.environ.pop("GH_ZYGOTE", None)
    assert p.stdin is not None
    p.stdin.close()
    p.wait(timeout=30)


def free_port_pair() -> int:
    """A port p with p + 1 free too (torchrun's MASTER_PORT; gradhub's
    scheduler takes MASTER_PORT + 1 on every interface)."""
    for _ in range(100):
        p = free_port()
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("0.0.0.0", p))
                b.bind(("0.0.0.0", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no two adjacent free ports")


def job_env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADHUB_")}
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    env["PYTHONUNBUFFERED"] = "1"
    # Every test job authenticates its connections (tests of a missing token drop it).
    env["GRADHUB_JOB_TOKEN"] = "test-job-token"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_launch(workers: int, servers: int, script: str, config: dict | None = None, *, threads: int = 1,
               launch_args: list[str] | None = None, timeout: float = 240, env: dict | None = None,
               fresh: bool = False):
    """Run `gradhub launch` with a worker script from tests/workers; returns
    (rc, output). `fresh`: each worker in an interpreter of its own (`worker_argv`)."""
    argv = [sys.executable, "-m", "gradhub", "launch", "-w", str(workers), "-s", str(servers),
            "--server-threads", str(threads), *(launch_args or []), "--", *worker_argv(script, fresh)]
    e = job_env(GH_TEST=json.dumps(config or {}), **(env or {}))
    p = subprocess.run(argv, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    return p.returncode, p.stdout.decode(errors="replace")


def assert_all_passed(rc: int, out: str, workers: int) -> None:
    assert rc == 0, out[-6000:]
    for r in range(workers):
        assert f"[worker {r}] PASS" in out, out[-6000:]
    assert_labels_agree(out)


# A launcher's line whose process names itself: `[server 1] [gradhub server 1/t0] ...`.
_NAMED = re.compile(r"^\[(worker|server) (\d+)(?:@\S+)?\] \[gradhub (worker|server) (\d+)(?:/t\d+)?\]", re.M)


def assert_labels_agree(out: str) -> None:
    """One numbering: the launcher's label of each line in which a process
    names itself is that name."""
    for m in _NAMED.finditer(out):
        assert m.group(1, 2) == m.group(3, 4), f"label and name differ: {m.group(0)!r}\n{out[-6000:]}"


def alarming(out: str) -> list[str]:
    """The lines a user grepping a log for trouble would find."""
    return [line for line in out.splitlines() if "warning" in line.lower() or "failed" in line.lower()]


def restart_process(old: subprocess.Popen, argv: list[str], env: dict, log: Path) -> subprocess.Popen:
    """Kill `old` (SIGKILL, as an OOM kill would) if it runs, and start `argv`
    again; its output goes on in `log`, after a `--- restarted ---` line."""
    if old.poll() is None:
        old.kill()
    old.wait()
    with open(log, "ab") as f:
        f.write(b"--- restarted ---\n")
    return subprocess.Popen(argv, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT)


class Cluster:
    """Scheduler and servers as separate processes, for failure tests that
    need to kill or poke individual members."""

    def __init__(self, workers: int, servers: int, threads: int = 1, server_ports: list[int] | None = None,
                 scheduler_args: list[str] | None = None, server_args: list[list[str]] | None = None,
                 server_envs: list[dict] | None = None, scheduler_via: str | None = None, port: int | None = None, **env):
        """`server_args` and `server_envs`, by server, add to its command line and environment;
        the scheduler listens on 127.0.0.1:`port`, and `scheduler_via` is the address the
        members dial for it (a proxy to it)."""
        self.port = port or free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.workers = workers
        self.env = job_env(GRADHUB_SCHEDULER=scheduler_via or self.addr, GRADHUB_NUM_WORKERS=workers,
                           GRADHUB_NUM_SERVERS=servers, **env)
        py = [sys.executable, "-m", "gradhub"]
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self.scheduler_argv = py + ["scheduler", "--bind", self.addr, *(scheduler_args or [])]
        self._spawn("scheduler", self.scheduler_argv)
        for s in range(servers):
            argv = py + ["server", "--threads", str(threads), "--rank", str(s), "--advertise-addr", "127.0.0.1"]
            if server_ports:
                argv += ["--port", str(server_ports[s])]
            argv += server_args[s] if server_args else []
            env = dict(self.env, **{k: str(v) for k, v in (server_envs[s] if server_envs else {}).items()})
            self._spawn(f"server{s}", argv, env)

    def _spawn(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        log = Path(os.environ.get("TMPDIR", "/tmp")) / f"gradhub-test-{os.getpid()}-{self.port}-{name}.log"
        f = open(log, "wb")
        p = subprocess.Popen(argv, env=env or self.env, stdout=f, stderr=subprocess.STDOUT)
        self.procs[name] = p
        self.logs[name] = log
        return p

    def start_worker(self, rank: int, script: str, config: dict | None = None, fresh: bool = False,
                     **env) -> subprocess.Popen:
        """`fresh`: in an interpreter of its own (`worker_argv`), e.g. for a
        worker the test stops with SIGSTOP, which only the process itself gets."""
        env = dict(self.env, GRADHUB_RANK=str(rank), GH_TEST=json.dumps(config or {}), **env)
        return self._spawn(f"worker{rank}", worker_argv(script, fresh), env)

    def restart_scheduler(self) -> subprocess.Popen:
        """Kill the scheduler (SIGKILL, as an OOM kill would) if it runs, and
        start it again with the same arguments; its log goes on in the same file."""
        p = restart_process(self.procs["scheduler"], self.scheduler_argv, self.env, self.logs["scheduler"])
        self.procs["scheduler"] = p
        return p

    def log(self, name: str) -> str:
        return self.logs[name].read_text(errors="replace")

    def wait_for(self, name: str, text: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.log(name):
                return
            if self.procs[name].poll() is not None and text not in self.log(name):
                raise AssertionError(f"{name} exited before printing {text!r}:\n{self.log(name)}")
            time.sleep(0.05)
        raise AssertionError(f"{name} did not print {text!r} within {timeout}s:\n{self.log(name)}")

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
            p.wait()
        for log in self.logs.values():
            log.unlink(missing_ok=True)


@pytest.fixture
def cluster_factory():
    made: list[Cluster] = []

    def make(*args, **kwargs) -> Cluster:
        c = Cluster(*args, **kwargs)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()
