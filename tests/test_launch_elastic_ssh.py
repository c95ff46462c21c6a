"""`gradhub launch -H ... --min-workers`: an elastic job across emulated
hosts over SSH (test_launch_ssh's namespaces and sshds; run it under the
shared lock): the service runs on the launcher's host, its servers and the
workers over ssh; a worker lost mid-step leaves the others to finish, and
the launch succeeds naming it, and stops the service on every host. With
--host-discovery-script, the job follows the hosts the script lists: it
grows onto a host added and stops the workers of a host removed (its
service on the first host: --scheduler-host first)."""

import json
import subprocess
import threading
import time
import uuid

from conftest import WORKERS
from test_launch_ssh import _launch, _marked, ssh_hosts  # noqa: F401 (the fixture)

# Seconds a worker waits after each step while the job waits for a worker to
# join: a new worker takes seconds to start over ssh, and the workers' check
# against one process's training holds to 1e-5 over tens of steps, not
# hundreds (the float rounding of split sums grows step by step).
STEP_SLEEP = 0.25


class Job:
    """A launch under way: its stdout and stderr read on threads as they come."""

    def __init__(self, p: subprocess.Popen, marker: str):
        self.p, self.marker = p, marker
        self.out: list[str] = []
        self.err: list[str] = []
        self.pumps = [threading.Thread(target=lambda f=f, to=to: to.extend(f), daemon=True)
                      for f, to in ((p.stdout, self.out), (p.stderr, self.err))]
        for t in self.pumps:
            t.start()

    def wait_for(self, text: str) -> None:
        """Until a line of stdout holds `text` (bounded)."""
        deadline = time.monotonic() + 60  # a hang guard
        while not any(text in x for x in self.out) and self.p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert any(text in x for x in self.out), "".join(self.out)[-4000:] + "".join(self.err)[-4000:]

    def finished(self, timeout: float = 150) -> tuple[str, str]:
        """Wait for the launch (it must succeed) and for every process of the
        job to be gone: the service and its servers do not exit by themselves,
        the launch stops them on every host. Its stdout and stderr."""
        try:
            self.p.wait(timeout)
        finally:
            if self.p.poll() is None:
                self.p.kill()
            for t in self.pumps:
                t.join(10)
        out, err = "".join(self.out), "".join(self.err)
        assert self.p.returncode == 0, err[-3000:] + out[-5000:]
        deadline = time.monotonic() + 30  # a hang guard: a process left behind fails below
        while _marked(self.marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _marked(self.marker) == []
        return out, err


def test_an_elastic_job_over_ssh_goes_on_without_a_lost_worker(ssh_hosts, tmp_path):  # noqa: F811
    a, b = ssh_hosts.hosts["a"], ssh_hosts.hosts["b"]
    cfg = {"victim": 2, "lose_at": 4, "steps": 8}
    marker = uuid.uuid4().hex
    p = _launch(ssh_hosts, tmp_path, f"{a.ip}:2,{b.ip}:1", WORKERS / "elastic_train.py", marker,
                extra=["--min-workers", "2", "--peer-timeout", "3"], GH_TEST=json.dumps(cfg))
    out, err = Job(p, marker).finished()
    for w in (0, 1):
        assert f"[worker {w}@{a.ip}] PASS" in out, out[-4000:]
    assert out.count("SIZE 2 ") == 2, out[-4000:]
    assert f"gradhub launch: worker 2@{b.ip} exited with code 9 (lost; the job went on with 2)" in err, err
    # The master token went over ssh's stdin: no process's command line holds it.
    assert "GRADHUB_SERVICE_TOKEN" not in err and "GRADHUB_JOB_TOKEN" not in err


def test_over_ssh_a_lost_worker_is_replaced_on_its_host(ssh_hosts, tmp_path):  # noqa: F811
    a, b = ssh_hosts.hosts["a"], ssh_hosts.hosts["b"]
    cfg = {"victim": 2, "lose_at": 3, "steps": 8, "step_sleep": STEP_SLEEP, "final_size": 3}
    marker = uuid.uuid4().hex
    p = _launch(ssh_hosts, tmp_path, f"{a.ip}:2,{b.ip}:1", WORKERS / "elastic_train.py", marker,
                extra=["--min-workers", "2", "--max-workers", "3", "--peer-timeout", "3"], GH_TEST=json.dumps(cfg))
    out, err = Job(p, marker).finished()
    assert f"gradhub launch: started worker 3@{b.ip} to replace worker 2@{b.ip}" in err, err
    # The newcomer takes rank 2 in the job, and its label follows.
    for w in (f"0@{a.ip}", f"1@{a.ip}", f"2@{b.ip}"):
        assert f"[worker {w}] PASS" in out, out[-4000:]
    assert out.count("SIZE 3 ") == 3, out[-4000:]


def test_a_discovered_job_grows_onto_a_host_added_and_leaves_a_host_removed(ssh_hosts, tmp_path):  # noqa: F811
    a, b = ssh_hosts.hosts["a"], ssh_hosts.hosts["b"]
    hosts = tmp_path / "hosts"
    hosts.write_text(f"{a.ip}:2\n")
    # Trains on until the job has had 3 workers, then 2 again (slowly: STEP_SLEEP).
    cfg = {"steps": 8, "step_sleep": STEP_SLEEP, "final_size": [3, 2]}
    marker = uuid.uuid4().hex
    p = _launch(ssh_hosts, tmp_path, None, WORKERS / "elastic_train.py", marker,
                extra=["--host-discovery-script", f"cat {hosts}", "--discovery-interval", "0.5",
                       "--min-workers", "2", "--max-workers", "3", "--peer-timeout", "3", "--scheduler-host", "first"],
                GH_TEST=json.dumps(cfg))
    job = Job(p, marker)
    try:
        job.wait_for("STEP 2 AT SIZE 2")
        hosts.write_text(f"{a.ip}:2\n{b.ip}:1\n")  # b added: a worker there, the job grows to 3
        job.wait_for("AT SIZE 3")
        hosts.write_text(f"{a.ip}:2\n")  # b removed: its worker is stopped, the job goes on with 2
    except BaseException:
        p.terminate()  # the launcher stops the job on every host
        p.wait(60)
        raise
    out, err = job.finished()
    # The job's shared service ran on the first host found.
    assert f"an elastic job on a shared service on {a.ip} at {a.ip}:" in err, err
    assert f"{b.ip} was discovered with a free slot: started worker 2@{b.ip}" in err, err
    assert f"stopping worker 2@{b.ip}: {b.ip} left the discovered hosts" in err, err
    assert f"worker 2@{b.ip} stopped (the job went on with 2)" in err, err
    assert f"[worker 2@{b.ip}] STEP" in out and f"[worker 2@{b.ip}] PASS" not in out
    for w in (0, 1):
        assert f"[worker {w}@{a.ip}] PASS" in out, out[-4000:]
    assert out.count("SIZE 2 RANK") == 2, out[-4000:]
