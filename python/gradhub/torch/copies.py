"""The torch local stage's copy layer: moves a worker's share of a tensor
between its device and the host buffer the core sums, and counts the bytes.

One host buffer per operation name, the size of the whole tensor, allocated
once and reused every step (pinned for CUDA). The core sums the whole
buffer under the tensor's name (every worker pushes every tensor), but only
this worker's share is ever copied in: the rest is zeros, which the core
pushes as a header only (`live`). After the round the buffer holds the whole
sum; only the share is copied back (the host's workers all-gather the rest
on their devices).

CPU tensors take the same calls (a plain CPU buffer, `Tensor.copy_`), so the
byte counts the tests check are the ones a GPU would move; CUDA tensors go
through `cuda_copies` (side stream, events, pinned memory).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import torch


class Counters:
    """Bytes this worker copied device->host (`d2h`) and host->device (`h2d`)
    through the local stage, since the process started (a test reads them
    before and after a step)."""

    __slots__ = ("d2h", "h2d", "_lock")

    def __init__(self):
        self.d2h = 0
        self.h2d = 0
        self._lock = threading.Lock()

    def add(self, d2h: int = 0, h2d: int = 0) -> None:
        with self._lock:  # once per share and direction: not per chunk
            self.d2h += d2h
            self.h2d += h2d

    def snapshot(self) -> tuple[int, int]:
        with self._lock:
            return self.d2h, self.h2d


counters = Counters()


def wait_until(done: Callable[[], bool], check: Callable[[], None], every: float = 0.05) -> None:
    """Poll `done()` with naps growing to 1 ms (a quick collective or copy
    costs microseconds, a long one a thousand cheap wake-ups a second),
    calling `check()`, which raises to give up, every `every` seconds."""
    nap, since = 2e-5, time.monotonic()
    while not done():
        time.sleep(nap)
        nap = min(nap * 2, 1e-3)
        if time.monotonic() - since >= every:
            check()
            since = time.monotonic()


class HostBuffers:
    """Host buffers by operation name (reused while the size and dtype stay;
    a name that changes shape gets a new one)."""

    def __init__(self, pinned: bool = False):
        self._pinned = pinned
        self._bufs: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    def get(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        with self._lock:
            b = self._bufs.get(name)
            if b is None or b.numel() != numel or b.dtype != dtype:
                b = torch.zeros(numel, dtype=dtype, pin_memory=self._pinned)
                self._bufs[name] = b
            return b

    def drop(self, name: str) -> None:
        """A generated (one-round) name: its buffer is not reused."""
        with self._lock:
            self._bufs.pop(name, None)


class CpuCopies:
    """The copies for CPU tensors: synchronous `copy_`s, counted."""

    def __init__(self):
        self.buffers = HostBuffers(pinned=False)

    def to_host(self, share: torch.Tensor, host: torch.Tensor, start: int, check=None) -> None:
        """Copy `share` into `host` at `start`; zero the rest of `host` (the
        previous round's result). `check()` raises if the wait for the copy
        must end (the job failed): on CPU the copy is done on return."""
        stop = start + share.numel()
        host[:start].zero_()
        host[stop:].zero_()
        host[start:stop].copy_(share)
        counters.add(d2h=share.numel() * share.element_size())

    def from_host(self, host: torch.Tensor, start: int, share: torch.Tensor) -> None:
        """Copy the result's share back."""
        share.copy_(host[start:start + share.numel()])
        counters.add(h2d=share.numel() * share.element_size())

    def record(self, t: torch.Tensor):
        """A marker of the work queued so far on `t` (a CUDA event); on CPU
        the work is done when the call returns: none."""
        return None

    def wait(self, marker) -> None:
        """The caller's work after this waits for `marker`: nothing on CPU."""
