"""`gradhub launch -H` across emulated hosts: network namespaces, each
running its own sshd (Debian's openssh-server, installed by ./install.sh).
The launcher runs on a host of its own and starts every server and worker
over ssh; sums are checked on every worker; a remote worker killed stops
every process on every host, and the launcher returns its code."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

import gradhub
from conftest import WORKERS, job_env
from gradhub_lab.netns import EmulatedCluster, check_available

SSH_PORT = 2222


def _sshd(host, tmp: Path, hide_gradhub: bool = False) -> subprocess.Popen:
    """An sshd in `host`'s namespace that lets in the test's key, as root;
    `hide_gradhub`: in a mount namespace where gradhub's package directory
    is empty (a host without gradhub)."""
    cfg = tmp / f"sshd_{host.name}"
    cfg.write_text(f"Port {SSH_PORT}\nListenAddress {host.ip}\nHostKey {tmp / 'hostkey'}\n"
                   f"AuthorizedKeysFile {tmp / 'id.pub'}\nPermitRootLogin yes\nPasswordAuthentication no\n"
                   "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nPidFile none\n")
    argv = ["/usr/sbin/sshd", "-D", "-e", "-f", str(cfg)]
    if hide_gradhub:
        pkg = Path(gradhub.__file__).parent
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                f"mount -t tmpfs none {pkg} && exec {' '.join(argv)}"]
    p = subprocess.Popen(host.cmd(argv), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert p.stderr is not None
    ready = threading.Event()

    def watch():
        for line in p.stderr:
            if "Server listening" in line:
                ready.set()

    threading.Thread(target=watch, daemon=True).start()
    assert ready.wait(30), f"sshd on {host.name} did not start"
    return p


@pytest.fixture
def ssh_hosts(tmp_path):
    why = check_available()
    if why:
        pytest.skip(why)
    if not os.path.exists("/usr/sbin/sshd"):
        pytest.fail("openssh-server is missing: ./install.sh installs it (as root)")
    os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
    for name in ("id", "hostkey"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / name)], check=True)
    (tmp_path / "ssh_config").write_text("Host *\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n"
                                         "  User root\n")
    sshds = []
    with EmulatedCluster(["a", "b", "c", "d"], rate=None) as cluster:
        try:
            for name in ("a", "b", "c", "d"):
                sshds.append(_sshd(cluster.hosts[name], tmp_path, hide_gradhub=name == "d"))
            yield cluster
        finally:
            for p in sshds:
                p.terminate()
                p.wait(10)


def _launch(cluster, tmp: Path, hosts: str | None, script: Path, marker: str, extra: list[str] | None = None,
            **env) -> subprocess.Popen:
    """`gradhub launch -H hosts` (None: the hosts come from `extra`) from the launcher's own host."""
    argv = [sys.executable, "-m", "gradhub", "launch", *(["-H", hosts] if hosts else []), "--ssh-port", str(SSH_PORT),
            "--ssh-identity-file", str(tmp / "id"), "--ssh-config", str(tmp / "ssh_config"), *(extra or []),
            "--", sys.executable, str(script)]
    e = job_env(GH_SSH_TEST=marker, **env)
    e.pop("GRADHUB_JOB_TOKEN")  # the launcher makes one up and hands it over ssh's stdin
    return subprocess.Popen(cluster.hosts["sched"].cmd(argv), env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _marked(marker: str) -> list[int]:
    """Processes (on any emulated host: one pid namespace) of the job with `marker`."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if f"GH_SSH_TEST={marker}".encode() in (d / "environ").read_bytes().split(b"\0"):
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


def _scheduler_pid(marker: str) -> int:
    """The job's scheduler process (`python -m gradhub scheduler ...`)."""
    for pid in _marked(marker):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[3:4] == [b"scheduler"]:
                return pid
        except OSError:
            pass
    raise AssertionError("no scheduler process")


def _same_netns(pid: int, host) -> bool:
    return os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat(f"/run/netns/{host.ns}").st_ino


def test_lightning_trains_across_two_hosts_with_the_ranks_the_launcher_gave(ssh_hosts, tmp_path):
    """examples/lightning_ddp.py (DDPStrategy on the gradhub backend) on 2
    hosts x 2: Lightning takes each worker's node from the NODE_RANK the
    launcher exports, so its global ranks are the launcher's (worker r on
    host r // 2), and training equals one process (the example checks)."""
    pytest.importorskip("lightning")
    cluster = ssh_hosts
    a, b = cluster.hosts["a"], cluster.hosts["b"]
    example = Path(__file__).resolve().parent.parent / "examples" / "lightning_ddp.py"
    p = _launch(cluster, tmp_path, f"{a.ip}:2,{b.ip}:2", example, uuid.uuid4().hex)
    try:
        out, err = p.communicate(timeout=300)
    finally:
        p.kill()
    assert p.returncode == 0, out[-6000:] + err[-3000:]
    for r, host in ((0, a), (1, a), (2, b), (3, b)):
        assert f"[worker {r}@{host.ip}] PASS rank {r}/4: Lightning DDP on gradhub" in out, out[-6000:]


@pytest.mark.parametrize("where", ["local", "first"])
def test_a_job_over_ssh_sums_exactly_and_a_killed_worker_stops_every_host(ssh_hosts, tmp_path, where):
    """The scheduler on the launcher's host, or (--scheduler-host first) on a."""
    cluster = ssh_hosts
    a, b, c = (cluster.hosts[n] for n in "abc")
    marker = uuid.uuid4().hex
    cfg = {"sizes": [10, 100003], "dtypes": ["float32", "float16"], "rounds": 2}
    p = _launch(cluster, tmp_path, f"{a.ip}:2,{b.ip}:2", WORKERS / "check_sums.py", marker,
                extra=["--server-hosts", c.ip, "--scheduler-host", where], GH_TEST=json.dumps(cfg))
    out, err = p.communicate(timeout=240)
    assert p.returncode == 0, out[-4000:] + err[-4000:]
    sched = (a if where == "first" else cluster.hosts["sched"]).ip
    assert f"scheduler on {a.ip if where == 'first' else 'this machine'} at {sched}:" in err, err
    assert f"[scheduler{'@' + a.ip if where == 'first' else ''}] " in out, out[-4000:]  # labelled like the rest
    for r, host, local in ((0, a, 0), (1, a, 1), (2, b, 0), (3, b, 1)):
        assert f"[worker {r}@{host.ip}] PASS {r}" in out, out[-4000:]
        assert f"[worker {r}@{host.ip}] LOCAL {local} of 2" in out, out[-4000:]
        node = 0 if host is a else 1
        assert f"[worker {r}@{host.ip}] NODE {node} GROUP {node} OF 2 LOCAL_WORLD_SIZE 2" in out, out[-4000:]
    assert f"[server 0@{c.ip}]" in out
    # The token went over stdin: no process's command line holds it.
    assert "GRADHUB_JOB_TOKEN" not in err

    # Every worker reports its pid, then waits in the job; worker 2 (on b) is killed.
    pids = tmp_path / "pids"
    pids.mkdir()
    script = tmp_path / "wait.py"
    script.write_text(f"import os, time, gradhub\ngradhub.init()\n"
                      f"open(os.path.join({str(pids)!r}, str(gradhub.rank())), 'w').write(str(os.getpid()))\n"
                      "gradhub.barrier()\ntime.sleep(300)\n")
    marker = uuid.uuid4().hex
    p = _launch(cluster, tmp_path, f"{a.ip}:2,{b.ip}:2", script, marker, extra=["--scheduler-host", where])
    try:
        deadline = time.monotonic() + 120  # a hang guard
        while len(list(pids.iterdir())) < 4 and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(list(pids.iterdir())) == 4, p.communicate(timeout=30)
        started = _marked(marker)
        assert len(started) >= 1 + 2 + 4  # the scheduler, 2 servers, 4 workers (and ssh, bootstraps)
        assert _same_netns(_scheduler_pid(marker), a if where == "first" else cluster.hosts["sched"])
        os.kill(int((pids / "2").read_text()), signal.SIGKILL)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGKILL, out[-3000:] + err[-3000:]
    assert f"gradhub launch: worker 2@{b.ip} exited with code {128 + signal.SIGKILL}; stopping the job" in err, err
    left = _marked(marker)
    deadline = time.monotonic() + 30  # a hang guard: a process left behind fails below
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _marked(marker)
    assert left == [], [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in left if os.path.exists(f"/proc/{pid}")]


def test_an_unreachable_host_or_missing_gradhub_is_an_error_before_anything_starts(ssh_hosts, tmp_path):
    cluster = ssh_hosts
    a = cluster.hosts["a"]
    marker = uuid.uuid4().hex
    # A host with no sshd (the scheduler's own namespace has none on that port).
    p = _launch(cluster, tmp_path, f"{a.ip}:1,{cluster.hosts['sched'].ip}:1", WORKERS / "check_sums.py", marker)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 2, out + err
    assert f"cannot reach {cluster.hosts['sched'].ip} over ssh" in err and "nothing was started" in err, err
    assert "[worker" not in out
    # A host whose Python lacks gradhub.
    d = cluster.hosts["d"]
    p = _launch(cluster, tmp_path, f"{a.ip}:1,{d.ip}:1", WORKERS / "check_sums.py", marker)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 2, out + err
    assert f"{d.ip}: gradhub is not installed for {sys.executable}" in err and a.ip not in err, err
    assert "[worker" not in out and _marked(marker) == []
