"""A process whose gradhub threads are still completing an operation when
its main thread ends exits cleanly. torch releases the GIL while it
completes a future and takes it back in a C++ destructor; a daemon thread
that does so once the interpreter finalizes dies there, in
`std::terminate` ("terminate called without an active exception", exit
status 134), a clean run's status lost. Each case ends the main thread
while one of gradhub's threads is inside torch's future completion (a done
callback that sleeps, releasing the GIL) and checks the exit."""

import subprocess
import sys
import textwrap

import pytest

SLOW = "lambda f: time.sleep(0.5)"

CASES = {
    # The backend's operation completed on a thread of its own (a send's,
    # the watchdog's, a completion callback's).
    "an operation finished on a thread": f"""
        from gradhub.torch.dist.work import _Op
        op = _Op("x", [])
        op.future.add_done_callback({SLOW})
        threading.Thread(target=op.finish, daemon=True).start()
    """,
    # A collective of several rounds, run on the group's helper thread.
    "the helper thread's job": f"""
        from gradhub.torch.dist.work import _Helper, _Op
        op = _Op("x", [])
        op.future.add_done_callback({SLOW})
        _Helper().submit(op.finish)
    """,
    # The Horovod-style API's operation of several rounds, on a thread of its own.
    "an operation of several rounds": f"""
        from torch.futures import Future
        from gradhub.torch.exchange import _ThreadHandle
        f = Future()
        f.add_done_callback({SLOW})
        _ThreadHandle(lambda: f.set_result(1), "gradhub.test.exit")
    """,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_exit_while_a_gradhub_thread_completes_an_operation(case):
    script = "import threading, time\nimport torch\n" + textwrap.dedent(CASES[case]) + \
        "time.sleep(0.1)\nprint('main ends', flush=True)\n"
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "main ends" in p.stdout, p.stderr
    assert p.returncode == 0 and "terminate called" not in p.stderr, (p.returncode, p.stderr)
