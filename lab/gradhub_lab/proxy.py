"""A fault-injecting TCP proxy, for tests and the fault campaign.

It sits between two members of a job on loopback, listening on one address
and forwarding each connection it accepts to a target, both ways, and lets
a test, from any thread while traffic flows: flip() one byte of a stream at
an exact offset; reset() every connection on both sides with an RST; go
down() (read and forward nothing, so the senders' buffers fill and they
block, as on a dead link) or blackhole() (read and discard everything), and
come back up(); hold() the connections of one worker rank only and
release() them; or cut() one rank off (a host partitioned from this server
but not from the others): its connections are reset and every new one is
reset as soon as its DataHello names the rank, until restore(). A
connection's rank is the one its DataHello names (its header is in clear
even on an encrypted connection). Typical use: a server binds 127.0.0.1:P and advertises
127.0.0.2; the proxy listens on 127.0.0.2:P and forwards to 127.0.0.1:P.

One thread does all the I/O, on non-blocking sockets under poll(), holding
a lock that the public methods take to change state, so once down() returns
not one more byte is read or forwarded. Bounded everywhere: `max_pairs`
connections (past that a new one is closed at once), a 64 KiB buffer per
direction per connection, 64 pending flips, the last 10,000 events.

By hand: python -m gradhub_lab.proxy --listen 127.0.0.2:P --target 127.0.0.1:P
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import errno
import os
import select
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

BUF = 64 * 1024
MAX_FLIPS = 64
DIRS = ("up", "down")  # up: from the connecting side to the target; down: back
_IN, _OUT = select.POLLIN, select.POLLOUT
_BAD = select.POLLERR | select.POLLHUP | select.POLLNVAL


@dataclass
class _Flip:
    after: int
    mask: int
    base: dict[int, int]  # pair id -> bytes it had forwarded when flip() was called
    first_new: int  # pairs with this id or above came later: counted from their first byte


class _Pair:
    def __init__(self, pid: int, client: socket.socket, peer: str) -> None:
        self.id, self.client, self.peer = pid, client, peer
        self.target: socket.socket | None = None  # dialled only while up
        self.connecting = False
        self.deadline = 0.0  # of the connect in progress
        self.closed = False
        self.buf = {d: bytearray() for d in DIRS}  # read, not yet forwarded
        self.sent = {d: 0 for d in DIRS}
        self.eof = {d: False for d in DIRS}  # the source sent its FIN
        self.shut = {d: False for d in DIRS}  # and it was passed on
        self.rank: int | None = None  # the worker rank its DataHello named
        self.scan = bytearray()  # the first bytes up, until the DataHello (or past any)
        self.scanning = True
        self.frozen = False  # forwards nothing more, for good (`Proxy.freeze`)

    def note_up(self, data: bytes) -> None:
        """Find the worker rank in the first frames up: AuthHello, AuthProof
        (each a 40-byte header and its payload), then the DataHello's header."""
        if not self.scanning:
            return
        self.scan += data
        at = 0
        for want in (11, 13, 1):  # AuthHello, AuthProof, DataHello
            if len(self.scan) < at + 40:
                return
            if self.scan[at + 3] != want:
                break
            if want == 1:
                self.rank = int.from_bytes(self.scan[at + 12:at + 16], "little")
                break
            at += 40 + int.from_bytes(self.scan[at + 28:at + 32], "little")
        self.scanning = False
        self.scan = bytearray()

    def ends(self, d: str) -> tuple[socket.socket | None, socket.socket | None]:
        return (self.client, self.target) if d == "up" else (self.target, self.client)

    def usable(self, s: socket.socket | None) -> bool:
        return s is not None and not (s is self.target and self.connecting)


class Proxy:
    """Forwards (listen_host, listen_port) to (target_host, target_port) from
    construction until close(); listen_port 0 takes an ephemeral port (see
    `listen_port`). `log`, if given, gets every event as it happens, from the
    proxy's thread with its lock held: it must be quick and not call back."""

    def __init__(self, listen_host: str, listen_port: int, target_host: str, target_port: int, *,
                 max_pairs: int = 256, connect_timeout: float = 5.0,
                 log: Callable[[str], None] | None = None) -> None:
        self.max_pairs, self.connect_timeout, self._log = max_pairs, connect_timeout, log
        self._family, _, _, _, self._target = socket.getaddrinfo(target_host, target_port,
                                                                 type=socket.SOCK_STREAM)[0]
        self._listener = socket.create_server(
            (listen_host, listen_port), backlog=128, family=socket.AF_INET6 if ":" in listen_host else socket.AF_INET)
        self.listen_port: int = self._listener.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        for s in (self._listener, self._wake_r, self._wake_w):
            s.setblocking(False)
        self._lock = threading.Lock()
        self._mode = "up"  # up, down or blackhole
        self._held: set[int] = set()  # worker ranks whose connections are held (`hold`)
        self._cut: set[int] = set()  # worker ranks whose connections are reset (`cut`)
        self._closing = False
        self._pairs: dict[int, _Pair] = {}
        self._next_id = 0
        self._flips: dict[str, list[_Flip]] = {d: [] for d in DIRS}
        self._events: collections.deque[str] = collections.deque(maxlen=10_000)
        self._t0 = time.monotonic()
        self.bytes_up = self.bytes_down = self.bytes_discarded = 0
        self.accepted = self.rejected = self.flips_done = 0
        self._event(f"forwarding {listen_host}:{self.listen_port} -> {target_host}:{target_port}")
        self._thread = threading.Thread(target=self._run, name=f"gradhub-proxy-{self.listen_port}", daemon=True)
        self._thread.start()

    def flip(self, direction: str, after: int = 0, mask: int = 0x01) -> None:
        """XOR `mask` into the byte `after` bytes past the next one forwarded
        in `direction`, on whichever connection gets that far first."""
        if direction not in DIRS or after < 0 or not 0 < mask < 256:
            raise ValueError(f"flip({direction!r}, after={after}, mask={mask})")
        with self._lock:
            if len(self._flips[direction]) >= MAX_FLIPS:
                raise RuntimeError(f"more than {MAX_FLIPS} flips pending")
            base = {p.id: p.sent[direction] for p in self._pairs.values()}
            self._flips[direction].append(_Flip(after, mask, base, self._next_id))
            self._event(f"flip {direction} after {after} mask {mask:#04x}")

    def reset(self) -> None:
        """Abort every connection, both sides, with an RST."""
        with self._lock:
            self._event(f"reset {len(self._pairs)} pairs")
            for p in list(self._pairs.values()):
                self._drop(p, "reset", abort=True)
        # The thread's poll() holds the sockets until it returns: wake it so the RSTs go now.
        self._wake()

    def down(self) -> None:
        """Stop reading and forwarding, both ways, and dialling new connections."""
        self._set_mode("down")

    def blackhole(self) -> None:
        """Read and discard everything, both ways (what is in flight is lost)."""
        self._set_mode("blackhole")

    def up(self) -> None:
        """Forward again, everything held first."""
        self._set_mode("up")

    def hold(self, rank: int) -> None:
        """As down(), for the connections of worker `rank` only (theirs from
        their DataHello on, a new one's too once it says it)."""
        with self._lock:
            self._held.add(rank)
            self._event(f"hold rank {rank}")
        self._wake()

    def release(self, rank: int) -> None:
        """Forward worker `rank`'s connections again."""
        with self._lock:
            self._held.discard(rank)
            self._event(f"release rank {rank}")
        self._wake()

    def cut(self, rank: int) -> None:
        """Reset worker `rank`'s connections, and each new one as soon as its
        DataHello names it, until restore()."""
        with self._lock:
            self._cut.add(rank)
            cut = [p for p in self._pairs.values() if p.rank == rank]
            self._event(f"cut rank {rank}: resetting {len(cut)} pairs")
            for p in cut:
                self._drop(p, "cut", abort=True)
        self._wake()

    def restore(self, rank: int) -> None:
        """Let worker `rank`'s connections through again."""
        with self._lock:
            self._cut.discard(rank)
            self._event(f"restore rank {rank}")
        self._wake()

    def freeze(self) -> None:
        """The connections open now forward nothing more, either way, for
        good, and are never closed (a flow a middlebox lost, while both ends
        live); new connections go through."""
        with self._lock:
            for p in self._pairs.values():
                p.frozen = True
            self._event(f"freeze {len(self._pairs)} pairs")
        self._wake()

    def _stopped(self, p: _Pair) -> bool:
        return self._mode == "down" or p.frozen or (p.rank is not None and p.rank in self._held)

    @property
    def events(self) -> list[str]:
        with self._lock:
            return list(self._events)

    @property
    def connections(self) -> int:
        """Connection pairs open now."""
        with self._lock:
            return len(self._pairs)

    def close(self) -> None:
        """Stop listening, close every pair and join the thread (5 s at most)."""
        with self._lock:
            self._closing = True
        self._wake()
        if self._thread is not threading.current_thread():
            self._thread.join(5.0)

    def __enter__(self) -> Proxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _set_mode(self, mode: str) -> None:
        with self._lock:
            if mode == "blackhole":
                for p in self._pairs.values():
                    for d in DIRS:
                        self.bytes_discarded += len(p.buf[d])
                        p.buf[d].clear()
            self._mode = mode
            self._event(mode)
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full (a wake is pending anyway) or closed
            self._wake_w.send(b"\0")

    def _event(self, what: str) -> None:
        line = f"{time.monotonic() - self._t0:8.3f} {what}"
        self._events.append(line)
        if self._log:
            self._log(line)

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._closing:
                        return
                    self._tend()
                    snap, timeout = self._interests()
                poller = select.poll()
                for fd, (ev, _, _) in snap.items():
                    poller.register(fd, ev)
                ready = poller.poll(timeout)
                with self._lock:
                    if self._closing:
                        return
                    for fd, rev in ready:
                        self._handle(*snap[fd], rev)
        except Exception as e:  # recorded, then everything is closed below
            with self._lock:
                self._event(f"proxy thread failed: {e!r}")
        finally:
            with self._lock:
                for p in list(self._pairs.values()):
                    self._drop(p, "proxy closed", abort=False)
                self._event("closed")
            for s in (self._listener, self._wake_r, self._wake_w):
                s.close()

    def _interests(self) -> tuple[dict[int, tuple[int, socket.socket, _Pair | None]], int]:
        """What to poll for now: fd -> (events, socket, pair), and the poll timeout (ms)."""
        ev: dict[socket.socket, int] = collections.defaultdict(int)
        owner: dict[socket.socket, _Pair] = {}
        timeout = 1.0
        for p in self._pairs.values():
            owner[p.client] = p
            if p.target is not None:
                owner[p.target] = p
            if p.connecting:
                ev[p.target] |= _OUT
                timeout = min(timeout, max(0.0, p.deadline - time.monotonic()))
            if self._stopped(p):
                continue  # not even reading: that is what makes the senders block
            for d in DIRS:
                src, dst = p.ends(d)
                if self._mode == "blackhole":
                    if p.usable(src) and not p.eof[d]:
                        ev[src] |= _IN
                elif p.usable(src) and p.usable(dst):
                    if p.buf[d]:
                        ev[dst] |= _OUT
                    if len(p.buf[d]) < BUF and not p.eof[d]:
                        ev[src] |= _IN
        snap = {self._wake_r.fileno(): (_IN, self._wake_r, None), self._listener.fileno(): (_IN, self._listener, None)}
        snap.update({s.fileno(): (e, s, owner[s]) for s, e in ev.items() if e})
        return snap, int(timeout * 1000) + 1

    def _tend(self) -> None:
        """Dial, time out connects, pass FINs on, retire finished pairs."""
        now = time.monotonic()
        for p in list(self._pairs.values()):
            if p.target is None:
                if self._mode == "up":
                    self._dial(p)
                continue
            if p.connecting:
                if now > p.deadline:
                    self._drop(p, "connect to target timed out", abort=False)
                continue
            for d in DIRS:
                if self._mode == "up" and p.eof[d] and not p.buf[d] and not p.shut[d]:
                    try:
                        p.ends(d)[1].shutdown(socket.SHUT_WR)
                    except OSError as e:
                        self._drop(p, f"shutdown {d}: {e}", abort=True)
                        break
                    p.shut[d] = True
            if not p.closed and all(p.shut.values()):
                self._drop(p, "done", abort=False)

    def _dial(self, p: _Pair) -> None:
        t = socket.socket(self._family, socket.SOCK_STREAM)
        t.setblocking(False)
        t.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        err = t.connect_ex(self._target)
        if err not in (0, errno.EINPROGRESS):
            t.close()
            self._drop(p, f"connect to target: {os.strerror(err)}", abort=False)
            return
        p.target, p.connecting, p.deadline = t, err != 0, time.monotonic() + self.connect_timeout

    def _handle(self, ev: int, s: socket.socket, p: _Pair | None, rev: int) -> None:
        if s is self._wake_r:
            with contextlib.suppress(BlockingIOError):
                s.recv(4096)  # any left wake the next poll at once: harmless
        elif s is self._listener:
            self._accept()
        elif p is None or p.closed:
            return  # reset() since the poll began
        elif p.connecting and s is p.target:
            err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:  # refused: the client side is closed
                self._drop(p, f"connect to target: {os.strerror(err)}", abort=False)
            else:
                p.connecting = False
        elif not self._stopped(p):  # down() or hold() since the poll began: leave it all where it is
            for d in DIRS:
                src, dst = p.ends(d)
                if s is src and ev & _IN and rev & (_IN | _BAD) and not p.closed:
                    self._read(p, d)
                if s is dst and ev & _OUT and rev & (_OUT | _BAD) and not p.closed:
                    self._write(p, d)

    def _accept(self) -> None:
        for _ in range(64):  # a burst at a time, so the pairs are served in between
            try:
                c, addr = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as e:  # EMFILE and the like: leave them in the backlog
                self._event(f"accept: {e}")
                return
            peer = f"{addr[0]}:{addr[1]}"
            if len(self._pairs) >= self.max_pairs:
                self.rejected += 1  # counted first: a test may see the close at once
                self._event(f"rejected {peer}: {self.max_pairs} pairs open")
                c.close()
                continue
            c.setblocking(False)
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            p = _Pair(self._next_id, c, peer)
            self._next_id += 1
            self._pairs[p.id] = p
            self.accepted += 1
            self._event(f"pair {p.id}: accepted {peer}")

    def _read(self, p: _Pair, d: str) -> None:
        src = p.ends(d)[0]
        blackhole = self._mode == "blackhole"
        room = BUF if blackhole else BUF - len(p.buf[d])
        if room <= 0:  # recv(0) would read as an EOF
            return
        data = self._attempt(p, f"{d}: recv", lambda: src.recv(room))
        if data is None:
            return
        if not data:
            p.eof[d] = True
            self._event(f"pair {p.id}: end of stream {d}")
        elif blackhole:
            self.bytes_discarded += len(data)
        else:
            p.buf[d] += data
            if d == "up":
                p.note_up(data)
                if p.rank is not None and p.rank in self._cut:
                    self._drop(p, f"rank {p.rank} is cut off", abort=True)
                    return
                if self._stopped(p):
                    return  # its DataHello just said it is held: nothing more goes
            self._write(p, d)  # at once, rather than after another poll

    def _write(self, p: _Pair, d: str) -> None:
        buf, dst = p.buf[d], p.ends(d)[1]
        if not buf or not p.usable(dst):
            return
        self._apply_flips(p, d)
        n = self._attempt(p, f"{d}: send", lambda: dst.send(buf))
        if n is None:
            return
        del buf[:n]
        p.sent[d] += n
        if d == "up":
            self.bytes_up += n
        else:
            self.bytes_down += n

    def _attempt(self, p: _Pair, what: str, op):
        """`op()`'s result, or None: it would block, or it failed (the pair
        is dropped, its event naming `what`)."""
        try:
            return op()
        except BlockingIOError:
            return None
        except OSError as e:
            self._drop(p, f"{what}: {e}", abort=True)
            return None

    def _apply_flips(self, p: _Pair, d: str) -> None:
        """Flip the bytes of `p`'s buffer (stream offsets sent .. sent + len) that flips aim at."""
        start, end = p.sent[d], p.sent[d] + len(p.buf[d])
        for f in list(self._flips[d]):
            base = f.base.get(p.id, 0 if p.id >= f.first_new else None)
            if base is not None and start <= base + f.after < end:
                p.buf[d][base + f.after - start] ^= f.mask
                self._flips[d].remove(f)
                self.flips_done += 1
                self._event(f"pair {p.id}: flipped {d} byte {base + f.after} with {f.mask:#04x}")

    def _drop(self, p: _Pair, why: str, abort: bool) -> None:
        p.closed = True
        del self._pairs[p.id]
        for s in (p.client, p.target):
            if s is not None and abort:  # an RST instead of a FIN
                with contextlib.suppress(OSError):
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            if s is not None:
                s.close()
        self._event(f"pair {p.id}: closed ({why})")


def _hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gradhub_lab.proxy", description=(
        "Forward TCP connections from --listen to --target, both ways, until Ctrl-C, printing each event "
        "to stderr. Faults (flip, reset, down, blackhole) are for tests, through gradhub_lab.proxy.Proxy."))
    ap.add_argument("--listen", required=True, type=_hostport, metavar="HOST:PORT",
                    help="where to accept connections, e.g. 127.0.0.2:9000")
    ap.add_argument("--target", required=True, type=_hostport, metavar="HOST:PORT",
                    help="where to forward each one, e.g. 127.0.0.1:9000")
    ap.add_argument("--max-pairs", type=int, default=256, metavar="N",
                    help="connections at once; one more is closed at once (default 256)")
    ap.add_argument("--connect-timeout", type=float, default=5.0, metavar="S",
                    help="seconds to connect to the target (default 5)")
    args = ap.parse_args(argv)
    with Proxy(*args.listen, *args.target, max_pairs=args.max_pairs, connect_timeout=args.connect_timeout,
               log=lambda line: print(line, file=sys.stderr, flush=True)) as proxy:
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)
    print(f"accepted {proxy.accepted}, rejected {proxy.rejected}, bytes up {proxy.bytes_up}, "
          f"down {proxy.bytes_down}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
