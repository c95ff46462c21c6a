"""Point-to-point for the gradhub backend (send, recv, recv from any source;
torch's batch_isend_irecv and the pipeline schedules are built on them):
one group's links (`gradhub.api.PeerLinks`, the core's `peer` module),
opened at the group's first point-to-point call. Each member listens and
publishes its address under the group's keys in torch's store; a send
goes on a thread per destination (in call order, as torch orders a pair's
messages), which looks the address up and writes the message; a receive
is posted to the core at once, in call order, and completes by callback.
CUDA tensors go through host memory."""

from __future__ import annotations

import collections
import datetime
import threading

import torch

from ... import api as _api
from .work import GradhubBackendError, Work, _Helper, _Op, _watchdog

# Sends waiting for one destination's thread before isend blocks.
_SEND_QUEUE = 1024
# Sends at most this large go on the caller's thread when nothing is queued.
_INLINE_BYTES = 256 << 10

# Who sent each recent receive from any member, by the received tensor's memory.
_SOURCES: collections.OrderedDict[int, int] = collections.OrderedDict()
_SOURCES_KEPT = 4096
_sources_lock = threading.Lock()


def _remember_source(t: torch.Tensor, src: int) -> None:
    with _sources_lock:
        _SOURCES[t.data_ptr()] = src
        _SOURCES.move_to_end(t.data_ptr())
        while len(_SOURCES) > _SOURCES_KEPT:
            _SOURCES.popitem(last=False)


def _install_source_rank() -> None:
    """torch hands a Python backend's Work back inside a wrapper of its own
    (`PyWorkHolder`) that forwards wait() and get_future() but not
    sourceRank(), so `dist.recv(t)` (from any member) could not learn who
    sent. Where torch's own answer is that refusal, ask the future, which
    is the backend's: its value is the received tensor, whose sender
    `_remember_source` noted."""
    cls = torch._C._distributed_c10d.Work
    if getattr(cls, "_gradhub_source_rank", False):
        return
    torch_own = cls._source_rank

    def _source_rank(self) -> int:
        try:
            return torch_own(self)
        except RuntimeError:
            try:
                value = self.get_future().value()
            except Exception:  # noqa: BLE001 - not a gradhub receive: torch's refusal stands
                value = None
            for t in value if isinstance(value, list) else []:
                with _sources_lock:
                    src = _SOURCES.get(t.data_ptr()) if isinstance(t, torch.Tensor) else None
                if src is not None:
                    return src
            raise

    cls._source_rank = _source_rank
    cls.source_rank = _source_rank
    cls._gradhub_source_rank = True


def _flat(t: torch.Tensor) -> torch.Tensor:
    """`t` itself if its memory can be used as it is, else a contiguous host copy."""
    if t.device.type == "cpu" and t.is_contiguous():
        return t
    return t.detach().to("cpu").contiguous()


class _Sender(_Helper):
    """One destination's sends, in call order: on a thread of their own, or
    on the caller's when nothing of this destination's is queued (`inline`)."""

    def __init__(self, dst: int):
        self._lock = threading.Lock()
        self._busy = 0   # sends queued or running
        super().__init__(f"gradhub-p2p-send-{dst}", maxsize=_SEND_QUEUE)

    def submit(self, fn) -> None:
        with self._lock:
            self._busy += 1

        def run():
            try:
                fn()
            finally:
                with self._lock:
                    self._busy -= 1

        super().submit(run)

    def inline(self, fn) -> bool:
        """Run `fn` now, on this thread, if nothing is queued before it."""
        with self._lock:
            if self._busy:
                return False
            self._busy += 1
        try:
            fn()
        finally:
            with self._lock:
                self._busy -= 1
        return True


class PointToPoint:
    """One group's point-to-point side, for member `rank` of `size`."""

    def __init__(self, rank: int, size: int, keys, name: str, timeout: float):
        self._rank, self._size = rank, size
        self._keys = keys          # the group's keys in torch's store (None: none)
        self._name = name          # the same on every member of this group, and only there
        self._timeout = timeout
        self._links = None
        self._addrs: dict[int, str] = {}
        self._senders: dict[int, _Sender] = {}
        self._lock = threading.Lock()
        self._closed = False

    def _open(self):
        with self._lock:
            if self._closed:
                raise GradhubBackendError("gradhub: the process group was destroyed")
            if self._links is None:
                if self._keys is None:
                    raise RuntimeError("the gradhub torch.distributed backend does not support point-to-point on a "
                                       "group created without torch's store")
                if not _api.is_initialized():
                    raise GradhubBackendError("gradhub: the process group was destroyed (its gradhub job has ended)")
                self._links = _api.open_peer_links(self._rank, self._size, self._name, self._timeout)
                self._keys.set(f"p2p/{self._rank}", self._links.address)
            return self._links

    def _check_peer(self, peer: int, what: str) -> None:
        if not 0 <= peer < self._size or peer == self._rank:
            raise ValueError(f"gradhub: {what} member {peer} of a group of {self._size} (this is member {self._rank})")

    def _address(self, dst: int) -> str:
        """Member `dst`'s listener, once it has opened its links (on this
        destination's send thread)."""
        a = self._addrs.get(dst)
        if a is None:
            key = f"p2p/{dst}"
            try:
                self._keys.wait([key], datetime.timedelta(seconds=self._timeout))
            except Exception as e:  # noqa: BLE001 - the store's timeout
                raise GradhubBackendError(
                    f"gradhub: member {dst} did not open its point-to-point links within the group's timeout "
                    f"({self._timeout:g} s): it posted no send or receive in this group") from e
            a = self._addrs[dst] = self._keys.get(key).decode()
        return a

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        self._check_peer(dst, "a send to")
        links = self._open()
        data = _flat(tensor)
        op = _Op(f"send to member {dst} (tag {tag})", [])
        _watchdog.add(op, self._timeout)

        def run():
            if op.done():   # (timed out while queued)
                return
            try:
                links.send(dst, self._address(dst), tag, data)
            except Exception as e:  # noqa: BLE001
                op.finish(e if isinstance(e, GradhubBackendError) else GradhubBackendError(str(e)))
                return
            op.finish()

        with self._lock:
            s = self._senders.get(dst)
            if s is None:
                s = self._senders[dst] = _Sender(dst)
        # A small message to a member already reached goes at once (a thread
        # switch fewer: its bytes fit the socket's buffer); others in turn.
        small = data.numel() * data.element_size() <= _INLINE_BYTES and dst in self._addrs
        if not (small and s.inline(run)):
            s.submit(run)
        return Work(op, self._timeout)

    def recv(self, tensor: torch.Tensor, src: int | None, tag: int) -> Work:
        if src is not None:
            self._check_peer(src, "a receive from")
        links = self._open()
        buf = tensor if tensor.device.type == "cpu" and tensor.is_contiguous() else torch.empty(
            tensor.shape, dtype=tensor.dtype, device="cpu")
        who = f"member {src}" if src is not None else "any member"
        op = _Op(f"receive from {who} (tag {tag})", [tensor])

        def done(sender, error):
            if error is not None:
                op.finish(GradhubBackendError(f"gradhub: {op.what}: {error}"))
                return
            try:
                if buf is not tensor:
                    tensor.copy_(buf)
            except Exception as e:  # noqa: BLE001
                op.finish(GradhubBackendError(f"gradhub: {op.what}: {type(e).__name__}: {e}"))
                return
            op.source = sender
            if src is None:
                _remember_source(tensor, sender)
            op.finish()

        ticket = links.post_recv(src, tag, buf, done)
        if ticket is not None:
            # Given up on (the group's timeout, a failed job): withdrawn, so a
            # message that comes later goes to the next receive instead.
            op.on_failure = lambda: links.cancel(ticket)
        _watchdog.add(op, self._timeout)
        return Work(op, self._timeout)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            links, self._links = self._links, None
            senders, self._senders = list(self._senders.values()), {}
        for s in senders:
            s.stop()
        if links is not None:
            links.close("the process group was destroyed")


_install_source_rank()
