"""Supervised child processes: `Proc` (one child, its output pumped under
its label, its exit recorded in the order exits happened) and `supervise`
(wait for the workers; the first process to fail stops the job, or, in an
elastic job, the first that leaves too few workers: `Losses`)."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import threading
import time

from .output import Pump, Terminal

_terminal: Terminal | None = None
_order = itertools.count()
_order_lock = threading.Lock()


def terminal() -> Terminal:
    """This launcher's stdout (one for every child, so their lines never mix)."""
    global _terminal
    if _terminal is None:
        _terminal = Terminal(sys.stdout.buffer)
    return _terminal


class Proc:
    """A child process of the launcher. `rc` and `seq` (the order among the
    exits of every Proc) are set by a thread waiting for it, the moment it
    exits, so the first process that failed is known however the launcher
    polls."""

    def __init__(self, label: str, argv: list[str], env: dict[str, str], stdin: int = subprocess.DEVNULL):
        self.label = label
        self.role = label.replace("@", " ").split()[0]  # scheduler, server or worker: labels start with it
        self._argv, self._env, self._stdin = argv, env, stdin
        self.rc: int | None = None
        self.seq: int | None = None
        self.exited = threading.Event()
        self.p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  stdin=stdin, start_new_session=True)
        assert self.p.stdout is not None
        # The label follows the number the process gives itself (`own_name`),
        # so the launcher's messages about it use the job's numbering too.
        pump = Pump(terminal(), label, self.p.stdout.fileno(), renamed=self._renamed)
        self.pump = threading.Thread(target=pump.run, daemon=True)
        self.pump.start()
        threading.Thread(target=self._wait, daemon=True).start()

    def again(self) -> Proc:
        """The same process started anew (a scheduler that was killed: `supervise`)."""
        return Proc(self.label, self._argv, self._env, self._stdin)

    def _renamed(self, label: str) -> None:
        self.label = label

    def _wait(self) -> None:
        rc = self.p.wait()
        with _order_lock:
            self.seq = next(_order)
            self.rc = rc
        self.exited.set()

    def poll(self) -> int | None:
        return self.rc

    def signal(self, sig: int) -> None:
        """Deliver `sig` to the child's whole process group."""
        try:
            os.killpg(self.p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def exit_code(rc: int) -> int:
    """A child's return code as the launcher's exit status (a signal: 128 + it)."""
    return rc if rc >= 0 else 128 - rc


def describe(rc: int) -> str:
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with code {rc}"


def stop_procs(procs: list[Proc], grace: float = 5.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        if not p.exited.wait(max(0.0, deadline - time.monotonic())):
            p.signal(signal.SIGKILL)
            p.exited.wait()
    for p in procs:
        p.pump.join(timeout=2)


# Seconds to let the rest of a failed job exit before naming its culprit.
SETTLE_S = 3.0

# Times a job's scheduler killed by a signal is started again (its members
# rejoin it within the peer timeout: src/scheduler/rejoin.rs).
SCHEDULER_RESTARTS = 3


def killed(rc: int) -> bool:
    """Whether an exit status is a death by a signal (here, or over ssh: 128 + it)."""
    return rc < 0 or rc > 128


def restart_scheduler(procs: list[Proc], tool: str, left: list[int]) -> None:
    """A job's scheduler killed by a signal (an OOM kill, a preemption) is
    started again on its address, at most `left[0]` more times; one that
    exited by itself (the job failed: 1) is not."""
    for i, p in enumerate(procs):
        if p.role == "scheduler" and p.rc is not None and killed(p.rc) and left[0] > 0:
            left[0] -= 1
            print(f"{tool}: {p.label} {describe(p.rc)}; starting it again on its address (the members rejoin it)",
                  file=sys.stderr, flush=True)
            p.pump.join(timeout=2)
            procs[i] = p.again()


def first_failure(procs: list[Proc]) -> Proc | None:
    """The process whose failure ended the job: the first to exit non-zero.
    A worker that raised reports its error to the scheduler before its
    interpreter has finished exiting, so the servers and the scheduler, told
    the job failed, often exit before it: one of those that exited with 1
    (roles.py: the job failed) is named only when nothing else failed."""
    failed = sorted((p for p in procs if p.seq is not None and p.rc != 0), key=lambda p: p.seq)
    own = [p for p in failed if not (p.role in ("scheduler", "server") and p.rc == 1)]
    return (own or failed or [None])[0]


def _settle(procs: list[Proc], workers: list[Proc]) -> None:
    """After a failure: give the workers a moment to exit too, so the
    culprit is among the exits."""
    deadline = time.monotonic() + SETTLE_S
    for w in workers:
        w.exited.wait(max(0.0, deadline - time.monotonic()))


class Losses:
    """An elastic job's lost workers. A worker that exits non-zero is lost,
    and the job goes on, while no worker has finished yet and at least
    `least` are still running; otherwise its exit is the job's failure, and
    `fatal` names it and why, when it left too few workers."""

    def __init__(self, workers: list[Proc], least: int, replace=None, most: int = 0,
                 retired: set[Proc] | None = None):
        self.workers, self.least = workers, least
        self.lost: list[Proc] = []
        # Workers the launcher stopped on purpose (their host left the job:
        # discovery.py): lost like the others, but never replaced.
        self.retired = retired if retired is not None else set()
        self.fatal: tuple[Proc, str] | None = None
        # `replace(lost)` starts a replacement worker (it joins the running job
        # at its next commit), while fewer than `most` run; at most one per
        # worker the job started with, so a worker that keeps failing is
        # not restarted for ever.
        self.replace, self.most = replace, most
        self.replacements_left = len(workers) if replace is not None else 0

    def update(self, tool: str) -> None:
        """Take in the workers that failed since the last call, in exit order."""
        failed = sorted((w for w in self.workers if w.rc not in (None, 0) and w not in self.lost),
                        key=lambda w: w.seq)
        for w in failed:
            assert w.rc is not None
            running = sum(1 for x in self.workers if x.rc is None)
            ending = any(x.rc == 0 for x in self.workers if x not in self.retired)
            if w in self.retired and (ending or running >= self.least):
                # Stopped on purpose: the survivors may have re-formed and
                # finished before its own exit came back over ssh.
                self.lost.append(w)
                print(f"{tool}: {w.label} stopped (the job went on with {running})", file=sys.stderr, flush=True)
                continue
            if ending:
                return  # the job was ending: a member of its last generation failed
            if running < self.least:
                self.fatal = (w, f"{w.label} {describe(w.rc)}, leaving {running} worker{'s' * (running != 1)}, "
                                 f"fewer than --min-workers {self.least}")
                return
            self.lost.append(w)
            print(f"{tool}: {w.label} {describe(w.rc)} (lost; the job went on with {running})",
                  file=sys.stderr, flush=True)
            if self.replacements_left > 0 and running < self.most:
                new = self.replace(w)  # None: no host has a free slot (a discovery job)
                if new is None:
                    continue
                self.replacements_left -= 1
                self.workers.append(new)
                print(f"{tool}: started {new.label} to replace {w.label}; it joins at the job's next commit",
                      file=sys.stderr, flush=True)

    def summary(self) -> str:
        done = len(self.workers) - len(self.lost)
        return (f"the job finished with {done} of {len(self.workers)} workers; lost: "
                + ", ".join(f"{w.label} ({describe(w.rc)})" for w in self.lost if w.rc is not None))


def stop_unready(procs: list[Proc], why: str, tool: str) -> int:
    """The job could not start (`why`): stop what was started; the exit code."""
    print(f"{tool}: {why}; stopping the job", file=sys.stderr, flush=True)
    stop_procs(procs)
    return 1


@contextlib.contextmanager
def stopped_on_signals(procs: list[Proc]):
    """Within: Ctrl-C or SIGTERM stops every process in `procs` (those started
    by then: the children run in sessions of their own, so nothing else
    would) and exits with 128 + the signal."""

    def on_signal(signum, _frame):
        stop_procs(procs)
        sys.exit(128 + signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def supervise(procs: list[Proc], workers: list[Proc], tool: str, min_workers: int | None = None,
              replace=None, max_workers: int = 0, tick=None, retired: set[Proc] | None = None,
              stop_service=None) -> int:
    """Wait for the workers; stop everything as soon as one process fails (or
    on Ctrl-C/SIGTERM) and return the first failure's exit code, else 0.
    `min_workers`: an elastic job on a shared service the launch started (a
    lost worker does not end it while `min_workers` run: `Losses`; the
    service does not exit by itself and is stopped once the workers are done);
    `replace(lost)`: a new worker's Proc, started for `lost` while fewer
    than `max_workers` run (or None: no room for it). `tick()`: called on
    every turn of the loop (an elastic job following its discovered hosts
    adds workers to `procs` and `workers` there); `retired`: workers it
    stopped on purpose (their exit is a stop, not a loss to replace);
    `stop_service()`: stops the elastic job's service at its normal end."""

    def start_replacement(lost: Proc) -> Proc | None:
        p = replace(lost)
        if p is not None:
            procs.append(p)
        return p

    losses = (Losses(workers, min_workers, start_replacement if replace is not None else None, max_workers,
                     retired) if min_workers is not None else None)
    restarts = [SCHEDULER_RESTARTS if min_workers is None else 0]  # an elastic job's service does not rebuild its generations
    with stopped_on_signals(procs):
        while True:
            if tick is not None:
                tick()
            restart_scheduler(procs, tool, restarts)
            if losses is not None:
                losses.update(tool)
            # (A scheduler killed since `restart_scheduler` looked starts again on the next turn.)
            live = [p for p in procs if (losses is None or p not in losses.lost)
                    and not (p.role == "scheduler" and p.rc is not None and killed(p.rc) and restarts[0] > 0)]
            if first_failure(live) is not None:
                fatal = losses.fatal if losses is not None else None
                if fatal is None:
                    _settle(procs, workers)
                bad = fatal[0] if fatal else first_failure(live)
                assert bad is not None and bad.rc is not None
                why = fatal[1] if fatal else f"{bad.label} {describe(bad.rc)}"
                print(f"{tool}: {why}; stopping the job", file=sys.stderr, flush=True)
                stop_procs(procs)
                return exit_code(bad.rc)
            if all(w.poll() == 0 for w in live if w in workers):
                break
            time.sleep(0.05)
        if losses is not None:
            # A shared service outlives its jobs: the launch stops it (its exit is not the job's).
            if stop_service is not None:
                stop_service()
            stop_procs(procs)
            if losses.lost:
                print(f"{tool}: {losses.summary()}", file=sys.stderr, flush=True)
            return 0
        # Workers are done; the scheduler shuts the servers down.
        deadline = time.monotonic() + 30
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        rest = [p for p in procs if p.poll() is None]
        if rest:
            print(f"{tool}: " + ", ".join(p.label for p in rest) + " did not exit; terminating", file=sys.stderr)
        stop_procs(procs)
        bad = first_failure([p for p in procs if p not in rest])
        if bad is not None and bad.rc is not None:
            print(f"{tool}: {bad.label} {describe(bad.rc)} after the workers finished", file=sys.stderr)
            return exit_code(bad.rc)
        return 0
