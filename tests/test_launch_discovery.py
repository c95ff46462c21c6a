"""`gradhub launch --host-discovery-script`'s logic without sockets or
hosts (launch/discovery.py): the script's output parsed, two host sets
diffed, a run bounded in time, and the follower's decisions on fake
workers; plus the flag's refusals. The job over emulated hosts is in
test_launch_elastic_ssh.py."""

import signal
import subprocess
import sys
import time

import pytest

from gradhub.launch import discovery
from gradhub.launch.proc import Losses


def test_the_scripts_output_is_parsed_with_default_slots_and_errors_name_the_line():
    out = "# hosts now\nnode1:4\n\nnode2\nnode3 slots=2\n[fe80::1]:3\n[fe80::2]\nslots9  # a host named slots9\n"
    assert discovery.parse_hosts_output(out, 2) == {"node1": 4, "node2": 2, "node3": 2, "[fe80::1]": 3,
                                                    "[fe80::2]": 2, "slots9": 2}
    assert discovery.parse_hosts_output("", 1) == {}
    with pytest.raises(ValueError, match="line 2: slots 'x'"):
        discovery.parse_hosts_output("a:1\nb:x\n", 1)
    with pytest.raises(ValueError, match="line 1: a host needs at least one slot"):
        discovery.parse_hosts_output("a:0\n", 1)
    with pytest.raises(ValueError, match="host a is listed twice"):
        discovery.parse_hosts_output("a:1\na:2\n", 1)
    with pytest.raises(ValueError, match="is not a host name"):
        discovery.parse_hosts_output("a b c\n", 1)


def test_the_diff_of_two_host_sets():
    assert not discovery.diff({"a": 2}, {"a": 2})
    c = discovery.diff({"a": 2, "b": 1, "c": 3}, {"a": 3, "c": 1, "d": 2})
    assert c.grown == {"a": 1, "d": 2} and c.shrunk == {"c": 2} and c.removed == ["b"]
    c = discovery.diff({}, {"a": 1})
    assert c and c.grown == {"a": 1} and not c.shrunk and not c.removed


def test_a_run_is_bounded_and_its_failures_say_why(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("a:2\nb\n")
    assert discovery.run_script(f"cat {hosts}", 3) == {"a": 2, "b": 3}
    with pytest.raises(ValueError, match="exited with code 3: broken"):
        discovery.run_script("echo broken >&2; exit 3", 1)
    with pytest.raises(ValueError, match="listed no host"):
        discovery.run_script("true", 1)
    # A hanging script and the child it started are killed at the bound.
    pidfile = tmp_path / "pid"
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="did not finish within 0.5 s; killed it"):
        discovery.run_script(f"sleep 60 & echo $! > {pidfile}; wait", 1, timeout=0.5)
    assert time.monotonic() - t0 < 30  # a hang guard
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)
    assert not _alive(pid)


def test_the_poller_keeps_the_last_good_hosts_while_the_script_fails(tmp_path, capsys):
    hosts = tmp_path / "hosts"
    hosts.write_text("a:2\n")
    poller = discovery.Poller(f"cat {hosts}", 1, 0.05, {"a": 2}, "t").start()

    def until(version: int) -> tuple[int, dict]:
        deadline = time.monotonic() + 30  # a hang guard
        while poller.get()[0] < version and time.monotonic() < deadline:
            time.sleep(0.02)
        return poller.get()

    try:
        hosts.write_text("a:2\nb\n")
        assert until(1) == (1, {"a": 2, "b": 1})
        hosts.unlink()  # failing now: reported once, the last set kept
        deadline = time.monotonic() + 30
        while "keeping the last hosts found" not in (said := capsys.readouterr().err) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert f"cat: {hosts}: No such file or directory; keeping the last hosts found" in said, said
        time.sleep(0.3)
        assert poller.get() == (1, {"a": 2, "b": 1}) and "keeping" not in capsys.readouterr().err
        hosts.write_text("b:3\n")
        assert until(2) == (2, {"b": 3})
        assert "the host discovery script works again" in capsys.readouterr().err
    finally:
        poller.stop()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


class FakeWorker:
    """A worker as Follower and Losses see it: a label, an exit code, signals received."""
    seq = 0

    def __init__(self, label: str):
        self.label, self.rc, self.seq, self.signals = label, None, None, []

    def poll(self):
        return self.rc

    def signal(self, sig):
        self.signals.append(sig)

    def exit(self, rc):
        FakeWorker.seq += 1
        self.rc, self.seq = rc, FakeWorker.seq


class FakePoller:
    def __init__(self, hosts):
        self.version, self.hosts = 0, hosts

    def get(self):
        return self.version, self.hosts

    def set(self, hosts):
        self.version, self.hosts = self.version + 1, hosts


def test_the_follower_grows_to_the_most_and_stops_the_workers_of_a_host_gone(capsys):
    workers = [FakeWorker("worker 0@a"), FakeWorker("worker 1@a")]
    poller = FakePoller({"a": 2})
    started = []

    def start(host):
        w = FakeWorker(f"worker {2 + len(started)}@{host}")
        started.append(w)
        return w

    retired = set()
    f = discovery.Follower(poller, workers, 4, start, retired.add, "t")
    f.tick()
    assert started == []  # nothing changed
    poller.set({"a": 2, "b": 3})  # 3 more slots, room for 2 under the most (4)
    f.tick()
    assert [w.label for w in started] == ["worker 2@b", "worker 3@b"] and workers[2:] == started
    assert f.free_host() == "b"
    poller.set({"a": 1})  # b gone, a shrunk: the newest worker of a and both of b stop
    f.tick()
    stopped = [w for w in workers if w.signals]
    assert {w.label for w in stopped} == {"worker 1@a", "worker 2@b", "worker 3@b"} == {w.label for w in retired}
    assert all(w.signals == [signal.SIGTERM] for w in stopped)
    # Past the grace, one still running gets SIGKILL.
    for w in stopped[:2]:
        w.exit(143)
    f.stopping = {w: 0.0 for w in f.stopping}
    f.tick()
    assert stopped[2].signals == [signal.SIGTERM, signal.SIGKILL] and stopped[0].signals == [signal.SIGTERM]
    assert f.free_host() is None and f.free_host(prefer="b") is None
    assert "stopping worker 2@b: b left the discovered hosts" in capsys.readouterr().err


def test_a_stopped_worker_is_lost_without_a_replacement_and_too_few_still_fail(capsys):
    workers = [FakeWorker(f"worker {i}@a") for i in range(3)]
    asked = []
    losses = Losses(workers, 2, lambda w: asked.append(w), 3, retired={workers[2]})
    workers[2].exit(143)
    losses.update("t")
    assert losses.lost == [workers[2]] and asked == [] and losses.fatal is None
    assert "worker 2@a stopped (the job went on with 2)" in capsys.readouterr().err
    workers[1].exit(9)
    losses.update("t")  # a real loss leaving 1 of --min-workers 2
    assert losses.fatal is not None and "fewer than --min-workers 2" in losses.fatal[1]


def test_a_stopped_worker_whose_exit_comes_after_the_others_finished_is_no_failure():
    # The survivors re-formed without it and finished before its exit came back over ssh.
    workers = [FakeWorker(f"worker {i}@a") for i in range(3)]
    losses = Losses(workers, 2, None, 0, retired={workers[2]})
    workers[0].exit(0)
    workers[2].exit(143)
    losses.update("t")
    assert losses.lost == [workers[2]] and losses.fatal is None
    # Not so for a worker that failed on its own then: the job's last generation lost a member.
    workers[1].exit(1)
    losses.update("t")
    assert losses.lost == [workers[2]]


def test_a_replacement_with_no_free_slot_is_not_started():
    workers = [FakeWorker(f"worker {i}@a") for i in range(2)]
    losses = Losses(workers, 1, lambda w: None, 2)
    workers[0].exit(9)
    losses.update("t")
    assert losses.lost == [workers[0]] and len(workers) == 2 and losses.replacements_left == 2


@pytest.mark.parametrize("argv, said", [
    (["--host-discovery-script", "true", "--", "true"], "needs --min-workers"),
    (["--host-discovery-script", "true", "-H", "a:1", "--min-workers", "1", "--", "true"], "leave out -H"),
    (["--scheduler-host", "first", "-w", "2", "--", "true"], "--scheduler-host first needs hosts"),
    (["--host-discovery-script", "exit 4", "--min-workers", "1", "--", "true"], "exited with code 4"),
])
def test_the_new_flags_are_refused_where_they_do_not_apply(argv, said):
    p = subprocess.run([sys.executable, "-m", "gradhub", "launch", *argv], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and said in p.stderr, p.stderr
