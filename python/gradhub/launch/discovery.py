"""`gradhub launch --host-discovery-script S`: an elastic job's hosts as a
script reports them, the way horovodrun's elastic mode takes them.

The script prints the hosts available now, one `host:slots` (or `host`,
which gets --slots-per-host) a line. Parsing its output and the difference
between two host sets are pure functions (`parse_hosts_output`, `diff`);
`run_script` runs it once, bounded in time; `Poller` runs it every interval
on a thread of its own and keeps the last good set; `Follower` applies each
new set to the running job from the supervising loop (proc.py's `supervise`
calls its `tick`), as `moves` re-plans it (a pure function of the hosts
before and now and the workers running on each): workers started on added
hosts or slots up to --max-workers (each the launch plan's `joiner`:
run.py), the workers of removed hosts or slots stopped (SIGTERM, then
SIGKILL), which the job takes as lost workers.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from .hosts import Host, _entry, _host, _unique
from .proc import Proc

# Seconds a run of the script may take before it is killed and reported: a
# hanging script must not freeze what the job knows of its hosts.
SCRIPT_TIMEOUT_S = 5.0
# Seconds a stopped worker has between SIGTERM and SIGKILL.
STOP_GRACE_S = 5.0


def parse_hosts_output(text: str, default_slots: int, where: str = "the host discovery script") -> dict[str, int]:
    """The hosts (in the script's order) and their slots from the script's
    output; `#` comments and blank lines skipped. A ValueError says what is
    wrong and on which line."""
    hosts = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        at = f"{where}, line {n}"
        bare = line.rpartition("]")[2] if line.startswith("[") else line
        # A line without slots gets --slots-per-host (hosts.py's parser would give it one).
        given = ":" in bare or re.search(r"\sslots\s*=", bare)
        hosts.append(_entry(line, at) if given else Host(_host(line, at), default_slots))
    return {h.name: h.slots for h in _unique(hosts, where)}


@dataclass
class Change:
    """What changed between two host sets: slots added on each host (new
    hosts among them) and slots taken away (hosts gone: all of theirs)."""
    grown: dict[str, int] = field(default_factory=dict)
    shrunk: dict[str, int] = field(default_factory=dict)
    removed: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.grown or self.shrunk or self.removed)


def diff(old: dict[str, int], new: dict[str, int]) -> Change:
    """The change from host set `old` to `new` (host -> slots each)."""
    c = Change()
    for h, n in new.items():
        if n > old.get(h, 0):
            c.grown[h] = n - old.get(h, 0)
    for h, n in old.items():
        if h not in new:
            c.removed.append(h)
        elif new[h] < n:
            c.shrunk[h] = n - new[h]
    return c


@dataclass
class Moves:
    """What an elastic job does when its hosts change: how many of each
    host's running workers stop (the newest), and the hosts that each get a
    new worker, in order (a host twice: two)."""
    stop: dict[str, int] = field(default_factory=dict)
    start: list[str] = field(default_factory=list)


def moves(old: dict[str, int], new: dict[str, int], running: dict[str, int], most: int) -> Moves:
    """The job re-planned from host set `old` to `new` (host -> slots), with
    `running[host]` workers running on each: a host gone stops all of its,
    a host with fewer slots its extra ones; a host with more slots (or a new
    one) gets a worker on each free slot while the job has fewer than `most`."""
    change, m = diff(old, new), Moves()
    for h in change.removed:
        if running.get(h, 0) > 0:
            m.stop[h] = running[h]
    for h in change.shrunk:
        if running.get(h, 0) > new[h]:
            m.stop[h] = running[h] - new[h]
    left = {h: n - m.stop.get(h, 0) for h, n in running.items()}
    total = sum(left.values())
    for h in change.grown:
        while total < most and left.get(h, 0) < new[h]:
            m.start.append(h)
            left[h] = left.get(h, 0) + 1
            total += 1
    return m


def run_script(script: str, default_slots: int, timeout: float = SCRIPT_TIMEOUT_S) -> dict[str, int]:
    """Run the discovery script once; its hosts, or a ValueError that says
    why not (it failed, hung past `timeout` and was killed, printed nonsense
    or no host)."""
    try:
        # Through the shell, as horovodrun runs it: a path, or a command with arguments.
        p = subprocess.Popen(["/bin/sh", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError as e:
        raise ValueError(f"cannot run the host discovery script {script}: {e.strerror}") from None
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # Its whole session: a script that started children must not leave them behind.
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            pass
        p.communicate()
        raise ValueError(f"the host discovery script {script} did not finish within {timeout:g} s; killed it") from None
    if p.returncode != 0:
        said = err.decode(errors="replace").strip().splitlines()
        raise ValueError(f"the host discovery script {script} exited with code {p.returncode}"
                         + (f": {said[-1]}" if said else ""))
    hosts = parse_hosts_output(out.decode(errors="replace"), default_slots, f"the host discovery script {script}")
    if not hosts:
        raise ValueError(f"the host discovery script {script} listed no host")
    return hosts


class Poller:
    """Runs the script every `interval` seconds on a thread of its own; the
    last good host set is `latest` (with a version that counts changes). A
    failing or hanging run is reported (once until it works again) and the
    last good set kept."""

    def __init__(self, script: str, default_slots: int, interval: float, first: dict[str, int], tool: str):
        self.script, self.default_slots, self.interval, self.tool = script, default_slots, interval, tool
        self.latest, self.version = first, 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Poller":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=SCRIPT_TIMEOUT_S + 1)

    def get(self) -> tuple[int, dict[str, int]]:
        with self._lock:
            return self.version, self.latest

    def _run(self) -> None:
        failing: str | None = None
        while not self._stop.wait(self.interval):
            try:
                hosts = run_script(self.script, self.default_slots)
            except ValueError as e:
                if str(e) != failing:
                    print(f"{self.tool}: {e}; keeping the last hosts found", file=sys.stderr, flush=True)
                failing = str(e)
                continue
            if failing is not None:
                print(f"{self.tool}: the host discovery script works again", file=sys.stderr, flush=True)
                failing = None
            with self._lock:
                if hosts != self.latest:
                    self.latest, self.version = hosts, self.version + 1


class Follower:
    """Applies the poller's host sets to the running job, from the
    supervising loop (which owns the process lists). `start(host)` starts a
    worker there (it joins at the job's next commit); `retire(worker)` tells
    the supervision that its exit is a stop, not a failure."""

    def __init__(self, poller: Poller, workers: list[Proc], most: int, start: Callable[[str], Proc],
                 retire: Callable[[Proc], None], tool: str):
        self.poller, self.workers, self.most, self.start, self.retire = poller, workers, most, start, retire
        self.tool = tool
        self.version, self.hosts = poller.get()
        self.stopping: dict[Proc, float] = {}  # a stopped worker -> when it gets SIGKILL

    def host_of(self, w: Proc) -> str:
        return w.label.split("@", 1)[1]

    def running(self, host: str | None = None) -> list[Proc]:
        """The live workers (on `host`), oldest first, not those being stopped."""
        return [w for w in self.workers if w.poll() is None and w not in self.stopping
                and (host is None or self.host_of(w) == host)]

    def free_host(self, prefer: str | None = None) -> str | None:
        """A listed host with a free slot (`prefer` first), or None."""
        for h in ([prefer] if prefer in self.hosts else []) + list(self.hosts):
            if len(self.running(h)) < self.hosts[h]:
                return h
        return None

    def tick(self) -> None:
        now = time.monotonic()
        self.stopping = {w: t for w, t in self.stopping.items() if w.poll() is None}
        for w, kill_at in self.stopping.items():
            if now >= kill_at:
                w.signal(signal.SIGKILL)
        version, hosts = self.poller.get()
        if version == self.version:
            return
        running: dict[str, int] = {}
        for w in self.running():
            running[self.host_of(w)] = running.get(self.host_of(w), 0) + 1
        m = moves(self.hosts, hosts, running, self.most)
        self.version, self.hosts = version, hosts
        for h, n in m.stop.items():
            self._stop(self.running(h)[-n:], f"{h} has {hosts[h]} slots now" if h in hosts
                       else f"{h} left the discovered hosts")
        for h in m.start:
            w = self.start(h)
            self.workers.append(w)
            print(f"{self.tool}: {h} was discovered with a free slot: started {w.label}; it joins at the "
                  "job's next commit", file=sys.stderr, flush=True)

    def _stop(self, workers: list[Proc], why: str) -> None:
        for w in workers:
            self.retire(w)
            self.stopping[w] = time.monotonic() + STOP_GRACE_S
            print(f"{self.tool}: stopping {w.label}: {why}", file=sys.stderr, flush=True)
            w.signal(signal.SIGTERM)
