"""Encryption from the user's side (GRADHUB_ENCRYPT, `--encrypt`): an
encrypted job trains exactly as one that is not, over every kind of
connection, losing a server included; a member that disagrees is refused
naming the setting; a byte changed on the way fails its tag and is sent
again, never summed. Roles started by hand. (The handshake and the sealing
itself: tests/integration/encryption.rs and the Rust unit tests.)"""

import subprocess
import sys

from conftest import free_port, job_env
from test_failover import WORKERS, lose_server, start
from test_links import finish, flip_bytes, proxied_job, proxies  # noqa: F401  (the proxies fixture)


def test_an_encrypted_job_trains_exactly_and_goes_on_after_losing_a_server(cluster_factory):
    # The optimizer on the servers: each chunk's state is kept on a replica
    # over a server-to-server link (sealed too); a server is killed and its
    # chunks move to their replicas. torch_train.py checks every worker's
    # parameters against single-process training on the combined batch.
    cfg = {"model": "mlp", "opt": "adamw", "steps": 16, "step_sleep": 0.05, "server": True}
    c = start(cluster_factory, "torch_train.py", cfg, "0", GRADHUB_ENCRYPT="1")
    lose_server(c, "kill", "STEP 5")
    for w in range(WORKERS):
        assert c.procs[f"worker{w}"].wait(timeout=120) == 0, c.log(f"worker{w}")
        assert f"PASS {w}" in c.log(f"worker{w}") and "server 1 was lost" in c.log(f"worker{w}")
    assert c.procs["scheduler"].wait(timeout=30) == 0, c.log("scheduler")
    takers = [c.log(s) for s in ("server0", "server2")]
    assert any("taking over its chunks" in log for log in takers), takers


def test_a_member_that_does_not_encrypt_is_refused_naming_the_setting():
    port = free_port()
    env = job_env(GRADHUB_SCHEDULER=f"127.0.0.1:{port}", GRADHUB_NUM_WORKERS=1, GRADHUB_NUM_SERVERS=1)
    sched = subprocess.Popen([sys.executable, "-m", "gradhub", "scheduler", "--bind", f"127.0.0.1:{port}",
                              "--encrypt"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out = subprocess.run([sys.executable, "-m", "gradhub", "server", "--connect-timeout", "5"], env=env,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 1, out.stdout + out.stderr
        assert "GRADHUB_ENCRYPT" in out.stderr and "encrypt their connections" in out.stderr, out.stderr
        code = "import gradhub; gradhub.init()"
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode != 0 and "GRADHUB_ENCRYPT" in out.stderr, out.stderr
    finally:
        sched.kill()
        sched.wait()
    # Encryption without a token is refused before anything starts.
    no_token = dict(env, GRADHUB_ENCRYPT="1")
    no_token.pop("GRADHUB_JOB_TOKEN")
    out = subprocess.run([sys.executable, "-m", "gradhub", "scheduler", "--bind", f"127.0.0.1:{port}"],
                         env=no_token, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "needs a job token" in out.stderr, out.stderr


def test_a_byte_changed_on_an_encrypted_link_fails_its_tag_and_is_sent_again(cluster_factory, proxies):
    c, proxy = proxied_job(cluster_factory, proxies, GRADHUB_ENCRYPT="1")
    flip_bytes(c, proxy, (("up", 300_000), ("down", 500_000), ("up", 1_000_003)))
    finish(c, proxy)
    logs = c.log("worker0") + c.log("worker1") + c.log("server0")
    assert "authentication tag mismatch" in logs, logs
    assert "connected again" in logs, logs
