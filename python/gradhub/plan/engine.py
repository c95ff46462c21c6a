"""The discrete-event engine under both simulators: a clock, an event heap,
and resources (links, CPU threads, compute) that serve one job per unit at a
time from a priority queue, accounting their busy time."""

from __future__ import annotations

import heapq
from typing import Any, Callable


class Resource:
    __slots__ = ("name", "units", "free", "queue", "busy")

    def __init__(self, name: str, units: int = 1):
        self.name, self.units, self.free = name, max(1, units), max(1, units)
        self.queue: list = []     # (key, seq, duration, callback, args)
        self.busy = 0.0           # unit-seconds served


class Engine:
    def __init__(self):
        self.now = 0.0
        self._events: list = []
        self._seq = 0
        self.events = 0

    def at(self, t: float, fn: Callable, *args: Any) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, fn, args))

    def use(self, res: Resource, key, duration: float, fn: Callable, *args: Any) -> None:
        """Serve `duration` on `res` (lowest key first among waiting jobs;
        equal keys first come, first served), then call fn(*args)."""
        if duration <= 0:
            fn(*args)
            return
        self._seq += 1
        if res.free > 0:
            res.free -= 1
            self._start(res, duration, fn, args)
        else:
            heapq.heappush(res.queue, (key, self._seq, duration, fn, args))

    def _start(self, res: Resource, duration: float, fn: Callable, args: tuple) -> None:
        res.busy += duration
        self.at(self.now + duration, self._finish, res, fn, args)

    def _finish(self, res: Resource, fn: Callable, args: tuple) -> None:
        if res.queue:
            _, _, d, f, a = heapq.heappop(res.queue)
            self._start(res, d, f, a)
        else:
            res.free += 1
        fn(*args)

    def run(self, until: float = float("inf")) -> None:
        ev = self._events
        while ev and ev[0][0] <= until:
            t, _, fn, args = heapq.heappop(ev)
            self.now = t
            self.events += 1
            fn(*args)
