"""CUDA-only: the torch local stage's copies for CUDA tensors, and its NCCL
groups. Everything here needs a GPU (tests/test_gpu.py runs it under CUDA;
`copies` is the CPU twin every other test runs).

- Copies run on one side stream per device, ordered after the gradient's
  producer by an event recorded on the caller's stream, never by a
  device-wide synchronize. Only the stage's own threads block, on the copy's
  event (the core reads the host buffer next); the autograd thread never
  waits for a copy.
- Host buffers are pinned, one per tensor or bucket name, allocated once and
  reused (`copies.HostBuffers`).
- The result's copy back is asynchronous: the all-gather (NCCL, which waits
  on the issuing thread's current stream) is ordered after it by an event,
  and `synchronize()`, `step()` and the DDP hook's future make the caller's
  stream wait on the final event (`wait`), not the host.
- 16-bit compression (`Compression.fp16`) casts on the GPU before any copy:
  `sums.start_reduction` compresses the tensor on its device, so the share
  staged here is already 16-bit.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from .copies import HostBuffers, counters, wait_until


def nccl_group(store, rank: int, size: int):
    """A NCCL process group of the host's GPUs (one per worker: each worker
    must have called torch.cuda.set_device(local_rank) before init)."""
    return dist.ProcessGroupNCCL(store, rank, size)


class CudaCopies:
    """`copies.CpuCopies`'s calls for CUDA tensors."""

    def __init__(self):
        self.buffers = HostBuffers(pinned=True)
        self._streams: dict[int, torch.cuda.Stream] = {}
        # The copy back out of a host buffer still in flight: the next round's
        # copy in (which first zeroes the buffer) waits for it.
        self._reading: dict[int, torch.cuda.Event] = {}
        self._lock = threading.Lock()

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        with self._lock:
            s = self._streams.get(device.index)
            if s is None:
                s = self._streams[device.index] = torch.cuda.Stream(device=device)
            return s

    def to_host(self, share: torch.Tensor, host: torch.Tensor, start: int, check=None) -> None:
        dev = share.device
        stop = start + share.numel()
        prev = self._reading.pop(id(host), None)
        if prev is not None:
            prev.synchronize()
        host[:start].zero_()
        host[stop:].zero_()
        side = self._stream(dev)
        with torch.cuda.device(dev):
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(dev))  # after the reduce-scatter this thread waited for
            side.wait_event(ready)
            with torch.cuda.stream(side):
                host[start:stop].copy_(share, non_blocking=True)
                done = torch.cuda.Event()
                done.record(side)
            share.record_stream(side)
        # This stage thread only waits (the core reads the buffer next), and
        # not for ever: the copy follows the host's reduce-scatter, which a
        # lost host mate never finishes; `check()` ends the wait then.
        if check is None:
            done.synchronize()
        else:
            wait_until(done.query, check)
        counters.add(d2h=share.numel() * share.element_size())

    def from_host(self, host: torch.Tensor, start: int, share: torch.Tensor) -> None:
        dev = share.device
        side = self._stream(dev)
        with torch.cuda.device(dev):
            side.wait_stream(torch.cuda.current_stream(dev))  # the share's last reader (the previous all-gather)
            with torch.cuda.stream(side):
                share.copy_(host[start:start + share.numel()], non_blocking=True)
                done = torch.cuda.Event()
                done.record(side)
            torch.cuda.current_stream(dev).wait_event(done)  # the all-gather comes after the copy
        self._reading[id(host)] = done
        counters.add(h2d=share.numel() * share.element_size())

    def record(self, t: torch.Tensor) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(t.device))
        return ev

    def wait(self, marker) -> None:
        if marker is not None:
            torch.cuda.current_stream().wait_event(marker)
