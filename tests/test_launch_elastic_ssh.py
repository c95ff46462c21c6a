"""`gradhub launch -H ... --min-workers`: an elastic job across emulated
hosts over SSH (test_launch_ssh's namespaces and sshds; run it under the
shared lock): the service runs on the launcher's host, its servers and the
workers over ssh; a worker lost mid-step leaves the others to finish, and
the launch succeeds naming it, and stops the service on every host."""

import json
import time
import uuid

from conftest import WORKERS
from test_launch_ssh import _launch, _marked, ssh_hosts  # noqa: F401 (the fixture)


def test_an_elastic_job_over_ssh_goes_on_without_a_lost_worker(ssh_hosts, tmp_path):  # noqa: F811
    a, b = ssh_hosts.hosts["a"], ssh_hosts.hosts["b"]
    cfg = {"victim": 2, "lose_at": 4, "steps": 8}
    marker = uuid.uuid4().hex
    p = _launch(ssh_hosts, tmp_path, f"{a.ip}:2,{b.ip}:1", WORKERS / "elastic_train.py", marker,
                extra=["--min-workers", "2", "--peer-timeout", "3"], GH_TEST=json.dumps(cfg))
    try:
        out, err = p.communicate(timeout=150)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, out[-4000:] + err[-4000:]
    for w in (0, 1):
        assert f"[worker {w}@{a.ip}] PASS" in out, out[-4000:]
    assert out.count("SIZE 2 ") == 2, out[-4000:]
    assert f"gradhub launch: worker 2@{b.ip} exited with code 9 (lost; the job went on with 2)" in err, err
    # The master token went over ssh's stdin: no process's command line holds it.
    assert "GRADHUB_SERVICE_TOKEN" not in err and "GRADHUB_JOB_TOKEN" not in err
    # The service and its servers do not exit by themselves: the launch stopped them on every host.
    deadline = time.monotonic() + 30  # a hang guard: a process left behind fails below
    while _marked(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _marked(marker) == []


def test_over_ssh_a_lost_worker_is_replaced_on_its_host(ssh_hosts, tmp_path):  # noqa: F811
    a, b = ssh_hosts.hosts["a"], ssh_hosts.hosts["b"]
    cfg = {"victim": 2, "lose_at": 3, "steps": 8, "step_sleep": 0.05, "final_size": 3}
    marker = uuid.uuid4().hex
    p = _launch(ssh_hosts, tmp_path, f"{a.ip}:2,{b.ip}:1", WORKERS / "elastic_train.py", marker,
                extra=["--min-workers", "2", "--max-workers", "3", "--peer-timeout", "3"], GH_TEST=json.dumps(cfg))
    try:
        out, err = p.communicate(timeout=150)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, out[-4000:] + err[-4000:]
    assert f"gradhub launch: started worker 3@{b.ip} to replace worker 2@{b.ip}" in err, err
    for w in (f"0@{a.ip}", f"1@{a.ip}", f"3@{b.ip}"):
        assert f"[worker {w}] PASS" in out, out[-4000:]
    assert out.count("SIZE 3 ") == 3, out[-4000:]
    deadline = time.monotonic() + 30
    while _marked(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _marked(marker) == []
