"""The gradhub backend's Work objects (`Work` over an `_Op`, its future),
the watchdog that fails pending operations on a job failure or the group's
timeout, the error type, and the helper thread of multi-round collectives."""

from __future__ import annotations

import datetime
import heapq
import itertools
import threading
import time
import weakref

import torch
import torch.distributed as dist
from torch.futures import Future

from ... import api as _api
from ..exit_gate import exit_gate
from .job import explain


class GradhubBackendError(dist.DistBackendError):
    """A collective of the gradhub backend failed: a peer was lost (named),
    the job failed, or the group's timeout passed."""


def _unsupported(what: str, hint: str = "") -> RuntimeError:
    return RuntimeError(f"the gradhub torch.distributed backend does not support {what}"
                        + (f": {hint}" if hint else ""))


class _Op:
    """A collective in flight: completed once, with its output tensors or
    an error, from a completion callback, the watchdog or a helper thread.
    Its torch future is made when first asked for (DDP asks; FSDP2 and a
    plain `wait()` do not, and making one costs about 8 µs a call)."""

    __slots__ = ("what", "outputs", "_latch", "_released", "_settled", "_error", "_raw", "_future", "_lock",
                 "_cuda", "_finished", "source", "on_failure", "__weakref__")

    def __init__(self, what: str, outputs: list[torch.Tensor]):
        self.what = what
        self.outputs = outputs
        # Held until the operation has completed: a waiter takes it and hands
        # it on (a lock is cheaper to make than an Event, and one is made a call).
        self._latch = threading.Lock()
        self._latch.acquire()
        self._released = False    # completed: waiters go
        self._settled = False     # finish() found no future: one made later is completed as it is made
        self._error: BaseException | None = None
        self._finished = False
        self.source = -1          # a receive from any member: who sent
        self.on_failure = None    # run once if it fails (a receive withdraws itself)
        self._lock = threading.Lock()
        self._cuda = sorted({t.device for t in outputs if t.device.type == "cuda"}, key=str) if outputs else []
        self._raw: Future | None = None
        self._future: Future | None = None

    @property
    def future(self) -> Future:
        """torch's future of this operation (made now, if not yet)."""
        with self._lock:
            if self._future is not None:
                return self._future
            # A failure reaches the future's C++ side (DDP's reducer raises it) through
            # a callback that raises: torch's Python set_exception alone does not.
            raw = self._raw = Future(devices=self._cuda) if self._cuda else Future()
            self._future = raw.then(_unwrap)
            settled = self._settled
        if settled:
            raw.set_result(self._outcome())
        return self._future

    def _outcome(self) -> tuple:
        return (None, self.outputs) if self._error is None else (self._error, None)

    def finish(self, error: BaseException | None = None) -> None:
        with self._lock:
            if self._finished:
                return
            self._finished = True
            self._error = error
        if error is not None and self.on_failure is not None:
            self.on_failure()
        if not exit_gate.enter():
            self._release()   # (the interpreter is ending: its future is left alone)
            return
        try:
            if error is None:
                for d in self._cuda:  # the copies back from the host stage are done before anyone reads
                    torch.cuda.current_stream(d).synchronize()
            with self._lock:
                raw, self._settled = self._raw, True
            if raw is not None:
                raw.set_result(self._outcome())
        finally:
            exit_gate.leave()
            self._release()  # after the future: a Work waited for is completed, its future too

    def _release(self) -> None:
        self._released = True
        self._latch.release()

    def done(self) -> bool:
        return self._released

    def wait(self, timeout: float | None) -> None:
        if not self._released:
            if self._latch.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
                self._latch.release()   # for the next waiter
            else:
                # Given up on, as torch's backends do: failed for good (a receive withdraws itself).
                self.finish(GradhubBackendError(f"gradhub: {self.what} did not complete within {timeout:g} s"))
                self.wait(None)   # (released by that finish, or by one that came first)
        if self._error is not None:
            raise self._error


def _unwrap(fut):
    error, outputs = fut.value()
    if error is not None:
        raise error
    return outputs


class Work(dist.Work):
    """torch's Work for a gradhub collective."""

    def __init__(self, op: _Op, timeout: float):
        super().__init__()
        self._op = op
        self._timeout = timeout

    def wait(self, timeout=None) -> bool:
        t = self._timeout
        if isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0:
            t = timeout.total_seconds()
        self._op.wait(t)
        return True

    def is_completed(self) -> bool:
        return self._op.done()

    def is_success(self) -> bool:
        return self._op.done() and self._op._error is None

    def exception(self):
        return self._op._error

    def get_future(self):
        return self._op.future

    def result(self):
        return self._op.outputs

    def _source_rank(self) -> int:
        """The sender of a receive from any member (after wait)."""
        return self._op.source

    def source_rank(self) -> int:
        return self._op.source

    def synchronize(self) -> None:
        self._op.wait(self._timeout)


# A failed job fails the pending operations of every group, and so does the
# group's timeout: one watchdog thread for the process.
class _Watchdog:
    def __init__(self):
        self._cv = threading.Condition()
        self._heap: list = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def add(self, op: _Op, timeout: float, own: bool = False) -> None:
        """Fail `op` if it is not done within `timeout` seconds: the group's
        timeout, or (`own`) the call's (`barrier(timeout=)`), reported in
        gloo's words, which torch's tests match."""
        with self._cv:
            entry = (_now() + timeout, next(self._seq), weakref.ref(op), timeout, own)
            heapq.heappush(self._heap, entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="gradhub-dist-watchdog", daemon=True)
                self._thread.start()
            if self._heap[0] is entry:   # (a later deadline than the one it waits for: no need to wake it)
                self._cv.notify()

    def _run(self) -> None:
        while True:
            pending, err = [], None
            with self._cv:
                while self._heap and (self._heap[0][2]() is None or self._heap[0][2]().done()):
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cv.wait(1.0)
                    continue
                failure = _api.job_failure()
                deadline, _, ref, timeout, own = self._heap[0]
                if failure is not None:
                    pending = [entry[2]() for entry in self._heap]
                    self._heap.clear()
                    err = GradhubBackendError(explain(f"gradhub: the job failed: {failure}"))
                elif deadline <= _now():
                    heapq.heappop(self._heap)
                    pending = [ref()]
                    why = f"Timed out waiting {timeout * 1e3:g}ms (the call's timeout)" if own else \
                        f"did not complete within the group's timeout ({timeout:g} s)"
                    err = GradhubBackendError(f"gradhub: {pending[0].what if pending[0] else 'a collective'} {why}")
                else:
                    self._cv.wait(min(deadline - _now(), 0.5))
                    continue
            for op in pending:
                if op is not None and not op.done():
                    op.finish(err)


def _now() -> float:
    return time.monotonic()


_watchdog = _Watchdog()


def _failure(what: str, e: BaseException) -> BaseException:
    if isinstance(e, dist.DistBackendError):
        return e
    if isinstance(e, _api.GradhubError):
        err = GradhubBackendError(explain(f"gradhub: {what} failed: {e}"))
    else:
        err = GradhubBackendError(f"gradhub: {what} failed: {type(e).__name__}: {e}")
    err.__cause__ = e
    return err



def _all_of(works: list[Work], outputs: list[torch.Tensor], what: str, backend) -> Work:
    op = backend._op(what, outputs)
    left = [len(works)]
    lock = threading.Lock()

    def one(w):
        if w._op._error is not None:  # (set before its future completes, which calls this)
            op.finish(w._op._error)
            return
        with lock:
            left[0] -= 1
            if left[0]:
                return
        op.finish()

    if not works:
        op.finish()
    for w in works:
        w._op.future.add_done_callback(lambda _f, w=w: one(w))
    return Work(op, backend._timeout)


class _Helper:
    """One thread per group for collectives of several rounds, run in call order."""

    def __init__(self, name: str = "gradhub-dist-helper", maxsize: int = 0):
        import queue

        self._q: queue.Queue = queue.Queue(maxsize=maxsize)
        self._t = threading.Thread(target=self._run, name=name, daemon=True)
        self._t.start()

    def submit(self, fn) -> None:
        self._q.put(fn)

    def stop(self) -> None:
        self._q.put(None)

    def _run(self) -> None:
        while True:
            fn = self._q.get()
            if fn is None or not exit_gate.enter():
                return
            try:
                fn()
            finally:
                exit_gate.leave()
