"""`gradhub launch --min-workers`: an elastic job on the shared service the
launch starts for it. A worker lost mid-step while the minimum still runs
does not end the job (the survivors finish as one process would, the launch
exits 0 and names the lost worker); below the minimum the launch stops
everything and fails with the reason; the flags are checked; a service that cannot start fails the launch; each worker's
environment holds the job's token and bounds, never the master token."""

import argparse
import socket
import subprocess
import sys

from conftest import alarming, assert_labels_agree, job_env, run_launch

from gradhub.launch import elastic

# A lost worker's disconnection is seen at once; the peer timeout bounds the rest.
FLAGS = ["--peer-timeout", "3"]


def test_a_worker_lost_mid_step_leaves_the_others_to_finish_and_the_launch_succeeds():
    rc, out = run_launch(3, 1, "elastic_train.py", {"victim": 2, "lose_at": 5, "steps": 10},
                         launch_args=["--min-workers", "2", *FLAGS], timeout=90)
    assert rc == 0, out[-6000:]
    for w in (0, 1):
        assert f"[worker {w}] PASS" in out, out[-6000:]
    assert "[worker 2] PASS" not in out, out[-6000:]
    assert out.count("SIZE 2 ") == 2 and out.count("RESETS [2]") == 2, out[-6000:]
    assert "gradhub launch: worker 2 exited with code 9 (lost; the job went on with 2)" in out, out[-6000:]
    assert "the job finished with 2 of 3 workers; lost: worker 2 (exited with code 9)" in out, out[-6000:]
    # One numbering: what warns is the loss of worker 2, by that name; the
    # job's normal end (after the survivors' PASS) is quiet in every role.
    assert all("worker 2" in line for line in alarming(out)), alarming(out)
    end = out[out.rindex("] PASS"):]
    assert not alarming(end), end
    assert_labels_agree(out)


def test_with_max_workers_a_lost_worker_is_replaced_and_the_replacement_joins_at_a_commit():
    # --max-workers 3: worker 2 is lost, the launch starts worker 3, which
    # joins the two survivors at their next commit; all three finish as one
    # process would (they train on until the job is back to 3).
    rc, out = run_launch(3, 1, "elastic_train.py",
                         {"victim": 2, "lose_at": 3, "steps": 10, "step_sleep": 0.05, "final_size": 3},
                         launch_args=["--min-workers", "2", "--max-workers", "3", *FLAGS], timeout=150)
    assert rc == 0, out[-6000:]
    assert "gradhub launch: started worker 3 to replace worker 2; it joins at the job's next commit" in out, out[-6000:]
    # The newcomer takes rank 2 in the job, and its label follows.
    assert "[worker 2] [gradhub worker 2] this worker is rank 2 of 3" in out, out[-6000:]
    for w in (0, 1, 2):
        assert f"[worker {w}] PASS" in out, out[-6000:]
    assert out.count("SIZE 3 ") == 3, out[-6000:]
    assert out.count("RESETS [2, 3]") == 2 and "[worker 2] SIZE 3 RANK 2 RESETS []" in out, out[-6000:]
    assert_labels_agree(out)


def test_below_the_minimum_the_launch_stops_everything_and_fails_with_the_reason():
    rc, out = run_launch(3, 1, "elastic_train.py", {"victim": 2, "lose_at": 3, "steps": 10},
                         launch_args=["--min-workers", "3", *FLAGS], timeout=90)
    assert rc == 9, out[-6000:]
    assert ("gradhub launch: worker 2 exited with code 9, leaving 2 workers, fewer than --min-workers 3; "
            "stopping the job") in out, out[-6000:]
    assert "PASS" not in out, out[-6000:]


def _launch_rc(*flags: str) -> subprocess.CompletedProcess:
    """`gradhub launch` with `flags` (a worker command after "--": else one that does nothing)."""
    argv = [sys.executable, "-m", "gradhub", "launch", *flags]
    if "--" not in flags:
        argv += ["--", sys.executable, "-c", "pass"]
    return subprocess.run(argv, env=job_env(), capture_output=True, text=True, timeout=30)


def test_elastic_flags_out_of_bounds_are_refused_before_anything_starts():
    p = _launch_rc("-w", "2", "--min-workers", "3")
    assert p.returncode == 2 and "1 <= --min-workers (3) <= the workers (2) <= --max-workers (2)" in p.stderr, p
    p = _launch_rc("-w", "3", "--min-workers", "2", "--max-workers", "2")
    assert p.returncode == 2 and "<= --max-workers (2)" in p.stderr, p
    p = _launch_rc("-w", "2", "--max-workers", "4")
    assert p.returncode == 2 and "--max-workers needs --min-workers" in p.stderr, p


def test_each_role_gets_its_own_secret_and_workers_get_the_bounds():
    el = elastic.Elastic(argparse.Namespace(min_workers=2, max_workers=5))
    base = {"GRADHUB_JOB_TOKEN": "users-own", "GRADHUB_SERVICE_TOKEN_FILE": "/x", "PATH": "/bin"}
    svc = el.service_env(base)
    assert svc["GRADHUB_SERVICE_TOKEN"] == el.master and "GRADHUB_JOB_TOKEN" not in svc
    assert "GRADHUB_SERVICE_TOKEN_FILE" not in svc
    w = el.worker_env({**base, "GRADHUB_SERVICE_TOKEN": "leak"})
    assert w["GRADHUB_JOB"] == el.job and w["GRADHUB_JOB_TOKEN"] == el.token != el.master
    assert (w["GRADHUB_MIN_WORKERS"], w["GRADHUB_MAX_WORKERS"]) == ("2", "5")
    assert not {"GRADHUB_SERVICE_TOKEN", "GRADHUB_SERVICE_TOKEN_FILE"} & set(w), w
    # Without --max-workers the job's bound is its starting size (the worker's default).
    assert "GRADHUB_MAX_WORKERS" not in elastic.Elastic(argparse.Namespace(min_workers=1, max_workers=None)).worker_env({})
    # Two launches never share a job name or a master token.
    other = elastic.Elastic(argparse.Namespace(min_workers=2, max_workers=None))
    assert (other.job, other.master) != (el.job, el.master)


def test_a_service_that_cannot_start_fails_the_launch_before_any_worker_starts(tmp_path):
    # The port is taken: the job's service cannot listen, so no worker may start.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        marker = tmp_path / "started"
        p = _launch_rc("-w", "2", "--min-workers", "1", "--port", str(s.getsockname()[1]),
                       "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')")
    assert p.returncode == 1, p
    assert "the job's service did not start: scheduler exited (code " in p.stderr, p.stderr
    assert not marker.exists()
