"""The job token from the user's side: where it comes from, who refuses to
run without one, and that `gradhub launch` makes one up. (The handshake
itself, wrong tokens, replays and rogue members: tests/integration/auth.rs.)"""

import subprocess
import sys

from conftest import free_port, job_env


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
