"""Failure handling: dead and stalled peers, bad input, user errors."""

import os
import resource
import signal
import socket
import struct
import sys
import time

import numpy as np
import pytest

from conftest import assert_all_passed, free_port, run_launch
from gradhub._core import PROTOCOL_VERSION, encode_frame


def wait_line(cluster, name, text, timeout=30):
    cluster.wait_for(name, text, timeout)
    return next(line for line in cluster.log(name).splitlines() if text in line)


@pytest.mark.parametrize("servers,env", [(2, {"GRADHUB_FAILOVER": "0"}), (1, {})], ids=["failover-off", "one-server"])
def test_server_killed_mid_round_raises_naming_it(cluster_factory, tmp_path, servers, env):
    # Without failover (turned off, or no other server to take over) a lost
    # server fails the job; test_failover.py has the job going on.
    c = cluster_factory(2, servers, **env)
    cfg = {"go_file": str(tmp_path / "never"), "size": 1_000_000}
    c.start_worker(0, "hold.py", cfg)
    c.start_worker(1, "hold.py", cfg)
    c.wait_for("worker0", "WAITING")
    time.sleep(0.3)  # worker 0's chunks are now pushed and waiting for worker 1
    killed = time.monotonic()
    c.procs[f"server{servers - 1}"].send_signal(signal.SIGKILL)
    line = wait_line(c, "worker0", "RAISED", timeout=20)
    assert time.monotonic() - killed < 20
    assert f"server {servers - 1}" in line, line
    assert c.procs["worker0"].wait(timeout=20) == 3, c.log("worker0")


def test_worker_killed_is_reported_to_the_others(cluster_factory, tmp_path):
    c = cluster_factory(2, 1)
    cfg = {"go_file": str(tmp_path / "never")}
    c.start_worker(0, "hold.py", cfg)
    c.start_worker(1, "hold.py", cfg)
    c.wait_for("worker0", "WAITING")
    c.wait_for("worker1", "READY")
    c.procs["worker1"].send_signal(signal.SIGKILL)
    line = wait_line(c, "worker0", "RAISED", timeout=20)
    assert "worker 1" in line, line
    # The scheduler and the server end with an error, they don't hang.
    assert c.procs["scheduler"].wait(timeout=20) == 1, c.log("scheduler")
    assert c.procs["server0"].wait(timeout=20) == 1, c.log("server0")


def test_a_process_set_member_killed_is_reported_to_members_and_non_members(cluster_factory):
    # Roles started one by one. Worker 2 is outside the set [0, 1]: its
    # process-set thread pushes zeros for the set's rounds while it waits in a
    # global barrier. Killing worker 1 must reach worker 0 and worker 2.
    c = cluster_factory(3, 1)
    for w in range(3):
        c.start_worker(w, "set_member_dies.py")
    c.wait_for("worker1", "READY")
    c.wait_for("worker2", "WAITING")
    c.procs["worker1"].send_signal(signal.SIGKILL)
    for w in (0, 2):
        line = wait_line(c, f"worker{w}", "RAISED", timeout=20)
        assert "worker 1" in line, line
        assert c.procs[f"worker{w}"].wait(timeout=20) == 3, c.log(f"worker{w}")
    assert c.procs["scheduler"].wait(timeout=20) == 1, c.log("scheduler")
    assert c.procs["server0"].wait(timeout=20) == 1, c.log("server0")


def test_completion_callbacks_at_exit_neither_abort_nor_are_cut_short():
    # A callback still running when the script ends finishes, and the
    # worker exits with the script's status.
    rc, out = run_launch(1, 1, "callback_at_exit.py", {"status": 5}, fresh=True)  # a real exit
    assert rc == 5 and "CALLBACK DONE" in out and "panicked" not in out, out[-4000:]
    # Operations in flight at exit: shutdown fails them, and their callbacks
    # met the interpreter's finalization on the callback thread (a panic
    # in most runs, SIGABRT in some, before the fix).
    for _ in range(3):
        rc, out = run_launch(2, 1, "callback_at_exit.py", {"status": 5, "mode": "in_flight"}, fresh=True)
        mine = "\n".join(line for line in out.splitlines() if line.startswith("[worker 0]"))
        assert rc == 5 and "EXITING" in mine, out[-4000:]
        assert "panicked" not in mine and "Fatal Python error" not in mine, mine[-4000:]


@pytest.mark.parametrize("how", ["exception", "shutdown"])
def test_a_worker_that_fails_is_not_a_worker_that_finished(cluster_factory, tmp_path, how):
    # An unhandled exception, or shutdown() with an operation in flight, used to
    # send the same goodbye as a clean exit: the others waited forever.
    c = cluster_factory(2, 1)
    cfg = {"hold_exits": how}
    c.start_worker(0, "hold.py", cfg)
    c.start_worker(1, "hold.py", cfg)
    c.wait_for("worker0", "WAITING")
    line = wait_line(c, "worker0", "RAISED", timeout=20)
    want = "ZeroDivisionError: a bug in the training script" if how == "exception" else "operations in flight: never_matched"
    assert "worker 1" in line and want in line, line
    assert c.procs["worker1"].wait(timeout=20) == (1 if how == "exception" else 0), c.log("worker1")
    assert c.procs["scheduler"].wait(timeout=20) == 1, c.log("scheduler")
    assert c.procs["server0"].wait(timeout=20) == 1, c.log("server0")


@pytest.mark.parametrize("what,how,host_reduce", [
    ("named", "shutdown", "1"), ("named", "exit1", "0"), ("unnamed", "shutdown", "0"), ("barrier", "shutdown", "1"),
])
def test_a_worker_that_left_fails_what_still_needs_it(cluster_factory, what, how, host_reduce):
    # Uneven steps: worker 1 leaves cleanly (shutdown, or sys.exit(1) with
    # nothing in flight) after 2 rounds; worker 0's third round (through the
    # host stage or straight to the server, a named or a new tensor, or a
    # barrier) used to wait forever for it.
    c = cluster_factory(2, 1, GRADHUB_HOST_REDUCE=host_reduce)
    cfg = {"what": what, "how": how, "steps": 3, "leave_steps": 2}
    c.start_worker(0, "leave.py", cfg)
    c.start_worker(1, "leave.py", cfg)
    c.wait_for("worker1", "LEFT")
    line = wait_line(c, "worker0", "RAISED", timeout=30)
    assert "left the job" in line and "1" in line and "same collective operations" in line, line
    assert "STEP 1" in c.log("worker0") and "STEP 2" not in c.log("worker0")
    assert c.procs["worker1"].wait(timeout=20) == (1 if how == "exit1" else 0), c.log("worker1")
    assert c.procs["worker0"].wait(timeout=20) == 3, c.log("worker0")
    assert c.procs["scheduler"].wait(timeout=20) == 1, c.log("scheduler")
    assert c.procs["server0"].wait(timeout=20) == 1, c.log("server0")


def test_silent_peer_detected_by_heartbeat(cluster_factory, tmp_path):
    # Failover off: with it a silent server is taken over (test_failover.py).
    c = cluster_factory(2, 2, GRADHUB_PEER_TIMEOUT=2, GRADHUB_FAILOVER="0")
    cfg = {"go_file": str(tmp_path / "never")}
    c.start_worker(0, "hold.py", cfg)
    c.start_worker(1, "hold.py", cfg)
    c.wait_for("worker0", "WAITING")
    os.kill(c.procs["server0"].pid, signal.SIGSTOP)  # alive, connections open, but silent
    try:
        stopped = time.monotonic()
        line = wait_line(c, "worker0", "RAISED", timeout=30)
        assert time.monotonic() - stopped < 15
        assert "server 0" in line and "heartbeat" in line, line
    finally:
        os.kill(c.procs["server0"].pid, signal.SIGCONT)


@pytest.mark.parametrize("declared,host_reduce", [(True, "1"), (True, "0"), (False, "1")])
def test_stall_report_names_missing_rank(cluster_factory, tmp_path, declared, host_reduce):
    # Declared ahead: the round waits for a push (the server reports it) or,
    # with the three workers summing on their host first, for a contribution
    # (the waiting workers report it). Not declared: the scheduler sees a
    # tensor that one worker never asked for.
    go = tmp_path / "go"
    c = cluster_factory(3, 1, GRADHUB_STALL_SECONDS=1, GRADHUB_HOST_REDUCE=host_reduce)
    cfg = {"go_file": str(go), "timeout": 3, "hold_rank": 2, "size": 1000, "declare": declared}
    for r in range(3):
        c.start_worker(r, "hold.py", cfg)
    line = wait_line(c, "worker0", "TIMEOUT", timeout=30)
    assert "rank(s) [2]" in line and "'x'" in line and "still running" in line, line
    who = "scheduler" if not declared else "server0" if host_reduce == "0" else "worker0"
    c.wait_for(who, "stall: tensor 'x'")
    assert "worker rank(s) [2]" in c.log(who)
    if who == "worker0":
        assert "of this host" in line, line
    go.write_text("go")
    for r in range(3):
        c.wait_for(f"worker{r}", "PASS")
    if declared:
        c.wait_for(who, "stall resolved")


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), bit by bit: for a 36-byte header."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def header(mtype, key=0, chunk=0, rnd=0, dtype=0, plen=0, flags=0, magic=0x4847, ver=PROTOCOL_VERSION):
    """A data-plane frame header (protocol/frame.rs), magic and version as
    given and its checksums right for them (a stranger's, or another
    version's: not one of ours changed on the way)."""
    frame = encode_frame(mtype, key=key, chunk=chunk, round=rnd, dtype=dtype, flags=flags, payload_len=plen)
    checked = struct.pack("<HB", magic, ver) + frame[3:36]
    assert magic != 0x4847 or ver != PROTOCOL_VERSION or checked + frame[36:40] == frame[:40]
    return checked + struct.pack("<I", crc32c(checked)) + frame[40:]


def held_job(cluster_factory, go, extra_rounds):
    """2 workers and a server on a known port, running: worker 0 waits in a
    round for worker 1, which waits for the file `go`. Returns (cluster, port)."""
    port = free_port()
    c = cluster_factory(2, 1, server_ports=[port])
    cfg = {"go_file": str(go), "size": 100_000, "extra_rounds": extra_rounds}
    c.start_worker(0, "hold.py", cfg)
    c.start_worker(1, "hold.py", cfg)
    c.wait_for("worker0", "WAITING")
    c.wait_for("worker1", "READY")
    return c, port


def test_garbage_to_server_port_is_rejected_and_job_continues(cluster_factory, tmp_path):
    go = tmp_path / "go"
    c, port = held_job(cluster_factory, go, extra_rounds=5)

    def send(data: bytes) -> bytes:
        """Send raw bytes, return whatever the server answers before closing."""
        chunks = []
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            try:
                s.sendall(data)
                s.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # the server may reject and close before reading everything
            try:
                while b := s.recv(65536):
                    chunks.append(b)
            except OSError:
                pass
        return b"".join(chunks)

    rng = np.random.default_rng(0)
    send(rng.integers(0, 256, 5000, dtype=np.uint8).tobytes())                     # random bytes
    reply = send(header(2, magic=0x1234))                                          # bad magic
    assert b"bad magic" in reply
    # Without the job's token nothing gets past the handshake (the checks
    # behind it: tests/integration/server.rs).
    for frame in (header(1, key=0), header(1, key=7), header(2, key=0, dtype=1, plen=4)):  # hellos, a push
        assert b"authentication failed" in send(frame)
    reply = send(header(2, plen=1 << 30))                                          # absurd length
    assert b"exceeds the limit" in reply
    go.write_text("go")
    c.wait_for("worker0", "PASS")
    c.wait_for("worker1", "PASS")
    log = c.log("server0")
    assert "closing connection" in log and "bad magic" in log
    assert c.procs["server0"].wait(timeout=20) == 0, c.log("server0")


def test_usage_errors_and_mismatched_declarations():
    rc, out = run_launch(2, 1, "usage_errors.py")
    assert_all_passed(rc, out, 2)


def test_torch_tensors_and_broadcast():
    rc, out = run_launch(3, 2, "torch_tensors.py", threads=2)
    assert_all_passed(rc, out, 3)


def test_errors_before_init():
    import subprocess

    code = (
        "import numpy as np, gradhub\n"
        "try:\n    gradhub.push_pull(np.zeros(3, np.float32))\nexcept RuntimeError as e:\n    print('E1', e)\n"
        "try:\n    gradhub.init()\nexcept RuntimeError as e:\n    print('E2', e)\n"
    )
    from conftest import job_env

    out = subprocess.run([sys.executable, "-c", code], env=job_env(), capture_output=True, text=True, timeout=60)
    assert "E1 gradhub is not initialized: call gradhub.init() first" in out.stdout, out
    assert "E2 gradhub.init(): no scheduler address" in out.stdout, out


def test_a_member_out_of_file_descriptors_accepts_what_waited_once_some_free_up(cluster_factory, tmp_path):
    # A scheduler or server at its descriptor limit cannot accept: the
    # connection waits in the listen queue. Nothing may be stranded there
    # (the server's listener is edge-triggered: no new edge comes for it),
    # and the retries must not flood the log or spin.
    go = tmp_path / "go"
    c, port = held_job(cluster_factory, go, extra_rounds=3)

    for name, addr_port in (("scheduler", c.port), ("server0", port)):
        pid = c.procs[name].pid
        old = resource.prlimit(pid, resource.RLIMIT_NOFILE)
        used = {int(fd) for fd in os.listdir(f"/proc/{pid}/fd")}
        lowest_free = min(set(range(len(used) + 1)) - used)
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (lowest_free, old[1]))  # no descriptor left
        with socket.create_connection(("127.0.0.1", addr_port), timeout=15) as s:
            s.sendall(header(2, magic=0x1234))
            c.wait_for(name, "accept failed", timeout=10)
            first = time.monotonic()
            time.sleep(2.5)
            warnings = c.log(name).count("accept failed")
            # At most one a second (a flood would be thousands).
            assert 1 <= warnings <= time.monotonic() - first + 2, c.log(name)[-3000:]
            resource.prlimit(pid, resource.RLIMIT_NOFILE, old)
            try:
                reply = s.recv(4096)  # the member accepts it now, and refuses it
            except ConnectionResetError:
                reply = b"reset"
            except socket.timeout:
                raise AssertionError(f"{name} never accepted the connection that waited:\n{c.log(name)[-3000:]}")
        if name == "server0":
            assert b"bad magic" in reply, reply
    go.write_text("go")
    c.wait_for("worker0", "PASS")
    c.wait_for("worker1", "PASS")
    assert c.procs["server0"].wait(timeout=20) == 0, c.log("server0")
