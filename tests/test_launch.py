"""`gradhub launch` as a user meets it: the first process that failed is the
one named, progress bars (carriage returns) move under their label, core log
lines keep their own lines; host specs of a multi-host launch."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
import time

import pytest

from conftest import alarming, assert_all_passed, job_env, run_launch
from gradhub.launch.hosts import Host, parse_hostfile, parse_hosts, parse_server_hosts, worker_slots
from gradhub.launch.output import Pump, Terminal

LAUNCH = [sys.executable, "-m", "gradhub", "launch"]


def test_the_first_process_that_failed_is_named(tmp_path):
    # Worker 1 raises; the scheduler then fails the job, and every server and
    # the other workers exit non-zero after it. Twice, since the old launcher
    # named whichever it polled first.
    script = tmp_path / "raise.py"
    # Every worker past init() first: under load, one still in init() when the
    # job fails exits with its own error, and may do so before worker 1 has.
    script.write_text("import gradhub, time\ngradhub.init()\ngradhub.barrier()\n"
                      "if gradhub.rank() == 1:\n    raise ValueError('boom')\ntime.sleep(60)\n")
    for _ in range(2):
        out = subprocess.run(LAUNCH + ["-w", "3", "-s", "2", "--", sys.executable, str(script)],
                             capture_output=True, text=True, timeout=120, env=job_env())
        assert out.returncode == 1, out
        assert "gradhub launch: worker 1 exited with code 1; stopping the job" in out.stderr, out.stderr
        assert "ValueError: boom" in out.stdout


def test_a_normal_end_is_quiet_and_every_label_is_the_process_own_name():
    # A straggler finishing last while the servers close the job: no role
    # prints a warning or a failure, and each line's label is the number
    # the process gives itself (assert_all_passed checks the labels).
    cfg = {"sizes": [1000, 262_147], "dtypes": ["float32"], "rounds": 8, "sleep": {"3": 0.03}}
    rc, out = run_launch(4, 2, "check_sums.py", cfg)
    assert_all_passed(rc, out, 4)
    assert not alarming(out), out[-6000:]


def test_a_label_follows_the_number_the_process_gives_itself():
    out = io.BytesIO()
    term = Terminal(out)
    names: list[str] = []
    pump = Pump(term, "worker 2@hostb", -1, renamed=names.append)
    pump.feed(b"hello\n[gradhub worker 1] this worker is rank 1 of 2\n[gradhub server 0] not mine\nbye\n")
    assert out.getvalue() == (b"[worker 2@hostb] hello\n[worker 1@hostb] [gradhub worker 1] this worker is rank 1 of 2\n"
                              b"[worker 1@hostb] [gradhub server 0] not mine\n[worker 1@hostb] bye\n")
    assert names == ["worker 1@hostb"]


def _pump(chunks: list[bytes]) -> bytes:
    out = io.BytesIO()
    term = Terminal(out)
    pump = Pump(term, "worker 0", -1)
    for c in chunks:
        pump.feed(c)
    term.end(pump)
    return out.getvalue()


def test_lines_are_written_whole_and_prefixed():
    assert _pump([b"hel", b"lo\nwor", b"ld\r\n"]) == b"[worker 0] hello\n[worker 0] world\n"


def test_carriage_returns_redraw_under_the_label():
    # tqdm: "\r" + the bar on every update, "\n" when it closes; an update is
    # drawn when it arrives, not when the next one ends it.
    got = _pump([b"\r 10%|#", b"\r 20%|##", b"\r100%|###", b"\n", b"done\n"])
    assert got == (b"\r[worker 0]  10%|#\r[worker 0]  20%|##\r[worker 0] 100%|###\n"
                   b"[worker 0] done\n")


def test_a_log_line_between_redraws_gets_its_own_line():
    got = _pump([b"\r 10%|#", b"[gradhub worker] a core line\n", b"\r 20%|##\n"])
    assert got == (b"\r[worker 0]  10%|#\n[worker 0] [gradhub worker] a core line\n"
                   b"\r[worker 0]  20%|##\n")


def test_another_process_line_does_not_splice_into_a_bar():
    out = io.BytesIO()
    term = Terminal(out)
    a, b = Pump(term, "worker 0", -1), Pump(term, "worker 1", -1)
    a.feed(b"\r 10%|#")
    b.feed(b"ready\n")
    a.feed(b"\r 20%|##")
    term.end(a)
    assert out.getvalue() == b"\r[worker 0]  10%|#\n[worker 1] ready\n\r[worker 0]  20%|##\n"


def test_progress_reaches_the_terminal_while_the_worker_runs(tmp_path):
    # The worker draws a bar, then waits until the test has seen it through
    # the launcher: a launcher that forwards whole lines only never shows it,
    # and the worker gives up.
    go = tmp_path / "go"
    script = tmp_path / "bar.py"
    script.write_text(f"""import os, sys, time
import gradhub
gradhub.init()  # a job member, so the job ends when it does
sys.stderr.write("\\r 10%|#"); sys.stderr.flush()
for _ in range(600):
    if os.path.exists({str(go)!r}):
        break
    time.sleep(0.1)
else:
    sys.exit(3)
sys.stderr.write("[gradhub worker] a core line\\n\\r100%|##########\\n"); sys.stderr.flush()
print("done")
gradhub.shutdown()
""")
    p = subprocess.Popen(LAUNCH + ["-w", "1", "--", sys.executable, str(script)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=job_env())
    assert p.stdout is not None
    seen = bytearray()
    fd = p.stdout.fileno()

    def read() -> None:
        for chunk in iter(lambda: os.read(fd, 4096), b""):
            seen.extend(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60  # a hang guard, not a timing target
        while b"\r[worker 0]  10%|#" not in seen and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert b"\r[worker 0]  10%|#" in seen, bytes(seen)
        go.touch()
        assert p.wait(timeout=60) == 0, p.stderr.read() if p.stderr else ""
    finally:
        if p.poll() is None:
            p.kill()
    reader.join(timeout=10)
    # The worker's own lines, in order (another process's line may come
    # between two of them: the launcher ends the open bar line first).
    out = b"".join(line + b"\n" for line in bytes(seen).split(b"\n") if line.lstrip(b"\r").startswith(b"[worker 0]"))
    assert b"\r[worker 0]  10%|#\n[worker 0] [gradhub worker] a core line\n" in out, bytes(seen)
    assert b"\r[worker 0] 100%|##########\n[worker 0] done\n" in out, bytes(seen)


def test_gradhub_error_is_public():
    import gradhub
    from gradhub import _core

    assert gradhub.GradhubError is _core.GradhubError
    assert f"{gradhub.GradhubError.__module__}.{gradhub.GradhubError.__qualname__}" == "gradhub.GradhubError"
    assert issubclass(gradhub.GradhubTimeoutError, TimeoutError)


# ---------------------------------------------------------------- host specs


def test_host_specs():
    assert parse_hosts("a:4,b:2") == [Host("a", 4), Host("b", 2)]
    assert parse_hosts("me@10.0.0.1:2,[fe80::1]:3,c") == [Host("me@10.0.0.1", 2), Host("[fe80::1]", 3), Host("c", 1)]
    assert parse_server_hosts("s1, s2") == ["s1", "s2"]
    slots = worker_slots(parse_hosts("a:2,b:2"), 3)
    assert [(r, h.name, lr) for r, h, lr in slots] == [(0, "a", 0), (1, "a", 1), (2, "b", 0)]


@pytest.mark.parametrize("spec,words", [
    ("", "expected host:slots"),
    ("a:4,,b:4", "expected host:slots"),
    ("a:four", "slots 'four' is not a whole number"),
    ("a:0", "at least one slot"),
    ("a b:2", "is not a host name"),
    ("a:2,a:2", "listed twice"),
])
def test_bad_host_specs_say_what_is_wrong(spec, words):
    with pytest.raises(ValueError, match=words):
        parse_hosts(spec)


def test_hostfile(tmp_path):
    f = tmp_path / "hosts"
    f.write_text("# workers\nnode1 slots=4\nnode2:2  # two GPUs\n\n")
    assert parse_hostfile(str(f)) == [Host("node1", 4), Host("node2", 2)]
    f.write_text("node1 slots=x\n")
    with pytest.raises(ValueError, match=r"line 1: slots 'x'"):
        parse_hostfile(str(f))
    with pytest.raises(ValueError, match="cannot read it"):
        parse_hostfile(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="ask for 1 to 6 workers"):
        worker_slots([Host("node1", 4), Host("node2", 2)], 7)


def test_bad_hosts_are_errors_before_anything_starts(tmp_path):
    out = subprocess.run(LAUNCH + ["-H", "a:x", "--", "true"], capture_output=True, text=True, timeout=60,
                         env=job_env())
    assert out.returncode == 2 and "slots 'x' is not a whole number" in out.stderr, out
    # A host ssh cannot reach (no such name): said, and nothing started.
    out = subprocess.run(LAUNCH + ["-H", "no-such-host.invalid:2", "--", "true"], capture_output=True, text=True,
                         timeout=120, env=job_env())
    assert out.returncode == 2, out
    assert "no-such-host.invalid" in out.stderr and "nothing was started" in out.stderr, out.stderr


def test_launch_help_documents_the_host_flags():
    out = subprocess.run(LAUNCH + ["--help"], capture_output=True, text=True, timeout=60, env=job_env())
    assert out.returncode == 0
    for flag in ("-H HOST:SLOTS", "--hostfile FILE", "--server-hosts HOST", "--ssh-port", "--ssh-identity-file FILE",
                 "--ssh-config FILE", "node1:4,node2:4", "--scheduler-host {local,first}",
                 "--host-discovery-script S", "--slots-per-host N", "--discovery-interval SECONDS"):
        assert flag in out.stdout, flag
