"""Horovod's timeline: every push_pull this worker runs, as a Chrome trace
(open the file in chrome://tracing or https://ui.perfetto.dev).

One row per tensor name; each operation is a complete event from the call to
its result (or failure), with its size, dtype and priority. Beside it, the
Rust core records every chunk the worker pushes in `chunk_path(path)`
(`.chunks.json`), one row per tensor: QUEUED (behind higher priorities and
the credit), SEND (until its server has it all) and RESULT (the other
workers' pushes, the sum and the result in flight); servers record their
side with `gradhub server --timeline` (WAIT_FOR_PUSHERS naming the last
worker, FINISH_ROUND). Every gradhub
and gradhub.torch operation goes through `api.push_pull_async`, so the
timeline sees all of them (an allgather as its size exchange and its data).
As in Horovod, only worker 0 writes it, unless the path contains `{rank}`:
then every worker writes its own file (`/tmp/tl.{rank}.json`), and
`gradhub timeline merge OUT FILES...` puts them in one trace on one clock
(each file records the wall-clock time of its start; across hosts the
merge is as good as their clocks' agreement). `mark_cycles` is accepted and
ignored (gradhub has no negotiation cycles).
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Callable

_lock = threading.Lock()
_active: "Timeline | None" = None
_chunks = None  # the client recording the chunks' side (`chunk_path`)


def chunk_path(path: str) -> str:
    """Where the chunks of the timeline at `path` are recorded."""
    return (path[:-5] if path.endswith(".json") else path) + ".chunks.json"


def _clock_pair() -> tuple[float, float]:
    """(perf_counter(), the wall clock in µs) read at one instant, as far as
    can be told: the tightest of a few brackets (a thread preempted between
    the two reads would shift every event of the file on `merge`'s clock)."""
    best = None
    for _ in range(5):
        a = time.perf_counter()
        wall = time.time()
        b = time.perf_counter()
        if best is None or b - a < best[0]:
            best = (b - a, (a + b) / 2, wall * 1e6)
    return best[1], best[2]


class Timeline:
    def __init__(self, path: str, pid: int):
        self._f = open(path, "w", encoding="utf-8")
        self._f.write("[\n")
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._open = 0  # operations started and not recorded yet
        self._tids: dict[str, int] = {}
        self._t0, unix_us = _clock_pair()
        self._pid = pid
        self._write({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"gradhub worker {pid}"}})
        # Where this file's clock starts, for `merge`.
        self._write({"name": "clock", "ph": "M", "pid": pid, "args": {"unix_us": unix_us}})

    def _write(self, event: dict) -> None:
        # One event per line; Chrome's viewer accepts the array unterminated,
        # so a worker that dies still leaves a readable file.
        self._f.write(json.dumps(event) + ",\n")

    def _now_us(self) -> float:
        return (time.perf_counter() - self._t0) * 1e6

    def start(self, name: str, nbytes: int, dtype: str, priority: int) -> Callable[[str | None], None]:
        """Record an operation's start; call the result with None or the error when it ends."""
        ts = self._now_us()
        with self._lock:
            self._open += 1
            tid = self._tids.get(name)
            if tid is None:
                tid = self._tids[name] = len(self._tids) + 1
                if self._f is not None:
                    self._write({"name": "thread_name", "ph": "M", "pid": self._pid, "tid": tid,
                                 "args": {"name": name}})

        def end(error: str | None) -> None:
            event = {"name": "PUSH_PULL", "cat": "push_pull", "ph": "X", "ts": round(ts, 1),
                     "dur": round(self._now_us() - ts, 1), "pid": self._pid, "tid": tid,
                     "args": {"tensor": name, "bytes": nbytes, "dtype": dtype, "priority": priority}}
            if error is not None:
                event["args"]["error"] = error
            with self._lock:
                self._open -= 1
                if self._f is not None:
                    self._write(event)
                    self._f.flush()
                self._idle.notify_all()

        return end

    def close(self, wait: float = 2.0) -> None:
        """Stop: operations that end within `wait` seconds are still
        recorded (their completions are reported from another thread)."""
        with self._lock:
            self._idle.wait_for(lambda: self._open == 0, timeout=wait)
            if self._f is not None:
                self._f.close()
                self._f = None


def start(path: str, rank: int, client=None) -> None:
    """Start writing the timeline to `path` (worker 0 only, as Horovod; every
    worker to its own file if the path contains `{rank}`), and with `client`
    (a `_core.Client`) its chunks to `chunk_path(path)`."""
    global _active, _chunks
    if not path:
        raise ValueError("start_timeline needs a file path")
    if "{rank}" in path:
        path = path.replace("{rank}", str(rank))
    elif rank != 0:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with _lock:
        if _active is not None:
            _active.close()
        _active = Timeline(path, rank)
        if client is not None:
            client.start_timeline(chunk_path(path))
        _chunks = client


def stop() -> None:
    global _active, _chunks
    with _lock:
        t, _active = _active, None
        c, _chunks = _chunks, None
    if t is not None:
        t.close()
    if c is not None:
        c.stop_timeline()


def active() -> Timeline | None:
    return _active


def read(path: str) -> list[dict]:
    """The events of a timeline file (closed or not: a worker that died
    leaves the array unterminated)."""
    with open(path, encoding="utf-8") as f:
        text = f.read().strip()
    if not text.endswith("]"):
        text = text.rstrip(",") + "]"
    events = json.loads(text)
    if not isinstance(events, list):
        raise ValueError(f"{path}: not a timeline (a JSON array of trace events)")
    return events


def merge(paths: list[str]) -> list[dict]:
    """The events of several workers' timelines on one clock: each file's
    times are shifted by its start's wall-clock time (its `clock` event)
    relative to the earliest start."""
    files = []
    for p in paths:
        events = read(p)
        clock = next((e for e in events if e.get("ph") == "M" and e.get("name") == "clock"), None)
        if clock is None:
            raise ValueError(f"{p}: no clock event (written by a gradhub older than `timeline merge`)")
        files.append((float(clock["args"]["unix_us"]), events))
    t0 = min(start for start, _ in files)
    out = []
    for start, events in files:
        for e in events:
            if "ts" in e:
                e = dict(e, ts=round(e["ts"] + start - t0, 1))
            out.append(e)
    return out
