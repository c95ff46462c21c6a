"""The job token from the user's side: where it comes from, who refuses to
run without one, and that `gradhub launch` makes one up. (The handshake
itself, wrong tokens, replays and rogue members: tests/integration/auth.rs.)"""

import json
import subprocess
import sys

from conftest import WORKERS, free_port, job_env
from test_multihost import hosts, run_all  # noqa: F401  (the emulated-hosts fixture)


def gh(*args, env, timeout=60):
    return subprocess.run([sys.executable, "-m", "gradhub", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def no_token(**extra):
    env = job_env(**extra)
    env.pop("GRADHUB_JOB_TOKEN")
    return env


def test_members_reachable_from_other_machines_refuse_to_run_without_a_token():
    port = free_port()
    out = gh("scheduler", "--bind", f"0.0.0.0:{port}", "--workers", "1", "--servers", "1", env=no_token())
    assert out.returncode == 2, out.stderr
    assert "no job token" in out.stderr and "GRADHUB_JOB_TOKEN" in out.stderr and "--insecure" in out.stderr
    out = gh("server", "--scheduler", f"10.200.0.1:{port}", env=no_token())
    assert out.returncode == 2 and "no job token" in out.stderr, out.stderr
    # A loopback scheduler's server listens on loopback: no token needed to
    # start (it then waits for the scheduler, which is not there).
    out = gh("server", "--scheduler", f"127.0.0.1:{port}", "--connect-timeout", "0.5", env=no_token())
    assert out.returncode == 1 and "cannot reach the scheduler" in out.stderr, out.stderr
    # A worker, the same.
    code = "import gradhub; gradhub.init()"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=no_token(GRADHUB_SCHEDULER=f"10.200.0.1:{port}", GRADHUB_NUM_WORKERS=1,
                                      GRADHUB_NUM_SERVERS=1))
    assert out.returncode != 0 and "no job token" in out.stderr, out.stderr


def test_the_token_file_must_exist_and_hold_a_token(tmp_path):
    port = free_port()
    args = ("scheduler", "--bind", f"127.0.0.1:{port}", "--workers", "1", "--servers", "1")
    out = gh(*args, env=no_token(GRADHUB_JOB_TOKEN_FILE=str(tmp_path / "missing")))
    assert out.returncode == 2 and "GRADHUB_JOB_TOKEN_FILE" in out.stderr and "cannot read" in out.stderr
    (tmp_path / "empty").write_text("\n")
    out = gh(*args, env=no_token(GRADHUB_JOB_TOKEN_FILE=str(tmp_path / "empty")))
    assert out.returncode == 2 and "is empty" in out.stderr, out.stderr


def test_launch_makes_up_a_token():
    # Each worker prints the length of the token it was given.
    code = ("import os, gradhub; t = os.environ['GRADHUB_JOB_TOKEN']; gradhub.init(); "
            "print('TOKEN', len(t), gradhub.rank(), flush=True); gradhub.shutdown()")
    p = subprocess.run([sys.executable, "-m", "gradhub", "launch", "-w", "2", "-s", "1", "--",
                        sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=no_token())
    assert p.returncode == 0, p.stdout + p.stderr
    lines = [ln for ln in p.stdout.splitlines() if "TOKEN" in ln]
    assert len(lines) == 2 and all("TOKEN 64" in ln for ln in lines), p.stdout


def test_torchrun_jobs_share_a_token_made_up_by_rank_0_through_torchruns_store(tmp_path):
    # A real torchrun (standalone: its agent's store on this machine); the job
    # hosts its scheduler and server, and nobody set GRADHUB_JOB_TOKEN.
    script = tmp_path / "job.py"
    script.write_text(
        "import os, numpy as np, gradhub\n"
        "gradhub.init()\n"
        "x = np.full(5000, gradhub.rank() + 1, np.float32)\n"
        "gradhub.push_pull(x, name='x')\n"
        "assert (x == 3).all(), x[:4]\n"
        # one write(2) of a short line: atomic on the pipe both ranks share
        "os.write(1, f'PASS {gradhub.rank()}\\n'.encode())\n"
        "gradhub.shutdown()\n")
    env = {k: v for k, v in no_token().items() if not k.startswith("GRADHUB_")}
    env["GRADHUB_SCHEDULER_PORT"] = str(free_port())
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          str(script)], capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS 0" in out.stdout and "PASS 1" in out.stdout, out.stdout
    assert "job token: made up by rank 0, shared through torchrun's store" in out.stderr, out.stderr


def test_a_stranger_on_another_host_cannot_join_squat_or_pose_as_a_server(hosts, tmp_path):
    """A multi-host job, every role on a host of its own, and a process on a
    fifth host without the token. Before the workers start, it tries to
    register as a worker (taking the slot a real worker needs) and as a
    server; while the job runs, to claim worker 0 on each server port. All
    are refused, the scheduler logs it, and the job's sums stay exact."""
    (sched_ns, sched_ip), (server_ns, server_ip) = hosts(0), hosts(1)
    workers, (rogue_ns, _) = [hosts(2), hosts(3)], hosts(4)
    stop = tmp_path / "stop"
    env = job_env(GRADHUB_SCHEDULER=f"{sched_ip}:9556", GRADHUB_NUM_WORKERS=2, GRADHUB_NUM_SERVERS=1,
                  GRADHUB_JOB_TOKEN="the-real-job-token", GH_TEST=json.dumps({"stop": str(stop)}))
    rogue_env = {k: v for k, v in env.items() if not k.startswith("GRADHUB_")}
    py = sys.executable

    def run(ns, argv, e=env):
        return subprocess.Popen(["ip", "netns", "exec", ns, *argv], env=e, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)

    def rogue(*args):
        out = subprocess.run(["ip", "netns", "exec", rogue_ns, py, str(WORKERS / "rogue.py"), *args],
                             env=rogue_env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "ACCEPTED" not in out.stdout, out.stdout + out.stderr
        return out.stdout

    procs = [run(sched_ns, [py, "-m", "gradhub", "scheduler"]),
             run(server_ns, [py, "-m", "gradhub", "server", "--threads", "2", "--port", "9700"])]
    try:
        said = rogue("register", f"{sched_ip}:9556")
        for what in ("worker with a wrong token", "worker without a token", "server"):
            assert f"REFUSED {what}" in said, said
        procs += [run(ns, [py, str(WORKERS / "until_file.py")], dict(env, GRADHUB_RANK=str(r)))
                  for r, (ns, _) in enumerate(workers)]
        said = rogue("squat", server_ip, "9700", "9701")
        assert "REFUSED rank 0 on port 9700" in said and "REFUSED rank 0 on port 9701" in said, said
        stop.touch()
        outs = run_all(procs, timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert "PASS 0" in outs[2] and "PASS 1" in outs[3], outs
    assert "rejecting" in outs[0], outs[0]  # the scheduler logs its rejections
